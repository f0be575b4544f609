"""ja.noise: the noise-scale estimator, AdaScale and the noise-driven window, against plain references."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import smoke
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo, noise

RTOL = 1e-12


# ---------------------------------------------------------------------------------------------
# The synthetic problem: per-example loss 0.5 |theta - x_n|^2 with x_n ~ N(mu, I), so the
# per-example gradient is theta - x_n: G = theta - mu and Sigma = I, tr(Sigma) = d.

D = 32


def synthetic_microbatch_grads(key, num_windows, sizes, g_true):
  """Mean gradients of each microbatch, shape (num_windows, K, D): G - mean of its noise rows."""
  sizes = np.asarray(sizes)
  n = int(sizes.sum())
  noise_rows = jax.random.normal(key, (num_windows, n, D))
  segment = np.repeat(np.arange(len(sizes)), sizes)
  sums = jax.vmap(lambda e: jax.ops.segment_sum(e, segment, num_segments=len(sizes)))(noise_rows)
  return g_true - sums / sizes[None, :, None]


def plain_estimates(grads, sizes):
  """The per-window estimates written out in numpy from the formulas (no jaxaccum code)."""
  b = np.asarray(sizes, float)
  big_b = b.sum()
  k = len(b)
  g = np.asarray(grads)  # (W, K, D)
  s1 = np.einsum("k,wkd,wkd->w", b, g, g) / big_b
  mean = np.einsum("k,wkd->wd", b, g) / big_b
  s2 = np.einsum("wd,wd->w", mean, mean)
  return (k * s2 - s1) / (k - 1), big_b * (s1 - s2) / (k - 1)


def run_windows(grads, sizes, decay):
  """Feeds every window through window_estimates/update_state in one jitted scan."""
  b = jnp.asarray(sizes, jnp.float64)

  @jax.jit
  def run(grads):
    def body(state, g):
      weighted_sq = jnp.sum(b * jnp.sum(g * g, axis=-1))
      mean = jnp.sum(b[:, None] * g, axis=0) / jnp.sum(b)
      est = noise.window_estimates(weighted_sq, jnp.sum(b), jnp.sum(mean * mean), jnp.asarray(len(sizes)))
      return noise.update_state(state, *est, decay), est[:2]

    return jax.lax.scan(body, noise.init_state(jnp.float64), grads)

  return run(grads)


@pytest.mark.parametrize("sizes", [[16] * 8, [3, 5, 8, 16, 32, 4, 40, 20]], ids=["equal", "unequal"])
def test_synthetic_estimates_converge(sizes):
  g_true = jnp.full((D,), 1.0 / np.sqrt(D)).at[0].add(0.5)  # |G|^2 = 1 + 1/sqrt(D) + 1/4 -ish
  grad_sq_true = float(jnp.sum(g_true**2))
  grads = synthetic_microbatch_grads(jax.random.PRNGKey(0), 400, sizes, g_true)
  state, per_window = run_windows(grads, sizes, decay=0.99)
  # Each window's estimates are the formulas' values.
  ref_g2, ref_tr = plain_estimates(grads, sizes)
  np.testing.assert_allclose(per_window[0], ref_g2, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(per_window[1], ref_tr, rtol=1e-10)
  # Unbiased: their plain means over all windows are close to the truth...
  assert abs(ref_tr.mean() / D - 1) < 0.03
  assert abs(ref_g2.mean() / grad_sq_true - 1) < 0.1
  # ...and the EMA's bias-corrected reading within 10-15%.
  measured = noise.noise_scale(state)
  assert int(state.windows) == 400
  assert abs(float(measured.trace_cov) / D - 1) < 0.10
  assert abs(float(measured.grad_sq) / grad_sq_true - 1) < 0.15
  assert abs(float(measured.b_simple) / (D / grad_sq_true) - 1) < 0.15


def test_window_estimates_on_fixed_inputs():
  # K = 3 microbatches of sizes 1, 2, 3 with hand-picked 2-d gradients.
  b = np.array([1.0, 2.0, 3.0])
  g = np.array([[1.0, 2.0], [0.5, -1.0], [2.0, 0.25]])
  big_b = b.sum()
  s1 = float(np.sum(b * np.sum(g * g, axis=1)) / big_b)
  mean = (b[:, None] * g).sum(0) / big_b
  s2 = float(mean @ mean)
  g2, tr, valid = noise.window_estimates(jnp.asarray(s1 * big_b), jnp.asarray(big_b), jnp.asarray(s2), jnp.asarray(3))
  assert bool(valid)
  np.testing.assert_allclose(float(g2), (3 * s2 - s1) / 2, rtol=RTOL)
  np.testing.assert_allclose(float(tr), big_b * (s1 - s2) / 2, rtol=RTOL)


def test_window_with_one_microbatch_leaves_the_average_unchanged():
  state = noise.update_state(noise.init_state(jnp.float64), jnp.asarray(2.0), jnp.asarray(6.0), jnp.asarray(True), 0.9)
  est = noise.window_estimates(jnp.asarray(5.0), jnp.asarray(4.0), jnp.asarray(1.0), jnp.asarray(1))
  assert not bool(est[2])
  after = noise.update_state(state, *est, 0.9)
  chex.assert_trees_all_equal(after, state)
  # A non-finite window is dropped too.
  est = noise.window_estimates(jnp.asarray(jnp.inf), jnp.asarray(4.0), jnp.asarray(1.0), jnp.asarray(4))
  assert not bool(est[2])
  chex.assert_trees_all_equal(noise.update_state(state, *est, 0.9), state)


def test_bias_correction_reads_the_plain_weighted_average():
  decay = 0.8
  xs = [(2.0, 6.0), (1.0, 9.0), (4.0, 3.0)]
  state = noise.init_state(jnp.float64)
  for g2, tr in xs:
    state = noise.update_state(state, jnp.asarray(g2), jnp.asarray(tr), jnp.asarray(True), decay)
  weights = np.array([decay**2, decay, 1.0]) * (1 - decay)
  g2_ref = np.dot(weights, [x[0] for x in xs]) / weights.sum()
  tr_ref = np.dot(weights, [x[1] for x in xs]) / weights.sum()
  measured = noise.noise_scale(state)
  np.testing.assert_allclose(float(measured.grad_sq), g2_ref, rtol=RTOL)
  np.testing.assert_allclose(float(measured.trace_cov), tr_ref, rtol=RTOL)
  np.testing.assert_allclose(float(measured.b_simple), tr_ref / g2_ref, rtol=RTOL)
  # decay = 0: the last window.
  zero = noise.init_state(jnp.float64)
  for g2, tr in xs:
    zero = noise.update_state(zero, jnp.asarray(g2), jnp.asarray(tr), jnp.asarray(True), 0.0)
  chex.assert_trees_all_equal(noise.noise_scale(zero), noise.NoiseScale(*map(jnp.asarray, (0.75, 4.0, 3.0))))


def test_noise_scale_before_any_window_is_nan_and_finds_nested_states():
  state = noise.init_state(jnp.float64)
  assert all(np.isnan(float(x)) for x in noise.noise_scale(state))
  state = noise.update_state(state, jnp.asarray(2.0), jnp.asarray(6.0), jnp.asarray(True), 0.5)
  nested = (optax.EmptyState(), {"noise": state})
  chex.assert_trees_all_equal(noise.noise_scale(nested), noise.noise_scale(state))


def test_noise_scale_of_a_state_without_tracking():
  with pytest.raises(ValueError, match="noise_scale_ema"):
    noise.noise_scale(optax.sgd(0.1).init({"w": jnp.zeros(3)}))
  two = (noise.init_state(), noise.init_state())
  with pytest.raises(ValueError, match="2 noise-scale"):
    noise.noise_scale(two)


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), float("inf"), 1.5])
def test_check_decay_rejects(bad):
  with pytest.raises(ValueError, match="noise_scale_ema"):
    noise.check_decay(bad)


@pytest.mark.parametrize("bad", [True, "0.9", None, jnp.asarray([0.9, 0.9])])
def test_check_decay_rejects_types(bad):
  with pytest.raises(TypeError, match="noise_scale_ema"):
    noise.check_decay(bad)


def test_check_decay_accepts():
  assert noise.check_decay(0) == 0.0
  assert noise.check_decay(np.float32(0.5)) == 0.5
  assert noise.check_decay(0.999) == 0.999


# ---------------------------------------------------------------------------------------------
# AdaScale.


def plain_gain(grad_sq, trace_cov, batch_weight, s):
  """Johnson et al. (2020) eq. 3 written out: sigma^2 is the base batch's variance."""
  base = batch_weight / s
  sigma2 = trace_cov / base
  return (sigma2 + grad_sq) / (sigma2 / s + grad_sq)


