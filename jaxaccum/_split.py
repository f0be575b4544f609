"""The batch seen as K microbatches: the split, the weights and the batch-size checks (no copy, no collective).

Microbatch i of K holds rows i, i+K, i+2K, ... of every batch argument: each
leaf of size B on its batch axis is viewed as (B/K, K) there (a free reshape
of a contiguous array), and the loop takes index i on the K axis. A batch
sharded on its batch axis keeps every microbatch evenly sharded. Used by
`ja.microbatch` and by `make_train_step`'s engine.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


def leading_size(batches, name: str = "batch") -> int:
  """The leading (batch) size shared by every leaf of `batches`, or a ValueError naming the leaves.

  Sizes are those of the arrays as given (global shapes, before any shard_map
  splits them), so the message names the user's numbers.
  """
  first: dict[int, str] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(batches):
    where = f"{name}{jax.tree_util.keystr(path)}"
    if jnp.ndim(leaf) == 0:
      raise ValueError(f"{where} is a scalar; every batch leaf needs a leading batch axis")
    first.setdefault(jnp.shape(leaf)[0], where)
  if not first:
    raise ValueError(f"the {name} holds no arrays")
  if len(first) > 1:
    listed = ", ".join(f"{where} has {size} rows" for size, where in sorted(first.items(), reverse=True))
    raise ValueError(f"{name} leaves disagree on their leading (batch) size: {listed}")
  (size,) = first
  if size == 0:
    raise ValueError(f"the {name} is empty ({first[0]} has 0 rows): there is nothing to average")
  return size


def batch_size(batches: tuple, axes: tuple[int, ...], name: str = "batch") -> int:
  """The batch size shared by every batch argument along its batch axis (`leading_size` per argument).

  An axis counts from the end when negative (as `jax.vmap`'s `in_axes`), leaf by
  leaf; one out of range for a leaf is a ValueError naming the argument, the
  leaf and its shape.
  """
  if all(a == 0 for a in axes):
    return leading_size(batches if len(batches) > 1 else batches[0], name)
  sizes = {}
  for j, (b, a) in enumerate(zip(batches, axes, strict=True)):
    for path, x in jax.tree_util.tree_leaves_with_path(b):
      if not -jnp.ndim(x) <= a < jnp.ndim(x):
        raise ValueError(
          f"in_axes={a} is out of range for {name} argument {j}{jax.tree_util.keystr(path)} of shape "
          f"{jnp.shape(x)}: its batch axis must be one of {-jnp.ndim(x)}, ..., {jnp.ndim(x) - 1}"
        )
    moved = jax.tree.map(lambda x, a=a: _BatchAxis(x, a), b)
    sizes[leading_size(moved, f"{name} argument {j}")] = j
  if len(sizes) > 1:
    raise ValueError(f"the batch arguments disagree on their batch size along in_axes: {sorted(sizes)}")
  (size,) = sizes
  return size


class _BatchAxis:
  """A leaf seen with its batch axis first (shape and ndim only), for `leading_size`."""

  def __init__(self, x, axis):
    shape = list(jnp.shape(x))
    self.shape = (shape.pop(axis),) + tuple(shape)
    self.ndim = len(self.shape)


class Split(NamedTuple):
  """The batch arguments of one call viewed as K microbatches, without a copy."""

  views: tuple  # each batch argument, its batch axis a reshaped to (size / K, K) at (a, a + 1)
  axes: tuple[int, ...]  # each batch argument's batch axis
  k: int  # the number of microbatches
  rows: int  # rows per microbatch (size / K)

  def take(self, i) -> tuple:
    """Microbatch i (rows i, i + K, ...) of every batch argument."""
    return tuple(
      jax.tree.map(lambda x, a=a: lax.dynamic_index_in_dim(x, i, axis=_k_axis(a), keepdims=False), v)
      for v, a in zip(self.views, self.axes, strict=True)
    )


def _k_axis(a: int) -> int:
  """Where a view holds the microbatch index for batch axis `a`: after the (size / K) axis, counted from the end
  when `a` is (axis -1 of a leaf becomes (size / K, K) at -2, -1 of its view)."""
  return a + 1 if a >= 0 else a


def split(batches: tuple, axes: tuple[int, ...], k: int, name: str = "batch") -> Split:
  """Views each batch argument as (size / K, K) on its batch axis: a free reshape, rows stay on their devices.

  Row r = j K + i lands at [j, i], so index i on the new axis is microbatch i.
  A negative axis counts from the end of each leaf. A leaf whose batch axis is
  typed as sharded over D devices (an Explicit mesh) needs size / K divisible
  by D (each microbatch keeps the batch's sharding); otherwise a ValueError
  names K, the rows and the devices.
  """
  size = batch_size(batches, axes, name)
  if size % k:
    raise ValueError(f"the {name}'s leading size {size} is not divisible by num_microbatches={k}")

  def view(x, a):
    shape = jnp.shape(x)
    a = a % len(shape)  # in range: batch_size checked it
    _check_rows_per_device(x, a, size, k, name)
    return jnp.reshape(x, shape[:a] + (size // k, k) + shape[a + 1 :])

  views = tuple(jax.tree.map(lambda x, a=a: view(x, a), b) for b, a in zip(batches, axes, strict=True))
  return Split(views, axes, k, size // k)


def _check_rows_per_device(x, a: int, size: int, k: int, name: str) -> None:
  """Refuses, naming K, the rows and the devices, a split whose microbatches cannot keep x's typed sharding.

  Microbatch i holds rows i, i + K, ...: on a batch sharded over D devices of
  an Explicit mesh, its size / K rows are spread as the batch's are, so each
  device holds (size / K) / D of them, which must be whole. JAX's reshape
  would otherwise fail with a ShardingTypeError that names neither.
  """
  sharding = _typed_spec(jax.typeof(x))
  if sharding is None:
    return
  spec = tuple(sharding.spec) + (None,) * (jnp.ndim(x) - len(sharding.spec))
  entry = spec[a]
  names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
  devices = math.prod(sharding.mesh.shape[n] for n in names)
  rows = size // k
  if devices <= 1 or rows % devices == 0:
    return
  per_device = size // devices
  fits = [d for d in range(1, per_device + 1) if per_device % d == 0]
  below = max(d for d in fits if d < k)
  above = [d for d in fits if d > k]
  hint = f"num_microbatches={below}" + (f" or {above[0]}" if above else "")
  axes = names[0] if len(names) == 1 else names
  raise ValueError(
    f"num_microbatches={k} splits the {name}'s {size} rows into microbatches of {rows} rows, but the {name} is "
    f"sharded over the {devices} devices of mesh axis {axes!r} and a microbatch keeps that sharding: {rows} rows "
    f"do not divide among {devices} devices. Use a num_microbatches that divides the {per_device} rows per device "
    f"(e.g. {hint}), or a batch of a multiple of {k * devices} rows."
  )


def _typed_spec(s):
  """The PartitionSpec in `s`'s type over Explicit mesh axes (None when it has none)."""
  sharding = getattr(s, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or not any(e is not None for e in spec):
    return None
  return sharding


def weights(sp: Split, weight_fn, num_real=None) -> jax.Array:
  """The K microbatch weights, from the batch alone: `weight_fn` vectorised over the microbatches."""
  if weight_fn is None:
    ws = jnp.ones((sp.k,), jnp.float32)
  else:

    def one(*mbs):
      w = jnp.asarray(weight_fn(mbs[0] if len(mbs) == 1 else mbs))
      if w.shape != ():
        raise ValueError(f"weight_fn must return a scalar, got shape {w.shape}")
      if not (jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer) or w.dtype == jnp.bool_):
        raise TypeError(f"weight_fn must return a real number, got dtype {w.dtype}")
      return w

    ws = jax.vmap(one, in_axes=tuple(_k_axis(a) for a in sp.axes))(*sp.views)
  if num_real is not None:
    ws = jnp.where(jnp.arange(sp.k) < num_real, ws, jnp.zeros((), ws.dtype))
  return ws
