"""stale(): applies at step t the gradient of step t - d, a deterministic simulation of asynchronous SGD."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxaccum import _lowcomm_util as util
from jaxaccum import _tree, parallel


class StaleState(NamedTuple):
  """State of `stale`."""

  slot: jax.Array  # int32 scalar: the ring-buffer slot holding the oldest gradient, in [0, delay).
  filled: jax.Array  # int32 scalar: gradients in the buffer, saturating at `delay` (no overflow).
  buffer: Any  # the last `delay` gradients: each leaf has a leading axis of size `delay`.
  inner_state: Any  # `inner`'s state; it advances only once the buffer is full.


def stale(
  inner: optax.GradientTransformation,
  delay: int,
  *,
  staleness_lr_scale: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Stale-gradient updates: applies at step t the gradient received at step t - `delay`.

  A deterministic simulation of asynchronous SGD with fixed staleness d: a
  worker computes g_t on theta_t, and by the time it reaches the parameter
  server d other updates have landed, so

      u_t = inner.update(g_{t-d})   for t >= d,     u_t = 0   for t < d,

  while the gradient itself was taken at the parameters of step t - d. The last
  d gradients wait in a ring buffer in the state (d params-sized copies). On
  the first d steps nothing is applied and `inner`'s state is untouched, so its
  step counts and schedules count applied updates. `delay=0` is `inner` itself.

  `staleness_lr_scale=True` divides the applied updates by d, the
  staleness-dependent learning rate alpha/tau of Zhang et al., "Staleness-aware
  Async-SGD for Distributed Deep Learning" (arXiv 1511.05950), with tau = d.
  The updates are scaled (not the gradient), so it is a learning-rate scale for
  any `inner`, Adam included.

  Composes with data parallelism: `optax.chain(ja.pmean(axis), ja.stale(inner,
  d))` delays the averaged gradient (every replica holds the same buffer), and
  works inside `ja.make_train_step`.

  Args:
    inner: the optimizer the delayed gradients are fed to.
    delay: d, an int >= 0.
    staleness_lr_scale: scale the applied updates by 1/d (no-op for d = 0).

  Returns:
    An `optax.GradientTransformationExtraArgs` with a `StaleState`; extra
    arguments go to `inner` (those of the current step, with the delayed gradient).

  Raises:
    TypeError/ValueError: `delay` not an int >= 0, `staleness_lr_scale` not a
      bool; at update time (any `delay`, 0 included) a state not made by this
      `init`, or a grads tree that does not match the params given to `init`
      (the message names the leaves).
  """
  inner = _tree.check_optimizer(inner, "inner")
  if isinstance(delay, (bool, np.bool_)) or not isinstance(delay, numbers.Integral):
    raise TypeError(f"{delay=} must be an integer >= 0, got {type(delay).__name__}")
  if delay < 0:
    raise ValueError(f"{delay=} must be an integer >= 0")
  delay = int(delay)
  if not isinstance(staleness_lr_scale, bool):
    raise TypeError(f"{staleness_lr_scale=} must be a bool")
  inner = optax.with_extra_args_support(inner)

  def init(params):
    # Python scalars are leaves optax accepts; the buffer keeps each leaf's dtype.
    buffer = jax.tree.map(lambda p: jnp.zeros((delay,) + jnp.shape(p), _tree.dtype_of(p)), params)
    return StaleState(
      slot=jnp.zeros([], jnp.int32), filled=jnp.zeros([], jnp.int32), buffer=buffer, inner_state=inner.init(params)
    )

  def update(grads, state, params=None, **extra_args):
    if not isinstance(state, StaleState):
      raise TypeError(f"state must be a StaleState (made by this stale's init(params)), got {_tree.describe(state)}")
    # The buffer holds one (delay, *shape) leaf per parameter, also for delay=0 (size 0): check the
    # grads against it as accumulate does against its accumulator, whatever the delay.
    slots = jax.tree.map(lambda b: jax.ShapeDtypeStruct(jnp.shape(b)[1:], b.dtype), state.buffer)
    _tree.check_same_structure(grads, slots, "grads", "the buffered gradients (the params given to init)")
    if delay == 0:
      updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)
    grads = jax.tree.map(jnp.asarray, grads)  # optax accepts Python scalars as leaves
    # Read the oldest gradient, then overwrite its slot with the newest: the
    # read is scheduled before the in-place write, so the buffer is not copied.
    oldest = jax.tree.map(lambda b: b[state.slot], state.buffer)
    buffer = jax.tree.map(
      lambda b, g: lax.dynamic_update_index_in_dim(b, g.astype(b.dtype), state.slot, 0), state.buffer, grads
    )
    ready = state.filled >= delay

    def apply(operands):
      oldest, inner_state = operands
      oldest = _tree.cast_like(oldest, grads)
      updates, inner_state = inner.update(oldest, inner_state, params, **extra_args)
      if staleness_lr_scale:
        updates = jax.tree.map(lambda u: u / jnp.asarray(delay, u.dtype), updates)
      return _tree.cast_like(updates, grads), inner_state

    def wait(operands):
      _, inner_state = operands
      return util.zeros_like(grads), inner_state

    updates, inner_state = parallel.cond(ready, apply, wait, (oldest, state.inner_state))
    slot = jnp.where(state.slot + 1 >= delay, jnp.zeros_like(state.slot), state.slot + 1)
    filled = jnp.minimum(state.filled + 1, delay)
    return updates, StaleState(slot, filled, buffer, inner_state)

  return optax.GradientTransformationExtraArgs(init, update)