@pytest.mark.parametrize(
  "grad_sq,trace_cov,batch_weight,s",
  [
    (1.0, 32.0, 128.0, 8.0),
    (0.25, 3.0, 7.0, 2.5),
    (3.0, 1e-3, 64.0, 16.0),
    (1e-4, 50.0, 10.0, 4.0),
  ],
)
def test_adascale_gain_against_the_formula(grad_sq, trace_cov, batch_weight, s):
  r = noise.adascale_gain(jnp.asarray(grad_sq), jnp.asarray(trace_cov), batch_weight, s)
  np.testing.assert_allclose(float(r), plain_gain(grad_sq, trace_cov, batch_weight, s), rtol=RTOL)
  assert 1.0 <= float(r) <= s


def test_adascale_gain_edge_cases():
  # Negative estimates are clipped: all noise -> S; all signal -> 1; nothing measured -> 1.
  assert float(noise.adascale_gain(-1.0, 5.0, 10.0, 4.0)) == 4.0
  assert float(noise.adascale_gain(2.0, -5.0, 10.0, 4.0)) == 1.0
  assert float(noise.adascale_gain(jnp.nan, jnp.nan, 10.0, 4.0)) == 1.0
  assert float(noise.adascale_gain(0.0, 0.0, 10.0, 4.0)) == 1.0


def _stats(key, steps):
  k1, k2, k3 = jax.random.split(key, 3)
  return (
    jnp.abs(jax.random.normal(k1, (steps,))) + 0.1,
    jnp.abs(jax.random.normal(k2, (steps,))) * 30,
    jax.random.normal(k3, (steps, 5)),
  )


@pytest.mark.parametrize(
  "make", [lambda: optax.sgd(0.1, momentum=0.9), lambda: optax.adam(0.05)], ids=["momentum", "adam"]
)
def test_adascale_scale_one_is_inner_bit_for_bit(make):
  params = {"w": jnp.linspace(-1.0, 1.0, 5)}
  g2s, trs, grads = _stats(jax.random.PRNGKey(3), 6)
  ada, plain = noise.adascale(make(), scale=1), make()
  sa, sp = ada.init(params), plain.init(params)
  for g2, tr, g in zip(g2s, trs, grads, strict=True):
    measured = noise.NoiseScale(tr / g2, g2, tr)
    ua, sa = ada.update({"w": g}, sa, params, noise_scale=measured, batch_weight=16.0)
    up, sp = plain.update({"w": g}, sp, params)
    chex.assert_trees_all_equal(ua, up)
  chex.assert_trees_all_equal(sa.inner_state, sp)
  assert float(sa.progress) == 6.0


def test_adascale_scales_the_update_and_counts_progress():
  params = {"w": jnp.zeros(5)}
  g2s, trs, grads = _stats(jax.random.PRNGKey(4), 5)
  ada = noise.adascale(optax.sgd(0.1), scale=lambda count: 2.0 + count)
  state = ada.init(params)
  progress = 0.0
  for i, (g2, tr, g) in enumerate(zip(g2s, trs, grads, strict=True)):
    measured = noise.NoiseScale(tr / g2, g2, tr)
    u, state = ada.update({"w": g}, state, params, noise_scale=measured, batch_weight=32.0)
    r = plain_gain(float(g2), float(tr), 32.0, 2.0 + i)
    np.testing.assert_allclose(u["w"], -0.1 * r * np.asarray(g), rtol=RTOL)
    progress += r
    np.testing.assert_allclose(float(state.gain), r, rtol=RTOL)
  np.testing.assert_allclose(float(state.progress), progress, rtol=RTOL)
  assert int(state.update_count) == 5


def test_adascale_learning_rate_schedule_runs_on_progress():
  params = {"w": jnp.zeros(5)}
  g2s, trs, grads = _stats(jax.random.PRNGKey(5), 4)
  schedule = optax.linear_schedule(1.0, 0.0, transition_steps=40)
  ada = noise.adascale(optax.identity(), base_batch_size=4.0, learning_rate=schedule)
  state = ada.init(params)
  progress = 0.0
  for g2, tr, g in zip(g2s, trs, grads, strict=True):
    measured = noise.NoiseScale(tr / g2, g2, tr)
    u, state = ada.update({"w": g}, state, params, noise_scale=measured, batch_weight=24.0)
    r = plain_gain(float(g2), float(tr), 24.0, 6.0)
    np.testing.assert_allclose(u["w"], -(1.0 - progress / 40) * r * np.asarray(g), rtol=RTOL)
    progress += r


