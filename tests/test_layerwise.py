"""jaxaccum._layerwise.layerwise: exact reduce-scattered gradients, each parameter gathered where it is used.

Against a plainly written full-batch `jax.grad` (float64, 8 simulated devices):
listed dense layers (with aux and a replicated leaf), a flax linen MLP, and
layers stacked and applied with `lax.scan`. Then the compiled HLO: no
all-gather of the whole tree, one per use of each weight forward and again
backward, one reduce-scatter per sharded leaf.

Faithful replay (issue #31): a parameter combined with constants (NumPy masks,
tables, projections, index arrays; tests/zoo/constant_models.py) through
`make_train_step` fsdp/hsdp exact against the plain step, and a differential
fuzzer (tests/_fuzz_programs.py): seeded random programs against plain
`jax.grad`, 16 in the default run, 400 (and 20 through `make_train_step`) in
the slow set.
"""

import re

import _fuzz_programs as _fuzz
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import smoke
from jax import lax
from jax.sharding import AxisType, PartitionSpec
from zoo import constant_models

import jaxaccum as ja
from jaxaccum import _hlo
from jaxaccum._layerwise import layerwise

P = 8
ROWS = 32  # 4 rows per device


def _mesh():
  return jax.make_mesh((P,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])


def _data(width=16, out=16):
  kx, ky = jax.random.split(jax.random.PRNGKey(7))
  return jax.random.normal(kx, (ROWS, width), jnp.float64), jax.random.normal(ky, (ROWS, out), jnp.float64)


def _pad(dims, flat):
  # The helper's own bookkeeping tolerates a wrong-length dims: layerwise itself must refuse it.
  dims = jax.tree.leaves(dims, is_leaf=lambda d: d is None)
  return (list(dims) + [0] * len(flat))[: len(flat)]


def _layerwise_grads(loss, params, specs, dims, x, y, has_aux=False):
  """Inside a shard_map over "data": value_and_grad of layerwise(loss); values and grads summed over devices."""
  f = layerwise(loss, dims, "data", P)

  def body(shards, x, y):
    value, g = jax.value_and_grad(f, has_aux=has_aux)(shards, x, y)
    # Replicated leaves (dim None) keep their local gradient: the caller sums them.
    flat, treedef = jax.tree.flatten(g)
    flat = [lax.psum(v, "data") if d is None else v for v, d in zip(flat, _pad(dims, flat), strict=True)]
    return lax.psum(value, "data"), jax.tree.unflatten(treedef, flat)

  def vary(shards):
    # Replicated leaves enter varying, so that their gradient stays local (no implicit psum).
    flat, treedef = jax.tree.flatten(shards)
    return jax.tree.unflatten(
      treedef,
      [lax.pcast(v, "data", to="varying") if d is None else v for v, d in zip(flat, _pad(dims, flat), strict=True)],
    )

  fn = jax.jit(
    jax.shard_map(
      lambda s, x, y: body(vary(s), x, y),
      mesh=_mesh(),
      in_specs=(specs, PartitionSpec("data"), PartitionSpec("data")),
      out_specs=(PartitionSpec(), specs),
      axis_names={"data"},
    )
  )
  return fn, fn(params, x, y)


def _full_batch(loss, params, x, y, has_aux=False):
  """The plain reference: the mean over devices of each device's loss on its 4 rows, one jax.grad."""

  def total(p):
    outs = [loss(p, x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]) for i in range(P)]
    return jax.tree.map(lambda *v: sum(v) / P, *outs)

  return jax.jit(jax.value_and_grad(total, has_aux=has_aux))(params)


def _assert_close(got, want, tol=1e-12):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape
    scale = max(np.max(np.abs(w)), 1e-30)
    assert np.max(np.abs(g - w)) / scale <= tol, (np.max(np.abs(g - w)) / scale, g.shape)


def _listed(key, sizes=(16, 16, 16, 16)):
  keys = jax.random.split(key, len(sizes))
  return [
    {"w": jax.random.normal(k, (m, n), jnp.float64) / np.sqrt(m), "b": jnp.full((n,), 0.1, jnp.float64)}
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=False)
  ]


def _listed_loss(params, x, y):
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  pred = x @ params[-1]["w"] + params[-1]["b"]
  return jnp.mean((pred - y) ** 2), jnp.max(pred)


