"""micro_grad()/micro_vmap(): float64 exactness vs a plain per-example loop, weights, 8 devices, optax's own tests."""

import unittest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_init, regression_data
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo

RTOL = 1e-12
CLIP = 0.5


def loss_with_pred(params, batch):
  """A mean over the rows (a batch of one per example with keep_batch_dim), the predictions as aux."""
  pred = mlp_apply(params, batch["x"])
  return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, axis=-1)), pred


def clip(grads):
  """Per-example clipping to norm CLIP, the DP-SGD transform."""
  norm = optax.tree.norm(grads)
  return jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / norm), grads)


def padded_batch(n, pad_rows):
  """n regression rows; the rows in `pad_rows` weigh 0 and hold NaN inputs (they must add nothing)."""
  x, y = regression_data(jax.random.PRNGKey(1), n)
  mask = np.ones(n)
  mask[list(pad_rows)] = 0.0
  x = np.where(mask[:, None] == 0, np.nan, np.asarray(x))
  return {"x": jnp.asarray(x), "y": y, "mask": jnp.asarray(mask)}


def plain_loop(params, batch):
  """The reference, written plainly: one jax.value_and_grad per row, clipped and summed in NumPy float64."""
  vg = jax.jit(jax.value_and_grad(loss_with_pred, has_aux=True))
  total = jax.tree.map(lambda p: np.zeros(p.shape, np.float64), params)
  values, norms, preds = [], [], []
  for r in range(batch["x"].shape[0]):
    if batch["mask"][r] == 0:  # padding: contributes nothing; its per-example outputs are zeros
      values.append(0.0)
      norms.append(0.0)
      preds.append(np.zeros((1, 2)))
      continue
    (value, pred), g = vg(params, jax.tree.map(lambda a: a[r : r + 1], batch))
    g = jax.tree.map(np.asarray, g)
    norm = np.sqrt(sum(np.sum(leaf**2) for leaf in jax.tree.leaves(g)))
    scale = min(1.0, CLIP / norm)
    total = jax.tree.map(lambda t, leaf: t + leaf * scale, total, g)
    values.append(float(value))
    norms.append(norm)
    preds.append(np.asarray(pred))
  return total, np.array(values), np.array(norms), np.stack(preds)


def assert_close(actual, expected, rtol=RTOL):
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(float(np.max(np.abs(b))), 1e-300)
    assert float(np.max(np.abs(a - b))) <= rtol * scale, (a, b)


def weight(example):
  return example["mask"].sum()


@pytest.mark.parametrize("k", [1, 4])
def test_clipped_sum_equals_plain_loop(k):
  """Clipped per-example sum, values, norms and aux in row order; padding rows (NaN inputs) add nothing.

  Rows 0, 4, 8, 12 are all of microbatch 0 when K=4 (rows i, i+K, ...): that microbatch is
  skipped whole; rows 5 and 14 are padding inside real microbatches.
  """
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  batch = padded_batch(16, (0, 4, 8, 12, 5, 14))
  grad_fn = ja.micro_grad(
    loss_with_pred,
    has_aux=True,
    num_microbatches=k,
    transform_fn=clip,
    metrics_fn=optax.tree.norm,
    weight_fn=weight,
  )
  grads, aux = jax.jit(grad_fn)(params, batch)
  total, values, norms, preds = plain_loop(params, batch)
  assert_close(grads, total)
  assert_close(aux.values, values)
  assert_close(aux.metrics, norms)
  assert_close(aux.aux, preds)
  assert isinstance(aux, ja.MicroGradAux) and aux.values.shape == (16,)


