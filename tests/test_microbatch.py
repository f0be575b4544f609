"""microbatch(): float64 exactness vs the whole batch, weights, keys, axis_name, HLO, bad input."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_init, mse_loss, regression_data
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo
from jaxaccum.microbatch import pad_microbatches

RTOL = 1e-12


def aux_loss(params, batch):
  """Mean loss plus, as aux, per-row means (so the full-batch aux is their mean too)."""
  x, y = batch
  pred = mlp_apply(params, x)
  loss = jnp.mean(jnp.sum((pred - y) ** 2, axis=-1))
  return loss, {"mean_pred": jnp.mean(pred, axis=0), "mean_abs_x": jnp.mean(jnp.abs(x))}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_equals_full_batch_with_aux(problem, k):
  params, _, data = problem
  expected = jax.value_and_grad(aux_loss, has_aux=True)(params, data)
  fun = jax.jit(ja.microbatch(jax.value_and_grad(aux_loss, has_aux=True), k))
  chex.assert_trees_all_close(fun(params, data), expected, rtol=RTOL, atol=0)


def test_strided_microbatches(problem):
  """Microbatch i is rows i, i+K, ...: visible through a function of the rows themselves."""
  params, _, (x, y) = problem
  k = 4
  # The max over a microbatch's rows is not linear, so the mean of maxima reveals the split.
  fun = ja.microbatch(lambda p, b: jnp.max(b[0][:, 0]), k)
  expected = np.mean([np.max(np.asarray(x)[i::k, 0]) for i in range(k)])
  np.testing.assert_allclose(fun(params, (x, y)), expected, rtol=RTOL)


def masked_loss(params, batch):
  err = jnp.sum((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
  return jnp.sum(batch["mask"] * err) / jnp.sum(batch["mask"])


def test_masked_batch_with_weights(problem):
  """Padding rows spread unevenly over microbatches; weights = real rows per microbatch."""
  params, _, (x, y) = problem
  n = x.shape[0]
  mask = np.ones(n)
  mask[[0, 4, 8, 12, 16, 1, 50, 77, 99]] = 0.0  # microbatch 0 (of 4) loses 5 rows, others fewer
  batch = {"x": x, "y": y, "mask": jnp.asarray(mask)}
  real = mask == 1
  expected = jax.value_and_grad(mse_loss)(params, (x[real], y[real]))
  fun = jax.jit(ja.microbatch(jax.value_and_grad(masked_loss), 4, weight_fn=lambda b: jnp.sum(b["mask"])))
  chex.assert_trees_all_close(fun(params, batch), expected, rtol=RTOL, atol=0)
  # Without the weights it is a mean of means: measurably wrong (so the test above can fail).
  unweighted = jax.jit(ja.microbatch(jax.value_and_grad(masked_loss), 4))(params, batch)
  assert abs(float(unweighted[0] - expected[0])) > 1e-6 * abs(float(expected[0]))


def test_several_batch_args_and_key(problem):
  params, _, (x, y) = problem
  key = jax.random.PRNGKey(7)
  k = 4

  def fun(p, xs, ys, key):
    noise = jax.random.uniform(key, ())
    return jnp.mean(xs) * noise + jnp.mean(ys)

  out = ja.microbatch(fun, k, batch_argnums=(1, 2), key_argnum=-1)(params, x, y, key)
  xs, ys = np.asarray(x), np.asarray(y)
  expected = np.mean(
    [
      np.mean(xs[i::k]) * float(jax.random.uniform(jax.random.fold_in(key, i), ())) + np.mean(ys[i::k])
      for i in range(k)
    ]
  )
  np.testing.assert_allclose(out, expected, rtol=RTOL)


def test_an_nnx_rngs_state_as_key_argnum_gives_each_microbatch_its_own_draws():
  """The nnx tutorial's dropout through ja.microbatch: the Rngs state from nnx.split named by key_argnum has its
  keys folded with the microbatch index (its count kept), as a single key is; left unnamed, every microbatch
  would draw the same masks (the mean then differs, so this test can fail)."""
  from flax import nnx

  graph, state = nnx.split(nnx.Rngs(dropout=3))
  state = nnx.as_pure(state)  # plain arrays: merged into fresh Variables inside each trace
  x = jnp.arange(32.0).reshape(8, 4) / 7.0
  k = 4

  def fun(w, rng_state, xs):
    mask = jax.random.bernoulli(nnx.merge(graph, rng_state).dropout(), 0.5, xs.shape)
    return jnp.sum(mask * xs * w)

  got = ja.microbatch(jax.grad(fun), k, batch_argnums=2, key_argnum=1)(1.5, state, x)
  folded = lambda i: jax.tree.map(lambda a: jax.random.fold_in(a, i) if ja_is_key(a) else a, state)
  want = np.mean([jax.grad(fun)(1.5, folded(i), x[i::k]) for i in range(k)])
  np.testing.assert_allclose(got, want, rtol=RTOL)
  same = ja.microbatch(jax.grad(fun), k, batch_argnums=2)(1.5, state, x)
  assert abs(float(same) - float(want)) > 1e-3
  with pytest.raises(TypeError, match="key_argnum names an argument with no PRNG key"):
    ja.microbatch(jax.grad(fun), k, batch_argnums=2, key_argnum=0)({"a": 1.0, "b": 2.0}, state, x)


def test_every_key_of_a_key_tree_is_folded_raw_or_typed():
  """A tree of a typed key, a raw PRNGKey and a counter: both keys folded per microbatch, the counter kept.
  Before (issue 49), the raw key beside a typed one reached every microbatch unchanged (the same dropout mask in
  each), and a dict of raw keys was refused."""
  x = jnp.arange(32.0).reshape(8, 4) / 7.0
  k = 4
  keys = {"typed": jax.random.key(1), "raw": jax.random.PRNGKey(2), "count": jnp.uint32(5)}

  def fun(w, ks, xs):
    a = jax.random.uniform(ks["typed"], xs.shape)
    b = jax.random.uniform(ks["raw"], xs.shape)
    return jnp.sum(xs * w * a) + jnp.sum(xs * b) * ks["count"].astype(xs.dtype)

  got = ja.microbatch(fun, k, batch_argnums=2, key_argnum=1)(1.5, keys, x)
  fold = lambda i: {**keys, "typed": jax.random.fold_in(keys["typed"], i), "raw": jax.random.fold_in(keys["raw"], i)}
  want = np.mean([fun(1.5, fold(i), x[i::k]) for i in range(k)])
  np.testing.assert_allclose(got, want, rtol=RTOL)
  raw_only = {"a": jax.random.PRNGKey(3), "b": jax.random.PRNGKey(4)}
  g = lambda w, ks, xs: jnp.sum(xs * jax.random.uniform(ks["a"], xs.shape) * jax.random.normal(ks["b"], xs.shape))
  got = ja.microbatch(g, k, batch_argnums=2, key_argnum=1)(1.0, raw_only, x)
  want = np.mean([g(1.0, jax.tree.map(lambda r: jax.random.fold_in(r, i), raw_only), x[i::k]) for i in range(k)])
  np.testing.assert_allclose(got, want, rtol=RTOL)
  # A leaf that is neither a key nor a counter cannot be told from a key: refused by its path, never passed on.
  with pytest.raises(TypeError, match=r"key_argnum\['seed'\] is int32\[4\], beside PRNG keys"):
    ja.microbatch(fun, k, batch_argnums=2, key_argnum=1)(1.5, {**keys, "seed": jnp.arange(4, dtype=jnp.int32)}, x)


def ja_is_key(a) -> bool:
  return jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


def test_dtypes():
  """bf16 outputs come back bf16 but are summed in float32 (a bf16 sum of 64 terms would drift)."""
  x = jnp.arange(1, 257, dtype=jnp.float32) / 7.0
  fun = ja.microbatch(lambda _, b: jnp.mean(b).astype(jnp.bfloat16), 64, batch_argnums=1)
  out = fun(None, x)
  assert out.dtype == jnp.bfloat16
  ref = jnp.mean(x).astype(jnp.bfloat16)
  assert out == ref
  out64 = ja.microbatch(lambda _, b: jnp.mean(b), 8, accumulator_dtype=jnp.float64)(None, x)
  assert out64.dtype == jnp.float32


def test_axis_name_shard_map_weighted(problem):
  """Inside shard_map over 8 devices with unequal real rows per device: the global masked mean."""
  params, _, (x, y) = problem
  mesh = ja.data_mesh()
  mask = np.ones(x.shape[0])
  mask[:13] = 0.0  # device 0 (rows 0-14) keeps 2 real rows, the others all 15
  batch = {"x": x, "y": y, "mask": jnp.asarray(mask)}
  real = mask == 1
  expected = jax.value_and_grad(mse_loss)(params, (x[real], y[real]))

  def local(params, batch):
    params = lax.pcast(params, "data", to="varying")
    return ja.microbatch(jax.value_and_grad(masked_loss), 3, weight_fn=lambda b: jnp.sum(b["mask"]), axis_name="data")(
      params, batch
    )

  fun = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  chex.assert_trees_all_close(fun(params, batch), expected, rtol=RTOL, atol=0)
  hlo = fun.lower(params, batch).compile().as_text()
  assert _hlo.locate(hlo, "all-reduce") == {"top": 1}


def test_axis_name_pmap(problem):
  """Under pmap (no varying-axis typing): the same one all-reduce of (sum w g, sum w)."""
  params, _, (x, y) = problem
  n = 8
  expected = jax.value_and_grad(mse_loss)(params, (x, y))
  fun = jax.pmap(ja.microbatch(jax.value_and_grad(mse_loss), 5, axis_name="data"), axis_name="data", in_axes=(None, 0))
  out = fun(params, (x.reshape(n, -1, 3), y.reshape(n, -1, 2)))
  chex.assert_trees_all_close(jax.tree.map(lambda o: o[3], out), expected, rtol=RTOL, atol=0)


def test_axis_name_rejects_reduced_grads(problem):
  """The shard_map pitfall: grads w.r.t. invariant params are already summed over devices."""
  params, _, data = problem
  mesh = ja.data_mesh()
  fun = ja.microbatch(jax.value_and_grad(mse_loss), 3, axis_name="data")
  bad = jax.jit(jax.shard_map(fun, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  with pytest.raises(ValueError, match="pcast"):
    bad(params, data)


def test_axis_name_unbound(problem):
  params, _, data = problem
  with pytest.raises(ValueError, match="'nope'"):
    ja.microbatch(jax.value_and_grad(mse_loss), 2, axis_name="nope")(params, data)


def _big_copies(hlo_text: str, min_elements: int) -> list[str]:
  """Copy/transpose instructions producing at least `min_elements` elements."""
  found = []
  for m in re.finditer(r"= \w+\[([\d,]*)\]\S* (copy|transpose)\(", hlo_text):
    dims = [int(d) for d in m.group(1).split(",") if d]
    if math.prod(dims) >= min_elements:
      found.append(m.group(0))
  return found


def test_split_moves_no_data():
  """A batch sharded over 8 devices: no all-to-all, collective-permute or all-gather, no batch copy."""
  params = mlp_init(jax.random.PRNGKey(0), (5, 8, 2))
  data = regression_data(jax.random.PRNGKey(1), 320, d_in=5)  # 40 rows x 5 per device
  batch = ja.shard_batch(data, ja.data_mesh())
  hlo = jax.jit(ja.microbatch(jax.value_and_grad(mse_loss), 4)).lower(params, batch).compile().as_text()
  for op in ("all-to-all", "collective-permute", "all-gather"):
    assert _hlo.count(hlo, op) == 0, op
  assert _big_copies(hlo, 40 * 5) == []
  # The helper does see a transposed copy of the batch when one is made.
  transposed = jax.jit(lambda b: jnp.swapaxes(b.reshape(80, 4, 5), 0, 1) * 2.0)
  assert _big_copies(transposed.lower(data[0]).compile().as_text(), 40 * 5)


def test_bad_input(problem):
  params, _, data = problem  # 120 rows
  vg = jax.value_and_grad(mse_loss)
  with pytest.raises(ValueError, match=r"120.*num_microbatches=7"):
    ja.microbatch(vg, 7)(params, data)
  for bad in (0, -2):
    with pytest.raises(ValueError, match=f"num_microbatches={bad}"):
      ja.microbatch(vg, bad)
  for bad in (2.5, True, "4"):
    with pytest.raises(TypeError, match="num_microbatches="):
      ja.microbatch(vg, bad)
  with pytest.raises(ValueError, match="batch_argnums=5"):
    ja.microbatch(vg, 2, batch_argnums=5)(params, data)
  with pytest.raises(TypeError, match="batch_argnums="):
    ja.microbatch(vg, 2, batch_argnums="x")
  with pytest.raises(ValueError, match="key_argnum=1"):
    ja.microbatch(vg, 2, key_argnum=1)(params, data)
  with pytest.raises(ValueError, match="disagree"):
    ja.microbatch(vg, 2)(params, (data[0], data[1][:60]))
  counting = lambda p, b: (mse_loss(p, b), jnp.sum(b[0][:, 0] > 0))  # an int output has no exact mean
  for k in (1, 4):
    with pytest.raises(TypeError, match=r"output\[1\] has dtype int"):
      ja.microbatch(counting, k)(params, data)


# --------------------------------------------------------------------------- issue 11


def test_empty_batch_and_zero_weights(problem):
  """An empty batch is an error; all-zero weights: an error eagerly, outputs 0 (not NaN) and total 0 traced."""
  params, _, (x, y) = problem
  vg = jax.value_and_grad(masked_loss)
  with pytest.raises(ValueError, match=r"empty.*0 rows"):
    ja.microbatch(vg, 1)(params, {"x": x[:0], "y": y[:0], "mask": jnp.zeros(0)})
  batch = {"x": x, "y": y, "mask": jnp.zeros(x.shape[0])}  # all padding: each microbatch's loss is 0/0
  wfn = lambda b: jnp.sum(b["mask"])
  for k in (1, 4):
    with pytest.raises(ValueError, match="every microbatch has weight 0"):
      ja.microbatch(vg, k, weight_fn=wfn)(params, batch)
    (loss, grads), total = jax.jit(ja.microbatch(vg, k, weight_fn=wfn, return_total_weight=True))(params, batch)
    assert float(total) == 0.0
    assert float(loss) == 0.0
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))
  # A negative weight: an error eagerly, NaN total weight traced.
  neg = lambda b: jnp.sum(b["mask"]) - 100.0
  ones = dict(batch, mask=jnp.ones(x.shape[0]))
  with pytest.raises(ValueError, match="negative or non-finite weight"):
    ja.microbatch(vg, 4, weight_fn=neg)(params, ones)
  _, total = jax.jit(ja.microbatch(vg, 4, weight_fn=neg, return_total_weight=True))(params, ones)
  assert np.isnan(total)
  # The total weight, when there is one: the real rows.
  _, total = jax.jit(ja.microbatch(vg, 4, weight_fn=wfn, return_total_weight=True))(params, ones)
  assert float(total) == x.shape[0]


def test_total_weight_over_devices(problem):
  """With axis_name the total weight is global, and a zero-weight device adds nothing."""
  params, _, (x, y) = problem
  mask = np.ones(x.shape[0])
  mask[:15] = 0.0  # device 0's rows are all padding
  batch = {"x": x, "y": y, "mask": jnp.asarray(mask)}
  real = mask == 1
  expected = jax.value_and_grad(mse_loss)(params, (x[real], y[real]))

  def local(params, batch):
    params = lax.pcast(params, "data", to="varying")
    return ja.microbatch(
      jax.value_and_grad(masked_loss),
      3,
      weight_fn=lambda b: jnp.sum(b["mask"]),
      axis_name="data",
      return_total_weight=True,
    )(params, batch)

  fun = jax.jit(jax.shard_map(local, mesh=ja.data_mesh(), in_specs=(P(), P("data")), out_specs=P()))
  out, total = fun(params, batch)
  chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=0)
  assert float(total) == real.sum()


def test_integer_accumulator_dtype_refused():
  """An integer running sum truncates (1.72 -> 1.5): refused at construction, as accumulate does."""
  for dt in (jnp.int32, jnp.int8, jnp.bool_, "int32"):
    with pytest.raises(ValueError, match="accumulator_dtype="):
      ja.microbatch(lambda p, b: jnp.mean(b), 2, accumulator_dtype=dt)
  with pytest.raises(TypeError, match="accumulator_dtype='nope'"):
    ja.microbatch(lambda p, b: jnp.mean(b), 2, accumulator_dtype="nope")


def test_keyword_arguments_pass_through_unsplit(problem):
  params, _, (x, y) = problem

  def loss(p, batch, *, scale, offset=0.0):
    return scale * mse_loss(p, batch) + offset

  fun = ja.microbatch(jax.value_and_grad(loss), 4)
  out = fun(params, (x, y), scale=3.0, offset=jnp.ones(()))  # offset is an array: not split either
  expected = jax.value_and_grad(loss)(params, (x, y), scale=3.0, offset=1.0)
  chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=0)
  with pytest.raises(TypeError, match=r"fun\(p, batch, \*, scale, offset=0.0\) cannot be called.*'nope'"):
    fun(params, (x, y), scale=1.0, nope=2)


def test_python_float_output(problem):
  params, _, (x, y) = problem
  for k in (1, 4):
    out = ja.microbatch(lambda p, b: (mse_loss(p, b), 0.5), k)(params, (x, y))
    np.testing.assert_allclose(out[1], 0.5, rtol=RTOL)
    np.testing.assert_allclose(out[0], mse_loss(params, (x, y)), rtol=RTOL)


def test_construction_errors_name_the_value(problem):
  params, _, (x, y) = problem
  with pytest.raises(TypeError, match="fun=None must be callable"):
    ja.microbatch(None, 4)
  with pytest.raises(TypeError, match="weight_fn=3"):
    ja.microbatch(mse_loss, 4, weight_fn=3)
  with pytest.raises(TypeError, match="key_argnum=True"):
    ja.microbatch(mse_loss, 4, key_argnum=True)
  with pytest.raises(TypeError, match="batch_argnums=True"):
    ja.microbatch(mse_loss, 4, batch_argnums=True)
  with pytest.raises(TypeError, match="batch_argnums="):
    ja.microbatch(mse_loss, 4, batch_argnums=(1, np.bool_(True)))
  with pytest.raises(TypeError, match="return_total_weight=1"):
    ja.microbatch(mse_loss, 4, return_total_weight=1)
  # Leaf sizes are named as given, with the leaves.
  with pytest.raises(ValueError, match=r"batch\[0\] has 120 rows, batch\[1\] has 60 rows"):
    ja.microbatch(mse_loss, 2)(params, (x, y[:60]))


def test_closure_over_the_batch_is_named(problem):
  """Flax examples write `def loss(params): ... batch ...`: the error says to take the batch as an argument."""
  params, _, (x, y) = problem
  closed = lambda p: mse_loss(p, (x, y))
  with pytest.raises(TypeError, match=r"def loss\(params, batch\)"):
    ja.microbatch(jax.value_and_grad(closed), 4)(params, (x, y))
  # Taking a batch argument but ignoring it: every microbatch would see the whole batch.
  ignoring = lambda p, batch: mse_loss(p, (x, y))
  with pytest.raises(ValueError, match=r"do not depend on its batch.*def loss\(params, batch\)"):
    ja.microbatch(jax.value_and_grad(ignoring), 4)(params, (x, y))


# --------------------------------------------------------------------------- reductions (issue 13)

RED = {
  "loss": "mean",
  "grads": "mean",
  "sse": "sum",
  "count": "sum",
  "pred": "concat",
  "gnorm": "concat",
  "last": "last",
}


def reduced_outputs(params, batch):
  """One output per reduction: means, a float and an int sum, per-example rows, a scalar per microbatch, a last."""
  x, y = batch
  loss, grads = jax.value_and_grad(mse_loss)(params, batch)
  pred = mlp_apply(params, x)
  err = jnp.sum((pred - y) ** 2, axis=-1)
  return {
    "loss": loss,
    "grads": grads,
    "sse": jnp.sum(err),
    "count": jnp.sum(err > 0.5).astype(jnp.int32),
    "pred": pred,
    "gnorm": optax.tree.norm(grads),
    "last": x[:1, 0],
  }


def reduced_reference(params, x, y, k, devices=1):
  """Plain full-batch values; per-microbatch ones from rows i::k of each device's contiguous block."""
  x, y = np.asarray(x), np.asarray(y)
  full = jax.tree.map(np.asarray, reduced_outputs(params, (x, y)))
  rows = x.shape[0] // devices
  blocks = [(x[p * rows : (p + 1) * rows], y[p * rows : (p + 1) * rows]) for p in range(devices)]
  gnorms = [
    float(optax.tree.norm(jax.grad(mse_loss)(params, (bx[i::k], by[i::k])))) for bx, by in blocks for i in range(k)
  ]
  lasts = np.concatenate([bx[k - 1 :: k][:1, 0] for bx, _ in blocks])
  err = np.sum((full["pred"] - y) ** 2, axis=-1)
  return dict(full, sse=np.sum(err), count=np.int32(np.sum(err > 0.5)), gnorm=np.asarray(gnorms), last=lasts)