def test_listed_layers_exact_with_aux_and_a_replicated_leaf():
  # The last layer is 16 -> 3: its bias (3,) has no dimension divisible by 8 and stays replicated;
  # its weight is sharded on dimension 0. The others on dimension 0 (the layout rule's tie-break).
  params = _listed(jax.random.PRNGKey(0), (16, 16, 16, 3))
  x, y = _data(16, 3)
  dims = [0, 0, 0, 0, None, 0]  # leaves: b0 w0 b1 w1 b2 w2
  specs = [{"b": PartitionSpec("data"), "w": PartitionSpec("data")} for _ in range(2)]
  specs.append({"b": PartitionSpec(), "w": PartitionSpec("data")})
  _, ((value, aux), grads) = _layerwise_grads(_listed_loss, params, specs, dims, x, y, has_aux=True)
  (want_value, want_aux), want = _full_batch(_listed_loss, params, x, y, has_aux=True)
  _assert_close(value / P, want_value)
  _assert_close(aux / P, want_aux)
  _assert_close(jax.tree.map(lambda g: g / P, grads), want)


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, param_dtype=jnp.float64)(x))
    # A rematerialised layer: its jax.checkpoint region is re-wrapped around the interpreted body.
    x = nn.relu(nn.remat(nn.Dense)(16, param_dtype=jnp.float64)(x))
    return nn.Dense(16, param_dtype=jnp.float64)(x)


def test_flax_linen_mlp_with_remat_exact():
  x, y = _data()
  model = _MLP()
  params = model.init(jax.random.PRNGKey(1), x[:1])

  def loss(p, x, y):
    return jnp.mean((model.apply(p, x) - y) ** 2)

  dims = [0] * len(jax.tree.leaves(params))
  specs = jax.tree.map(lambda _: PartitionSpec("data"), params)
  _, (value, grads) = _layerwise_grads(loss, params, specs, dims, x, y)
  want_value, want = _full_batch(loss, params, x, y)
  _assert_close(value / P, want_value)
  _assert_close(jax.tree.map(lambda g: g / P, grads), want)


def test_scanned_layers_exact():
  # Stacked (L, 16, 16) weights and (L, 16) biases applied with lax.scan, sharded on dimension 1.
  keys = jax.random.split(jax.random.PRNGKey(2), 2)
  params = {
    "w": jax.random.normal(keys[0], (3, 16, 16), jnp.float64) / 4.0,
    "b": 0.1 * jax.random.normal(keys[1], (3, 16), jnp.float64),
  }
  x, y = _data()

  def loss(p, x, y):
    h, _ = lax.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None), x, p)
    return jnp.mean((h - y) ** 2)

  specs = {"w": PartitionSpec(None, "data"), "b": PartitionSpec(None, "data")}
  fn, (value, grads) = _layerwise_grads(loss, params, specs, [1, 1], x, y)
  want_value, want = _full_batch(loss, params, x, y)
  _assert_close(value / P, want_value)
  _assert_close(jax.tree.map(lambda g: g / P, grads), want)
  # Gathered one layer per iteration, inside the loops: nothing gathered outside them.
  found = _hlo.collectives(fn.lower(params, x, y).compile().as_text(), num_devices=P)
  gathers = [c for c in found if c.opcode == "all-gather"]
  assert gathers and all(c.where == "loop" for c in gathers), [(c.where, c.result_bytes) for c in gathers]
  assert max(c.result_bytes for c in gathers) == 16 * 16 * 8  # one layer's weight, never the stack


