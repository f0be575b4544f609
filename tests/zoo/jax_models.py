"""Plain-JAX models, each bringing one construct the JAX docs teach (see each Model's `what`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from zoo import Model
from zoo.flax_models import regression

F64 = jnp.float64


def _dense(key, m, n, dtype=F64):
  return {"w": (jax.random.normal(key, (m, n)) / jnp.sqrt(m)).astype(dtype), "b": jnp.full((n,), 0.1, dtype)}


def _mse(pred, y):
  return jnp.mean(jnp.sum((pred - y) ** 2, -1))


def _mlp_init(key, sizes=(3, 6, 2), dtype=F64):
  return [
    _dense(k, m, n, dtype) for k, m, n in zip(jax.random.split(key, len(sizes) - 1), sizes[:-1], sizes[1:], strict=True)
  ]


def _mlp(params, x, act=jnp.tanh):
  for layer in params[:-1]:
    x = act(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


# --- the JAX docs' shard_map tensor-parallel layer ---------------------------------------------------------------
def _tp_layer(x, w1, w2):
  # Megatron style: w1 split by columns, w2 by rows over "model"; one psum gives the layer's output.
  return lax.psum(jnp.tanh(x @ w1) @ w2, "model")


def _tp_loss(params, batch):
  layer = jax.shard_map(
    _tp_layer, in_specs=(P(), P(None, "model"), P("model", None)), out_specs=P(), axis_names={"model"}
  )
  return _mse(layer(batch["x"], params["w1"], params["w2"]) + params["b"], batch["y"])


def _tp_init(key):
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (3, 8), F64) / 2,
    "w2": jax.random.normal(k2, (8, 2), F64) / 3,
    "b": jnp.full((2,), 0.1, F64),
  }


TP = Model(
  name="shard_map_tp",
  framework="jax",
  what='the docs\' `jax.shard_map` tensor-parallel MLP (nested shard_map over "model", `psum` inside)',
  init=_tp_init,
  loss=_tp_loss,
  batch=regression,
  mesh_axes=(("model", 2),),
)


# --- the training cookbook's explicit-sharding transformer (activations annotated with the data axis) -------------
def _cookbook_init(key, d=4, t=3):
  ks = jax.random.split(key, 5)
  return {
    "embed": jax.random.normal(ks[0], (3, d), F64) / 2,
    "pos": jax.random.normal(ks[1], (t, d), F64) / 4,
    "wqkv": jax.random.normal(ks[2], (d, 3, d), F64) / 2,
    "wo": jax.random.normal(ks[3], (d, d), F64) / 2,
    "head": jax.random.normal(ks[4], (d, 2), F64) / 2,
  }


def _cookbook_loss(params, batch):
  data = P("data")
  x = jnp.einsum("btf,fd->btd", batch["x"], params["embed"], out_sharding=data) + params["pos"]
  q, k, v = jnp.unstack(jnp.einsum("btd,dhe->bhte", x, params["wqkv"], out_sharding=data), axis=1)
  a = jax.nn.softmax(jnp.einsum("bte,bse->bts", q, k, out_sharding=data) / 2.0, axis=-1)
  x = x + jnp.einsum("bts,bse,ed->btd", a, v, params["wo"], out_sharding=data)
  x = jax.sharding.reshard(jnp.mean(x, axis=1), data)
  return _mse(x @ params["head"], batch["y"])


def _cookbook_batch(key, n, t=3):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (n, t, 3), F64)
  return {"x": x, "y": jnp.sin(x.sum(1) @ jax.random.normal(ky, (3, 2), F64))}


COOKBOOK = Model(
  name="cookbook_explicit",
  framework="jax",
  what='the training cookbook\'s explicit-sharding attention (einsums with `out_sharding=P("data")`, `reshard`)',
  init=_cookbook_init,
  loss=_cookbook_loss,
  batch=_cookbook_batch,
  explicit=True,
)


# --- stacked layers under lax.scan, and under lax.fori_loop --------------------------------------------------------
def _stack_init(key, d=4, depth=3):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "inp": _dense(k1, 3, d),
    "layers": {"w": jax.random.normal(k2, (depth, d, d), F64) / 2, "b": jnp.full((depth, d), 0.1, F64)},
    "out": _dense(k3, d, 2),
  }


def _scan_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["inp"]["w"] + params["inp"]["b"])
  h, _ = lax.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None), h, params["layers"])
  return _mse(h @ params["out"]["w"] + params["out"]["b"], batch["y"])


def _fori_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["inp"]["w"] + params["inp"]["b"])
  layers = params["layers"]
  h = lax.fori_loop(0, layers["w"].shape[0], lambda i, h: jnp.tanh(h @ layers["w"][i] + layers["b"][i]), h)
  return _mse(h @ params["out"]["w"] + params["out"]["b"], batch["y"])


SCAN = Model("lax_scan_layers", "jax", "stacked layers applied with `lax.scan`", _stack_init, _scan_loss, regression)
FORI = Model(
  "fori_loop_layers", "jax", "stacked layers applied with `lax.fori_loop` (dynamic index)", _stack_init, _fori_loss,
  regression,
)  # fmt: skip


# --- an RNN whose lax.scan starts from zeros ----------------------------------------------------------------------
def _rnn_init(key, d=4):
  k1, k2, k3 = jax.random.split(key, 3)
  return {"wx": jax.random.normal(k1, (2, d), F64) / 2, "wh": jax.random.normal(k2, (d, d), F64) / 2,
          "out": _dense(k3, d, 2)}  # fmt: skip


def _rnn_loss(params, batch):
  xs = jnp.swapaxes(batch["x"], 0, 1)  # time-major
  h0 = jnp.zeros((xs.shape[1], params["wh"].shape[0]), xs.dtype)
  h, _ = lax.scan(lambda h, x: (jnp.tanh(x @ params["wx"] + h @ params["wh"]), None), h0, xs)
  return _mse(h @ params["out"]["w"] + params["out"]["b"], batch["y"])


def _rnn_batch(key, n, t=4):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (n, t, 2), F64)
  return {"x": x, "y": jnp.cos(x.sum(1) @ jax.random.normal(ky, (2, 2), F64))}


RNN = Model(
  "rnn_zeros_carry", "jax", "an RNN: `lax.scan` over time from `h0 = zeros`", _rnn_init, _rnn_loss, _rnn_batch
)


# --- custom derivatives ---------------------------------------------------------------------------------------------
@jax.custom_jvp
def softplus(x):
  return jnp.logaddexp(x, 0.0)


@softplus.defjvp
def _softplus_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return softplus(x), jax.nn.sigmoid(x) * t


@jax.custom_vjp
def linear(x, w):
  return x @ w


def _linear_fwd(x, w):
  return x @ w, (x, w)


def _linear_bwd(res, ct):
  x, w = res
  return ct @ w.T, x.T @ ct


linear.defvjp(_linear_fwd, _linear_bwd)


# The JAX tutorial's clip_gradient: the identity forward, the cotangent clipped backward (nonlinear in it).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def clip_gradient(lo, hi, x):
  return x


def _clip_fwd(lo, hi, x):
  return x, None


def _clip_bwd(lo, hi, _, g):
  return (jnp.clip(g, lo, hi),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def _jvp_loss(params, batch):
  return _mse(_mlp(params, batch["x"], act=softplus), batch["y"])


def _vjp_loss(params, batch):
  h = jnp.tanh(linear(batch["x"], params[0]["w"]) + params[0]["b"])
  return _mse(linear(h, params[1]["w"]) + params[1]["b"], batch["y"])


def _clip_loss(params, batch):
  first = {"w": clip_gradient(-0.05, 0.05, params[0]["w"]), "b": params[0]["b"]}
  return _mse(_mlp([first, *params[1:]], batch["x"]), batch["y"])


JVP = Model("custom_jvp_act", "jax", "a `jax.custom_jvp` activation (softplus)", _mlp_init, _jvp_loss, regression)
VJP = Model("custom_vjp_layer", "jax", "a `jax.custom_vjp` linear layer", _mlp_init, _vjp_loss, regression)
CLIP = Model(
  name="clip_gradient",
  framework="jax",
  what="the tutorial's `clip_gradient` (custom_vjp clipping the cotangent: nonlinear) on a weight",
  init=_mlp_init,
  loss=_clip_loss,
  batch=regression,
  grouped=True,  # the clip is applied to each group's own cotangent
)


# --- a masked loss where a device may hold only padding rows --------------------------------------------------------
def _masked_loss(params, batch):
  err = jnp.sum((_mlp(params, batch["x"]) - batch["y"]) ** 2, -1)
  return jnp.sum(batch["mask"] * err) / jnp.sum(batch["mask"])  # 0/0 on a piece of padding only


def _masked_batch(key, n):
  batch = regression(key, n)
  return {**batch, "mask": (jnp.arange(n) < n - n // 8).astype(F64)}  # the last device's rows: padding


MASKED = Model(
  name="masked_padding",
  framework="jax",
  what="`sum(mask * err) / sum(mask)`, the last eighth of the rows padding (weight_fn = mask sum)",
  init=_mlp_init,
  loss=_masked_loss,
  batch=_masked_batch,
  weight_fn=lambda rows: jnp.sum(rows["mask"]),
)


# --- jax.checkpoint with a policy -----------------------------------------------------------------------------------
def _remat_loss(params, batch):
  layer = jax.checkpoint(
    lambda p, x: jnp.tanh(x @ p["w"] + p["b"]), policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  )
  h = batch["x"]
  for p in params[:-1]:
    h = layer(p, h)
  return _mse(h @ params[-1]["w"] + params[-1]["b"], batch["y"])


REMAT = Model(
  "remat_policy", "jax", "layers under `jax.checkpoint(policy=dots_with_no_batch_dims_saveable)`",
  lambda key: _mlp_init(key, (3, 5, 5, 2)), _remat_loss, regression,
)  # fmt: skip


# --- a tied embedding / output weight (integer tokens) ----------------------------------------------------------------
def _tied_init(key, vocab=7, d=4):
  k1, k2 = jax.random.split(key)
  return {"embed": jax.random.normal(k1, (vocab, d), F64) / 2, "mix": jax.random.normal(k2, (d, d), F64) / 2}


def _tied_loss(params, batch):
  h = params["embed"][batch["tokens"]]  # (n, t, d)
  h = jnp.tanh(jnp.cumsum(h, axis=1) @ params["mix"])
  logits = h @ params["embed"].T  # the same weight reads the output
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["tokens"][:, 1:]))


TIED = Model(
  "tied_embedding", "jax", "an embedding matrix reused as the output projection (int32 tokens)",
  _tied_init, _tied_loss, lambda key, n: {"tokens": jax.random.randint(key, (n, 4), 0, 7)},
)  # fmt: skip


# --- lax.cond on a parameter -------------------------------------------------------------------------------------
def _cond_init(key):
  return {"gate": jnp.asarray(0.3, F64), "mlp": _mlp_init(key)}


def _cond_loss(params, batch):
  pred = lax.cond(
    params["gate"] > 0,
    lambda: params["gate"] * _mlp(params["mlp"], batch["x"]),
    lambda: _mlp(params["mlp"], batch["x"], act=jax.nn.relu),
  )
  return _mse(pred, batch["y"])


COND = Model("cond_on_param", "jax", "`lax.cond` whose predicate is a parameter", _cond_init, _cond_loss, regression)


# --- integer, scalar and empty leaves ------------------------------------------------------------------------------
def _odd_init(key):
  k1, _ = jax.random.split(key)
  return {"w": jax.random.normal(k1, (3, 3), F64) / 2, "scale": jnp.asarray(1.5, F64), "empty": jnp.zeros((0, 3), F64)}


def _odd_loss(params, batch):
  logits = params["scale"] * jnp.tanh(batch["x"] @ params["w"]) + jnp.sum(params["empty"], axis=0)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]))


def _odd_batch(key, n):
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, (n, 3), F64), "label": jax.random.randint(ky, (n,), 0, 3).astype(jnp.int32)}


ODD = Model(
  "odd_leaves", "jax", "a scalar and an empty (0, 3) parameter, int32 labels in the batch", _odd_init, _odd_loss,
  _odd_batch,
)  # fmt: skip


# --- bf16 parameters ------------------------------------------------------------------------------------------------
def _bf16_loss(params, batch):
  pred = _mlp(params, batch["x"].astype(jnp.bfloat16)).astype(jnp.float32)
  return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, -1))


BF16 = Model(
  name="bf16_params",
  framework="jax",
  what="a tanh MLP with bfloat16 parameters (tolerance scaled to bf16)",
  init=lambda key: _mlp_init(key, dtype=jnp.bfloat16),
  loss=_bf16_loss,
  batch=lambda key, n: jax.tree.map(lambda a: a.astype(jnp.float32), regression(key, n)),
  rtol=2e-2,
  atol=2e-2,
)

MODELS = [TP, COOKBOOK, SCAN, FORI, RNN, JVP, VJP, CLIP, MASKED, REMAT, TIED, COND, ODD, BF16]