def assert_reduced(out, expected):
  assert out["count"].dtype == jnp.int32 and int(out["count"]) == int(expected["count"])
  assert out["count"] > 0 and out["count"] < 128  # the threshold splits the rows, so the sum means something
  rest = {n: v for n, v in out.items() if n != "count"}
  chex.assert_trees_all_close(rest, {n: expected[n] for n in rest}, rtol=RTOL, atol=1e-15)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_reductions_equal_full_batch(k):
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 128)
  out = jax.jit(ja.microbatch(reduced_outputs, k, reductions=RED))(params, (x, y))
  expected = reduced_reference(params, x, y, k)
  assert out["pred"].shape == (128, 2) and out["gnorm"].shape == (k,)
  assert_reduced(out, expected)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_reductions_over_8_devices(k):
  """shard_map over 8 devices: means/sums reduced, concat gathered in global row order, last per device."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 128)  # 16 rows per device
  mesh = ja.data_mesh()

  def local(params, batch):
    params = lax.pcast(params, "data", to="varying")
    return ja.microbatch(reduced_outputs, k, reductions=RED, axis_name="data")(params, batch)

  out_specs = {n: P("data") if n == "last" else P() for n in RED}
  fun = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=out_specs))
  out = fun(params, ja.shard_batch((x, y), mesh))
  expected = reduced_reference(params, x, y, k, devices=8)
  assert out["pred"].shape == (128, 2) and out["gnorm"].shape == (8 * k,) and out["last"].shape == (8,)
  assert_reduced(out, expected)
  hlo = fun.lower(params, ja.shard_batch((x, y), mesh)).compile().as_text()
  # Means, float sums and weights share one all-reduce; the int32 count needs its own.
  assert _hlo.count(hlo, "all-reduce") == 2


def test_concat_and_sum_under_pmap():
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 64)
  red = {"loss": "mean", "sse": "sum", "pred": "concat"}

  def fun(p, b):
    pred = mlp_apply(p, b[0])
    return {"loss": mse_loss(p, b), "sse": jnp.sum((pred - b[1]) ** 2), "pred": pred}

  out = jax.pmap(ja.microbatch(fun, 4, reductions=red, axis_name="data"), axis_name="data", in_axes=(None, 0))(
    params, (x.reshape(8, 8, 3), y.reshape(8, 8, 2))
  )
  pred = mlp_apply(params, x)
  chex.assert_trees_all_close(
    jax.tree.map(lambda o: o[5], out),
    {"loss": mse_loss(params, (x, y)), "sse": jnp.sum((pred - y) ** 2), "pred": pred},
    rtol=RTOL,
    atol=1e-15,
  )


def test_sum_skips_zero_weight_microbatches_concat_keeps_them():
  x = jnp.arange(16.0)
  w = jnp.asarray([0.0, 1.0, 1.0, 1.0] * 4)  # microbatch 0 (rows 0, 4, 8, 12) weighs 0

  def fun(_, b):
    return {
      "sum": jnp.sum(b["x"]) / jnp.sum(b["w"]) * 0 + jnp.sum(b["x"]),
      "nan": jnp.sum(b["x"]) / jnp.sum(b["w"]),
      "rows": b["x"],
    }

  out = ja.microbatch(
    fun, 4, weight_fn=lambda b: jnp.sum(b["w"]) > 0, reductions={"sum": "sum", "nan": "sum", "rows": "concat"}
  )(None, {"x": x, "w": w})
  kept = np.asarray([r for r in range(16) if r % 4])
  np.testing.assert_array_equal(out["sum"], np.sum(kept * 1.0))  # NaN of microbatch 0 (0/0) left out
  assert np.isfinite(out["nan"])
  np.testing.assert_array_equal(out["rows"], x)


def test_reductions_bad_input(problem):
  params, _, data = problem
  vg = jax.value_and_grad(mse_loss)
  with pytest.raises(ValueError, match=r"reductions='median' is not a reduction.*'mean', 'sum', 'concat', 'last'"):
    ja.microbatch(vg, 2, reductions="median")
  with pytest.raises(ValueError, match=r"reductions\[1\]=None is not a reduction"):
    ja.microbatch(vg, 2, reductions=("mean", None))
  with pytest.raises(ValueError, match=r"reductions=\('mean', 'mean', 'sum'\) is not a tree prefix of fun's outputs"):
    ja.microbatch(vg, 2, reductions=("mean", "mean", "sum"))(params, data)
  with pytest.raises(ValueError, match="is not a tree prefix"):
    ja.microbatch(vg, 2, reductions={"loss": "mean"})(params, data)
  counting = lambda p, b: {"loss": mse_loss(p, b), "n": jnp.sum(b[0][:, 0] > 0), "ok": jnp.all(b[0] < 9)}
  for k in (1, 4):
    with pytest.raises(TypeError, match=r"output\['n'\] has dtype int.*\"sum\" \(a count\)"):
      ja.microbatch(counting, k)(params, data)
    with pytest.raises(TypeError, match=r"output\['ok'\] has dtype bool, which has no sum"):
      ja.microbatch(counting, k, reductions={"loss": "mean", "n": "sum", "ok": "sum"})(params, data)
    out = ja.microbatch(counting, k, reductions={"loss": "mean", "n": "sum", "ok": "last"})(params, data)
    assert int(out["n"]) == int(jnp.sum(data[0][:, 0] > 0)) and out["ok"].dtype == jnp.bool_


# --------------------------------------------------------------------------- issue 14: skip_empty, pad_microbatches


def test_pad_microbatches_layout():
  """Microbatch j lands in device j % P, slot j // P: rows p m K + t K + i; the rest zeros, masked out."""
  m, k, p = 2, 3, 2
  mbs = [{"v": np.full((m, 2), j + 1.0), "t": np.arange(m) + 10 * j} for j in range(4)]
  batch, mask = pad_microbatches(mbs, k, num_devices=p)
  assert batch["v"].shape == (p * k * m, 2) and batch["t"].dtype == mbs[0]["t"].dtype and mask.dtype == np.bool_
  for j, mb in enumerate(mbs):
    dev, slot = j % p, j // p
    block = slice(dev * m * k, (dev + 1) * m * k)
    np.testing.assert_array_equal(batch["v"][block][slot::k], mb["v"])  # what microbatch() gives slot i
    np.testing.assert_array_equal(batch["t"][block][slot::k], mb["t"])
    assert mask[block][slot::k].all()
  assert mask.sum() == 4 * m and not batch["v"][~mask].any()
  with pytest.raises(ValueError, match=r"5 microbatches do not fit in num_devices=2 x num_microbatches=2 = 4"):
    pad_microbatches(mbs + mbs[:1], 2, num_devices=2)
  with pytest.raises(
    ValueError,
    match=r"microbatches\[1\]\['t'\] has shape \(3,\) and dtype int64 where "
    r"microbatches\[0\]\['t'\] has \(2,\)",
  ):
    pad_microbatches([mbs[0], {"v": np.ones((3, 2)), "t": np.arange(3)}], 2)
  with pytest.raises(ValueError, match="non-empty list"):
    pad_microbatches([], 2)
  with pytest.raises(ValueError, match=r"num_devices=0 must be an integer >= 1"):
    pad_microbatches(mbs, 2, num_devices=0)


