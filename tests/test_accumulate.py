"""ja.accumulate against full-batch steps written plainly with jax/optax, in float64."""

import functools
import re
from typing import NamedTuple

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_init, mse_loss, regression_data
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo

RTOL = 1e-12

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.1),
  "momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "adam": lambda: optax.adam(0.05),
  "amsgrad": lambda: optax.amsgrad(0.05),
  "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
  "lamb": lambda: optax.lamb(0.05),
}


def split_rows(data, sizes):
  """Consecutive microbatches of the given sizes."""
  x, y = data
  edges = np.cumsum([0] + list(sizes))
  return [(x[a:b], y[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=False)]


def full_batch_run(opt, params, loss_fn, windows):
  """The reference: one plain optax step per window on the union of its microbatches."""
  state = opt.init(params)
  trajectory = []
  for window in windows:
    union = jax.tree.map(lambda *xs: jnp.concatenate(xs), *window)
    grads = jax.grad(loss_fn)(params, union)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    trajectory.append(params)
  return trajectory


def make_step(tx, loss_fn):
  @jax.jit
  def step(params, state, batch, weight):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state, updates

  return step


def accumulate_run(tx, params, loss_fn, windows, weighted=True):
  step = make_step(tx, loss_fn)
  state = tx.init(params)
  trajectory = []
  for window in windows:
    for i, micro in enumerate(window):
      weight = jnp.asarray(micro[0].shape[0], jnp.float64) if weighted else None
      params, state, updates = step(params, state, micro, weight)
      last = i == len(window) - 1
      assert bool(ja.has_updated(state)) == last
      if not last:
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
    trajectory.append(params)
  return trajectory, state


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_equals_full_batch(problem, name, k):
  params, loss_fn, data = problem
  micro = split_rows(data, [8] * (3 * k))
  windows = [micro[i * k : (i + 1) * k] for i in range(3)]
  expected = full_batch_run(OPTIMIZERS[name](), params, loss_fn, windows)
  got, state = accumulate_run(ja.accumulate(OPTIMIZERS[name](), k), params, loss_fn, windows, weighted=False)
  chex.assert_trees_all_close(got, expected, rtol=RTOL, atol=0)
  assert int(state.update_count) == 3 and int(state.micro_step) == 0


def test_unequal_sizes_weighted_exact_multisteps_is_not(problem):
  params, loss_fn, data = problem
  sizes = [3, 5, 8]
  windows = [split_rows(data, sizes), split_rows((data[0][16:], data[1][16:]), sizes)]
  expected = full_batch_run(optax.sgd(0.1), params, loss_fn, windows)
  got, _ = accumulate_run(ja.accumulate(optax.sgd(0.1), 3), params, loss_fn, windows, weighted=True)
  chex.assert_trees_all_close(got, expected, rtol=RTOL, atol=0)

  # optax.MultiSteps averages means of unequal microbatches: measurably off.
  tx = optax.MultiSteps(optax.sgd(0.1), 3)
  state, p = tx.init(params), params
  for micro in windows[0]:
    updates, state = tx.update(jax.grad(loss_fn)(p, micro), state, p)
    p = optax.apply_updates(p, updates)
  delta_ref = jax.tree.map(jnp.subtract, expected[0], params)
  delta_ms = jax.tree.map(jnp.subtract, p, params)
  err = optax.tree.norm(jax.tree.map(jnp.subtract, delta_ms, delta_ref)) / optax.tree.norm(delta_ref)
  assert err > 0.01, err


# ----------------------------------------------------------------------------- the Keras seed


def keras_adam_accumulate(params, batches, lr, decay, accum_iters, beta_1=0.9, beta_2=0.999, epsilon=0.0):
  """A literal port of the seed's Keras AdamAccumulate.get_updates, one call per batch, in numpy."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  p = np.asarray(flat)
  m, v, tg = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
  iterations = 0
  for batch in batches:
    g = np.asarray(jax.flatten_util.ravel_pytree(jax.grad(mse_loss)(unravel(p), batch))[0])
    completed_updates = float(iterations // accum_iters)
    lr_d = lr * (1.0 / (1.0 + decay * completed_updates)) if decay > 0 else lr
    t = completed_updates + 1
    lr_t = lr_d * (np.sqrt(1.0 - beta_2**t) / (1.0 - beta_1**t))
    update_switch = float((iterations + 1) % accum_iters == 0)
    sum_grad = tg + g
    avg_grad = sum_grad / accum_iters
    m_t = beta_1 * m + (1.0 - beta_1) * avg_grad
    v_t = beta_2 * v + (1.0 - beta_2) * np.square(avg_grad)
    p_t = p - lr_t * m_t / (np.sqrt(v_t) + epsilon)
    m = (1 - update_switch) * m + update_switch * m_t
    v = (1 - update_switch) * v + update_switch * v_t
    tg = (1 - update_switch) * sum_grad
    p = (1 - update_switch) * p + update_switch * p_t
    iterations += 1
  return unravel(jnp.asarray(p))


def test_keras_adam_accumulate_seed(problem):
  params, loss_fn, data = problem
  lr, decay, accum_iters = 0.01, 1e-2, 5
  batches = split_rows(data, [10] * 10)  # batch 10, two windows: batch 50 per update
  expected = keras_adam_accumulate(params, batches, lr, decay, accum_iters)

  # Keras decays lr by completed updates; inner counts updates because it only runs on them.
  schedule = lambda count: lr / (1.0 + decay * count)
  tx = ja.accumulate(optax.adam(schedule, eps=0.0), accum_iters)
  got, _ = accumulate_run(tx, params, loss_fn, [batches[:5], batches[5:]], weighted=False)
  chex.assert_trees_all_close(got[-1], expected, rtol=1e-11, atol=0)
  # ... and that is Adam at batch 50 with lr / (1 + decay * t).
  reference = full_batch_run(optax.adam(schedule, eps=0.0), params, loss_fn, [batches[:5], batches[5:]])
  chex.assert_trees_all_close(reference[-1], expected, rtol=1e-11, atol=0)


# ----------------------------------------------------------------------------- schedules of k


def test_every_k_schedule(problem):
  params, loss_fn, data = problem
  every_k = lambda count: jnp.where(count < 2, 2, 3)
  sizes = [2, 2, 3, 3]
  micro = split_rows(data, [6] * sum(sizes))
  windows, start = [], 0
  for size in sizes:
    windows.append(micro[start : start + size])
    start += size
  expected = full_batch_run(optax.adam(0.05), params, loss_fn, windows)
  got, state = accumulate_run(ja.accumulate(optax.adam(0.05), every_k), params, loss_fn, windows)
  # A bias that adam's steps carry from 0.1 to within 1e-5 of zero: atol 1e-15 is 1e-14 of the parameters'
  # scale (0.1), and rtol governs every entry above 1e-3. That bias's last bits depend on how XLA:CPU compiled
  # the sums (the LLVM level, FMA contraction), not on the method, whose errors are around 1e-3.
  chex.assert_trees_all_close(got, expected, rtol=RTOL, atol=1e-15)
  assert int(state.update_count) == 4


class CountState(NamedTuple):
  calls: jax.Array


def counting(inner):
  """Wraps `inner`, counting in its state how many times its update ran."""

  def init(params):
    return CountState(jnp.zeros([], jnp.int32)), inner.init(params)

  def update(grads, state, params=None):
    count, inner_state = state
    updates, inner_state = inner.update(grads, inner_state, params)
    return updates, (CountState(count.calls + 1), inner_state)

  return optax.GradientTransformation(init, update)


def test_inner_runs_only_at_window_ends(problem):
  params, loss_fn, data = problem
  tx = ja.accumulate(counting(optax.adam(0.05)), 4)
  step = make_step(tx, loss_fn)
  state = tx.init(params)
  for i, micro in enumerate(split_rows(data, [10] * 10)):
    params, state, _ = step(params, state, micro, None)
    assert int(state.inner_state[0].calls) == (i + 1) // 4
    assert int(state.inner_state[1][0].count) == (i + 1) // 4  # adam's own step count too


def test_no_copy_of_inner_state_on_micro_steps():
  """Compiled with donation, nothing params-sized is copied: the inner state passes through."""
  # Leaves of distinct shapes, so that XLA cannot merge equal zero broadcasts (and copy them apart).
  params = {"a": jnp.ones((64, 32)), "b": jnp.ones((48,)), "c": jnp.ones((16, 8))}
  loss_fn = lambda p, x: jnp.sum(jnp.tanh(p["a"] * x) ** 2) + jnp.sum(p["b"] ** 3) + jnp.sum(p["c"] ** 2 * x)
  for tx in [ja.accumulate(optax.adam(0.1), 4), ja.accumulate(optax.adam(0.1), 4, skip_nonfinite=True)]:

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, x):
      updates, state = tx.update(jax.grad(loss_fn)(params, x), state, params)
      return optax.apply_updates(params, updates), state

    hlo = step.lower(params, tx.init(params), jnp.float64(0.5)).compile().as_text()
    big_copies = [
      line for line in hlo.splitlines() if " copy(" in line and "[]" not in line.split("=")[1].split(" copy(")[0]
    ]
    assert not big_copies, big_copies
    assert _hlo.count(hlo, "conditional") >= 1


def test_micro_step_writes_no_zero_updates(monkeypatch):
  """Through the plain API (update, then apply_updates in the caller's jit) a micro-step's zero updates are a
  select fused into the caller's apply_updates: the compiled step makes no params-sized buffer from a constant
  (materialised zeros), and the updates are exactly +0 even for a NaN gradient of weight 0."""
  from jaxaccum import _window

  # A dense layer: its weight gradient is a dot, its bias gradient a sum over rows (both materialised anyway).
  params = {"w": jnp.ones((64, 32)) / 8, "b": jnp.ones((32,))}
  loss_fn = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)
  x = jnp.linspace(-1.0, 1.0, 4 * 64).reshape(4, 64)
  tx = ja.accumulate(optax.adam(0.1), 4)

  @jax.jit
  def updates_of(params, state, x, weight):
    return tx.update(jax.grad(loss_fn)(params, x), state, params, weight=weight)

  def zeros_made():
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, x):
      updates, state = tx.update(jax.grad(loss_fn)(params, x), state, params)
      return optax.apply_updates(params, updates), state

    hlo = step.lower(params, tx.init(params), x).compile().as_text()
    return re.findall(r"= f64\[64,32\]\{1,0\} fusion\(%constant[.\d]*\)", hlo)

  state = tx.init(params)
  updates, state = updates_of(params, state, x.at[0, 0].set(jnp.nan), jnp.float64(0.0))
  assert all(bool(jnp.all(u == 0)) and not bool(jnp.any(jnp.signbit(u))) for u in jax.tree.leaves(updates))
  assert zeros_made() == []
  monkeypatch.setattr(_window, "_passes_grads", lambda *args: False)  # what the check would see otherwise
  assert zeros_made()


@pytest.mark.parametrize("k, skip_nonfinite", [(1, False), (3, False), (3, True)])
def test_fused_apply_gradients_is_update_then_apply_updates(problem, k, skip_nonfinite):
  """`tx.update.apply_gradients` (what ja.flax uses) equals update + apply_updates.

  To rounding, not bit for bit: XLA fuses `params + updates` into the window-end
  branch, where it may contract a multiply-add differently; over steps the ulps add up.
  """
  params, loss_fn, data = problem
  tx = ja.accumulate(optax.adam(0.05), k, skip_nonfinite=skip_nonfinite)
  micro = split_rows(data, [8] * 9)
  if skip_nonfinite:  # one NaN microbatch inside a window, then a window with nothing finite
    micro[1] = (micro[1][0].at[0, 0].set(jnp.nan), micro[1][1])
    for i in (6, 7, 8):
      micro[i] = (micro[i][0].at[0, 0].set(jnp.inf), micro[i][1])

  @jax.jit
  def two_ways(p_plain, s_plain, p_fused, s_fused, batch, weight):
    updates, s_plain = tx.update(jax.grad(loss_fn)(p_plain, batch), s_plain, p_plain, weight=weight)
    p_fused, s_fused = tx.update.apply_gradients(jax.grad(loss_fn)(p_fused, batch), s_fused, p_fused, weight=weight)
    return optax.apply_updates(p_plain, updates), s_plain, p_fused, s_fused

  p_plain, p_fused = params, params
  s_plain = s_fused = tx.init(params)
  for i, batch in enumerate(micro):
    p_plain, s_plain, p_fused, s_fused = two_ways(p_plain, s_plain, p_fused, s_fused, batch, jnp.float64(i + 1))
    chex.assert_trees_all_close(p_fused, p_plain, rtol=RTOL, atol=1e-15)
    chex.assert_trees_all_close(s_fused, s_plain, rtol=RTOL, atol=1e-15)
    for field in ("micro_step", "update_count", "num_skipped", "num_empty_windows", "updated"):
      assert int(getattr(s_fused, field)) == int(getattr(s_plain, field)), field
  assert int(s_fused.update_count) == (2 if skip_nonfinite else 9 // k)
  with pytest.raises(ValueError, match="params does not match"):
    tx.update.apply_gradients(jax.tree.map(jnp.zeros_like, params), tx.init(params), params[:1])


def test_fused_apply_gradients_mixed_dtypes_against_plain_arithmetic():
  """bf16 and float32 params through the fused path: dtypes kept, values as written out by hand."""
  params = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}
  tx = ja.accumulate(optax.sgd(0.5), 2)
  grads = [
    {"w": jnp.full((4, 3), 0.25 * (i + 1), jnp.bfloat16), "b": jnp.arange(3.0, dtype=jnp.float32) * (i - 1.5)}
    for i in range(4)
  ]
  fused = jax.jit(tx.update.apply_gradients)
  p, state = params, tx.init(params)
  for g in grads:
    p, state = fused(g, state, p)
  assert p["w"].dtype == jnp.bfloat16 and p["b"].dtype == jnp.float32
  # Window means of the grads (summed in float32), times -0.5, applied twice.
  mean_w = [(0.25 + 0.5) / 2, (0.75 + 1.0) / 2]
  mean_b = [np.arange(3.0) * ((-1.5 - 0.5) / 2), np.arange(3.0) * ((0.5 + 1.5) / 2)]
  np.testing.assert_allclose(np.asarray(p["b"]), -0.5 * (mean_b[0] + mean_b[1]), rtol=1e-6, atol=1e-7)
  expected_w = np.float32(jnp.bfloat16(jnp.bfloat16(1.0 - 0.5 * mean_w[0]) - jnp.bfloat16(0.5 * mean_w[1])))
  np.testing.assert_allclose(np.asarray(p["w"], np.float32), expected_w, rtol=1e-2)


def test_a_wrapped_update_is_not_bypassed_by_the_fused_path():
  """ja.flax takes the fused path only for ja.accumulate's own update, not a functools.wraps copy of it."""
  tx = ja.accumulate(optax.sgd(1.0), 1)

  @functools.wraps(tx.update)  # copies the apply_gradients attribute along with the name
  def clipped(grads, state, params=None, **kw):
    return tx.update(jax.tree.map(lambda g: jnp.clip(g, -1.0, 1.0), grads), state, params, **kw)

  state = ja.flax.TrainState.create(
    apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.GradientTransformationExtraArgs(tx.init, clipped)
  )
  state = state.apply_gradients(grads={"w": jnp.full(2, 10.0)})
  np.testing.assert_array_equal(state.params["w"], -np.ones(2))


# ----------------------------------------------------------------------------- skipping non-finite


def test_skip_nonfinite(problem):
  params, loss_fn, data = problem
  micro = split_rows(data, [10] * 6)
  nan = (micro[1][0].at[0, 0].set(jnp.nan), micro[1][1])
  tx = ja.accumulate(optax.adam(0.05), 3, skip_nonfinite=True)
  step = make_step(tx, loss_fn)
  state = tx.init(params)
  p = params
  for batch in [micro[0], nan, micro[2]]:
    p, state, _ = step(p, state, batch, jnp.float64(10.0))
  expected = full_batch_run(optax.adam(0.05), params, loss_fn, [[micro[0], micro[2]]])
  chex.assert_trees_all_close(p, expected[0], rtol=RTOL, atol=0)
  assert int(state.num_skipped) == 1 and int(state.update_count) == 1

  # A window with nothing finite: no update, inner state untouched, not counted as an update.
  before = state
  inf_batch = (micro[3][0].at[:, 0].set(jnp.inf), micro[3][1])
  p2 = p
  for _ in range(3):
    p2, state, updates = step(p2, state, inf_batch, None)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
  chex.assert_trees_all_equal(p2, p)
  chex.assert_trees_all_equal(state.inner_state, before.inner_state)
  assert int(state.update_count) == 1 and int(state.num_skipped) == 4 and int(state.num_empty_windows) == 1
  assert not bool(ja.has_updated(state))


# ----------------------------------------------------------------------------- property


def _masked_mse(params, x, y, mask):
  return jnp.sum(mask * jnp.sum((mlp_apply(params, x) - y) ** 2, axis=-1)) / jnp.sum(mask)


_masked_grad = jax.jit(jax.grad(_masked_mse))
_property_update = jax.jit(optax.sgd(0.3, momentum=0.5).update)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
  sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
  scale=st.floats(0.25, 4.0),
)
def test_property_weighted_window_is_full_batch(sizes, scale):
  """Random microbatch sizes and weight scales: the window's update is the full-batch update."""
  params = mlp_init(jax.random.PRNGKey(2), (3, 4, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 54)  # masks select rows: one compile for every size
  edges = np.cumsum([0] + sizes)
  masks = [
    jnp.asarray((np.arange(54) >= a) & (np.arange(54) < b), jnp.float64)
    for a, b in zip(edges[:-1], edges[1:], strict=False)
  ]
  union = jnp.asarray(np.arange(54) < edges[-1], jnp.float64)
  inner = optax.sgd(0.3, momentum=0.5)
  expected, _ = _property_update(_masked_grad(params, x, y, union), inner.init(params), params)

  tx = ja.accumulate(inner, len(sizes))
  update = _jitted_update(len(sizes))
  state = tx.init(params)
  for mask, n in zip(masks, sizes, strict=False):
    # Any common scale of the weights gives the same mean.
    updates, state = update(_masked_grad(params, x, y, mask), state, params, jnp.float64(scale * n))
  assert bool(ja.has_updated(state))
  chex.assert_trees_all_close(updates, expected, rtol=1e-11, atol=1e-15)


@functools.cache
def _jitted_update(k):
  tx = ja.accumulate(optax.sgd(0.3, momentum=0.5), k)
  return jax.jit(lambda g, s, p, w: tx.update(g, s, p, weight=w))


# ----------------------------------------------------------------------------- dtypes, vmap, shardings


def test_dtypes_bf16_params_mixed_inner_state():
  params = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}
  inner = optax.adam(0.1, mu_dtype=jnp.bfloat16)
  tx = ja.accumulate(inner, 2)
  state = tx.init(params)
  assert state.acc_grads["w"].dtype == jnp.float32 and state.acc_grads["b"].dtype == jnp.float32
  grads = [
    {"w": jnp.full((4, 3), 0.1 * (i + 1), jnp.bfloat16), "b": jnp.full((3,), 0.5 * i, jnp.float32)} for i in range(2)
  ]
  update = jax.jit(tx.update)
  for g in grads:
    updates, state = update(g, state, params)
  assert updates["w"].dtype == jnp.bfloat16 and updates["b"].dtype == jnp.float32
  expected, _ = inner.update(
    jax.tree.map(lambda a, b: ((a.astype(jnp.float32) + b.astype(jnp.float32)) / 2).astype(a.dtype), *grads),
    inner.init(params),
    params,
  )
  chex.assert_trees_all_close(updates, expected, rtol=1e-2)
  # float64 grads stay float64; an explicit accumulator dtype is honoured.
  assert ja.accumulate(inner, 2).init({"x": jnp.zeros(2, jnp.float64)}).acc_grads["x"].dtype == jnp.float64
  assert ja.accumulate(inner, 2, accumulator_dtype=jnp.float64).init(params).acc_grads["w"].dtype == jnp.float64


@pytest.mark.parametrize("fused", [False, True])
def test_inner_state_that_changes_dtype_when_inner_runs(fused):
  """bf16 params, float32 grads: optax's adam promotes its bf16 moments to float32 on the first
  update, while the micro-step branch would keep them bf16; the state takes the promoted dtype,
  as plain optax leaves it, and the updates equal plain optax on the window means."""
  params = {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}
  inner = optax.adam(0.1)
  grads = [
    {"w": jnp.full((2, 3), 0.1 * (i + 1), jnp.float32), "b": jnp.arange(3.0, dtype=jnp.float32) - i} for i in range(4)
  ]
  tx = ja.accumulate(inner, 2)
  state, p = tx.init(params), params
  step = jax.jit(
    tx.update.apply_gradients
    if fused
    else lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  )
  ref_state, ref_p = inner.init(params), params
  for i, g in enumerate(grads):
    p, state = step(g, state, p)
    if i % 2:
      mean = jax.tree.map(lambda a, b: (a + b) / 2, grads[i - 1], g)
      updates, ref_state = inner.update(mean, ref_state, ref_p)
      ref_p = optax.apply_updates(ref_p, updates)
      chex.assert_trees_all_equal(p, ref_p)
  assert state.inner_state[0].mu["w"].dtype == ref_state[0].mu["w"].dtype == jnp.float32


def test_vmap_over_independent_problems(problem):
  params, loss_fn, data = problem
  tx = ja.accumulate(optax.adam(0.05), 2)
  micro = split_rows(data, [10] * 4)  # problem 0 sees micro 0, 1; problem 1 sees micro 2, 3
  stacked = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  params_b = stacked([params, params])
  state_b = jax.vmap(tx.init)(params_b)
  step = jax.jit(jax.vmap(functools.partial(_plain_step, tx, loss_fn)))
  for t in range(2):
    params_b, state_b = step(params_b, state_b, stacked([micro[t], micro[2 + t]]))
  for i in range(2):
    expected = full_batch_run(optax.adam(0.05), params, loss_fn, [[micro[2 * i], micro[2 * i + 1]]])
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], params_b), expected[0], rtol=RTOL, atol=0)


