"""ja.flax: linen TrainState and nnx AccumulatingOptimizer against plain jax/optax references (float64)."""

import functools
import subprocess
import sys
import textwrap
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_init, mse_loss, regression_data
from flax import nnx, struct
from flax.training import train_state as flax_train_state

import jaxaccum as ja

RTOL = 1e-12
SIZES = (3, 5, 4, 5, 3, 4)  # two windows of K=3, unequal microbatch sizes, weighted by size
K = 3


def microbatches(data, sizes=SIZES):
  x, y = data
  edges = np.cumsum([0] + list(sizes))
  return [(x[a:b], y[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def union(batches):
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)


def reference_run(opt, params, loss_fn, batches, k=K):
  """One plain optax step per window, on the union of its microbatches."""
  state = opt.init(params)
  for start in range(0, len(batches), k):
    grads = jax.grad(loss_fn)(params, union(batches[start : start + k]))
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def reference_with_stats(loss_and_stats, params, stats, batches, keys, sizes, k, opt):
  """(params, stats) after each window, written plainly: every microbatch's gradient and new
  statistics from the window-start params/statistics (same dropout keys), size-weighted means,
  one optax step per window."""
  ref_grad = jax.jit(jax.grad(loss_and_stats, has_aux=True))
  opt_state = opt.init(params)
  after = []
  for w in range(len(batches) // k):
    idx = range(w * k, (w + 1) * k)
    outs = [ref_grad(params, stats, batches[i], keys[i]) for i in idx]
    wts = [float(sizes[i]) for i in idx]
    wsum = lambda *xs: sum(wi * xi for wi, xi in zip(wts, xs, strict=True))
    mean = lambda trees: jax.tree.map(lambda *xs: wsum(*xs) / sum(wts), *trees)
    updates, opt_state = opt.update(mean([o[0] for o in outs]), opt_state, params)
    params, stats = optax.apply_updates(params, updates), mean([o[1] for o in outs])
    after.append((params, stats))
  return after


# --------------------------------------------------------------------------- linen


def test_linen_trainstate_counts_updates_and_equals_large_batch():
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  batches = microbatches(regression_data(jax.random.PRNGKey(1), sum(SIZES)))
  state = ja.flax.TrainState.create(apply_fn=mlp_apply, params=params, tx=ja.accumulate(optax.adam(0.05), K))

  @jax.jit
  def step(state, batch, weight):
    return state.apply_gradients(grads=jax.grad(mse_loss)(state.params, batch), weight=weight)

  seen = []
  for i, batch in enumerate(batches):
    before = state.params
    state = step(state, batch, float(len(batch[0])))
    seen.append((int(state.step), int(state.micro_step)))
    if (i + 1) % K:
      chex.assert_trees_all_equal(state.params, before)  # micro-step: parameters untouched
    else:
      pairs = zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True)
      assert not all(np.array_equal(a, b) for a, b in pairs)
  assert seen == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
  expected = reference_run(optax.adam(0.05), params, mse_loss, batches)
  # A bias that adam's steps carry from 0.1 to within 1e-5 of zero: atol 1e-15 is 1e-14 of the parameters'
  # scale (0.1), and rtol governs every entry above 1e-3. That bias's last bits depend on how XLA:CPU compiled
  # the sums (the LLVM level, FMA contraction), not on the method, whose errors are around 1e-3.
  chex.assert_trees_all_close(state.params, expected, rtol=RTOL, atol=1e-15)


def test_plain_flax_trainstate_with_multisteps_counts_micro_steps():
  """The trap: flax's TrainState.step counts calls, so step-keyed schedules run K times too fast."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 4, 2))
  batches = microbatches(regression_data(jax.random.PRNGKey(1), 24), (4,) * 6)
  plain = flax_train_state.TrainState.create(apply_fn=mlp_apply, params=params, tx=optax.MultiSteps(optax.sgd(0.1), K))
  ours = ja.flax.TrainState.create(apply_fn=mlp_apply, params=params, tx=ja.accumulate(optax.sgd(0.1), K))
  step = jax.jit(lambda state, batch: state.apply_gradients(grads=jax.grad(mse_loss)(state.params, batch)))
  for batch in batches:
    plain, ours = step(plain, batch), step(ours, batch)
  assert int(plain.step) == 6  # micro-steps
  assert int(plain.opt_state.gradient_step) == 2  # the real count, buried in the optimizer state
  assert int(ours.step) == 2 and int(ours.micro_step) == 0
  # Same mean gradient for equal sizes: the parameters agree (to MultiSteps' float32
  # accumulator), only the count differs.
  chex.assert_trees_all_close(ours.params, plain.params, rtol=1e-6, atol=0)


def test_linen_trainstate_with_plain_tx_behaves_like_flax():
  params = mlp_init(jax.random.PRNGKey(0), (3, 4, 2))
  batches = microbatches(regression_data(jax.random.PRNGKey(1), 12), (4,) * 3)
  plain = flax_train_state.TrainState.create(apply_fn=mlp_apply, params=params, tx=optax.adam(0.1))
  ours = ja.flax.TrainState.create(apply_fn=mlp_apply, params=params, tx=optax.adam(0.1))
  for batch in batches:
    plain = plain.apply_gradients(grads=jax.grad(mse_loss)(plain.params, batch))
    ours = ours.apply_gradients(grads=jax.grad(mse_loss)(ours.params, batch))
  assert int(ours.step) == 3 and int(ours.micro_step) == 0 and int(ours.microbatches_seen) == 3
  chex.assert_trees_all_close(ours.params, plain.params, rtol=RTOL, atol=0)


class BNDropMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    # No bias before BatchNorm: its gradient is zero up to rounding, which adam would amplify.
    x = nn.Dense(8, use_bias=False, param_dtype=jnp.float64)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.8, param_dtype=jnp.float64)(x)
    x = nn.Dropout(0.3, deterministic=not train)(jnp.tanh(x))
    return nn.Dense(2, param_dtype=jnp.float64)(x)


def test_linen_batchnorm_and_dropout_under_jit():
  model = BNDropMLP()
  sizes = (4, 4, 4, 4)  # equal sizes: the running mean must equal the full batch's exactly
  batches = microbatches(regression_data(jax.random.PRNGKey(1), sum(sizes)), sizes)
  keys = [jax.random.fold_in(jax.random.PRNGKey(7), i) for i in range(len(batches))]
  variables = model.init(jax.random.PRNGKey(0), batches[0][0], train=False)
  # linen creates running statistics in float32: take them to float64 for the 1e-12 comparisons.
  variables = {**variables, "batch_stats": jax.tree.map(lambda s: s.astype(jnp.float64), variables["batch_stats"])}
  k = 2

  def loss_and_stats(params, stats, batch, key):
    x, y = batch
    out, new = model.apply(
      {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"], rngs={"dropout": key}
    )
    return jnp.mean(jnp.sum((out - y) ** 2, -1)), new["batch_stats"]

  state = ja.flax.TrainState.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=ja.accumulate(optax.adam(0.05), k),
    batch_stats=variables["batch_stats"],
  )

  @jax.jit
  def step(state, batch, key, weight):
    grads, stats = jax.grad(loss_and_stats, has_aux=True)(state.params, state.batch_stats, batch, key)
    return state.apply_gradients(grads=grads, batch_stats=stats, weight=weight)

  expected = reference_with_stats(
    loss_and_stats, variables["params"], variables["batch_stats"], batches, keys, sizes, k, optax.adam(0.05)
  )
  for w, (ref_params, ref_stats) in enumerate(expected):
    start_stats = state.batch_stats
    for j, i in enumerate(range(w * k, (w + 1) * k)):
      state = step(state, batches[i], keys[i], float(sizes[i]))
      if j < k - 1:
        chex.assert_trees_all_equal(state.batch_stats, start_stats)  # constant within the window
    assert int(state.step) == w + 1 and int(state.micro_step) == 0
    chex.assert_trees_all_close(state.params, ref_params, rtol=RTOL, atol=1e-15)
    chex.assert_trees_all_close(state.batch_stats, ref_stats, rtol=RTOL, atol=1e-15)


def test_linen_batchnorm_average_vs_full_batch_statistics():
  """Equal sizes: running mean exact; running var smaller by (1 - m) * Var_i(mean_i)."""
  bn = nn.BatchNorm(use_running_average=False, momentum=0.8, param_dtype=jnp.float64)
  x = jax.random.normal(jax.random.PRNGKey(3), (12, 5)) * 2 + 1
  v = bn.init(jax.random.PRNGKey(0), x)
  v = {**v, "batch_stats": jax.tree.map(lambda s: s.astype(jnp.float64), v["batch_stats"])}
  start = v["batch_stats"]
  full = bn.apply(v, x, mutable=["batch_stats"])[1]["batch_stats"]
  state = ja.flax.TrainState.create(
    apply_fn=bn.apply, params=v["params"], tx=ja.accumulate(optax.sgd(0.0), 3), batch_stats=start
  )
  parts = jnp.split(x, 3)
  for part in parts:
    stats = bn.apply({"params": state.params, "batch_stats": state.batch_stats}, part, mutable=["batch_stats"])[1]
    state = state.apply_gradients(grads=jax.tree.map(jnp.zeros_like, state.params), batch_stats=stats["batch_stats"])
  means = jnp.stack([p.mean(0) for p in parts])
  np.testing.assert_allclose(state.batch_stats["mean"], full["mean"], rtol=RTOL)
  np.testing.assert_allclose(state.batch_stats["var"], full["var"] - 0.2 * means.var(0), rtol=1e-11)


def test_linen_skip_nonfinite_drops_the_microbatch_statistics_too():
  """A microbatch dropped for a NaN gradient takes its (NaN) statistics with it; an empty window changes nothing."""
  params = {"w": jnp.asarray([1.0, -2.0, 0.5])}
  tx = ja.accumulate(optax.sgd(0.1), 3, skip_nonfinite=True)
  state = ja.flax.TrainState.create(apply_fn=None, params=params, tx=tx, batch_stats={"mean": jnp.zeros(3)})
  step = jax.jit(lambda st, g, s, w: st.apply_gradients(grads={"w": g}, batch_stats={"mean": s}, weight=w))
  nan = jnp.full(3, jnp.nan)
  g1, g3, s1, s3 = jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([-1.0, 0.0, 4.0]), jnp.full(3, 2.0), jnp.full(3, 7.0)
  for g, st, w in [(g1, s1, 2.0), (nan, nan, 3.0), (g3, s3, 5.0)]:
    state = step(state, g, st, w)
  np.testing.assert_allclose(state.params["w"], params["w"] - 0.1 * (2 * g1 + 5 * g3) / 7, rtol=RTOL)
  np.testing.assert_allclose(state.batch_stats["mean"], (2 * s1 + 5 * s3) / 7, rtol=RTOL)
  assert int(state.step) == 1 and int(state.opt_state.num_skipped) == 1
  before = state
  for _ in range(3):
    state = step(state, nan, nan, 1.0)
  chex.assert_trees_all_equal((state.params, state.batch_stats), (before.params, before.batch_stats))
  assert int(state.step) == 1 and int(state.opt_state.num_skipped) == 4


def test_linen_batch_stats_averaged_over_devices_with_axis_name():
  """TrainState(axis_name=...) under pmap: window-end statistics are the weighted mean over devices too."""
  n, k = 4, 2
  params = {"w": jnp.asarray([1.0, -2.0])}
  tx = ja.accumulate(optax.sgd(0.1), k, axis_name="d")
  state = ja.flax.TrainState.create(
    apply_fn=None, params=params, tx=tx, batch_stats={"mean": jnp.zeros(2)}, axis_name="d"
  )
  # The accumulator (and so the whole state) is per device: give every device its own copy.
  states = jax.tree.map(lambda x: jnp.stack([x] * n), state)
  rng = np.random.default_rng(0)
  grads, stats, weights = rng.normal(size=(k, n, 2)), rng.normal(size=(k, n, 2)), rng.integers(1, 9, size=(k, n)) * 1.0
  step = jax.pmap(
    lambda st, g, s, w: st.apply_gradients(grads={"w": g}, batch_stats={"mean": s}, weight=w), axis_name="d"
  )
  for i in range(k):
    states = step(states, grads[i], stats[i], weights[i])
  wsum = weights.sum()
  expected_stats = (weights[..., None] * stats).sum((0, 1)) / wsum
  expected_w = np.asarray(params["w"]) - 0.1 * (weights[..., None] * grads).sum((0, 1)) / wsum
  for d in range(n):
    np.testing.assert_allclose(states.batch_stats["mean"][d], expected_stats, rtol=RTOL)
    np.testing.assert_allclose(states.params["w"][d], expected_w, rtol=RTOL)
  assert np.all(np.asarray(states.step) == 1)


def _big_copies(hlo_text: str) -> list[str]:
  """Non-scalar copy instructions: a passed-through buffer copied, or zero updates materialised."""
  out = []
  for line in hlo_text.splitlines():
    if " copy(" in line:
      shape = line.split("=", 1)[1].split(" copy(", 1)[0]
      if "[]" not in shape:
        out.append(line.strip())
  return out


def test_linen_donated_step_has_no_parameter_copies():
  params = mlp_init(jax.random.PRNGKey(0), (16, 64, 64, 2), dtype=jnp.float32)
  state = ja.flax.TrainState.create(apply_fn=mlp_apply, params=params, tx=ja.accumulate(optax.adam(1e-3), 4))
  batch = (jnp.ones((8, 16), jnp.float32), jnp.ones((8, 2), jnp.float32))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch):
    return state.apply_gradients(grads=jax.grad(mse_loss)(state.params, batch))

  hlo = step.lower(state, batch).compile().as_text()
  assert "conditional" in hlo
  # Not even the zero updates that the plain optax API has to emit on micro-steps
  # (ja.accumulate's fused apply_gradients writes the parameters in its window-end branch).
  assert _big_copies(hlo) == []
  # Every parameter buffer is donated into an output (updated in place or passed through).
  aliases = hlo.split("input_output_alias={", 1)[1].split("\n", 1)[0]
  for i in range(len(jax.tree.leaves(params))):
    assert f"({i}, {{}}, may-alias)" in aliases, i


def test_linen_bad_input():
  params = mlp_init(jax.random.PRNGKey(0), (3, 4, 2))
  grads = jax.tree.map(jnp.ones_like, params)
  for bad in (3, "", ("data", 2)):
    with pytest.raises(TypeError, match="axis_name="):
      ja.flax.TrainState.create(apply_fn=mlp_apply, params=params, tx=ja.accumulate(optax.sgd(0.1), 2), axis_name=bad)
  state = ja.flax.TrainState.create(apply_fn=mlp_apply, params=params, tx=ja.accumulate(optax.sgd(0.1), 2))
  with pytest.raises(ValueError, match="weight"):
    state.apply_gradients(grads=grads, weight=-1.0)
  with pytest.raises(ValueError, match="weight"):
    state.apply_gradients(grads=grads, weight=float("nan"))
  with pytest.raises(ValueError, match="grads"):
    state.apply_gradients(grads=grads[:1])
  with pytest.raises(ValueError, match="batch_stats"):
    state.apply_gradients(grads=grads, batch_stats={"mean": jnp.zeros(3)})
  with_stats = ja.flax.TrainState.create(
    apply_fn=mlp_apply, params=params, tx=ja.accumulate(optax.sgd(0.1), 2), batch_stats={"mean": jnp.zeros(3)}
  )
  with pytest.raises(ValueError, match="batch_stats"):
    with_stats.apply_gradients(grads=grads, batch_stats={"mean": jnp.zeros(4)})
  plain = ja.flax.TrainState.create(apply_fn=mlp_apply, params=params, tx=optax.sgd(0.1))
  with pytest.raises(TypeError, match="weight"):
    plain.apply_gradients(grads=grads, weight=2.0)
  with pytest.raises(TypeError, match="tx"):
    ja.flax.TrainState.create(apply_fn=mlp_apply, params=params, tx=optax.sgd)


def _adam_reference(params, mean_grads, lr, b1=0.9, b2=0.999, eps=1e-8):
  """Adam written plainly in numpy, one step per mean gradient: the parameters after each step."""
  params = jax.tree.map(np.asarray, params)
  m = jax.tree.map(np.zeros_like, params)
  v = jax.tree.map(np.zeros_like, params)
  after = []
  for t, g in enumerate(mean_grads, start=1):
    g = jax.tree.map(np.asarray, g)
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
    params = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps), params, m, v)
    after.append(params)
  return after


def test_linen_zero_invalid_weights_and_empty_window_under_jit():
  """Weight 0 with NaN gradient/statistics adds nothing; NaN or negative weights drop the microbatch
  (its statistics too); a window of total weight 0 changes nothing and does not advance step."""
  params = {"w": jnp.asarray([1.0, -2.0, 0.5])}
  state = ja.flax.TrainState.create(
    apply_fn=None, params=params, tx=ja.accumulate(optax.adam(0.1), 3), batch_stats={"mean": jnp.zeros(3)}
  )
  step = jax.jit(lambda st, g, s, w: st.apply_gradients(grads={"w": g}, batch_stats={"mean": s}, weight=w))
  nan = jnp.full(3, jnp.nan)
  g1, g2, s1, s2 = jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([-1.0, 0.0, 4.0]), jnp.full(3, 2.0), jnp.full(3, 7.0)
  windows = [
    [(g1, s1, 2.0), (nan, nan, 0.0), (g2, s2, 5.0)],  # padding only: weight 0, NaN everything
    [(g1, s1, 4.0), (g2, s2, jnp.nan), (nan, s2, -2.0)],  # invalid weights: dropped with their statistics
    [(nan, nan, 0.0), (g2, s2, jnp.nan), (nan, nan, 0.0)],  # total weight 0: nothing at all
  ]
  expected = _adam_reference(params, [{"w": (2 * g1 + 5 * g2) / 7}, {"w": g1}], 0.1)
  expected_stats = [(2 * s1 + 5 * s2) / 7, s1]
  for w, window in enumerate(windows):
    before = state
    for g, st, weight in window:
      state = step(state, g, st, weight)
    if w < 2:
      chex.assert_trees_all_close(state.params, expected[w], rtol=RTOL, atol=0)
      np.testing.assert_allclose(state.batch_stats["mean"], expected_stats[w], rtol=RTOL)
      assert int(state.step) == w + 1
    else:
      chex.assert_trees_all_equal(
        (state.params, state.batch_stats, state.opt_state.inner_state),
        (before.params, before.batch_stats, before.opt_state.inner_state),
      )
      assert int(state.step) == 2 and int(state.opt_state.update_count) == 2
  assert int(state.opt_state.num_skipped) == 3 and int(state.opt_state.num_empty_windows) == 1
  assert int(state.microbatches_seen) == 9 and int(state.micro_step) == 0


class DropoutOnly(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    return nn.Dropout(0.5, deterministic=not train)(x)


def test_linen_microbatches_seen_gives_each_microbatch_its_dropout_key():
  """fold_in(rng, state.microbatches_seen): a new mask per microbatch; fold_in(rng, state.step) repeats
  within a window."""
  model, rng, k = DropoutOnly(), jax.random.PRNGKey(5), 3
  params = {"w": jnp.zeros(2)}
  state = ja.flax.TrainState.create(apply_fn=model.apply, params=params, tx=ja.accumulate(optax.sgd(0.1), k))
  assert state.microbatches_seen.dtype == jnp.int32

  @jax.jit
  def step(state):
    mask = lambda n: model.apply({}, jnp.ones(64), train=True, rngs={"dropout": jax.random.fold_in(rng, n)}) != 0
    new = state.apply_gradients(grads={"w": jnp.ones(2)})
    return new, mask(state.microbatches_seen), mask(state.step)

  by_seen, by_step = [], []
  for i in range(2 * k):
    state, m_seen, m_step = step(state)
    by_seen.append(np.asarray(m_seen))
    by_step.append(np.asarray(m_step))
    assert int(state.microbatches_seen) == i + 1
  assert len({m.tobytes() for m in by_seen}) == 2 * k  # every microbatch its own mask
  assert len({m.tobytes() for m in by_step}) == 2  # the trap: one mask per window


def test_linen_state_can_be_donated_whole():
  """No buffer appears twice in the state (step vs opt_state.update_count), so a jitted step that reads
  state.step can take the state donated."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 4, 2))
  state = ja.flax.TrainState.create(
    apply_fn=mlp_apply, params=params, tx=ja.accumulate(optax.adam(0.1), 2), batch_stats={"mean": jnp.zeros(3)}
  )
  batch = regression_data(jax.random.PRNGKey(1), 4)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch):
    new = state.apply_gradients(
      grads=jax.grad(mse_loss)(state.params, batch), batch_stats={"mean": batch[0][0]}, weight=2.0
    )
    return new, state.step * 10  # a schedule reading the donated step, as lm1b's does

  def assert_distinct(state):
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    assert len(set(pointers)) == len(pointers)

  assert_distinct(state)
  for i in range(5):
    state, read = step(state, batch)
    assert_distinct(state)
    assert int(read) == 10 * (i // 2)
  assert int(state.step) == 2 and int(state.microbatches_seen) == 5


def test_linen_trainstate_subclasses_like_flax():
  """Flax's ImageNet example: `batch_stats: Any` redeclared, and a new field without a default."""

  class WithStats(ja.flax.TrainState):
    batch_stats: Any

  class WithRng(ja.flax.TrainState):
    dropout_rng: Any
    scale: Any = struct.field(pytree_node=False, default=1.0)

  params = {"w": jnp.asarray([1.0, -2.0])}
  step = jax.jit(lambda st, g, s: st.apply_gradients(grads={"w": g}, batch_stats={"mean": s}, weight=1.0))
  state = WithStats.create(
    apply_fn=None, params=params, tx=ja.accumulate(optax.sgd(0.1), 2), batch_stats={"mean": jnp.zeros(2)}
  )
  for g, s in [(jnp.asarray([1.0, 3.0]), jnp.full(2, 2.0)), (jnp.asarray([3.0, -1.0]), jnp.full(2, 4.0))]:
    state = step(state, g, s)
  assert isinstance(state, WithStats) and int(state.step) == 1
  np.testing.assert_allclose(state.params["w"], [1.0 - 0.1 * 2.0, -2.0 - 0.1 * 1.0], rtol=RTOL)
  np.testing.assert_allclose(state.batch_stats["mean"], [3.0, 3.0], rtol=RTOL)

  key = jax.random.PRNGKey(3)
  state = WithRng.create(
    apply_fn=None,
    params=params,
    tx=ja.accumulate(optax.sgd(0.1), 2),
    dropout_rng=key,
    batch_stats={"mean": jnp.zeros(2)},
  )
  state = step(state, jnp.ones(2), jnp.ones(2))
  assert isinstance(state, WithRng) and int(state.micro_step) == 1 and int(state.microbatches_seen) == 1
  np.testing.assert_array_equal(state.dropout_rng, key)
  assert state.scale == 1.0


# --------------------------------------------------------------------------- nnx


class NNXModel(nnx.Module):
  def __init__(self, rngs, *, batchnorm=False, dropout=0.0):
    self.l1 = nnx.Linear(3, 8, use_bias=not batchnorm, param_dtype=jnp.float64, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.8, param_dtype=jnp.float64, rngs=rngs) if batchnorm else None
    if batchnorm:  # nnx creates running statistics in float32: float64 for the 1e-12 comparisons.
      self.bn.mean = nnx.BatchStat(jnp.zeros(8, jnp.float64))
      self.bn.var = nnx.BatchStat(jnp.ones(8, jnp.float64))
    self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None
    self.l2 = nnx.Linear(8, 2, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x, key=None):
    x = self.l1(x)
    if self.bn is not None:
      x = self.bn(x)
    x = jnp.tanh(x)
    if self.drop is not None:
      x = self.drop(x, rngs=nnx.Rngs(dropout=key))
    return self.l2(x)


def nnx_loss(model, batch, key=None):
  x, y = batch
  return jnp.mean(jnp.sum((model(x, key) - y) ** 2, -1))


def test_nnx_optimizer_counts_updates_and_equals_large_batch():
  model = NNXModel(nnx.Rngs(0))
  graphdef, params0 = nnx.split(model, nnx.Param)
  params0 = nnx.as_pure(params0)  # a State holds the model's live Variables: take the arrays now
  batches = microbatches(regression_data(jax.random.PRNGKey(1), sum(SIZES)))
  optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.adam(0.05), K), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch, weight):
    optimizer.update(model, nnx.grad(nnx_loss)(model, batch), weight=weight)

  seen = []
  for i, batch in enumerate(batches):
    before = nnx.as_pure(nnx.state(model, nnx.Param))
    step(model, optimizer, batch, float(len(batch[0])))
    seen.append((int(optimizer.step[...]), int(optimizer.micro_step)))
    if (i + 1) % K:
      chex.assert_trees_all_equal(nnx.as_pure(nnx.state(model, nnx.Param)), before)
  assert seen == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]

  # Reference: pure functions of the parameter arrays, jax.grad on the union, optax.
  pure = lambda p, batch: nnx_loss(nnx.merge(graphdef, p), batch)
  expected = reference_run(optax.adam(0.05), params0, pure, batches)
  chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.Param)), expected, rtol=RTOL, atol=0)