def test_eight_devices_one_reduction():
  """shard_map over 8 devices, K=4: the sum over every device's examples, one all-reduce, rows in global order."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  batch = padded_batch(64, (0, 8, 16, 24, 3, 40, 41, 42, 43, 44, 45, 46, 47, 63))  # device 5: all padding
  mesh = ja.data_mesh()
  grad_fn = ja.micro_grad(
    loss_with_pred,
    has_aux=True,
    num_microbatches=4,
    transform_fn=clip,
    metrics_fn=optax.tree.norm,
    weight_fn=weight,
    axis_name="data",
  )
  fun = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  sharded = ja.shard_batch(batch, mesh)
  grads, aux = fun(params, sharded)
  total, values, norms, preds = plain_loop(params, batch)
  assert_close(grads, total)
  assert_close(aux.values, values)
  assert_close(aux.metrics, norms)
  assert_close(aux.aux, preds)
  hlo = fun.lower(params, sharded).compile().as_text()
  assert _hlo.locate(hlo, "all-reduce") == {"top": 1}
  # The per-example outputs (values, norms, predictions) are gathered after the loop, one all-gather each.
  assert _hlo.locate(hlo, "all-gather") == {"top": 3}


def test_weights_scale_each_example_and_invalid_weights_never_pass():
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  batch = padded_batch(8, ())
  w = jnp.asarray([0.5, 2.0, 1.0, 0.0, 3.0, 1.0, 1.0, 0.25])
  batch["w"] = w
  vg = jax.grad(lambda p, b: loss_with_pred(p, b)[0])
  expected = jax.tree.map(
    lambda *gs: sum(float(w[r]) * np.asarray(g) for r, g in enumerate(gs)),
    *[vg(params, jax.tree.map(lambda a: a[r : r + 1], batch)) for r in range(8)],
  )
  grad_fn = ja.micro_grad(lambda p, b: loss_with_pred(p, b)[0], num_microbatches=2, weight_fn=lambda ex: ex["w"][0])
  grads, _ = grad_fn(params, batch)
  assert_close(grads, expected)
  bad = dict(batch, w=w.at[2].set(-1.0))
  with pytest.raises(ValueError, match="negative or non-finite weight"):
    grad_fn(params, bad)
  grads, _ = jax.jit(grad_fn)(params, bad)  # traced: nothing can raise, so the gradient says NaN
  assert all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(grads))
  # Every row padding: eagerly an error, under jit zero gradients (a sum over no examples).
  empty = dict(batch, w=jnp.zeros(8))
  with pytest.raises(ValueError, match="weight 0"):
    grad_fn(params, empty)
  grads, _ = jax.jit(grad_fn)(params, empty)
  assert all(bool(jnp.all(g == 0)) for g in jax.tree.leaves(grads))


def test_bad_arguments_are_named():
  loss = lambda p, b: jnp.sum(p * b)
  with pytest.raises(ValueError, match="argnums=1 and batch_argnums=1"):
    ja.micro_grad(loss, argnums=1)(1.0, jnp.ones(4))
  with pytest.raises(ValueError, match="not divisible by num_microbatches=3"):
    ja.micro_grad(loss, num_microbatches=3)(1.0, jnp.ones(4))
  with pytest.raises(ValueError, match="not divisible by microbatch_size=3"):
    ja.micro_grad(loss, microbatch_size=3)(1.0, jnp.ones(4))
  with pytest.raises(ValueError, match="not both"):
    ja.micro_grad(loss, num_microbatches=2, microbatch_size=2)
  with pytest.raises(TypeError, match="transform_fn"):
    ja.micro_grad(loss, transform_fn=3)
  with pytest.raises(ValueError, match="num_microbatches=0"):
    ja.micro_grad(loss, num_microbatches=0)
  with pytest.raises(ValueError, match="scalar weight per example"):
    ja.micro_grad(loss, weight_fn=lambda ex: ex)(1.0, jnp.ones(4))
  with pytest.raises(ValueError, match="reductions"):
    ja.micro_vmap(jnp.sum, reductions="last")
  with pytest.raises(ValueError, match="out_axes=1"):
    ja.micro_vmap(jnp.sum, out_axes=1)


@pytest.mark.parametrize("k", [1, 4])
def test_micro_vmap_equals_vmap(k):
  """concat/sum/mean (weighted) against jax.vmap followed by plain NumPy reductions."""
  x, y = regression_data(jax.random.PRNGKey(2), 16)
  w = np.arange(16.0) % 3  # rows of weight 0 among them
  fun = lambda x, y, s, *, z: {"c": x * s + z, "s": jnp.sum(x) * jnp.sum(y), "m": y * s}
  red = {"c": "concat", "s": "sum", "m": "mean"}
  mapped = jax.vmap(fun, in_axes=(0, 0, None))(x, y, 2.0, z=x)
  got = jax.jit(ja.micro_vmap(fun, (0, 0, None), num_microbatches=k, reductions=red))(x, y, 2.0, z=x)
  assert_close(got["c"], mapped["c"])
  assert_close(got["s"], np.sum(np.asarray(mapped["s"])))
  assert_close(got["m"], np.mean(np.asarray(mapped["m"]), axis=0))
  weighted = ja.micro_vmap(
    lambda x, w: {"c": x, "s": jnp.sum(x), "m": x}, num_microbatches=k, reductions=red, weight_fn=lambda ex: ex[1]
  )
  got = jax.jit(weighted)(x, jnp.asarray(w))
  xs = np.asarray(x)
  assert_close(got["c"], np.where(w[:, None] == 0, 0.0, xs))
  assert_close(got["s"], np.sum(w * xs.sum(-1)))
  assert_close(got["m"], (w[:, None] * xs).sum(0) / w.sum())


def test_keyword_batch_other_axis_and_real_microbatches_pass_through():
  """argnames, in_axes and num_real_microbatches reach ja.microbatch: the same sums as the plain layout."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 16)
  loss = lambda p, x, *, y: jnp.mean(jnp.sum((mlp_apply(p, x) - y) ** 2, axis=-1))
  plain = ja.micro_grad(loss, batch_argnums=1, argnames="y", num_microbatches=4, transform_fn=clip)
  grads, aux = plain(params, x, y=y)
  xt = jnp.swapaxes(x, 0, 1)  # examples on axis 1
  other = ja.micro_grad(
    lambda p, xt, *, y: loss(p, jnp.swapaxes(xt, 0, 1), y=y),
    argnames="y",
    in_axes=(1, 0),
    num_microbatches=4,
    transform_fn=clip,
  )
  assert_close(other(params, xt, y=y), (grads, aux))
  # Microbatches 0 and 1 of 4 (rows i, i+4, ...) only: rows with r % 4 < 2, read at run time.
  real = jax.jit(lambda p, n: ja.micro_grad(loss, argnames="y", num_microbatches=4, num_real_microbatches=n)(p, x, y=y))
  grads2, aux2 = real(params, jnp.int32(2))
  keep = np.arange(16) % 4 < 2
  expected, _ = ja.micro_grad(loss, argnames="y")(params, x[keep], y=y[keep])
  assert_close(grads2, expected)
  assert_close(aux2.values, np.where(keep, np.asarray(aux.values), 0.0))


