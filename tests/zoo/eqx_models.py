"""An Equinox MLP as the Equinox docs write it: `eqx.partition` into arrays and static parts."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from zoo import Model
from zoo.flax_models import regression

_static = eqx.partition(
  eqx.nn.MLP(3, 2, 8, 2, activation=jnp.tanh, dtype=jnp.float64, key=jax.random.PRNGKey(0)), eqx.is_inexact_array
)[1]


def _init(key):
  model = eqx.nn.MLP(3, 2, 8, 2, activation=jnp.tanh, dtype=jnp.float64, key=key)
  return eqx.partition(model, eqx.is_inexact_array)[0]


def _loss(params, batch):
  model = eqx.combine(params, _static)
  return jnp.mean(jnp.sum((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2, -1))


EQX_MLP = Model(
  name="eqx_mlp",
  framework="equinox",
  what="`eqx.nn.MLP`, partitioned with `eqx.partition`/`eqx.combine`, applied with `jax.vmap`",
  init=_init,
  loss=_loss,
  batch=regression,
)

MODELS = [EQX_MLP]