def test_skip_empty_does_not_run_padding(problem):
  """fun runs once per real microbatch (counted by a host callback); padding's NaN outputs never appear."""
  params, _, (x, y) = problem
  k, m = 4, 5
  mbs = [{"x": np.asarray(x[j * m : (j + 1) * m]), "y": np.asarray(y[j * m : (j + 1) * m])} for j in range(4)]
  calls = []

  def fun(p, b):
    jax.debug.callback(lambda: calls.append(1))
    loss, grads = jax.value_and_grad(masked_loss)(p, b)  # 0/0 = NaN on an all-padding microbatch
    return loss, grads, b["x"] / b["mask"][:, None], b["x"][0, 0]

  f = jax.jit(
    ja.microbatch(
      fun, k, weight_fn=lambda b: jnp.sum(b["mask"]), skip_empty=True, reductions=("mean", "mean", "concat", "last")
    )
  )
  for n in (1, 3, 4):
    batch, mask = pad_microbatches(mbs[:n], k)
    batch["mask"] = mask.astype(np.float64)
    calls.clear()
    loss, grads, rows, last = jax.block_until_ready(f(params, batch))
    assert len(calls) == n
    expected = jax.value_and_grad(mse_loss)(params, (x[: n * m], y[: n * m]))
    chex.assert_trees_all_close((loss, grads), expected, rtol=RTOL, atol=1e-15)
    np.testing.assert_array_equal(rows, np.where(mask[:, None], batch["x"], 0.0))  # zeros, not NaN
    assert float(last) == float(mbs[n - 1]["x"][0, 0])  # the last microbatch that ran
  assert f._cache_size() == 1
  hlo = f.lower(params, batch).compile().as_text()
  assert _hlo.locate(hlo, "conditional") == {"loop": 1}
  # K = 1: a loop of one, skipped too (all padding: outputs 0, total weight 0).
  one = jax.jit(
    ja.microbatch(
      fun,
      1,
      weight_fn=lambda b: jnp.sum(b["mask"]),
      skip_empty=True,
      reductions=("mean", "mean", "concat", "last"),
      return_total_weight=True,
    )
  )
  calls.clear()
  (loss, grads, rows, _), total = jax.block_until_ready(one(params, dict(batch, mask=np.zeros(k * m))))
  assert not calls and float(total) == 0 and float(loss) == 0 and not np.asarray(rows).any()
  (loss, grads, _, _), total = one(params, dict(batch, mask=np.ones(k * m)))
  chex.assert_trees_all_close(
    (loss, grads), jax.value_and_grad(mse_loss)(params, (batch["x"], batch["y"])), rtol=RTOL, atol=1e-15
  )


