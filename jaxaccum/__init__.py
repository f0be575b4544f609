"""jaxaccum: exact, cheap gradient accumulation, microbatching and data-parallel averaging.

Public names only; every one lives in the module named after its concept.

`ja.checkpoint` and `ja.flax` are imported on first use (PEP 562): they load orbax-checkpoint and
flax.nnx, which cost more to import than jax and optax together and which a script that neither
checkpoints nor uses Flax never needs.
"""

import importlib
from typing import TYPE_CHECKING

from jaxaccum import _versions, schedules  # noqa: F401  (_versions warns once if this jax is outside the tested range)
from jaxaccum._versions import UntestedJaxWarning
from jaxaccum.accumulate import AccumulateState, accumulate, has_updated
from jaxaccum.distributed import fail_fast
from jaxaccum.hlo import collective_bytes, count_collectives
from jaxaccum.lowcomm import TopK, diloco, local_sgd, stale
from jaxaccum.memory import Buffer, MemoryBreakdown, memory_breakdown
from jaxaccum.microbatch import microbatch, pad_microbatches
from jaxaccum.noise import (
  AdaScaleState,
  NoiseScale,
  NoiseScaleEveryK,
  NoiseScaleState,
  adascale,
  adascale_gain,
  every_k_from_noise_scale,
  noise_scale,
  noise_scale_smooth,
)
from jaxaccum.parallel import data_mesh, pmean, psum, replicate, shard_batch
from jaxaccum.per_example import MicroGradAux, micro_grad, micro_vmap
from jaxaccum.planner import plan_microbatches
from jaxaccum.sharded import shard_train_state
from jaxaccum.slowlink import DiLoCoTrainStep, diloco_train_step
from jaxaccum.train_step import make_train_step

__all__ = [
  "AccumulateState",
  "accumulate",
  "has_updated",
  "grad",
  "value_and_grad",
  "microbatch",
  "pad_microbatches",
  "make_train_step",
  "plan_microbatches",
  "memory_breakdown",
  "MemoryBreakdown",
  "Buffer",
  "shard_train_state",
  "pmean",
  "psum",
  "data_mesh",
  "shard_batch",
  "replicate",
  "local_sgd",
  "diloco",
  "TopK",
  "stale",
  "diloco_train_step",
  "DiLoCoTrainStep",
  "noise_scale",
  "NoiseScale",
  "NoiseScaleState",
  "noise_scale_smooth",
  "adascale",
  "AdaScaleState",
  "adascale_gain",
  "every_k_from_noise_scale",
  "NoiseScaleEveryK",
  "schedules",
  "flax",
  "checkpoint",
  "fail_fast",
  "count_collectives",
  "collective_bytes",
  "micro_grad",
  "micro_vmap",
  "MicroGradAux",
  "UntestedJaxWarning",
]

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("checkpoint", "flax")

if TYPE_CHECKING:  # type checkers and IDEs see the submodules as plain attributes
  from jaxaccum import checkpoint, flax


def __getattr__(name: str):
  if name in _LAZY_SUBMODULES:
    module = importlib.import_module(f"jaxaccum.{name}")  # binds jaxaccum.<name>: later lookups skip this
    globals()[name] = module
    return module
  raise AttributeError(f"module 'jaxaccum' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY_SUBMODULES))


# Your own jit step on an Explicit mesh (issue 19): gradients left unreduced over the data axis.
from jaxaccum.grad import grad, value_and_grad  # noqa: E402  (the function shadows the submodule's name)
