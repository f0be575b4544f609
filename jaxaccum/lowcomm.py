"""local_sgd(), diloco(), stale(): beyond per-step synchronous gradient averaging.

Synchronous data parallelism all-reduces the gradient on every update, and every
device waits for the slowest. Two ways out, both written here as pure optax
gradient transformations:

* Communicate less often. `local_sgd` lets each replica run its own optimizer
  and averages the *parameters* every H updates; `diloco` does the same but
  treats the averaged parameter change as a gradient for an outer optimizer
  (Nesterov momentum in the paper). One all-reduce per H updates.
* Do not wait. `stale` simulates asynchronous SGD with a fixed staleness d: the
  update applied at step t uses the gradient computed at step t - d, i.e. on
  parameters d updates old, as a parameter server does with slow workers.

Parameter averaging as a gradient transformation. optax applies updates as
`params + updates`. At a synchronization step these transforms emit

    updates = target - params,

where `target` is the average over replicas of `params + local update`
(`local_sgd`) or `anchor + outer update` (`diloco`), so that `apply_updates`
lands on `target`. Both therefore need `params` in `update`. In floating point
`params + (target - params)` equals `target` up to one rounding (at most one
ulp of the result, and exact whenever the two are within a factor of two of
each other, by Sterbenz's lemma); replicas with different `params` may thus
land an ulp apart. In float64 that is ~1e-16 relative; `diloco` keeps the exact
`target` as its anchor, so the difference never accumulates there.

Cost. On the H-1 updates between synchronizations the all-reduce sits in the
untaken branch of a `lax.cond` and does not run; the compiled HLO holds no
all-reduce outside that branch (tests/test_lowcomm.py checks it).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxaccum import _tree, parallel


class LocalSGDState(NamedTuple):
  """State of `local_sgd`; per replica (replicas' inner states differ)."""

  local_step: jax.Array  # int32 scalar: updates since the last synchronization, in [0, sync_every).
  sync_count: jax.Array  # int32 scalar: synchronizations (parameter all-reduces) done so far.
  inner_state: Any  # `inner`'s state, local to the replica and never averaged.


class DiLoCoState(NamedTuple):
  """State of `diloco`: the inner state is per replica, anchor and outer state agree on all."""

  local_step: jax.Array  # int32 scalar: inner updates since the last synchronization.
  sync_count: jax.Array  # int32 scalar: outer updates done so far.
  anchor: Any  # the parameters after the last outer update (theta^{t-1} in the paper); params-sized.
  inner_state: Any  # `inner`'s state, local to the replica; kept (not reset) across outer steps.
  outer_state: Any  # `outer`'s state (e.g. Nesterov momentum, params-sized).


class StaleState(NamedTuple):
  """State of `stale`."""

  slot: jax.Array  # int32 scalar: the ring-buffer slot holding the oldest gradient, in [0, delay).
  filled: jax.Array  # int32 scalar: gradients in the buffer, saturating at `delay` (no overflow).
  buffer: Any  # the last `delay` gradients: each leaf has a leading axis of size `delay`.
  inner_state: Any  # `inner`'s state; it advances only once the buffer is full.


def _check_axis_name_arg(axis_name):
  parallel.validate_axis_name(axis_name)
  return axis_name


def _check_params(params, name: str):
  if params is None:
    raise ValueError(
      f"{name} averages parameters, so its update needs them: call "
      f"update(grads, state, params) (optax.chain passes params through)"
    )


def _local_inner_update(name, inner, axis_name, grads, state, params, extra_args):
  """The start of every low-communication update: check the call, run `inner` on this replica's gradient.

  Returns (axis size, local updates, new inner state).
  """
  _check_params(params, name)
  size = parallel.check_axis_name(axis_name)
  parallel.check_varying(grads, axis_name)
  local, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
  return size, local, inner_state


def _zeros_like(tree):
  # zeros_like, not zeros(shape): the zeros keep each leaf's sharding (under
  # Explicit mesh axes the two branches of a cond must agree on it).
  return jax.tree.map(jnp.zeros_like, tree)


def _select(pred, on_true, on_false):
  # A fused elementwise select rather than returning `on_false` from a cond
  # branch: a freshly computed value passed through a branch is copied by XLA.
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _advance(local_step, sync_count, sync_every):
  """(is_sync, next local_step, next sync_count) after one more inner update."""
  local_step = local_step + 1
  is_sync = local_step >= sync_every
  return (
    is_sync,
    jnp.where(is_sync, jnp.zeros_like(local_step), local_step),
    sync_count + is_sync.astype(sync_count.dtype),
  )


def local_sgd(
  inner: optax.GradientTransformation,
  sync_every: int,
  *,
  axis_name: str | tuple[str, ...],
) -> optax.GradientTransformationExtraArgs:
  """Local SGD: each replica runs `inner` alone; parameters are averaged every `sync_every` updates.

  With replicas p = 1..P, local parameters theta_p and H = `sync_every`:

      theta_p <- theta_p + u_p,   u_p = inner.update(g_p, ...)     on each update,
      theta_p <- (1/P) sum_q (theta_q + u_q)                       on every H-th update,

  the latter emitted as `updates = mean_q(theta_q + u_q) - theta_p` (see the
  module docstring for the one rounding this costs). H = 1 is synchronous
  parameter averaging, which for plain SGD is synchronous gradient averaging.
  One all-reduce of a params-sized tree per H updates; in between, nothing is
  communicated. References: Stich, "Local SGD converges fast and communicates
  little" (ICLR 2019); Lin et al., "Don't use large mini-batches, use local SGD"
  (arXiv 1808.07217), whose *post-local SGD* is `sync_every=1` for a warm-up
  then H > 1 (two transforms, switched by the training loop).

  Use inside `jax.pmap` or `jax.shard_map` over `axis_name`, feeding each
  replica's own (not averaged) gradients. Between synchronizations the replicas'
  parameters differ, so parameters and state are per replica: under pmap that
  is automatic; under shard_map keep them sharded with a leading replica axis
  (in/out specs `P(axis_name)`), and take gradients of varying parameters
  (gradients already summed by autodiff over replicated parameters raise).
  `inner`'s state is never averaged (Adam moments stay local). To send bf16
  on the wire, send parameter *changes* instead: `diloco(inner,
  optax.sgd(1.0), H, axis_name=..., comm_dtype=jnp.bfloat16)` is local SGD.

  Args:
    inner: the per-replica optimizer.
    sync_every: H, an int >= 1: average parameters on every H-th update.
    axis_name: the mapped data axis to average over (required).

  Returns:
    An `optax.GradientTransformationExtraArgs` with a `LocalSGDState`; extra
    arguments go to `inner`.

  Raises:
    TypeError/ValueError: `sync_every` not an int >= 1, `axis_name` not a
      string; at update time, `params` missing or `axis_name` unbound.
  """
  inner = _tree.check_optimizer(inner, "inner")
  sync_every = _tree.check_positive_int(sync_every, "sync_every")
  axis_name = _check_axis_name_arg(axis_name)
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return LocalSGDState(
      local_step=jnp.zeros([], jnp.int32), sync_count=jnp.zeros([], jnp.int32), inner_state=inner.init(params)
    )

  def update(grads, state, params=None, **extra_args):
    size, local, inner_state = _local_inner_update("local_sgd", inner, axis_name, grads, state, params, extra_args)

    def average(operands):
      params, local = operands
      moved = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, local)
      total = lax.psum(moved, axis_name)
      return jax.tree.map(lambda t, p, u: (t / jnp.asarray(size, t.dtype) - p).astype(u.dtype), total, params, local)

    if sync_every == 1:
      return average((params, local)), LocalSGDState(state.local_step, state.sync_count + 1, inner_state)
    is_sync, local_step, sync_count = _advance(state.local_step, state.sync_count, sync_every)
    averaged = parallel.cond(is_sync, average, lambda ops: _zeros_like(ops[1]), (params, local))
    return _select(is_sync, averaged, local), LocalSGDState(local_step, sync_count, inner_state)

  return optax.GradientTransformationExtraArgs(init, update)


def diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation,
  sync_every: int,
  *,
  axis_name: str | tuple[str, ...],
  comm_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: H local `inner` steps, then one `outer` step on the averaged parameter change.

  Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models" (arXiv 2311.08105), Algorithm 1. With anchor theta (the
  parameters after the last outer step) and replica parameters theta_p:

      theta_p <- theta_p + inner.update(g_p)                     on each update,
      Delta   =  (1/P) sum_p (theta - theta_p)                   on every H-th update,
      theta   <- theta + outer.update(Delta, params=theta),      theta_p <- theta.

  The paper's outer optimizer is Nesterov momentum, `optax.sgd(0.7,
  momentum=0.9, nesterov=True)` with inner AdamW; `outer=optax.sgd(1.0)` gives
  local SGD (theta = mean_p theta_p), and with `sync_every=1` and inner
  `optax.sgd(lr)` it is synchronous data-parallel SGD. The outer gradient is the
  only thing communicated, one all-reduce per H updates, in `comm_dtype` on the
  wire if set: Delta is a small difference, so bf16 costs little accuracy (the
  paper reports none). Emitted as `updates = theta_new - theta_p`; the anchor
  keeps the exact theta_new (see the module docstring on rounding).

  Usage and sharding as for `local_sgd`. State: the anchor (one params-sized
  copy) plus `outer`'s state (one more for momentum) on top of `inner`'s.

  Args:
    inner: the per-replica optimizer (its state is kept across outer steps).
    outer: the optimizer applied to the averaged outer gradient Delta.
    sync_every: H, an int >= 1: an outer step on every H-th update.
    axis_name: the mapped data axis to average over (required).
    comm_dtype: dtype of Delta on the wire (e.g. `jnp.bfloat16`); the average
      comes back in the parameters' dtype.

  Returns:
    An `optax.GradientTransformationExtraArgs` with a `DiLoCoState`; extra
    arguments go to `inner`.

  Raises:
    TypeError/ValueError: as `local_sgd`, and a `comm_dtype` that is not floating.
  """
  inner = _tree.check_optimizer(inner, "inner")
  outer = _tree.check_optimizer(outer, "outer")
  sync_every = _tree.check_positive_int(sync_every, "sync_every")
  axis_name = _check_axis_name_arg(axis_name)
  if comm_dtype is not None:
    comm_dtype = jnp.dtype(comm_dtype)
    if not jnp.issubdtype(comm_dtype, jnp.floating):
      raise ValueError(f"{comm_dtype=} must be a floating dtype")
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return DiLoCoState(
      local_step=jnp.zeros([], jnp.int32),
      sync_count=jnp.zeros([], jnp.int32),
      # A copy, so that a donated params buffer does not alias the anchor.
      anchor=jax.tree.map(jnp.array, params),
      inner_state=inner.init(params),
      outer_state=outer.init(params),
    )

  def update(grads, state, params=None, **extra_args):
    size, local, inner_state = _local_inner_update("diloco", inner, axis_name, grads, state, params, extra_args)

    def outer_step(operands):
      params, local, anchor, outer_state = operands
      delta = jax.tree.map(lambda a, p, u: a - (p + u.astype(p.dtype)), anchor, params, local)
      delta = parallel.all_reduce_sum(delta, axis_name, comm_dtype)
      delta = jax.tree.map(lambda d: d / jnp.asarray(size, d.dtype), delta)
      outer_updates, outer_state = outer.update(delta, outer_state, anchor)
      anchor = jax.tree.map(lambda a, o: a + o.astype(a.dtype), anchor, outer_updates)
      updates = jax.tree.map(lambda a, p, u: (a - p).astype(u.dtype), anchor, params, local)
      return updates, anchor, outer_state

    def hold(operands):
      # anchor and outer state are state: passing them through aliases, no copy.
      _, local, anchor, outer_state = operands
      return _zeros_like(local), anchor, outer_state

    operands = (params, local, state.anchor, state.outer_state)
    if sync_every == 1:
      updates, anchor, outer_state = outer_step(operands)
      return updates, DiLoCoState(state.local_step, state.sync_count + 1, anchor, inner_state, outer_state)
    is_sync, local_step, sync_count = _advance(state.local_step, state.sync_count, sync_every)
    synced, anchor, outer_state = parallel.cond(is_sync, outer_step, hold, operands)
    return _select(is_sync, synced, local), DiLoCoState(local_step, sync_count, anchor, inner_state, outer_state)

  return optax.GradientTransformationExtraArgs(init, update)


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
      return _zeros_like(grads), inner_state

    updates, inner_state = parallel.cond(ready, apply, wait, (oldest, state.inner_state))
    slot = jnp.where(state.slot + 1 >= delay, jnp.zeros_like(state.slot), state.slot + 1)
    filled = jnp.minimum(state.filled + 1, delay)
    return updates, StaleState(slot, filled, buffer, inner_state)

  return optax.GradientTransformationExtraArgs(init, update)
