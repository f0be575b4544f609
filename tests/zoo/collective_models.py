"""Models whose loss reduces over the data axis itself, as pmap-era code writes them.

- `sync_bn`: Flax's ImageNet example trains with synchronized BatchNorm,
  `nn.BatchNorm(use_running_average=False, axis_name=...)`, which `pmean`s the batch statistics over
  the data axis inside the model.
- `psum_tokens`: a token-level loss normalised by the global token count, `psum`med over the data axis
  (padded sequences, a different number of real tokens on every device).

Inside a map over the data axis (pmap, a user's shard_map, make_train_step with a mesh, `ja.grad` in a
user's jit) a collective means what it means in the user's own shard_map: over the devices that hold the
same microbatch. Outside one, plain JAX fails ("unbound axis name"), jaxaccum aside; the zoo marks those
cells not applicable and tests/test_zoo.py shows JAX's own error.

What the steps compute is the mean over devices of each device's gradient (the mean-loss convention
of every data-parallel step, pmap's `pmean` of gradients). So a loss normalised by a *global* count is
written as its device's share of the mean: `axis_size * local_sum / psum(count)`, whose device-mean is
`sum / count` over every device's tokens (docs/guides/train-step.md, "Collectives in the loss").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax import lax

from zoo import Model

F64 = jnp.float64
AXIS = "data"


# --- synchronized BatchNorm (Flax's ImageNet example) ---------------------------------------------------------------
class SyncBNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(6, param_dtype=F64)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, param_dtype=F64, axis_name=AXIS)(x)
    x = nn.relu(x)
    return nn.Dense(3, param_dtype=F64)(x)


_sync_bn = SyncBNNet()


def _sync_bn_init(key):
  # Initialised under a size-1 map over the axis, as the example initialises under pmap.
  variables = jax.vmap(lambda k: _sync_bn.init(k, jnp.zeros((2, 4), F64)), axis_name=AXIS)(key[None])
  variables = jax.tree.map(lambda x: x[0], variables)
  return variables["params"], variables["batch_stats"]


def _sync_bn_loss(params, batch_stats, batch):
  logits, updates = _sync_bn.apply(
    {"params": params, "batch_stats": batch_stats}, batch["x"], train=True, mutable=["batch_stats"]
  )
  loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]))
  return loss, updates["batch_stats"]


def _classes(key, n):
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, (n, 4), F64), "label": jax.random.randint(ky, (n,), 0, 3)}


SYNC_BN = Model(
  name="sync_bn",
  framework="linen",
  what='`nn.BatchNorm(axis_name="data")`, Flax\'s ImageNet synchronized BatchNorm (`pmean` of the statistics '
  "over the data axis inside the model)",
  init=_sync_bn_init,
  loss=_sync_bn_loss,
  batch=_classes,
  has_state=True,
  grouped=True,  # the statistics of each microbatch, across the devices that share it
  syncs=AXIS,
  linen=(_sync_bn, None),
)


# --- a token loss over the global token count -------------------------------------------------------------------------
def _tokens_init(key, d=4):
  k1, k2 = jax.random.split(key)
  return {"w": jax.random.normal(k1, (d, d), F64) / 2, "v": jax.random.normal(k2, (d,), F64) / 2}


def _tokens_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w"])
  err = (h @ params["v"] - batch["y"]) ** 2  # (rows, tokens)
  local_sum = jnp.sum(batch["mask"] * err)
  count = lax.psum(jnp.sum(batch["mask"]), AXIS)  # every device's real tokens
  return lax.psum(1, AXIS) * local_sum / count  # this device's share of the global token mean


def _tokens_batch(key, n, t=5, d=4):
  kx, ky, km = jax.random.split(key, 3)
  lengths = jax.random.randint(km, (n,), 1, t + 1)  # 1..t real tokens per row
  return {
    "x": jax.random.normal(kx, (n, t, d), F64),
    "y": jax.random.normal(ky, (n, t), F64),
    "mask": (jnp.arange(t)[None, :] < lengths[:, None]).astype(F64),
  }


PSUM_TOKENS = Model(
  name="psum_tokens",
  framework="jax",
  what="a padded token loss over the global token count, `psum`med over the data axis inside the loss",
  init=_tokens_init,
  loss=_tokens_loss,
  batch=_tokens_batch,
  grouped=True,  # each microbatch's token mean, across the devices that share it
  syncs=AXIS,
)

MODELS = [SYNC_BN, PSUM_TOKENS]
