"""Benchmark section: FSDP's per-device peak memory and bytes on the wire, layer by layer.

`python -m jaxaccum.bench --sections fsdp` (8 devices, simulated on CPU). A
tanh MLP of L square layers (12 x 512 float32 by default), adam, batch 256, K
microbatches per step, the layers either listed (a list of {"w", "b"}) or
stacked and applied with `lax.scan` (the MaxText/Levanter style). Steps:

- (a) `reference`: hand-written layerwise FSDP under shard_map: each layer a
  custom_vjp that all-gathers its weights (forward, with a data dependence on
  the layer input; backward again, with one on the cotangent) and
  `psum_scatter`s its gradient into a 1/P accumulator;
- (b) `_layerwise` alone: `jaxaccum._layerwise.layerwise(loss)` inside the same
  bare shard_map microbatch loop and 1/P accumulator as (a) (the model code
  unchanged, no jaxaccum step around it): the engine's mechanism by itself;
- (c) jaxaccum's step, `ja.make_train_step(strategy="fsdp")` with
  `fsdp_gather="per_microbatch"` (the default: the engine runs the loss
  through `_layerwise`, so (c) should equal (b)) and `"once"`;
- (d) a user's plain `jax.jit` over FSDP-sharded params and state with a
  `lax.scan` over microbatches (contiguous and strided splits of the batch).

A second table puts every strategy side by side on the listed model
(`ja.make_train_step(strategy=...)`: ddp, zero1, fsdp and hsdp in both gather
modes), with the floor on paper of each. A third puts each strategy's step
beside the same step whose update always applies (adam and
clip_by_global_norm + adamw): a skipped update must cost no memory.

Per-device peak from the compiled memory analysis: argument + output + temp -
alias, params and state donated. Collectives: every instruction of the
compiled HLO weighted by how many times it runs per step (loop trip counts),
with the bytes one device sends on a ring. No timing: the same numbers on any
machine with this XLA. CPU memory analysis is indicative: a GPU/TPU scheduler
may prefetch the next layer's gather (one more layer alive).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxaccum as ja
from jaxaccum import _engine, _hlo
from jaxaccum._layerwise import layerwise

# --------------------------------------------------------------------------- the model


def _params(kind: str, width: int, depth: int, key):
  keys = jax.random.split(key, depth)
  ws = [jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width) for k in keys]
  bs = [jnp.full((width,), 0.01, jnp.float32) for _ in keys]
  if kind == "listed":
    return [{"w": w, "b": b} for w, b in zip(ws, bs, strict=True)]
  return {"w": jnp.stack(ws), "b": jnp.stack(bs)}


def _loss(kind: str) -> Callable:
  """Mean squared error of a tanh MLP on `(x, y)`; the same function of the same numbers in both layouts."""
  if kind == "listed":

    def apply(params, x):
      for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
      return x

  else:

    def apply(params, x):
      h, _ = lax.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None), x, params)
      return h

  def loss(params, x, y):
    return jnp.mean((apply(params, x) - y) ** 2)

  return loss


# --------------------------------------------------------------------------- (a) the hand-written reference


def _dep(x):
  """-0.0 from one element of `x`: a real data dependence that adds nothing."""
  s = lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(())
  return -(jnp.abs(jnp.where(jnp.isfinite(s), s, 0.0)) * 0.0)


def _reference_layer(axis: str):
  """tanh(h @ w + b) on the shards of w and b (dimension 0 of each), gathered inside, scattered backwards."""

  def full(w, b, z):
    return (lax.all_gather(v + z.astype(v.dtype), axis, axis=0, tiled=True, to="varying") for v in (w, b))

  @jax.custom_vjp
  def layer(w, b, h):
    fw, fb = full(w, b, _dep(h))
    return jnp.tanh(h @ fw + fb)

  def fwd(w, b, h):
    return layer(w, b, h), (w, b, h)

  def bwd(res, ct):
    w, b, h = res
    fw, fb = full(w, b, _dep(ct))
    _, vjp = jax.vjp(lambda fw, fb, h: jnp.tanh(h @ fw + fb), fw, fb, h)
    cw, cb, ch = vjp(ct)
    return lax.psum_scatter(cw, axis, tiled=True), lax.psum_scatter(cb, axis, tiled=True), ch

  layer.defvjp(fwd, bwd)
  return layer


def _reference_loss(kind: str, axis: str) -> Callable:
  layer = _reference_layer(axis)

  def loss(shards, x, y):
    if kind == "listed":
      for p in shards:
        x = layer(p["w"], p["b"], x)
    else:
      x, _ = lax.scan(lambda h, p: (layer(p["w"], p["b"], h), None), x, shards)
    return jnp.mean((x - y) ** 2)

  return loss


# --------------------------------------------------------------------------- the steps


def _specs(params):
  return jax.tree.map(lambda x: x.sharding.spec, params)


def _dims(params, axis: str):
  def dim(x):
    spec = list(x.sharding.spec)
    return spec.index(axis) if axis in spec else None

  return [dim(x) for x in jax.tree.leaves(params)]


def _shard_map_step(grad_fn, params, opt, mesh, k: int):
  """jit(step): a shard_map loop over K microbatches adding each sharded gradient into a 1/P accumulator."""
  specs = _specs(params)
  n = mesh.shape["data"]

  def grads(shards, x, y):
    xs = x.reshape((k, x.shape[0] // k) + x.shape[1:])
    ys = y.reshape((k, y.shape[0] // k) + y.shape[1:])

    def body(carry, i):
      acc, total = carry
      value, g = grad_fn(shards, xs[i], ys[i])
      return (jax.tree.map(jnp.add, acc, g), total + value), None

    zeros = jax.tree.map(jnp.zeros_like, shards)
    start = lax.pcast(jnp.zeros((), jnp.float32), "data", to="varying")
    (acc, total), _ = lax.scan(body, (zeros, start), jnp.arange(k))
    return acc, lax.psum(total, "data")

  def step(params, opt_state, x, y):
    g, total = jax.shard_map(
      grads,
      mesh=mesh,
      in_specs=(specs, PartitionSpec("data"), PartitionSpec("data")),
      out_specs=(specs, PartitionSpec()),
      axis_names={"data"},
    )(params, x, y)
    g = jax.tree.map(lambda v: v / (n * k), g)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, total / (n * k)

  return jax.jit(step, donate_argnums=(0, 1))


def _plain_jit_step(loss, opt, k: int, split: str):
  """A user's step: jit, params and state sharded as fsdp, a lax.scan over K microbatches."""

  def step(params, opt_state, x, y):
    if split == "contiguous":  # microbatch i = rows [i B/K, (i+1) B/K)
      xs, ys = (v.reshape((k, v.shape[0] // k) + v.shape[1:]) for v in (x, y))
    else:  # microbatch i = rows i, i+K, i+2K, ...: each device keeps its rows
      xs, ys = (jnp.moveaxis(v.reshape((v.shape[0] // k, k) + v.shape[1:]), 1, 0) for v in (x, y))

    def body(carry, mb):
      acc, total = carry
      value, g = jax.value_and_grad(loss)(params, *mb)
      return (jax.tree.map(jnp.add, acc, g), total + value), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (acc, total), _ = lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), (xs, ys))
    updates, opt_state = opt.update(jax.tree.map(lambda g: g / k, acc), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, total / k

  return jax.jit(step, donate_argnums=(0, 1))


# --------------------------------------------------------------------------- reading the compiled step


def peak_bytes(compiled) -> int:
  """argument + output + temp - alias of one device, from XLA's memory analysis."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def collectives_per_step(hlo_text: str, num_devices: int = 8) -> dict[str, dict[str, float]]:
  """{opcode: {"count", "bytes"}}: each collective weighted by the runs of its loops, ring bytes sent per device.

  A collective inside a while loop runs (trip count) times per run of the loop;
  nested loops multiply (a layer scan inside the microbatch loop: K L times).
  """
  return _hlo.per_call(hlo_text, num_devices)  # the counting of `ja.count_collectives` / `ja.collective_bytes`


# --------------------------------------------------------------------------- the tables

REFERENCE = "(a) hand-written layerwise reference"
LAYERWISE = "(b) `_layerwise` alone, bare shard_map loop"
JA = "(c) jaxaccum fsdp {}"
PLAIN = "(d) plain jit + scan, {} split"


def _measure(compiled, n_dev: int) -> dict:
  m = compiled.memory_analysis()
  return {
    "peak_bytes": peak_bytes(compiled),
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
    "collectives": collectives_per_step(compiled.as_text() or "", n_dev),
  }


def _compile(build, *args, n_dev: int) -> dict:
  """The compiled step's figures (a step that does not compile raises: a bug to see, not a row to skip)."""
  return _measure(build().lower(*args).compile(), n_dev)


def _floor(total: int, shards: int, layer: int, depth: int, rows_mb: int, width: int, batch_rows: int) -> dict:
  """The floor on paper of a layerwise step with state sharded `shards` ways: see the module docstring."""
  return {
    # params + adam's two moments + the accumulator, each 1/P of N
    "sharded_state": 4 * total // shards,
    # one gathered layer (w and b) and its full-size gradient before the reduce-scatter
    "gathered_layer_and_grad": 2 * layer,
    # one microbatch's saved layer inputs (the activations the backward pass needs)
    "activations": depth * rows_mb * width * 4,
    # the batch argument (x and y) on one device
    "batch": 2 * batch_rows * width * 4,
  }


def fsdp_table(width: int = 512, depth: int = 12, batch: int = 256, ks=(4, 8), kinds=("listed", "scanned")):
  """Rows {kind, K, case, peak_bytes, ..., collectives} and the paper floor per (kind, K)."""
  devices = jax.devices()[:8]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
  n_dev = 8
  opt = optax.adam(1e-3)
  rows, floors = [], {}
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (batch, width), jnp.float32)
  y = jnp.zeros((batch, width), jnp.float32)
  batch_sh = NamedSharding(mesh, PartitionSpec("data"))
  x, y = jax.device_put((x, y), batch_sh)
  for kind in kinds:
    params = _params(kind, width, depth, jax.random.PRNGKey(1))
    loss = _loss(kind)
    total = sum(v.nbytes for v in jax.tree.leaves(params))
    layer = (width * width + width) * 4
    for k in ks:
      floors[(kind, k)] = _floor(total, n_dev, layer, depth, batch // n_dev // k, width, batch // n_dev)
      cases: list[tuple[str, Any]] = []
      ref = _reference_loss(kind, "data")
      cases.append((REFERENCE, lambda p, s, ref=ref: _shard_map_step(jax.value_and_grad(ref), p, opt, mesh, k)))
      cases.append(
        (
          LAYERWISE,
          lambda p, s: _shard_map_step(
            jax.value_and_grad(layerwise(loss, _dims(p, "data"), "data", n_dev)), p, opt, mesh, k
          ),
        )
      )
      for gather in ("per_microbatch", "once"):
        cases.append((JA.format(gather), lambda p, s, gather=gather: _ja_step(loss, opt, mesh, k, "fsdp", gather)))
      for split in ("contiguous", "strided"):
        cases.append((PLAIN.format(split), lambda p, s, split=split: _plain_jit_step(loss, opt, k, split)))
      for name, build in cases:
        p, s = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
        args = (p, s, (x, y)) if name.startswith("(c)") else (p, s, x, y)
        got = _compile(lambda build=build, p=p, s=s: build(p, s), *args, n_dev=n_dev)
        rows.append({"kind": kind, "K": k, "case": name, "param_bytes": total, **got})
  return rows, floors


def strategy_table(width: int = 512, depth: int = 12, batch: int = 256, k: int = 4):
  """Every strategy's compiled step on the listed model at K: rows {case, peak_bytes, ..., floor}.

  The floor on paper of each, per device (N params, P = 8 devices, S = 4 the
  hsdp shard axis, L one layer, A one microbatch's saved layer inputs, B the
  batch): ddp 4N (params, adam's two moments, the accumulator) + L (a layer's
  gradient, added as it is produced) + A + B; zero1 2N + 2N/P (the local
  accumulator is full size until the one reduce-scatter); fsdp per_microbatch
  4N/P + L (the layer or its gradient) + A + B; fsdp once 2N + 3N/P + L + A + B
  (the gathered copy and the full accumulator); hsdp as fsdp with S for P.
  """
  devices = jax.devices()[:8]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
  hsdp_mesh = jax.make_mesh((2, 4), ("replica", "shard"), axis_types=(AxisType.Auto,) * 2, devices=devices)
  opt = optax.adam(1e-3)
  params = _params("listed", width, depth, jax.random.PRNGKey(1))
  loss = _loss("listed")
  n = sum(v.nbytes for v in jax.tree.leaves(params))
  layer = (width * width + width) * 4
  rows_dev = batch // 8
  act, data = depth * (rows_dev // k) * width * 4, 2 * rows_dev * width * 4
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, width), jnp.float32)
  y = jnp.zeros((batch, width), jnp.float32)
  cases: list[tuple[str, str, Any, Any, str | None, int]] = [  # name, strategy, mesh, data_axis, fsdp_gather, floor
    ("ddp", "ddp", mesh, "data", None, 4 * n + layer + act + data),
    ("zero1", "zero1", mesh, "data", None, 2 * n + 2 * n // 8 + layer + act + data),
    ("fsdp per_microbatch", "fsdp", mesh, "data", "per_microbatch", 4 * n // 8 + layer + act + data),
    ("fsdp once", "fsdp", mesh, "data", "once", 2 * n + 3 * n // 8 + layer + act + data),
    ("hsdp (2 x 4) per_microbatch", "hsdp", hsdp_mesh, ("replica", "shard"), "per_microbatch", n + layer + act + data),
    ("hsdp (2 x 4) once", "hsdp", hsdp_mesh, ("replica", "shard"), "once", 2 * n + 3 * n // 4 + layer + act + data),
  ]
  rows = []
  for name, strategy, m, axes, gather, floor in cases:
    p, s = ja.shard_train_state(params, opt, m, strategy=strategy, data_axis=axes)
    b = ja.shard_batch((x, y), m, axes)
    build = lambda strategy=strategy, m=m, axes=axes, gather=gather: _ja_step(loss, opt, m, k, strategy, gather, axes)
    got = _compile(build, p, s, b, n_dev=8)
    state = sum(_max_shard(v) for v in jax.tree.leaves(s))
    rows.append(
      {
        "case": name,
        "K": k,
        "param_bytes": n,
        "params_per_device": sum(_max_shard(v) for v in jax.tree.leaves(p)),
        "state_per_device": state,
        "floor_bytes": floor,
        **got,
      }
    )
  return rows


def skip_table(width: int = 512, depth: int = 12, batch: int = 256, k: int = 4, quick: bool = False):
  """A skipped update costs no memory: each strategy's step beside its twin whose update always applies.

  The step skips its update (zero total weight, a non-finite gradient) inside a
  conditional; the twin (`_engine.always_applied`) runs the update with no
  condition. Rows {optimizer, case, peak_bytes, twin_peak_bytes, ...} on the
  listed model, adam and clip_by_global_norm + adamw, every strategy (`quick`:
  clip_by_global_norm + adamw, whose update holds a collective, on ddp, zero1
  and fsdp per_microbatch).
  """
  devices = jax.devices()[:8]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
  hsdp_mesh = jax.make_mesh((2, 4), ("replica", "shard"), axis_types=(AxisType.Auto,) * 2, devices=devices)
  opts: tuple = (
    ("adam", optax.adam(1e-3)),
    ("clip_by_global_norm + adamw", optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))),
  )
  params = _params("listed", width, depth, jax.random.PRNGKey(1))
  loss = _loss("listed")
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, width), jnp.float32)
  y = jnp.zeros((batch, width), jnp.float32)
  cases: tuple = (  # name, strategy, mesh, data_axis, fsdp_gather
    ("ddp", "ddp", mesh, "data", None),
    ("zero1", "zero1", mesh, "data", None),
    ("fsdp per_microbatch", "fsdp", mesh, "data", "per_microbatch"),
    ("fsdp once", "fsdp", mesh, "data", "once"),
    ("hsdp (2 x 4) per_microbatch", "hsdp", hsdp_mesh, ("replica", "shard"), "per_microbatch"),
    ("hsdp (2 x 4) once", "hsdp", hsdp_mesh, ("replica", "shard"), "once"),
  )
  if quick:
    opts, cases = opts[1:], cases[:3]
  rows = []
  for opt_name, opt in opts:
    for name, strategy, m, axes, gather in cases:
      p, s = ja.shard_train_state(params, opt, m, strategy=strategy, data_axis=axes)
      b = ja.shard_batch((x, y), m, axes)
      step = _ja_step(loss, opt, m, k, strategy, gather, axes)
      got = _compile(lambda step=step: step, p, s, b, n_dev=8)
      twin = _compile(lambda step=step: _engine.always_applied(step), p, s, b, n_dev=8)
      rows.append(
        {"optimizer": opt_name, "case": name, "K": k, **got, "twin_peak_bytes": twin["peak_bytes"], "twin": twin}
      )
  return rows


# --------------------------------------------------------------------------- whole-leaf fallbacks


def _fallback_models(width: int = 16, depth: int = 8) -> list[tuple[str, Callable, Any, list, Any]]:
  """(name, loss(params, x, y), params, dims, mesh axes) of model forms, each leaf's sharded dimension chosen."""
  key = jax.random.PRNGKey(0)
  f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)  # also under jax_enable_x64
  listed, stacked = f32(_params("listed", width, depth, key)), f32(_params("scanned", width, depth, key))
  mask = np.triu(np.ones((width, width), np.float32))

  def carry_loss(p, x, y):  # a parameter as a scan's carry
    w, _ = lax.scan(lambda w, _: (0.5 * w, None), p["w"][0], None, length=2)
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

  def while_loss(p, x, y):  # a fori_loop with a traced trip count: a while loop
    n = (x[0, 0] > -1e9).astype(jnp.int32) + 1
    h = lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ lax.stop_gradient(p["w"][0])), x)
    return jnp.mean((h @ p["w"][1] - y) ** 2)

  def tp_loss(p, x, y):  # the docs' tensor-parallel layer: a nested shard_map over "model"
    layer = jax.shard_map(
      lambda x, w1, w2: lax.psum(jnp.tanh(x @ w1) @ w2, "model"),
      in_specs=(PartitionSpec(), PartitionSpec(None, "model"), PartitionSpec("model", None)),
      out_specs=PartitionSpec(),
      axis_names={"model"},
    )
    return jnp.mean((layer(x, p[0]["w"], p[1]["w"]) - y) ** 2)

  masked = lambda p, x, y: jnp.mean((jnp.tanh(x @ (p[0]["w"] * mask)) @ p[1]["w"] - y) ** 2)
  n_listed = len(jax.tree.leaves(listed))
  return [
    ("listed layers", _loss("listed"), listed, [0] * n_listed, None),
    ("a NumPy mask on a weight", masked, listed[:2], [0] * 4, None),
    ("layers stacked, lax.scan, sharded within a layer", _loss("scanned"), stacked, [1, 1], None),
    ("layers stacked, lax.scan, sharded on the layer axis", _loss("scanned"), stacked, [0, 0], None),
    ("a parameter as a scan's carry", carry_loss, stacked, [1, 1], None),
    ("a fori_loop with a traced trip count", while_loss, stacked, [1, 1], None),
    ('a nested shard_map over "model"', tp_loss, listed[:2], [0] * 4, ("model", 2)),
  ]


def fallback_table(width: int = 16, depth: int = 8) -> list[dict]:
  """Which equations `_layerwise` runs with a whole-leaf gather, per model form (traced only, not compiled).

  Every other equation that reads a parameter gathers it for that equation
  alone; these keep the gathered leaf alive longer: `_layerwise.fallbacks()`.
  """
  from jaxaccum import _layerwise

  rows = []
  for name, loss, params, dims, extra in _fallback_models(width, depth):
    axes: tuple = ("data",)
    shape: tuple = (8,)
    if extra is not None:  # the nested map's axis first (Shardy wants it before the outer one)
      axes, shape = (extra[0], "data"), (extra[1], 8 // extra[1])
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
    n = mesh.shape["data"]
    flat, treedef = jax.tree.flatten(params)
    leaf_specs = [PartitionSpec() if d is None else PartitionSpec(*[None] * d, "data") for d in dims]
    specs = jax.tree.unflatten(treedef, leaf_specs)
    grad = jax.grad(layerwise(loss, dims, "data", n))
    fn = jax.shard_map(
      grad,
      mesh=mesh,
      in_specs=(specs, PartitionSpec("data"), PartitionSpec("data")),
      out_specs=specs,
      axis_names={"data"},
      check_vma=False,
    )
    x = jnp.ones((8 * 2, width), jnp.float32)
    _layerwise.clear_fallbacks()
    with jax.set_mesh(mesh):
      jax.make_jaxpr(fn)(params, x, x)
    rows.append({"model": name, "fallbacks": [[k[0], k[1], v] for k, v in _layerwise.fallbacks(why=True).items()]})
  return rows


def _max_shard(x) -> int:
  return max(s.data.nbytes for s in x.addressable_shards)


def _ja_step(loss, opt, mesh, k, strategy="fsdp", gather=None, data_axis="data"):
  options = {} if gather is None else {"fsdp_gather": gather}
  return ja.make_train_step(
    lambda p, b: loss(p, *b), opt, num_microbatches=k, mesh=mesh, strategy=strategy, data_axis=data_axis, **options
  )


def _wire(collectives: dict) -> float:
  """Ring bytes sent per device per step, over every kind of collective."""
  return sum(v["bytes"] for v in collectives.values())


def _mib(b) -> str:
  return f"{b / 2**20:.2f}"


def _counts(c: dict) -> str:
  return " | ".join(f"{c.get(op, {}).get('count', 0)}" for op in ("all-gather", "reduce-scatter", "all-reduce"))


def run(quick: bool = False) -> list[dict]:
  width, depth, batch = (64, 3, 64) if quick else (512, 12, 256)
  ks = (2,) if quick else (4, 8)
  rows, floors = fsdp_table(width, depth, batch, ks)
  n = rows[0]["param_bytes"]
  layer = (width * width + width) * 4
  lines = [
    f"{depth} tanh layers of {width} (N = {n / 2**20:.2f} MiB of float32 parameters), adam, 8 devices, batch "
    f"{batch}. Peak per device: argument + output + temp - alias (params and state donated), MiB. Floor on "
    "paper: params + adam's two moments + accumulator (4N/P) + one gathered layer and its full-size gradient + "
    "one microbatch's saved layer inputs + the batch; the tight floor holds one full-size buffer at a time "
    "(the gradient is reduce-scattered before the layer is re-gathered). Collectives per step, each weighted by "
    "its loops' trip counts, and ring bytes sent per device in units of N. Rows: (a) hand-written layerwise "
    "FSDP under shard_map (the target's yardstick); (b) jaxaccum's `_layerwise` mechanism alone in the same "
    'bare loop; (c) `ja.make_train_step(strategy="fsdp", fsdp_gather=...)`, whose per_microbatch mode runs '
    "(b) inside the engine; (d) a user's `jax.jit` with FSDP shardings and a `lax.scan` over microbatches.",
    "",
    "| layers | K | step | peak (MiB) | / floor | / tight floor | / (a) | all-gathers | reduce-scatters "
    "| all-reduces | wire bytes |",
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  data: dict[str, Any] = {"rows": rows, "floors": {f"{kd}/K={k}": v for (kd, k), v in floors.items()}}
  for (kind, k), floor in floors.items():
    group = [r for r in rows if r["kind"] == kind and r["K"] == k]
    ref = next(r for r in group if r["case"] == REFERENCE)
    floor_bytes = sum(floor.values())
    tight = floor_bytes - layer
    lines.append(
      f"| {kind} | {k} | floor on paper (tight floor {_mib(tight)}) | {_mib(floor_bytes)} | 1.00 "
      f"| {floor_bytes / tight:.2f} | | | | | |"
    )
    for r in group:
      c = r["collectives"]
      wire = _wire(c)
      lines.append(
        f"| {kind} | {k} | {r['case']} | {_mib(r['peak_bytes'])} | {r['peak_bytes'] / floor_bytes:.2f} "
        f"| {r['peak_bytes'] / tight:.2f} | {r['peak_bytes'] / ref['peak_bytes']:.2f} | {_counts(c)} "
        f"| {wire / n:.2f} N |"
      )
    plain = [r for r in group if r["case"].startswith("(d)")]
    for tag, case in (("layerwise", LAYERWISE), ("ja_per_microbatch", JA.format("per_microbatch"))):
      r = next(r for r in group if r["case"] == case)
      best = min(plain, key=lambda r: r["peak_bytes"])
      data[f"ratio_{tag}_vs_reference_peak/{kind}/K={k}"] = r["peak_bytes"] / ref["peak_bytes"]
      data[f"ratio_{tag}_vs_floor_peak/{kind}/K={k}"] = r["peak_bytes"] / floor_bytes
      data[f"ratio_{tag}_vs_tight_floor_peak/{kind}/K={k}"] = r["peak_bytes"] / tight
      data[f"ratio_{tag}_vs_plain_jit_peak/{kind}/K={k}"] = r["peak_bytes"] / best["peak_bytes"]
      r_wire = _wire(r["collectives"])
      best_wire = min(_wire(q["collectives"]) for q in plain)
      data[f"ratio_{tag}_vs_plain_jit_wire/{kind}/K={k}"] = r_wire / best_wire
  out = [
    {
      "title": "fsdp: per-device peak memory and collectives, layer by layer",
      "markdown": "\n".join(lines),
      "data": data,
    }
  ]

  k = ks[0]
  srows = strategy_table(width, depth, batch, k)
  lines = [
    f"The listed model above ({depth} x {width}, N = {n / 2**20:.2f} MiB), adam, 8 devices, batch {batch}, K = {k}, "
    "`ja.make_train_step(strategy=...)`. Per device, MiB: the parameters and the optimizer state the fullest "
    "device holds (arguments, with the batch), XLA's temp (accumulator, gathered parameters, gradients, "
    "activations), the peak (argument + output + temp - alias, donated), and the floor on paper of each "
    "strategy (N params, P = 8, S = 4 for hsdp; L one layer, A one microbatch's activations, B the batch): "
    "ddp 4N + L + A + B; zero1 2N + 2N/P + L + A + B; fsdp per_microbatch 4N/P + L + A + B; fsdp once "
    "2N + 3N/P + L + A + B; hsdp with S for P.",
    "",
    "| strategy | params | optimizer state | argument | temp | peak | floor on paper | peak / floor "
    "| all-gathers | reduce-scatters | all-reduces | wire bytes |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in srows:
    c = r["collectives"]
    wire = _wire(c)
    lines.append(
      f"| {r['case']} | {_mib(r['params_per_device'])} | {_mib(r['state_per_device'])} "
      f"| {_mib(r['argument_bytes'])} | {_mib(r['temp_bytes'])} | {_mib(r['peak_bytes'])} "
      f"| {_mib(r['floor_bytes'])} | {r['peak_bytes'] / r['floor_bytes']:.2f} | {_counts(c)} | {wire / n:.2f} N |"
    )
  out.append(
    {
      "title": "fsdp: every strategy's per-device peak",
      "markdown": "\n".join(lines),
      "data": {"rows": srows},
    }
  )

  frows = fallback_table()
  lines = [
    'Which equations run with a whole-leaf gather under `fsdp_gather="per_microbatch"` '
    "(`jaxaccum._layerwise.fallbacks(why=True)` after tracing each form; 16-wide float32 layers, 8 devices). "
    "Every other equation that reads a parameter gathers it for that equation alone; these keep the whole "
    "gathered leaf alive longer (exact either way).",
    "",
    "| model form | equations with a whole-leaf gather |",
    "|---|---|",
  ]
  for r in frows:
    what = "; ".join(f"`{prim}` x{count}: {why}" for prim, why, count in r["fallbacks"]) or "none"
    lines.append(f"| {r['model']} | {what} |")
  out.append({"title": "fsdp: whole-leaf fallbacks", "markdown": "\n".join(lines), "data": {"rows": frows}})

  krows = skip_table(width, depth, batch, k, quick=quick)
  lines = [
    f"The listed model above ({depth} x {width}), float32, 8 devices, batch {batch}, K = {k}, "
    "`ja.make_train_step(strategy=...)`. A skipped update (zero total weight, a non-finite gradient) costs no "
    "memory: the step's per-device peak (argument + output + temp - alias, MiB) beside the same step whose "
    "update always applies (no skip). The skip is a conditional around the update; computing the update and "
    "then selecting new or old would keep both alive.",
    "",
    "| optimizer | strategy | peak | always applied | ratio |",
    "|---|---|---:|---:|---:|",
  ]
  data = {"rows": krows}
  for r in krows:
    ratio = r["peak_bytes"] / r["twin_peak_bytes"]
    lines.append(
      f"| {r['optimizer']} | {r['case']} | {_mib(r['peak_bytes'])} | {_mib(r['twin_peak_bytes'])} | {ratio:.3f} |"
    )
    data[f"ratio_skip_vs_always_applied_peak/{r['optimizer']}/{r['case']}"] = ratio
  out.append({"title": "fsdp: a skipped update costs no memory", "markdown": "\n".join(lines), "data": data})
  return out


if __name__ == "__main__":
  raise SystemExit("run it as: python -m jaxaccum.bench --sections fsdp")
