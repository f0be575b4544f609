"""The inside of `ja.diloco`: its options as a `Config`, and one update as module functions.

`lowcomm.diloco` validates its options into a `Config` (`configure`); `init`
makes the state and each `update` call runs, per replica:

1. with tau >= 1, on update t_f - tau + 1 of fragment f's period, its outer
   gradient from the parameters at the call's start (`send_early`);
2. the inner update, gated where the wrapper's step skips (`inner_update`);
3. on t_f, fragment f's merge (`merge_fragment`), which with tau = 0 first
   prepares its outer gradient (`prepare`) and then runs `outer` (`merge`).

A fragment's collectives sit in the taken branch of its `lax.cond`: no
collective runs on other updates. Everything is traced per call from the
config and the call's arguments.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum import _lowcomm_util as util
from jaxaccum import _quantize, _sparse, _tree, parallel


class DiLoCoState(NamedTuple):
  """State of `diloco`: inner state and residuals are per replica; anchor, outer states and in-flight agree."""

  local_step: jax.Array  # int32 scalar: updates into the current period of sync_every, in [0, sync_every).
  sync_count: jax.Array  # int32 scalar: merges (outer updates of any fragment) done so far.
  anchor: Any  # params-sized: each fragment's parameters after its last outer update (theta^{t-1} in the paper).
  inner_state: Any  # `inner`'s state, local to the replica; kept (not reset) across outer steps.
  outer_state: tuple  # one `outer` state per fragment (e.g. Nesterov momentum of that fragment's leaves).
  in_flight: Any  # params-sized with delay >= 1: each fragment's all-reduced Delta awaiting its merge; else None.
  residual: Any  # params-sized with error_feedback: each replica's quantisation residual e; else None.


class Config(NamedTuple):
  """`diloco`'s options, validated (see its docstring for each)."""

  inner: optax.GradientTransformationExtraArgs  # the per-replica optimizer, with extra-args support
  outer: optax.GradientTransformation  # each fragment's outer optimizer
  sync_every: int  # H
  axis_name: Any  # the replica axis
  comm_dtype: Any  # None or a floating wire dtype
  fragments: int | Callable[[Any, Any], int]  # F, or fn(path, leaf) -> fragment index
  delay: int  # tau
  alpha: float  # the weight of the local parameters in a merge
  compress: Any  # one of _quantize.COMPRESS, or a _sparse.TopK
  error_feedback: bool  # keep each replica's residual per fragment


def configure(inner, outer, sync_every, axis_name, comm_dtype, fragments, delay, alpha, compress, error_feedback):
  """`diloco`'s arguments checked into a `Config`; raises the errors its docstring lists."""
  inner = _tree.check_optimizer(inner, "inner")
  outer = _tree.check_optimizer(outer, "outer")
  sync_every = _tree.check_positive_int(sync_every, "sync_every")
  axis_name = util.check_axis_name_arg(axis_name)
  if comm_dtype is not None:
    comm_dtype = jnp.dtype(comm_dtype)
    if not jnp.issubdtype(comm_dtype, jnp.floating):
      raise ValueError(f"{comm_dtype=} must be a floating dtype")
  if not callable(fragments):
    fragments = _tree.check_positive_int(fragments, "fragments")
  delay = util.check_delay(delay)
  if not callable(fragments):
    check_schedule(sync_every, fragments, delay, "")
  elif delay < 0:
    raise ValueError(f"{delay=} must be an integer >= 0")
  alpha = check_alpha(alpha)
  if compress == "topk":
    compress = _sparse.TopK()
  if not isinstance(compress, _sparse.TopK) and (
    not isinstance(compress, (str, type(None))) or compress not in _quantize.COMPRESS
  ):
    raise ValueError(
      f"{compress=} is not one of {_quantize.COMPRESS[1:]}, 'topk' or a ja.TopK(...) (or None: no compression)"
    )
  if isinstance(compress, _sparse.TopK) and error_feedback is not True:
    raise ValueError(
      f"{error_feedback=} with compress={compress}: the sparse wire sends a few values of each chunk and "
      "its error-feedback accumulator keeps the rest (SparseLoCo); pass error_feedback=True"
    )
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
  return Config(inner, outer, sync_every, axis_name, comm_dtype, fragments, delay, alpha, compress, error_feedback)


def check_schedule(sync_every: int, num_fragments: int, delay: int, what: str) -> None:
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


def check_alpha(alpha) -> float:
  if isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, numbers.Real):
    raise TypeError(f"{alpha=} must be a float in [0, 1], got {type(alpha).__name__}")
  if not 0.0 <= float(alpha) <= 1.0:
    raise ValueError(f"{alpha=} must be in [0, 1]: the weight of the local parameters in a merge")
  return float(alpha)


def fragment_of_leaves(fragments, params) -> tuple[int, tuple[int, ...]]:
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


