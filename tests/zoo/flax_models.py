"""Flax models as the Flax docs write them: a linen MLP, a linen CNN with BatchNorm, an nnx
transformer block with dropout, and nnx layers stacked with nnx.vmap and applied with nnx.scan."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights

from zoo import Model

F64 = jnp.float64


def regression(key, n, d_in=3, d_out=2):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (n, d_in), F64)
  return {"x": x, "y": jnp.sin(x @ jax.random.normal(ky, (d_in, d_out), F64))}


# --- linen MLP -------------------------------------------------------------------------------------------------------
class MLP(nn.Module):
  features: Sequence[int]

  @nn.compact
  def __call__(self, x):
    for f in self.features[:-1]:
      x = nn.tanh(nn.Dense(f, param_dtype=F64)(x))
    return nn.Dense(self.features[-1], param_dtype=F64)(x)


_mlp = MLP((8, 2))


def _mlp_loss(params, batch):
  pred = _mlp.apply({"params": params}, batch["x"])
  return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, -1))


LINEN_MLP = Model(
  name="linen_mlp",
  framework="linen",
  what="`flax.linen` Dense/tanh MLP",
  init=lambda key: _mlp.init(key, jnp.zeros((1, 3), F64))["params"],
  loss=_mlp_loss,
  batch=regression,
  linen=(_mlp, None),
)


# --- linen CNN with BatchNorm ------------------------------------------------------------------------------------
class CNN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(3, (3, 3), param_dtype=F64)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, param_dtype=F64)(x)
    x = nn.relu(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(2, param_dtype=F64)(x)


_cnn = CNN()


def _cnn_init(key):
  variables = _cnn.init(key, jnp.zeros((2, 5, 5, 1), F64))
  return variables["params"], variables["batch_stats"]


def _cnn_loss(params, batch_stats, batch):
  logits, updates = _cnn.apply(
    {"params": params, "batch_stats": batch_stats}, batch["x"], train=True, mutable=["batch_stats"]
  )
  loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]))
  return loss, updates["batch_stats"]


def _images(key, n):
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, (n, 5, 5, 1), F64), "label": jax.random.randint(ky, (n,), 0, 2)}


LINEN_CNN_BN = Model(
  name="linen_cnn_bn",
  framework="linen",
  what="`flax.linen` Conv + BatchNorm (batch_stats as model state; ghost batch norm per microbatch)",
  init=_cnn_init,
  loss=_cnn_loss,
  batch=_images,
  has_state=True,
  grouped=True,
  linen=(_cnn, None),
)


# --- nnx transformer block with dropout ------------------------------------------------------------------------------
def attention(query, key, value, **_):
  # nnx's default routes to jax.nn.dot_product_attention (softmax in float32 whatever the inputs): in float64
  # that is 1e-8 noise, so the block uses nnx's own weights function (softmax in the inputs' dtype).
  return jnp.einsum("...hqk,...khd->...qhd", dot_product_attention_weights(query, key), value)


class Block(nnx.Module):
  def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
    self.attn = nnx.MultiHeadAttention(
      num_heads=heads, in_features=d, qkv_features=d, decode=False, param_dtype=F64, attention_fn=attention, rngs=rngs
    )
    self.norm1 = nnx.LayerNorm(d, param_dtype=F64, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d, param_dtype=F64, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, param_dtype=F64, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, param_dtype=F64, rngs=rngs)
    self.drop = nnx.Dropout(0.25)
    self.head = nnx.Linear(d, 1, param_dtype=F64, rngs=rngs)

  def __call__(self, x, *, rngs: nnx.Rngs):
    x = x + self.drop(self.attn(self.norm1(x)), rngs=rngs)
    x = x + self.drop(self.down(nnx.gelu(self.up(self.norm2(x)))), rngs=rngs)
    return self.head(x)[..., 0]


def _block_loss(model, batch):
  # One dropout key per row: each row draws its masks from its own key, however the batch is split.
  def row(x, key):
    return model(x[None], rngs=nnx.Rngs(dropout=key))[0]

  pred = jax.vmap(row)(batch["x"], batch["keys"])
  return jnp.mean((pred - batch["y"]) ** 2)


_block_graph = nnx.graphdef(Block(4, 2, rngs=nnx.Rngs(0)))


def _block_init(key):
  return nnx.state(Block(4, 2, rngs=nnx.Rngs(params=key)))


def _block_merge(params):
  return nnx.merge(_block_graph, params)


def _sequences(key, n, t=3, d=4):
  kx, ky, kk = jax.random.split(key, 3)
  return {
    "x": jax.random.normal(kx, (n, t, d), F64),
    "y": jax.random.normal(ky, (n, t), F64),
    "keys": jax.random.key_data(jax.random.split(kk, n)),
  }


NNX_TRANSFORMER = Model(
  name="nnx_transformer",
  framework="nnx",
  what="`flax.nnx` attention block with LayerNorm, MLP and Dropout (a dropout key per row)",
  init=_block_init,
  loss=lambda params, batch: _block_loss(_block_merge(params), batch),
  batch=_sequences,
  nnx=(_block_merge, _block_loss),
)


# --- nnx.scan over layers stacked by nnx.vmap ------------------------------------------------------------------------
class Layer(nnx.Module):
  def __init__(self, d: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(d, d, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


class Stack(nnx.Module):
  def __init__(self, d: int, depth: int, *, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs):
      return Layer(d, rngs=rngs)

    self.inp = nnx.Linear(3, d, param_dtype=F64, rngs=rngs)
    self.layers = make(rngs)
    self.out = nnx.Linear(d, 2, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return layer(x)

    return self.out(body(self.inp(x), self.layers))


def _stack_loss(model, batch):
  return jnp.mean(jnp.sum((model(batch["x"]) - batch["y"]) ** 2, -1))


_stack_graph = nnx.graphdef(Stack(4, 3, rngs=nnx.Rngs(0)))


def _stack_merge(params):
  return nnx.merge(_stack_graph, params)


NNX_SCAN = Model(
  name="nnx_scan",
  framework="nnx",
  what="`flax.nnx` layers stacked with `nnx.vmap`, applied with `nnx.scan`",
  init=lambda key: nnx.state(Stack(4, 3, rngs=nnx.Rngs(params=key))),
  loss=lambda params, batch: _stack_loss(_stack_merge(params), batch),
  batch=regression,
  nnx=(_stack_merge, _stack_loss),
)

MODELS = [LINEN_MLP, LINEN_CNN_BN, NNX_TRANSFORMER, NNX_SCAN]
