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
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxaccum import _quantize, _tree, parallel


class LocalSGDState(NamedTuple):
  """State of `local_sgd`; per replica (replicas' inner states differ)."""

  local_step: jax.Array  # int32 scalar: updates since the last synchronization, in [0, sync_every).
  sync_count: jax.Array  # int32 scalar: synchronizations (parameter all-reduces) done so far.
  inner_state: Any  # `inner`'s state, local to the replica and never averaged.


class DiLoCoState(NamedTuple):
  """State of `diloco`: inner state and residuals are per replica; anchor, outer states and in-flight agree."""

  local_step: jax.Array  # int32 scalar: updates into the current period of sync_every, in [0, sync_every).
  sync_count: jax.Array  # int32 scalar: merges (outer updates of any fragment) done so far.
  anchor: Any  # params-sized: each fragment's parameters after its last outer update (theta^{t-1} in the paper).
  inner_state: Any  # `inner`'s state, local to the replica; kept (not reset) across outer steps.
  outer_state: tuple  # one `outer` state per fragment (e.g. Nesterov momentum of that fragment's leaves).
  in_flight: Any  # params-sized with delay >= 1: each fragment's all-reduced Delta awaiting its merge; else None.
  residual: Any  # params-sized with error_feedback: each replica's quantisation residual e; else None.


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


def _check_delay(delay):
  if isinstance(delay, (bool, np.bool_)) or not isinstance(delay, numbers.Integral):
    raise TypeError(f"{delay=} must be an integer >= 0, got {type(delay).__name__}")
  return int(delay)


def _check_schedule(sync_every: int, num_fragments: int, delay: int, what: str) -> None:
  """The schedule's ValueErrors: H divisible by F, 0 <= tau < H / F. `what` says where F came from."""
  if sync_every % num_fragments:
    raise ValueError(
      f"{sync_every=} must be divisible by the number of fragments ({num_fragments}{what}): fragment f "
      f"merges every sync_every updates, on update (f + 1) * sync_every / fragments of each period"
    )
  if not 0 <= delay < sync_every // num_fragments:
    raise ValueError(
      f"{delay=} must be in [0, sync_every / fragments) = [0, {sync_every // num_fragments}): a fragment's outer "
      f"gradient is prepared `delay` updates before its merge, within its own {sync_every // num_fragments} updates"
    )


def _fragment_of_leaves(fragments, params) -> tuple[int, tuple[int, ...]]:
  """(F, the fragment index of each leaf in `jax.tree.leaves` order); raises ValueError on a bad assignment."""
  with_path = jax.tree_util.tree_flatten_with_path(params)[0]
  n = len(with_path)
  if not callable(fragments):
    if n < fragments:
      raise ValueError(f"{fragments=} needs at least {fragments} parameter leaves, the params have {n}")
    # numpy.array_split's contiguous groups: the first n % F hold one leaf more.
    return fragments, tuple(int(f) for f, part in enumerate(np.array_split(np.arange(n), fragments)) for _ in part)
  index = []
  for path, leaf in with_path:
    f = fragments(path, leaf)
    if isinstance(f, (bool, np.bool_)) or not isinstance(f, numbers.Integral) or f < 0:
      raise ValueError(
        f"fragments={getattr(fragments, '__name__', fragments)} returned {f!r} for the leaf at "
        f"{jax.tree_util.keystr(path)}: it must return a fragment index, an int >= 0"
      )
    index.append(int(f))
  num = max(index, default=-1) + 1
  unused = sorted(set(range(num)) - set(index))
  if num == 0 or unused:
    raise ValueError(
      f"fragments={getattr(fragments, '__name__', fragments)} must use every fragment index from 0 to F - 1; "
      f"it returned {sorted(set(index))}, so {unused or [0]} hold no leaf"
    )
  return num, tuple(index)