def test_skip_empty_under_shard_map_and_pmap(problem):
  """Each device skips its own empty microbatches; one all-reduce after the loop, none inside."""
  params, _, (x, y) = problem
  k, m, n = 2, 3, 5  # devices 0-4 hold one real microbatch, devices 5-7 none
  mbs = [{"x": np.asarray(x[j * m : (j + 1) * m]), "y": np.asarray(y[j * m : (j + 1) * m])} for j in range(n)]
  batch, mask = pad_microbatches(mbs, k, num_devices=8)
  batch["mask"] = mask.astype(np.float64)
  expected = jax.value_and_grad(mse_loss)(params, (x[: n * m], y[: n * m]))
  wrap = lambda: ja.microbatch(
    jax.value_and_grad(masked_loss), k, weight_fn=lambda b: jnp.sum(b["mask"]), axis_name="data", skip_empty=True
  )

  def local(params, batch):
    return wrap()(lax.pcast(params, "data", to="varying"), batch)

  fun = jax.jit(jax.shard_map(local, mesh=ja.data_mesh(), in_specs=(P(), P("data")), out_specs=P()))
  chex.assert_trees_all_close(fun(params, batch), expected, rtol=RTOL, atol=1e-15)
  hlo = fun.lower(params, batch).compile().as_text()
  assert _hlo.locate(hlo, "all-reduce") == {"top": 1} and _hlo.locate(hlo, "conditional")["loop"] == 1
  out = jax.pmap(wrap(), axis_name="data", in_axes=(None, 0))(
    params, jax.tree.map(lambda a: a.reshape((8, -1) + a.shape[1:]), batch)
  )
  chex.assert_trees_all_close(jax.tree.map(lambda o: o[7], out), expected, rtol=RTOL, atol=1e-15)


