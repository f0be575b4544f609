"""Bench section "sharded": per-device memory and collective bytes per step, by strategy and K.

`python -m jaxaccum._bench_sharded` (needs 8 devices: on CPU, set
XLA_FLAGS=--xla_force_host_platform_device_count=8 or jax_num_cpu_devices).
Everything here is read from compiled HLO and from `addressable_shards`; no
timing, so the numbers are the same on any machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

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


def sharded_table(sizes=(64, 512, 512, 512, 8), ks=(1, 4, 16), rows_per_device=16):
  """Rows of (case, K, params/state bytes per device, compiled temp bytes, collectives, ring bytes)."""
  devices = jax.devices()[:8]
  flat = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
  two = jax.make_mesh((2, 4), ("rep", "shard"), axis_types=(AxisType.Auto,) * 2, devices=devices)
  cases = [("ddp", flat, "data", {}), ("zero1", flat, "data", {}),
           ("fsdp", flat, "data", {"fsdp_gather": "per_microbatch"}), ("fsdp", flat, "data", {"fsdp_gather": "once"}),
           ("hsdp", two, ("rep", "shard"), {"fsdp_gather": "per_microbatch"})]
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
      step = sharded.make_sharded_train_step(_loss, opt, strategy=strategy, mesh=mesh, data_axis=axes,
                                             num_microbatches=k, **options)
      compiled = step.lower(p, s, batch).compile()
      found = _hlo.collectives(compiled.as_text(), num_devices=8)
      counts = {}
      for c in found:
        n = k if c.where == "loop" else 1
        counts[c.opcode] = counts.get(c.opcode, 0) + n
      ring = sum(c.ring_bytes * (k if c.where == "loop" else 1) for c in found)
      mem = compiled.memory_analysis()
      name = strategy + (f" ({options['fsdp_gather']})" if strategy == "fsdp" else "")
      out.append({"case": name, "K": k, "params_bytes": _device_bytes(p, dev), "state_bytes": _device_bytes(s, dev),
                  "temp_bytes": getattr(mem, "temp_size_in_bytes", None), "collectives": counts,
                  "ring_bytes": ring})
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  return total, out


def main():
  total, rows = sharded_table()
  print(f"MLP parameters: {total} bytes (float32), adam, 8 devices\n")
  print("| strategy | K | params / device | adam state / dev | XLA temp | collectives per step | ring bytes / device |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    colls = ", ".join(f"{v} {k}" for k, v in sorted(r["collectives"].items()))
    print(f"| {r['case']} | {r['K']} | {r['params_bytes'] / total:.3f} N | {r['state_bytes'] / (2 * total):.3f} x 2N "
          f"| {r['temp_bytes']} | {colls} | {r['ring_bytes'] / total:.2f} N |")


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  main()
