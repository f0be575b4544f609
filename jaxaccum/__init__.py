"""jaxaccum: exact, cheap gradient accumulation, microbatching and data-parallel averaging.

Public names only; every one lives in the module named after its concept.
"""

from jaxaccum.accumulate import AccumulateState
from jaxaccum.accumulate import accumulate
from jaxaccum.accumulate import has_updated
from jaxaccum.lowcomm import diloco
from jaxaccum.lowcomm import local_sgd
from jaxaccum.lowcomm import stale
from jaxaccum.microbatch import microbatch
from jaxaccum.noise import AdaScaleState
from jaxaccum.noise import NoiseScale
from jaxaccum.noise import NoiseScaleEveryK
from jaxaccum.noise import NoiseScaleState
from jaxaccum.noise import adascale
from jaxaccum.noise import adascale_gain
from jaxaccum.noise import every_k_from_noise_scale
from jaxaccum.noise import noise_scale
from jaxaccum.noise import noise_scale_smooth
from jaxaccum.parallel import data_mesh
from jaxaccum.parallel import pmean
from jaxaccum.parallel import psum
from jaxaccum.parallel import replicate
from jaxaccum.parallel import shard_batch
from jaxaccum.planner import plan_microbatches
from jaxaccum.sharded import shard_train_state
from jaxaccum.train_step import make_train_step
from jaxaccum import schedules
from jaxaccum import flax
from jaxaccum import checkpoint

__all__ = [
    "AccumulateState", "accumulate", "has_updated",
    "microbatch", "make_train_step", "plan_microbatches", "shard_train_state",
    "pmean", "psum", "data_mesh", "shard_batch", "replicate",
    "local_sgd", "diloco", "stale",
    "noise_scale", "NoiseScale", "NoiseScaleState", "noise_scale_smooth", "adascale", "AdaScaleState",
    "adascale_gain", "every_k_from_noise_scale", "NoiseScaleEveryK",
    "schedules", "flax", "checkpoint",
]

__version__ = "0.1.0"