def test_listed_layers_gather_one_layer_at_a_time():
  """Compiled HLO: per-layer all-gathers (forward, and again backward), one reduce-scatter per sharded leaf."""
  params = _listed(jax.random.PRNGKey(0))
  x, y = _data()
  specs = [{"b": PartitionSpec("data"), "w": PartitionSpec("data")} for _ in params]
  fn, _ = _layerwise_grads(lambda p, x, y: _listed_loss(p, x, y)[0], params, specs, [0] * 6, x, y)
  found = _hlo.collectives(fn.lower(params, x, y).compile().as_text(), num_devices=P)
  tree_bytes = sum(v.nbytes for v in jax.tree.leaves(params))
  w_bytes = 16 * 16 * 8
  gathers = [c.result_bytes for c in found if c.opcode == "all-gather"]
  # No gather of the tree (or of more than one leaf): every gathered array is one leaf.
  assert max(gathers) == w_bytes < tree_bytes, gathers
  # 3 weights gathered forward, and re-gathered backward where the input's cotangent needs them
  # (layers 1 and 2; layer 0's input is data): were the re-gather merged into the forward
  # gather (CSE), the gathered layers would all stay alive until the backward pass, and only 3 remain.
  assert gathers.count(w_bytes) == 5, gathers
  scatters = sorted(c.result_bytes for c in found if c.opcode == "reduce-scatter")
  assert scatters == [16 * 8 // P] * 3 + [w_bytes // P] * 3, scatters


def test_bad_arguments():
  with pytest.raises(TypeError, match="loss_fn"):
    layerwise(None, [0], "data", P)
  with pytest.raises(ValueError, match="size"):
    layerwise(_listed_loss, [0], "data", 0)
  with pytest.raises(ValueError, match="axis"):
    layerwise(_listed_loss, [0], "", P)
  with pytest.raises(ValueError, match="comm_dtype"):
    layerwise(_listed_loss, [0], "data", P, comm_dtype=jnp.int32)
  params = _listed(jax.random.PRNGKey(0))
  x, y = _data()
  specs = [{"b": PartitionSpec("data"), "w": PartitionSpec("data")} for _ in params]
  with pytest.raises(ValueError, match="dims"):
    _layerwise_grads(lambda p, x, y: _listed_loss(p, x, y)[0], params, specs, [0] * 5, x, y)
  with pytest.raises(ValueError, match=r"dims\[1\]=2"):
    _layerwise_grads(lambda p, x, y: _listed_loss(p, x, y)[0], params, specs, [0, 2, 0, 0, 0, 0], x, y)


def test_explicit_mesh_with_a_model_axis_exact():
  # An Explicit ("data", "model") mesh: the weights sharded over "data" on dimension 0 (the manual
  # axis, gathered layer by layer) and over "model" on dimension 1 (left to the partitioner).
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:8])
  params = _listed(jax.random.PRNGKey(3))
  x, y = _data()
  placed = [
    {
      "b": jax.device_put(p["b"], jax.NamedSharding(mesh, PartitionSpec("data"))),
      "w": jax.device_put(p["w"], jax.NamedSharding(mesh, PartitionSpec("data", "model"))),
    }
    for p in params
  ]
  batch = jax.device_put((x, y), jax.NamedSharding(mesh, PartitionSpec("data")))
  loss = lambda p, x, y: _listed_loss(p, x, y)[0]
  f = layerwise(loss, [0] * 6, "data", 4)

  def body(shards, x, y):
    value, g = jax.value_and_grad(f)(shards, x, y)
    return lax.psum(value, "data"), g

  specs = [{"b": PartitionSpec("data"), "w": PartitionSpec("data")} for _ in params]
  fn = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(specs, PartitionSpec("data"), PartitionSpec("data")),
      out_specs=(PartitionSpec(), specs),
      axis_names={"data"},
    )
  )
  value, grads = fn(placed, *batch)
  assert grads[0]["w"].sharding.spec == PartitionSpec("data", "model")

  def total(p):
    return sum(loss(p, x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]) for i in range(4)) / 4

  want_value, want = jax.value_and_grad(total)(params)
  _assert_close(value / 4, want_value)
  _assert_close(jax.tree.map(lambda g: g / 4, grads), want)


def test_keep_false_adds_exact_zeros_even_from_nan():
  """A device whose microbatch does not count (keep=False) adds exactly 0, though its loss is NaN."""
  params = _listed(jax.random.PRNGKey(4))
  x, y = _data()
  x = x.at[12:16].set(jnp.nan)  # device 3's rows
  loss = lambda p, x, y: _listed_loss(p, x, y)[0]
  f = layerwise(loss, [0] * 6, "data", P)

  def body(shards, x, y):
    keep = lax.axis_index("data") != 3
    w = keep.astype(x.dtype)
    return jax.grad(lambda s: w * f(s, x, y, keep=keep))(shards)

  specs = [{"b": PartitionSpec("data"), "w": PartitionSpec("data")} for _ in params]
  fn = jax.jit(
    jax.shard_map(
      body,
      mesh=_mesh(),
      in_specs=(specs, PartitionSpec("data"), PartitionSpec("data")),
      out_specs=specs,
      axis_names={"data"},
    )
  )
  grads = fn(params, x, y)
  want = jax.grad(lambda p: sum(loss(p, x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]) for i in range(P) if i != 3))(
    params
  )
  _assert_close(grads, want)