def test_adascale_under_jit_and_before_any_measurement():
  params = {"w": jnp.ones(3)}
  ada = noise.adascale(optax.sgd(1.0), scale=8)
  nan = jnp.asarray(jnp.nan)
  u, state = jax.jit(ada.update)(
    {"w": jnp.ones(3)}, ada.init(params), params, noise_scale=noise.NoiseScale(nan, nan, nan), batch_weight=8.0
  )
  chex.assert_trees_all_equal(u, {"w": -jnp.ones(3)})
  assert float(state.gain) == 1.0


def test_adascale_bad_input():
  with pytest.raises(ValueError, match="exactly one"):
    noise.adascale(optax.sgd(0.1))
  with pytest.raises(ValueError, match="exactly one"):
    noise.adascale(optax.sgd(0.1), scale=2, base_batch_size=3)
  with pytest.raises(ValueError, match="scale=0.5"):
    noise.adascale(optax.sgd(0.1), scale=0.5)
  with pytest.raises(ValueError, match="scale=nan"):
    noise.adascale(optax.sgd(0.1), scale=float("nan"))
  with pytest.raises(TypeError, match="scale"):
    noise.adascale(optax.sgd(0.1), scale="8")
  with pytest.raises(ValueError, match="base_batch_size=0"):
    noise.adascale(optax.sgd(0.1), base_batch_size=0)
  with pytest.raises(TypeError, match="learning_rate"):
    noise.adascale(optax.identity(), scale=2, learning_rate="0.1")
  ada = noise.adascale(optax.sgd(0.1), scale=2)
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match="noise_scale="):
    ada.update(params, ada.init(params), params)
  with pytest.raises(TypeError, match="NoiseScale"):
    ada.update(params, ada.init(params), params, noise_scale=(1.0, 1.0, 1.0), batch_weight=2.0)


# ---------------------------------------------------------------------------------------------
# The noise-driven window length.


def test_every_k_from_noise_scale_values():
  rule = noise.every_k_from_noise_scale(16, k_max=32, k_min=2, k_init=4)

  def k(b_simple_grad_sq, trace_cov):
    g2 = jnp.asarray(b_simple_grad_sq, jnp.float64)
    tr = jnp.asarray(trace_cov, jnp.float64)
    return int(rule(noise.NoiseScale(tr / g2, g2, tr)))

  assert k(1.0, 16 * 7.4) == 7
  assert k(1.0, 16 * 7.6) == 8
  assert k(1.0, 1.0) == 2  # below k_min
  assert k(1.0, 1e6) == 32  # above k_max
  assert k(-1.0, 5.0) == 32  # no signal seen above the noise yet
  assert k(1.0, -5.0) == 2  # no noise seen
  assert k(jnp.nan, jnp.nan) == 4  # nothing measured yet
  assert k(-1.0, -1.0) == 4
  assert rule(noise.NoiseScale(*[jnp.asarray(1.0, jnp.float32)] * 3)).dtype == jnp.int32


def test_every_k_from_noise_scale_bad_input():
  with pytest.raises(ValueError, match="k_max=0"):
    noise.every_k_from_noise_scale(16, k_max=0)
  with pytest.raises(ValueError, match="k_min=4"):
    noise.every_k_from_noise_scale(16, k_max=3, k_min=4)
  with pytest.raises(ValueError, match="k_init=9"):
    noise.every_k_from_noise_scale(16, k_max=8, k_init=9)
  with pytest.raises(TypeError, match="k_max"):
    noise.every_k_from_noise_scale(16, k_max=2.5)
  with pytest.raises(ValueError, match="microbatch_size=0"):
    noise.every_k_from_noise_scale(0, k_max=8)
  with pytest.raises(TypeError, match="microbatch_size"):
    noise.every_k_from_noise_scale("16", k_max=8)


# ---------------------------------------------------------------------------------------------
# ja.accumulate(..., noise_scale_ema=beta).


def plain_ema(values, decay):
  """Bias-corrected EMA written out: sum_t decay^(n-1-t) (1-decay) x_t / (1 - decay^n)."""
  n = len(values)
  w = np.array([decay ** (n - 1 - t) * (1 - decay) for t in range(n)])
  return float(np.dot(w, values) / (1 - decay**n))


def run_accumulate(tx, grads, sizes):
  """Feeds grads (W, K, D) window by window (weights = sizes) through tx.update in one jitted scan."""
  params = {"theta": jnp.zeros(D)}
  b = jnp.asarray(sizes, jnp.float64)

  @jax.jit
  def run(grads):
    def body(state, g_and_w):
      g, w = g_and_w
      _, state = tx.update({"theta": g}, state, params, weight=w)
      return state, None

    flat = grads.reshape(-1, D)
    weights = jnp.tile(b, grads.shape[0])
    return jax.lax.scan(body, tx.init(params), (flat, weights))[0]

  return run(grads)


@pytest.mark.parametrize("sizes", [[16] * 8, [3, 5, 8, 16, 32, 4, 40, 20]], ids=["equal", "unequal"])
def test_accumulate_measures_the_synthetic_noise_scale(sizes):
  g_true = jnp.full((D,), 1.0 / np.sqrt(D)).at[0].add(0.5)
  grad_sq_true = float(jnp.sum(g_true**2))
  grads = synthetic_microbatch_grads(jax.random.PRNGKey(1), 300, sizes, g_true)
  tx = ja.accumulate(optax.set_to_zero(), len(sizes), noise_scale_ema=0.98)
  state = run_accumulate(tx, grads, sizes)
  measured = noise.noise_scale(state)
  # Exactly the plainly written estimator and EMA...
  ref_g2, ref_tr = plain_estimates(grads, sizes)
  np.testing.assert_allclose(float(measured.grad_sq), plain_ema(ref_g2, 0.98), rtol=1e-10)
  np.testing.assert_allclose(float(measured.trace_cov), plain_ema(ref_tr, 0.98), rtol=1e-10)
  assert int(state.noise_stats.windows) == 300
  # ...and within 10-15% of the truth: tr(Sigma) = D per example, |G|^2, B_simple in examples.
  assert abs(float(measured.trace_cov) / D - 1) < 0.10
  assert abs(float(measured.grad_sq) / grad_sq_true - 1) < 0.15
  assert abs(float(measured.b_simple) / (D / grad_sq_true) - 1) < 0.15


