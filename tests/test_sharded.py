"""Sharded training (ddp, zero1, fsdp, hsdp): exactness against a plain full-batch step, layouts, HLO."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_init, mse_loss, regression_data
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo, sharded

SIZES = (3, 32, 16, 2)  # the last bias (2,) divides no axis: the replicated path runs beside the packed one
STEPS = 3
ROWS = 128  # divisible by 8 devices times K for every K used here

OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
  "lamb": lambda: optax.lamb(1e-2),
  "momentum": lambda: optax.sgd(1e-1, momentum=0.9),
  "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
}


def data_mesh(kind=AxisType.Auto):
  return jax.make_mesh((8,), ("data",), axis_types=(kind,))


def hsdp_mesh(kind=AxisType.Auto):
  return jax.make_mesh((2, 4), ("rep", "shard"), axis_types=(kind, kind))


_full_grad = jax.jit(jax.value_and_grad(mse_loss))


def reference(opt, params, batch):
  """The single-device full-batch step, written plainly with jax and optax."""
  state = opt.init(params)
  losses = []
  for _ in range(STEPS):
    loss, grads = _full_grad(params, batch)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(loss)
  return params, jnp.stack(losses)


def run(strategy, opt, k, mesh, axes, params=None, **options):
  """STEPS sharded steps; returns (params, opt_state, losses, compiled HLO text)."""
  params = mlp_init(jax.random.PRNGKey(0), SIZES) if params is None else params
  batch = regression_data(jax.random.PRNGKey(1), ROWS)
  p, s = sharded.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=axes)
  step = ja.make_train_step(mse_loss, opt, strategy=strategy, mesh=mesh, data_axis=axes, num_microbatches=k, **options)
  placed = jax.device_put(batch, NamedSharding(mesh, P(axes)))
  compiled = step.lower(p, s, placed).compile()
  losses = []
  for _ in range(STEPS):
    p, s, metrics = compiled(p, s, placed, None)
    losses.append(metrics["loss"])
  return p, s, jnp.stack(losses), compiled.as_text()


def assert_exact(opt, got_params, got_losses, params=None):
  params = mlp_init(jax.random.PRNGKey(0), SIZES) if params is None else params
  want, want_losses = reference(opt, params, regression_data(jax.random.PRNGKey(1), ROWS))
  chex.assert_trees_all_close(jax.device_get(got_params), want, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-12)


def nbytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def device_bytes(tree, device):
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def by_opcode(hlo, opcode):
  return [c for c in _hlo.collectives(hlo, num_devices=8) if c.opcode == opcode]


def params_bytes():
  return nbytes(mlp_init(jax.random.PRNGKey(0), SIZES))


# --------------------------------------------------------------------------- zero1


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero1_equals_full_batch_and_communicates_one_all_reduce_worth(name):
  opt = OPTIMIZERS[name]()
  p, s, losses, hlo = run("zero1", opt, 4, data_mesh(), "data")
  assert_exact(opt, p, losses)
  for x in jax.tree.leaves(p):
    assert x.sharding.is_fully_replicated
  # Local accumulation: nothing in the loop; one packed reduce-scatter and one all-gather per step.
  # lamb's and clip's scalar norms are all-reduced inside the update's branch: it runs only when applied.
  found = _hlo.collectives(hlo, num_devices=8)
  assert [c for c in found if c.where == "loop"] == []
  assert all(c.operand_bytes <= 8 * 32 for c in found if c.where == "branch")  # scalars only
  assert [c.where for c in by_opcode(hlo, "reduce-scatter")] == ["top"]
  assert [c.where for c in by_opcode(hlo, "all-gather")] == ["top"]
  # Bytes one device sends (ring): the reduce-scatter and the all-gather together are one
  # all-reduce of the parameters, 2 (P-1)/P N; scalars (weight, loss, global norms) aside.
  ideal = 2 * 7 / 8 * params_bytes()
  scalars = 2 * 7 / 8 * 8 * 32  # up to 32 float64 scalars: lamb has 2 norms per leaf
  assert sum(c.ring_bytes for c in found) <= ideal + scalars
  assert sum(c.operand_bytes for c in found) <= ideal + scalars


def test_zero1_k1_sends_comm_dtype():
  opt = optax.adam(1e-2)
  p, _, losses, hlo = run("zero1", opt, 1, data_mesh(), "data", comm_dtype=jnp.float32)
  (rs,) = by_opcode(hlo, "reduce-scatter")
  assert rs.where == "top"
  packed = params_bytes() - 2 * 8  # all but the replicated (2,) bias, in float64
  assert rs.operand_bytes == packed // 2  # float32 on the wire
  # Accumulation stays float64; only the wire rounds to float32.
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  want, _ = reference(opt, params, regression_data(jax.random.PRNGKey(1), ROWS))
  chex.assert_trees_all_close(jax.device_get(p), want, rtol=1e-5, atol=1e-7)
  assert jax.tree.leaves(p)[0].dtype == jnp.float64


# --------------------------------------------------------------------------- fsdp


@pytest.mark.parametrize(
  "k, gather, name", [(1, "per_microbatch", "adam"), (4, "per_microbatch", "lamb"), (4, "once", "clip_adam")]
)
def test_fsdp_equals_full_batch_and_gathers_as_asked(k, gather, name):
  opt = OPTIMIZERS[name]()
  p, s, losses, hlo = run("fsdp", opt, k, data_mesh(), "data", fsdp_gather=gather)
  assert_exact(opt, p, losses)
  assert p[1]["w"].sharding.spec == P("data")  # (32, 16): its largest dimension
  assert p[0]["w"].sharding.spec == P(None, "data")  # (3, 32)
  gathers, scatters = by_opcode(hlo, "all-gather"), by_opcode(hlo, "reduce-scatter")
  expect = "loop" if (gather == "per_microbatch" and k > 1) else "top"
  if gather == "once":  # comm-lean: the whole tree gathered and reduce-scattered once per step (packed)
    assert len(gathers) == len(scatters) == 1
    assert gathers[0].where == scatters[0].where == "top"
  else:
    # Memory-lean: layer by layer, inside the microbatch loop. Each sharded leaf is gathered where
    # it is used (forward, and again for the backward pass where a cotangent needs it) and its
    # gradient reduce-scattered as soon as it exists: one reduce-scatter per sharded leaf, and no
    # gather larger than one leaf (the whole tree is never gathered at once).
    sharded_leaves = [x for x in jax.tree.leaves(p) if not x.sharding.is_fully_replicated]
    assert len(scatters) == len(sharded_leaves) == 5
    assert len(gathers) >= len(sharded_leaves)
    assert {c.where for c in gathers + scatters} == {expect}
    assert max(c.result_bytes for c in gathers) == max(x.nbytes for x in sharded_leaves)
  # All-reduces: the loss and replicated leaves once per step; clip's global norm in the update's branch.
  reduces = by_opcode(hlo, "all-reduce")
  assert all(c.where == "top" or (c.where == "branch" and c.operand_bytes <= 8 * 32) for c in reduces)


# --------------------------------------------------------------------------- hsdp and ddp


@pytest.mark.parametrize("k, name", [(1, "adam"), (8, "momentum")])
def test_hsdp_equals_full_batch_with_one_cross_replica_all_reduce(k, name):
  opt = OPTIMIZERS[name]()
  mesh = hsdp_mesh()
  p, s, losses, hlo = run("hsdp", opt, k, mesh, ("rep", "shard"))
  assert_exact(opt, p, losses)
  assert p[1]["w"].sharding.spec == P("shard")
  replica_groups = _hlo.mesh_groups((2, 4), ("rep", "shard"), "rep")
  cross = [c for c in _hlo.collectives(hlo, num_devices=8) if c.groups == replica_groups]
  assert [(c.opcode, c.where) for c in cross] == [("all-reduce", "top")]
  # It carries the gradient (all of it: 1/4 of the parameters sharded, plus the replicated bias).
  assert cross[0].operand_bytes >= (params_bytes() - 16) / 4
  assert all(c.where == "top" for c in by_opcode(hlo, "all-reduce"))


def test_ddp_equals_full_batch_with_no_collective_in_the_loop():
  opt = OPTIMIZERS["adamw"]()
  p, s, losses, hlo = run("ddp", opt, 4, data_mesh(), "data")
  assert_exact(opt, p, losses)
  found = _hlo.collectives(hlo, num_devices=8)
  assert [(c.opcode, c.where) for c in found] == [("all-reduce", "top")]
  assert found[0].operand_bytes >= params_bytes()


# --------------------------------------------------------------------------- meshes


@pytest.mark.parametrize("strategy, name", [("zero1", "lamb"), ("fsdp", "clip_adam")])
def test_explicit_mesh_axes(strategy, name):
  mesh = jax.make_mesh((8,), ("data",))  # jax's default axis type
  assert mesh.axis_types == (AxisType.Explicit,)
  opt = OPTIMIZERS[name]()
  p, s, losses, hlo = run(strategy, opt, 4, mesh, "data")
  assert_exact(opt, p, losses)
  # zero1: one packed reduce-scatter per step; fsdp: one per sharded leaf (layer by layer).
  assert len(by_opcode(hlo, "reduce-scatter")) == (1 if strategy == "zero1" else 5)


@pytest.mark.parametrize("strategy, kind", [("zero1", AxisType.Auto), ("fsdp", AxisType.Explicit)])
def test_data_model_mesh_keeps_model_sharding(strategy, kind):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  # Tensor parallel on the middle layer: its columns over "model".
  params[1]["w"] = jax.device_put(params[1]["w"], NamedSharding(mesh, P(None, "model")))
  opt = OPTIMIZERS["adam"]()
  p, s, losses, _ = run(strategy, opt, 4, mesh, "data", params=params)
  assert_exact(opt, p, losses, params=mlp_init(jax.random.PRNGKey(0), SIZES))
  want = P(None, "model") if strategy == "zero1" else P("data", "model")
  assert p[1]["w"].sharding.spec == want
  assert s[0].mu[1]["w"].sharding.spec == P("data", "model")


# --------------------------------------------------------------------------- layouts and memory


@pytest.mark.parametrize(
  "strategy, axes, shard",
  [("zero1", "data", 8), ("fsdp", "data", 8), ("hsdp", ("rep", "shard"), 4), ("ddp", "data", 1)],
)
def test_shard_train_state_per_device_bytes(strategy, axes, shard):
  mesh = hsdp_mesh() if strategy == "hsdp" else data_mesh()
  params = mlp_init(jax.random.PRNGKey(0), (3, 32, 16, 8))  # every leaf divisible by 8
  opt = optax.adam(1e-2)
  p, s = sharded.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=axes)
  chex.assert_trees_all_equal(jax.device_get(p), params)
  chex.assert_trees_all_equal(jax.device_get(s), opt.init(params))
  for device in mesh.devices.flat:
    assert device_bytes(s, device) <= 1.02 / shard * nbytes(s)
    if strategy in ("zero1", "ddp"):
      assert device_bytes(p, device) == nbytes(p)
    else:
      assert device_bytes(p, device) <= 1.02 / shard * nbytes(p)
  # Fresh buffers: a donating step cannot delete the caller's arrays.
  p2, _ = sharded.shard_train_state(p, opt, mesh, strategy=strategy, data_axis=axes)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2), strict=True):
    assert {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}.isdisjoint(
      s.data.unsafe_buffer_pointer() for s in b.addressable_shards
    )


# --------------------------------------------------------------------------- bad input


def test_bad_input_names_the_value():
  mesh, opt = data_mesh(), optax.adam(1e-2)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  with pytest.raises(ValueError, match="strategy='zero3'"):
    sharded.shard_train_state(params, opt, mesh, strategy="zero3")
  with pytest.raises(ValueError, match="strategy='zero3'"):
    ja.make_train_step(mse_loss, opt, strategy="zero3", mesh=mesh)
  with pytest.raises(ValueError, match=r"hsdp.*data_axis='data'"):
    sharded.shard_train_state(params, opt, mesh, strategy="hsdp", data_axis="data")
  with pytest.raises(ValueError, match=r"hsdp.*\('rep', 'rep'\)"):
    ja.make_train_step(mse_loss, opt, strategy="hsdp", mesh=hsdp_mesh(), data_axis=("rep", "rep"))
  with pytest.raises(ValueError, match="'batch'.*not an axis of the mesh"):
    sharded.shard_train_state(params, opt, mesh, strategy="fsdp", data_axis="batch")
  with pytest.raises(ValueError, match="fsdp_gather='always'"):
    ja.make_train_step(mse_loss, opt, strategy="fsdp", mesh=mesh, fsdp_gather="always")
  # A step given parameters laid out for another strategy.
  p, s = sharded.shard_train_state(params, opt, mesh, strategy="zero1")
  step = ja.make_train_step(mse_loss, opt, strategy="fsdp", mesh=mesh)
  with pytest.raises(ValueError, match=r"params\[0\]\['b'\] has sharding spec P\(\).*strategy='fsdp'"):
    step.lower(p, s, regression_data(jax.random.PRNGKey(1), ROWS))


# --------------------------------------------------------------------------- placement: one rule (issue 25)

PLACEMENT = [("ddp", "data"), ("zero1", "data"), ("fsdp", "data"), ("hsdp", ("rep", "shard"))]


def _placements(mesh, axes, params):
  """The parameters as users place them: on one device, replicated, sharded per fsdp, per hsdp's shard axis."""
  shard_axis = axes if isinstance(axes, str) else axes[1]
  by_hand = lambda spec_of: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec_of(x))), params)
  largest = lambda x: P(
    *[shard_axis if d == int(np.argmax(x.shape)) and x.shape[d] % 4 == 0 else None for d in range(x.ndim)]
  )
  return {
    "one device": jax.device_put(params, jax.devices()[0]),
    "replicated": by_hand(lambda x: P()),
    "sharded by hand": by_hand(largest),
  }


