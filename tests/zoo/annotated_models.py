"""Model code annotated for the global batch, as the large JAX codebases write it, and model state with a key.

Each names the data axis in a sharding annotation (or runs a module-level shard_map layer): inside jaxaccum's
per-device map the data axis is already split, and the annotations are localised (`jaxaccum/_program.py`).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from zoo import Model, tp_layer
from zoo.flax_models import regression

F64 = jnp.float64


def _mse(pred, y):
  return jnp.mean(jnp.sum((pred - y) ** 2, -1))


def _two_layer_init(key, d_in=3, hidden=8, d_out=2):
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (d_in, hidden), F64) / 2,
    "b1": jnp.full((hidden,), 0.1, F64),
    "w2": jax.random.normal(k2, (hidden, d_out), F64) / 3,
    "b2": jnp.full((d_out,), 0.1, F64),
  }


# --- with_sharding_constraint on an Auto mesh, activations (batch, hidden) over ("data", "model") ------------------
def _wsc_loss(params, batch):
  h = jax.lax.with_sharding_constraint(batch["x"] @ params["w1"] + params["b1"], P("data", "model"))
  h = jax.lax.with_sharding_constraint(jnp.tanh(h), P("data", "model"))
  return _mse(h @ params["w2"] + params["b2"], batch["y"])


WSC = Model(
  name="wsc_auto",
  framework="jax",
  what='`jax.lax.with_sharding_constraint(h, P("data", "model"))` on activations, on an Auto (data, model) mesh',
  init=_two_layer_init,
  loss=_wsc_loss,
  batch=regression,
  mesh_axes=(("model", 2),),
  annotates_data=True,
)


# --- a linen model under logical axis rules (T5X / MaxText style) -------------------------------------------------
RULES = (("batch", "data"), ("mlp", "model"), ("embed", None))


class LogicalMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.with_logical_constraint(x, ("batch", "embed"))
    h = nn.with_logical_constraint(nn.Dense(8, param_dtype=F64)(x), ("batch", "mlp"))
    h = nn.with_logical_constraint(nn.tanh(h), ("batch", "mlp"))
    return nn.Dense(2, param_dtype=F64)(h)


_logical = LogicalMLP()


def _logical_init(key):
  return _logical.init(key, jnp.zeros((2, 3), F64))["params"]


def _logical_loss(params, batch):
  with nn.logical_axis_rules(RULES):  # T5X and MaxText enter the rules around the step; here around the model
    return _mse(_logical.apply({"params": params}, batch["x"]), batch["y"])


LOGICAL = Model(
  name="linen_logical",
  framework="linen",
  what='`flax.linen` MLP with `nn.with_logical_constraint` under `nn.logical_axis_rules` ("batch" -> "data", '
  '"mlp" -> "model")',
  init=_logical_init,
  loss=_logical_loss,
  batch=regression,
  mesh_axes=(("model", 2),),
  annotates_data=True,
  linen=(_logical, None),
)


# --- the docs' module-level @jax.shard_map tensor-parallel layer (gemm_tp) ------------------------------------------
def _tp_init(key):
  k1, k2 = jax.random.split(key)
  return [
    (jax.random.normal(k1, (4, 8), F64) / 2, jnp.full((8,), 0.1, F64)),
    (jax.random.normal(k2, (8, 2), F64) / 3, jnp.full((2,), 0.1, F64)),
  ]


def _tp_loss(params, batch):
  predictions = tp_layer.predict_tp(params, batch["x"])
  return jnp.mean(jnp.sum((predictions - batch["y"]) ** 2, axis=-1))


TP_MODULE = Model(
  name="shard_map_tp_module",
  framework="jax",
  what="the docs' `gemm_tp`: a module-level `@jax.shard_map` layer (no `mesh=`: it keeps the mesh of its first "
  "call), `psum_scatter` inside",
  init=_tp_init,
  loss=_tp_loss,
  batch=lambda key, n: regression(key, n, d_in=4),
  mesh_axes=(("model", 2),),
  fresh=lambda: importlib.reload(tp_layer),
)


# --- a typed PRNG key in the model state ----------------------------------------------------------------------------
def _key_init(key):
  return _two_layer_init(key), {"rng": jax.random.key(7), "x_mean": jnp.zeros((3,), F64)}


def _key_loss(params, state, batch):
  # The state's key draws a weight noise shared by every row (the same for any split) and advances each step.
  w1 = params["w1"] + 0.01 * jax.random.normal(state["rng"], params["w1"].shape, F64)
  h = jnp.tanh(batch["x"] @ w1 + params["b1"])
  new_state = {"rng": jax.random.fold_in(state["rng"], 1), "x_mean": jnp.mean(batch["x"], axis=0)}
  return _mse(h @ params["w2"] + params["b2"], batch["y"]), new_state


KEY_STATE = Model(
  name="key_in_state",
  framework="jax",
  what="a typed `jax.random.key` in the model state (`has_state`), advanced every step",
  init=_key_init,
  loss=_key_loss,
  batch=regression,
  has_state=True,
)

MODELS = [WSC, LOGICAL, TP_MODULE, KEY_STATE]