def _plain_step(tx, loss_fn, params, state, batch):
  updates, state = tx.update(jax.grad(loss_fn)(params, batch), state, params)
  return optax.apply_updates(params, updates), state


def test_jit_with_named_shardings(problem):
  params, loss_fn, data = problem
  mesh = ja.data_mesh("data")
  replicated = NamedSharding(mesh, P())
  tx = ja.accumulate(optax.adam(0.05), 2)
  micro = split_rows(data, [16] * 4)
  step = jax.jit(functools.partial(_plain_step, tx, loss_fn))
  p, s = jax.device_put((params, tx.init(params)), replicated)
  for m in micro:
    p, s = step(p, s, ja.shard_batch(m, mesh))
  expected = full_batch_run(optax.adam(0.05), params, loss_fn, [micro[:2], micro[2:]])
  chex.assert_trees_all_close(p, expected[-1], rtol=RTOL, atol=0)


# ----------------------------------------------------------------------------- data parallel


def device_windows(data, num_devices, k, sizes_per_device):
  """Per device and micro-step, a microbatch; devices get different row counts."""
  x, y = data
  rows, start = {}, 0
  for d in range(num_devices):
    for i in range(k):
      n = sizes_per_device[d]
      rows[d, i] = (x[start : start + n], y[start : start + n])
      start += n
  return rows