@pytest.mark.parametrize("strategy, axes", PLACEMENT)
def test_placement_is_one_rule_for_every_strategy(strategy, axes):
  """shard_train_state re-lays parameters placed any way; a step re-lays one-device parameters and refuses,
  with one message for every strategy, parameters placed on the mesh in another strategy's layout."""
  mesh = data_mesh() if strategy != "hsdp" else hsdp_mesh()
  opt = optax.sgd(0.1)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  want_p, want_s = sharded.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=axes)
  same = lambda a, b: all(
    x.sharding.is_equivalent_to(y.sharding, x.ndim) for x, y in zip(*map(jax.tree.leaves, (a, b)), strict=True)
  )
  placements = _placements(mesh, axes, params)
  for name, placed in placements.items():
    p, s = sharded.shard_train_state(placed, opt, mesh, strategy=strategy, data_axis=axes)
    assert same(p, want_p), name
    chex.assert_trees_all_equal(jax.device_get(p), params)
  batch = regression_data(jax.random.PRNGKey(1), ROWS)
  step = ja.make_train_step(mse_loss, opt, strategy=strategy, mesh=mesh, data_axis=axes, donate=False)
  new_p, _, _ = step(placements["one device"], want_s, batch)  # re-laid by the step
  assert same(new_p, want_p)
  grads = jax.grad(mse_loss)(params, batch)
  chex.assert_trees_all_close(jax.device_get(new_p), jax.tree.map(lambda x, g: x - 0.1 * g, params, grads), rtol=1e-12)
  for name in ("replicated", "sharded by hand"):
    if same(placements[name], want_p):
      step.lower(placements[name], want_s, batch)  # already the strategy's layout
      continue
    with pytest.raises(
      ValueError,
      match=rf"conflicts with strategy='{strategy}'.*Place parameters and optimizer "
      r"state with ja.shard_train_state\(params, optimizer, mesh, strategy=...\), which lays out",
    ):
      step.lower(placements[name], want_s, batch)


