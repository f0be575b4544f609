"""Benchmark section: FSDP's per-device peak memory and bytes on the wire, layer by layer.

`python -m jaxaccum.bench --sections fsdp` (8 devices, simulated on CPU). A
tanh MLP of L square layers (12 x 512 float32 by default), adam, batch 256, K
microbatches per step, the layers either listed (a list of {"w", "b"}) or
stacked and applied with `lax.scan` (the MaxText/Levanter style). Steps:

- (a) `reference`: hand-written layerwise FSDP under shard_map: each layer a
  custom_vjp that all-gathers its weights (forward, with a data dependence on
  the layer input; backward again, with one on the cotangent) and
  `psum_scatter`s its gradient into a 1/P accumulator;
- (b) `layerwise`: `jaxaccum._layerwise.layerwise(loss)` inside the same
  shard_map microbatch loop and 1/P accumulator (the model code unchanged);
- (c) jaxaccum's fsdp today: `ja.make_train_step(strategy="fsdp")` with
  `fsdp_gather="per_microbatch"` and `"once"`;
- (d) a user's plain `jax.jit` over FSDP-sharded params and state with a
  `lax.scan` over microbatches (contiguous and strided splits of the batch).

Per-device peak from the compiled memory analysis: argument + output + temp -
alias, params and state donated. Collectives: every instruction of the
compiled HLO weighted by how many times it runs per step (loop trip counts),
with the bytes one device sends on a ring. No timing: the same numbers on any
machine with this XLA. CPU memory analysis is indicative: a GPU/TPU scheduler
may prefetch the next layer's gather (one more layer alive).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxaccum as ja
from jaxaccum import _hlo
from jaxaccum._layerwise import layerwise

_TRIP = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')


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
  computations, entry = _hlo._instructions(hlo_text)
  out: dict[str, dict[str, float]] = {}

  def visit(name, times, depth):
    if name not in computations or depth > 50:
      return
    for opcode, result, line, called in computations[name]:
      base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
      if base in _hlo.COLLECTIVES and not opcode.endswith("-done"):
        arrays = _hlo._ARRAY.findall(result)
        result_bytes = _hlo._array_bytes("{}[{}]".format(*arrays[-1])) if arrays else 0
        groups = _hlo._groups(line)
        n = len(next(iter(groups))) if groups else num_devices
        if base == "all-gather":
          ring: float = result_bytes // n * (n - 1)
        elif base == "reduce-scatter":
          ring = result_bytes * (n - 1)
        elif base == "all-reduce":
          ring = 2 * (n - 1) * result_bytes / n
        else:
          ring = result_bytes
        slot = out.setdefault(base, {"count": 0, "bytes": 0.0})
        slot["count"] += times
        slot["bytes"] += times * ring
      trip = _TRIP.search(line) if opcode == "while" else None
      for kind, target in called:
        if kind == "condition":
          continue
        visit(target, times * (int(trip.group(1)) if trip and kind == "body" else 1), depth + 1)

  if entry is not None:
    visit(entry, 1, 0)
  return out


# --------------------------------------------------------------------------- the table


def fsdp_table(width: int = 512, depth: int = 12, batch: int = 256, ks=(4, 8), kinds=("listed", "scanned")):
  """Rows {kind, K, case, peak_bytes, collectives} and the paper floor per (kind, K)."""
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
      rows_mb = batch // n_dev // k
      floors[(kind, k)] = {
        # params + adam's two moments + the accumulator, each 1/P of N
        "sharded_state": 4 * total // n_dev,
        # one gathered layer (w and b) and its full-size gradient before the reduce-scatter
        "gathered_layer_and_grad": 2 * layer,
        # one microbatch's saved layer inputs (the activations the backward pass needs)
        "activations": depth * rows_mb * width * 4,
        # the batch argument on one device
        "batch": 2 * batch // n_dev * width * 4,
      }
      cases: list[tuple[str, Any]] = []
      ref = _reference_loss(kind, "data")
      cases.append(
        (
          "(a) reference (hand-written layerwise)",
          lambda p, s, ref=ref: _shard_map_step(jax.value_and_grad(ref), p, opt, mesh, k),
        )
      )
      cases.append(
        (
          "(b) layerwise()",
          lambda p, s: _shard_map_step(
            jax.value_and_grad(layerwise(loss, _dims(p, "data"), "data", n_dev)), p, opt, mesh, k
          ),
        )
      )
      for gather in ("per_microbatch", "once"):
        cases.append((f"(c) ja fsdp {gather}", lambda p, s, gather=gather: _ja_step(loss, opt, mesh, k, gather)))
      for split in ("contiguous", "strided"):
        cases.append((f"(d) plain jit + scan, {split}", lambda p, s, split=split: _plain_jit_step(loss, opt, k, split)))
      for name, build in cases:
        p, s = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
        step = build(p, s)
        if name.startswith("(c)"):
          compiled = step.lower(p, s, (x, y)).compile()
        else:
          compiled = step.lower(p, s, x, y).compile()
        rows.append(
          {
            "kind": kind,
            "K": k,
            "case": name,
            "peak_bytes": peak_bytes(compiled),
            "collectives": collectives_per_step(compiled.as_text() or "", n_dev),
            "param_bytes": total,
          }
        )
  return rows, floors


def _ja_step(loss, opt, mesh, k, gather):
  return ja.make_train_step(
    lambda p, b: loss(p, *b), opt, num_microbatches=k, mesh=mesh, strategy="fsdp", fsdp_gather=gather
  )


def _mib(b) -> str:
  return f"{b / 2**20:.2f}"


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
    "its loops' trip counts, and ring bytes sent per device in units of N.",
    "",
    "| layers | K | step | peak (MiB) | / floor | / tight floor | / (a) | all-gathers | reduce-scatters "
    "| all-reduces | wire bytes |",
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  data: dict[str, Any] = {"rows": rows, "floors": {f"{kd}/K={k}": v for (kd, k), v in floors.items()}}
  for (kind, k), floor in floors.items():
    group = [r for r in rows if r["kind"] == kind and r["K"] == k]
    ref = next(r for r in group if r["case"].startswith("(a)"))
    floor_bytes = sum(floor.values())
    tight = floor_bytes - layer
    lines.append(
      f"| {kind} | {k} | floor on paper (tight floor {_mib(tight)}) | {_mib(floor_bytes)} | 1.00 "
      f"| {floor_bytes / tight:.2f} | | | | | |"
    )
    for r in group:
      c = r["collectives"]
      wire = sum(v["bytes"] for v in c.values())
      lines.append(
        f"| {kind} | {k} | {r['case']} | {_mib(r['peak_bytes'])} | {r['peak_bytes'] / floor_bytes:.2f} "
        f"| {r['peak_bytes'] / tight:.2f} | {r['peak_bytes'] / ref['peak_bytes']:.2f} "
        f"| {c.get('all-gather', {}).get('count', 0)} | {c.get('reduce-scatter', {}).get('count', 0)} "
        f"| {c.get('all-reduce', {}).get('count', 0)} | {wire / n:.2f} N |"
      )
    lw = next(r for r in group if r["case"].startswith("(b)"))
    plain = [r for r in group if r["case"].startswith("(d)")]
    best = min(plain, key=lambda r: r["peak_bytes"])
    data[f"ratio_layerwise_vs_reference_peak/{kind}/K={k}"] = lw["peak_bytes"] / ref["peak_bytes"]
    data[f"ratio_layerwise_vs_floor_peak/{kind}/K={k}"] = lw["peak_bytes"] / floor_bytes
    data[f"ratio_layerwise_vs_tight_floor_peak/{kind}/K={k}"] = lw["peak_bytes"] / tight
    data[f"ratio_layerwise_vs_plain_jit_peak/{kind}/K={k}"] = lw["peak_bytes"] / best["peak_bytes"]
    lw_wire = sum(v["bytes"] for v in lw["collectives"].values())
    best_wire = min(sum(v["bytes"] for v in r["collectives"].values()) for r in plain)
    data[f"ratio_layerwise_vs_plain_jit_wire/{kind}/K={k}"] = lw_wire / best_wire
  table = "\n".join(lines)
  return [{"title": "fsdp: per-device peak memory and collectives, layer by layer", "markdown": table, "data": data}]


if __name__ == "__main__":
  raise SystemExit("run it as: python -m jaxaccum.bench --sections fsdp")
