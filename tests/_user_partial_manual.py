"""A user's own partly manual `jax.shard_map` on an Explicit (data, model) mesh, in float64, outside any jaxaccum step.

Run as a script (`python tests/_user_partial_manual.py`) it prints what `program()` returns as JSON, from a
process in which jaxaccum was never imported: the reference tests/test_jax_private.py compares against.
"""

from __future__ import annotations

import hashlib
import json

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def program() -> dict:
  """The map's lowered text (sha256) and its float64 results (hex of their bytes).

  Manual over "data" only: "model" is free, and the operands are typed split over it (rows of `x`'s columns,
  `w`'s rows), so the contraction inside the body meets a free Explicit axis at the map's boundary, where jax
  0.10.2 and 0.11+ lower differently (see `jaxaccum._jax_private.shard_map_keeps_free_explicit_axes`).
  """
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  kx, kw = jax.random.split(jax.random.PRNGKey(3))
  x = jax.random.normal(kx, (16, 64), jnp.float64)
  w = jax.random.normal(kw, (64, 8), jnp.float64) / 8

  def body(x, w):
    return jnp.tanh(jnp.matmul(x, w, out_sharding=P())) * jnp.sum(x * x, axis=-1, keepdims=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"), axis_names={"data"}))
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(w, NamedSharding(mesh, P("model", None)))
    lowered = f.lower(x, w)
    out = np.asarray(jax.device_get(f(x, w)))
  return {"hlo": hashlib.sha256(lowered.as_text().encode()).hexdigest(), "out": out.tobytes().hex()}


if __name__ == "__main__":
  print(json.dumps(program()))
