"""Models that combine a parameter with a NumPy constant, as model code does (issue #31).

A fixed mask, a sinusoidal positional table, a fixed projection: module-level
`np` arrays read in one operation with a parameter (`w * MASK`, `pos + PE`,
`w @ PROJ`). fsdp's per-microbatch gather used to replay such an operation
with the gathered parameter in place of the constant (`w * w`), a silent wrong
number. `MODELS` are the zoo's rows; `CASES` adds the other forms that went
wrong (NumPy index arrays, `jnp.asarray(np_array)` inside the loss, constants
in a scan body, a scan input scaled by a constant, `jnp.where` on a NumPy
boolean mask, `jnp.pad` of a parameter, a wide projection by a constant),
run by tests/test_layerwise.py through `make_train_step`.

Every weight has a side of 8 (or 16): fsdp on 8 devices and hsdp's shard
axis of 4 shard it, so the layerwise gather runs on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zoo import Model
from zoo.flax_models import regression

F64 = jnp.float64
D, T = 8, 4  # width, sequence length

MASK = np.triu(np.ones((D, D))) * (1.0 - 0.5 * (np.arange(D) % 2))  # a fixed structured mask
_pos, _freq = np.arange(T)[:, None], 10000.0 ** (-np.arange(0, D, 2) / D)
PE = np.concatenate([np.sin(_pos * _freq), np.cos(_pos * _freq)], axis=1)  # the sinusoidal table (T, D)
PROJ = np.linalg.qr(np.random.default_rng(0).normal(size=(D, D)))[0]  # a fixed orthogonal projection
WIDE = np.random.default_rng(1).normal(size=(D, 4 * D)) / 4.0  # a fixed wide projection (8 -> 32)
PERM = np.array([3, 0, 6, 1, 7, 2, 5, 4])  # a NumPy index array
KEEP = np.random.default_rng(2).uniform(size=(D, D)) > 0.3  # a NumPy boolean mask
FILL = np.full((D, D), 0.05)
SCALE = np.array([1.0, 0.5, 0.25]).reshape(3, 1, 1)  # per-layer scale of a stacked parameter


def _dense(key, m, n):
  return {"w": jax.random.normal(key, (m, n), F64) / jnp.sqrt(m), "b": jnp.full((n,), 0.1, F64)}


def _mse(pred, y):
  return jnp.mean(jnp.sum((pred - y) ** 2, -1))


def _init(key):
  """An input layer 3 -> 8, a hidden (8, 8) weight, a head 8 -> 2."""
  k1, k2, k3 = jax.random.split(key, 3)
  return {"inp": _dense(k1, 3, D), "w": jax.random.normal(k2, (D, D), F64) / 3, "out": _dense(k3, D, 2)}


def _hidden(params, batch, weight):
  """The MLP with its hidden weight replaced by `weight(params["w"])`."""
  h = jnp.tanh(batch["x"] @ params["inp"]["w"] + params["inp"]["b"])
  h = jnp.tanh(h @ weight(params["w"]))
  return _mse(h @ params["out"]["w"] + params["out"]["b"], batch["y"])


# --- the three zoo rows ------------------------------------------------------------------------------------------
def _mask_loss(params, batch):
  return _hidden(params, batch, lambda w: w * MASK)


def _pe_init(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "embed": jax.random.normal(k1, (3, D), F64) / 2,
    "pos": jax.random.normal(k2, (T, D), F64) / 4,  # learned positions, added to the fixed table
    "head": _dense(k3, D, 2),
  }


def _pe_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["embed"] + (params["pos"] + PE))  # (n, T, D)
  return _mse(h.mean(1) @ params["head"]["w"] + params["head"]["b"], batch["y"])


def _seq_batch(key, n):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (n, T, 3), F64)
  return {"x": x, "y": jnp.sin(x.sum(1) @ jax.random.normal(ky, (3, 2), F64))}


def _proj_loss(params, batch):
  return _hidden(params, batch, lambda w: w @ PROJ)


MASKED_WEIGHT = Model(
  "numpy_mask", "jax", "a weight times a module-level NumPy mask (`w * MASK`)", _init, _mask_loss, regression
)
POS_TABLE = Model(
  "numpy_pos_table", "jax", "learned positions plus a NumPy sinusoidal table (`pos + PE`)", _pe_init, _pe_loss,
  _seq_batch,
)  # fmt: skip
PROJECTION = Model(
  "numpy_projection", "jax", "a weight times a fixed NumPy projection (`w @ PROJ`)", _init, _proj_loss, regression
)

MODELS = [MASKED_WEIGHT, POS_TABLE, PROJECTION]


# --- the other forms (tests/test_layerwise.py) -------------------------------------------------------------------
def _stack_init(key, depth=3):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "inp": _dense(k1, 3, D),
    "layers": {"w": jax.random.normal(k2, (depth, D, D), F64) / 3, "b": jnp.full((depth, D), 0.1, F64)},
    "out": _dense(k3, D, 2),
  }


def _stacked(params, batch, xs, body_weight):
  h = jnp.tanh(batch["x"] @ params["inp"]["w"] + params["inp"]["b"])
  h, _ = lax.scan(lambda h, layer: (jnp.tanh(h @ body_weight(layer["w"]) + layer["b"]), None), h, xs)
  return _mse(h @ params["out"]["w"] + params["out"]["b"], batch["y"])


def _scan_const_loss(params, batch):
  # Constants read inside the scan body: a mask on each layer's weight.
  return _stacked(params, batch, params["layers"], lambda w: w * MASK)


def _scan_scaled_loss(params, batch):
  # The stacked weight scaled by a constant before it is fed to the scan.
  layers = {"w": params["layers"]["w"] * SCALE, "b": params["layers"]["b"]}
  return _stacked(params, batch, layers, lambda w: w)


def _rows(w):
  # `w[PERM]` normalises the indices with jnp ops (traced values); lax.gather reads the NumPy array as is.
  dims = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
  picked = lax.gather(w, PERM[:, None], dims, (1, D), mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
  return 0.5 * (picked + w[PERM])


CASES = [
  *MODELS,
  Model("numpy_index", "jax", "rows picked by a NumPy index array (`lax.gather(w, PERM[:, None], ...)`, `w[PERM]`)",
        _init, lambda p, b: _hidden(p, b, _rows), regression),
  Model("asarray_inside", "jax", "`w * jnp.asarray(MASK)` written inside the loss", _init,
        lambda p, b: _hidden(p, b, lambda w: w * jnp.asarray(MASK)), regression),
  Model("scan_body_constant", "jax", "a NumPy mask read inside a `lax.scan` body over stacked layers", _stack_init,
        _scan_const_loss, regression),
  Model("scan_xs_scaled", "jax", "stacked layers scaled by a NumPy array, then scanned", _stack_init,
        _scan_scaled_loss, regression),
  Model("where_numpy_bool", "jax", "`jnp.where(KEEP, w, FILL)`, KEEP a NumPy boolean mask", _init,
        lambda p, b: _hidden(p, b, lambda w: jnp.where(KEEP, w, FILL)), regression),
  Model("pad_param", "jax", "`jnp.pad` of a sharded weight on the gradient path", _init,
        lambda p, b: _hidden(p, b, lambda w: jnp.pad(w, ((0, 0), (0, D)))[:, D // 2 : D // 2 + D]), regression),
  Model("wide_projection", "jax", "a weight times a wide NumPy projection (`(w @ WIDE)` 8 -> 32, folded)", _init,
        lambda p, b: _hidden(p, b, lambda w: (w @ WIDE).reshape(D, 4, D).sum(1)), regression),
]  # fmt: skip