def test_comm_dtype_puts_the_gradients_on_the_wire_in_bfloat16():
  params = _listed(jax.random.PRNGKey(5))
  x, y = _data()
  loss = lambda p, x, y: _listed_loss(p, x, y)[0]
  f = layerwise(loss, [0] * 6, "data", P, comm_dtype=jnp.bfloat16)
  specs = [{"b": PartitionSpec("data"), "w": PartitionSpec("data")} for _ in params]
  fn = jax.jit(
    jax.shard_map(
      jax.grad(f),
      mesh=_mesh(),
      in_specs=(specs, PartitionSpec("data"), PartitionSpec("data")),
      out_specs=specs,
      axis_names={"data"},
    )
  )
  grads = fn(params, x, y)
  want = jax.grad(lambda p: sum(loss(p, x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]) for i in range(P)))(params)
  assert all(g.dtype == jnp.float64 for g in jax.tree.leaves(grads))
  _assert_close(grads, want, tol=2e-2)  # bfloat16 sums: close, not exact
  # What the program asks for (XLA CPU then widens bfloat16 reductions to float32 to compute them).
  text = fn.lower(params, x, y).as_text()
  scatters = re.findall(r'"stablehlo.reduce_scatter".*?\) -> tensor<([^>]*)>', text, flags=re.DOTALL)
  assert len(scatters) == 6 and all(t.endswith("bf16") for t in scatters), scatters


def test_lookup_tied_weights_scan_consts_cond_and_weight_decay_exact():
  """The interpreter's other paths: an embedding lookup (integer indices), the same weight used twice
  (tied), parameters closed over by a scan body (consts) and by a cond, a penalty on a parameter alone
  (a lazy chain of reductions), and a replicated leaf."""
  keys = jax.random.split(jax.random.PRNGKey(6), 3)
  params = {
    "emb": 0.3 * jax.random.normal(keys[0], (32, 16), jnp.float64),
    "odd": jnp.ones((3,), jnp.float64),
    "scale": jnp.full((16,), 1.1, jnp.float64),
    "w": 0.3 * jax.random.normal(keys[1], (16, 16), jnp.float64),
  }
  ids = jax.random.randint(keys[2], (ROWS, 5), 0, 32)
  y = jnp.zeros((ROWS,), jnp.float64)

  def loss(p, ids, y):
    h = p["emb"][ids].mean(1)
    h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ p["w"]) * p["scale"], None), h, None, length=2)
    h = lax.cond(h.sum() > 0, lambda h: h @ p["w"].T, lambda h: h - p["w"][0], h)
    logits = h @ p["emb"].T
    return jnp.mean(jax.nn.log_softmax(logits)[:, 0] + y) + jnp.sum(p["odd"] ** 2) + 0.01 * jnp.sum(p["w"] ** 2)

  dims = {"emb": 0, "odd": None, "scale": 0, "w": 0}
  specs = {
    "emb": PartitionSpec("data"),
    "odd": PartitionSpec(),
    "scale": PartitionSpec("data"),
    "w": PartitionSpec("data"),
  }
  _, (value, grads) = _layerwise_grads(loss, params, specs, dims, ids, y)
  want_value, want = _full_batch(loss, params, ids, y)
  _assert_close(value / P, want_value)
  _assert_close(jax.tree.map(lambda g: g / P, grads), want)


# --------------------------------------------------------------------------- faithful replay (issue #31)
# A parameter read in one operation with a constant (a NumPy mask, table, projection, index array) was
# replayed with the gathered parameter in place of the constant (`w * MASK` computed as `w * w`).


def _plain_step(loss, opt, params, batch):
  """The reference: one full-batch jax.grad and one optax update."""
  updates, _ = opt.update(jax.grad(loss)(params, batch), opt.init(params), params)
  return optax.apply_updates(params, updates)