def _accumulate_trajectory(tx, params, steps, use_apply):
  @jax.jit
  def step(params, state, g, w):
    if use_apply:
      return tx.update.apply_gradients(g, state, params, weight=w)
    updates, state = tx.update(g, state, params, weight=w)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  out = []
  for g, w in steps:
    params, state = step(params, state, g, w)
    out.append(params)
  return out, state


@pytest.mark.parametrize("every_k,skip,use_apply", [(3, False, False), (3, True, True), (2, False, True)])
def test_accumulate_updates_are_unchanged_bit_for_bit(every_k, skip, use_apply):
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
  keys = jax.random.split(jax.random.PRNGKey(7), 9)
  steps = [
    (jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params), jnp.float64(1 + i % 4))
    for i, k in enumerate(keys)
  ]
  steps[4] = (steps[4][0], jnp.float64(0.0))  # weight 0: adds nothing, does not count in K
  if skip:
    steps[5] = ({"w": steps[5][0]["w"].at[0, 0].set(jnp.nan), "b": steps[5][0]["b"]}, steps[5][1])
  kwargs = dict(skip_nonfinite=skip)
  plain, s_plain = _accumulate_trajectory(ja.accumulate(optax.adam(0.05), every_k, **kwargs), params, steps, use_apply)
  tracked, s_tracked = _accumulate_trajectory(
    ja.accumulate(optax.adam(0.05), every_k, noise_scale_ema=0.9, **kwargs), params, steps, use_apply
  )
  chex.assert_trees_all_equal(tracked, plain)
  assert s_plain.noise_stats is None
  chex.assert_trees_all_equal(s_tracked._replace(noise_stats=None), s_plain)
  if every_k == 3:  # with skip, the window (w=4, w=0, NaN) holds one counted microbatch: not measured
    assert int(s_tracked.noise_stats.windows) == (2 if skip else 3)
  else:  # windows of 2 over 9 calls: 4 complete, one of them (w=4, w=0) with a single counted microbatch
    assert int(s_tracked.noise_stats.windows) == 3


def test_accumulate_noise_counts_only_microbatches_of_weight_above_zero():
  # Window of 4 calls, one of weight 0 with a NaN gradient: K = 3 and the NaN does not leak.
  g = [jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0]), jnp.array([jnp.nan, 0.0]), jnp.array([2.0, 0.25])]
  b = [1.0, 2.0, 0.0, 3.0]
  tx = ja.accumulate(optax.sgd(0.1), 4, noise_scale_ema=0.0)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for gi, bi in zip(g, b, strict=True):
    _, state = tx.update({"w": gi}, state, params, weight=bi)
  kept = [0, 1, 3]
  ref_g2, ref_tr = plain_estimates(np.stack([g[i] for i in kept])[None], [b[i] for i in kept])
  measured = noise.noise_scale(state)
  np.testing.assert_allclose(float(measured.grad_sq), ref_g2[0], rtol=RTOL)
  np.testing.assert_allclose(float(measured.trace_cov), ref_tr[0], rtol=RTOL)


def test_accumulate_noise_on_8_devices_counts_every_microbatch_of_every_device():
  n_dev, k, windows = 8, 2, 60
  sizes = np.array([[3, 9], [4, 4], [8, 2], [5, 7], [6, 6], [1, 11], [10, 2], [7, 3]])  # (device, microbatch)
  g_true = jnp.full((D,), 1.0 / np.sqrt(D)).at[0].add(0.5)
  grads = synthetic_microbatch_grads(jax.random.PRNGKey(2), windows, sizes.reshape(-1), g_true)  # (W, 16, D)
  grads = grads.reshape(windows, n_dev, k, D)
  mesh = ja.data_mesh("data")
  tx = ja.accumulate(optax.set_to_zero(), k, axis_name="data", noise_scale_ema=0.9)
  params = {"theta": jnp.zeros(D)}

  def per_device(state, f):
    stats = state.noise_stats
    return state._replace(
      acc_grads=jax.tree.map(f, state.acc_grads),
      acc_weight=f(state.acc_weight),
      num_skipped=f(state.num_skipped),
      noise_stats=stats._replace(acc_sq=f(stats.acc_sq), acc_count=f(stats.acc_count)),
    )

  state = per_device(tx.init(params), lambda a: jnp.stack([a] * n_dev))
  spec = per_device(jax.tree.map(lambda _: P(), state), lambda _: P("data"))

  def body(state, g, w):
    _, state = tx.update({"theta": g[0]}, per_device(state, lambda a: a[0]), params, weight=w[0])
    return per_device(state, lambda a: a[None])

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P("data"), P("data")), out_specs=spec))
  for w_i in range(windows):
    for i in range(k):
      state = step(state, grads[w_i, :, i], jnp.asarray(sizes[:, i], jnp.float64))
  ref_g2, ref_tr = plain_estimates(grads.reshape(windows, n_dev * k, D), sizes.reshape(-1))
  measured = noise.noise_scale(state)
  np.testing.assert_allclose(np.asarray(measured.grad_sq), plain_ema(ref_g2, 0.9), rtol=1e-10)
  np.testing.assert_allclose(np.asarray(measured.trace_cov), plain_ema(ref_tr, 0.9), rtol=1e-10)
  assert abs(float(plain_ema(ref_tr, 0.9)) / D - 1) < 0.15


@pytest.mark.parametrize("comm_dtype", [None, jnp.float32], ids=["f64", "comm_f32"])
def test_accumulate_noise_adds_no_collective(comm_dtype):
  params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}

  def hlo(noise_scale_ema):
    tx = ja.accumulate(optax.adam(0.1), 4, axis_name="data", comm_dtype=comm_dtype, noise_scale_ema=noise_scale_ema)
    step = jax.pmap(lambda g, s: tx.update(g, s, params, weight=2.0), axis_name="data", in_axes=(0, None))
    g = jax.tree.map(lambda p: jnp.ones((8, *p.shape)), params)
    return step.lower(g, tx.init(params)).compile().as_text()

  plain, tracked = hlo(None), hlo(0.9)
  n_plain, e_plain = _hlo.all_reduce_sizes(plain)
  n_tracked, e_tracked = _hlo.all_reduce_sizes(tracked)
  assert n_tracked == n_plain, (n_plain, n_tracked)
  assert e_tracked == e_plain + 2, (e_plain, e_tracked)  # two scalars ride along: sum w|g|^2 and K
  assert _hlo.locate(tracked, "all-reduce")["top"] == 0