@pytest.mark.parametrize("style", ["pmap", "shard_map"])
def test_data_parallel_unequal_tokens_equals_one_device(style, tmp_path):
  n_dev, k = 8, 3
  sizes = [2, 3, 4, 5, 2, 3, 4, 5]
  pad = max(sizes)
  params = mlp_init(jax.random.PRNGKey(4), (3, 6, 2))
  data = regression_data(jax.random.PRNGKey(5), sum(sizes) * k)
  rows = device_windows(data, n_dev, k, sizes)

  def masked_loss(p, batch):
    x, y, mask = batch
    per_row = jnp.sum((mlp_apply(p, x) - y) ** 2, axis=-1)
    return jnp.sum(per_row * mask) / jnp.sum(mask)

  def padded(i):  # micro-step i for every device, padded to `pad` rows with a mask
    xs, ys, ms = [], [], []
    for d in range(n_dev):
      x, y = rows[d, i]
      n = x.shape[0]
      xs.append(jnp.pad(x, ((0, pad - n), (0, 0))))
      ys.append(jnp.pad(y, ((0, pad - n), (0, 0))))
      ms.append(jnp.arange(pad) < n)
    return jnp.stack(xs), jnp.stack(ys), jnp.stack(ms).astype(jnp.float64)

  tx = ja.accumulate(optax.adam(0.05), k, axis_name="data")

  def local_step(p, s, batch):
    grad_params = lax.pcast(p, "data", to="varying") if style == "shard_map" else p
    grads = jax.grad(masked_loss)(grad_params, batch)
    updates, s = tx.update(grads, s, p, weight=jnp.sum(batch[2]))
    return optax.apply_updates(p, updates), s

  state = tx.init(params)
  if style == "pmap":
    # Mid-window the accumulator holds each device's own partial sum: the state is per device
    # (a leading device axis, in_axes=0 and out_axes=0), never out_axes=None.
    step = jax.pmap(local_step, axis_name="data", in_axes=(None, 0, 0), out_axes=(None, 0))
    p, state = params, jax.tree.map(lambda x: jnp.stack([x] * n_dev), state)
    for i in range(k):
      p, state = step(p, state, padded(i))
      if i == 0:  # through the host and back, mid-window: the partial sums must survive
        ja.checkpoint.save(tmp_path / "mid", (p, state))
        p, state = ja.checkpoint.restore(tmp_path / "mid", (p, state))
        assert len(set(np.asarray(state.acc_weight).tolist())) > 1  # devices really differ
  else:
    mesh = ja.data_mesh("data")
    state_spec = jax.tree.map(lambda _: P(), state)
    # The per-device fields (documented): acc_grads, acc_weight and num_skipped (a traced
    # weight that is invalid on one device is dropped and counted there).
    state_spec = state_spec._replace(
      acc_grads=jax.tree.map(lambda _: P("data"), state.acc_grads), acc_weight=P("data"), num_skipped=P("data")
    )
    step = jax.jit(
      jax.shard_map(
        functools.partial(_squeeze_step, local_step),
        mesh=mesh,
        in_specs=(P(), state_spec, P("data")),
        out_specs=(P(), state_spec),
      )
    )
    # The local accumulator differs per device: give each device its own slot.
    state = state._replace(
      acc_grads=jax.tree.map(lambda a: jnp.stack([a] * n_dev), state.acc_grads),
      acc_weight=jnp.stack([state.acc_weight] * n_dev),
      num_skipped=jnp.stack([state.num_skipped] * n_dev),
    )
    p = params
    for i in range(k):
      p, state = step(p, state, padded(i))

  union = [jax.tree.map(lambda *xs: jnp.concatenate(xs), *[rows[d, i] for d in range(n_dev) for i in range(k)])]
  expected = full_batch_run(
    optax.adam(0.05), params, lambda q, b: jnp.mean(jnp.sum((mlp_apply(q, b[0]) - b[1]) ** 2, -1)), [union]
  )
  chex.assert_trees_all_close(p, expected[0], rtol=RTOL, atol=0)


