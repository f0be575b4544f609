"""Flax integration: a linen `TrainState` and an nnx optimizer whose step counts updates.

The trap this module exists for. `flax.training.train_state.TrainState.step`
and `nnx.Optimizer.step` count calls of `apply_gradients`/`update`. With
`optax.MultiSteps(inner, k)` as the optimizer every call is a micro-step, so
`step` runs k times faster than the number of real updates, and a learning-rate
schedule, a warm-up or a "checkpoint every N steps" keyed on it is k times too
fast. Here `step` counts completed updates (windows that applied `inner`) and
`micro_step` the position inside the current window.

On a micro-step the parameters are not written at all: `ja.accumulate`'s
window-end branch applies the update to the parameters itself (one `lax.cond`
for `inner` and the write), and its micro-step branch passes the (donated)
parameter buffers through. So a micro-step costs the gradient plus one add
into the accumulator, with no params-sized zero updates in between.

BatchNorm. Each microbatch's forward pass computes new running statistics
`s_i = m * s + (1 - m) * stat_i` from the window-start statistics `s`. Feeding
them with `apply_gradients(..., batch_stats=s_i, weight=w_i)` accumulates
sum_i w_i s_i; at the window's end the state's statistics become the weighted
mean sum_i w_i s_i / sum_i w_i = m * s + (1 - m) * mean_w(stat_i), and until
then they stay at `s`, so every microbatch of a window starts from the same
statistics. What that mean is, against statistics of the whole window's batch:
with weights equal to the microbatch sizes the running *mean* is exactly the
full-batch one; the running *variance* is the mean of the within-microbatch
variances, smaller than the full-batch variance by the (weighted) variance of
the microbatch means (law of total variance). That is also what the model
normalised with during training, since BatchNorm in training mode uses each
microbatch's own statistics. A microbatch that `accumulate` drops (a NaN,
infinite or negative traced weight, or under `skip_nonfinite=True` a
non-finite gradient; counted in `num_skipped`) takes its statistics with it;
one of weight 0 (padding only) adds exactly nothing, selected out rather than
multiplied by 0, so NaN statistics from an empty microbatch cannot leak; and a
window of total weight 0 leaves parameters, `inner`'s optimizer state,
statistics and `step` as they were (the window's own counters move on:
`micro_step` resets and `num_empty_windows` counts it).

Counters. `step` counts updates (for schedules and checkpoints);
`microbatches_seen` counts every microbatch fed, for per-microbatch
randomness: `jax.random.fold_in(rng, state.microbatches_seen)`.

`ja.accumulate` must be the outermost transformation: clipping, weight decay
and schedules go inside it (`ja.accumulate(optax.chain(clip, adam), k)`), so
they act once per window on the mean gradient; the constructors refuse an
`accumulate` nested in another transformation.
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
import flax.struct as struct
import flax.training.train_state as flax_train_state
import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxaccum import _tree, _unreduced, parallel
from jaxaccum.accumulate import AccumulateState

__all__ = ["TrainState", "AccumulatingOptimizer"]


# --------------------------------------------------------------------------- shared


def _apply_accumulated(tx, grads, opt_state, params, weight, extra_args):
  """(new params, new opt_state) for one microbatch, with no parameter write on micro-steps.

  `ja.accumulate` offers a fused `update.apply_gradients`; any other
  transformation whose state is an `AccumulateState` gets `update` followed by
  a `lax.cond` on `updated` that keeps the parameters on micro-steps.
  """
  fused = getattr(tx.update, "apply_gradients", None)
  if fused is not None and getattr(fused, "update", None) is tx.update:
    return fused(grads, opt_state, params, weight=weight, **extra_args)
  updates, opt_state = tx.update(grads, opt_state, params, weight=weight, **extra_args)
  params = parallel.cond(
    opt_state.updated, lambda ops: optax.apply_updates(*ops), lambda ops: ops[0], (params, updates)
  )
  return params, opt_state


def _check_tx(tx, owner: str) -> None:
  """A clear TypeError for what is not an optax transformation: None, or a factory not called."""
  if hasattr(tx, "init") and hasattr(tx, "update"):
    return
  example = "ja.accumulate(optax.adam(1e-3), 4)"
  if tx is None:
    raise TypeError(f"tx=None: {owner} needs an optax GradientTransformation, e.g. tx={example}")
  if callable(tx):
    name = getattr(tx, "__qualname__", None) or repr(tx)
    raise TypeError(
      f"tx={name} is a function (an optax factory, not called?), not a GradientTransformation: "
      f"call it with its hyperparameters, e.g. tx={example}"
    )
  raise TypeError(f"tx={tx!r} must be an optax GradientTransformation, e.g. tx={example}")


def _check_accumulate_outermost(opt_state, owner: str) -> None:
  """Refuses a `ja.accumulate` nested inside another transformation (e.g. `optax.chain(clip, accumulate)`).

  Only an outermost `accumulate` lets `step` count updates, take `weight=`
  and skip the parameter write. And whatever is chained *before* it runs on
  every microbatch's gradient, not on the window's mean gradient: clipping
  there clips each microbatch, a different (and batch-size dependent)
  algorithm.
  """
  if isinstance(opt_state, AccumulateState):
    return
  found = [
    path
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state, is_leaf=lambda x: isinstance(x, AccumulateState))
    if isinstance(leaf, AccumulateState)
  ]
  if found:
    raise ValueError(
      f"tx holds ja.accumulate inside another transformation (its AccumulateState is at "
      f"opt_state{jax.tree_util.keystr(found[0])}; the state is a {type(opt_state).__name__}). {owner} needs "
      "ja.accumulate outermost, with everything else inside it: write "
      "ja.accumulate(optax.chain(optax.clip_by_global_norm(1.0), adam), k) instead of "
      "optax.chain(optax.clip_by_global_norm(1.0), ja.accumulate(adam, k)). Transformations chained before "
      "accumulate run on every microbatch's gradient, so that clips each microbatch instead of the window's "
      "mean gradient once per update (the bug Keras 3 shipped, keras#19990), and step would count "
      "micro-steps and weight= could not be passed."
    )


def _distinct(x):
  """A copy in its own buffer, for a value stored twice in a state (see `TrainState.create`).

  A state holding one buffer in two places cannot be donated: XLA refuses to
  donate a buffer twice (and crashes on a multi-device mesh).
  """
  return jax.tree.map(lambda a: jnp.array(a, copy=True), x)


def _take(weight, dtype, kept):
  """(take, w): whether this microbatch's statistics count, and their weight (0 when not taken).

  Taken when `accumulate` kept the microbatch (`kept`: `num_skipped` did not
  grow, so it was neither non-finite under skip_nonfinite nor of an invalid
  weight) and its weight is finite and > 0. A microbatch of weight 0 (all
  padding) adds nothing, even with NaN statistics.
  """
  w = jnp.ones([], dtype) if weight is None else jnp.asarray(weight).astype(dtype)
  take = jnp.logical_and(kept, jnp.logical_and(jnp.isfinite(w), w > 0))
  return take, jnp.where(take, w, jnp.zeros_like(w))


def _accumulate_stats(new_stats, stats_sum, stats_weight, weight, new_window, kept):
  """sum <- (new window ? 0 : sum) + w s_i, and the same for the weight (lazy reset, as accumulate does).

  A microbatch that is not taken (`_take`) adds exactly nothing: selected
  out, never multiplied by 0 (NaN * 0 is NaN).
  """
  take, w = _take(weight, stats_weight.dtype, kept)

  def add(acc, s):
    s = s.astype(acc.dtype) * w.astype(acc.dtype)
    return jnp.where(new_window, jnp.zeros_like(acc), acc) + jnp.where(take, s, jnp.zeros_like(s))

  stats_sum = jax.tree.map(add, stats_sum, new_stats)
  stats_weight = jnp.where(new_window, jnp.zeros_like(stats_weight), stats_weight) + w
  return stats_sum, stats_weight


def _kept(old_opt_state, new_opt_state):
  """False when `accumulate` just dropped the microbatch (non-finite, or an invalid weight)."""
  return new_opt_state.num_skipped == old_opt_state.num_skipped


def _stats_accumulator(stats):
  acc = jax.tree.map(lambda s: jnp.zeros(jnp.shape(s), _tree.accumulator_dtype(jnp.result_type(s))), stats)
  weight = jnp.zeros([], _tree.widest(x.dtype for x in jax.tree.leaves(acc)))
  return acc, weight


def _window_mean(stats_sum, stats_weight, like, axis_name):
  """The window's weighted mean of the statistics; `like` (the window-start ones) when nothing was kept."""
  if axis_name is not None:
    stats_sum, stats_weight = lax.psum((stats_sum, stats_weight), axis_name)
  has_data = stats_weight > 0
  safe = jnp.where(has_data, stats_weight, jnp.ones_like(stats_weight))
  return jax.tree.map(
    lambda a, s: jnp.where(has_data, (a / safe.astype(a.dtype)).astype(jnp.result_type(s)), s), stats_sum, like
  )