def _check_alpha(alpha) -> float:
  if isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, numbers.Real):
    raise TypeError(f"{alpha=} must be a float in [0, 1], got {type(alpha).__name__}")
  if not 0.0 <= float(alpha) <= 1.0:
    raise ValueError(f"{alpha=} must be in [0, 1]: the weight of the local parameters in a merge")
  return float(alpha)


def _diloco_prepare(anchor: list, source: list, residual, axis_name, replicas: int, compress=None, comm_dtype=None):
  """One fragment's outer gradient on the wire, per replica: (Delta, new residual or None).

  x_p = anchor - source_p (+ residual_p); c_p = C(x_p); Delta = mean_p c_p as
  the wire computes it; residual_p <- x_p - c_p. Lists of the fragment's
  leaves; `residual=None` is no error feedback. A plain function of its
  arguments, for wrappers that run the per-replica step themselves.
  """
  x = [a - s for a, s in zip(anchor, source, strict=True)]
  if residual is not None:
    x = [v + e for v, e in zip(x, residual, strict=True)]
  delta, sent = _quantize.wire_mean(x, axis_name, replicas, compress, comm_dtype)
  return delta, None if residual is None else [v - c for v, c in zip(x, sent, strict=True)]


def _diloco_merge(outer, delta, outer_state, anchor, params: list, local_updates: list, alpha: float, like):
  """One fragment's merge: (updates to emit, new anchor, new outer state).

  (o, outer_state) = outer.update(Delta, outer_state, anchor); anchor += o;
  theta_p <- alpha * (params_p + u_p) + (1 - alpha) * anchor, emitted as
  theta_p - params_p. `delta`/`anchor` are lists of the fragment's leaves;
  `like(leaves)` makes the tree `outer` sees (the params' structure, None
  outside the fragment).
  """
  outer_updates, outer_state = outer.update(like(delta), outer_state, like(anchor))
  anchor = [a + o.astype(a.dtype) for a, o in zip(anchor, jax.tree.leaves(outer_updates), strict=True)]
  if alpha == 1.0:
    return list(local_updates), anchor, outer_state
  updates = []
  for a, p, u in zip(anchor, params, local_updates, strict=True):
    # alpha = 0 lands on the anchor itself (no 0 * local term: an inf there would make a nan).
    target = a if alpha == 0.0 else alpha * (p + u.astype(p.dtype)) + (1.0 - alpha) * a
    updates.append((target - p).astype(u.dtype))
  return updates, anchor, outer_state


def diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation,
  sync_every: int,
  *,
  axis_name: str | tuple[str, ...],
  comm_dtype: Any = None,
  fragments: int | Callable[[Any, Any], int] = 1,
  delay: int = 0,
  alpha: float = 0.0,
  compress: str | None = None,
  error_feedback: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """(Streaming) DiLoCo: local `inner` steps; each parameter fragment gets an `outer` step every H updates.

  Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models" (arXiv 2311.08105), and its streaming form, Douillard et
  al., "Streaming DiLoCo with overlapping communication" (arXiv 2501.18512).
  With P replicas, H = `sync_every`, F fragments, s = H / F, tau = `delay`,
  updates counted t = 1, 2, ... and replica parameters theta_p:

      every update:   u_p = inner.update(g_p),  local_p = theta_p + u_p,
      prepare f on t_f - tau:   x_p = anchor_f - local_{p,f} (+ e_{p,f}),  c_p = C(x_p),
                                Delta_f = (1/P) sum_p c_p,  e_{p,f} <- x_p - c_p,
      merge f on t_f = (f + 1) s + k H:
                      (o, S_f) = outer.update(Delta_f, S_f, anchor_f),  anchor_f += o,
                      theta_{p,f} <- alpha local_{p,f} + (1 - alpha) anchor_f,
      every other leaf:  theta_p <- local_p.

  Fragments merge in turn, one every s updates, so each sync moves 1/F of the
  parameters. Fragment f's collectives run on one update of its period: with
  tau = 0 on t_f after the inner update; with tau >= 1 on update
  t_f - tau + 1, from the parameters at its start (they are local_p after
  t_f - tau), so they do not depend on that update's forward/backward and a
  scheduler can overlap them with tau updates of compute. Delta_f waits in
  the state until t_f. Defaults (F = 1, tau = 0, alpha = 0, no compression)
  are the paper's Algorithm 1: Delta = (1/P) sum_p (anchor - theta_p), anchor
  += outer step, theta_p <- anchor. The paper's outer optimizer is Nesterov,
  `optax.sgd(0.7, momentum=0.9, nesterov=True)` with inner AdamW;
  `outer=optax.sgd(1.0)` is local SGD, and `sync_every=1` with inner
  `optax.sgd(lr)` is synchronous data-parallel SGD.

  The wire C (see `jaxaccum._quantize`): `comm_dtype` or `compress="bf16"`
  rounds x to that float dtype and all-reduces in it. `compress="int8"`/`"int4"`
  sends blockwise absmax codes: blocks of 64 consecutive elements of each
  raveled leaf, one scale per block shared by every replica (one small
  max-all-reduce), s_j = max |x| / qmax with qmax = 127/7, codes
  clip(round_half_even(x / s_j), +-qmax) summed exactly as integers in the
  narrowest type that holds P qmax, Delta = (sum_p q_p) s_j / P. With
  `error_feedback=True` each replica keeps what its quantiser dropped,
  e = x - c, and adds it to the fragment's next outer gradient, so the sum of
  what was sent tracks the sum of the true outer gradients within one
  quantisation step (|e| <= s_j / 2).

  Usage and sharding as for `local_sgd`: inside `jax.shard_map`/`jax.pmap` over
  `axis_name`, params and state per replica. State: the anchor (params-sized),
  one `outer` state per fragment, `inner`'s state, and params-sized buffers for
  the in-flight Delta (tau >= 1) and the residual (error feedback). Updates
  are emitted as target - theta_p (see the module docstring on rounding).

  Args:
    inner: the per-replica optimizer (its state is kept across outer steps, never averaged).
    outer: the optimizer of each fragment's outer gradient; `outer.init` is
      called once per fragment on the params tree with None outside it, so
      adam's count advances only on that fragment's merges.
    sync_every: H, an int >= 1: each fragment gets an outer step every H updates.
    axis_name: the mapped replica axis to average over (required).
    comm_dtype: a float dtype for Delta on the wire (e.g. `jnp.bfloat16`);
      the average comes back in the parameters' dtype.
    fragments: F, an int >= 1 that splits the leaves, in `jax.tree.leaves`
      order, into F contiguous groups as `numpy.array_split` does; or
      `fn(path, leaf) -> index` (called at init and update), F = the largest
      index + 1, every index 0..F-1 used.
    delay: tau, an int in [0, H / F): updates between preparing and merging.
    alpha: the weight of the local parameters in a merge, in [0, 1]: 0
      replaces the fragment by the anchor, 1 keeps the local values.
    compress: None, "bf16", "int8" or "int4" (see above).
    error_feedback: keep each replica's quantisation residual per fragment.

  Returns:
    An `optax.GradientTransformationExtraArgs` with a `DiLoCoState`; extra
    arguments go to `inner`.

  Raises:
    TypeError/ValueError: as `local_sgd`; a `comm_dtype` that is not floating,
      or given with `compress`; `sync_every` not divisible by F; `delay` < 0
      or >= H / F; `alpha` outside [0, 1]; an unknown `compress`; a
      `fragments` function returning a negative or non-int index or leaving
      an index unused (at init, before any state is made).
  """
  inner = _tree.check_optimizer(inner, "inner")
  outer = _tree.check_optimizer(outer, "outer")
  sync_every = _tree.check_positive_int(sync_every, "sync_every")
  axis_name = _check_axis_name_arg(axis_name)
  if comm_dtype is not None:
    comm_dtype = jnp.dtype(comm_dtype)
    if not jnp.issubdtype(comm_dtype, jnp.floating):
      raise ValueError(f"{comm_dtype=} must be a floating dtype")
  if not callable(fragments):
    fragments = _tree.check_positive_int(fragments, "fragments")
  delay = _check_delay(delay)
  if not callable(fragments):
    _check_schedule(sync_every, fragments, delay, "")
  elif delay < 0:
    raise ValueError(f"{delay=} must be an integer >= 0")
  alpha = _check_alpha(alpha)
  if not isinstance(compress, (str, type(None))) or compress not in _quantize.COMPRESS:
    raise ValueError(f"{compress=} is not one of {_quantize.COMPRESS[1:]} (or None: no compression)")
  if compress is not None and comm_dtype is not None:
    raise ValueError(f"{comm_dtype=} and {compress=} both choose the wire: give one")
  if not isinstance(error_feedback, bool):
    raise TypeError(f"{error_feedback=} must be a bool")
  if error_feedback and compress is None and comm_dtype is None:
    # An exact wire drops nothing: the residual would be a params-sized buffer of zeros.
    raise ValueError(
      f"{error_feedback=} needs a lossy wire: give compress='int8' | 'int4' | 'bf16' or a comm_dtype (the "
      "full-precision wire drops nothing for the residual to carry)"
    )
  inner = optax.with_extra_args_support(inner)

  def layout(params, check):
    """(F, leaf fragment indices, treedef); `check` raises the schedule's ValueErrors for a function's F."""
    num, index = _fragment_of_leaves(fragments, params)
    if check and callable(fragments):
      _check_schedule(sync_every, num, delay, f" returned by fragments={getattr(fragments, '__name__', fragments)}")
    return num, index, jax.tree.structure(params)

  def like_for(index, treedef, f):
    def like(leaves):
      it = iter(leaves)
      return treedef.unflatten([next(it) if i == f else None for i in index])

    return like

  def init(params):
    num, index, treedef = layout(params, check=True)
    leaves = jax.tree.leaves(params)
    copy = lambda: jax.tree.map(jnp.array, params)  # copies: a donated params buffer must not alias state
    return DiLoCoState(
      local_step=jnp.zeros([], jnp.int32),
      sync_count=jnp.zeros([], jnp.int32),
      anchor=copy(),
      inner_state=inner.init(params),
      outer_state=tuple(
        outer.init(like_for(index, treedef, f)([x for x, i in zip(leaves, index, strict=True) if i == f]))
        for f in range(num)
      ),
      in_flight=_zeros_like(params) if delay else None,
      residual=_zeros_like(params) if error_feedback else None,
    )

  def update(grads, state, params=None, *, inner_applied=None, **extra_args):
    # inner_applied (private; ja.diloco_train_step's engine passes it): a traced bool, False where this
    # replica's step skips. Only the inner update is gated; the schedule and collectives run regardless.
    _check_params(params, "diloco")
    num, index, treedef = layout(params, check=False)
    size = parallel.check_axis_name(axis_name)
    parallel.check_varying(grads, axis_name)
    span = sync_every // num
    pick = lambda tree, f: [x for x, i in zip(jax.tree.leaves(tree), index, strict=True) if i == f]
    anchor_l = jax.tree.leaves(state.anchor)
    flight_l = jax.tree.leaves(state.in_flight) if delay else None
    resid_l = jax.tree.leaves(state.residual) if error_feedback else None
    step = state.local_step + 1  # this update's position in the period, in [1, H]
    # With H = 1 (so F = 1, tau = 0) every update syncs: straight-line code, no conditional.
    run = (lambda pred, yes, no, ops: yes(ops)) if sync_every == 1 else parallel.cond

    def put(leaves_l, f, new):
      it = iter(new)
      return [next(it) if i == f else x for x, i in zip(leaves_l, index, strict=True)]

    # Collectives of tau >= 1, on update t_f - tau + 1: from the params at its start, before inner runs.
    if delay:
      for f in range(num):

        def send(ops):
          anchor, source, resid, _ = ops
          return _diloco_prepare(anchor, source, resid, axis_name, size, compress, comm_dtype)

        def wait(ops):
          *_, resid, flight = ops
          return flight, resid

        ops = (pick(state.anchor, f), pick(params, f), None if resid_l is None else pick(state.residual, f))
        flight, resid = run(step == (f + 1) * span - delay + 1, send, wait, ops + (pick(state.in_flight, f),))
        flight_l = put(flight_l, f, flight)
        if resid_l is not None:
          resid_l = put(resid_l, f, resid)

    if inner_applied is None:
      local, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
    else:
      local, inner_state = _gated_inner(inner, inner_applied, grads, state.inner_state, params, extra_args)
    local_l = jax.tree.leaves(local)
    updates_l, outer_state, merged = list(local_l), list(state.outer_state), jnp.zeros([], jnp.bool_)
    for f in range(num):
      like = like_for(index, treedef, f)

      def sync(ops):
        params_f, local_f, anchor_f, ostate, flight, resid = ops
        if not delay:
          source = [p + u.astype(p.dtype) for p, u in zip(params_f, local_f, strict=True)]
          flight, resid = _diloco_prepare(anchor_f, source, resid, axis_name, size, compress, comm_dtype)
        upd, anchor_f, ostate = _diloco_merge(outer, flight, ostate, anchor_f, params_f, local_f, alpha, like)
        return upd, anchor_f, ostate, resid

      def hold(ops):
        # anchor, outer state and residual are state: passing them through aliases, no copy.
        _, local_f, anchor_f, ostate, _, resid = ops
        return _zeros_like(local_f), anchor_f, ostate, resid

      pred = step == (f + 1) * span
      merge_ops = (
        pick(params, f),
        pick(local, f),
        pick(state.anchor, f),
        outer_state[f],
        None if flight_l is None else pick(flight_l, f),
        None if resid_l is None else pick(resid_l, f),
      )
      upd, anchor_f, outer_state[f], resid = run(pred, sync, hold, merge_ops)
      # A fused select, not the local update passed through the branch (XLA would copy it).
      updates_l = put(updates_l, f, [jnp.where(pred, a, b) for a, b in zip(upd, pick(local, f), strict=True)])
      anchor_l = put(anchor_l, f, anchor_f)
      if resid_l is not None and not delay:
        resid_l = put(resid_l, f, resid)
      merged = merged | pred
    new_state = DiLoCoState(
      local_step=jnp.where(step >= sync_every, jnp.zeros_like(step), step),
      sync_count=state.sync_count + merged.astype(state.sync_count.dtype),
      anchor=treedef.unflatten(anchor_l),
      inner_state=inner_state,
      outer_state=tuple(outer_state),
      in_flight=treedef.unflatten(flight_l) if delay else None,
      residual=treedef.unflatten(resid_l) if error_feedback else None,
    )
    return jax.tree.unflatten(jax.tree.structure(local), updates_l), new_state

  return optax.GradientTransformationExtraArgs(init, update)


def _gated_inner(inner, applied, grads, inner_state, params, extra_args):
  """`inner.update` where `applied`, else a zero update and `inner_state` unchanged (a conditional, no select).

  A skipped step's gradient may be non-finite: it is replaced by zeros before
  it enters either branch, so no NaN flows into the update or its gradients.
  """
  grads = jax.tree.map(lambda g: jnp.where(applied, g, jnp.zeros_like(g)), grads)

  def apply(ops):
    return inner.update(ops[0], ops[1], params, **extra_args)

  def hold(ops):
    return _zeros_like(ops[0]), ops[1]  # in the gradient's layout; parallel.cond joins dtypes

  return parallel.cond(applied, apply, hold, (grads, inner_state))


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