def _squeeze_step(local_step, p, s, batch):
  """Inside shard_map: drop the per-device leading axis of the batch and of the local accumulator."""
  batch = jax.tree.map(lambda x: x[0], batch)
  s = s._replace(
    acc_grads=jax.tree.map(lambda a: a[0], s.acc_grads), acc_weight=s.acc_weight[0], num_skipped=s.num_skipped[0]
  )
  p, s = local_step(p, s, batch)
  return p, s._replace(
    acc_grads=jax.tree.map(lambda a: a[None], s.acc_grads),
    acc_weight=s.acc_weight[None],
    num_skipped=s.num_skipped[None],
  )


def test_shard_map_recipe_with_skip_nonfinite_and_the_fused_path():
  """The README's shard_map recipe, verbatim: per-device fields sharded, a NaN on one device dropped."""
  n, k = 8, 2
  params = mlp_init(jax.random.PRNGKey(4), (3, 6, 2))
  x, y = regression_data(jax.random.PRNGKey(5), n * k * 4)
  micro = [(x[i::k], y[i::k]) for i in range(k)]  # k microbatches of n * 4 rows, 4 per device
  bad_x = micro[1][0].at[4 * 3, 0].set(jnp.nan)  # device 3's rows of microbatch 1 hold a NaN
  micro[1] = (bad_x, micro[1][1])
  mesh = ja.data_mesh("data")
  tx = ja.accumulate(optax.adam(0.05), k, axis_name="data", skip_nonfinite=True)

  def local_step(params, state, batch):  # the fused path, as ja.flax uses it
    grads = jax.grad(mse_loss)(lax.pcast(params, "data", to="varying"), batch)
    return tx.update.apply_gradients(grads, state, params, weight=jnp.float64(batch[0].shape[0]))

  # --- from the README
  def per_device(state, f):
    return state._replace(
      acc_grads=jax.tree.map(f, state.acc_grads), acc_weight=f(state.acc_weight), num_skipped=f(state.num_skipped)
    )

  state = per_device(tx.init(params), lambda a: jnp.stack([a] * n))
  spec = per_device(jax.tree.map(lambda _: P(), state), lambda _: P("data"))

  def body(params, state, batch):
    params, state = local_step(params, per_device(state, lambda a: a[0]), batch)
    return params, per_device(state, lambda a: a[None])

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec)))
  # ---
  p = params
  for m in micro:
    p, state = step(p, state, m)
  assert np.asarray(state.num_skipped).tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
  kept = [
    micro[0],
    (jnp.delete(micro[1][0], jnp.arange(12, 16), axis=0), jnp.delete(micro[1][1], jnp.arange(12, 16), axis=0)),
  ]
  expected = full_batch_run(optax.adam(0.05), params, mse_loss, [kept])
  chex.assert_trees_all_close(p, expected[0], rtol=RTOL, atol=0)


