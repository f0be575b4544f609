"""Benchmark section: per-device memory and collective bytes per step, by sharding strategy and K.

`python -m jaxaccum.bench --sections sharded` (8 devices, simulated on CPU).
Everything here is read from compiled HLO and from `addressable_shards`; no
timing, so the numbers are the same on any machine. Beside the strategies, the
pattern users write today: `jax.jit` over parameters sharded on the data axis
(FSDP-style) with a `lax.scan` over microbatches, where the partitioner puts
the gradient reductions inside the loop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxaccum as ja
from jaxaccum import _hlo, sharded


def _mlp(sizes, key):
  params = []
  for k, (m, n) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:], strict=True), strict=True):
    params.append({"w": jax.random.normal(k, (m, n), jnp.float32) / np.sqrt(m), "b": jnp.zeros((n,), jnp.float32)})
  return params


def _loss(params, batch):
  x, y = batch
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return jnp.mean((x @ params[-1]["w"] + params[-1]["b"] - y) ** 2)


def _device_bytes(tree, device):
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def _per_update(compiled, k: int, calls: int = 1) -> tuple[dict[str, int], int, int]:
  """(collectives by opcode, instructions inside the loop, ring bytes per device) per update.

  A collective inside the microbatch loop runs K times per call; the call runs `calls` times per update.
  """
  found = _hlo.collectives(compiled.as_text() or "", num_devices=8)
  counts: dict[str, int] = {}
  for c in found:
    counts[c.opcode] = counts.get(c.opcode, 0) + calls * (k if c.where == "loop" else 1)
  in_loop = sum(1 for c in found if c.where == "loop")
  ring = calls * sum(c.ring_bytes * (k if c.where == "loop" else 1) for c in found)
  return counts, in_loop, ring


def sharded_table(sizes=(64, 512, 512, 512, 8), ks=(1, 4, 16), rows_per_device=16):
  """Rows of (case, K, params/state bytes per device, compiled temp bytes, collectives, ring bytes)."""
  devices = jax.devices()[:8]
  flat = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
  two = jax.make_mesh((2, 4), ("rep", "shard"), axis_types=(AxisType.Auto,) * 2, devices=devices)
  cases: list[tuple[str, Any, Any, dict[str, Any]]] = [
    ("ddp", flat, "data", {}),
    ("zero1", flat, "data", {}),
    ("fsdp", flat, "data", {"fsdp_gather": "per_microbatch"}),
    ("fsdp", flat, "data", {"fsdp_gather": "once"}),
    ("hsdp", two, ("rep", "shard"), {"fsdp_gather": "per_microbatch"}),
  ]
  params = _mlp(sizes, jax.random.PRNGKey(0))
  opt = optax.adam(1e-3)
  out = []
  for strategy, mesh, axes, options in cases:
    p, s = sharded.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=axes)
    dev = mesh.devices.flat[0]
    for k in ks:
      rows = 8 * k * rows_per_device
      key = jax.random.PRNGKey(1)
      batch = (jax.random.normal(key, (rows, sizes[0]), jnp.float32), jnp.zeros((rows, sizes[-1]), jnp.float32))
      batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(axes)))
      step = ja.make_train_step(_loss, opt, strategy=strategy, mesh=mesh, data_axis=axes, num_microbatches=k, **options)
      compiled = step.lower(p, s, batch).compile()
      counts, _, ring = _per_update(compiled, k)
      mem = compiled.memory_analysis()
      name = strategy + (f" ({options['fsdp_gather']})" if strategy == "fsdp" else "")
      out.append(
        {
          "case": name,
          "K": k,
          "params_bytes": _device_bytes(p, dev),
          "state_bytes": _device_bytes(s, dev),
          "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
          "collectives": counts,
          "ring_bytes": ring,
        }
      )
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  return total, out


def naive_table(sizes=(64, 512, 512, 512, 8), ks=(1, 4, 16), rows_per_device=16):
  """The pattern users write today: jit, params sharded like fsdp, a scan over microbatches, adam."""
  devices = jax.devices()[:8]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
  params = _mlp(sizes, jax.random.PRNGKey(0))
  opt = optax.adam(1e-3)
  p, s = sharded.shard_train_state(params, opt, mesh, strategy="fsdp", data_axis="data")
  out = []
  for k in ks:
    rows = 8 * k * rows_per_device

    def step(params, opt_state, batch, k=k):
      micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)

      def body(acc, mb):
        g = jax.grad(_loss)(params, mb)
        return jax.tree.map(jnp.add, acc, g), None

      acc, _ = lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
      grads = jax.tree.map(lambda g: g / k, acc)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    batch = (jnp.ones((rows, sizes[0]), jnp.float32), jnp.zeros((rows, sizes[-1]), jnp.float32))
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    compiled = jax.jit(step).lower(p, s, batch).compile()
    counts, in_loop, ring = _per_update(compiled, k)
    out.append(
      {
        "case": "jit + fsdp-sharded params + scan",
        "K": k,
        "params_bytes": _device_bytes(p, devices[0]),
        "state_bytes": _device_bytes(s, devices[0]),
        "collectives": counts,
        "in_loop": in_loop,
        "ring_bytes": ring,
      }
    )
    # optax.MultiSteps over the same sharded state, one jitted call per microbatch (the
    # across-call pattern): whatever one call communicates happens K times per update.
    multi = optax.MultiSteps(opt, every_k_schedule=k)
    ms = multi.init(p)  # eager: follows the params' shardings (a plain jax.jit(init) would replicate it)

    def micro_step(params, state, batch):
      g = jax.grad(_loss)(params, batch)
      updates, state = multi.update(g, state, params)
      return optax.apply_updates(params, updates), state

    micro_rows = rows // k
    mb = (jnp.ones((micro_rows, sizes[0]), jnp.float32), jnp.zeros((micro_rows, sizes[-1]), jnp.float32))
    mb = jax.device_put(mb, NamedSharding(mesh, PartitionSpec("data")))
    compiled = jax.jit(micro_step).lower(p, ms, mb).compile()
    counts, _, ring = _per_update(compiled, k, calls=k)
    out.append(
      {
        "case": "optax.MultiSteps over fsdp-sharded state (one call per microbatch)",
        "K": k,
        "params_bytes": _device_bytes(p, devices[0]),
        "state_bytes": _device_bytes(ms, devices[0]),
        "collectives": counts,
        "in_loop": 0,
        "ring_bytes": ring,
      }
    )
  return out


def run(quick: bool = False) -> list[dict]:
  sizes = (64, 128, 128, 8) if quick else (64, 512, 512, 512, 8)
  ks = (1, 4) if quick else (1, 4, 16)
  total, rows = sharded_table(sizes, ks)
  naive = naive_table(sizes, ks)
  lines = [
    f"MLP {'-'.join(map(str, sizes))}, N = {total} bytes of float32 parameters, adam, 8 devices. "
    "Per-device bytes from `addressable_shards`; collectives per step and ring bytes sent per device "
    "(a loop collective counts K times) from the compiled HLO.",
    "",
    "| strategy | K | params / device | adam state / device | XLA temp (bytes) | collectives per step "
    "| ring bytes / device |",
    "|---|---:|---:|---:|---:|---|---:|",
  ]
  for r in rows:
    colls = ", ".join(f"{v} {k}" for k, v in sorted(r["collectives"].items()))
    lines.append(
      f"| {r['case']} | {r['K']} | {r['params_bytes'] / total:.3f} N | {r['state_bytes'] / (2 * total):.3f} x 2N "
      f"| {r['temp_bytes']} | {colls} | {r['ring_bytes'] / total:.2f} N |"
    )
  for r in naive:
    colls = ", ".join(f"{v} {k}" for k, v in sorted(r["collectives"].items()))
    where = f" ({r['in_loop']} inside the loop)" if r["case"].startswith("jit") else " (K calls)"
    lines.append(
      f"| {r['case']} | {r['K']} | {r['params_bytes'] / total:.3f} N | {r['state_bytes'] / (2 * total):.3f} x 2N "
      f"| | {colls}{where} | {r['ring_bytes'] / total:.2f} N |"
    )
  table = "\n".join(lines)
  data = {
    "param_bytes": total,
    "strategies": rows,
    "naive": naive,
    "ratio_zero1_ring_bytes_vs_ddp": _ratio(rows, "zero1", "ddp"),
  }
  return [{"title": "sharded: per-device memory and bytes on the wire per step", "markdown": table, "data": data}]


def _ratio(rows, a, b):
  ra = [r["ring_bytes"] for r in rows if r["case"] == a]
  rb = [r["ring_bytes"] for r in rows if r["case"] == b]
  return ra[0] / rb[0]


if __name__ == "__main__":
  raise SystemExit("run it as: python -m jaxaccum.bench --sections sharded")