def test_a_whole_train_state_or_a_nonfinite_gradient_never_reaches_the_parameters():
  """shard_train_state refuses a whole (flax) TrainState; a NaN mean gradient skips the step (applied False)."""
  from flax.training import train_state

  params = mlp_init(jax.random.PRNGKey(0), (3, 16, 8))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  opt = optax.adam(1e-2)
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=opt)
  with pytest.raises(TypeError, match=r"shard_train_state takes the parameters alone.*state.params"):
    sharded.shard_train_state(state, opt, mesh, strategy="zero1")
  p, s = sharded.shard_train_state(params, opt, mesh, strategy="zero1")
  before = jax.tree.map(np.asarray, (p, s))

  # A masked mean over an all-padding microbatch is 0/0; without a weight_fn it has weight 1.
  def loss(params, batch):
    x, y, mask = batch
    err = jnp.sum((mlp_apply(params, x) - y) ** 2, axis=-1)
    return jnp.sum(mask * err) / jnp.sum(mask)

  x, y = regression_data(jax.random.PRNGKey(1), 32, d_out=8)
  mask = jnp.ones(32).at[::2].set(0.0)  # microbatch 0 of each device (K=2: rows 0, 2, ...) is all padding
  step = ja.make_train_step(loss, opt, strategy="zero1", mesh=mesh, num_microbatches=2, donate=False)
  batch = jax.device_put((x, y, mask), NamedSharding(mesh, P("data")))
  new_p, new_s, metrics = step(p, s, batch)
  assert not bool(metrics["applied"]) and float(metrics["total_weight"]) > 0
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, (new_p, new_s)), before)