def test_shard_map_pitfall_is_caught():
  params = {"w": jnp.ones((3,))}
  tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data")
  mesh = ja.data_mesh("data")

  def local_step(p, s, x):
    grads = jax.grad(lambda q: jnp.mean((x @ q["w"]) ** 2))(p)  # p replicated: autodiff psums
    return tx.update(grads, s, p)

  f = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())))
  with pytest.raises(ValueError, match="invariant over axis_name='data'.*pcast"):
    f(params, tx.init(params), jnp.ones((16, 3)))


def test_all_reduce_only_at_window_end_in_hlo():
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  tx = ja.accumulate(optax.adam(0.05), 4, axis_name="data")
  step = jax.pmap(functools.partial(_plain_step, tx, mse_loss), axis_name="data", in_axes=(None, None, 0))
  x, y = regression_data(jax.random.PRNGKey(1), 16)
  hlo = step.lower(params, tx.init(params), (x.reshape(8, 2, 3), y.reshape(8, 2, 2))).compile().as_text()
  where = _hlo.locate(hlo, "all-reduce")
  assert where["top"] == 0 and where["loop"] == 0, where
  assert where["branch"] >= 1, where

  # The counter is not blind: optax.MultiSteps + pmean all-reduces on every micro-step.
  ms = optax.chain(ja.pmean("data"), optax.adam(0.05))
  ms = optax.MultiSteps(ms, 4)
  step_ms = jax.pmap(functools.partial(_plain_step, ms, mse_loss), axis_name="data", in_axes=(None, None, 0))
  hlo_ms = step_ms.lower(params, ms.init(params), (x.reshape(8, 2, 3), y.reshape(8, 2, 2))).compile().as_text()
  assert _hlo.locate(hlo_ms, "all-reduce")["top"] >= 1


def test_comm_dtype_bf16_on_the_wire():
  params = {"w": jnp.ones((3,))}
  tx = ja.accumulate(optax.sgd(1.0), 1, axis_name="data", comm_dtype=jnp.bfloat16)
  f = jax.pmap(lambda g: tx.update({"w": g}, tx.init(params), params)[0]["w"], axis_name="data")
  g = jnp.arange(24.0).reshape(8, 3) / 7
  # The program sends bf16 (XLA:CPU then widens its all-reduces to f32; GPUs and TPUs do not).
  lowered = f.lower(g).as_text()
  assert re.search(r"stablehlo.all_reduce.{0,400}\}\) : \(tensor<3xbf16>\)", lowered, re.S)
  # The weight travels in its own dtype (bf16 counts are exact only to 256): XLA merges the
  # scalar into the gradient's all-reduce when the dtypes agree, else it is a second, scalar one.
  assert _hlo.count(f.lower(g).compile().as_text(), "all-reduce") <= 2
  out = f(g)
  assert out.dtype == jnp.float64
  np.testing.assert_allclose(out[0], -g.mean(0), rtol=2e-2)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
  "every_k, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError), ("3", TypeError)]
)
def test_bad_every_k(every_k, error):
  with pytest.raises(error, match="every_k"):
    ja.accumulate(optax.sgd(0.1), every_k)


@pytest.mark.parametrize(
  "schedule", [optax.constant_schedule(2), lambda count: 2, lambda count: count.astype(jnp.int32) * 0 + 2]
)
def test_constant_valued_schedules_under_jit(schedule):
  """A schedule may ignore the (traced) count, or accept only arrays."""
  tx = ja.accumulate(optax.sgd(1.0), schedule)
  update = jax.jit(tx.update)
  state = tx.init({"w": jnp.zeros(1)})
  seen = []
  for g in (1.0, 3.0, 5.0, 7.0):
    updates, state = update({"w": jnp.full(1, g)}, state)
    seen.append(float(updates["w"][0]))
  assert seen == [0.0, -2.0, 0.0, -6.0]


def test_schedule_returning_zero():
  with pytest.raises(ValueError, match=r"every_k\(0\)=0"):
    ja.accumulate(optax.sgd(0.1), lambda count: 0)
  tx = ja.accumulate(optax.sgd(0.1), lambda count: 2 if count < 1 else 0)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  for _ in range(2):
    _, state = tx.update({"w": jnp.ones(2)}, state)
  with pytest.raises(ValueError, match=r"every_k\(1\)=0"):
    tx.update({"w": jnp.ones(2)}, state)


def test_bad_grads_and_weights():
  params = {"w": jnp.ones(2), "b": jnp.ones(3)}
  tx = ja.accumulate(optax.sgd(0.1), 2)
  state = tx.init(params)
  with pytest.raises(ValueError, match="grads does not match"):
    tx.update({"w": jnp.ones(2)}, state)
  with pytest.raises(ValueError, match=r"grads does not match.*\['b'\].*shape"):
    tx.update({"w": jnp.ones(2), "b": jnp.ones(4)}, state)
  for bad in [-1.0, float("nan"), float("inf")]:
    with pytest.raises(ValueError, match="weight="):
      tx.update(params, state, weight=bad)
  # A concrete 0 is valid, as a traced one is: the microbatch adds nothing.
  _, zero = tx.update(params, state, weight=0.0)
  assert float(zero.acc_weight) == 0.0 and int(zero.micro_step) == 1 and int(zero.num_skipped) == 0
  with pytest.raises(ValueError, match="weight must be a scalar"):
    tx.update(params, state, weight=jnp.ones(2))
  with pytest.raises(TypeError, match="state must be an AccumulateState"):
    tx.update(params, state.inner_state)
  # State untouched: pure functions, and the same state still works.
  _, new_state = tx.update(params, state, weight=2.0)
  assert int(new_state.micro_step) == 1 and int(state.micro_step) == 0


def test_bad_axis_name_and_options():
  params = {"w": jnp.ones(2)}
  tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data")
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    jax.jit(tx.update)(params, tx.init(params))
  with pytest.raises(TypeError, match="axis_name"):
    ja.accumulate(optax.sgd(0.1), 2, axis_name=3)
  with pytest.raises(ValueError, match="accumulator_dtype"):
    ja.accumulate(optax.sgd(0.1), 2, accumulator_dtype=jnp.int32)
  with pytest.raises(TypeError, match="skip_nonfinite"):
    ja.accumulate(optax.sgd(0.1), 2, skip_nonfinite=1)


# ----------------------------------------------------------------------------- weights under jit


def _window_reference(inner, params, windows):
  """Plain optax on each window's weighted mean, skipping windows of total weight 0.

  `windows`: lists of (grads, weight); a weight that is not a finite number >= 0 is left out.
  Returns the parameters after each window and the final inner state.
  """
  state, out = inner.init(params), []
  for window in windows:
    kept = [(g, w) for g, w in window if np.isfinite(w) and w > 0]
    if kept:
      total = sum(w for _, w in kept)
      weighted_sum = lambda *gs: sum(w * g for g, (_, w) in zip(gs, kept, strict=True))
      mean = jax.tree.map(lambda *gs: weighted_sum(*gs) / total, *[g for g, _ in kept])
      updates, state = inner.update(mean, state, params)
      params = optax.apply_updates(params, updates)
    out.append(params)
  return out, state


