"""microbatch(): float64 exactness vs the whole batch, weights, keys, axis_name, HLO, bad input."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo
from conftest import mlp_apply, mlp_init, mse_loss, regression_data

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
  expected = np.mean([np.mean(xs[i::k]) * float(jax.random.uniform(jax.random.fold_in(key, i), ()))
                      + np.mean(ys[i::k]) for i in range(k)])
  np.testing.assert_allclose(out, expected, rtol=RTOL)


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
    return ja.microbatch(jax.value_and_grad(masked_loss), 3, weight_fn=lambda b: jnp.sum(b["mask"]),
                         axis_name="data")(params, batch)

  fun = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  chex.assert_trees_all_close(fun(params, batch), expected, rtol=RTOL, atol=0)
  hlo = fun.lower(params, batch).compile().as_text()
  assert _hlo.locate(hlo, "all-reduce") == {"top": 1}


def test_axis_name_pmap(problem):
  """Under pmap (no varying-axis typing): the same one all-reduce of (sum w g, sum w)."""
  params, _, (x, y) = problem
  n = 8
  expected = jax.value_and_grad(mse_loss)(params, (x, y))
  fun = jax.pmap(ja.microbatch(jax.value_and_grad(mse_loss), 5, axis_name="data"), axis_name="data",
                 in_axes=(None, 0))
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
    return ja.microbatch(jax.value_and_grad(masked_loss), 3, weight_fn=lambda b: jnp.sum(b["mask"]),
                         axis_name="data", return_total_weight=True)(params, batch)

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