def test_every_k_from_noise_scale_grows_the_window_without_recompiling():
  # theta moves towards mu with sgd: |G|^2 shrinks, B_simple grows, and so does k.
  mu = jnp.full((D,), 0.2)
  rule = noise.every_k_from_noise_scale(16, k_max=12, k_min=2)
  tx = ja.accumulate(optax.sgd(0.2), rule, noise_scale_ema=0.5)
  params = {"theta": jnp.full((D,), 2.0, jnp.float64)}  # not weak-typed: the output is not

  @jax.jit
  def step(params, state, key):
    x = mu + jax.random.normal(key, (16, D))
    grads = {"theta": params["theta"] - x.mean(0)}  # the gradient of 0.5 mean |theta - x_n|^2
    updates, state = tx.update(grads, state, params, weight=16.0)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  lengths, current, micro_steps = [], 0, []
  for key in jax.random.split(jax.random.PRNGKey(0), 400):
    params, state = step(params, state, key)
    current += 1
    micro_steps.append(int(state.micro_step))
    if bool(state.updated):
      lengths.append(current)
      current = 0
  assert step._cache_size() == 1
  assert lengths[0] == 2 and max(lengths) == 12 and len(set(lengths)) >= 4, lengths
  # Each window's length is the rule's value at its start, computed from the state.
  assert lengths[-1] == 12


def test_adascale_inside_accumulate():
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  keys = jax.random.split(jax.random.PRNGKey(9), 12)
  steps = [({"w": jax.random.normal(k, (4,)) + 1.0}, jnp.float64(1 + i % 3)) for i, k in enumerate(keys)]
  plain, _ = _accumulate_trajectory(ja.accumulate(optax.sgd(0.1, momentum=0.9), 4), params, steps, False)
  ada1, _ = _accumulate_trajectory(
    ja.accumulate(noise.adascale(optax.sgd(0.1, momentum=0.9), scale=1), 4, noise_scale_ema=0.5), params, steps, False
  )
  chex.assert_trees_all_equal(ada1, plain)
  # scale=4: each window's update is r times sgd's, r from the averages including that window.
  tx = ja.accumulate(noise.adascale(optax.sgd(0.1), scale=4), 4, noise_scale_ema=0.5)
  state, p = tx.init(params), params
  for i, (g, w) in enumerate(steps):
    updates, state = tx.update(g, state, p, weight=w)
    if i % 4 == 3:
      measured = noise.noise_scale(state)
      window_weight = sum(float(s[1]) for s in steps[i - 3 : i + 1])
      r = plain_gain(float(measured.grad_sq), float(measured.trace_cov), window_weight, 4.0)
      window = steps[i - 3 : i + 1]
      mean = sum(float(s[1]) * np.asarray(s[0]["w"]) for s in window) / window_weight
      np.testing.assert_allclose(updates["w"], -0.1 * r * mean, rtol=RTOL)
      np.testing.assert_allclose(float(state.inner_state.gain), r, rtol=RTOL)
    p = optax.apply_updates(p, updates)


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), 2])
def test_accumulate_rejects_bad_noise_scale_ema(bad):
  with pytest.raises(ValueError, match=r"noise_scale_ema=.* must be a float in \[0, 1\)"):
    ja.accumulate(optax.sgd(0.1), 2, noise_scale_ema=bad)


def test_accumulate_bad_noise_input():
  with pytest.raises(TypeError, match="noise_scale_ema"):
    ja.accumulate(optax.sgd(0.1), 2, noise_scale_ema="0.9")
  with pytest.raises(ValueError, match="noise_scale_ema="):
    ja.accumulate(optax.sgd(0.1), noise.every_k_from_noise_scale(8, k_max=4))
  tx = ja.accumulate(optax.sgd(0.1), 2)
  with pytest.raises(ValueError, match="noise_scale_ema"):
    noise.noise_scale(tx.init({"w": jnp.zeros(2)}))
  # One microbatch per window on one device can never be measured: refused, not NaN forever.
  with pytest.raises(ValueError, match=r"noise_scale_ema=0.9 with every_k=1 and no axis_name"):
    ja.accumulate(optax.sgd(0.1), 1, noise_scale_ema=0.9)
  with pytest.raises(ValueError, match=r"k_min=1, k_init=.*without axis_name can settle at windows of 1"):
    ja.accumulate(optax.sgd(0.1), ja.every_k_from_noise_scale(8, k_max=4, k_min=1), noise_scale_ema=0.9)


def test_accumulate_state_with_noise_tracking_can_be_donated():
  # Every leaf its own buffer: XLA refuses to donate one buffer twice.
  params = {"w": jnp.ones(3)}
  tx = ja.accumulate(optax.adam(0.1), 2, noise_scale_ema=0.9)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  ids = [id(x) for x in jax.tree.leaves(state)]
  assert len(set(ids)) == len(ids)
  p = params
  for i in range(4):
    p, state = step(p, state, {"w": jnp.arange(3.0) * i})
  assert int(state.noise_stats.windows) == 2


# ---------------------------------------------------------------------------------------------
# make_train_step(..., noise_scale=True).


def test_make_train_step_noise_scale_metrics_on_8_devices():
  n_dev, k, rows = 8, 2, 6  # 16 microbatches of 6 rows over the mesh, 96 rows in all
  mu = jnp.linspace(-0.5, 0.5, D)

  def loss_fn(params, x):
    return 0.5 * jnp.mean(jnp.sum((params["theta"] - x) ** 2, axis=-1))

  step = ja.make_train_step(
    loss_fn, optax.sgd(0.1), num_microbatches=k, mesh=ja.data_mesh("data"), noise_scale=True, donate=False
  )
  x = mu + jax.random.normal(jax.random.PRNGKey(3), (n_dev * k * rows, D))
  params = {"theta": jnp.zeros(D)}
  _, _, metrics = step(params, optax.sgd(0.1).init(params), ja.shard_batch(x, ja.data_mesh("data")))
  # The plain reference: device p holds rows p*R..(p+1)*R-1, its microbatch i the rows i, i+k, ... of those.
  per_device = np.asarray(x).reshape(n_dev, k * rows, D)
  grads = np.stack([np.asarray(params["theta"]) - per_device[p, i::k].mean(0) for p in range(n_dev) for i in range(k)])
  # Equal weights (1 per microbatch): tr(Sigma) per microbatch, so compare with sizes 1.
  ref_g2, ref_tr = plain_estimates(grads[None], [1] * (n_dev * k))
  measured = metrics["noise_scale"]
  np.testing.assert_allclose(float(measured.grad_sq), ref_g2[0], rtol=1e-10)
  np.testing.assert_allclose(float(measured.trace_cov), ref_tr[0], rtol=1e-10)
  # Smoothed across steps with noise_scale_smooth, read with noise_scale.
  ema = noise.noise_scale_smooth(None, measured, 0.9)
  ema = noise.noise_scale_smooth(ema, noise.NoiseScale(*[jnp.asarray(jnp.nan)] * 3), 0.9)  # NaN: unchanged
  np.testing.assert_allclose(float(noise.noise_scale(ema).trace_cov), ref_tr[0], rtol=1e-10)