def _grads_like(params, seed, nan=False):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  grads = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
  if nan:
    grads = [g.at[(0,) * g.ndim].set(jnp.nan) for g in grads]
  return jax.tree.unflatten(treedef, grads)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_traced_weights_zero_adds_nothing_invalid_is_dropped_empty_window_applies_nothing(fused, skip_nonfinite):
  """Weights under jit (issue 11 item 1): weight 0 + NaN gradient adds nothing (not skipped);
  NaN/Inf/negative weights are dropped and counted; an all-zero window applies nothing."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 4, 2))
  g = [_grads_like(params, i) for i in range(9)]
  g_nan = _grads_like(params, 99, nan=True)
  windows = [
    [(g[0], 2.0), (g_nan, 0.0), (g[1], 3.0)],  # the zero-weight NaN adds nothing
    [(g[2], np.nan), (g[3], 1.5), (g[4], -1.0)],  # NaN and negative weights dropped
    [(g_nan, 0.0), (g[5], 0.0), (g[6], np.inf)],  # empty: nothing applied, state untouched
    [(g[7], np.inf), (g[8], 4.0), (g_nan, 0.0)],
  ]
  inner = optax.adam(0.05)
  tx = ja.accumulate(inner, 3, skip_nonfinite=skip_nonfinite)
  if fused:
    step = jax.jit(lambda g, s, p, w: tx.update.apply_gradients(g, s, p, weight=w))
  else:
    step = jax.jit(lambda g, s, p, w: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p, weight=w)))
  expected, expected_inner = _window_reference(inner, params, windows)
  p, state = params, tx.init(params)
  for t, window in enumerate(windows):
    inner_before = state.inner_state
    for grads, w in window:
      p, state = step(grads, state, p, jnp.float64(w))
    chex.assert_trees_all_close(p, expected[t], rtol=RTOL, atol=1e-15)
    if t == 2:
      chex.assert_trees_all_equal(state.inner_state, inner_before)
      assert not bool(ja.has_updated(state))
  chex.assert_trees_all_close(state.inner_state, expected_inner, rtol=RTOL, atol=1e-15)
  assert int(state.update_count) == 3 and int(state.num_empty_windows) == 1
  assert int(state.num_skipped) == 4  # nan, -1, inf, inf: zero weights are not skipped


def test_nonfinite_gradient_with_positive_weight_is_skipped_only_with_skip_nonfinite():
  params = {"w": jnp.zeros(3)}
  g_nan = {"w": jnp.array([1.0, jnp.nan, 2.0])}
  for skip in (False, True):
    tx = ja.accumulate(optax.sgd(1.0), 2, skip_nonfinite=skip)
    step = jax.jit(lambda g, s, w: tx.update(g, s, weight=w))
    state = tx.init(params)
    _, state = step({"w": jnp.ones(3)}, state, jnp.float64(1.0))
    updates, state = step(g_nan, state, jnp.float64(1.0))
    if skip:  # dropped and counted: the window's mean is the finite microbatch alone
      np.testing.assert_array_equal(updates["w"], -np.ones(3))
      assert int(state.num_skipped) == 1
    else:  # added: the user's choice, documented
      assert np.isnan(np.asarray(updates["w"])[1]) and int(state.num_skipped) == 0


def test_an_empty_window_with_every_k_1_and_under_an_axis_the_total_decides():
  params = {"w": jnp.zeros(2)}
  tx = ja.accumulate(optax.adam(0.1), 1)
  updates, state = jax.jit(lambda g, s, w: tx.update(g, s, weight=w))(
    {"w": jnp.full(2, jnp.nan)}, tx.init(params), jnp.float64(0.0)
  )
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2)})
  chex.assert_trees_all_equal(state.inner_state, tx.init(params).inner_state)
  assert (int(state.update_count), int(state.num_empty_windows), bool(state.updated)) == (0, 1, False)

  # Under pmap: only device 0 has weight; the all-reduced total decides, so every device updates.
  n = 8
  tx = ja.accumulate(optax.sgd(1.0), 2, axis_name="data")
  step = jax.pmap(lambda g, s, w: tx.update(g, s, weight=w), axis_name="data")
  state = jax.tree.map(lambda x: jnp.stack([x] * n), tx.init(params))
  grads = {"w": jnp.arange(2.0 * n).reshape(n, 2)}
  for weights in ([1.0] + [0.0] * (n - 1), [2.0] + [0.0] * (n - 1)):
    grads_i = jax.tree.map(lambda x: x.at[1:].set(jnp.nan), grads)  # zero weight: NaN adds nothing
    updates, state = step(grads_i, state, jnp.asarray(weights))
  np.testing.assert_array_equal(updates["w"], -np.broadcast_to(grads["w"][0], (n, 2)))
  # All weights 0 on all devices: an empty window everywhere.
  for _ in range(2):
    updates, state = step(grads, state, jnp.zeros(n))
  np.testing.assert_array_equal(updates["w"], np.zeros((n, 2)))
  assert np.asarray(state.num_empty_windows).tolist() == [1] * n
  assert np.asarray(state.update_count).tolist() == [1] * n


# ----------------------------------------------------------------------------- dtypes of updates, keys


DTYPE_MIXES = [  # (params dtype, grads dtype, inner)
  (jnp.float32, jnp.bfloat16, lambda: optax.adam(1e-3)),
  (jnp.bfloat16, jnp.float32, lambda: optax.adam(1e-3)),
  (jnp.float32, jnp.float32, lambda: optax.adam(1e-3, mu_dtype=jnp.bfloat16)),
  (jnp.bfloat16, jnp.bfloat16, lambda: optax.sgd(0.1, momentum=0.9)),
  (jnp.float64, jnp.float32, lambda: optax.adamw(1e-3, weight_decay=0.1)),
]


@pytest.mark.parametrize("param_dtype, grad_dtype, make_inner", DTYPE_MIXES)
def test_every_k_1_is_inner_bit_for_bit_in_every_dtype_mix(param_dtype, grad_dtype, make_inner):
  """Issue 11 item 7: updates come back in the dtype inner gives them, not the gradient's."""
  params = {"w": jnp.linspace(-1, 1, 24, dtype=param_dtype).reshape(4, 6), "b": jnp.full((6,), 0.1, param_dtype)}
  inner = make_inner()
  tx = ja.accumulate(inner, 1)
  plain, wrapped = jax.jit(inner.update), jax.jit(tx.update)
  p_state, a_state = inner.init(params), tx.init(params)
  for i in range(3):
    grads = jax.tree.map(lambda x: (jnp.cos(x.astype(jnp.float32) * (i + 3)) / 7).astype(grad_dtype), params)
    expected, p_state = plain(grads, p_state, params)
    updates, a_state = wrapped(grads, a_state, params)
    chex.assert_trees_all_equal(updates, expected)  # values and dtypes, bit for bit
    chex.assert_trees_all_equal(a_state.inner_state, p_state)


@pytest.mark.parametrize("param_dtype, grad_dtype, make_inner", DTYPE_MIXES[:3])
def test_micro_step_zero_updates_have_the_window_end_dtypes(param_dtype, grad_dtype, make_inner):
  params = {"w": jnp.ones((4, 6), param_dtype), "b": jnp.zeros((6,), param_dtype)}
  inner = make_inner()
  tx = ja.accumulate(inner, 3)
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, grad_dtype), params)
  expected_dtypes = jax.tree.map(lambda u: u.dtype, inner.update(grads, inner.init(params), params)[0])
  update, state = jax.jit(tx.update), tx.init(params)
  for i in range(3):
    updates, state = update(grads, state, params)
    assert jax.tree.map(lambda u: u.dtype, updates) == expected_dtypes, i
  assert bool(state.updated)