def test_micro_vmap_over_8_devices():
  x, _ = regression_data(jax.random.PRNGKey(2), 64)
  red = {"c": "concat", "s": "sum", "m": "mean"}
  fun = ja.micro_vmap(
    lambda x: {"c": jnp.tanh(x), "s": jnp.sum(x), "m": x}, num_microbatches=2, reductions=red, axis_name="data"
  )
  mesh = ja.data_mesh()
  got = jax.jit(jax.shard_map(fun, mesh=mesh, in_specs=P("data"), out_specs=P()))(ja.shard_batch(x, mesh))
  xs = np.asarray(x)
  assert_close(got["c"], np.tanh(xs))
  assert_close(got["s"], xs.sum())
  assert_close(got["m"], xs.mean(0))


# --------------------------------------------------------------------------- optax's own tests, through an adapter
#
# optax/microbatching/_microbatching_test.py, unchanged, with its module global
# `microbatching` pointed at this adapter: optax's names and arguments mapped to
# jaxaccum's, nothing computed here but ja.microbatch's K from optax's microbatch_size.

_REDUCTION = {
  optax.microbatching.AccumulationType.SUM: "sum",
  optax.microbatching.AccumulationType.MEAN: "mean",
  optax.microbatching.AccumulationType.RUNNING_MEAN: "mean",
  optax.microbatching.AccumulationType.CONCAT: "concat",
}


def _reductions(accumulator):
  return jax.tree.map(_REDUCTION.__getitem__, accumulator)


class _Adapter:
  AccumulationType = optax.microbatching.AccumulationType

  @staticmethod
  def microbatch(fun, argnums, microbatch_size, accumulator=optax.microbatching.AccumulationType.SUM, **options):
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    argnames = options.get("argnames", ())
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    in_axes = options.get("in_axes", 0)

    def call(*args, **kwargs):
      # ja.microbatch takes the number of microbatches, optax the rows per microbatch.
      first = ([args[i] for i in argnums] + [kwargs[n] for n in argnames])[0]
      axis = in_axes if isinstance(in_axes, int) else in_axes[0]
      k = jax.tree.leaves(first)[0].shape[axis] // microbatch_size
      return ja.microbatch(fun, k, batch_argnums=argnums, reductions=_reductions(accumulator), **options)(
        *args, **kwargs
      )

    return call

  @staticmethod
  def micro_vmap(fun, in_axes=0, out_axes=0, *, accumulator=optax.microbatching.AccumulationType.CONCAT, **options):
    return ja.micro_vmap(fun, in_axes, out_axes, reductions=_reductions(accumulator), **options)

  @staticmethod
  def micro_grad(fun, has_aux=False, argnums=0, *, accumulator=optax.microbatching.AccumulationType.SUM, **options):
    if accumulator != optax.microbatching.AccumulationType.SUM:
      raise NotImplementedError("ja.micro_grad sums (optax's SUM accumulator)")
    return ja.micro_grad(fun, has_aux, argnums, **options)