def test_skip_empty_bad_input(problem):
  vg = jax.value_and_grad(masked_loss)
  with pytest.raises(ValueError, match=r"skip_empty=True needs a weight_fn"):
    ja.microbatch(vg, 2, skip_empty=True)
  with pytest.raises(TypeError, match=r"skip_empty='yes' must be a bool"):
    ja.microbatch(vg, 2, skip_empty="yes", weight_fn=lambda b: 1.0)


# --------------------------------------------------------------------------- argnames, in_axes, num_real_microbatches


def test_argnames_in_axes_and_num_real_equal_the_plain_computation(problem):
  """Batches by keyword and on another axis, and a run-time count of real microbatches, against plain jax."""
  params, _, (x, y) = problem
  vg = jax.value_and_grad(lambda p, *, xs, ys: mse_loss(p, (xs.T, ys)))
  # xs carries its rows on axis 1 (features first); ys on axis 0.
  want = jax.value_and_grad(mse_loss)(params, (x, y))
  got = ja.microbatch(vg, 4, batch_argnums=(), argnames=("xs", "ys"), in_axes=(1, 0))(params, xs=x.T, ys=y)
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=1e-15)

  # n of K=4 microbatches real (rows i, i+4, ... for i < n), n traced: one compile for every n.
  fun = jax.jit(
    lambda p, b, n: ja.microbatch(jax.value_and_grad(mse_loss), 4, num_real_microbatches=n, return_total_weight=True)(
      p, b
    )
  )
  for n in (1, 3):
    rows = np.asarray([r for r in range(120) if r % 4 < n])
    (loss, grads), total = fun(params, (x, y), jnp.int32(n))
    chex.assert_trees_all_close((loss, grads), jax.value_and_grad(mse_loss)(params, (x[rows], y[rows])), rtol=RTOL)
    assert float(total) == n
  assert fun._cache_size() == 1