@pytest.mark.parametrize("k", [1, 3])
def test_inner_state_with_typed_prng_keys(problem, k):
  """Issue 11 item 10: optax.noisy_sgd keeps a typed key in its state; it equals noisy_sgd on window means."""
  params, loss_fn, data = problem
  make = lambda: optax.noisy_sgd(0.05, key=jax.random.key(7))
  micro = split_rows(data, [10] * (2 * k))
  windows = [[(jax.grad(loss_fn)(params, m), 1.0) for m in micro[j * k : (j + 1) * k]] for j in range(2)]
  # Gradients fixed in advance (taken at the initial params) keep the reference plain.
  expected, _ = _window_reference(make(), params, windows)
  tx = ja.accumulate(make(), k)
  step = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
  p, state = params, tx.init(params)
  for j, window in enumerate(windows):
    for grads, _ in window:
      p, state = step(grads, state, p)
    chex.assert_trees_all_close(p, expected[j], rtol=RTOL, atol=1e-15)


# ----------------------------------------------------------------------------- sharded parameters


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_sharded_parameters_keep_their_sharding_and_equal_the_plain_reference(axis_type):
  """Issue 11 item 11: accumulator and zero updates carry each parameter's sharding; eager and jit."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  sharded, replicated = NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P())
  host = {"w": jnp.linspace(-1, 1, 2 * 8 * 4).reshape(2, 8, 4), "b": jnp.full((4,), 0.1)}
  params = {"w": jax.device_put(host["w"], sharded), "b": jax.device_put(host["b"], replicated)}
  inner = optax.adam(0.05)
  k = 3
  grads = [jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 2)), params) for i in range(2 * k)]
  windows = [[(jax.tree.map(np.asarray, g), 1.0) for g in grads[j * k : (j + 1) * k]] for j in range(2)]
  expected, _ = _window_reference(inner, host, windows)
  tx = ja.accumulate(inner, k)

  state = tx.init(params)  # eager: sharded like the params, 1/8 of the bytes on each device
  acc = state.acc_grads["w"]
  assert acc.sharding.is_equivalent_to(sharded, 3)
  assert {s.data.nbytes for s in acc.addressable_shards} == {acc.nbytes // 8}

  with jax.set_mesh(mesh):
    jitted = jax.jit(tx.update)
    p = params
    for j in range(2):
      for i in range(k):
        run = jitted if j == 0 else tx.update  # the first window inside jit, the second eager
        updates, state = run(grads[j * k + i], state, p)
        assert updates["w"].sharding.is_equivalent_to(sharded, 3)
        p = optax.apply_updates(p, updates)
      chex.assert_trees_all_close(p, expected[j], rtol=RTOL, atol=1e-15)
    assert state.acc_grads["w"].sharding.is_equivalent_to(sharded, 3)
    # Inside jit in Auto mode the sharding is not in the types: out_shardings says where the state goes.
    init = jax.jit(tx.init, out_shardings=jax.tree.map(lambda x: x.sharding, state))
    assert {s.data.nbytes for s in init(params).acc_grads["w"].addressable_shards} == {acc.nbytes // 8}


# ----------------------------------------------------------------------------- Python scalars, bad input


def test_python_scalar_params_and_grads():
  """Issue 11 item 13: leaves optax accepts (Python floats) work in init and update."""
  inner = optax.adam(0.1)
  tx = ja.accumulate(inner, 2)
  state = tx.init({"w": 1.0})
  for g in (0.5, 1.5):
    updates, state = tx.update({"w": g}, state, {"w": 1.0})
  expected, _ = inner.update({"w": 1.0}, inner.init({"w": 1.0}), {"w": 1.0})
  np.testing.assert_allclose(updates["w"], expected["w"], rtol=RTOL)
  state = tx.init({"w": 1.0})
  p, state = tx.update.apply_gradients(0.5, tx.init(1.0), 1.0)
  assert float(p) == 1.0


def test_construction_errors_name_the_argument():
  with pytest.raises(TypeError, match=r"inner=optax.adam .*call it: inner=optax.adam\(1e-3\)"):
    ja.accumulate(optax.adam, 4)
  with pytest.raises(TypeError, match="inner=None"):
    ja.accumulate(None, 4)
  tx = ja.accumulate(optax.sgd(0.1), 2)
  for bad in ("3", 1j, True, np.complex64(1)):
    with pytest.raises(TypeError, match="weight="):
      tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}), weight=bad)


def test_a_state_of_another_optimizer_says_which_was_expected():
  params = {"w": jnp.ones(2)}
  tx = ja.accumulate(optax.adam(0.1), 2)
  with pytest.raises(TypeError, match=r"AccumulateState.*ScaleByAdamState.*got tuple\(EmptyState, EmptyState\)"):
    tx.update(params, optax.sgd(0.1).init(params))
  with pytest.raises(TypeError, match="that is the state of `inner` itself"):
    tx.update(params, optax.adam(0.1).init(params))
  with pytest.raises(TypeError, match=r"inner_state does not match inner: .*ScaleByAdamState.*EmptyState, EmptyState"):
    tx.update(params, ja.accumulate(optax.sgd(0.1), 2).init(params))
  with pytest.raises(ValueError, match=r"grads has leaves \['v'\] that .* lacks; grads lacks the leaves \['w'\]"):
    tx.update({"v": jnp.ones(2)}, tx.init(params))


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_a_weight_that_overflows_the_accumulator_dtype_is_dropped_and_counted(skip_nonfinite):
  """Token counts of 7e4 are finite int32 but Inf in a float16 accumulator: dropped, never reaching the params."""
  tx = ja.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.float16, skip_nonfinite=skip_nonfinite)
  params = {"w": jnp.zeros(2, jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for w in (70000, 80000):
    updates, state = update({"w": jnp.full(2, 0.5, jnp.float32)}, state, params, weight=jnp.int32(w))
  np.testing.assert_array_equal(updates["w"], np.zeros(2))
  assert (int(state.num_skipped), int(state.num_empty_windows), int(state.update_count)) == (2, 1, 0)
  if skip_nonfinite:  # a valid weight whose product with the gradient overflows float32
    tx = ja.accumulate(optax.sgd(1.0), 2, skip_nonfinite=True)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.full(2, 1e10, jnp.float32)}, state, params, weight=1e30)
    updates, state = jax.jit(tx.update)({"w": jnp.ones(2, jnp.float32)}, state, params, weight=2.0)
    np.testing.assert_array_equal(updates["w"], -np.ones(2))  # only the finite microbatch: mean 1
    assert int(state.num_skipped) == 1


# ----------------------------------------------------------------------------- normalised wire (issue 18)


def test_float16_wire_with_token_weights_is_normalised_under_pmap():
  """512-token microbatches, gradients ~40: sum w g (~1.6e5 over 8 devices) overflows float16; the mean does not.

  The wire carries each device's share (sum_local w g) / (sum w) of the mean, the scalar total reduced
  first: the result lands within float16 rounding of the float64 one (before: parameters at -inf).
  """
  n, k = 8, 2
  params = {"w": jnp.ones((4,), jnp.float64)}
  xs = 1.0 + 0.01 * jax.random.uniform(jax.random.PRNGKey(0), (k, n, 512, 4), jnp.float64)

  def run(comm_dtype):
    tx = ja.accumulate(optax.sgd(1e-3), k, axis_name="data", comm_dtype=comm_dtype)

    def step(p, s, x):
      g = jax.grad(lambda q: 40.0 * jnp.mean(x @ q["w"]))(p)
      u, s = tx.update(g, s, p, weight=jnp.float64(x.shape[0]))
      return optax.apply_updates(p, u), s

    f = jax.pmap(step, axis_name="data")
    p = jax.tree.map(lambda a: jnp.stack([a] * n), params)
    s = jax.pmap(tx.init)(p)
    for i in range(k):
      p, s = f(p, s, xs[i])
    return p["w"][0]

  exact, half = run(None), run(jnp.float16)
  assert np.all(np.isfinite(half))
  # One float16 rounding of each device's share (~40/8, relative 2^-11) and of the sum, times the learning rate.
  np.testing.assert_allclose(half, exact, rtol=0, atol=1e-3 * 40 * 2.0**-9)


# ----------------------------------------------------------------------------- a dropped microbatch's slot (issue 22)


def _nan_microbatches(data):
  micro = split_rows(data, [10] * 7)
  micro[1] = (micro[1][0].at[0, 0].set(jnp.nan), micro[1][1])
  return micro


def test_dropped_microbatch_uses_its_slot_by_default(problem):
  """Default: a skipped microbatch still counts towards every_k. Windows: [0, (1 dropped), 2], [3, 4, 5]."""
  params, loss_fn, data = problem
  micro = _nan_microbatches(data)
  tx = ja.accumulate(optax.adam(0.05), 3, skip_nonfinite=True)
  step = make_step(tx, loss_fn)
  state, p = tx.init(params), params
  for batch in micro[:6]:
    p, state, _ = step(p, state, batch, jnp.float64(10.0))
  expected = full_batch_run(optax.adam(0.05), params, loss_fn, [[micro[0], micro[2]], micro[3:6]])
  chex.assert_trees_all_close(p, expected[-1], rtol=RTOL, atol=0)
  assert int(state.update_count) == 2 and int(state.num_skipped) == 1


def test_dropped_use_slot_false_skips_without_using_a_slot(problem):
  """dropped_use_slot=False (optax.MultiSteps' should_skip_update_fn): windows [0, 2, 3], [4, 5, 6]."""
  params, loss_fn, data = problem
  micro = _nan_microbatches(data)
  tx = ja.accumulate(optax.adam(0.05), 3, skip_nonfinite=True, dropped_use_slot=False)
  step = make_step(tx, loss_fn)
  state, p = tx.init(params), params
  updated = []
  for batch in micro:
    p, state, _ = step(p, state, batch, jnp.float64(10.0))
    updated.append(bool(ja.has_updated(state)))
  assert updated == [False, False, False, True, False, False, True]
  expected = full_batch_run(optax.adam(0.05), params, loss_fn, [[micro[0], micro[2], micro[3]], micro[4:7]])
  # atol: one leaf crosses zero (3.7e-6 after cancellation); 1e-15 is far below one update's rounding.
  chex.assert_trees_all_close(p, expected[-1], rtol=RTOL, atol=1e-15)
  assert int(state.update_count) == 2 and int(state.num_skipped) == 1 and int(state.micro_step) == 0


def test_dropped_use_slot_false_matches_optax_multisteps_should_skip(problem):
  """Equal microbatches: the same windows as optax.MultiSteps(should_skip_update_fn=skip_not_finite).

  every_k=1: the same values. every_k=2: the same windows (which calls emit); the values are checked
  against the plainly written reference above, not against MultiSteps, whose running (Welford) mean
  differed here by up to 2e-8 relative (not investigated further).
  """
  params, loss_fn, data = problem
  micro = _nan_microbatches(data)
  for k in (1, 2):
    ours = ja.accumulate(optax.sgd(0.1), k, skip_nonfinite=True, dropped_use_slot=False)
    theirs = optax.MultiSteps(optax.sgd(0.1), k, should_skip_update_fn=optax.skip_not_finite)
    results, emitted = [], []
    for tx in (ours, theirs):
      state, p, emits = tx.init(params), params, []
      for batch in micro:
        u, state = tx.update(jax.grad(loss_fn)(p, batch), state, p)
        emits.append(any(bool(jnp.any(x != 0)) for x in jax.tree.leaves(u)))
        p = optax.apply_updates(p, u)
      results.append(p)
      emitted.append(emits)
    assert emitted[0] == emitted[1], (k, emitted)
    if k == 1:
      chex.assert_trees_all_close(results[0], results[1], rtol=RTOL, atol=0)


def test_dropped_use_slot_must_be_a_bool():
  with pytest.raises(TypeError, match="dropped_use_slot"):
    ja.accumulate(optax.sgd(0.1), 2, dropped_use_slot="no")


# ----------------------------------------------------------------------------- noise scale under tensor parallelism


def _noise_run(mesh, model_axis, grads, sizes):
  """noise_scale_ema under a shard_map manual over the mesh; `theta` sharded over `model_axis` (or whole)."""
  n_data, k = sizes.shape
  tx = ja.accumulate(optax.set_to_zero(), k, axis_name="data", noise_scale_ema=0.9)
  params = {"theta": jnp.zeros(grads["theta"].shape[-1]), "b": jnp.zeros(grads["b"].shape[-1])}

  def per_device(state, f, f_theta=None):
    stats = state.noise_stats
    f_theta = f if f_theta is None else f_theta
    return state._replace(
      acc_grads={"b": f(state.acc_grads["b"]), "theta": f_theta(state.acc_grads["theta"])},
      acc_weight=f(state.acc_weight),
      num_skipped=f(state.num_skipped),
      noise_stats=stats._replace(acc_sq=f(stats.acc_sq), acc_count=f(stats.acc_count)),
    )

  state = per_device(tx.init(params), lambda a: jnp.stack([a] * n_data))
  theta_spec = P("data", model_axis)
  spec = per_device(jax.tree.map(lambda _: P(), state), lambda _: P("data"), lambda _: theta_spec)

  def body(state, g, w):
    g = jax.tree.map(lambda a: a[0], g)
    _, state = tx.update(g, per_device(state, lambda a: a[0]), params, weight=w[0])
    return per_device(state, lambda a: a[None])

  g_spec = {"b": P("data"), "theta": theta_spec}
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, g_spec, P("data")), out_specs=spec))
  for w_i in range(grads["theta"].shape[0]):
    for i in range(k):
      g = jax.tree.map(lambda a: a[w_i, :, i], grads)
      state = step(state, g, jnp.asarray(sizes[:, i], jnp.float64))
  return ja.noise_scale(state)


def test_noise_scale_under_tensor_parallel_shard_map_sums_the_model_shards():
  """(data, model) = (4, 2), theta sharded over 'model': the same estimates as the whole theta on 4 data devices.

  Before: each device's |g|^2 covered its model shard only, and the per-device statistics came out varying
  over 'model' (a raw out_specs error).
  """
  windows, d = 6, 8
  sizes = np.array([[3, 9], [4, 4], [8, 2], [5, 7]])
  keys = jax.random.split(jax.random.PRNGKey(7), 2)
  grads = {
    "theta": jax.random.normal(keys[0], (windows, 4, 2, d), jnp.float64) + 0.5,
    "b": jax.random.normal(keys[1], (windows, 4, 2, 3), jnp.float64),
  }
  tp = _noise_run(jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2), "model", grads, sizes)
  whole = _noise_run(
    jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4]), None, grads, sizes
  )
  np.testing.assert_allclose(np.asarray(tp.grad_sq), np.asarray(whole.grad_sq), rtol=RTOL)
  np.testing.assert_allclose(np.asarray(tp.trace_cov), np.asarray(whole.trace_cov), rtol=RTOL)
  assert np.isfinite(float(tp.b_simple))
