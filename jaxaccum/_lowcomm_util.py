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
