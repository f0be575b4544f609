"""The inside of `ja.accumulate`: one call's micro-step, the window's end, its reduction.

`accumulate` validates its options into a `Config`; each `update` call then runs
`step`, which follows `_engine.py`'s plan -> local sums -> reduce -> update:

1. which microbatch counts (`which_count`: weights and, with skip_nonfinite, NaN/Inf);
2. the micro-step (`add`): acc <- (new window ? 0 : acc) + w g, and the noise
   statistics' sum w |g|^2 (`noise_micro_step`);
3. at the window's end, in the taken branch of a `lax.cond` (`emit`), the one
   reduction over `axis_name` (`reduce_window`) and `inner` on the mean
   sum w g / sum w (`apply_inner`); on other calls `hold` passes `inner`'s
   state (and with `apply` the parameters) through untouched.

Everything here is traced per call from the config and the call's arguments;
none of it holds state of its own.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxaccum import _tree, _unreduced, noise, parallel


class Config(NamedTuple):
  """`accumulate`'s options, validated (see its docstring for each)."""

  inner: optax.GradientTransformationExtraArgs  # the optimizer of the window's mean, with extra-args support
  every_k: Any  # an int >= 1, a schedule f(update_count) -> int, or a `noise.NoiseScaleEveryK`
  axis_name: Any  # None, or the data axis (bound by pmap/shard_map, or Explicit in the user's own jit)
  accumulator_dtype: Any  # None (the wider of float32 and each gradient's dtype) or a floating dtype
  comm_dtype: Any  # None, or the floating dtype on the wire of the window end's all-reduce
  skip_nonfinite: bool  # drop a microbatch of weight > 0 whose gradient holds a NaN/Inf
  dropped_use_slot: bool  # a dropped microbatch still uses one of the window's slots
  noise_scale_ema: float | None  # the noise statistics' EMA decay; None: not measured
  sample: int | None  # noise_scale_sample: microbatches measured per window (None: all)

  @property
  def tracking(self) -> bool:
    """Whether the noise scale is measured."""
    return self.noise_scale_ema is not None

  @property
  def ema_decay(self) -> float:
    return 0.0 if self.noise_scale_ema is None else self.noise_scale_ema


class Call(NamedTuple):
  """What one `update` call decided at trace time, shared by the window end's branches."""

  grads: Any  # this call's gradients (as arrays)
  extra_args: dict  # passed on to `inner.update`
  apply: bool  # return new params (`apply_gradients`) rather than updates
  single: bool  # every call ends a window (every_k=1 and no slot kept): no cond
  may_be_empty: bool  # some microbatch may not count, so a window can end with total weight 0
  update_shapes: Any  # the abstract updates `inner` gives (for zero updates), or None when never needed
  targets: Any  # unreduced (own jit on an Explicit mesh): each leaf's PartitionSpec after the reduction; else None
  # A call that applies nothing returns this call's gradients as placeholder updates, and `step` selects zeros
  # for them outside the cond (see `_passes_grads`); False: it returns materialised zeros.
  pass_grads: bool = False


def check_k_value(k, what: str) -> None:
  value = np.asarray(k)
  if value.ndim != 0 or not np.issubdtype(value.dtype, np.integer) or value.dtype == np.bool_:
    raise TypeError(f"{what}={k!r} must be an integer >= 1 (a scalar int)")
  if int(value) < 1:
    raise ValueError(f"{what}={int(value)} must be an integer >= 1")


def which_count(grads, weight, acc_grads, acc_weight, skip_nonfinite: bool):
  """Weight checks: which microbatch counts. Returns (keep, dropped), boolean scalars or None.

  weight == 0: a normal microbatch that adds nothing (even a NaN gradient:
  selected, never multiplied by 0). An invalid traced weight (NaN, Inf, < 0):
  dropped and counted. With skip_nonfinite, a NaN/Inf gradient of weight > 0:
  dropped and counted. `keep` is None where every microbatch counts by
  construction, `dropped` None where none can be dropped.
  """
  keep = dropped = None
  acc_dtypes = sorted({x.dtype for x in jax.tree.leaves(acc_grads)} | {acc_weight.dtype}, key=str)
  if weight is not None:
    # Checked in every dtype the weight is cast to: 7e4 is finite in int32 but Inf in a float16 accumulator.
    valid = (weight >= 0) & jnp.all(jnp.stack([jnp.isfinite(weight.astype(d)) for d in acc_dtypes]))
    keep, dropped = valid & (weight > 0), jnp.logical_not(valid)
  if skip_nonfinite:
    # What would be added, w g in the accumulator's dtype: an overflow of the product counts as non-finite.
    if weight is None:
      finite = _tree.all_finite(jax.tree.map(lambda acc, g: g.astype(acc.dtype), acc_grads, grads))
    else:
      finite = _tree.all_finite(
        jax.tree.map(lambda acc, g: g.astype(acc.dtype) * weight.astype(acc.dtype), acc_grads, grads)
      )
    bad_grads = jnp.logical_not(finite) if keep is None else keep & jnp.logical_not(finite)
    keep = finite if keep is None else keep & finite
    dropped = bad_grads if dropped is None else dropped | bad_grads
  return keep, dropped