# --------------------------------------------------------------------------- linen


class TrainState(flax_train_state.TrainState):
  """A linen `TrainState` for `tx=ja.accumulate(inner, k)`: honest steps, no writes on micro-steps.

  `TrainState.create(apply_fn=..., params=..., tx=ja.accumulate(inner, k),
  batch_stats=None)`; then one `apply_gradients(grads=..., weight=None,
  batch_stats=None)` per microbatch. With any other optax `tx` it behaves as
  flax's `TrainState` (`step` counts calls, `weight` is refused). `accumulate`
  must be the outermost transformation (`create` refuses
  `optax.chain(..., ja.accumulate(...))`).

  Subclass it as flax's (`class TrainState(ja.flax.TrainState): batch_stats:
  Any`, or new fields without defaults): the fields below are keyword-only.

  Attributes (besides flax's `apply_fn`, `params`, `tx`, `opt_state`):
    step: int32 scalar, completed updates (`opt_state.update_count`); with a
      plain `tx`, calls of `apply_gradients`. Key schedules and checkpoints on it.
    microbatches_seen: int32 scalar, calls of `apply_gradients` (every
      microbatch fed, dropped ones included). Key per-microbatch randomness on
      it: `jax.random.fold_in(rng, state.microbatches_seen)` gives each
      microbatch its own dropout key, where `fold_in(rng, state.step)` gives
      the k microbatches of a window the same one.
    micro_step: (property) microbatches already in the current window; 0 right
      after an update.
    batch_stats: BatchNorm running statistics (a linen `batch_stats`
      collection) or None. Constant within a window; at its end the weighted
      mean of the statistics fed with each microbatch (module docstring).
    batch_stats_sum: sum_i w_i s_i over the window (accumulator dtype), reset
      lazily on the first microbatch of the next window.
    batch_stats_weight: sum_i w_i, reset like `batch_stats_sum`.
    axis_name: (static) inside pmap/shard_map, the data axis over which the
      window-end statistics are also averaged (one psum of the small stats
      tree per window). Parameters are averaged by `ja.accumulate(...,
      axis_name=...)`, not here.

  Every array of the state is its own buffer (`step` is a copy of
  `opt_state.update_count`, not the same array), so the whole state can be
  donated to a jitted step.
  """

  batch_stats: Any = struct.field(default=None, kw_only=True)
  batch_stats_sum: Any = struct.field(default=None, kw_only=True)
  batch_stats_weight: Any = struct.field(default=None, kw_only=True)
  microbatches_seen: Any = struct.field(default=None, kw_only=True)
  axis_name: Any = struct.field(pytree_node=False, default=None, kw_only=True)

  @property
  def micro_step(self) -> jax.Array:
    if isinstance(self.opt_state, AccumulateState):
      return self.opt_state.micro_step
    return jnp.zeros([], jnp.int32)

  @classmethod
  def create(cls, *, apply_fn, params, tx, batch_stats=None, axis_name=None, **kwargs):
    """A fresh state: `step` 0, `opt_state = tx.init(params)`, a zero statistics accumulator.

    Args:
      apply_fn: usually `model.apply`.
      params: the parameters `tx` updates.
      tx: `ja.accumulate(inner, k)`, outermost (any optax transformation
        without an `accumulate` inside works, as in flax).
      batch_stats: the model's initial `batch_stats` collection, or None.
      axis_name: see the class docstring.
      **kwargs: further fields of a subclass.

    Raises:
      TypeError: `tx` is not an optax transformation (None, or a factory such
        as `optax.adam` not called).
      ValueError: `tx` holds a `ja.accumulate` that is not outermost, e.g.
        `optax.chain(optax.clip_by_global_norm(1.0), ja.accumulate(adam, k))`.
    """
    _check_tx(tx, "TrainState.create")
    if axis_name is not None:
      parallel.validate_axis_name(axis_name)
    opt_state = tx.init(params)
    _check_accumulate_outermost(opt_state, "ja.flax.TrainState")
    stats_sum = stats_weight = None
    if batch_stats is not None:
      stats_sum, stats_weight = _stats_accumulator(batch_stats)
    if isinstance(opt_state, AccumulateState):
      step = _distinct(opt_state.update_count)
    else:
      step = jnp.zeros([], jnp.int32)
    return cls(
      step=step,
      apply_fn=apply_fn,
      params=params,
      tx=tx,
      opt_state=opt_state,
      batch_stats=batch_stats,
      batch_stats_sum=stats_sum,
      batch_stats_weight=stats_weight,
      microbatches_seen=jnp.zeros([], jnp.int32),
      axis_name=axis_name,
      **kwargs,
    )

  def _seen_plus_one(self):
    seen = jnp.zeros([], jnp.int32) if self.microbatches_seen is None else self.microbatches_seen
    return seen + 1

  def apply_gradients(self, *, grads, weight=None, batch_stats=None, **kwargs):
    """Feeds one microbatch: its gradient, its weight and (with BatchNorm) its new statistics.

    Args:
      grads: the microbatch's gradient, the structure of `params`.
      weight: the microbatch's weight w_i (e.g. its number of examples or
        tokens); None means 1. The window's update uses sum w_i g_i / sum w_i.
        Under jit, a microbatch of weight 0 adds nothing (its gradient and
        statistics may be NaN); a NaN, infinite or negative weight drops the
        microbatch (counted in `opt_state.num_skipped`); a window of total
        weight 0 applies nothing (`params`, `opt_state`'s inner state,
        `batch_stats` and `step` stay; counted in
        `opt_state.num_empty_windows`).
      batch_stats: the `batch_stats` collection returned by this microbatch's
        training-mode forward pass (computed from `self.batch_stats`).
      **kwargs: other fields to `replace`.

    Returns:
      The new state. On a micro-step `params` are the same buffers, `step` is
      unchanged and `micro_step` is one more; on a window's last microbatch
      `params` take the update, `step` is one more (unless the window was
      empty) and `micro_step` is 0. `microbatches_seen` is always one more.

    Raises:
      TypeError: `weight` with a `tx` that is not `ja.accumulate`.
      ValueError: `batch_stats` given to a state created without them, or not
        matching them; grads not matching `params`; a concrete `weight` that
        is negative or not finite.
    """
    if batch_stats is not None:
      if self.batch_stats is None:
        raise ValueError(
          "batch_stats were given but this TrainState was created without them: "
          "pass TrainState.create(..., batch_stats=variables['batch_stats'])"
        )
      _tree.check_same_structure(batch_stats, self.batch_stats, "batch_stats", "state.batch_stats")
    seen = self._seen_plus_one()

    if not isinstance(self.opt_state, AccumulateState):
      # A plain optax transformation: flax's semantics, step counts calls.
      if weight is not None:
        raise TypeError(
          f"{weight=} needs tx=ja.accumulate(...); this TrainState's tx is not one (its state "
          f"is a {type(self.opt_state).__name__})"
        )
      _tree.check_same_structure(grads, self.params, "grads", "state.params")
      _unreduced.refuse(grads, "ja.flax.TrainState.apply_gradients (tx is plain optax)")
      updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
      extra = {} if batch_stats is None else {"batch_stats": batch_stats}
      return self.replace(
        step=self.step + 1,
        params=optax.apply_updates(self.params, updates),
        opt_state=opt_state,
        microbatches_seen=seen,
        **extra,
        **kwargs,
      )

    _tree.check_same_structure(grads, self.params, "grads", "state.params")
    new_window = self.opt_state.micro_step == 0
    # Skip the write on micro-steps: the parameters pass through the untaken
    # branch (aliased when donated, no copy), where `params + 0` would read and
    # write every parameter.
    params, opt_state = _apply_accumulated(self.tx, grads, self.opt_state, self.params, weight, {})
    extra = {}
    if batch_stats is not None:
      stats_sum, stats_weight = _accumulate_stats(
        batch_stats, self.batch_stats_sum, self.batch_stats_weight, weight, new_window, _kept(self.opt_state, opt_state)
      )
      window_end = opt_state.micro_step == 0
      new_stats = parallel.cond(
        window_end,
        lambda ops: _window_mean(ops[0], ops[1], ops[2], self.axis_name),
        lambda ops: ops[2],
        (stats_sum, stats_weight, self.batch_stats),
      )
      extra = {"batch_stats": new_stats, "batch_stats_sum": stats_sum, "batch_stats_weight": stats_weight}
    # `step` in its own buffer: the same array in two places could not be donated.
    return self.replace(
      step=_distinct(opt_state.update_count),
      params=params,
      opt_state=opt_state,
      microbatches_seen=seen,
      **extra,
      **kwargs,
    )