def _fsdp_step(loss, opt, params, batch, strategy, k=2):
  """One make_train_step update (K microbatches, per-microbatch gather): fsdp on 8 devices, hsdp on (2, 4)."""
  if strategy == "hsdp":
    mesh = jax.make_mesh((2, 4), ("replica", "data"), axis_types=(AxisType.Auto,) * 2)
    data_axis = ("replica", "data")
  else:
    mesh, data_axis = _mesh(), "data"
  step = ja.make_train_step(
    loss, opt, num_microbatches=k, mesh=mesh, data_axis=data_axis, strategy=strategy,
    fsdp_gather="per_microbatch", donate=False,
  )  # fmt: skip
  p, opt_state = ja.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=data_axis)
  # The weights are sharded: the layerwise interpreter is what runs them.
  assert any("data" in str(x.sharding.spec) for x in jax.tree.leaves(p))
  p, _, metrics = step(p, opt_state, ja.shard_batch(batch, mesh, data_axis))
  assert bool(metrics["applied"])
  return p


def _all_cases():
  """Every case of tests/zoo/constant_models.py side by side on its own parameters: one compile."""
  cases = constant_models.CASES
  params = {m.name: m.init(jax.random.PRNGKey(i)) for i, m in enumerate(cases)}
  batch = {m.name: m.batch(jax.random.PRNGKey(100 + i), 32) for i, m in enumerate(cases)}
  return params, batch, lambda p, b: sum(m.loss(p[m.name], b[m.name]) for m in cases)