def add(acc_grads, acc_weight, grads, weight, keep, new_window, scale=None):
  """The micro-step: one fused pass per leaf, acc <- (new window ? 0 : acc) + (keep ? w g : 0).

  The accumulator is reset lazily, on the first add of the next window,
  rather than zeroed at the window's end: that keeps the add outside the
  cond and in place in a donated buffer (XLA copies values that pass
  through a branch, and operands a branch shares with an in-place write).
  Returns (acc_grads, acc_weight, w), w this microbatch's counted weight.
  `scale(g, w)` multiplies a gradient by the weight (unreduced gradients need
  the weight cast to reduced first, see `_unreduced.scale`).
  """

  def add_leaf(acc, g):
    if acc.size == 0:  # nothing to add (and an empty unreduced accumulator is an ordinary array: _unreduced.zeros)
      return acc
    g = g.astype(acc.dtype)
    if weight is not None:
      g = g * weight.astype(acc.dtype) if scale is None else scale(g, weight)
    if keep is not None:
      g = jnp.where(keep, g, jnp.zeros_like(g))  # NaN * 0 is NaN: select, don't scale.
    return jnp.where(new_window, jnp.zeros_like(acc), acc) + g

  new_acc = jax.tree.map(add_leaf, acc_grads, grads)
  w = jnp.ones([], acc_weight.dtype) if weight is None else weight.astype(acc_weight.dtype)
  if keep is not None:
    w = jnp.where(keep, w, jnp.zeros_like(w))
  new_weight = jnp.where(new_window, jnp.zeros_like(w), acc_weight) + w
  return new_acc, new_weight, w


def sum_over_shards(sq_by_leaf, leaves, dtype, axis_name):
  """sum of per-leaf squared norms, each leaf's partial norm summed over the manual axes it is sharded on.

  Inside a `jax.shard_map` manual over (data, model), a tensor-parallel leaf's
  gradient is varying over "model": its squared norm on one device covers only
  its model shard, and the shards' must be added (a scalar psum over "model"). A
  leaf invariant over "model" is whole on every device and must not be added
  twice. Leaves are grouped by the extra axes (besides `axis_name`, whose sum
  the window end does) and each group's scalar is psummed once. Without such
  leaves this is the plain sum in leaf order (bit for bit as before).
  """
  own = set(_unreduced.names(axis_name)) if axis_name is not None else set()
  groups: dict[tuple, Any] = {}
  for sq, leaf in zip(sq_by_leaf, leaves, strict=True):
    extra = tuple(sorted((parallel._varying_axes(leaf) or frozenset()) - own))  # noqa: SLF001
    groups[extra] = (groups[extra] if extra in groups else jnp.zeros([], dtype)) + sq
  total = groups.pop((), jnp.zeros([], dtype))
  for extra, sq in groups.items():
    total = total + lax.psum(sq, extra)
  return total


def leaf_sq(x):
  """sum(x^2) of one leaf."""
  return jnp.sum(x * x)