# --------------------------------------------------------------------------- nnx


class AccumulatingOptimizer(nnx.Optimizer):
  """`nnx.Optimizer` for `tx=ja.accumulate(inner, k)`: `step` counts updates, micro-steps keep params.

  Usage, under `nnx.jit`::

    optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.adam(1e-3), 4), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y, weight):
      grads = nnx.grad(loss_fn)(model, x, y)
      optimizer.update(model, grads, weight=weight)

  `step` (an `OptState` variable, as in `nnx.Optimizer`) is the number of
  completed updates; `micro_step` the position in the window. Variables of
  `batch_stats` (default `nnx.BatchStat`, e.g. BatchNorm's running mean and
  variance) are averaged over the window as in the linen `TrainState`: each
  training-mode forward pass writes new statistics into the model; `update`
  adds them (weighted) to a running sum, puts the window-start statistics back
  on micro-steps and writes the weighted mean at the window's end. So change
  those variables only through forward passes followed by `update`. Dropout
  needs nothing: an `nnx.Rngs` stream gives each forward pass (microbatch) its
  own key; or pass `rngs=` per microbatch with a key from
  `jax.random.fold_in(rng, optimizer.microbatches_seen[...])`, the number of
  `update` calls so far (`step` would give a window's microbatches one key).

  Under jit a microbatch of weight 0 adds nothing (gradient and statistics may
  be NaN), one of invalid weight (NaN, infinite, negative) is dropped with its
  statistics, and a window of total weight 0 changes nothing (parameters,
  statistics, `step`); see `ja.accumulate`. Every array of the optimizer is its
  own buffer, none shared with the model, so model and optimizer can be
  donated together.

  With any other optax `tx` without an `accumulate` inside it is
  `nnx.Optimizer` (plus `microbatches_seen`); `accumulate` must be outermost.
  """

  def __init__(
    self, model, tx: optax.GradientTransformation, *, wrt, batch_stats=nnx.BatchStat, axis_name=None, graph=None
  ):
    """Args as `nnx.Optimizer`, plus:

    Args:
      batch_stats: the filter of the statistics averaged per window (None: none).
      axis_name: inside pmap/shard_map, the data axis over which the window-end
        statistics are also averaged (one psum of the small statistics tree per
        window, none on micro-steps). Gradients are averaged by
        `ja.accumulate(..., axis_name=...)`, not here.

    Raises:
      TypeError: `tx` is not an optax transformation (None, or a factory such
        as `optax.adam` not called); `wrt` missing.
      ValueError: `tx` holds a `ja.accumulate` that is not outermost.
    """
    _check_tx(tx, "AccumulatingOptimizer")
    if axis_name is not None:
      parallel.validate_axis_name(axis_name)
    super().__init__(model, tx, wrt=wrt, graph=graph)
    _check_accumulate_outermost(nnx.as_pure(self.opt_state), "ja.flax.AccumulatingOptimizer")
    self.microbatches_seen = nnx.OptState(jnp.zeros([], jnp.int32))
    self.stats_filter = batch_stats
    self.axis_name = axis_name
    stats = None
    if batch_stats is not None:
      stats = nnx.as_pure(nnx.state(model, batch_stats, graph=graph))
      if not jax.tree.leaves(stats):
        stats = None
    if stats is None:
      self.stats_start = self.stats_sum = self.stats_weight = None
    else:
      acc, weight = _stats_accumulator(stats)
      # Copies: buffers shared with the model could not be donated with it.
      self.stats_start = nnx.data(jax.tree.map(lambda s: nnx.OptState(_distinct(s)), stats))
      self.stats_sum = nnx.data(jax.tree.map(nnx.OptState, acc))
      self.stats_weight = nnx.OptState(weight)
    if self._accumulating():
      self.step[...] = _distinct(nnx.as_pure(self.opt_state).update_count.astype(self.step.dtype))

  def _accumulating(self) -> bool:
    return isinstance(nnx.as_pure(self.opt_state), AccumulateState)

  @property
  def micro_step(self) -> jax.Array:
    if self._accumulating():
      return nnx.as_pure(self.opt_state).micro_step
    return jnp.zeros([], jnp.int32)

  def update(self, model, grads, /, *, weight=None, **kwargs):
    """Feeds one microbatch's gradient (and the statistics its forward pass left in `model`).

    Args:
      model: the model whose `wrt` variables are updated.
      grads: the microbatch's gradient, from `nnx.grad`.
      weight: the microbatch's weight w_i (None: 1); see `ja.accumulate`.
      **kwargs: extra arguments of `tx.update`.

    Returns:
      The change applied to the parameters, new minus old, in the structure of
      `wrt` (exact zeros on micro-steps). Under `nnx.jit` it costs nothing when
      the caller ignores it; it is not part of the fused step.
    """
    if not self._accumulating():
      if weight is not None:
        raise TypeError(f"{weight=} needs tx=ja.accumulate(...); this optimizer's tx is not one")
      _unreduced.refuse(grads, "ja.flax.AccumulatingOptimizer.update (tx is plain optax)")
      out = super().update(model, grads, **kwargs)
      self.microbatches_seen[...] = self.microbatches_seen[...] + 1
      return out
    param_arrays = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    if self.stats_start is not None:
      # Checked before anything is written: a bad call changes nothing.
      current = nnx.as_pure(nnx.state(model, self.stats_filter, graph=self.graph))
      start = nnx.as_pure(self.stats_start)
      _tree.check_same_structure(current, start, f"the model's {self.stats_filter} variables", "those at construction")
    old_opt_state = nnx.as_pure(self.opt_state)
    new_params, opt_state = _apply_accumulated(
      self.tx, grad_arrays, old_opt_state, param_arrays, weight, nnx.as_pure(kwargs)
    )

    if self.stats_start is not None:
      stats_sum, stats_weight = _accumulate_stats(
        current,
        nnx.as_pure(self.stats_sum),
        nnx.as_pure(self.stats_weight),
        weight,
        old_opt_state.micro_step == 0,
        _kept(old_opt_state, opt_state),
      )
      window_end = opt_state.micro_step == 0
      if self.axis_name is None:
        # Statistics are small: a select is cheaper than a cond here.
        mean = _window_mean(stats_sum, stats_weight, start, None)
        stats = jax.tree.map(lambda m, s: jnp.where(window_end, m, s), mean, start)
      else:  # the all-reduce only in the window-end branch
        stats = parallel.cond(
          window_end,
          lambda ops: _window_mean(ops[0], ops[1], ops[2], self.axis_name),
          lambda ops: ops[2],
          (stats_sum, stats_weight, start),
        )

    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(opt_state, graph=self.graph))
    # Own buffers for values stored twice (see `_distinct`): donation needs them.
    self.step[...] = _distinct(opt_state.update_count.astype(self.step.dtype))
    self.microbatches_seen[...] = self.microbatches_seen[...] + 1
    if self.stats_start is not None:
      nnx.update(model, stats)
      nnx.update(self.stats_start, _distinct(stats))
      nnx.update(self.stats_sum, stats_sum)
      assert self.stats_weight is not None  # set with stats_start in __init__
      self.stats_weight[...] = stats_weight
    return jax.tree.map(jnp.subtract, new_params, param_arrays)