def test_plain_nnx_optimizer_with_multisteps_counts_micro_steps():
  model = NNXModel(nnx.Rngs(0))
  plain = nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), K), wrt=nnx.Param)
  ours = ja.flax.AccumulatingOptimizer(nnx.clone(model), ja.accumulate(optax.sgd(0.1), K), wrt=nnx.Param)
  grads = nnx.grad(nnx_loss)(model, regression_data(jax.random.PRNGKey(1), 4))
  step = nnx.jit(lambda optimizer, model: optimizer.update(model, grads))
  ours_model = NNXModel(nnx.Rngs(0))
  for _ in range(2 * K):
    step(plain, model)
    step(ours, ours_model)
  assert int(plain.step[...]) == 2 * K
  assert int(ours.step[...]) == 2 and int(ours.micro_step) == 0


def test_nnx_batchnorm_and_dropout_under_jit():
  k = 2
  model = NNXModel(nnx.Rngs(0), batchnorm=True, dropout=0.3)
  sizes = (4, 6, 6, 4)
  batches = microbatches(regression_data(jax.random.PRNGKey(1), sum(sizes)), sizes)
  keys = [jax.random.fold_in(jax.random.PRNGKey(7), i) for i in range(len(batches))]

  # Reference first (from a copy): pure functions, one dropout key per microbatch.
  graphdef, params, stats, rest = nnx.split(nnx.clone(model), nnx.Param, nnx.BatchStat, ...)
  params, stats = nnx.as_pure(params), nnx.as_pure(stats)

  def loss_and_stats(p, s, batch, key):
    m = nnx.merge(graphdef, p, s, rest)
    loss = nnx_loss(m, batch, key)
    return loss, nnx.as_pure(nnx.state(m, nnx.BatchStat))

  expected = reference_with_stats(loss_and_stats, params, stats, batches, keys, sizes, k, optax.adam(0.05))

  optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.adam(0.05), k), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch, key, weight):
    optimizer.update(model, nnx.grad(nnx_loss)(model, batch, key), weight=weight)

  for w, (ref_params, ref_stats) in enumerate(expected):
    start_stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    for j in range(k):
      i = w * k + j
      step(model, optimizer, batches[i], keys[i], float(sizes[i]))
      if j < k - 1:
        chex.assert_trees_all_equal(nnx.as_pure(nnx.state(model, nnx.BatchStat)), start_stats)
    assert int(optimizer.step[...]) == w + 1
    chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.Param)), ref_params, rtol=RTOL, atol=1e-15)
    chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.BatchStat)), ref_stats, rtol=RTOL, atol=1e-15)


