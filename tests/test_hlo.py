"""ja.count_collectives / ja.collective_bytes: executions per call with loop trip counts, on known programs."""

import jax
import jax.numpy as jnp
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