def test_num_real_microbatches_does_not_run_the_rest(problem):
  params, _, data = problem
  calls = []

  def loss(p, b):
    jax.debug.callback(lambda: calls.append(1))
    return mse_loss(p, b)

  jax.block_until_ready(ja.microbatch(jax.value_and_grad(loss), 4, num_real_microbatches=2)(params, data))
  assert len(calls) == 2


def test_new_options_bad_input(problem):
  params, _, data = problem
  vg = jax.value_and_grad(mse_loss)
  with pytest.raises(TypeError, match=r"argnames=3"):
    ja.microbatch(vg, 2, argnames=3)
  with pytest.raises(TypeError, match=r"in_axes=\(0, 1\)"):
    ja.microbatch(vg, 2, in_axes=(0, 1))
  with pytest.raises(ValueError, match=r"num_real_microbatches=5 must be between 0 and num_microbatches=4"):
    ja.microbatch(vg, 4, num_real_microbatches=5)
  with pytest.raises(TypeError, match=r"num_real_microbatches=1.5"):
    ja.microbatch(vg, 4, num_real_microbatches=1.5)
  with pytest.raises(TypeError, match=r"argnames names 'batch'"):
    ja.microbatch(lambda p, *, batch: mse_loss(p, batch), 2, batch_argnums=(), argnames="batch")(params)
  with pytest.raises(ValueError, match=r"in_axes=2 is out of range"):
    ja.microbatch(vg, 2, in_axes=2)(params, data)