def test_nnx_skip_nonfinite_drops_the_microbatch_statistics_too():
  model = NNXModel(nnx.Rngs(0), batchnorm=True)
  optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.sgd(0.1), 2, skip_nonfinite=True), wrt=nnx.Param)
  params0 = nnx.as_pure(nnx.state(model, nnx.Param))
  grads = nnx.grad(nnx_loss)(model, regression_data(jax.random.PRNGKey(1), 6))
  nan_grads = jax.tree.map(lambda g: g * jnp.nan, grads)
  stat = jnp.linspace(-1.0, 1.0, 8)

  def feed(mean, g, weight):  # what a training-mode forward pass and its gradient hand over
    model.bn.mean[...] = mean
    optimizer.update(model, g, weight=weight)

  feed(stat, grads, 2.0)
  feed(jnp.full(8, jnp.nan), nan_grads, 3.0)
  np.testing.assert_allclose(model.bn.mean[...], stat, rtol=RTOL)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, params0, nnx.as_pure(grads))
  chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.Param)), expected, rtol=RTOL, atol=1e-15)
  assert int(optimizer.step[...]) == 1
  after = nnx.as_pure(nnx.state(model))
  for _ in range(2):
    feed(jnp.full(8, jnp.nan), nan_grads, 1.0)
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state(model)), after)
  assert int(optimizer.step[...]) == 1