def noise_micro_step(stats, acc_grads, grads, w, new_window, axis_name=None, sample=None):
  """Noise statistics of one microbatch: sum_i w_i |g_i|^2 and K, per device, reset lazily like acc_weight.

  The squared norm reads the same cast gradient as the add; XLA:CPU does not
  fuse the two (a second read of the gradient: +16% per window at 8-row
  microbatches, +2-3% at 128 rows; a dot instead of sum(g*g) is no faster).
  With `sample=m` only the window's first m microbatches of weight > 0 on this
  device are measured, under a `lax.cond`: the others skip the read.
  """
  leaves = jax.tree.leaves(grads)

  def leaf_sqs(leaves):
    accs = jax.tree.leaves(acc_grads)
    return [leaf_sq(g.astype(acc.dtype)).astype(w.dtype) for acc, g in zip(accs, leaves, strict=True)]

  count = jnp.where(new_window, jnp.zeros_like(stats.acc_count), stats.acc_count)
  counted = w > 0
  if sample is None:
    sqs = leaf_sqs(leaves)
  else:
    counted = counted & (count < sample)
    # The psum over tensor-parallel shards stays outside the cond (scalars: 0 where not measured).
    sqs = lax.cond(counted, leaf_sqs, lambda leaves: [jnp.zeros([], w.dtype) for _ in leaves], leaves)
  sq = sum_over_shards(sqs, leaves, w.dtype, axis_name)
  sq = jnp.where(counted, w * sq, jnp.zeros_like(sq))  # a NaN gradient of weight 0: selected out.
  stats = stats._replace(
    acc_sq=jnp.where(new_window, jnp.zeros_like(sq), stats.acc_sq) + sq,
    acc_count=count + counted.astype(stats.acc_count.dtype),
  )
  if sample is not None:
    sampled = jnp.where(new_window, jnp.zeros_like(stats.acc_sampled_weight), stats.acc_sampled_weight)
    stats = stats._replace(acc_sampled_weight=sampled + jnp.where(counted, w, jnp.zeros_like(w)))
  return stats


def noise_window_end(stats, norm_of, acc_weight, window_sq, window_count, ema_decay: float, axis_name=None):
  """The window's noise estimates from its (all-reduced) sums, folded into the EMAs.

  |g|^2 of the window's mean comes from the all-reduced sum: the same on every
  device. `norm_of = (tree, scale)`: |g|^2 = scale^2 |tree|^2, the tree being
  the window's sum sum_i w_i g_i with scale 1 / sum_i w_i where the sum exists
  (its square then fuses into the one read of the sum, where squaring the mean
  would materialise mean * mean beside the mean `inner` reads), else the mean.
  Sampled (`window_sq` a pair: sum_S w |g|^2 and B_S), the sampled estimator.
  """
  tree, scale = norm_of
  leaves = jax.tree.leaves(tree)
  dtype = acc_weight.dtype
  mean_sq = sum_over_shards([leaf_sq(x.astype(dtype)) for x in leaves], leaves, dtype, axis_name)
  mean_sq = mean_sq * jnp.square(jnp.asarray(scale, dtype))
  if isinstance(window_sq, tuple):
    sq, sampled_weight = window_sq
    grad_sq, trace_cov, valid = noise.sampled_window_estimates(sq, sampled_weight, window_count, acc_weight, mean_sq)
  else:
    grad_sq, trace_cov, valid = noise.window_estimates(window_sq, acc_weight, mean_sq, window_count)
  return noise.update_state(stats, grad_sq, trace_cov, valid, ema_decay)


def window_length(cfg: Config, state):
  """The current window's length k: an int, or a traced int32 >= 1 (a schedule, the noise scale's)."""
  every_k = cfg.every_k
  update_count = state.update_count
  if isinstance(every_k, noise.NoiseScaleEveryK):
    # The averages change only at window ends, so k does too.
    return every_k(noise.noise_scale(state.noise_stats))
  if not callable(every_k):
    return every_k
  k = every_k(update_count)
  if _tree.is_concrete(k):
    # A schedule may return a constant while the count is traced (under jit).
    at = int(update_count) if _tree.is_concrete(update_count) else "update_count"
    check_k_value(k, f"every_k({at})")
  return jnp.maximum(jnp.asarray(k, jnp.int32), 1)


def noise_args(cfg: Config, stats, batch_weight) -> dict:
  """The extra arguments `inner` gets when the noise scale is measured (`ja.adascale` reads them)."""
  if not cfg.tracking:
    return {}
  return {"noise_scale": noise.noise_scale(stats), "batch_weight": batch_weight}