def test_make_train_step_noise_scale_bad_input():
  with pytest.raises(TypeError, match="noise_scale"):
    ja.make_train_step(lambda p, b: jnp.mean(b), optax.sgd(0.1), noise_scale=1)


def test_make_train_step_noise_scale_adds_no_collective():
  def loss_fn(params, x):
    return 0.5 * jnp.mean(jnp.sum((params["theta"] - x) ** 2, axis=-1))

  params = {"theta": jnp.zeros(D)}
  x = ja.shard_batch(jnp.ones((32, D)), ja.data_mesh("data"))
  counts = []
  for flag in (False, True):
    step = ja.make_train_step(
      loss_fn, optax.sgd(0.1), num_microbatches=2, mesh=ja.data_mesh("data"), noise_scale=flag, donate=False
    )
    counts.append(_hlo.all_reduce_sizes(step.lower(params, optax.sgd(0.1).init(params), x).compile().as_text()))
  assert counts[1][0] == counts[0][0], counts
  assert counts[1][1] == counts[0][1] + 2, counts


# make_train_step(..., noise_scale=True, noise_scale_sample=m): the first m microbatches of weight > 0 of the
# step on each device, ja.accumulate's sampled estimator.

SAMPLE_K, SAMPLE_ROWS = 4, 96  # 8 devices x 4 microbatches x 3 rows (1 device: 4 microbatches of 24 rows)


def _masked_mse(params, batch):
  """A masked mean over the rows (0 for a microbatch of padding only: its weight is 0)."""
  x, y, mask = batch["x"], batch["y"], batch["mask"]
  pred = x @ params[0]["w"] + params[0]["b"]
  pred = jnp.tanh(pred) @ params[1]["w"] + params[1]["b"]
  err = jnp.sum((pred - y) ** 2, axis=-1)
  return jnp.sum(mask * err) / jnp.maximum(jnp.sum(mask), 1.0)


def _sample_problem(devices):
  """Params, a batch whose microbatch weights differ, and each (device, microbatch)'s rows in the step's order."""
  keys = jax.random.split(jax.random.PRNGKey(11), 4)
  params = [
    {"w": jax.random.normal(keys[0], (3, 8), jnp.float64) / 2, "b": jnp.full((8,), 0.1, jnp.float64)},
    {"w": jax.random.normal(keys[1], (8, 2), jnp.float64) / 3, "b": jnp.zeros((2,), jnp.float64)},
  ]
  x = jax.random.normal(keys[2], (SAMPLE_ROWS, 3), jnp.float64)
  y = jnp.sin(x @ jax.random.normal(keys[3], (3, 2), jnp.float64))
  per = SAMPLE_ROWS // devices
  # Device p's block of rows; its microbatch i holds rows i, i + K, ... of that block.
  mbs = [(p, i, np.arange(p * per + i, (p + 1) * per, SAMPLE_K)) for p in range(devices) for i in range(SAMPLE_K)]
  mask = np.ones(SAMPLE_ROWS)
  mask[[3, 10, 21, 50, 77]] = 0.0  # unequal weights
  for p, i, rows in mbs:
    if i == 0 and p % 2 == 0:
      mask[rows] = 0.0  # the first microbatch of every other device is padding: the sample skips it
  return params, {"x": x, "y": y, "mask": jnp.asarray(mask)}, mbs


def _plain_sampled_estimate(params, batch, mbs, m):
  """tr(Sigma) and |G|^2 from per-microbatch gradients (jax.grad in a loop), the sampled formulas in numpy."""
  ws, gs, sampled = [], [], []
  taken: dict = {}
  for p, _, rows in mbs:
    mb = jax.tree.map(lambda v: v[rows], batch)
    w = float(np.sum(mb["mask"]))
    g = jax.grad(_masked_mse)(params, mb)
    ws.append(w)
    gs.append(np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(g)]))
    in_sample = w > 0 and taken.get(p, 0) < m
    taken[p] = taken.get(p, 0) + in_sample
    sampled.append(in_sample)
  ws, gs, sampled = np.asarray(ws), np.stack(gs), np.asarray(sampled)
  big_b = ws.sum()
  mean = (ws[:, None] * gs).sum(0) / big_b
  s2 = mean @ mean
  b_s = ws[sampled].sum()
  s1 = np.sum(ws[sampled] * np.sum(gs[sampled] ** 2, axis=1)) / b_s
  trace_cov = (s1 - s2) / (sampled.sum() / b_s - 1 / big_b)
  return s2 - trace_cov / big_b, trace_cov


@pytest.mark.parametrize(
  "strategy, samples",
  smoke(
    [("none", (1, 2)), ("ddp", (1, 2)), ("fsdp", (1, 2)), ("zero1", (2,)), ("fsdp_once", (2,)), ("hsdp", (2,))],
    {("ddp", (1, 2))},
  ),
)
def test_make_train_step_noise_scale_sample(strategy, samples):
  mesh, axes, kwargs = None, "data", {}
  if strategy == "hsdp":
    mesh, axes = jax.make_mesh((2, 4), ("rep", "shard")), ("rep", "shard")
  elif strategy != "none":
    mesh = ja.data_mesh()
  if strategy != "none":
    kwargs = dict(mesh=mesh, data_axis=axes, strategy="fsdp" if strategy == "fsdp_once" else strategy)
  if strategy == "fsdp_once":
    kwargs["fsdp_gather"] = "once"
  devices = 1 if mesh is None else 8
  params, batch, mbs = _sample_problem(devices)
  opt = optax.adam(1e-2)

  def run(**options):
    step = ja.make_train_step(
      _masked_mse,
      opt,
      num_microbatches=SAMPLE_K,
      weight_fn=lambda b: jnp.sum(b["mask"]),
      noise_scale=True,
      donate=False,
      **kwargs,
      **options,
    )
    if mesh is None:
      p, s = params, opt.init(params)
    else:
      p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axes)
    compiled = step.lower(p, s, batch).compile()
    new_p, _, metrics = compiled(p, s, batch, None)
    return new_p, metrics, None if mesh is None else ja.count_collectives(compiled)

  full_p, full_metrics, full_counts = run()
  for m in samples:
    got_p, metrics, counts = run(noise_scale_sample=m)
    # The update is the same bit for bit, and no collective is added.
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(full_p), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(metrics["loss"]), np.asarray(full_metrics["loss"]))
    assert counts == full_counts, (m, counts, full_counts)
    want_g2, want_tr = _plain_sampled_estimate(params, batch, mbs, m)
    measured = metrics["noise_scale"]
    np.testing.assert_allclose(float(measured.grad_sq), want_g2, rtol=1e-10)
    np.testing.assert_allclose(float(measured.trace_cov), want_tr, rtol=1e-10)
    np.testing.assert_allclose(float(measured.b_simple), want_tr / want_g2, rtol=1e-10)
    # A sample is not the whole step: the estimate differs from the unsampled one.
    assert abs(float(measured.trace_cov) - float(full_metrics["noise_scale"].trace_cov)) > 1e-6


