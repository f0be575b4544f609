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
microbatch's own statistics. A microbatch that `accumulate(...,
skip_nonfinite=True)` drops takes its statistics with it, and a window with no
finite microbatch leaves the statistics as they were.
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

from jaxaccum import _tree
from jaxaccum import parallel
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
      opt_state.updated, lambda ops: optax.apply_updates(*ops), lambda ops: ops[0], (params, updates))
  return params, opt_state


def _weight_or_one(weight, dtype):
  return jnp.ones([], dtype) if weight is None else jnp.asarray(weight).astype(dtype)


def _accumulate_stats(new_stats, stats_sum, stats_weight, weight, new_window, kept):
  """sum <- (new window ? 0 : sum) + w s_i, and the same for the weight (lazy reset, as accumulate does).

  `kept` is False for a microbatch that `accumulate(..., skip_nonfinite=True)`
  dropped: its statistics (likely NaN too) are dropped with it.
  """
  w = jnp.where(kept, _weight_or_one(weight, stats_weight.dtype), jnp.zeros([], stats_weight.dtype))

  def add(acc, s):
    s = s.astype(acc.dtype) * w.astype(acc.dtype)
    return jnp.where(new_window, jnp.zeros_like(acc), acc) + jnp.where(kept, s, jnp.zeros_like(s))  # NaN * 0 is NaN

  stats_sum = jax.tree.map(add, stats_sum, new_stats)
  stats_weight = jnp.where(new_window, jnp.zeros_like(stats_weight), stats_weight) + w
  return stats_sum, stats_weight


def _kept(old_opt_state, new_opt_state):
  """False when the call just made dropped its microbatch as non-finite."""
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
      lambda a, s: jnp.where(has_data, (a / safe.astype(a.dtype)).astype(jnp.result_type(s)), s), stats_sum, like)


# --------------------------------------------------------------------------- linen


class TrainState(flax_train_state.TrainState):
  """A linen `TrainState` for `tx=ja.accumulate(inner, k)`: honest steps, no writes on micro-steps.

  `TrainState.create(apply_fn=..., params=..., tx=ja.accumulate(inner, k),
  batch_stats=None)`; then one `apply_gradients(grads=..., weight=None,
  batch_stats=None)` per microbatch. With any other optax `tx` it behaves as
  flax's `TrainState` (`step` counts calls, `weight` is refused).

  Attributes (besides flax's `apply_fn`, `params`, `tx`, `opt_state`):
    step: int32 scalar, completed updates (`opt_state.update_count`); with a
      plain `tx`, calls of `apply_gradients`.
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
  """

  batch_stats: Any = None
  batch_stats_sum: Any = None
  batch_stats_weight: Any = None
  axis_name: Any = struct.field(pytree_node=False, default=None)

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
      tx: `ja.accumulate(inner, k)` (any optax transformation works, as in flax).
      batch_stats: the model's initial `batch_stats` collection, or None.
      axis_name: see the class docstring.
      **kwargs: further fields of a subclass.

    Raises:
      TypeError: `tx` is not an optax transformation.
    """
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError(f"tx={tx!r} must be an optax GradientTransformation, e.g. ja.accumulate(optax.adam(1e-3), 4)")
    if axis_name is not None:
      parallel.validate_axis_name(axis_name)
    opt_state = tx.init(params)
    stats_sum = stats_weight = None
    if batch_stats is not None:
      stats_sum, stats_weight = _stats_accumulator(batch_stats)
    step = opt_state.update_count if isinstance(opt_state, AccumulateState) else jnp.zeros([], jnp.int32)
    return cls(step=step, apply_fn=apply_fn, params=params, tx=tx, opt_state=opt_state,
               batch_stats=batch_stats, batch_stats_sum=stats_sum, batch_stats_weight=stats_weight,
               axis_name=axis_name, **kwargs)

  def apply_gradients(self, *, grads, weight=None, batch_stats=None, **kwargs):
    """Feeds one microbatch: its gradient, its weight and (with BatchNorm) its new statistics.

    Args:
      grads: the microbatch's gradient, the structure of `params`.
      weight: the microbatch's weight w_i (e.g. its number of examples or
        tokens); None means 1. The window's update uses sum w_i g_i / sum w_i.
      batch_stats: the `batch_stats` collection returned by this microbatch's
        training-mode forward pass (computed from `self.batch_stats`).
      **kwargs: other fields to `replace`.

    Returns:
      The new state. On a micro-step `params` are the same buffers, `step` is
      unchanged and `micro_step` is one more; on a window's last microbatch
      `params` take the update, `step` is one more and `micro_step` is 0.

    Raises:
      TypeError: `weight` with a `tx` that is not `ja.accumulate`.
      ValueError: `batch_stats` given to a state created without them, or not
        matching them; grads not matching `params`; a non-finite or
        non-positive concrete `weight`.
    """
    if batch_stats is not None:
      if self.batch_stats is None:
        raise ValueError("batch_stats were given but this TrainState was created without them: "
                         "pass TrainState.create(..., batch_stats=variables['batch_stats'])")
      _tree.check_same_structure(batch_stats, self.batch_stats, "batch_stats", "state.batch_stats")

    if not isinstance(self.opt_state, AccumulateState):
      # A plain optax transformation: flax's semantics, step counts calls.
      if weight is not None:
        raise TypeError(f"{weight=} needs tx=ja.accumulate(...); this TrainState's tx is not one (its state "
                        f"is a {type(self.opt_state).__name__})")
      _tree.check_same_structure(grads, self.params, "grads", "state.params")
      updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
      extra = {} if batch_stats is None else {"batch_stats": batch_stats}
      return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                          opt_state=opt_state, **extra, **kwargs)

    _tree.check_same_structure(grads, self.params, "grads", "state.params")
    new_window = self.opt_state.micro_step == 0
    # Skip the write on micro-steps: the parameters pass through the untaken
    # branch (aliased when donated, no copy), where `params + 0` would read and
    # write every parameter.
    params, opt_state = _apply_accumulated(self.tx, grads, self.opt_state, self.params, weight, {})
    extra = {}
    if batch_stats is not None:
      stats_sum, stats_weight = _accumulate_stats(
          batch_stats, self.batch_stats_sum, self.batch_stats_weight, weight, new_window,
          _kept(self.opt_state, opt_state))
      window_end = opt_state.micro_step == 0
      new_stats = parallel.cond(
          window_end,
          lambda ops: _window_mean(ops[0], ops[1], ops[2], self.axis_name),
          lambda ops: ops[2],
          (stats_sum, stats_weight, self.batch_stats))
      extra = {"batch_stats": new_stats, "batch_stats_sum": stats_sum, "batch_stats_weight": stats_weight}
    return self.replace(step=opt_state.update_count, params=params, opt_state=opt_state, **extra, **kwargs)


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
  own key, or pass `rngs=` per microbatch.

  With any other optax `tx` it is `nnx.Optimizer`.
  """

  def __init__(self, model, tx: optax.GradientTransformation, *, wrt, batch_stats=nnx.BatchStat,
               axis_name=None, graph=None):
    """Args as `nnx.Optimizer`, plus:

    Args:
      batch_stats: the filter of the statistics averaged per window (None: none).
      axis_name: inside pmap/shard_map, the data axis over which the window-end
        statistics are also averaged (one psum of the small statistics tree per
        window, none on micro-steps). Gradients are averaged by
        `ja.accumulate(..., axis_name=...)`, not here.
    """
    if axis_name is not None:
      parallel.validate_axis_name(axis_name)
    super().__init__(model, tx, wrt=wrt, graph=graph)
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
      self.stats_start = nnx.data(jax.tree.map(lambda s: nnx.OptState(jnp.asarray(s)), stats))
      self.stats_sum = nnx.data(jax.tree.map(nnx.OptState, acc))
      self.stats_weight = nnx.OptState(weight)
    if self._accumulating():
      self.step[...] = nnx.as_pure(self.opt_state).update_count.astype(self.step.dtype)

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
      return super().update(model, grads, **kwargs)
    param_arrays = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    if self.stats_start is not None:
      # Checked before anything is written: a bad call changes nothing.
      current = nnx.as_pure(nnx.state(model, self.stats_filter, graph=self.graph))
      start = nnx.as_pure(self.stats_start)
      _tree.check_same_structure(current, start, f"the model's {self.stats_filter} variables",
                                 "those at construction")
    old_opt_state = nnx.as_pure(self.opt_state)
    new_params, opt_state = _apply_accumulated(
        self.tx, grad_arrays, old_opt_state, param_arrays, weight, nnx.as_pure(kwargs))

    if self.stats_start is not None:
      stats_sum, stats_weight = _accumulate_stats(
          current, nnx.as_pure(self.stats_sum), nnx.as_pure(self.stats_weight), weight,
          old_opt_state.micro_step == 0, _kept(old_opt_state, opt_state))
      window_end = opt_state.micro_step == 0
      if self.axis_name is None:
        # Statistics are small: a select is cheaper than a cond here.
        mean = _window_mean(stats_sum, stats_weight, start, None)
        stats = jax.tree.map(lambda m, s: jnp.where(window_end, m, s), mean, start)
      else:  # the all-reduce only in the window-end branch
        stats = parallel.cond(window_end, lambda ops: _window_mean(*ops, self.axis_name), lambda ops: ops[2],
                              (stats_sum, stats_weight, start))

    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(opt_state, graph=self.graph))
    self.step[...] = opt_state.update_count.astype(self.step.dtype)
    if self.stats_start is not None:
      nnx.update(model, stats)
      nnx.update(self.stats_start, stats)
      nnx.update(self.stats_sum, stats_sum)
      self.stats_weight[...] = stats_weight
    return jax.tree.map(jnp.subtract, new_params, param_arrays)
