"""Benchmark section: per-device memory and collective bytes per step, by sharding strategy and K.

`python -m jaxaccum.bench --sections sharded` (8 devices, simulated on CPU).
Everything here is read from compiled HLO and from `addressable_shards`; no
timing, so the numbers are the same on any machine. Beside the strategies, the
pattern users write today: `jax.jit` over parameters sharded on the data axis
(FSDP-style) with a `lax.scan` over microbatches, where the partitioner puts
the gradient reductions inside the loop. And (data, model) meshes whose
'model' axis shards every parameter leaf (`model_axis_table`): the data-axis
bytes per update against the ideal where each leaf's collective moves only its
model shard.
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
from jaxaccum.hlo import collective_bytes, count_collectives


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


def _per_update(compiled, k: int, calls: int = 1) -> tuple[dict[str, int], int, float]:
  """(collectives by opcode, instructions inside the loop, ring bytes per device) per update.

  Counted with `ja.count_collectives` / `ja.collective_bytes` (a collective inside the microbatch
  loop runs its trip count, K, times per call); the call runs `calls` times per update.
  """
  counts = {op: calls * n for op, n in count_collectives(compiled).items()}
  in_loop = sum(1 for c in _hlo.collectives(compiled.as_text() or "", num_devices=8) if c.where == "loop")
  ring = calls * sum(collective_bytes(compiled, num_devices=8).values())
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
      counts, in_loop, ring = _per_update(compiled, k)
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
          "in_loop": in_loop,
          "ring_bytes": ring,
        }
      )
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  return total, out


def _tp_params(width, hidden, key, mesh):
  """A Megatron-style MLP block whose every leaf the 'model' axis shards: column- then row-parallel."""
  k1, k2 = jax.random.split(key)
  params = {
    "w1": jax.random.normal(k1, (width, hidden), jnp.float32) / np.sqrt(width),
    "b1": jnp.zeros((hidden,), jnp.float32),
    "w2": jax.random.normal(k2, (hidden, width), jnp.float32) / np.sqrt(hidden),
  }
  specs = {"w1": PartitionSpec(None, "model"), "b1": PartitionSpec("model"), "w2": PartitionSpec("model", None)}
  return {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in params.items()}


def _tp_loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  # The row-parallel product sums over 'model'; on Explicit axes the output's sharding must be said.
  explicit = any(t == AxisType.Explicit for t in jax.sharding.get_abstract_mesh().axis_types)
  out = jnp.matmul(h, params["w2"], out_sharding=PartitionSpec()) if explicit else h @ params["w2"]
  return jnp.mean((out - y) ** 2)


def model_axis_table(width=64, hidden=512, k=2, rows_per_device=16, axis_type=AxisType.Auto):
  """Data-axis bytes per update on (data, model) meshes, every parameter leaf sharded over 'model' too.

  Each leaf's data-axis collective should move only its model shard: the
  ideal per device is 2 (P-1)/P x N / model_size for one reduce-scatter and one
  all-gather (zero1, fsdp once; x K for fsdp's per-microbatch gathers), and for
  hsdp the same over its shard axis plus the replica all-reduce of each block,
  2 (R-1)/R x N / (model_size S). Collectives are told apart by their replica
  groups (`_hlo.mesh_groups`).
  """
  devices = jax.devices()[:8]
  two = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2, devices=devices)
  three = jax.make_mesh((2, 2, 2), ("rep", "shard", "model"), axis_types=(axis_type,) * 3, devices=devices)
  cases: list[tuple[str, Any, Any, dict[str, Any]]] = [
    ("ddp", two, "data", {}),
    ("zero1", two, "data", {}),
    ("fsdp", two, "data", {"fsdp_gather": "once"}),
    ("fsdp", two, "data", {"fsdp_gather": "per_microbatch"}),
    ("hsdp", three, ("rep", "shard"), {"fsdp_gather": "once"}),
  ]
  opt = optax.adam(1e-3)
  out = []
  for strategy, mesh, axes, options in cases:
    names = tuple(mesh.axis_names)
    params = _tp_params(width, hidden, jax.random.PRNGKey(0), mesh)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    per_model = total / mesh.shape["model"]
    p, s = sharded.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=axes)
    rows = 8 * k * rows_per_device
    batch = (jnp.ones((rows, width), jnp.float32), jnp.zeros((rows, width), jnp.float32))
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(axes)))
    step = ja.make_train_step(
      _tp_loss, opt, strategy=strategy, mesh=mesh, data_axis=axes, num_microbatches=k, **options
    )
    found = _hlo.collectives(step.lower(p, s, batch).compile().as_text() or "", num_devices=8)
    data_axes = (axes,) if isinstance(axes, str) else axes
    groups = {a: _hlo.mesh_groups(mesh.devices.shape, names, a) for a in data_axes}
    groups["all data"] = _hlo.mesh_groups(mesh.devices.shape, names, data_axes)
    by_axis: dict[str, float] = {}
    kinds: dict[str, int] = {}
    for c in found:
      times = k if c.where == "loop" else 1
      axis = next((a for a, g in groups.items() if c.groups == g), None)
      if axis is None:  # the model axis (the tensor-parallel forward and backward), not counted here
        continue
      by_axis[axis] = by_axis.get(axis, 0.0) + times * c.ring_bytes
      if c.result_bytes > 64:  # not the scalar weight / loss / finite-check all-reduces
        key = f"{c.opcode} ({axis})"
        kinds[key] = kinds.get(key, 0) + times
    if strategy == "hsdp":
      size, rep = mesh.shape["shard"], mesh.shape["rep"]
      ideal = 2 * (size - 1) / size * per_model + 2 * (rep - 1) / rep * per_model / size
    else:
      size = mesh.shape["data"]
      rounds = k if options.get("fsdp_gather") == "per_microbatch" else 1
      ideal = rounds * 2 * (size - 1) / size * per_model
    measured = sum(by_axis.values())
    name = strategy + (f" ({options['fsdp_gather']})" if "fsdp_gather" in options else "")
    shape = "x".join(str(mesh.shape[a]) for a in names) + f" {axis_type.name}"
    out.append(
      {
        "case": name,
        "mesh": f"{shape} {names}",
        "K": k,
        "param_bytes": total,
        "collectives": kinds,
        "data_ring_bytes": measured,
        "ideal_ring_bytes": ideal,
        "ratio_to_ideal": measured / ideal,
      }
    )
  return out


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


def _listed(collectives: dict) -> str:
  """ "2 all-gather, 1 reduce-scatter": how many of each collective, sorted by name."""
  return ", ".join(f"{v} {k}" for k, v in sorted(collectives.items()))


def run(quick: bool = False) -> list[dict]:
  sizes = (64, 128, 128, 8) if quick else (64, 512, 512, 512, 8)
  ks = (1, 4) if quick else (1, 4, 16)
  total, rows = sharded_table(sizes, ks)
  naive = naive_table(sizes, ks)
  tp = [
    r for t in (AxisType.Auto, AxisType.Explicit) for r in model_axis_table(hidden=128 if quick else 512, axis_type=t)
  ]
  lines = [
    f"MLP {'-'.join(map(str, sizes))}, N = {total} bytes of float32 parameters, adam, 8 devices. "
    "Per-device bytes from `addressable_shards`; collectives per step and ring bytes sent per device "
    "(`ja.count_collectives`: a loop collective counts its trip count, K, times) from the compiled HLO.",
    "",
    "| strategy | K | params / device | adam state / device | XLA temp (bytes) | collectives per step "
    "| ring bytes / device |",
    "|---|---:|---:|---:|---:|---|---:|",
  ]
  for r, temp, calls in [(r, r["temp_bytes"], False) for r in rows] + [(r, "", True) for r in naive]:
    # The optax patterns' rows: K calls per update, or a jit whose loop holds the collectives.
    where = " (K calls)" if calls and not r["case"].startswith("jit") else f" ({r['in_loop']} inside the loop)"
    lines.append(
      f"| {r['case']} | {r['K']} | {r['params_bytes'] / total:.3f} N | {r['state_bytes'] / (2 * total):.3f} x 2N "
      f"| {temp} | {_listed(r['collectives'])}{where} | {r['ring_bytes'] / total:.2f} N |"
    )
  lines += [
    "",
    f"(data, model) meshes: a Megatron-style block (w1 P(None, 'model'), b1 P('model'), w2 P('model', None)), "
    f"N = {tp[0]['param_bytes']} bytes, every leaf sharded over 'model' too; adam, K={tp[0]['K']}. Ring bytes per "
    "device per update over the data axes only (the tensor-parallel collectives over 'model' are not counted), against "
    "the ideal where each leaf's collective moves only its model shard: 2 (P-1)/P x N / model_size per reduce-scatter "
    "+ all-gather round (hsdp: over its shard axis, plus the replica all-reduce of the blocks).",
    "",
    "| strategy | mesh | data-axis collectives per update (non-scalar) | data-axis ring bytes / device | ideal "
    "| measured / ideal |",
    "|---|---|---|---:|---:|---:|",
  ]
  for r in tp:
    colls = _listed(r["collectives"])
    n = r["param_bytes"]
    lines.append(
      f"| {r['case']} | {r['mesh']} | {colls} | {r['data_ring_bytes'] / n:.3f} N | {r['ideal_ring_bytes'] / n:.3f} N "
      f"| {r['ratio_to_ideal']:.3f} |"
    )
  table = "\n".join(lines)
  data = {
    "model_axis": tp,
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