def test_nnx_batch_stats_averaged_over_devices_with_axis_name():
  """AccumulatingOptimizer(axis_name=...) under pmap: window-end statistics are the weighted mean over devices."""
  n, k = 4, 2
  model = NNXModel(nnx.Rngs(0), batchnorm=True)
  optimizer = ja.flax.AccumulatingOptimizer(
    model, ja.accumulate(optax.sgd(0.1), k, axis_name="d"), wrt=nnx.Param, axis_name="d"
  )
  graphdef, state = nnx.split((model, optimizer))
  params0 = nnx.as_pure(nnx.state(model, nnx.Param))
  states = jax.tree.map(lambda x: jnp.stack([x] * n), nnx.as_pure(state))  # per device: the sums differ

  def feed(state, mean, g, weight):  # one microbatch on one device
    m, o = nnx.merge(graphdef, state)
    m.bn.mean[...] = mean  # what its training-mode forward pass would leave behind
    o.update(m, jax.tree.map(lambda p: jnp.full_like(p, g), nnx.state(m, nnx.Param)), weight=weight)
    return nnx.as_pure(nnx.state((m, o)))

  step = jax.pmap(feed, axis_name="d")
  rng = np.random.default_rng(0)
  means, gs, weights = rng.normal(size=(k, n, 8)), rng.normal(size=(k, n)), rng.integers(1, 9, size=(k, n)) * 1.0
  for i in range(k):
    states = step(states, means[i], gs[i], weights[i])
  model_state = states[0]
  expected_mean = (weights[..., None] * means).sum((0, 1)) / weights.sum()
  expected_step = (weights * gs).sum() / weights.sum()
  for d in range(n):
    np.testing.assert_allclose(model_state["bn"]["mean"][d], expected_mean, rtol=RTOL)
    np.testing.assert_allclose(model_state["l1"]["kernel"][d], params0["l1"]["kernel"] - 0.1 * expected_step, rtol=RTOL)
  assert np.all(np.asarray(states[1]["step"]) == 1)