def test_make_train_step_noise_scale_sample_bad_input():
  loss = lambda p, b: jnp.mean(b)
  for bad, error in ((1.5, TypeError), (True, TypeError), ("2", TypeError), (0, ValueError), (-1, ValueError)):
    with pytest.raises(error) as from_step:
      ja.make_train_step(loss, optax.sgd(0.1), noise_scale=True, noise_scale_sample=bad)
    with pytest.raises(error) as from_accumulate:
      ja.accumulate(optax.sgd(0.1), 4, noise_scale_ema=0.9, noise_scale_sample=bad)
    assert str(from_step.value) == str(from_accumulate.value)  # one checker, one text
  with pytest.raises(ValueError, match=r"noise_scale_sample=2 .* which is off: turn it on with noise_scale=True"):
    ja.make_train_step(loss, optax.sgd(0.1), noise_scale_sample=2)


# ---------------------------------------------------------------------------------------------
# Issue 22: bad input and faults.


@pytest.mark.parametrize("bad", [None, optax.sgd, "sgd"], ids=["None", "factory", "str"])
def test_adascale_names_a_bad_inner(bad):
  with pytest.raises(TypeError, match=r"inner="):
    noise.adascale(bad, scale=2)


def _one_update(ada, g2=1.0, tr=32.0, batch_weight=128.0, jit=False):
  params = {"w": jnp.ones(3)}
  update = jax.jit(ada.update) if jit else ada.update
  measured = noise.NoiseScale(jnp.asarray(tr / g2), jnp.asarray(g2), jnp.asarray(tr))
  return update({"w": jnp.ones(3)}, ada.init(params), params, noise_scale=measured, batch_weight=batch_weight)


@pytest.mark.parametrize("value", [0.5, -1.0, float("nan")])
def test_adascale_scale_schedule_below_one_is_refused_or_clamped(value):
  # A concrete value (eager, or a constant schedule under jit) is refused, naming the schedule's call.
  with pytest.raises(ValueError, match=r"scale\(0\)="):
    _one_update(noise.adascale(optax.sgd(0.1), scale=lambda count: value))
  with pytest.raises(ValueError, match=r"scale\(update_count\)="):
    _one_update(noise.adascale(optax.sgd(0.1), scale=lambda count: value), jit=True)
  # A traced value below 1 cannot raise: it is taken as 1, so the gain is 1 (never below: the
  # learning rate is not shrunk).
  traced = noise.adascale(optax.sgd(0.1), scale=lambda count: value + 0.0 * count)
  updates, state = _one_update(traced, jit=True)
  assert float(state.gain) == 1.0
  np.testing.assert_array_equal(updates["w"], -0.1 * np.ones(3))


def test_adascale_traced_scale_works_and_is_clamped():
  def run(s):
    return _one_update(noise.adascale(optax.sgd(0.1), scale=s))

  want_u, want_state = run(8.0)
  got_u, got_state = jax.jit(run)(jnp.asarray(8.0))
  np.testing.assert_allclose(float(got_state.gain), plain_gain(1.0, 32.0, 128.0, 8.0), rtol=RTOL)
  chex.assert_trees_all_close((got_u, got_state.gain), (want_u, want_state.gain), rtol=RTOL)
  _, low = jax.jit(run)(jnp.asarray(0.5))  # below 1, traced: taken as 1
  assert float(low.gain) == 1.0
  with pytest.raises(TypeError, match=r"scale=.* must be a real number >= 1 \(a scalar\)"):
    jax.jit(run)(jnp.asarray([2.0, 3.0]))
  with pytest.raises(TypeError, match=r"scale=.* must be a real number >= 1"):
    jax.jit(run)(jnp.asarray(True))


def test_b_simple_after_windows_of_zero_gradients_is_zero_not_nan():
  """Zero gradients measure |G|^2 = 0 and tr(Sigma) = 0: no noise, B_simple = 0 (NaN means "not measured")."""
  params = {"w": jnp.zeros(3)}
  tx = ja.accumulate(optax.sgd(0.1), 2, noise_scale_ema=0.9)
  state = tx.init(params)
  assert np.isnan(float(noise.noise_scale(state).b_simple))  # nothing measured yet
  for _ in range(4):
    _, state = tx.update({"w": jnp.zeros(3)}, state, params)
  measured = noise.noise_scale(state)
  assert int(state.noise_stats.windows) == 2
  assert (float(measured.grad_sq), float(measured.trace_cov), float(measured.b_simple)) == (0.0, 0.0, 0.0)
  # The one-step estimate (make_train_step's metrics) reads the same.
  zero = jnp.zeros([])
  assert float(noise.step_estimate(zero, zero, jnp.asarray(True)).b_simple) == 0.0
  assert np.isnan(float(noise.step_estimate(zero, zero, jnp.asarray(False)).b_simple))


# ---------------------------------------------------------------------------------------------
# noise_scale_sample=m: the squared norm of the first m microbatches (of weight > 0) per window only.


def plain_sampled_estimates(grads, sizes, m):
  """The sampled estimator (noise.py, "Sampling") written out in numpy: S = the first m microbatches with b > 0."""
  b = np.asarray(sizes, float)
  g = np.asarray(grads)  # (W, K, D)
  real = np.flatnonzero(b > 0)
  s = real[:m]
  big_b, b_s = b[real].sum(), b[s].sum()
  s1 = np.einsum("k,wkd,wkd->w", b[s], g[:, s], g[:, s]) / b_s
  mean = np.einsum("k,wkd->wd", b[real], g[:, real]) / big_b
  s2 = np.einsum("wd,wd->w", mean, mean)
  trace_cov = (s1 - s2) / (len(s) / b_s - 1 / big_b)
  return s2 - trace_cov / big_b, trace_cov


