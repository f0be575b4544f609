"""Tests for jaxaccum.schedules: every-k schedules and Smith et al. (2018) batch growth."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxaccum import schedules


def _expected(boundaries, values, u):
  """Reference: the value of the last boundary <= u."""
  return [v for b, v in zip(boundaries, values, strict=False) if b <= u][-1]


def _check_everywhere(f, boundaries, values, horizon):
  """Python ints, a concrete int32 scalar, and jit with traced int32 (scalar and vector) agree."""
  us = np.arange(horizon)
  want = np.array([_expected(boundaries, values, int(u)) for u in us])
  got_py = [f(int(u)) for u in us]
  assert all(type(k) is int for k in got_py)
  np.testing.assert_array_equal(got_py, want)
  vector = jax.jit(f)(jnp.asarray(us, jnp.int32))
  assert vector.dtype == jnp.int32 and vector.shape == us.shape
  np.testing.assert_array_equal(vector, want)
  for u in {0, *boundaries, *(b - 1 for b in boundaries if b > 0), horizon - 1}:
    concrete = f(jnp.int32(u))
    assert concrete.dtype == jnp.int32 and concrete.shape == ()
    assert int(concrete) == want[u]


def test_from_lr_decay_worked_example():
  # DESIGN.md: k=1 for updates 0-99, k=2 for 100-149, k=4 from 150 on.
  f = schedules.from_lr_decay(1, {100: 0.5, 200: 0.5})
  assert (f.boundaries, f.values) == ((0, 100, 150), (1, 2, 4))
  for u, k in [(0, 1), (99, 1), (100, 2), (101, 2), (149, 2), (150, 4), (151, 4), (10**6, 4)]:
    assert f(u) == k
  _check_everywhere(f, (0, 100, 150), (1, 2, 4), horizon=200)
  # The new k starts exactly where the data crosses each boundary.
  assert schedules.microbatches_consumed(f, 100) == 100
  assert schedules.microbatches_consumed(f, 150) == 200


def test_from_lr_decay_traced_scalar_under_jit():
  f = schedules.from_lr_decay(1, {100: 0.5, 200: 0.5})

  @jax.jit
  def k_of(u):
    assert isinstance(u, jax.core.Tracer)
    return f(u)

  for u, k in [(99, 1), (100, 2), (149, 2), (150, 4)]:
    out = k_of(jnp.int32(u))
    assert out.dtype == jnp.int32 and int(out) == k
  assert int(f(jnp.int32(5))) == 1


def test_from_lr_decay_boundary_inside_an_update():
  # base_k=2, LR / 5 at microbatch 30, / 2 at microbatch 101 (not a multiple of k=10).
  f = schedules.from_lr_decay(2, {30: 0.2, 101: 0.5})
  # 15 updates of 2 reach microbatch 30 exactly; then updates of 10 start at
  # 30, 40, ..., 100 (straddles 101: keeps k=10), 110 (first at or after 101).
  assert (f.boundaries, f.values) == ((0, 15, 23), (2, 10, 20))
  assert schedules.microbatches_consumed(f, 22) == 100
  assert schedules.microbatches_consumed(f, 23) == 110
  _check_everywhere(f, (0, 15, 23), (2, 10, 20), horizon=40)


def test_from_lr_decay_rounding_and_edge_cases():
  # 1/0.3 = 3.33 -> 3; cumulative 1/0.09 = 11.1 -> 11 (not 3 * 3 = 9: no compounding).
  f = schedules.from_lr_decay(1, {10: 0.3, 20: 0.3})
  assert f.values == (1, 3, 11)
  # Ties round up: 1 / 0.4 = 2.5 -> 3; a boundary at 0 applies from the start.
  assert schedules.from_lr_decay(1, {0: 0.4}).values == (3,)
  # Exact inverses are exact, whatever the float error of the product.
  assert schedules.from_lr_decay(3, {10: 0.1, 100: 0.1, 1000: 1 / 3}).values == (3, 30, 300, 900)
  # No decay, None, or scale 1: constant base_k.
  for spec in (None, {}, [], {50: 1.0}):
    assert schedules.from_lr_decay(4, spec).values == (4,)
  # Boundaries that fall inside the same update collapse into the last one.
  g = schedules.from_lr_decay(3, {10: 0.3, 11: 0.5})
  assert (g.boundaries, g.values) == ((0, 4), (3, 20))
  # A dict's order is irrelevant (optax sorts); sorted pairs mean the same.
  a = schedules.from_lr_decay(1, {200: 0.5, 100: 0.5})
  b = schedules.from_lr_decay(1, [(100, 0.5), (200, 0.5)])
  assert (a.boundaries, a.values) == (b.boundaries, b.values) == ((0, 100, 150), (1, 2, 4))
  assert repr(a) == "from_lr_decay({0: 1, 100: 2, 150: 4})"
  # A boundary beyond the counter dtype's range is never reached (not even at its maximum).
  far = schedules.from_lr_decay(1, {2**40: 0.5})
  assert int(far(jnp.int32(2**31 - 1))) == 1 and far(2**41) == 2
  assert int(schedules.from_lr_decay(1, {300: 0.5})(jnp.uint8(255))) == 1
  assert int(schedules.microbatches_consumed(far, jnp.int32(7))) == 7
  # Unsigned counters do not wrap below a boundary not yet reached.
  assert int(schedules.microbatches_consumed(schedules.from_lr_decay(1, {100: 0.5}), jnp.uint32(5))) == 5


@pytest.mark.parametrize(
  "base_k, boundaries_and_scales, momentum",
  [
    (1, {100: 0.5, 200: 0.5}, 0.0),  # the worked example: exact
    (2, {30: 0.2, 101: 0.5}, 0.9),  # boundary inside an update: exact at update starts
    (1, {10: 0.3, 25: 0.3, 77: 0.7}, 0.0),  # non-integer inverses: within rounding of k
  ],
)
def test_noise_scale_matches_decaying_lr_along_the_run(base_k, boundaries_and_scales, momentum):
  base_lr, dataset_size, micro = 0.1, 50_000, 8
  lr_schedule = optax.piecewise_constant_schedule(base_lr, boundaries_and_scales)
  f = schedules.from_lr_decay(base_k, boundaries_and_scales)
  exact = all(abs(1 / s - round(1 / s)) < 1e-9 for s in boundaries_and_scales.values())
  consumed = 0
  for u in range(120):
    k = f(u)
    assert consumed == schedules.microbatches_consumed(f, u)
    # Reference run: batch base_k * micro, its LR schedule read at the same data point
    # (`consumed` microbatches; optax applies a scale when count >= boundary).
    reference = schedules.noise_scale(float(lr_schedule(consumed)), dataset_size, base_k * micro, momentum)
    growing = schedules.noise_scale(base_lr, dataset_size, k * micro, momentum)
    if exact:
      assert math.isclose(growing, reference, rel_tol=1e-12), (u, consumed, k)
    else:
      # k is the exact ratio rounded to the nearest integer: off by at most 1/2.
      exact_k = base_k * base_lr / float(lr_schedule(consumed))
      assert abs(k - exact_k) <= 0.5 + 1e-9, (u, k, exact_k)
      assert abs(growing / reference - 1) <= 0.5 / k + 1e-9
    consumed += k


def test_constant_and_piecewise_values():
  c = schedules.constant(4)
  assert c(0) == 4 and c(10**9) == 4
  _check_everywhere(c, (0,), (4,), horizon=5)
  np.testing.assert_array_equal(c(jnp.arange(3)), [4, 4, 4])

  p = schedules.piecewise({0: 2, 10: 4, 20: 8})
  _check_everywhere(p, (0, 10, 20), (2, 4, 8), horizon=25)
  # No key 0: k=1 (the default init_value) until the first key.
  assert schedules.piecewise({5: 3}).values == (1, 3)
  assert schedules.piecewise({5: 3}, init_value=2).values == (2, 3)
  # Pairs, decreasing k, repeated values merged, empty.
  q = schedules.piecewise([(0, 8), (3, 8), (6, 2)])
  assert (q.boundaries, q.values) == ((0, 6), (8, 2))
  assert schedules.piecewise({}).values == (1,)
  assert schedules.piecewise(None, init_value=3).values == (3,)
  assert repr(p) == "piecewise({0: 2, 10: 4, 20: 8})"


def test_microbatches_consumed():
  f = schedules.piecewise({0: 2, 3: 5, 7: 1})
  brute = np.cumsum([0] + [f(u) for u in range(12)])
  assert [schedules.microbatches_consumed(f, u) for u in range(13)] == list(brute)
  got = jax.jit(lambda u: schedules.microbatches_consumed(f, u))(jnp.arange(13, dtype=jnp.int32))
  np.testing.assert_array_equal(got, brute)
  # Any callable schedule, summed term by term.
  assert schedules.microbatches_consumed(lambda u: u + 1, 4) == 1 + 2 + 3 + 4


def test_noise_scale_values():
  assert math.isclose(schedules.noise_scale(0.1, 50_000, 128), 0.1 * 50_000 / 128)
  assert math.isclose(schedules.noise_scale(0.1, 50_000, 128, momentum=0.9), 0.1 * 50_000 / 128 / 0.1)
  # Halving the LR or doubling the batch gives the same noise scale.
  assert math.isclose(schedules.noise_scale(0.05, 1000, 64), schedules.noise_scale(0.1, 1000, 128))
  traced = jax.jit(schedules.noise_scale)(jnp.float32(0.1), 1000, jnp.int32(4) * 8, 0.5)
  assert math.isclose(float(traced), 0.1 * 1000 / 32 / 0.5, rel_tol=1e-6)


@pytest.mark.parametrize(
  "call, error, name",
  [
    (lambda: schedules.constant(0), ValueError, "k=0"),
    (lambda: schedules.constant(-2), ValueError, "k=-2"),
    (lambda: schedules.constant(1.5), TypeError, "k=1.5"),
    (lambda: schedules.constant(True), TypeError, "k=True"),
    (lambda: schedules.constant(2**31), ValueError, "k="),
    (lambda: schedules.piecewise({0: 0}), ValueError, r"boundaries_and_values\[0\]=0"),
    (lambda: schedules.piecewise({5: 2.0}), TypeError, r"boundaries_and_values\[5\]=2.0"),
    (lambda: schedules.piecewise({-1: 2}), ValueError, "boundaries_and_values boundary -1"),
    (lambda: schedules.piecewise({1.5: 2}), TypeError, "boundaries_and_values boundary 1.5"),
    (lambda: schedules.piecewise([(5, 2), (3, 4)]), ValueError, "boundaries_and_values boundaries must be strictly"),
    (lambda: schedules.piecewise([(5, 2), (5, 4)]), ValueError, "boundaries_and_values boundaries must be strictly"),
    (lambda: schedules.piecewise([(5, 2, 1)]), TypeError, "boundaries_and_values item"),
    (lambda: schedules.piecewise("abc"), TypeError, "boundaries_and_values='abc'"),
    (lambda: schedules.piecewise(7), TypeError, "boundaries_and_values=7"),
    (lambda: schedules.piecewise({}, init_value=0), ValueError, "init_value=0"),
    (lambda: schedules.piecewise({0: 2}, init_value=3), ValueError, "init_value=3"),
    (lambda: schedules.from_lr_decay(0, {}), ValueError, "base_k=0"),
    (lambda: schedules.from_lr_decay(2.0, {}), TypeError, "base_k=2.0"),
    (lambda: schedules.from_lr_decay(True, {}), TypeError, "base_k=True"),
    (lambda: schedules.from_lr_decay(1, {-10: 0.5}), ValueError, "boundaries_and_scales boundary -10"),
    (lambda: schedules.from_lr_decay(1, {10.0: 0.5}), TypeError, "boundaries_and_scales boundary 10.0"),
    (
      lambda: schedules.from_lr_decay(1, [(20, 0.5), (10, 0.5)]),
      ValueError,
      "boundaries_and_scales boundaries must be strictly",
    ),
    (lambda: schedules.from_lr_decay(1, {10: 0.0}), ValueError, r"boundaries_and_scales\[10\]=0.0 must be in \(0, 1\]"),
    (lambda: schedules.from_lr_decay(1, {10: 1.5}), ValueError, r"boundaries_and_scales\[10\]=1.5"),
    (lambda: schedules.from_lr_decay(1, {10: -0.5}), ValueError, r"boundaries_and_scales\[10\]=-0.5"),
    (lambda: schedules.from_lr_decay(1, {10: float("nan")}), ValueError, r"boundaries_and_scales\[10\]=nan"),
    (lambda: schedules.from_lr_decay(1, {10: "0.5"}), TypeError, r"boundaries_and_scales\[10\]='0.5'"),
    (lambda: schedules.from_lr_decay(1, {10: True}), TypeError, r"boundaries_and_scales\[10\]=True"),
    (lambda: schedules.from_lr_decay(1, {10: 1e-10}), ValueError, "boundaries_and_scales gives k="),
    (lambda: schedules.from_lr_decay(1, 0.5), TypeError, "boundaries_and_scales=0.5"),
    (lambda: schedules.noise_scale(0.0, 100, 8), ValueError, "lr=0.0"),
    (lambda: schedules.noise_scale(float("inf"), 100, 8), ValueError, "lr=inf"),
    (lambda: schedules.noise_scale("0.1", 100, 8), TypeError, "lr='0.1'"),
    (lambda: schedules.noise_scale(0.1, 0, 8), ValueError, "dataset_size=0"),
    (lambda: schedules.noise_scale(0.1, True, 8), TypeError, "dataset_size=True"),
    (lambda: schedules.noise_scale(0.1, 100, -8), ValueError, "batch_size=-8"),
    (lambda: schedules.noise_scale(0.1, 100, 8, momentum=1.0), ValueError, "momentum=1.0"),
    (lambda: schedules.noise_scale(0.1, 100, 8, momentum=-0.1), ValueError, "momentum=-0.1"),
    (lambda: schedules.constant(2)(-1), ValueError, "update_count=-1"),
    (lambda: schedules.constant(2)(jnp.float32(1.0)), TypeError, "update_count"),
    (lambda: schedules.constant(2)(jnp.array([-1, 2])), ValueError, "update_count"),
    (lambda: schedules.microbatches_consumed(3, 5), TypeError, "schedule=3"),
    (lambda: schedules.microbatches_consumed(schedules.constant(2), -1), ValueError, "update_count=-1"),
    (lambda: schedules.microbatches_consumed(lambda u: 2, jnp.int32(3)), TypeError, "update_count"),
    # Issue 22: a string or None named no argument (jax's own "not a valid JAX array type").
    (lambda: schedules.constant(2)("3"), TypeError, r"update_count='3' must be an integer"),
    (lambda: schedules.constant(2)(None), TypeError, r"update_count=None must be an integer"),
    (lambda: schedules.piecewise({0: 1, 5: 4})(["1"]), TypeError, r"update_count=\['1'\] must be an integer"),
    (lambda: schedules.from_lr_decay(1, {3: 0.5})(b"3"), TypeError, r"update_count=b'3' must be an integer"),
    (lambda: schedules.microbatches_consumed(schedules.constant(2), "3"), TypeError, r"update_count='3'"),
    (lambda: schedules.microbatches_consumed(schedules.constant(2), None), TypeError, r"update_count=None"),
  ],
)
def test_bad_input(call, error, name):
  with pytest.raises(error, match=name):
    call()


def test_accumulate_with_from_lr_decay_updates_where_expected():
  """ja.accumulate driven by from_lr_decay emits its updates exactly at the schedule's window ends."""
  import optax

  import jaxaccum as ja

  schedule = ja.schedules.from_lr_decay(1, {3: 0.5, 7: 0.5})  # k = 1, 1, 1, 2, 2, 4, ...
  tx = ja.accumulate(optax.sgd(1.0), schedule)
  params = {"w": jnp.zeros(2)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  emitted = []
  for call in range(15):
    _, state = update({"w": jnp.ones(2)}, state, params)
    if bool(ja.has_updated(state)):
      emitted.append(call)
  # Windows: [0], [1], [2], [3, 4], [5, 6], [7..10], [11..14]
  assert emitted == [0, 1, 2, 4, 6, 10, 14]
  assert int(state.update_count) == 7
