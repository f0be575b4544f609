"""Pieces shared by `local_sgd`, `diloco` and `stale`: argument checks, the schedule counter, selects.

Every low-communication transform runs per replica inside `jax.shard_map` or
`jax.pmap` over a replica axis, takes the parameters in `update` and decides
on each call, from a counter in its state, whether this is a sync.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, PartitionSpec

from jaxaccum import parallel


def check_axis_name_arg(axis_name):
  parallel.validate_axis_name(axis_name)
  return axis_name


def check_params(params, name: str):
  if params is None:
    raise ValueError(
      f"{name} averages parameters, so its update needs them: call "
      f"update(grads, state, params) (optax.chain passes params through)"
    )


def local_inner_update(name, inner, axis_name, grads, state, params, extra_args):
  """The start of every low-communication update: check the call, run `inner` on this replica's gradient.

  Returns (axis size, local updates, new inner state).
  """
  check_params(params, name)
  size = parallel.check_axis_name(axis_name)
  parallel.check_varying(grads, axis_name)
  local, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
  return size, local, inner_state


def zeros_like(tree):
  # zeros_like, not zeros(shape): the zeros keep each leaf's sharding (under
  # Explicit mesh axes the two branches of a cond must agree on it).
  return jax.tree.map(jnp.zeros_like, tree)


def select(pred, on_true, on_false):
  # A fused elementwise select rather than returning `on_false` from a cond
  # branch: a freshly computed value passed through a branch is copied by XLA.
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def advance(local_step, sync_count, sync_every):
  """(is_sync, next local_step, next sync_count) after one more inner update."""
  local_step = local_step + 1
  is_sync = local_step >= sync_every
  return (
    is_sync,
    jnp.where(is_sync, jnp.zeros_like(local_step), local_step),
    sync_count + is_sync.astype(sync_count.dtype),
  )


def check_delay(delay):
  if isinstance(delay, (bool, np.bool_)) or not isinstance(delay, numbers.Integral):
    raise TypeError(f"{delay=} must be an integer >= 0, got {type(delay).__name__}")
  return int(delay)


# The all-reduce dtypes XLA's AllReducePromotion widens (bf16 on CPU, 16-bit integers on GPU).
PROMOTED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int16), jnp.dtype(jnp.uint16))


def reduce_over(reduce, xs: list, axis_name) -> list:
  """`reduce(xs, axis_name)` (`lax.psum` or `lax.pmax` over the replica axis) for a list of arrays, in any map.

  In a map manual over every mesh axis (the user's own `shard_map`, `pmap`) it
  is just that. In one manual over the replica axis only, with the other mesh
  axes left to the partitioner (`diloco_train_step`: the step's data axes), JAX
  lowers the all-reduce's scalar body with a sharding annotation that Shardy
  turns into a `copy` at the body's root; XLA's AllReducePromotion, which
  widens bf16 all-reduces on CPU and 16-bit integer ones on GPU, then aborts
  the process cloning that body ("Invalid binary instruction opcode copy",
  issue 38). A leaf of such a dtype is reduced in a nested map manual over
  those free axes too: raveled, each of their D devices reduces its 1/D of it
  across the replicas (the same values summed over the same replicas: the same
  bits) and gathers the whole over the free (fast) axes. The nested map takes
  and gives whole leaves, so it asks no layout of them (one would spread through
  the update to the parameters: ddp's would come out sharded). Other dtypes
  reduce as they are.
  """
  mesh = jax.sharding.get_abstract_mesh()
  types = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  free = tuple(a for a, t in types.items() if t != AxisType.Manual)
  nested = [i for i, x in enumerate(xs) if free and jnp.result_type(x) in PROMOTED]
  if not nested:
    return reduce(xs, axis_name)
  out = list(xs)
  rest = [i for i in range(len(xs)) if i not in nested]
  if rest:
    for i, y in zip(rest, reduce([xs[i] for i in rest], axis_name), strict=True):
      out[i] = y
  size = int(np.prod([mesh.shape[a] for a in free]))
  explicit = any(types[a] == AxisType.Explicit for a in free)
  flats = []
  for i in nested:
    # Typed over Explicit free axes: whole over them, as the nested map takes it.
    flat = jnp.ravel(jax.sharding.reshard(xs[i], PartitionSpec()) if explicit else xs[i])
    flats.append(jnp.pad(flat, (0, -flat.size % size)))

  def body(fs):
    index = lax.axis_index(free)
    parts = [lax.dynamic_slice_in_dim(f, index * (f.size // size), f.size // size) for f in fs]
    return [lax.all_gather(y, free, tiled=True) for y in reduce(parts, axis_name)]

  whole = PartitionSpec()
  sums = jax.shard_map(body, mesh=mesh, in_specs=whole, out_specs=whole, axis_names=set(free), check_vma=False)(flats)
  for i, y in zip(nested, sums, strict=True):
    x = xs[i]
    y = y[: x.size].reshape(x.shape)
    typ = getattr(jax.typeof(x), "sharding", None)
    out[i] = jax.sharding.reshard(y, typ.spec) if explicit and typ is not None else y
  return out
