"""ja.pmean / ja.psum inside pmap and shard_map, and the mesh helpers (data_mesh, shard_batch, replicate)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo


def _reference_sgd_step(params, x, lr):
  """The full-batch step written plainly: mean squared output over all rows."""
  grads = jax.grad(lambda q: jnp.mean((x @ q["w"]) ** 2))(params)
  return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def test_pmean_psum_under_pmap():
  pm, ps = ja.pmean("data"), ja.psum("data")
  g = jnp.arange(24.0).reshape(8, 3)
  mean = jax.pmap(lambda x: pm.update({"g": x}, pm.init(None))[0]["g"], axis_name="data")(g)
  total = jax.pmap(lambda x: ps.update({"g": x}, ps.init(None))[0]["g"], axis_name="data")(g)
  np.testing.assert_allclose(mean, np.broadcast_to(np.asarray(g).mean(0), (8, 3)), rtol=1e-15)
  np.testing.assert_allclose(total, np.broadcast_to(np.asarray(g).sum(0), (8, 3)), rtol=1e-15)


@pytest.mark.parametrize("style", ["pmap", "shard_map"])
def test_pmean_in_a_chain_equals_the_full_batch_step(style):
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)}
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 3))
  tx = optax.chain(ja.pmean("data"), optax.sgd(0.1))

  def local_step(p, xs):
    # Under shard_map replicated params must be cast to varying, or autodiff sums for us.
    q = lax.pcast(p, "data", to="varying") if style == "shard_map" else p
    grads = jax.grad(lambda q: jnp.mean((xs @ q["w"]) ** 2))(q)
    updates, _ = tx.update(grads, tx.init(p), p)  # all-reduced: invariant again
    return optax.apply_updates(p, updates)

  if style == "pmap":
    out = jax.pmap(local_step, axis_name="data", in_axes=(None, 0))(params, x.reshape(8, 4, 3))
    out = jax.tree.map(lambda a: a[0], out)
  else:
    mesh = ja.data_mesh()
    f = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    out = jax.jit(f)(params, x)
  chex.assert_trees_all_close(out, _reference_sgd_step(params, x, 0.1), rtol=1e-13)


def test_comm_dtype_sends_bf16_and_returns_the_leaf_dtype():
  pm = ja.pmean("data", comm_dtype=jnp.bfloat16)
  g = jnp.arange(24.0).reshape(8, 3) / 7
  f = jax.pmap(lambda x: pm.update({"g": x}, pm.init(None))[0]["g"], axis_name="data")
  assert "tensor<3xbf16>" in f.lower(g).as_text()
  out = f(g)
  assert out.dtype == g.dtype
  np.testing.assert_allclose(out[0], np.asarray(g).mean(0), rtol=1e-2)
  assert not np.allclose(out[0], np.asarray(g).mean(0), rtol=1e-12, atol=0)  # it did go through bf16


def test_one_all_reduce_instruction_for_a_whole_tree():
  pm = ja.pmean("data")
  tree = {"a": jnp.ones((8, 3)), "b": jnp.ones((8, 4, 2)), "c": jnp.ones((8,))}
  hlo = jax.pmap(lambda t: pm.update(t, pm.init(None))[0], axis_name="data").lower(tree).compile().as_text()
  assert _hlo.count(hlo, "all-reduce") == 1


def test_shard_map_pitfall_is_caught():
  params = {"w": jnp.ones((3,))}
  mesh = ja.data_mesh("data")
  pm = ja.pmean("data")
  g = jax.jit(
    jax.shard_map(
      lambda p, x: pm.update(jax.grad(lambda q: jnp.mean((x @ q["w"]) ** 2))(p), pm.init(p))[0],
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=P(),
    )
  )
  with pytest.raises(ValueError, match=r"updates\['w'\] is invariant over axis_name='data'.*pcast"):
    g(params, jnp.ones((16, 3)))


def test_unbound_and_bad_axis_names():
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    jax.jit(ja.pmean("data").update)(params, ja.pmean("data").init(params))
  with pytest.raises(ValueError, match="axis_name='batch' is not bound"):
    jax.pmap(lambda g: ja.psum("batch").update(g, ())[0], axis_name="data")(jnp.ones((8, 2)))
  for bad in (3, None, ()):
    with pytest.raises(TypeError, match="axis_name"):
      ja.pmean(bad)
  for make in (ja.pmean, ja.psum):
    with pytest.raises(ValueError, match="comm_dtype=dtype\\('int32'\\)"):
      make("data", comm_dtype=jnp.int32)


# --------------------------------------------------------------------------- meshes and data


def test_data_mesh():
  mesh = ja.data_mesh()
  assert mesh.axis_names == ("data",) and mesh.shape["data"] == 8
  five = ja.data_mesh("batch", devices=jax.devices()[:5])
  assert five.shape["batch"] == 5
  with pytest.raises(TypeError, match="axis_name"):
    ja.data_mesh("")
  with pytest.raises(ValueError, match="devices"):
    ja.data_mesh(devices=[])


def test_shard_batch_splits_rows_over_the_axis():
  mesh = ja.data_mesh()
  batch = {"x": np.arange(48.0).reshape(16, 3), "y": np.arange(16)}
  sharded = ja.shard_batch(batch, mesh)
  assert sharded["x"].sharding == NamedSharding(mesh, P("data"))
  np.testing.assert_array_equal(sharded["x"], batch["x"])
  assert [s.data.shape for s in sharded["x"].addressable_shards] == [(2, 3)] * 8
  with pytest.raises(ValueError, match=r"batch\['x'\] has 12 local rows, not divisible by the 8 shards"):
    ja.shard_batch({"x": np.ones((12, 3))}, mesh)
  with pytest.raises(ValueError, match="scalar"):
    ja.shard_batch({"x": np.float64(1.0)}, mesh)
  with pytest.raises(ValueError, match="axis_name='model' is not an axis of the mesh"):
    ja.shard_batch(batch, mesh, axis_name="model")
  with pytest.raises(TypeError, match="mesh"):
    ja.shard_batch(batch, "data")


def test_replicate_copies_so_donation_cannot_delete_the_callers_arrays():
  mesh = ja.data_mesh()
  params = {"w": jnp.ones((3, 2)), "b": np.zeros(2)}
  placed = ja.replicate(params, mesh)
  assert placed["w"].sharding == NamedSharding(mesh, P())
  assert len(placed["w"].addressable_shards) == 8
  jax.jit(lambda t: jax.tree.map(lambda a: a + 1, t), donate_argnums=0)(placed)
  assert placed["w"].is_deleted()
  np.testing.assert_array_equal(params["w"], np.ones((3, 2)))  # still alive and unchanged
  with pytest.raises(TypeError, match="mesh"):
    ja.replicate(params, None)


def test_data_mesh_rejects_non_devices_and_duplicates():
  with pytest.raises(TypeError, match=r"devices\[0\]=0 must be a jax Device.*devices=\[0, 1\]"):
    ja.data_mesh(devices=[0, 1])
  d = jax.devices()
  with pytest.raises(ValueError, match="twice"):
    ja.data_mesh(devices=[d[0], d[1], d[0]])


def test_cond_leaves_typed_prng_keys_alone_and_promotes_numbers():
  """Keys have no promotion (optax.noisy_sgd's state holds one); numeric leaves are still joined."""
  key = jax.random.key(3)

  def advance(ops):
    k, x = ops
    return jax.random.split(k)[0], x.astype(jnp.float32) * 2

  out_key, out_x = jax.jit(lambda p, ops: ja.parallel.cond(p, advance, lambda ops: ops, ops))(
    True, (key, jnp.ones(2, jnp.bfloat16))
  )
  assert jax.dtypes.issubdtype(out_key.dtype, jax.dtypes.prng_key) and out_x.dtype == jnp.float32
  np.testing.assert_array_equal(jax.random.key_data(out_key), jax.random.key_data(jax.random.split(key)[0]))


def test_shard_batch_takes_a_tuple_of_axes_for_hsdp():
  mesh = jax.make_mesh((2, 4), ("replica", "shard"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = np.arange(16 * 3.0).reshape(16, 3)
  out = ja.shard_batch({"x": x}, mesh, ("replica", "shard"))["x"]
  assert out.sharding.spec == P(("replica", "shard"))
  np.testing.assert_array_equal(np.asarray(out), x)
  # Rows split over the product of the two axes, the first axis major: 2 rows per device.
  for shard in out.addressable_shards:
    assert shard.data.shape == (2, 3)
  with pytest.raises(ValueError, match=r"axis_name='model' is not an axis"):
    ja.shard_batch({"x": x}, mesh, ("replica", "model"))
  with pytest.raises(ValueError, match=r"6 local rows, not divisible by the 8 shards"):
    ja.shard_batch({"x": x[:6]}, mesh, ("replica", "shard"))
  with pytest.raises(ValueError, match="names an axis twice"):
    ja.shard_batch({"x": x}, mesh, ("shard", "shard"))


def test_data_mesh_names_devices_when_given_one_device_or_a_non_sequence():
  """Issue 22: one device (not a list) raised "'Device' object is not iterable", naming nothing."""
  one = jax.devices()[0]
  with pytest.raises(TypeError, match=r"devices=.* is one device.*pass devices=\["):
    ja.data_mesh(devices=one)
  for bad in ("cpu", 3):
    with pytest.raises(TypeError, match=rf"devices={bad!r} must be a sequence of jax Devices"):
      ja.data_mesh(devices=bad)
  assert ja.data_mesh(devices=[one]).devices.tolist() == [one]


def test_shard_batch_refuses_an_empty_batch_as_make_train_step_does():
  """Issue 22: a zero-row batch came back as empty arrays; make_train_step refuses it."""
  mesh = ja.data_mesh()
  with pytest.raises(ValueError, match=r"batch\['x'\] has 0 rows.*empty"):
    ja.shard_batch({"x": np.zeros((0, 3)), "y": np.zeros((0,))}, mesh)
  with pytest.raises(ValueError, match=r"batch\[1\] has 0 rows"):
    ja.shard_batch((jnp.zeros((8, 3)), jnp.zeros((0,))), mesh)


def test_cond_traces_each_branch_once_and_keeps_constants_and_closures():
  """Each branch's Python runs once per trace (an optimizer update, a microbatch's gradient: issue 39)."""
  calls = {"yes": 0, "no": 0}
  scale = jnp.float32(3.0)

  def yes(ops):
    calls["yes"] += 1
    x, n = ops
    return x * scale, n + 1, 1.5  # a closed-over array, and a Python constant

  def no(ops):
    calls["no"] += 1
    x, n = ops
    return x, n, jnp.float32(0)

  f = jax.jit(lambda p, ops: ja.parallel.cond(p, yes, no, ops))
  for pred, want in ((True, (6.0, 2, 1.5)), (False, (2.0, 1, 0.0))):
    x, n, c = f(pred, (jnp.float32(2.0), jnp.int32(1)))
    assert (float(x), int(n), float(c)) == want
  assert calls == {"yes": 1, "no": 1}  # one trace of f: each branch traced once, not twice
