"""The JAX range jaxaccum is tested on, and one warning at import when the running JAX is outside it.

The range is the one `pyproject.toml` declares (read from the installed
package's metadata, so it is written once) and the one `.ci/run` tests: the
oldest Python with the lowest declared versions, the newest Python with the
newest. pip never resolves a JAX outside it; a runtime that brings its own
(Colab's TPU and GPU images, a rented machine's preinstalled jax) keeps it, as
the notebooks' install cell does, and gets this warning instead of a crash.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings

import jax

# Used when jaxaccum runs from a source tree without being installed (no metadata to read).
_DECLARED = ">=0.10.2,<0.13"


class UntestedJaxWarning(UserWarning):
  """The running JAX is outside the range jaxaccum is tested on."""


def _version_tuple(text: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", text)[:4])


def declared_jax_range() -> str:
  """The specifier `pyproject.toml` gives `jax` (e.g. ">=0.10.2,<0.13"), from the installed metadata."""
  try:
    requires = importlib.metadata.requires("jaxaccum") or []
  except importlib.metadata.PackageNotFoundError:
    return _DECLARED
  for req in requires:
    m = re.fullmatch(r"jax\s*(\([^)]*\)|[<>=!~][^;]*)?\s*(;.*)?", req.strip())
    if m and m.group(1):
      clauses = m.group(1).strip("() ").replace(" ", "").split(",")
      return ",".join(sorted(clauses, key=lambda c: not c.startswith(">")))  # metadata may list "<" first
  return _DECLARED


def in_range(version: str, specifier: str) -> bool:
  """Whether `version` satisfies `specifier` (comma-separated `>=`, `>`, `<`, `<=`, `==`, `!=` clauses)."""
  have = _version_tuple(version)
  for clause in filter(None, specifier.split(",")):
    op, bound = re.fullmatch(r"(>=|<=|==|!=|>|<|~=)?(.*)", clause.strip()).groups()  # type: ignore[union-attr]
    want = _version_tuple(bound)
    # Compare on the bound's own precision: "<0.13" excludes 0.13.0 and 0.13.1 alike.
    mine = have[: len(want)] + (0,) * max(0, len(want) - len(have))
    ok = {
      ">=": mine >= want,
      ">": have > want,
      "<": mine < want,
      "<=": mine <= want,
      "==": mine == want,
      "!=": mine != want,
      "~=": mine >= want,
      None: mine == want,
    }[op]
    if not ok:
      return False
  return True


def warn_if_untested() -> bool:
  """Warn once (`UntestedJaxWarning`) when `jax.__version__` is outside the declared range; True if it is."""
  spec = declared_jax_range()
  if in_range(jax.__version__, spec):
    return False
  warnings.warn(
    f"jaxaccum is tested with jax{spec}, and this is jax {jax.__version__}: it may work, but no test has run on it. "
    "Report what breaks; to stay in the tested range, pip install 'jax" + spec + "'.",
    UntestedJaxWarning,
    stacklevel=3,
  )
  return True


warn_if_untested()