# --------------------------------------------------------------------------- abstract state (issue 39)


def _abstract(tree):
  """ShapeDtypeStructs of `tree`'s leaves, keeping a sharding a leaf has."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _typed(tree):
  return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype), x.sharding), tree)


def _specs_of(tree):
  """Each leaf's sharding spec, trailing Nones dropped (P() == P(None,)), None without a sharding."""
  spec = lambda x: None if x.sharding is None else sharded._spec(sharded._entries(x.sharding.spec, len(x.shape)))
  return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype), spec(x)), tree)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("strategy, axes", PLACEMENT)
def test_shard_train_state_on_abstract_params_is_the_concrete_layout(strategy, axes, kind):
  """ShapeDtypeStructs in: the layout out as ShapeDtypeStructs with the concrete call's shardings, nothing allocated.
  Under jax.eval_shape the traced path runs on both mesh kinds (Explicit axes typed, Auto ones not)."""
  mesh = data_mesh(kind) if strategy != "hsdp" else hsdp_mesh(kind)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)  # float64; the (2,) bias divides no axis: replicated
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  concrete = sharded.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=axes)
  live = {id(x) for x in jax.live_arrays()}
  abstract = ja.shard_train_state(_abstract(params), opt, mesh, strategy=strategy, data_axis=axes)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
  assert all(isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh for x in jax.tree.leaves(abstract))
  assert _typed(abstract) == _typed(concrete)
  assert not [x for x in jax.live_arrays() if id(x) not in live]  # nothing allocated
  # Abstract leaves carrying the concrete layout (a step's own outputs, say) give it back unchanged.
  assert _typed(ja.shard_train_state(_abstract(concrete[0]), opt, mesh, strategy=strategy, data_axis=axes)) == (
    _typed(concrete)
  )
  traced = jax.eval_shape(lambda p: ja.shard_train_state(p, opt, mesh, strategy=strategy, data_axis=axes), params)
  if kind == AxisType.Explicit:  # in the types, on the mesh's AbstractMesh
    assert _specs_of(traced) == _specs_of(concrete)
    assert all(x.sharding.mesh == mesh.abstract_mesh for x in jax.tree.leaves(traced))
  else:  # Auto axes are not in the types: eval_shape reports shapes and dtypes alone
    unsharded = lambda t: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), t)
    assert unsharded(traced) == unsharded(concrete)


