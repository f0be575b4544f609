"""The measured gradient noise scale, AdaScale, and a window length that follows it.

How big should the batch be? McCandlish et al. (2018), "An Empirical Model of
Large-Batch Training" (arXiv:1812.06162), answer with the simple noise scale

    B_simple = tr(Sigma) / |G|^2,

G the true gradient and Sigma the covariance of one example's gradient: below
B_simple a larger batch buys almost proportionally fewer steps, above it
almost nothing. Both terms can be estimated from gradients at two batch sizes,
and accumulation holds exactly that: every microbatch's gradient and the
window's mean.

The estimator. A window has K microbatches i with weights b_i > 0 (their batch
sizes: examples or tokens; K counts those with b_i > 0, across devices too),
B = sum_i b_i, g_i the mean gradient of microbatch i and g = sum_i b_i g_i / B
the window's mean. With the examples independent, g_i = G + e_i where
E e_i = 0 and Cov e_i = Sigma / b_i, so

    E |g_i|^2 = |G|^2 + tr(Sigma) / b_i,
    S1 = sum_i b_i |g_i|^2 / B:   E S1 = |G|^2 + K tr(Sigma) / B,
    S2 = |g|^2:                   E S2 = |G|^2 + tr(Sigma) / B

(g = G + sum_i b_i e_i / B has covariance sum_i b_i^2 Sigma / b_i / B^2 =
Sigma / B). Two linear equations in |G|^2 and tr(Sigma); solving them gives
per-window estimates that are unbiased for any sizes b_i:

    tr(Sigma)^ = B (S1 - S2) / (K - 1),
    |G|^2^     = (K S2 - S1) / (K - 1).

They need K >= 2 (a window of one microbatch has no spread to measure: it
leaves the averages unchanged). For K = 2 equal halves these are McCandlish's
appendix-A formulas with B_small = B/2 and B_big = B. Each estimate alone is
noisy (|G|^2^ can be negative), so both are averaged over windows by an
exponential moving average with decay beta, bias-corrected as in Adam, and
B_simple is the ratio of the two averages (McCandlish et al. do the same).
tr(Sigma) is per unit of weight, so B_simple is in the units of the weights:
examples when the weights are example counts, microbatches when every weight
is 1 (the default of `ja.accumulate`).

Sampling (`ja.accumulate(..., noise_scale_sample=m)`). The squared norm of
every microbatch is one more read of its gradient per micro-step (XLA:CPU does
not fuse it with the add into the accumulator). Measuring only a subset S of
each window's microbatches, |S| of them with weight B_S = sum_{i in S} b_i,
chosen before their gradients are seen (the first m of weight > 0 on each
device), keeps the estimates unbiased: with

    S1' = sum_{i in S} b_i |g_i|^2 / B_S:   E S1' = |G|^2 + |S| tr(Sigma) / B_S,

and S2 as above,

    tr(Sigma)^ = (S1' - S2) / (|S| / B_S - 1 / B),
    |G|^2^     = S2 - tr(Sigma)^ / B,

defined when |S| B > B_S (|S| >= 1 and at least one more microbatch in the
window). With S every microbatch these are the estimates above. The price is
variance. For K microbatches of equal size b, Gaussian gradient noise and
m = |S|, the per-window estimate has

    Var tr(Sigma)^ = [2 tr(Sigma^2) (1/m - 1/K^2) + 4 b G'Sigma G (1/m - 1/K)] / (1 - 1/K)^2,

against 2 tr(Sigma^2) / (K - 1) for m = K (the second term, absent there,
comes from G + e_i: a subset's mean noise is not the window's). At K = 8,
m = 1 gives 9x the variance of the first term (3x the spread) plus the
second; the EMA over windows averages both down. The bench's noise section
measures bias and spread on a linear regression whose B_simple is known.

Cost: one squared norm per microbatch (fused by XLA into the add into the
accumulator), one squared norm of the window's mean, and scalars; across
devices each device sums its own microbatches' sum_i b_i |g_i|^2 and K, and
those two scalars ride in the all-reduce of the gradient sum that the window
end does anyway: no extra collective, let alone a parameter-sized one.

AdaScale (Johnson et al. 2020, arXiv:2007.05105) uses the same two statistics
to scale the learning rate when the batch is S times a base batch; see
`adascale`. `every_k_from_noise_scale` makes `ja.accumulate`'s window follow
the measured B_simple (batch growth, as in Merrill et al. 2025,
arXiv:2505.23971).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum import _tree

ScalarOrSchedule = float | Callable[[jax.Array], Any]


class NoiseScale(NamedTuple):
  """The measured gradient noise scale and its two terms (EMA-smoothed, bias-corrected).

  All three are NaN until a window with at least two microbatches was measured.
  Once measured, `b_simple` is 0 wherever `trace_cov` is exactly 0, including
  when `grad_sq` is 0 too (every measured gradient was zero, e.g. frozen
  parameters or a loss at an exact minimum: no noise, so any batch is as good as
  the smallest), rather than 0/0 = NaN, which keeps meaning "nothing measured".
  """

  b_simple: jax.Array  # tr(Sigma) / |G|^2, in units of weight (examples when weights are example counts).
  grad_sq: jax.Array  # |G|^2, the squared norm of the true gradient (may be <= 0 when noise dominates).
  trace_cov: jax.Array  # tr(Sigma), the total variance of the gradient of one unit of weight.


class NoiseScaleState(NamedTuple):
  """Running averages of the per-window estimates (a field of the state of `ja.accumulate`).

  The averages are kept raw, with their bias-correction denominator, so that
  reading them (`noise_scale`) needs no decay: with n measured windows and decay
  beta, `norm` = 1 - beta^n.
  """

  windows: jax.Array  # int32 scalar: windows measured so far (those with K >= 2 and finite estimates).
  norm: jax.Array  # 1 - beta^windows: what the raw averages are divided by.
  grad_sq: jax.Array  # raw EMA of the per-window |G|^2 estimates.
  trace_cov: jax.Array  # raw EMA of the per-window tr(Sigma) estimates.
  # Inside `ja.accumulate`: sum_i b_i |g_i|^2 and the number of microbatches with
  # b_i > 0 of the current window, on this device (under pmap/shard_map these two
  # are per device, like acc_weight), reset lazily like acc_weight.
  acc_sq: jax.Array
  acc_count: jax.Array  # int32 scalar.
  # With `noise_scale_sample=m`: sum_{i in S} b_i of the window's measured microbatches (acc_sq and acc_count
  # then cover those only), per device; None otherwise (no leaf: the state of every other user is unchanged).
  acc_sampled_weight: Any = None


def check_decay(decay, name: str = "noise_scale_ema") -> float:
  """Returns `decay` as a float in [0, 1), or raises naming `name` and the value."""
  if isinstance(decay, (bool, np.bool_)) or not isinstance(decay, numbers.Real):
    raise TypeError(f"{name}={decay!r} must be a float in [0, 1)")
  value = float(decay)
  if not (0.0 <= value < 1.0):  # False for NaN too.
    raise ValueError(f"{name}={value!r} must be a float in [0, 1)")
  return value


def check_sample(sample, noise_scale_ema, *, switch: str = "noise_scale_ema= (e.g. 0.95)") -> int | None:
  """`noise_scale_sample`: None (every microbatch measured) or m >= 1 microbatches per window, with tracking on.

  `noise_scale_ema`: None where the measurement is off; `switch` names what turns it on (the entry point's option).
  """
  if sample is None:
    return None
  if isinstance(sample, (bool, np.bool_)) or not isinstance(sample, numbers.Integral):
    raise TypeError(f"noise_scale_sample={sample!r} must be None or an int >= 1")
  if sample < 1:
    raise ValueError(f"noise_scale_sample={sample!r} must be None or an int >= 1 (microbatches measured per window)")
  if noise_scale_ema is None:
    raise ValueError(
      f"noise_scale_sample={sample!r} samples the noise-scale measurement, which is off: turn it on with {switch}"
    )
  return int(sample)


def init_state(dtype: Any = jnp.float32, *, sampled: bool = False) -> NoiseScaleState:
  """Empty running averages in `dtype` (no window measured yet); `sampled`: with `acc_sampled_weight`."""
  # A fresh array per field: a state whose leaves share one buffer cannot be donated.
  return NoiseScaleState(
    windows=jnp.zeros([], jnp.int32),
    norm=jnp.zeros([], dtype),
    grad_sq=jnp.zeros([], dtype),
    trace_cov=jnp.zeros([], dtype),
    acc_sq=jnp.zeros([], dtype),
    acc_count=jnp.zeros([], jnp.int32),
    acc_sampled_weight=jnp.zeros([], dtype) if sampled else None,
  )


def sq_norm(tree, dtype: Any) -> jax.Array:
  """sum over leaves of sum(x^2), in `dtype` (each leaf cast first, so bf16 doesn't overflow)."""
  total = jnp.zeros([], dtype)
  for x in jax.tree.leaves(tree):
    x = x.astype(dtype)
    total = total + jnp.sum(x * x)
  return total


def window_estimates(weighted_sq: jax.Array, weight: jax.Array, mean_sq: jax.Array, count: jax.Array):
  """Unbiased per-window estimates of |G|^2 and tr(Sigma) (see the module docstring).

  Args:
    weighted_sq: sum_i b_i |g_i|^2 over the window's microbatches (all devices).
    weight: B = sum_i b_i.
    mean_sq: S2 = |g|^2, g = sum_i b_i g_i / B.
    count: K, the number of microbatches with b_i > 0 (all devices).

  Returns:
    (grad_sq, trace_cov, valid): the estimates, and whether they may enter the
    average (K >= 2, B > 0 and both finite). Invalid estimates are returned as 0.
  """
  dtype = weighted_sq.dtype
  weight = weight.astype(dtype)
  k = count.astype(dtype)
  safe_weight = jnp.where(weight > 0, weight, jnp.ones_like(weight))
  safe_km1 = jnp.where(k >= 2, k - 1, jnp.ones_like(k))
  s1 = weighted_sq / safe_weight
  s2 = mean_sq.astype(dtype)
  trace_cov = weight * (s1 - s2) / safe_km1
  grad_sq = (k * s2 - s1) / safe_km1
  valid = (k >= 2) & (weight > 0) & jnp.isfinite(trace_cov) & jnp.isfinite(grad_sq)
  zero = jnp.zeros([], dtype)
  return jnp.where(valid, grad_sq, zero), jnp.where(valid, trace_cov, zero), valid


def sampled_window_estimates(sampled_sq, sampled_weight, sampled_count, weight, mean_sq):
  """Unbiased per-window estimates from a sample S of the window's microbatches (module docstring, "Sampling").

  Args:
    sampled_sq: sum_{i in S} b_i |g_i|^2 (all devices).
    sampled_weight: B_S = sum_{i in S} b_i.
    sampled_count: |S|, the measured microbatches (weight > 0).
    weight: B = sum_i b_i over the whole window.
    mean_sq: S2 = |g|^2 of the window's mean.

  Returns:
    (grad_sq, trace_cov, valid) as `window_estimates`: valid when |S| B > B_S
    (a spread to measure), B_S > 0 and both estimates finite.
  """
  dtype = sampled_sq.dtype
  weight = weight.astype(dtype)
  b_s = sampled_weight.astype(dtype)
  m = sampled_count.astype(dtype)
  ok = (m >= 1) & (b_s > 0) & (weight > 0) & (m * weight > b_s)
  one = jnp.ones([], dtype)
  safe_b_s = jnp.where(ok, b_s, one)
  safe_weight = jnp.where(ok, weight, one)
  denom = jnp.where(ok, m / safe_b_s - 1 / safe_weight, one)
  s2 = mean_sq.astype(dtype)
  trace_cov = (sampled_sq / safe_b_s - s2) / denom
  grad_sq = s2 - trace_cov / safe_weight
  valid = ok & jnp.isfinite(trace_cov) & jnp.isfinite(grad_sq)
  zero = jnp.zeros([], dtype)
  return jnp.where(valid, grad_sq, zero), jnp.where(valid, trace_cov, zero), valid


def update_state(state: NoiseScaleState, grad_sq, trace_cov, valid, decay: float) -> NoiseScaleState:
  """Folds one window's estimates into the averages when `valid`; otherwise returns `state` unchanged."""
  dtype = state.grad_sq.dtype
  beta = jnp.asarray(decay, dtype)
  one_minus = jnp.asarray(1.0 - decay, dtype)

  def ema(old, new):
    return jnp.where(valid, beta * old + one_minus * new.astype(dtype), old)

  return state._replace(
    windows=state.windows + valid.astype(jnp.int32),
    norm=ema(state.norm, jnp.ones([], dtype)),
    grad_sq=ema(state.grad_sq, grad_sq),
    trace_cov=ema(state.trace_cov, trace_cov),
  )


def _find_states(state) -> list[NoiseScaleState]:
  found = []

  def visit(x):
    if isinstance(x, NoiseScaleState):
      found.append(x)
    return x

  jax.tree.map(visit, state, is_leaf=lambda x: isinstance(x, NoiseScaleState))
  return found


def _b_simple(grad_sq, trace_cov):
  """tr(Sigma) / |G|^2, defined as 0 where tr(Sigma) is exactly 0 (no noise: 0/0 would be NaN)."""
  zero = jnp.zeros_like(trace_cov)
  safe = jnp.where(trace_cov == 0, jnp.ones_like(grad_sq), grad_sq)
  return jnp.where(trace_cov == 0, zero, trace_cov / safe)


def noise_scale(state) -> NoiseScale:
  """The measured noise scale held in `state`.

  Args:
    state: the state of `ja.accumulate(..., noise_scale_ema=beta)`, or any tree
      that holds exactly one (a chain's state, a `ja.flax.TrainState`'s
      `opt_state`), or a `NoiseScaleState`. Under pmap/shard_map with a leading
      device axis the result has that axis too (every device holds the same values).

  Returns:
    `NoiseScale(b_simple, grad_sq, trace_cov)`: the bias-corrected averages and
    their ratio; all NaN while no window with K >= 2 has been measured.
    `b_simple` is 0 where `trace_cov` is exactly 0 (windows of zero gradients
    give 0 for both: no noise, not 0/0 = NaN).

  Raises:
    ValueError: `state` holds no noise statistics (tracking not turned on), or
      more than one.
  """
  found = _find_states(state)
  if not found:
    raise ValueError(
      f"state ({type(state).__name__}) holds no noise-scale statistics: turn them on with "
      "ja.accumulate(..., noise_scale_ema=0.95)"
    )
  if len(found) > 1:
    raise ValueError(f"state ({type(state).__name__}) holds {len(found)} noise-scale statistics; pass one of them")
  s = found[0]
  measured = s.windows > 0
  norm = jnp.where(measured, s.norm, jnp.ones_like(s.norm))
  nan = jnp.full_like(s.norm, jnp.nan)
  grad_sq = jnp.where(measured, s.grad_sq / norm, nan)
  trace_cov = jnp.where(measured, s.trace_cov / norm, nan)
  return NoiseScale(b_simple=_b_simple(grad_sq, trace_cov), grad_sq=grad_sq, trace_cov=trace_cov)


def step_estimate(grad_sq, trace_cov, valid) -> NoiseScale:
  """One window's (or one step's) raw estimates as a `NoiseScale`; NaN where not `valid`.

  As in `noise_scale`, `b_simple` is 0 where a valid `trace_cov` is exactly 0.
  """
  nan = jnp.full_like(grad_sq, jnp.nan)
  grad_sq = jnp.where(valid, grad_sq, nan)
  trace_cov = jnp.where(valid, trace_cov, nan)
  return NoiseScale(b_simple=_b_simple(grad_sq, trace_cov), grad_sq=grad_sq, trace_cov=trace_cov)


def noise_scale_smooth(ema: NoiseScaleState | None, estimate: NoiseScale, decay: float) -> NoiseScaleState:
  """Folds one step's raw estimate (e.g. `make_train_step`'s `metrics["noise_scale"]`) into an EMA.

  Start from `ema=None`; read the smoothed, bias-corrected values with
  `ja.noise_scale(ema)`. An estimate with a NaN (fewer than two microbatches
  of weight > 0) leaves the EMA unchanged. Works inside and outside jit.

  Args:
    ema: the previous `NoiseScaleState`, or None to start.
    estimate: a `NoiseScale` of raw per-step estimates.
    decay: the EMA decay, a float in [0, 1).
  """
  decay = check_decay(decay, "decay")
  if not isinstance(estimate, NoiseScale):
    raise TypeError(f"estimate must be a ja.NoiseScale, got {type(estimate).__name__}")
  grad_sq, trace_cov = jnp.asarray(estimate.grad_sq), jnp.asarray(estimate.trace_cov)
  if ema is None:
    ema = init_state(jnp.result_type(grad_sq, trace_cov, jnp.float32))
  valid = jnp.isfinite(grad_sq) & jnp.isfinite(trace_cov)
  zero = jnp.zeros_like(grad_sq)
  return update_state(ema, jnp.where(valid, grad_sq, zero), jnp.where(valid, trace_cov, zero), valid, decay)


# --------------------------------------------------------------------------------------------
# AdaScale.


class AdaScaleState(NamedTuple):
  """State of `adascale`."""

  update_count: jax.Array  # int32 scalar: updates made.
  progress: jax.Array  # float scalar: sum of the gains so far, the scale-invariant step count.
  gain: jax.Array  # float scalar: the gain r of the last update (1 before the first).
  inner_state: Any  # `inner`'s state.


def adascale_gain(grad_sq, trace_cov, batch_weight, scale) -> jax.Array:
  """The AdaScale gain r for a batch of weight `batch_weight` that is `scale` base batches.

  With the base batch b0 = batch_weight / S, its gradient's variance is
  sigma^2 = tr(Sigma) / b0, and Johnson et al. (2020), eq. (3), give

      r = (sigma^2 + |G|^2) / (sigma^2 / S + |G|^2),

  the ratio E|g_base|^2 / E|g_batch|^2: 1 when the gradient is exact, S when it
  is all noise. Negative estimates (noise) are clipped to 0, so r lies in
  [1, S] for S >= 1; where it is undefined (both terms 0, or a NaN: nothing
  measured yet) r = 1.
  """
  dtype = jnp.result_type(grad_sq, trace_cov, float)
  g2 = jnp.maximum(jnp.asarray(grad_sq, dtype), 0)
  tr = jnp.maximum(jnp.asarray(trace_cov, dtype), 0)
  s = jnp.asarray(scale, dtype)
  w = jnp.asarray(batch_weight, dtype)
  sigma2 = tr * s / w
  num = sigma2 + g2
  den = sigma2 / s + g2
  r = num / jnp.where(den > 0, den, jnp.ones_like(den))
  return jnp.where((den > 0) & jnp.isfinite(r), r, jnp.ones_like(r))


def _check_scale_value(value, name: str) -> None:
  """Raises naming `name` unless `value` is a real scalar >= 1; a traced value is checked for type only."""
  if isinstance(value, (str, bytes)) or value is None:
    raise TypeError(f"{name}={value!r} must be a real number >= 1")
  try:
    dtype, ndim = np.dtype(jnp.result_type(value)), jnp.ndim(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name}={value!r} must be a real number >= 1, got {type(value).__name__}") from None
  if ndim != 0 or not np.issubdtype(dtype, np.number) or dtype == np.bool_ or np.issubdtype(dtype, np.complexfloating):
    raise TypeError(f"{name}={value!r} must be a real number >= 1 (a scalar), got {dtype}{list(jnp.shape(value))}")
  if not _tree.is_concrete(value):
    return  # traced: clamped to >= 1 where it is used (nothing can raise inside jit)
  value = float(np.asarray(value))
  if not (value >= 1.0) or not np.isfinite(value):
    raise ValueError(f"{name}={value!r} must be a finite number >= 1")


def _scale_at_least_one(s):
  """S clamped to [1, inf): a traced scale (or a schedule's traced value) below 1 or NaN is taken as 1."""
  return jnp.where(s >= 1, s, jnp.ones_like(s))


def adascale(
  inner: optax.GradientTransformation,
  *,
  scale: ScalarOrSchedule | None = None,
  base_batch_size: float | None = None,
  learning_rate: ScalarOrSchedule | None = None,
) -> optax.GradientTransformationExtraArgs:
  """AdaScale: the learning rate scaled by the measured gain r when the batch is S base batches.

  Johnson, Agrawal, Gu & Guestrin (2020), "AdaScale SGD" (arXiv:2007.05105):
  a batch S times larger than the base batch whose learning rate schedule you
  tuned gives a gradient whose variance is S times smaller, and the step can
  grow by r = (sigma^2 + |G|^2) / (sigma^2 / S + |G|^2) (see `adascale_gain`):
  by S when noise dominates (the linear scaling rule), by 1 when the gradient
  is exact. The "scale-invariant iterations" `progress` = sum of r counts
  updates in units of base-batch steps: a schedule tuned for T base steps is
  run to progress T, with fewer real updates.

  The statistics are the ones `ja.accumulate(..., noise_scale_ema=beta)`
  measures; it passes them to its `inner` on each window end as the extra
  arguments `noise_scale=` (a `NoiseScale`) and `batch_weight=` (the window's
  total weight B). So use it as

      tx = ja.accumulate(ja.adascale(optax.sgd(0.1), scale=8), every_k=8, noise_scale_ema=0.95)

  (base batch = one microbatch: S = 8). Outside `accumulate`, pass both
  extra arguments yourself.

  Schedules. Two ways to drive an optax schedule by the scale-invariant
  progress instead of the update count:
  * `learning_rate=schedule`: `inner` then gives a direction without a
    learning rate (e.g. `optax.scale_by_adam()`), and the update is
    `-schedule(progress) * r * direction` (optax's sign convention, as
    `optax.scale_by_learning_rate`); the schedule sees the progress before
    this update.
  * or read `progress` from the state (`AdaScaleState.progress`; inside
    accumulate's state at `state.inner_state.progress`) and evaluate any
    schedule on it yourself, e.g. to decide when to stop.

  Args:
    inner: the optimizer whose updates are scaled (with its own learning rate
      when `learning_rate` is None).
    scale: S, the number of base batches in one update: a number >= 1, or a
      schedule f(update_count) of the updates made. The base batch is then
      batch_weight / S. A concrete value below 1 (or NaN, or not finite) is
      refused with an error naming `scale` (a schedule's: `scale(<count>)`);
      a traced value (a `scale` made inside jit, or a schedule's value under
      jit) cannot raise, so one below 1 or NaN is taken as 1: the gain stays
      in [1, S], never shrinking the learning rate.
    base_batch_size: instead of `scale`: the base batch b0 in units of weight;
      S = batch_weight / b0 follows the window's weight, which suits a growing
      window (`every_k_from_noise_scale`) and unequal microbatches.
    learning_rate: optional float or schedule of the progress (see above).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose `update` needs the keyword
    arguments `noise_scale` and `batch_weight`; its state is an
    `AdaScaleState`. With `scale=1` and no `learning_rate` the updates are
    `inner`'s bit for bit (with `base_batch_size`, S is the window's weight
    over it, generally not 1).

  Raises:
    ValueError/TypeError: `inner` not an optimizer, not exactly one of
      `scale` and `base_batch_size`, a concrete scale < 1 (at update time: a
      schedule's concrete value < 1), a base_batch_size that is not > 0, or
      (at update time) missing statistics.
  """
  inner = _tree.check_optimizer(inner, "inner")
  if (scale is None) == (base_batch_size is None):
    raise ValueError(f"adascale needs exactly one of scale and base_batch_size, got {scale=}, {base_batch_size=}")
  if scale is not None and not callable(scale):
    _check_scale_value(scale, "scale")
  if base_batch_size is not None:
    if isinstance(base_batch_size, (bool, np.bool_)) or not isinstance(base_batch_size, numbers.Real):
      raise TypeError(f"{base_batch_size=} must be a number > 0")
    if not (math.isfinite(base_batch_size) and base_batch_size > 0):
      raise ValueError(f"{base_batch_size=} must be a finite number > 0")
  if learning_rate is not None and not callable(learning_rate):
    if isinstance(learning_rate, (bool, np.bool_)) or not isinstance(learning_rate, numbers.Real):
      raise TypeError(f"{learning_rate=} must be a number or a schedule")
  inner = optax.with_extra_args_support(inner)
  float_dtype = jax.dtypes.canonicalize_dtype(jnp.float64)

  def init(params):
    return AdaScaleState(
      update_count=jnp.zeros([], jnp.int32),
      progress=jnp.zeros([], float_dtype),
      gain=jnp.ones([], float_dtype),
      inner_state=inner.init(params),
    )

  def update(updates, state, params=None, *, noise_scale=None, batch_weight=None, **extra_args):
    if not isinstance(state, AdaScaleState):
      raise TypeError(f"state must be an AdaScaleState, got {type(state).__name__}")
    if noise_scale is None or batch_weight is None:
      raise TypeError(
        "adascale's update needs the noise statistics as noise_scale= (a ja.NoiseScale) and "
        "batch_weight=: use it as the inner optimizer of ja.accumulate(..., noise_scale_ema=beta), "
        "or pass both yourself"
      )
    if not isinstance(noise_scale, NoiseScale):
      raise TypeError(f"noise_scale must be a ja.NoiseScale, got {type(noise_scale).__name__}")
    inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    if base_batch_size is not None:
      s = jnp.asarray(batch_weight, float_dtype) / base_batch_size
    elif callable(scale):
      value = scale(state.update_count)
      at = int(state.update_count) if _tree.is_concrete(state.update_count) else "update_count"
      _check_scale_value(value, f"scale({at})")  # a concrete value below 1 is refused; a traced one clamped
      s = _scale_at_least_one(jnp.asarray(value, float_dtype))
    else:
      s = _scale_at_least_one(jnp.asarray(scale, float_dtype))
    r = adascale_gain(noise_scale.grad_sq, noise_scale.trace_cov, batch_weight, s).astype(float_dtype)
    if learning_rate is None:
      factor = r
    else:
      lr = learning_rate(state.progress) if callable(learning_rate) else learning_rate
      factor = -jnp.asarray(lr, float_dtype) * r
    scaled = jax.tree.map(lambda u: u * factor.astype(u.dtype), inner_updates)
    return scaled, AdaScaleState(
      update_count=state.update_count + 1,
      progress=state.progress + r,
      gain=r,
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init, update)


# --------------------------------------------------------------------------------------------
# Batch growth.


@dataclasses.dataclass(frozen=True)
class NoiseScaleEveryK:
  """A window length that follows the measured noise scale: pass it as `ja.accumulate`'s `every_k`.

  k = clip(round(B_simple / microbatch_size), k_min, k_max), read from the
  state's averages, which change only at window ends: so k changes only at
  window ends, and since accumulate's k is a traced value, never recompiles.
  Built by `every_k_from_noise_scale`.
  """

  microbatch_size: float
  k_max: int
  k_min: int
  k_init: int

  def __call__(self, measured: NoiseScale) -> jax.Array:
    """The window length (int32 scalar) for the measured `NoiseScale`."""
    g2, tr = measured.grad_sq, measured.trace_cov
    dtype = jnp.result_type(g2, tr, float)
    g2 = jnp.asarray(g2, dtype)
    tr = jnp.asarray(tr, dtype)
    inf = jnp.full_like(g2, jnp.inf)
    # |G|^2 <= 0 with tr(Sigma) > 0: the signal is not yet seen above the noise,
    # B_simple is "infinite": the largest window. Both <= 0 or a NaN: no estimate.
    b = jnp.where(g2 > 0, jnp.maximum(tr, 0) / jnp.where(g2 > 0, g2, jnp.ones_like(g2)), inf)
    known = jnp.isfinite(g2) & jnp.isfinite(tr) & ((g2 > 0) | (tr > 0))
    k = jnp.clip(jnp.round(b / self.microbatch_size), self.k_min, self.k_max)
    return jnp.where(known, k, self.k_init).astype(jnp.int32)


def every_k_from_noise_scale(
  microbatch_size: float, *, k_max: int, k_min: int = 2, k_init: int | None = None
) -> NoiseScaleEveryK:
  """Batch growth driven by the measurement: a window of about B_simple worth of weight.

  McCandlish et al. find the critical batch near B_simple; Merrill et al. (2025)
  that it starts near 0 and grows during training, and that a batch-size warmup
  that follows it needs far fewer optimizer steps for the same loss. Use as

      tx = ja.accumulate(inner, every_k=ja.every_k_from_noise_scale(32, k_max=64),
                         noise_scale_ema=0.9)

  Each window's length is clip(round(B_simple / microbatch_size), k_min,
  k_max) with B_simple as measured up to the end of the previous window
  (`k_init` while nothing has been measured; `k_max` while |G|^2 is not yet
  distinguishable from noise). The length is a traced value: it changes
  without recompiling.

  A window must hold at least two microbatches (over all devices) to be
  measured: with one device keep `k_min` >= 2, or k could settle at 1 and
  never be measured again. With P >= 2 devices k_min = 1 is fine.

  Args:
    microbatch_size: the weight one update call adds, summed over devices
      (examples per call and device times devices, when weights are example
      counts; 1 when you pass no weights).
    k_max: the longest window (memory is not the limit: time per update is).
    k_min: the shortest window.
    k_init: the window before the first measurement (default k_min).
  """
  if isinstance(microbatch_size, (bool, np.bool_)) or not isinstance(microbatch_size, numbers.Real):
    raise TypeError(f"{microbatch_size=} must be a number > 0")
  if not (math.isfinite(microbatch_size) and microbatch_size > 0):
    raise ValueError(f"{microbatch_size=} must be a finite number > 0")
  k_max = _tree.check_positive_int(k_max, "k_max")
  k_min = _tree.check_positive_int(k_min, "k_min")
  if k_min > k_max:
    raise ValueError(f"{k_min=} must be <= {k_max=}")
  k_init = k_min if k_init is None else _tree.check_positive_int(k_init, "k_init")
  if not k_min <= k_init <= k_max:
    raise ValueError(f"{k_init=} must be between {k_min=} and {k_max=}")
  return NoiseScaleEveryK(float(microbatch_size), k_max, k_min, k_init)