def test_nnx_bad_input():
  model = NNXModel(nnx.Rngs(0))
  grads = nnx.grad(nnx_loss)(model, regression_data(jax.random.PRNGKey(1), 4))
  optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)
  with pytest.raises(ValueError, match="weight"):
    optimizer.update(model, grads, weight=-1.0)
  assert int(optimizer.micro_step) == 0  # nothing half-applied
  plain = ja.flax.AccumulatingOptimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  with pytest.raises(TypeError, match="weight"):
    plain.update(model, grads, weight=2.0)
  with pytest.raises(TypeError, match="wrt"):
    ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.sgd(0.1), 2))
  with pytest.raises(TypeError, match="axis_name=3"):
    ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param, axis_name=3)

  # A model whose statistics no longer match those at construction: refused before anything is written.
  bn_model = NNXModel(nnx.Rngs(0), batchnorm=True)
  bn_optimizer = ja.flax.AccumulatingOptimizer(bn_model, ja.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)
  bn_grads = nnx.grad(nnx_loss)(bn_model, regression_data(jax.random.PRNGKey(1), 4))
  before = nnx.as_pure(nnx.state((bn_model, bn_optimizer)))
  bn_model.extra = nnx.BatchStat(jnp.zeros(2))
  with pytest.raises(ValueError, match="BatchStat.* does not match those at construction"):
    bn_optimizer.update(bn_model, bn_grads)
  del bn_model.extra
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state((bn_model, bn_optimizer))), before)