class Layout(NamedTuple):
  """Which fragment each leaf belongs to: F, each leaf's index (`jax.tree.leaves` order), the params' treedef."""

  num: int
  fragment_of: tuple[int, ...]  # each leaf's fragment
  treedef: Any

  def pick(self, leaves: list, f: int) -> list:
    """Fragment f's leaves of a params-shaped tree's leaves (`jax.tree.leaves` order)."""
    return [x for x, i in zip(leaves, self.fragment_of, strict=True) if i == f]

  def put(self, leaves: list, f: int, new: list) -> list:
    """`leaves` with fragment f's replaced by `new`."""
    it = iter(new)
    return [next(it) if i == f else x for x, i in zip(leaves, self.fragment_of, strict=True)]

  def like(self, f: int) -> Callable[[list], Any]:
    """leaves -> the params' structure with fragment f's leaves and None elsewhere (the tree `outer` sees)."""

    def like(leaves):
      it = iter(leaves)
      return self.treedef.unflatten([next(it) if i == f else None for i in self.fragment_of])

    return like


def layout(cfg: Config, params, check: bool) -> Layout:
  """The fragments of `params`; `check` raises the schedule's ValueErrors for a function's F."""
  num, index = fragment_of_leaves(cfg.fragments, params)
  if isinstance(cfg.compress, _sparse.TopK):
    cfg.compress.check_leaves(params)
  if check and callable(cfg.fragments):
    name = getattr(cfg.fragments, "__name__", cfg.fragments)
    check_schedule(cfg.sync_every, num, cfg.delay, f" returned by fragments={name}")
  return Layout(num, index, jax.tree.structure(params))


def init(cfg: Config, params) -> DiLoCoState:
  lay = layout(cfg, params, check=True)
  copy = lambda: jax.tree.map(jnp.array, params)  # copies: a donated params buffer must not alias state
  return DiLoCoState(
    local_step=jnp.zeros([], jnp.int32),
    sync_count=jnp.zeros([], jnp.int32),
    anchor=copy(),
    inner_state=cfg.inner.init(params),
    outer_state=tuple(cfg.outer.init(lay.like(f)(lay.pick(jax.tree.leaves(params), f))) for f in range(lay.num)),
    in_flight=util.zeros_like(params) if cfg.delay else None,
    residual=util.zeros_like(params) if cfg.error_feedback else None,
  )


def prepare(anchor: list, source: list, residual, axis_name, replicas: int, compress=None, comm_dtype=None):
  """One fragment's outer gradient on the wire, per replica: (Delta, new residual or None).

  x_p = anchor - source_p (+ residual_p); c_p = C(x_p); Delta = mean_p c_p as
  the wire computes it; residual_p <- x_p - c_p (with `ja.TopK`, x_p adds
  beta * residual_p: SparseLoCo's decayed accumulator). Lists of the fragment's
  leaves; `residual=None` is no error feedback. A plain function of its
  arguments, for wrappers that run the per-replica step themselves.
  """
  beta = compress.beta if isinstance(compress, _sparse.TopK) else 1.0

  def outer_gradient(a, s, e):
    x = a - s
    if e is None:
      return x
    return x + e if beta == 1.0 else x + beta * e  # SparseLoCo's e <- beta e + Delta

  # Each leaf's x from its inputs, computed when the wire asks (the sparse wire codes one leaf at a time).
  resid = [None] * len(anchor) if residual is None else residual
  leaves = [lambda order, t=t: outer_gradient(*order(t)) for t in zip(anchor, source, resid, strict=True)]
  delta, left = _quantize.wire_mean(leaves, axis_name, replicas, compress, comm_dtype)
  return delta, None if residual is None else left


def merge(outer, delta, outer_state, anchor, params: list, local_updates: list, alpha: float, like):
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


class Call(NamedTuple):
  """What one `update` call fixed at trace time, shared by the fragments' branches."""

  cfg: Config
  lay: Layout
  size: int  # replicas on the axis
  step: Any  # this update's position in the period, in [1, H] (traced)
  run: Callable  # parallel.cond, or straight-line code where every update syncs (H = 1)

  def wire(self, anchor, source, resid):
    cfg = self.cfg
    return prepare(anchor, source, resid, cfg.axis_name, self.size, cfg.compress, cfg.comm_dtype)


def send_early(call: Call, state: DiLoCoState, params, flight_l: list, resid_l: list | None):
  """tau >= 1: fragment f's collectives on update t_f - tau + 1, from the params at its start, before inner runs.

  Returns the new in-flight and residual leaves (fragments not sending keep theirs).
  """
  lay, span = call.lay, call.cfg.sync_every // call.lay.num

  def send(ops):
    anchor, source, resid, _ = ops
    return call.wire(anchor, source, resid)

  def wait(ops):
    *_, resid, flight = ops
    return flight, resid

  anchor_l, params_l = jax.tree.leaves(state.anchor), jax.tree.leaves(params)
  for f in range(lay.num):
    ops = (lay.pick(anchor_l, f), lay.pick(params_l, f), None if resid_l is None else lay.pick(resid_l, f))
    sends = call.step == (f + 1) * span - call.cfg.delay + 1
    flight, resid = call.run(sends, send, wait, ops + (lay.pick(flight_l, f),))
    flight_l = lay.put(flight_l, f, flight)
    if resid_l is not None:
      resid_l = lay.put(resid_l, f, resid)
  return flight_l, resid_l