@pytest.mark.parametrize("strategy", smoke(["fsdp", "hsdp"], {"fsdp"}))
def test_numpy_constants_through_the_fsdp_step_exact(strategy):
  """Every constant case at once (fixed mask, positional table, projection, NumPy index array,
  jnp.asarray inside the loss, constants in a scan body, a scan input scaled by a constant, where on a
  NumPy boolean mask, pad of a weight, a wide projection): exact against the plain step. On e619e36 the
  masks, tables and projections computed `w * w`, `pos + pos`, `w @ w`, and where/pad/wide raised."""
  params, batch, loss = _all_cases()
  opt = optax.sgd(0.3, momentum=0.9)
  got = _fsdp_step(loss, opt, params, batch, strategy)
  want = _plain_step(loss, opt, params, batch)
  for name in params:
    _assert_close(got[name], want[name], tol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
@pytest.mark.parametrize("model", constant_models.CASES, ids=lambda m: m.name)
def test_each_numpy_constant_case_exact(model, strategy):
  params, batch = model.init(jax.random.PRNGKey(0)), model.batch(jax.random.PRNGKey(1), 32)
  opt = optax.sgd(0.3, momentum=0.9)
  _assert_close(
    _fsdp_step(model.loss, opt, params, batch, strategy), _plain_step(model.loss, opt, params, batch), 1e-10
  )


# --------------------------------------------------------------------------- the differential fuzzer
# Seeded random programs (tests/_fuzz_programs.py: what model code does with parameters and constants)
# through layerwise inside the step's untyped shard_map, against plain jax.grad in float64. A failure
# names each failing program's seed, operations and sharded dimensions.
FUZZ_DEFAULT = range(8)  # one compile of 8 programs side by side
FUZZ_SLOW = range(8, 416)


def test_fuzz_small_set_exact():
  errs = _fuzz.errors([_fuzz.program(s) for s in FUZZ_DEFAULT])
  assert not errs, "\n".join(errs)


@pytest.mark.slow
@pytest.mark.parametrize("start", FUZZ_SLOW[::20])
def test_fuzz_large_set_exact(start):
  errs = _fuzz.errors([_fuzz.program(s) for s in range(start, start + 20)])
  assert not errs, "\n".join(errs)


@pytest.mark.slow
def test_fuzz_under_check_vma_exact():
  """The same programs in a typed shard_map (check_vma=True: JAX pvary's each constant into a traced value)."""
  errs = _fuzz.errors([_fuzz.program(s) for s in range(16)], check_vma=True)
  assert not errs, "\n".join(errs)


def test_whole_leaf_fallbacks_reported_per_model_form():
  """The bench's fallback table (traced, not compiled): which equations keep a whole gathered leaf alive."""
  from jaxaccum.bench import fsdp

  found = {r["model"]: {(prim, n) for prim, _, n in r["fallbacks"]} for r in fsdp.fallback_table()}
  assert found == {
    "listed layers": set(),
    "a NumPy mask on a weight": set(),
    "layers stacked, lax.scan, sharded within a layer": set(),
    "layers stacked, lax.scan, sharded on the layer axis": {("scan", 2)},  # w and b, gathered before the loop
    "a parameter as a scan's carry": {("scan", 1)},
    "a fori_loop with a traced trip count": {("while", 1)},
    'a nested shard_map over "model"': {("shard_map", 1)},
  }


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_fuzz_through_make_train_step_exact(strategy):
  """20 fuzz programs side by side through make_train_step (the layout rule picks each leaf's dimension),
  one microbatch per device: the update of plain SGD(1) is the mean of the 8 devices' gradients (compared
  as parameters, rtol 1e-10: `p - new` would lose the digits of a gradient far below the parameter)."""
  params, _, loss = _fuzz.combined([_fuzz.program(s) for s in range(500, 520)])
  x, y = _fuzz.data(1)
  _, want = _fuzz.reference_value_and_grad(loss, params, x, y)
  got = _fsdp_step(lambda p, b: loss(p, b["x"], b["y"]), optax.sgd(1.0), params, {"x": x, "y": y}, strategy, k=1)
  want = jax.tree.map(lambda p, g: p - g, params, want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-12)


def test_constant_masks_and_indices_stay_layerwise():
  """`where(np_mask, w, 0.0)` and `w[np_idx] * MASK`: the constants built in the trace (the broadcast 0.0,
  the normalised indices) stay constants, so the weight is gathered at its matmul and re-gathered backwards,
  not gathered once and held from the forward pass to the backward one (5 gathers, not 3)."""
  mask = np.arange(256).reshape(16, 16) % 3 != 0
  perm = np.random.default_rng(0).permutation(16)
  params = _listed(jax.random.PRNGKey(8))[:3]
  x, y = _data()

  def loss(p, x, y):
    h = jnp.tanh(x @ p[0]["w"] + p[0]["b"])
    h = jnp.tanh(h @ jnp.where(mask, p[1]["w"], 0.0) + p[1]["b"])
    return jnp.mean((h @ (p[2]["w"][perm] * mask) + p[2]["b"] - y) ** 2)

  specs = [{"b": PartitionSpec("data"), "w": PartitionSpec("data")} for _ in params]
  fn, (value, grads) = _layerwise_grads(loss, params, specs, [0] * 6, x, y)
  want_value, want = _full_batch(loss, params, x, y)
  _assert_close(jax.tree.map(lambda g: g / P, grads), want)
  found = _hlo.collectives(fn.lower(params, x, y).compile().as_text(), num_devices=P)
  gathers = [c.result_bytes for c in found if c.opcode == "all-gather"]
  assert gathers.count(16 * 16 * 8) == 5, gathers


def test_a_call_equation_is_evaluated_through_layer_by_layer():
  """A loss holding a call equation (what `jax.extend`'s `closed_call_p` binds, named "eval_jaxpr" from jax
  0.11) is evaluated through, as a jit equation is: exact, and each leaf gathered where its layer uses it and
  again backwards (5 weight gathers, 3 bias gathers), not gathered all together around the call (6 and 6)."""
  from jax.extend.core import primitives

  params = _listed(jax.random.PRNGKey(9))
  x, y = _data()

  def called(loss):
    def wrapped(p, x, y):
      closed = jax.make_jaxpr(loss)(p, x, y)
      params = primitives.closed_call_p.get_bind_params({"call_jaxpr": closed})
      (out,) = primitives.closed_call_p.bind(*jax.tree.leaves((p, x, y)), **params)
      return out

    return wrapped

  loss = lambda p, x, y: _listed_loss(p, x, y)[0]
  specs = [{"b": PartitionSpec("data"), "w": PartitionSpec("data")} for _ in params]
  fn, (_, grads) = _layerwise_grads(called(loss), params, specs, [0] * 6, x, y)
  _, want = _full_batch(loss, params, x, y)
  _assert_close(jax.tree.map(lambda g: g / P, grads), want)
  found = _hlo.collectives(fn.lower(params, x, y).compile().as_text(), num_devices=P)
  gathers = [c.result_bytes for c in found if c.opcode == "all-gather"]
  assert max(gathers) == 16 * 16 * 8, gathers
  assert gathers.count(16 * 16 * 8) == 5, gathers
  assert gathers.count(16 * 8) == 3, gathers
