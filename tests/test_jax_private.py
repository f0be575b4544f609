"""jaxaccum/_jax_private.py: what it changes in JAX stays inside jaxaccum's own programs (issue 49, item 5)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import _user_partial_manual
import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _jax_private

HERE = pathlib.Path(__file__).parent


def _step_on_an_explicit_model_mesh():
  """One update of make_train_step on an Explicit (data, model) mesh, a parameter split over "model": the step
  whose build installs `shard_map_keeps_free_explicit_axes` (jax 0.10), lowered and run. Checked against the plain
  full-batch step, so the step keeps its own typed boundary and its values."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k1, (3, 8), jnp.float64) / 2, "w2": jax.random.normal(k2, (8, 2), jnp.float64)}
  x = jax.random.normal(k3, (32, 3), jnp.float64)
  batch = (x, jnp.sin(x[:, :2]))

  def loss(p, b):
    return jnp.mean(jnp.sum((jnp.tanh(b[0] @ p["w1"]) @ p["w2"] - b[1]) ** 2, -1))

  opt = optax.sgd(0.3)
  step = ja.make_train_step(loss, opt, num_microbatches=2, mesh=mesh, donate=False, strategy="fsdp")
  with jax.set_mesh(mesh):
    placed = {"w1": jax.device_put(params["w1"], P(None, "model")), "w2": jax.device_put(params["w2"], P())}
    p, s = ja.shard_train_state(placed, opt, mesh, strategy="fsdp")
    new, _, _ = step(p, s, ja.shard_batch(batch, mesh))
    g = jax.jit(jax.grad(loss))(placed, jax.device_put(batch, NamedSharding(mesh, P("data"))))
  want = jax.tree.map(lambda p, g: p - 0.3 * g, params, jax.device_get(g))
  chex.assert_trees_all_close(jax.device_get(new), want, rtol=1e-12, atol=1e-14)


def test_a_users_own_partial_manual_shard_map_lowers_as_in_a_process_without_jaxaccum():
  """Once, on jax 0.10.2, building a step on an Explicit mesh changed every partial-manual shard_map lowered after
  it in the process, the user's too: other boundary shardings (other HLO) and float64 results 1-16 ulp apart (the
  reduction order). Now the user's map lowers to the same text and gives the same bits as in a fresh process that
  never imported jaxaccum (jax 0.11+ changes nothing either way)."""
  _step_on_an_explicit_model_mesh()
  assert _jax_private._SHARD_MAP_TYPED_BOUNDARY  # installed (a no-op from jax 0.11)
  got = _user_partial_manual.program()
  fresh = subprocess.run(
    [sys.executable, str(HERE / "_user_partial_manual.py")], capture_output=True, text=True, timeout=300, check=True
  )
  want = json.loads(fresh.stdout.strip().splitlines()[-1])
  assert got["hlo"] == want["hlo"], "the user's shard_map lowered to other HLO than without jaxaccum"
  assert got["out"] == want["out"], "the user's shard_map gave other float64 bits than without jaxaccum"


def test_the_typed_boundary_is_kept_only_where_it_names_the_same_manual_axes():
  """On jax 0.10.2 JAX's spec (from in_specs/out_specs) fixes the body's block shapes; the value's type may only
  add free axes. A type that splits a dimension over the manual axes differently keeps JAX's spec."""
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  typed = lambda spec: jax.core.ShapedArray((8, 4), jnp.float64, sharding=NamedSharding(mesh, spec))
  rule = _jax_private._typed_boundary_spec
  assert rule(P("data"), typed(P("data", "model")), {"data"}) == P("data", "model")
  assert rule(P("data"), typed(P(None, "model")), {"data"}) == P("data")
  assert rule(P(), typed(P("data")), {"data"}) == P()
  assert rule(P(None, "model"), typed(P()), {"model"}) == P(None, "model")
  # An unreduced type (ja.grad's gradient): read by its partitions (JAX refuses indexing such a spec).
  assert rule(P(), typed(P(None, None, unreduced={"data"})), {"data"}) == P(None, None, unreduced={"data"})