def test_nnx_zero_invalid_weights_and_empty_window_under_jit():
  """As the linen test: weight 0 (NaN gradient and statistics) adds nothing, invalid weights drop the
  microbatch with its statistics, a window of total weight 0 changes nothing."""
  model = NNXModel(nnx.Rngs(0), batchnorm=True)
  ga = nnx.grad(nnx_loss)(model, regression_data(jax.random.PRNGKey(1), 6))  # (moves the running var)
  var0 = np.asarray(model.bn.var[...])
  optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.adam(0.1), 3), wrt=nnx.Param)
  params0 = nnx.as_pure(nnx.state(model, nnx.Param))
  gb = jax.tree.map(lambda g: 0.1 - 0.5 * g, ga)
  gnan = jax.tree.map(lambda g: g * jnp.nan, ga)
  m1, m2, nan = jnp.linspace(-1.0, 1.0, 8), jnp.linspace(2.0, 0.5, 8), jnp.full(8, jnp.nan)

  @nnx.jit
  def feed(model, optimizer, mean, g, weight):  # what a training-mode forward pass and its gradient hand over
    model.bn.mean[...] = mean
    optimizer.update(model, g, weight=weight)

  windows = [
    [(m1, ga, 2.0), (nan, gnan, 0.0), (m2, gb, 5.0)],
    [(m1, ga, 4.0), (m2, gb, jnp.nan), (m2, gnan, -2.0)],
    [(nan, gnan, 0.0), (m2, ga, jnp.nan), (nan, gnan, 0.0)],
  ]
  pa, pb = nnx.as_pure(ga), nnx.as_pure(gb)
  expected = _adam_reference(params0, [jax.tree.map(lambda a, b: (2 * a + 5 * b) / 7, pa, pb), pa], 0.1)
  expected_mean = [(2 * m1 + 5 * m2) / 7, m1]
  for w, window in enumerate(windows):
    before = nnx.as_pure(nnx.state((model, optimizer.opt_state.inner_state)))
    for mean, g, weight in window:
      feed(model, optimizer, mean, g, weight)
    if w < 2:
      chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.Param)), expected[w], rtol=RTOL, atol=1e-15)
      np.testing.assert_allclose(model.bn.mean[...], expected_mean[w], rtol=RTOL)
      np.testing.assert_allclose(model.bn.var[...], var0, rtol=RTOL)
      assert int(optimizer.step[...]) == w + 1
    else:
      chex.assert_trees_all_equal(nnx.as_pure(nnx.state((model, optimizer.opt_state.inner_state))), before)
      assert int(optimizer.step[...]) == 2
  opt_state = nnx.as_pure(optimizer.opt_state)
  assert int(opt_state.num_skipped) == 3 and int(opt_state.num_empty_windows) == 1
  assert int(optimizer.microbatches_seen[...]) == 9