# --------------------------------------------------------------------------- issue 22: "concat"


def test_concat_with_a_leading_size_other_than_the_rows_is_refused(problem):
  """3 of a microbatch's 4 rows, or a per-microbatch vector, cannot be put in row order: named, not interleaved."""
  params, _, (x, y) = problem
  x, y = x[:32], y[:32]  # K=8: 4 rows per microbatch
  for name, out in (("three", lambda b: b[0][:3]), ("vector", lambda b: jnp.sum(b[0], axis=0))):
    fun = lambda p, b: {"loss": mse_loss(p, b), name: out(b)}
    with pytest.raises(ValueError, match=rf"output\['{name}'\] has shape .*\"concat\".* not the 4 rows"):
      ja.microbatch(fun, 8, reductions={"loss": "mean", name: "concat"})(params, (x, y))


def test_concat_on_an_explicit_mesh():
  """optax's sharding_test::test_microbatch_with_explicit_sharding: "concat" of a batch sharded over Explicit "data"."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 64)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P("data"))
    fun = ja.microbatch(
      lambda p, b: {"pred": mlp_apply(p, b), "m": jnp.mean(b)}, 4, reductions={"pred": "concat", "m": "mean"}
    )
    for call in (fun, jax.jit(fun)):
      out = call(params, xs)
      np.testing.assert_allclose(out["pred"], mlp_apply(params, x), rtol=RTOL)
      np.testing.assert_allclose(out["m"], jnp.mean(x), rtol=RTOL)
      assert out["pred"].sharding.spec[0] == "data"


# --------------------------------------------------------------------------- issue 25: in_axes, n = 0, rows per device


def test_negative_in_axes_count_from_the_end(problem):
  """in_axes=-1 is each leaf's last axis (as in jax.vmap): the weighted mean of the plain microbatches i::K."""
  params, _, (x, y) = problem
  vg = jax.value_and_grad(lambda p, *, xs, ys: mse_loss(p, (xs.T, ys)))
  real = lambda mbs: jnp.sum(mbs[0][0] > 0)  # rows of the microbatch whose first feature is positive: unequal weights
  ws = [float(np.sum(np.asarray(x[i::4, 0]) > 0)) for i in range(4)]
  parts = [jax.value_and_grad(mse_loss)(params, (x[i::4], y[i::4])) for i in range(4)]
  want = jax.tree.map(lambda *o: sum(w * a for w, a in zip(ws, o, strict=True)) / sum(ws), *parts)
  for axes in ((-1, 0), (1, -2), (-1, -2)):
    fun = ja.microbatch(vg, 4, batch_argnums=(), argnames=("xs", "ys"), in_axes=axes, weight_fn=real)
    for call in (fun, jax.jit(fun)):
      chex.assert_trees_all_close(call(params, xs=x.T, ys=y), want, rtol=RTOL, atol=1e-15)
  with pytest.raises(ValueError, match=r"in_axes=-3 is out of range for batch argument 0 of shape \(3, 120\)"):
    ja.microbatch(vg, 4, batch_argnums=(), argnames=("xs", "ys"), in_axes=(-3, 0))(params, xs=x.T, ys=y)
  with pytest.raises(ValueError, match=r"in_axes=2 is out of range for batch argument 1 of shape \(120, 2\)"):
    ja.microbatch(vg, 4, batch_argnums=(), argnames=("xs", "ys"), in_axes=(1, 2))(params, xs=x.T, ys=y)


def test_zero_real_microbatches_give_zeros_eagerly_as_under_jit_and_optax(problem):
  """num_real_microbatches=0 asks for nothing: zeros and total weight 0 in every mode, not the all-padding error."""
  params, _, data = problem
  zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
  optax_mean = optax.microbatching.microbatch(
    jax.value_and_grad(mse_loss), 1, 30, optax.microbatching.AccumulationType.MEAN, num_real_microbatches=0
  )
  chex.assert_trees_all_close(optax_mean(params, data), zeros, atol=0)
  for weight_fn in (None, lambda b: b[0].shape[0]):
    fun = ja.microbatch(
      jax.value_and_grad(mse_loss), 4, weight_fn=weight_fn, num_real_microbatches=0, return_total_weight=True
    )
    for call in (fun, jax.jit(fun)):
      out, total = call(params, data)
      chex.assert_trees_all_close(out, zeros, atol=0)
      assert float(total) == 0
  # Real microbatches that all weigh 0 are still the all-padding error eagerly (zeros under jit).
  with pytest.raises(ValueError, match=r"every microbatch has weight 0 \(weight_fn gave 0"):
    ja.microbatch(jax.value_and_grad(mse_loss), 4, weight_fn=lambda b: 0.0, num_real_microbatches=2)(params, data)


