"""`python -m jaxaccum.bench`: see `jaxaccum.bench` for the sections and flags."""

import sys

from jaxaccum.bench import main

sys.exit(main())
