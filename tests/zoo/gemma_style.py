"""A Gemma-style decoder written for explicit sharding, in the layout of Flax's Gemma example's fsdp + tensor-
parallel config (issue 49: model-axis bytes of ddp/zero1 against the plain step on that config).

Written here, not copied: grouped-query attention (two query heads per key/value head), RMSNorm with (1 +
scale), pre- and post-norms around attention and the gated-GELU feed-forward, the embedding scaled by
sqrt(width) and tied to the output layer. The layout table is the example's (`ShardingConfig.fsdp_tp_sharding`
with fsdp="data", tp="model"): the embedding table (vocab, width) on ("model", "data"), query kernels (heads,
width, head_dim) on ("model", "data", None), the key/value kernels (2, kv_heads, width, head_dim) on (None,
"model", "data", None), the output kernel (heads, head_dim, width) on ("model", None, "data"), the feed-forward
kernels (width, hidden) on ("data", "model") and (hidden, width) on ("model", "data"), the norms' scales on
("model",); activations (batch, seq, width) on ("data", None, "model"), (batch, seq, hidden) on ("data", None,
"model").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum.bench.model_axis import token_batch

ACT_BTD = P("data", None, "model")
ACT_BTF = P("data", None, "model")
ACT_BTNH = P("data", None, "model", None)


def init(key, *, vocab=64, width=32, heads=4, kv_heads=2, head_dim=8, hidden=64, layers=2, dtype=jnp.float32):
  ks = iter(jax.random.split(key, 6 * layers + 1))
  normal = lambda shape, scale: (scale * jax.random.normal(next(ks), shape)).astype(dtype)
  layer = lambda: {
    "q": normal((heads, width, head_dim), width**-0.5),
    "kv": normal((2, kv_heads, width, head_dim), width**-0.5),
    "o": normal((heads, head_dim, width), (heads * head_dim) ** -0.5),
    "gate": normal((2, width, hidden), width**-0.5),
    "down": normal((hidden, width), hidden**-0.5),
    **{n: jnp.zeros((width,), dtype) for n in ("pre_attn", "post_attn", "pre_ffw", "post_ffw")},
  }
  return {
    "embed": normal((vocab, width), width**-0.5),
    "final_norm": jnp.zeros((width,), dtype),
    "layers": [layer() for _ in range(layers)],
  }


def specs(params):
  layer = {
    "q": P("model", "data", None),
    "kv": P(None, "model", "data", None),
    "o": P("model", None, "data"),
    "gate": P(None, "data", "model"),
    "down": P("model", "data"),
    **{n: P("model") for n in ("pre_attn", "post_attn", "pre_ffw", "post_ffw")},
  }
  return {"embed": P("model", "data"), "final_norm": P("model"), "layers": [dict(layer) for _ in params["layers"]]}


def _norm(x, scale):
  var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


def loss(params, batch):
  """Mean next-token cross-entropy; every einsum's output annotated as Explicit meshes ask."""
  tokens, targets = batch["inputs"], batch["targets"]
  vocab, width = params["embed"].shape
  seq = tokens.shape[1]
  x = params["embed"].at[tokens].get(out_sharding=ACT_BTD) * jnp.sqrt(jnp.asarray(width, params["embed"].dtype))
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  for lp in params["layers"]:
    h = _norm(x, lp["pre_attn"])
    q = jnp.einsum("btd,ndh->btnh", h, lp["q"], out_sharding=ACT_BTNH)
    k, v = (jnp.einsum("btd,ndh->btnh", h, lp["kv"][i], out_sharding=P("data", None, None, None)) for i in (0, 1))
    heads = q.shape[2]
    k, v = (jnp.repeat(t, heads // t.shape[2], axis=2, out_sharding=ACT_BTNH) for t in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q, k, out_sharding=P("data", "model", None, None)) * q.shape[-1] ** -0.5
    a = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
    o = jnp.einsum("bnts,bsnh->btnh", a, v, out_sharding=ACT_BTNH)
    x = x + _norm(jnp.einsum("btnh,nhd->btd", o, lp["o"], out_sharding=ACT_BTD), lp["post_attn"])
    h = _norm(x, lp["pre_ffw"])
    g = jnp.einsum("btd,df->btf", h, lp["gate"][0], out_sharding=ACT_BTF)
    u = jnp.einsum("btd,df->btf", h, lp["gate"][1], out_sharding=ACT_BTF)
    f = jnp.einsum("btf,fd->btd", jax.nn.gelu(g) * u, lp["down"], out_sharding=ACT_BTD)
    x = x + _norm(f, lp["post_ffw"])
  logits = jnp.einsum(
    "btd,vd->btv", _norm(x, params["final_norm"]), params["embed"], out_sharding=P("data", None, "model")
  )
  logp = jax.nn.log_softmax(logits, axis=-1)
  onehot = jax.sharding.reshard(jax.nn.one_hot(targets, vocab, dtype=logp.dtype), P("data", None, "model"))
  return -jnp.mean(jnp.sum(logp * onehot, axis=-1))


def model(dtype=jnp.float32):
  """(name, loss, placed params, batch, mesh) on an Explicit (data=4, model=2) mesh, as `bench.model_axis` models."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  params = init(jax.random.key(0), dtype=dtype)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(params), is_leaf=lambda x: isinstance(x, P))
  with jax.set_mesh(mesh):
    placed = jax.device_put(params, shardings)
  batch = token_batch(0, rows=16, seq=8, vocab=64)  # the bench models' token batch
  return "Gemma-style (Flax example's fsdp + tp layout, Explicit mesh)", loss, placed, batch, mesh