# The optax tests of the features issue 21 asked for: micro_grad, micro_vmap, and ja.microbatch's argnames,
# in_axes and num_real_microbatches (the plain microbatch tests are in tests/test_microbatch.py's terms).
OPTAX_TESTS = [
  "test_micro_grad_basic0",  # keep_batch_dim False and True
  "test_micro_grad_basic1",
  "test_micro_grad_early_stopping",
  "test_vmap",
  "test_vmap_kwargs",
  "test_vmap_early_stopping",
  "test_early_stopping_concat",
  "test_dynamic_steps",
  "test_in_axes_invariant0",
  "test_in_axes_invariant1",
  "test_in_axes_invariant2",
  "test_in_axes_invariant3",
  "test_in_axes_with_argnames0",
  "test_in_axes_with_argnames1",
  "test_in_axes_with_argnames2",
  "test_in_axes_with_argnames3",
  "test_microbatch_with_kwargs",
  "test_argnums_argnames_invariant",
]
# Parameter 3 of these two is optax's CONCAT of a (4, 4) output that has no batch axis: optax stacks the
# per-microbatch blocks; ja.microbatch's "concat" puts rows back in the batch's order, so it refuses an
# output whose leading size is not the microbatch's rows (a ValueError saying so) rather than guess.
_REFUSED = {"test_in_axes_invariant3", "test_in_axes_with_argnames3"}


@pytest.mark.parametrize("name", OPTAX_TESTS)
def test_optax_microbatching_tests_through_adapter(name, monkeypatch):
  optax_tests = pytest.importorskip("optax.microbatching._microbatching_test")
  monkeypatch.setattr(optax_tests, "microbatching", _Adapter)
  result = unittest.TestResult()
  optax_tests.MicrobatchingTest(name).run(result)
  problems = "\n".join(text for _, text in result.failures + result.errors)
  assert result.testsRun == 1
  if name in _REFUSED:
    assert "cannot be put back in the batch's row order" in problems, problems
  else:
    assert not problems, problems


def test_adapter_is_faithful_to_optax():
  """The adapter's own check: optax's implementation passes the same selected tests (so they can fail)."""
  optax_tests = pytest.importorskip("optax.microbatching._microbatching_test")
  result = unittest.TestResult()
  for name in OPTAX_TESTS:
    optax_tests.MicrobatchingTest(name).run(result)
  assert result.testsRun == len(OPTAX_TESTS) and not result.failures and not result.errors


def test_negative_in_axes_and_zero_real_microbatches():
  """Issue 25: in_axes=-1 is each leaf's last axis (as in jax.vmap); num_real_microbatches=0 is zeros eagerly too."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 16)
  loss = lambda p, x, y: jnp.mean(jnp.sum((mlp_apply(p, x) - y) ** 2, axis=-1))
  grads, aux = ja.micro_grad(loss, batch_argnums=(1, 2), num_microbatches=4, transform_fn=clip)(params, x, y)
  plain = plain_loop(params, {"x": x, "y": y, "mask": np.ones(16)})
  assert_close(grads, plain[0])
  xt = jnp.swapaxes(x, 0, 1)  # examples on the last axis
  last = ja.micro_grad(
    lambda p, xt, y: loss(p, jnp.swapaxes(xt, 0, 1), y),
    batch_argnums=(1, 2),
    in_axes=(-1, -2),
    num_microbatches=4,
    transform_fn=clip,
  )
  for call in (last, jax.jit(last)):
    assert_close(call(params, xt, y), (grads, aux))
  mapped = jax.vmap(lambda r: mlp_apply(params, r))(x)
  vm = ja.micro_vmap(lambda c: mlp_apply(params, c), in_axes=-1, num_microbatches=4)
  assert_close(vm(xt), mapped)
  with pytest.raises(ValueError, match=r"in_axes=-3 is out of range for batch argument 0 of shape \(3, 16\)"):
    ja.micro_vmap(lambda c: c, in_axes=-3, num_microbatches=4)(xt)
  zero_grad = ja.micro_grad(loss, batch_argnums=(1, 2), num_microbatches=4, num_real_microbatches=0)
  zero_mean = ja.micro_vmap(lambda r: r, num_microbatches=4, reductions="mean", num_real_microbatches=0)
  for g, m in ((zero_grad, zero_mean), (jax.jit(zero_grad), jax.jit(zero_mean))):
    got, got_aux = g(params, x, y)
    assert_close(got, jax.tree.map(np.zeros_like, params), rtol=0)
    assert not np.any(np.asarray(got_aux.values))
    assert not np.any(np.asarray(m(x)))
