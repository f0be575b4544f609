"""Every-k schedules: batch-size ramps, and LR decay turned into batch growth.

An every-k schedule is a function `f(update_count) -> k` of the number of
completed updates, as `jaxaccum.accumulate(inner, every_k=f)` expects: update
number `u` (0-based) averages the gradients of `f(u)` microbatches, so the
effective batch size is `f(u) * microbatch_size`.

All schedules here are piecewise constant over static boundaries, which are
validated and converted in Python when the schedule is built. Called with a
Python int they return a Python int; called with a `jax.Array` (a traced
int32 scalar under `jax.jit`, or a concrete array) they return an int32 array
of the same shape, computed with `jnp.searchsorted`, so they are free to use
inside a jitted update.

Smith, Kindermans & Le (ICLR 2018), "Don't decay the learning rate, increase
the batch size" (arXiv:1711.00489), model SGD as a stochastic differential
equation whose noise scale is

    g = lr * N / (B * (1 - m))

(N the dataset size, B the batch size, m the momentum). Dividing `lr` by a
factor or multiplying `B` by the same factor gives the same `g`, so a decaying
learning rate schedule can be replaced by a growing batch, with fewer, larger
(and better parallelised) updates for the same data. `from_lr_decay` does that
conversion; `noise_scale` computes `g`.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _tree

_INT32_MAX = int(np.iinfo(np.int32).max)

# `{boundary: value}` or a sequence of `(boundary, value)` pairs.
BoundariesAnd = Mapping[int, Any] | Iterable[tuple[int, Any]] | None


class PiecewiseSchedule:
  """A piecewise constant every-k schedule: `k = values[i]` for `boundaries[i] <= u < boundaries[i+1]`.

  Built by `constant`, `piecewise` and `from_lr_decay`; call it with the number
  of completed updates. `boundaries` (update counts) starts with 0 and is
  strictly increasing; consecutive `values` differ.

  Attributes:
    boundaries: tuple of update counts at which a new k takes effect.
    values: tuple of the k in force from the matching boundary on.
  """

  __slots__ = ("boundaries", "values", "_name", "__weakref__")

  def __init__(self, boundaries: tuple[int, ...], values: tuple[int, ...], name: str):
    self.boundaries = boundaries
    self.values = values
    self._name = name

  def __call__(self, update_count):
    """The k for the update that follows `update_count` completed updates.

    `update_count` is an integer >= 0 (a Python int, or an integer array);
    anything else (a string, None, a float) is a TypeError naming it.
    """
    if isinstance(update_count, numbers.Integral) and not isinstance(update_count, (bool, np.bool_)):
      update_count = int(update_count)
      if update_count < 0:
        raise ValueError(f"{update_count=} must be >= 0")
      return self.values[bisect.bisect_right(self.boundaries, update_count) - 1]
    count = _check_count_array(update_count)
    # A boundary beyond the counter dtype's range is never reached: drop it (a
    # clip to the maximum would make it reachable there), and don't overflow.
    top = int(np.iinfo(count.dtype).max)
    reachable = [i for i, b in enumerate(self.boundaries) if b <= top]
    bounds = jnp.asarray([self.boundaries[i] for i in reachable], count.dtype)
    values = jnp.asarray([self.values[i] for i in reachable], jnp.int32)
    index = jnp.searchsorted(bounds, count, side="right") - 1
    return values[jnp.clip(index, 0, len(reachable) - 1)]

  def __repr__(self) -> str:
    pieces = ", ".join(f"{b}: {v}" for b, v in zip(self.boundaries, self.values, strict=False))
    return f"{self._name}({{{pieces}}})"


def constant(k: int) -> PiecewiseSchedule:
  """The every-k schedule that is `k` at every update.

  Args:
    k: the number of microbatches per update, an integer >= 1.

  Returns:
    A schedule `f(update_count) -> k`.

  Raises:
    TypeError: `k` is not an integer (booleans included).
    ValueError: `k` < 1.
  """
  k = _check_k(k, "k")
  return PiecewiseSchedule((0,), (k,), "constant")


def piecewise(boundaries_and_values: BoundariesAnd, *, init_value: int | None = None) -> PiecewiseSchedule:
  """A piecewise constant every-k schedule keyed on completed updates.

  `piecewise({0: 1, 1000: 4, 5000: 16})` averages 1 microbatch per update for
  updates 0-999, 4 for updates 1000-4999 and 16 from update 5000 on. Before
  the first key, k is `init_value`, which defaults to 1: `piecewise({1000: 4})`
  does not accumulate for the first 1000 updates.

  Args:
    boundaries_and_values: `{update_count: k}`, from each `update_count` on
      (inclusive) k is the value; or a sequence of `(update_count, k)` pairs,
      which must be strictly increasing in `update_count`. Keys are integers
      >= 0, values integers >= 1. May be empty or None.
    init_value: k before the first key (default 1). Giving it together with a
      key 0 is ambiguous and an error.

  Returns:
    A schedule `f(update_count) -> k`.

  Raises:
    TypeError: a key or value that is not an integer, a container that is not
      a mapping or a sequence of pairs.
    ValueError: a negative key, a value < 1, unsorted or repeated keys in a
      sequence of pairs, `init_value` together with a key 0.
  """
  pairs = _pairs(boundaries_and_values, "boundaries_and_values")
  if init_value is not None:
    init_value = _check_k(init_value, "init_value")
    if pairs and pairs[0][0] == 0:
      raise ValueError(
        f"{init_value=} and boundaries_and_values[0]={pairs[0][1]!r} both give k at update 0; give only one"
      )
  boundaries, values = [0], [1 if init_value is None else init_value]
  for b, v in pairs:
    v = _check_k(v, f"boundaries_and_values[{b}]")
    if b == 0:
      values[0] = v
    else:
      boundaries.append(b)
      values.append(v)
  return PiecewiseSchedule(*_merge(boundaries, values), "piecewise")


def from_lr_decay(base_k: int, boundaries_and_scales: BoundariesAnd) -> PiecewiseSchedule:
  """Turns a piecewise constant LR decay into a growing every-k (Smith et al. 2018).

  The noise scale of SGD, `g = lr * N / (B (1 - m))`, is unchanged when the
  learning rate is divided by a factor and the batch size multiplied by the
  same factor. So instead of decaying the learning rate by `a` at some point
  of training, keep it constant and multiply k (microbatches per update, hence
  the batch size) by `1 / a` at the same point *in the data*.

  `boundaries_and_scales` is the LR schedule you would have used, in the
  convention of `optax.piecewise_constant_schedule`: from boundary `b_i` on,
  the learning rate is multiplied by `s_i`, cumulatively. Boundaries count
  microbatches consumed (the step count of the run with k = 1), so a boundary
  means the same amount of data whatever the batch size. Example:
  `from_lr_decay(1, {100: 0.5, 200: 0.5})` gives k = 1 for updates 0-99
  (microbatches 0-99), k = 2 for updates 100-149 (microbatches 100-199) and
  k = 4 from update 150 on (microbatch 200 on).

  Rules:
    * Target k. After boundary `b_i`, k is `base_k / prod_{j <= i} s_j`
      rounded to the nearest integer (ties up). Rounding is applied to the
      cumulative product, not step by step, so it never compounds: each k is
      within 1/2 of its exact value, the realised noise scale within a factor
      `1 +- 1 / (2 k)` of the decayed-LR run's. Scales whose inverse is an
      integer (0.5, 0.2, 0.1, 1/3...) are reproduced exactly.
    * Boundary placement. An update consumes k consecutive microbatches; the
      new k takes effect at the first update that *begins* at or after the
      boundary (the update that straddles a boundary keeps the old k, so the
      switch is at most k_old - 1 microbatches late). This is the same
      `count >= boundary` test optax applies to the step count: at the start
      of every update, the k here and the LR of the decaying run at the same
      number of microbatches consumed give the same noise scale (up to the
      rounding above). Boundaries that fall in the same update collapse into
      the last one.
    * Scales must lie in (0, 1]: a learning-rate *increase* (warm-up) would
      need a shrinking batch, which is not what this conversion is for; use
      `piecewise` for that.

  Args:
    base_k: k before the first boundary, an integer >= 1.
    boundaries_and_scales: `{microbatches_consumed: scale}` as in
      `optax.piecewise_constant_schedule` (order irrelevant), or a sequence of
      `(microbatches_consumed, scale)` pairs, strictly increasing. Boundaries
      are integers >= 0; scales real numbers in (0, 1]. May be empty or None.

  Returns:
    A schedule `f(update_count) -> k` of completed updates.

  Raises:
    TypeError: `base_k` or a boundary not an integer, a scale not a real
      number, a container that is not a mapping or a sequence of pairs.
    ValueError: `base_k` < 1, a negative boundary, unsorted or repeated
      boundaries in a sequence of pairs, a scale outside (0, 1], a k that
      does not fit in int32.
  """
  base_k = _check_k(base_k, "base_k")
  pairs = _pairs(boundaries_and_scales, "boundaries_and_scales")
  scales = []
  for b, s in pairs:
    name = f"boundaries_and_scales[{b}]"
    if isinstance(s, (bool, np.bool_)) or not isinstance(s, numbers.Real):
      raise TypeError(f"{name}={s!r} must be a real number in (0, 1], got {type(s).__name__}")
    if not (0.0 < float(s) <= 1.0):
      raise ValueError(f"{name}={s!r} must be in (0, 1]")
    scales.append(float(s))

  # Convert microbatch boundaries into update-count boundaries by walking the run.
  boundaries, values = [0], [base_k]
  update, consumed, k, product = 0, 0, base_k, 1.0
  for (b, _), s in zip(pairs, scales, strict=False):
    product *= s
    if b > consumed:
      steps = -(-(b - consumed) // k)  # ceil: first update beginning at or after b
      update += steps
      consumed += steps * k
    k = math.floor(base_k / product + 0.5)
    if k > _INT32_MAX:
      raise ValueError(f"boundaries_and_scales gives k={k} from microbatch {b} on, more than int32 holds")
    if update == boundaries[-1]:
      values[-1] = k
    else:
      boundaries.append(update)
      values.append(k)
  return PiecewiseSchedule(*_merge(boundaries, values), "from_lr_decay")


def noise_scale(lr, dataset_size, batch_size, momentum=0.0):
  """The SGD noise scale `g = lr * N / (B (1 - m))` of Smith, Kindermans & Le (2018).

  Smith et al. ("Don't decay the learning rate, increase the batch size",
  ICLR 2018, arXiv:1711.00489) derive `g = lr (N / B - 1) ~ lr N / B` for SGD
  and `g = lr N / (B (1 - m))` with momentum `m`; runs with the same `g` along
  training reach similar test accuracy. Python numbers and concrete arrays
  are validated; traced arrays (inside `jax.jit`) are used as they are.

  Args:
    lr: the learning rate, > 0.
    dataset_size: N, the number of training examples, > 0.
    batch_size: B, examples per update (k * microbatch size), > 0.
    momentum: m, in [0, 1).

  Returns:
    `lr * dataset_size / (batch_size * (1 - momentum))`.

  Raises:
    TypeError: an argument that is not a real number (booleans included).
    ValueError: an argument out of its range, or not finite.
  """
  _check_real(lr, "lr", lambda v: v > 0, "> 0")
  _check_real(dataset_size, "dataset_size", lambda v: v > 0, "> 0")
  _check_real(batch_size, "batch_size", lambda v: v > 0, "> 0")
  _check_real(momentum, "momentum", lambda v: 0 <= v < 1, "in [0, 1)")
  return lr * dataset_size / (batch_size * (1 - momentum))


def microbatches_consumed(schedule: Callable[[Any], Any], update_count):
  """Microbatches consumed by the first `update_count` updates: `sum_{u < update_count} f(u)`.

  The inverse view of a schedule: where in the data update `update_count`
  begins. Closed form for the schedules of this module (Python ints exact,
  arrays in their own integer dtype); any other schedule is summed term by
  term and needs a Python int.

  Args:
    schedule: an every-k schedule.
    update_count: the number of completed updates, an integer >= 0.

  Returns:
    The number of microbatches those updates consumed.

  Raises:
    TypeError: `schedule` not callable, `update_count` not an integer.
    ValueError: `update_count` < 0.
  """
  if not callable(schedule):
    raise TypeError(f"schedule={schedule!r} must be callable")
  is_int = isinstance(update_count, numbers.Integral) and not isinstance(update_count, (bool, np.bool_))
  if is_int and update_count < 0:
    raise ValueError(f"{update_count=} must be >= 0")
  if not isinstance(schedule, PiecewiseSchedule):
    if not is_int:
      raise TypeError(f"{update_count=} must be a Python int for a schedule not built by jaxaccum.schedules")
    return sum(int(schedule(u)) for u in range(int(update_count)))
  starts = schedule.boundaries
  ends = starts[1:] + (None,)
  if is_int:
    u = int(update_count)
    return sum(
      v * max(0, (u if e is None else min(u, e)) - b) for b, e, v in zip(starts, ends, schedule.values, strict=False)
    )
  count = _check_count_array(update_count)
  top = int(np.iinfo(count.dtype).max)
  total = jnp.zeros(count.shape, count.dtype)
  for b, e, v in zip(starts, ends, schedule.values, strict=False):
    if b > top:  # never reached by a counter of this dtype
      break
    upper = count if e is None or e > top else jnp.minimum(count, e)
    total = total + v * (jnp.maximum(upper, b) - b)  # never below 0, so unsigned counters do not wrap
  return total


# ---------------------------------------------------------------------------- helpers


def _check_k(k, name: str) -> int:
  k = _tree.check_positive_int(k, name)
  if k > _INT32_MAX:
    raise ValueError(f"{name}={k} must fit in int32")
  return k


def _check_count_array(update_count) -> jax.Array:
  if isinstance(update_count, (str, bytes)) or update_count is None:
    raise TypeError(f"update_count={update_count!r} must be an integer >= 0, got {type(update_count).__name__}")
  try:
    count = jnp.asarray(update_count)
  except (TypeError, ValueError):  # e.g. a list of strings, an object: jax's message would not name the argument
    raise TypeError(
      f"update_count={update_count!r} must be an integer >= 0, got {type(update_count).__name__}"
    ) from None
  if not jnp.issubdtype(count.dtype, jnp.integer) or count.dtype == jnp.bool_:
    raise TypeError(f"update_count={update_count!r} must be an integer, got dtype {count.dtype}")
  if _tree.is_concrete(count) and bool(jnp.any(count < 0)):
    raise ValueError(f"update_count={update_count!r} must be >= 0")
  return count


def _check_real(value, name: str, ok, what: str) -> None:
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}={value!r} must be a real number {what}, got bool")
  if isinstance(value, jax.core.Tracer):
    return
  arr = np.asarray(value)
  if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
    raise TypeError(f"{name}={value!r} must be a real number {what}, got {type(value).__name__}")
  if not (np.all(np.isfinite(arr)) and np.all(ok(arr))):
    raise ValueError(f"{name}={value!r} must be finite and {what}")


def _pairs(container, name: str) -> list[tuple[int, Any]]:
  """`(boundary, value)` pairs sorted by boundary, boundaries checked to be ints >= 0.

  A mapping's order does not matter (it is sorted, as optax does); a sequence
  of pairs must already be strictly increasing.
  """
  if container is None:
    return []
  if isinstance(container, Mapping):
    items, ordered = list(container.items()), False
  elif isinstance(container, (str, bytes)) or not isinstance(container, Iterable):
    raise TypeError(f"{name}={container!r} must be a dict {{boundary: value}} or a sequence of pairs")
  else:
    items, ordered = [], True
    for item in container:
      if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise TypeError(f"{name} item {item!r} must be a (boundary, value) pair")
      items.append(tuple(item))
  for b, _ in items:
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, numbers.Integral):
      raise TypeError(f"{name} boundary {b!r} must be an integer >= 0, got {type(b).__name__}")
    if b < 0:
      raise ValueError(f"{name} boundary {b!r} must be an integer >= 0")
  items = [(int(b), v) for b, v in items]
  if ordered:
    for (b0, _), (b1, _) in zip(items, items[1:], strict=False):
      if b1 <= b0:
        raise ValueError(f"{name} boundaries must be strictly increasing, got {b0} then {b1}")
  return sorted(items, key=lambda item: item[0])


def _merge(boundaries: list[int], values: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Drops boundaries where k does not change."""
  out_b, out_v = [boundaries[0]], [values[0]]
  for b, v in zip(boundaries[1:], values[1:], strict=False):
    if v != out_v[-1]:
      out_b.append(b)
      out_v.append(v)
  return tuple(out_b), tuple(out_v)
