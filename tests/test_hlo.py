"""ja.count_collectives / ja.collective_bytes: executions per call with loop trip counts, on known programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxaccum as ja

N_DEV = 8


def _mesh():
  return jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))


def _compiled(body, x):
  """`body` under a shard_map over 8 devices, compiled; x is sharded over "data"."""
  mesh = _mesh()
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  return f.lower(x).compile()


def _gather_sum(x):
  return lax.all_gather(x, "data", tiled=True)[: x.shape[0]] * 0.5 + x


def test_a_scan_of_four_with_one_all_gather_counts_four():
  def body(x):
    def step(c, _):
      return _gather_sum(c), None

    return lax.scan(step, x, None, length=4)[0]

  compiled = _compiled(body, jnp.arange(16.0))
  counts = ja.count_collectives(compiled)
  assert counts.get("all-gather") == 4, counts
  # The instruction itself appears once in the text: counting instructions would say 1.
  assert compiled.as_text().count(" all-gather(") + compiled.as_text().count(" all-gather-start(") == 1
  # The HLO text counts the same as the compiled object.
  assert ja.count_collectives(compiled.as_text()) == counts


def test_nested_loops_multiply_and_straight_line_code_counts_once():
  def body(x):
    def inner(c, _):
      return _gather_sum(c), None

    def outer(c, _):
      return lax.scan(inner, c, None, length=3)[0], None

    x = lax.scan(outer, x, None, length=4)[0]
    return x + lax.psum(x, "data")  # one all-reduce, outside the loops

  counts = ja.count_collectives(_compiled(body, jnp.arange(16.0)))
  assert counts["all-gather"] == 12, counts
  assert counts["all-reduce"] == 1, counts


def test_branches_all_or_none_and_ring_bytes():
  def body(x):
    def step(c, i):
      # An all-reduce only in the taken branch of a cond inside a loop of 4.
      c = lax.cond(i == 3, lambda v: lax.pcast(lax.psum(v, "data"), "data", to="varying"), lambda v: v * 2.0, c)
      return c, None

    return lax.scan(step, x, jnp.arange(4))[0]

  x = jnp.arange(16.0)  # float64: 2 rows of 8 bytes per device
  compiled = _compiled(body, x)
  assert ja.count_collectives(compiled) == {"all-reduce": 4}
  assert ja.count_collectives(compiled, branches="none") == {}
  # Ring all-reduce of b = 16 bytes over n = 8 devices: 2 (n-1) b / n = 28 bytes, 4 times (as if taken).
  assert ja.collective_bytes(compiled) == {"all-reduce": pytest.approx(4 * 28.0)}


def test_all_gather_ring_bytes_are_the_other_devices_shards():
  compiled = _compiled(_gather_sum, jnp.arange(16.0))
  # Result 16 float64 = 128 bytes on each device; it receives the 7 other shards of 16 bytes.
  assert ja.collective_bytes(compiled) == {"all-gather": pytest.approx(7 * 16.0)}


def test_bad_input_is_refused_by_name():
  lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(3))
  with pytest.raises(TypeError, match="compiled"):
    ja.count_collectives(lowered)
  with pytest.raises(TypeError, match="compiled"):
    ja.count_collectives(3)
  with pytest.raises(ValueError, match="branches"):
    ja.count_collectives(lowered.compile(), branches="some")
  with pytest.raises(ValueError, match="num_devices"):
    ja.collective_bytes(lowered.compile(), num_devices=0)


def test_mesh_form_replica_groups_are_the_groups_over_the_named_axes():
  """XLA prints some groups as `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}` (a gather over the data axis of a
  (replica, data) mesh inside a shard_map manual over replica): two groups of 4, not one of 8."""
  from jaxaccum import _hlo

  line = "%ag = f32[1,16]{0,1} all-gather(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}"
  assert _hlo._groups(line) == frozenset({frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})})
  line = "%ar = f32[4] all-reduce(%x), replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}, to_apply=%add"
  assert _hlo._groups(line) == frozenset({frozenset({0, 1, 4, 5}), frozenset({2, 3, 6, 7})})


# ------------------------------------------------------------------ by_axis: which mesh axes a collective spans


def _mesh_4x2(devices=None):
  if devices is None:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  return jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _per_axis_step(mesh):
  """Per trip of a fori_loop of 3: psum over "data", over "model", over both, all_gather over "model"."""

  def body(x):
    def step(i, c):
      c = c + lax.psum(c, "data")
      c = c + lax.psum(c, "model")
      c = c + lax.psum(c, ("data", "model"))
      return c + lax.all_gather(c, "model", tiled=True)[: c.shape[0]]

    return lax.fori_loop(0, 3, step, x)

  spec = P(("data", "model"))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  return f.lower(jnp.arange(32.0)).compile()  # float64 (x64): 4 values = 32 bytes per device


# `_per_axis_step`, counted by hand: 3 trips x one instruction each.
HAND_COUNTED = {
  "data": {"all-reduce": 3},
  "model": {"all-reduce": 3, "all-gather": 3},
  ("data", "model"): {"all-reduce": 3},
}


def test_by_axis_counts_each_collective_under_the_mesh_axes_it_spans():
  mesh = _mesh_4x2()
  compiled = _per_axis_step(mesh)
  counts = ja.count_collectives(compiled, by_axis=True, mesh=mesh)
  assert counts == HAND_COUNTED, counts
  assert list(counts) == ["data", "model", ("data", "model")]  # fewer axes first, then mesh order
  # Summed over the axes: the plain count. HLO text reads the same as the compiled step.
  assert ja.count_collectives(compiled) == {"all-reduce": 9, "all-gather": 3}
  assert ja.count_collectives(compiled.as_text(), by_axis=True, mesh=mesh) == counts
  # Bytes of the data psum: 3 x a ring all-reduce of b = 32 bytes over n = 4 devices, 2 (n-1) b / n = 48.
  nbytes = ja.collective_bytes(compiled, by_axis=True, mesh=mesh)
  assert nbytes["data"] == {"all-reduce": pytest.approx(3 * 48.0)}
  # The all-gather over "model": receives the 1 other shard of 32 bytes, 3 times.
  assert nbytes["model"]["all-gather"] == pytest.approx(3 * 32.0)
  assert nbytes[("data", "model")] == {"all-reduce": pytest.approx(3 * 2 * 7 * 32.0 / 8)}


def test_by_axis_follows_the_meshs_device_order():
  """On a mesh of permuted devices the HLO's logical ids are positions in the mesh, not device ids."""
  order = [3, 0, 5, 1, 7, 2, 6, 4]
  mesh = _mesh_4x2(np.array(jax.devices())[order].reshape(4, 2))
  compiled = _per_axis_step(mesh)
  counts = ja.count_collectives(compiled, by_axis=True, mesh=mesh)
  assert counts == HAND_COUNTED, counts
  assert ja.count_collectives(compiled.as_text(), by_axis=True, mesh=mesh) == counts