def test_nnx_microbatches_seen_gives_each_microbatch_its_dropout_key():
  k, rng = 3, jax.random.PRNGKey(5)
  model = NNXModel(nnx.Rngs(0))
  optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.sgd(0.1), k), wrt=nnx.Param)
  drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))
  grads = nnx.grad(nnx_loss)(model, regression_data(jax.random.PRNGKey(1), 4))
  assert optimizer.microbatches_seen[...].dtype == jnp.int32

  @nnx.jit
  def step(model, optimizer, drop, grads):
    key = jax.random.fold_in(rng, optimizer.microbatches_seen[...])
    mask = drop(jnp.ones(64), rngs=nnx.Rngs(dropout=key)) != 0
    optimizer.update(model, grads)
    return mask

  masks = []
  for i in range(2 * k):
    masks.append(np.asarray(step(model, optimizer, drop, grads)).tobytes())
    assert int(optimizer.microbatches_seen[...]) == i + 1
  assert len(set(masks)) == 2 * k and int(optimizer.step[...]) == 2


def test_nnx_model_and_optimizer_can_be_donated_together():
  """No buffer of the optimizer is one of the model's (saved BatchStats, step): both donated at once."""
  model = NNXModel(nnx.Rngs(0), batchnorm=True)
  optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.adam(0.1), 2), wrt=nnx.Param)
  batch = regression_data(jax.random.PRNGKey(1), 4)

  def assert_distinct():
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.as_pure(nnx.state((model, optimizer))))]
    assert len(set(pointers)) == len(pointers)

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def step(model, optimizer, batch):
    optimizer.update(model, nnx.grad(nnx_loss)(model, batch), weight=2.0)

  assert_distinct()
  for _ in range(3):
    step(model, optimizer, batch)
    assert_distinct()
  assert int(optimizer.step[...]) == 1 and int(optimizer.microbatches_seen[...]) == 3


_MESH_DONATION_SCRIPT = textwrap.dedent("""
    import functools, jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxaccum as ja

    mesh = jax.make_mesh((8,), ("data",))
    replicate = lambda tree: jax.device_put(tree, NamedSharding(mesh, P()))
    params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    state = replicate(ja.flax.TrainState.create(apply_fn=None, params=params, tx=ja.accumulate(optax.adam(0.1), 2),
                                                batch_stats={"mean": jnp.zeros(2)}))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state):
      grads = jax.tree.map(jnp.ones_like, state.params)
      return state.apply_gradients(grads=grads, batch_stats={"mean": jnp.ones(2)}, weight=2.0), state.step + 1

    for _ in range(3):
      state, _ = step(state)
    assert int(state.step) == 1

    class M(nnx.Module):
      def __init__(self):
        self.lin = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
      def __call__(self, x):
        return self.bn(self.lin(x))

    model = M()
    optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.adam(0.1), 2), wrt=nnx.Param)
    graphdef, both = nnx.split((model, optimizer))
    both = replicate(both)

    @functools.partial(jax.jit, donate_argnums=0)
    def nnx_step(both, x):
      model, optimizer = nnx.merge(graphdef, both)
      optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
      return nnx.state((model, optimizer))

    for _ in range(3):
      both = nnx_step(both, jnp.arange(12.0).reshape(3, 4))
    assert int(nnx.merge(graphdef, both)[1].step[...]) == 1
    print("DONATED OK")
""")