def merge_fragment(call: Call, f: int, params, local, anchor_l, ostate, flight_l, resid_l):
  """Fragment f's branch on t_f (prepare with tau = 0, then `merge`), a pass-through elsewhere.

  Returns (pred, updates or zeros, anchor leaves, outer state, residual leaves) of the fragment.
  """
  cfg, lay = call.cfg, call.lay

  def sync(ops):
    params_f, local_f, anchor_f, ostate, flight, resid = ops
    if not cfg.delay:
      source = [p + u.astype(p.dtype) for p, u in zip(params_f, local_f, strict=True)]
      flight, resid = call.wire(anchor_f, source, resid)
    upd, anchor_f, ostate = merge(cfg.outer, flight, ostate, anchor_f, params_f, local_f, cfg.alpha, lay.like(f))
    return upd, anchor_f, ostate, resid

  def hold(ops):
    # anchor, outer state and residual are state: passing them through aliases, no copy.
    _, local_f, anchor_f, ostate, _, resid = ops
    return util.zeros_like(local_f), anchor_f, ostate, resid

  pred = call.step == (f + 1) * (cfg.sync_every // lay.num)
  ops = (
    lay.pick(jax.tree.leaves(params), f),
    lay.pick(local, f),
    lay.pick(anchor_l, f),
    ostate,
    None if flight_l is None else lay.pick(flight_l, f),
    None if resid_l is None else lay.pick(resid_l, f),
  )
  return (pred, *call.run(pred, sync, hold, ops))


def update(cfg: Config, grads, state: DiLoCoState, params, inner_applied, extra_args):
  """One `diloco` update on this replica: (updates, new state). See the module docstring for the order."""
  util.check_params(params, "diloco")
  lay = layout(cfg, params, check=False)
  size = parallel.check_axis_name(cfg.axis_name)
  parallel.check_varying(grads, cfg.axis_name)
  # With H = 1 (so F = 1, tau = 0) every update syncs: straight-line code, no conditional.
  run = (lambda pred, yes, no, ops: yes(ops)) if cfg.sync_every == 1 else parallel.cond
  call = Call(cfg, lay, size, state.local_step + 1, run)
  flight_l = jax.tree.leaves(state.in_flight) if cfg.delay else None
  resid_l = jax.tree.leaves(state.residual) if cfg.error_feedback else None
  if flight_l is not None:  # tau >= 1
    flight_l, resid_l = send_early(call, state, params, flight_l, resid_l)
  local, inner_state = inner_update(cfg.inner, inner_applied, grads, state.inner_state, params, extra_args)
  local_l, anchor_l = jax.tree.leaves(local), jax.tree.leaves(state.anchor)
  updates_l, outer_state, merged = list(local_l), list(state.outer_state), jnp.zeros([], jnp.bool_)
  for f in range(lay.num):
    pred, upd, anchor_f, outer_state[f], resid = merge_fragment(
      call, f, params, local_l, anchor_l, outer_state[f], flight_l, resid_l
    )
    # A fused select, not the local update passed through the branch (XLA would copy it).
    updates_l = lay.put(updates_l, f, [jnp.where(pred, a, b) for a, b in zip(upd, lay.pick(local_l, f), strict=True)])
    anchor_l = lay.put(anchor_l, f, anchor_f)
    if resid_l is not None and not cfg.delay:
      resid_l = lay.put(resid_l, f, resid)
    merged = merged | pred
  new_state = DiLoCoState(
    local_step=jnp.where(call.step >= cfg.sync_every, jnp.zeros_like(call.step), call.step),
    sync_count=state.sync_count + merged.astype(state.sync_count.dtype),
    anchor=lay.treedef.unflatten(anchor_l),
    inner_state=inner_state,
    outer_state=tuple(outer_state),
    in_flight=lay.treedef.unflatten(flight_l) if cfg.delay else None,
    residual=lay.treedef.unflatten(resid_l) if cfg.error_feedback else None,
  )
  return jax.tree.unflatten(jax.tree.structure(local), updates_l), new_state


def inner_update(inner, applied, grads, inner_state, params, extra_args):
  """`inner.update`; where `applied` (traced, from the wrapper) is False a zero update, `inner_state` kept.

  A conditional, not a select. A skipped step's gradient may be non-finite: it
  is replaced by zeros before it enters either branch, so no NaN flows into
  the update or its gradients. `applied=None` (the user's own loop): always.
  """
  if applied is None:
    return inner.update(grads, inner_state, params, **extra_args)
  grads = jax.tree.map(lambda g: jnp.where(applied, g, jnp.zeros_like(g)), grads)

  def apply(ops):
    return inner.update(ops[0], ops[1], params, **extra_args)

  def hold(ops):
    return util.zeros_like(ops[0]), ops[1]  # in the gradient's layout; parallel.cond joins dtypes

  return parallel.cond(applied, apply, hold, (grads, inner_state))