def test_by_axis_reads_every_replica_group_form():
  from jaxaccum import _hlo

  coords = np.array(np.unravel_index(np.arange(8), (2, 2, 2))).T
  names = ("a", "b", "c")

  def axes(opcode, attrs):
    return _hlo.spanned_axes(opcode, f"%x = f32[4] {opcode}(%y), {attrs}", coords, names)

  assert axes("all-reduce", "replica_groups={{0,4},{1,5},{2,6},{3,7}}") == "a"
  assert axes("all-reduce", "replica_groups={{0,1,2,3},{4,5,6,7}}") == ("b", "c")
  assert axes("all-reduce", "replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}") == ()
  assert axes("all-reduce", "replica_groups={}") == ("a", "b", "c")  # no groups: every device
  # Iota: [2,4]<=[2,4]T(1,0) is {0,4,1,5},{2,6,3,7}: axes a and c.
  assert axes("all-gather", "replica_groups=[2,4]<=[2,4]T(1,0), dimensions={0}") == ("a", "c")
  assert axes("reduce-scatter", "replica_groups=[4,2]<=[8], dimensions={0}") == "c"
  assert axes("all-to-all", "replica_groups=mesh['x'=2,'y'=2,'z'=2] {'y'}") == "b"
  assert axes("collective-permute", "source_target_pairs={{0,2},{2,0},{4,6},{6,4}}") == "b"
  assert axes("collective-permute", "source_target_pairs={{0,3},{3,0}}") == ("b", "c")
  assert axes("collective-permute", "source_target_pairs={}") == ()


def test_by_axis_on_a_compiled_permute_all_to_all_and_reduce_scatter():
  mesh = _mesh_4x2()

  def body(c):
    c = c + lax.psum_scatter(jnp.concatenate([c] * 4), "data", tiled=True)
    c = c + lax.ppermute(c, "data", [(i, (i + 1) % 4) for i in range(4)])
    c = c + lax.ppermute(c, "model", [(0, 1), (1, 0)])
    return c + lax.all_to_all(c, "model", 0, 0, tiled=True)

  spec = P(("data", "model"))
  compiled = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).lower(jnp.arange(32.0)).compile()
  counts = ja.count_collectives(compiled, by_axis=True, mesh=mesh)
  assert counts == {
    "data": {"reduce-scatter": 1, "collective-permute": 1},
    "model": {"collective-permute": 1, "all-to-all": 1},
  }, counts


def test_by_axis_is_refused_without_a_mesh_by_name():
  mesh = _mesh_4x2()
  compiled = _per_axis_step(mesh)
  with pytest.raises(ValueError, match="mesh"):
    ja.count_collectives(compiled, by_axis=True)
  with pytest.raises(ValueError, match="mesh"):
    ja.collective_bytes(compiled, by_axis=True)
  with pytest.raises(ValueError, match="mesh"):
    ja.count_collectives(compiled, by_axis=True, mesh=("data", "model"))  # type: ignore[call-overload]
  with pytest.raises(ValueError, match="mesh"):
    ja.count_collectives(compiled, by_axis=True, mesh=mesh.abstract_mesh)
  with pytest.raises(ValueError, match="by_axis"):
    ja.count_collectives(compiled, mesh=mesh)
  with pytest.raises(ValueError, match="by_axis"):
    ja.count_collectives(compiled, by_axis="yes", mesh=mesh)  # type: ignore[call-overload]
  # A mesh smaller than the step: the HLO names ids it does not hold.
  small = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  with pytest.raises(ValueError, match="mesh"):
    ja.count_collectives(compiled.as_text(), by_axis=True, mesh=small)