def step(cfg: Config, grads, state, params, weight, extra_args, apply: bool, unreduced: bool):
  """One microbatch, its arguments checked (see `accumulate._checked_step`). Returns (updates or params, state).

  With `apply` the window end applies the update to `params` inside the same
  branch that runs `inner`, and a micro-step passes `params` through: no
  params-sized zero updates are materialised and nothing is written to the
  parameters. `unreduced`: the user's own jit on an Explicit mesh (`_unreduced`).
  """
  keep, dropped = which_count(grads, weight, state.acc_grads, state.acc_weight, cfg.skip_nonfinite)
  num_skipped = state.num_skipped
  if dropped is not None:
    num_skipped = num_skipped + dropped.astype(jnp.int32)
  new_window = state.micro_step == 0
  scale = (lambda g, w: _unreduced.scale(g, w, cfg.axis_name)) if unreduced else None
  acc_grads, acc_weight, w = add(state.acc_grads, state.acc_weight, grads, weight, keep, new_window, scale)
  stats = state.noise_stats
  if cfg.tracking:
    stats = noise_micro_step(stats, state.acc_grads, grads, w, new_window, cfg.axis_name, cfg.sample)

  k = window_length(cfg, state)
  # Without dropped_use_slot, a dropped microbatch does not advance the window
  # (optax.MultiSteps' should_skip_update_fn): even k = 1 then needs the cond.
  slot_may_be_kept = not cfg.dropped_use_slot and dropped is not None
  single = isinstance(k, int) and k == 1 and not slot_may_be_kept
  # A window can end empty (total weight 0) only if some microbatch may not count;
  # a window-end call that counts by construction (weight 1) makes it non-empty.
  call = _plan(cfg, grads, state, params, stats, acc_weight, extra_args, apply, unreduced, single, keep is not None)
  call = call._replace(pass_grads=call.update_shapes is not None and _passes_grads(cfg, call))

  operands = (acc_grads, acc_weight, state.inner_state, params, stats)
  if single:
    out, inner_state, updated, stats = emit(cfg, call, operands)
    is_last = jnp.asarray(True)
    micro_step = jnp.zeros_like(state.micro_step)
  else:
    step_size = 1 if not slot_may_be_kept else jnp.logical_not(dropped).astype(state.micro_step.dtype)
    micro_step = state.micro_step + step_size
    is_last = micro_step >= k
    branches = functools.partial(emit, cfg, call), functools.partial(hold, call)
    out, inner_state, updated, stats = parallel.cond(is_last, *branches, operands)
    micro_step = jnp.where(is_last, jnp.zeros_like(micro_step), micro_step)
  out = select_updates(call, out, updated)
  empty = is_last & jnp.logical_not(updated)
  return out, state._replace(
    micro_step=micro_step,
    update_count=state.update_count + updated.astype(state.update_count.dtype),
    acc_grads=acc_grads,
    acc_weight=acc_weight,
    inner_state=inner_state,
    num_skipped=num_skipped,
    num_empty_windows=state.num_empty_windows + empty.astype(state.num_empty_windows.dtype),
    updated=updated,
    noise_stats=stats,
  )


def _plan(cfg: Config, grads, state, params, stats, acc_weight, extra_args, apply, unreduced, single, may_be_empty):
  """The call's `Call`: where the mean lands and the shapes of the updates `inner` gives (trace time only)."""
  # Where the window's mean lands: each parameter's own sharding (a leaf sharded
  # over the axis is reduce-scattered), replicated when no params are given.
  targets = None
  if unreduced:
    if params is None:
      targets = jax.tree.map(lambda _: P(), grads)
    else:
      targets = jax.tree.map(lambda g, p: _unreduced.target_spec(p), grads, params)
  update_shapes = None
  if not apply and (may_be_empty or not single):
    # The dtypes (and shardings) `inner` gives its updates (trace time only),
    # so that the zero updates of a call that applies nothing have the same ones.
    def reduced_like(g, t):
      return jax.reshard(g, t) if unreduced else g

    update_shapes = jax.eval_shape(
      lambda g, s, p, ns: cfg.inner.update(
        jax.tree.map(reduced_like, g, targets if unreduced else g),
        s,
        p,
        **extra_args,
        **noise_args(cfg, ns, acc_weight),
      )[0],
      grads,
      state.inner_state,
      params,
      stats,
    )
  return Call(grads, extra_args, apply, single, may_be_empty, update_shapes, targets)