def test_donation_with_the_state_replicated_on_an_8_device_mesh():
  """lm1b places the state on a mesh and donates it: a buffer shared inside the state crashed the
  process (segfault), hence a subprocess. TrainState, and nnx model + optimizer donated together."""
  out = subprocess.run([sys.executable, "-c", _MESH_DONATION_SCRIPT], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and "DONATED OK" in out.stdout, (out.returncode, out.stdout[-2000:], out.stderr[-4000:])


def test_accumulate_nested_inside_another_transformation_is_refused():
  """optax.chain(clip, ja.accumulate(adam, k)) clips per microbatch and hides the update count: refused,
  with the fix in the message; the fixed form is accepted."""
  params = {"w": jnp.ones(3)}
  model = NNXModel(nnx.Rngs(0))
  adam = optax.adam(1e-3)
  nested = optax.chain(optax.clip_by_global_norm(1.0), ja.accumulate(adam, 2))
  fix = r"ja\.accumulate\(optax\.chain\(optax\.clip_by_global_norm\(1\.0\), adam\), k\).*keras#19990"
  with pytest.raises(ValueError, match=r"opt_state\[1\].*" + fix):
    ja.flax.TrainState.create(apply_fn=None, params=params, tx=nested)
  with pytest.raises(ValueError, match=fix):
    ja.flax.AccumulatingOptimizer(model, nested, wrt=nnx.Param)
  with pytest.raises(ValueError, match=fix):  # however deep
    ja.flax.TrainState.create(apply_fn=None, params=params, tx=optax.chain(optax.chain(ja.accumulate(adam, 2))))
  fixed = ja.accumulate(optax.chain(optax.clip_by_global_norm(1.0), adam), 2)
  assert int(ja.flax.TrainState.create(apply_fn=None, params=params, tx=fixed).step) == 0
  assert int(ja.flax.AccumulatingOptimizer(model, fixed, wrt=nnx.Param).step[...]) == 0


def test_tx_none_or_an_uncalled_factory_is_refused():
  params = {"w": jnp.ones(3)}
  model = NNXModel(nnx.Rngs(0))
  for tx, pattern in ((None, r"tx=None: {}"), (optax.adam, r"tx=adam is a function \(an optax factory, not called")):
    with pytest.raises(TypeError, match=pattern.format("TrainState.create")):
      ja.flax.TrainState.create(apply_fn=None, params=params, tx=tx)
    with pytest.raises(TypeError, match=pattern.format("AccumulatingOptimizer")):
      ja.flax.AccumulatingOptimizer(model, tx, wrt=nnx.Param)


# --------------------------------------------------------------------------- own jit on an Explicit mesh (issue 19)

EXPLICIT_SIZES = (16, 40, 8, 24, 32, 16)  # multiples of the 8 devices, unequal, weighted by size


def _explicit_mesh():
  from jax.sharding import AxisType

  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def test_linen_trainstate_with_ja_grad_on_an_explicit_mesh():
  """ja.grad + TrainState(tx=ja.accumulate(..., axis_name='data')) in a plain jit: exact, one reduction per window."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxaccum import _hlo

  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  batches = microbatches(regression_data(jax.random.PRNGKey(1), sum(EXPLICIT_SIZES)), EXPLICIT_SIZES)
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.05, weight_decay=0.1))
  mesh = _explicit_mesh()
  with jax.set_mesh(mesh):
    state = ja.flax.TrainState.create(
      apply_fn=mlp_apply,
      params=jax.device_put(params, NamedSharding(mesh, P())),
      tx=ja.accumulate(inner, K, axis_name="data"),
    )

    @jax.jit
    def step(state, batch, weight):
      return state.apply_gradients(grads=ja.grad(mse_loss, axis_name="data")(state.params, batch), weight=weight)

    for batch in batches:
      state = step(state, jax.device_put(batch, NamedSharding(mesh, P("data"))), float(len(batch[0])))
    hlo = step.lower(state, jax.device_put(batches[0], NamedSharding(mesh, P("data"))), 1.0).compile().as_text()
  assert int(state.step) == 2 and int(state.micro_step) == 0
  assert {c.where for c in _hlo.collectives(hlo, 8)} == {"branch"}
  expected = reference_run(inner, params, mse_loss, batches)
  chex.assert_trees_all_close(state.params, expected, rtol=RTOL, atol=0)


def test_nnx_optimizer_with_ja_grad_on_an_explicit_mesh():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _explicit_mesh()
  batches = microbatches(regression_data(jax.random.PRNGKey(1), sum(EXPLICIT_SIZES)), EXPLICIT_SIZES)
  model = NNXModel(nnx.Rngs(0))
  graphdef, params0 = nnx.split(model, nnx.Param)
  params0 = nnx.as_pure(params0)
  pure = lambda p, batch: nnx_loss(nnx.merge(graphdef, p), batch)
  expected = reference_run(optax.adam(0.05), params0, pure, batches)  # plain, on one device
  with jax.set_mesh(mesh):
    nnx.update(model, jax.device_put(params0, NamedSharding(mesh, P())))
    optimizer = ja.flax.AccumulatingOptimizer(
      model, ja.accumulate(optax.adam(0.05), K, axis_name="data"), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, optimizer, batch, weight):
      grads = ja.grad(pure, axis_name="data")(nnx.state(model, nnx.Param), batch)
      optimizer.update(model, grads, weight=weight)

    for batch in batches:
      step(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))), float(len(batch[0])))
  assert int(optimizer.step[...]) == 2
  chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.Param)), expected, rtol=RTOL, atol=0)