@pytest.mark.parametrize("m", [1, 3])
def test_sampled_noise_scale_is_the_plain_sampled_estimator_and_unbiased(m):
  """Weights unequal, the first microbatch of weight 0 (NaN gradient): it is neither sampled nor leaks."""
  sizes = [0, 3, 5, 8, 16, 32, 4, 40]
  g_true = jnp.full((D,), 1.0 / np.sqrt(D)).at[0].add(0.5)
  grads = synthetic_microbatch_grads(jax.random.PRNGKey(3), 400, sizes, g_true)
  assert np.all(np.isnan(np.asarray(grads[:, 0])))
  tx = ja.accumulate(optax.set_to_zero(), len(sizes), noise_scale_ema=0.98, noise_scale_sample=m)
  state = run_accumulate(tx, grads, sizes)
  measured = noise.noise_scale(state)
  ref_g2, ref_tr = plain_sampled_estimates(grads, sizes, m)
  np.testing.assert_allclose(float(measured.grad_sq), plain_ema(ref_g2, 0.98), rtol=1e-10)
  np.testing.assert_allclose(float(measured.trace_cov), plain_ema(ref_tr, 0.98), rtol=1e-10)
  assert int(state.noise_stats.windows) == 400
  # Unbiased: the mean over 400 windows is near the truth (tr(Sigma) = D per example, |G|^2).
  assert abs(np.mean(ref_tr) / D - 1) < 0.1
  assert abs(np.mean(ref_g2) / float(jnp.sum(g_true**2)) - 1) < 0.1


def test_sampled_noise_scale_leaves_updates_bit_for_bit_and_adds_no_collective():
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
  keys = jax.random.split(jax.random.PRNGKey(7), 9)
  steps = [
    (jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params), jnp.float64(1 + i % 4))
    for i, k in enumerate(keys)
  ]
  steps[3] = (steps[3][0], jnp.float64(0.0))  # weight 0 at a window's start: the next microbatch is sampled
  plain, s_plain = _accumulate_trajectory(ja.accumulate(optax.adam(0.05), 3), params, steps, False)
  tx = ja.accumulate(optax.adam(0.05), 3, noise_scale_ema=0.0, noise_scale_sample=1)
  sampled, s_sampled = _accumulate_trajectory(tx, params, steps, False)
  chex.assert_trees_all_equal(sampled, plain)
  chex.assert_trees_all_equal(s_sampled._replace(noise_stats=None), s_plain)
  assert int(s_sampled.noise_stats.windows) == 3
  # The last window (steps 6, 7, 8) by hand: microbatch 6 sampled.
  g = np.stack([np.concatenate([np.ravel(s[0]["w"]), s[0]["b"]]) for s in steps[6:]])[None]
  ref_g2, ref_tr = plain_sampled_estimates(g, [float(s[1]) for s in steps[6:]], 1)
  measured = noise.noise_scale(s_sampled)
  np.testing.assert_allclose([float(measured.grad_sq), float(measured.trace_cov)], [ref_g2[0], ref_tr[0]], rtol=RTOL)

  def hlo(sample):
    tx = ja.accumulate(optax.adam(0.1), 4, axis_name="data", noise_scale_ema=0.9, noise_scale_sample=sample)
    step = jax.pmap(lambda g, s: tx.update(g, s, params, weight=2.0), axis_name="data", in_axes=(0, None))
    g = jax.tree.map(lambda p: jnp.ones((8, *p.shape)), params)
    return _hlo.all_reduce_sizes(step.lower(g, tx.init(params)).compile().as_text())

  (n_all, e_all), (n_sampled, e_sampled) = hlo(None), hlo(2)
  assert n_sampled == n_all and e_sampled == e_all + 1, (n_all, e_all, n_sampled, e_sampled)  # + B_S, a scalar


def test_sampled_noise_scale_bad_input():
  for bad, err in ((0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError), ("2", TypeError)):
    with pytest.raises(err, match=rf"noise_scale_sample={bad!r} must be None or an int >= 1"):
      ja.accumulate(optax.sgd(0.1), 4, noise_scale_ema=0.9, noise_scale_sample=bad)
  with pytest.raises(ValueError, match=r"noise_scale_sample=2 samples the noise-scale measurement, which is off"):
    ja.accumulate(optax.sgd(0.1), 4, noise_scale_sample=2)
  assert ja.accumulate(optax.sgd(0.1), 4, noise_scale_ema=0.9).init({"w": jnp.zeros(2)}).noise_stats[-1] is None


def test_sampled_noise_scale_on_8_devices_samples_each_devices_first_microbatch():
  n_dev, k, windows = 8, 3, 20
  rng = np.random.default_rng(0)
  sizes = rng.integers(1, 12, size=(n_dev, k)).astype(float)  # (device, microbatch)
  g_true = jnp.full((D,), 1.0 / np.sqrt(D)).at[0].add(0.5)
  grads = synthetic_microbatch_grads(jax.random.PRNGKey(4), windows, sizes.reshape(-1).astype(int), g_true)
  grads = np.asarray(grads).reshape(windows, n_dev, k, D)
  tx = ja.accumulate(optax.set_to_zero(), k, axis_name="data", noise_scale_ema=0.9, noise_scale_sample=1)
  params = {"theta": jnp.zeros(D)}
  step = jax.pmap(lambda s, g, w: tx.update({"theta": g}, s, params, weight=w)[1], axis_name="data")
  state = jax.tree.map(lambda a: jnp.stack([a] * n_dev), tx.init(params))
  for w_i in range(windows):
    for i in range(k):
      state = step(state, jnp.asarray(grads[w_i, :, i]), jnp.asarray(sizes[:, i]))
  # The plain reference: S = microbatch 0 of every device, the window = all 24 microbatches.
  b, big_b, b_s = sizes, sizes.sum(), sizes[:, 0].sum()
  s1 = np.einsum("p,wpd,wpd->w", b[:, 0], grads[:, :, 0], grads[:, :, 0]) / b_s
  mean = np.einsum("pk,wpkd->wd", b, grads) / big_b
  s2 = np.einsum("wd,wd->w", mean, mean)
  ref_tr = (s1 - s2) / (n_dev / b_s - 1 / big_b)
  ref_g2 = s2 - ref_tr / big_b
  measured = noise.noise_scale(state)
  np.testing.assert_allclose(np.asarray(measured.grad_sq), plain_ema(ref_g2, 0.9), rtol=1e-10)
  np.testing.assert_allclose(np.asarray(measured.trace_cov), plain_ema(ref_tr, 0.9), rtol=1e-10)