def test_rows_per_microbatch_not_divisible_by_the_devices_is_named():
  """A batch sharded over 8 Explicit devices: 64 rows / K=16 = 4 rows per microbatch cannot keep the sharding."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 64)
  named = r"num_microbatches=16 splits the batch's 64 rows into microbatches of 4 rows.* 8 devices of mesh axis 'data'"
  named += r".*divides the 8 rows per device \(e.g. num_microbatches=8\)"
  with jax.set_mesh(mesh):
    batch = (jax.device_put(x, P("data")), jax.device_put(y, P("data")))
    funs = (
      ja.microbatch(ja.grad(mse_loss, axis_name="data"), 16, axis_name="data"),
      ja.microbatch(jax.value_and_grad(mse_loss), 16),
      ja.micro_grad(mse_loss, num_microbatches=16),
      ja.micro_grad(mse_loss, microbatch_size=4),
    )
    for fun in funs:
      for call in (fun, jax.jit(fun)):
        with pytest.raises(ValueError, match=named):
          call(params, batch)
    with pytest.raises(ValueError, match=named):
      jax.jit(ja.micro_vmap(lambda r: mlp_apply(params, r), num_microbatches=16))(batch[0])
    # K=8 (1 row per device per microbatch) runs, and is the full batch's gradient.
    got = jax.jit(ja.microbatch(ja.grad(mse_loss, axis_name="data"), 8, axis_name="data"))(params, batch)
  chex.assert_trees_all_close(got, jax.grad(mse_loss)(params, (x, y)), rtol=RTOL)


def test_equinox_gradient_with_none_leaves_and_a_rows_sized_leaf_is_averaged():
  """Issue 38 (the Equinox way, exact at e619e36, then broken): eqx.filter_value_and_grad's gradient has None where
  the model has int, bool and function leaves, so it does not mirror the model; its (8, 3) weight, 8 being also a
  microbatch's rows, came back concatenated to (32, 3). The rule looks at whether a leaf follows the rows."""
  import equinox as eqx

  class Model(eqx.Module):
    linear: eqx.nn.Linear  # weight (8, 3): 8 = a microbatch's rows below
    head: jax.Array
    steps: int = 2
    use_bias: bool = True
    act: object = jnp.tanh

  model = Model(eqx.nn.Linear(3, 8, key=jax.random.PRNGKey(0), dtype=jnp.float64), jnp.ones((8,)) / 8)

  def loss(m, x, y):
    h = jax.vmap(m.linear)(x)
    for _ in range(m.steps):
      h = m.act(h) if m.use_bias else h
    return jnp.mean((h @ m.head - y) ** 2)

  x, y = jax.random.normal(jax.random.PRNGKey(1), (32, 3)), jax.random.normal(jax.random.PRNGKey(2), (32,))
  value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
  got_value, got = eqx.filter_jit(ja.microbatch(eqx.filter_value_and_grad(loss), 4, batch_argnums=(1, 2)))(model, x, y)
  np.testing.assert_allclose(got_value, value, rtol=1e-12)
  assert got.linear.weight.shape == (8, 3)
  chex.assert_trees_all_close(got, grads, rtol=1e-12, atol=1e-15)
  updated = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, got))  # "add got incompatible shapes" before
  assert updated.linear.weight.shape == (8, 3)


def test_nnx_tutorial_step_with_batchnorm_statistics_as_aux_inside_nnx_jit():
  """Issue 38: the Flax nnx MNIST tutorial's train step (BatchNorm + Dropout, nnx.jit) ported as the guide says,
  the batch statistics as aux, BatchNorm over as many features as a microbatch has rows. They came back
  concatenated, and the next forward pass failed inside the model ("cannot reshape ..."). Exact against the
  microbatches run one by one with jax.value_and_grad and averaged."""
  from flax import nnx

  features, k = 8, 4  # 32 rows, K=4: 8 rows per microbatch, as many as BatchNorm's features

  class Net(nnx.Module):
    def __init__(self, rngs):
      kw = dict(dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)
      self.linear = nnx.Linear(3, features, **kw)
      self.norm = nnx.BatchNorm(features, momentum=0.9, **kw)
      self.norm.mean, self.norm.var = (
        nnx.BatchStat(s[...].astype(jnp.float64)) for s in (self.norm.mean, self.norm.var)
      )
      self.dropout = nnx.Dropout(0.25)
      self.out = nnx.Linear(features, 2, **kw)

    def __call__(self, x, key):
      h = self.dropout(nnx.relu(self.norm(self.linear(x))), rngs=key)
      return self.out(h)

  model = Net(nnx.Rngs(0))
  graphdef, params0, stats0 = nnx.split(model, nnx.Param, nnx.BatchStat)
  params0, stats0 = jax.tree.map(jnp.copy, (params0, stats0))  # the model's own arrays change as it trains
  x, y = regression_data(jax.random.PRNGKey(3), 32, d_out=2)
  key = jax.random.key(7)

  def loss_with_stats(params, batch, key, stats):
    m = nnx.merge(graphdef, params, stats, copy=True)
    loss = jnp.mean((m(batch[0], key) - batch[1]) ** 2)
    return loss, nnx.state(m, nnx.BatchStat)

  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch, key):
    _, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    pure_loss_fn = lambda params, batch, key: loss_with_stats(params, batch, key, stats)  # the tutorial's closure
    grad_fn = ja.microbatch(jax.value_and_grad(pure_loss_fn, has_aux=True), k, key_argnum=2)
    (loss, new_stats), grads = grad_fn(params, batch, key)
    optimizer.update(model, grads)
    nnx.update(model, new_stats)
    return loss

  losses = [train_step(model, optimizer, (x, y), jax.random.fold_in(key, t)) for t in range(2)]

  params, stats = params0, stats0  # the reference: microbatch i = rows i, i+K, ..., key fold_in(key_t, i)
  for t in range(2):
    outs = [
      jax.value_and_grad(loss_with_stats, has_aux=True)(
        params, (x[i::k], y[i::k]), jax.random.fold_in(jax.random.fold_in(key, t), i), stats
      )
      for i in range(k)
    ]
    (loss, new_stats), grads = jax.tree.map(lambda *v: sum(v) / k, *outs)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    stats = new_stats
    np.testing.assert_allclose(losses[t], loss, rtol=1e-12)
  _, got_params, got_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  chex.assert_trees_all_close(got_params, params, rtol=1e-12, atol=1e-15)
  chex.assert_trees_all_close(got_stats, stats, rtol=1e-12, atol=1e-15)