def _passes_grads(cfg: Config, call: Call) -> bool:
  """Whether a call that applies nothing may return its gradients in place of zero updates (selected out later).

  Through the plain API a micro-step's zero updates are decided at run time, so
  returned from the cond they are written as a params-sized buffer, read again
  by the caller's `apply_updates`. Returning this call's gradient buffers
  instead (the add into the accumulator has just read them; passed through the
  cond, not copied) and selecting `where(updated, u, 0)` after the cond lets
  XLA fuse the select into the caller's `apply_updates`: no zeros are written.
  (Passing the accumulator instead would make XLA copy it: it is also the
  state's output.) A gradient that XLA would otherwise fuse into the add (an
  elementwise one, no dot or reduction behind it) is then materialised; a
  layer's weight and bias gradients are materialised anyway. Only inside a jit
  (eager calls fuse nothing) and where the gradient has the update's exact
  type: the same shape and dtype, no mesh axis in its sharding and no varying
  manual axis (without `axis_name`, not in the user's own jit on an Explicit mesh).
  """
  if cfg.axis_name is not None or call.targets is not None or call.apply:
    return False
  for g, u in zip(jax.tree.leaves(call.grads), jax.tree.leaves(call.update_shapes), strict=True):
    if not isinstance(g, jax.core.Tracer) or jnp.shape(g) != u.shape or jnp.result_type(g) != u.dtype:
      return False
    aval = jax.typeof(g)
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if (spec is not None and any(axis is not None for axis in spec)) or getattr(aval, "vma", None):
      return False
  return True


def select_updates(call: Call, out, updated):
  """The updates of a call whose idle branches passed the gradients through: zeros unless `updated`."""
  if not call.pass_grads:
    return out
  return jax.tree.map(lambda u: jnp.where(updated, u, jnp.zeros([], u.dtype)), out)


def idle(call: Call, acc_grads, params):
  """What a call that applies nothing returns: zero updates, or the parameters as they are.

  The zeros carry each parameter's sharding, as the window end's updates do
  (under Explicit mesh axes the two branches of the cond must agree on it),
  but not the local accumulator's varying axes (see `_tree.zeros_like_sharded`).
  """
  if call.apply:
    return params
  if call.pass_grads:  # selected out after the cond (`select_updates`)
    return call.grads
  if call.targets is not None:  # unreduced: the accumulator's type is not the updates' (see `targets`)
    return jax.tree.map(lambda u, t: jnp.zeros(u.shape, u.dtype, out_sharding=t), call.update_shapes, call.targets)
  return jax.tree.map(lambda a, u: _tree.zeros_like_sharded(a, u.dtype), acc_grads, call.update_shapes)


def emit(cfg: Config, call: Call, operands):
  """The window's end: all-reduce, mean, `inner`. Runs only in the taken branch.

  (acc_grads, acc_weight, inner_state, params, stats) -> (updates or params, inner_state, updated, stats),
  as `hold`.
  """
  acc_grads, acc_weight, inner_state, params, stats = operands
  window_sq = window_count = None
  if cfg.tracking:
    window_sq, window_count = stats.acc_sq, stats.acc_count
    if cfg.sample is not None:
      window_sq = (stats.acc_sq, stats.acc_sampled_weight)
  mean, acc_weight, window_sq, window_count, norm_of = reduce_window(
    cfg, acc_grads, acc_weight, window_sq, window_count, call.targets
  )
  if cfg.tracking:
    stats = noise_window_end(stats, norm_of, acc_weight, window_sq, window_count, cfg.ema_decay, cfg.axis_name)

  inner_operands = (mean, acc_weight, inner_state, params)
  if call.may_be_empty:
    # Under axis_name the all-reduced total decides: the same on every device.
    branches = functools.partial(apply_inner, cfg, call, stats), functools.partial(skip_inner, call)
    out = parallel.cond(acc_weight > 0, *branches, inner_operands)
  else:
    out = apply_inner(cfg, call, stats, inner_operands)
  return (*out, stats)


def apply_inner(cfg: Config, call: Call, stats, operands):
  """`inner` on the window's mean: (updates or new params, inner_state, True)."""
  mean, acc_weight, inner_state, params = operands
  if call.single and cfg.axis_name is None:
    # The mean of one microbatch is its gradient: pass it as it is, so that
    # every_k=1 is `inner` bit for bit (w g / w need not round back to g).
    mean = call.grads
  else:
    mean = jax.tree.map(lambda m, g: m.astype(g.dtype), mean, call.grads)
  updates, inner_state = cfg.inner.update(
    mean, inner_state, params, **call.extra_args, **noise_args(cfg, stats, acc_weight)
  )
  return (optax.apply_updates(params, updates) if call.apply else updates), inner_state, jnp.asarray(True)


