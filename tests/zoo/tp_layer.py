"""The JAX docs' tensor-parallel layer exactly as the shard_map notebook writes it: a module-level
`@jax.shard_map` without `mesh=`, so its wrapper keeps the context mesh of its first call (the zoo reloads
this module before each use, as a fresh process would import it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.shard_map(in_specs=(jax.P(None, "model"), jax.P("model", None), jax.P("model")), out_specs=jax.P(None, "model"))
def gemm_tp(inputs, W, b):  # noqa: N803  (the docs' name)
  block_result = jnp.dot(inputs, W)
  return jax.lax.psum_scatter(block_result, "model", scatter_dimension=1, tiled=True) + b


def predict_tp(params, inputs):
  for W, b in params:  # noqa: N806
    outputs = gemm_tp(inputs, W, b)
    inputs = jnp.tanh(outputs)
  return outputs
