"""The model zoo: small models written as their authors write them, behind one small interface.

Every entry point of jaxaccum is run against every model here by tests/test_zoo.py; the outcome of
each cell (exact against the plain full-batch step, or refused by name) is the matrix in
docs/guides/zoo.md. Each model is TINY (a few hundred parameters) and float64 (except `bf16`).

The interface (`Model`):
  init(key) -> params                          (with has_state: (params, state))
  loss(params, batch) -> scalar                (with has_state: loss(params, state, batch) -> (loss, new_state))
  batch(key, n) -> a dict of arrays with n rows
Randomness (dropout) travels with the rows (`batch["keys"]`, one key per row), so that every way of
splitting the batch draws the same masks and the full-batch step stays the reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Model:
  """One zoo entry.

  Attributes:
    name: the row name in the matrix.
    framework: "linen", "nnx", "equinox" or "jax" (how the model is written).
    what: one line for the docs: the construct this model brings.
    init: `init(key) -> params`, or `(params, state)` with `has_state`.
    loss: the mean loss over the batch's rows (see the module docstring for the signatures).
    batch: `batch(key, n) -> dict` of arrays with a leading axis of n rows.
    has_state: the loss threads model state (BatchNorm statistics).
    grouped: the loss of a union of groups is not the mean of the groups' losses (BatchNorm's batch
      statistics, a clip on the cotangent): the reference is then the mean over the entry point's
      groups (microbatches x devices) of each group's plain gradient, as documented for microbatching.
    weight_fn: `weight_fn(rows) -> scalar` for a masked mean loss (the real rows), else None.
    mesh_axes: extra mesh axes the loss names (the tensor-parallel layer's {"model": 2}).
    explicit: the loss annotates activations with the "data" axis (needs an Explicit mesh context).
    annotates_data: the loss names the "data" axis in sharding annotations on an Auto mesh (needs a mesh context
      with that axis, of size 1 where the entry point has none).
    syncs: the data axis the loss itself reduces over (`lax.pmean`/`psum` inside the model: synchronized
      BatchNorm, a global token count), or None. Such a loss runs only where that axis is bound; its groups are
      each microbatch across the devices that share it, and the reference binds the axis with size 1.
    fresh: called before each use of the model (a module-level `@jax.shard_map` keeps the mesh of its first
      call: each cell reloads its module, as a fresh process would import it), or None.
    rtol, atol: tolerance against the reference (float64: 1e-10; bf16: scaled to bf16).
    linen: for linen models, `(module, variables -> (params, state))`; used by ja.flax.TrainState.
    nnx: for nnx models, `(params -> nnx module, module_loss(module, batch))`; for AccumulatingOptimizer.
  """

  name: str
  framework: str
  what: str
  init: Callable[..., Any]
  loss: Callable[..., Any]
  batch: Callable[..., Any]
  has_state: bool = False
  grouped: bool = False
  weight_fn: Callable[[Any], Any] | None = None
  mesh_axes: tuple[tuple[str, int], ...] = ()
  explicit: bool = False
  annotates_data: bool = False
  rtol: float = 1e-10
  atol: float = 1e-12
  linen: Any = None
  nnx: Any = None
  fresh: Callable[[], Any] | None = None
  syncs: str | None = None


def models() -> list[Model]:
  """Every model of the zoo, in the matrix's row order."""
  from zoo import annotated_models, collective_models, constant_models, eqx_models, flax_models, jax_models

  return [
    *flax_models.MODELS,
    *eqx_models.MODELS,
    *jax_models.MODELS,
    *annotated_models.MODELS,
    *constant_models.MODELS,
    *collective_models.MODELS,
  ]