def skip_inner(call: Call, operands):
  """An empty window (total weight 0): nothing applied, `inner`'s state untouched."""
  acc_grads, _, inner_state, params = operands
  return idle(call, acc_grads, params), inner_state, jnp.asarray(False)


def hold(call: Call, operands):
  """A micro-step: `inner`'s state (and with `apply` the parameters) pass through untouched.

  Passed-through operands are aliased by XLA when the caller donates them: no copy.
  """
  acc_grads, _, inner_state, params, stats = operands
  return idle(call, acc_grads, params), inner_state, jnp.asarray(False), stats


def reduce_window(cfg: Config, acc_grads, acc_weight, window_sq, window_count, targets):
  """The window's mean sum w g / sum w, its total weight sum w and noise scalars, reduced over `axis_name`.

  Returns (mean in the accumulator's dtypes, total weight, window_sq, window_count,
  norm_of): `norm_of = (tree, scale)` with mean = scale * tree, the reduced sums
  and 1 / total where they exist (see `noise_window_end`), else (mean, 1).
  Without `axis_name`: the local mean. Under pmap/shard_map: one all-reduce
  of (sum w g, sum w), the noise statistics' two scalars riding along with the
  weight (no extra collective). With `comm_dtype` the wire is normalised: the
  scalars are all-reduced first, then each device sends its share
  (sum_local w g) / (sum w) of the mean, so a float16 wire does not overflow on
  token-count weights (the sum w g itself can exceed 65504 while the mean is
  small); the weight never crosses in comm_dtype (a token count in bf16 is
  exact only up to 256). Unreduced (the user's own jit on an Explicit mesh,
  `targets` given): the total weight is already global (weights are
  replicated), and each leaf is reduced once into its target sharding.
  """

  def divide(sums, total):
    safe = jnp.where(total > 0, total, jnp.ones_like(total))  # an empty window: no 0/0 (it applies nothing)
    return jax.tree.map(lambda a: a / safe.astype(a.dtype), sums)

  def of_sums(sums, total, mean):
    if jnp.finfo(total.dtype).bits < 32:  # a float16 sum squared overflows where the mean squared does not
      return mean, 1
    return sums, 1 / jnp.where(total > 0, total, jnp.ones_like(total))

  if cfg.axis_name is None:
    mean = divide(acc_grads, acc_weight)
    return mean, acc_weight, window_sq, window_count, of_sums(acc_grads, acc_weight, mean)
  if targets is not None:
    if cfg.comm_dtype is None:
      sums = jax.tree.map(lambda a, t: _unreduced.reduce(a, cfg.axis_name, t), acc_grads, targets)
      mean = divide(sums, acc_weight)
      return mean, acc_weight, window_sq, window_count, of_sums(sums, acc_weight, mean)
    safe = jnp.where(acc_weight > 0, acc_weight, jnp.ones_like(acc_weight))
    mean = jax.tree.map(
      lambda a, t: _unreduced.reduce(_unreduced.scale(a, 1 / safe, cfg.axis_name), cfg.axis_name, t, cfg.comm_dtype),
      acc_grads,
      targets,
    )
    return mean, acc_weight, window_sq, window_count, (mean, 1)
  scalars = acc_weight
  sampled = isinstance(window_sq, tuple)  # noise_scale_sample: (sum_S w |g|^2, B_S), one scalar more
  if cfg.tracking:
    noise_sums = list(window_sq) if sampled else [window_sq]
    scalars = jnp.stack([acc_weight, *noise_sums, window_count.astype(acc_weight.dtype)])
  if cfg.comm_dtype is None:
    sums, scalars = lax.psum((acc_grads, scalars), cfg.axis_name)
    total = scalars[0] if cfg.tracking else scalars
    mean = divide(sums, total)
    norm_of = of_sums(sums, total, mean)
  else:
    scalars = lax.psum(scalars, cfg.axis_name)
    total = scalars[0] if cfg.tracking else scalars
    mean = parallel.all_reduce_sum(divide(acc_grads, total), cfg.axis_name, cfg.comm_dtype)
    norm_of = (mean, 1)
  if cfg.tracking:
    window_sq = (scalars[1], scalars[2]) if sampled else scalars[1]
    return mean, total, window_sq, scalars[-1], norm_of
  return mean, total, None, None, norm_of