def test_shard_train_state_on_abstract_params_keeps_a_model_axis():
  """An abstract leaf's sharding over another mesh axis is kept, as a placed array's is."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  params[1]["w"] = jax.device_put(params[1]["w"], NamedSharding(mesh, P(None, "model")))
  opt = optax.adam(1e-2)
  for strategy in ("zero1", "fsdp"):
    concrete = sharded.shard_train_state(params, opt, mesh, strategy=strategy)
    abstract = ja.shard_train_state(_abstract(params), opt, mesh, strategy=strategy)
    assert _typed(abstract) == _typed(concrete)
    assert abstract[1][0].mu[1]["w"].sharding.spec == P("data", "model")


def test_packed_collectives_cut_their_buffer_at_offsets_xla_cannot_fold():
  """On CPU a packed buffer's pieces are dynamic slices at opaque offsets (issue 39).

  XLA:CPU compiles each distinct kernel once: with static slices each leaf's
  piece (and the consumer it fuses into) differs by its offset, and a 32-layer
  model's fsdp "once" step compiled one kernel per leaf, twice.
  """
  mesh = data_mesh()
  leaves = [sharded._Leaf(P(), P(), dim, False) for dim in (0, 1, 0)]
  xs = [jnp.arange(8 * 3.0).reshape(8, 3), jnp.arange(16 * 8.0).reshape(2, 64), jnp.arange(64.0)]

  def body(*xs):
    blocks = sharded._packed_reduce_scatter(list(xs), leaves, "data", 8, None, free=True)
    return tuple(sharded._packed_all_gather(blocks, leaves, "data", 8, to="invarying"))

  f = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 3, out_specs=(P(),) * 3, check_vma=False)
  prims = {e.primitive.name for e in jax.make_jaxpr(f)(*xs).jaxpr.eqns[0].params["jaxpr"].eqns}
  if jax.default_backend() == "cpu":
    assert "dynamic_slice" in prims and "slice" not in prims and "optimization_barrier" in prims
  for got, x in zip(jax.jit(f)(*xs), xs, strict=True):
    np.testing.assert_array_equal(got, 8 * x)  # the sum over 8 devices of the same x, gathered back whole
