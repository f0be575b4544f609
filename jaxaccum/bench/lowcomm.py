"""Benchmark section: all-reduce bytes per 100 updates, synchronous vs local SGD vs DiLoCo; streaming DiLoCo's wire.

Read off the compiled HLO of the pmapped training step on 8 devices: each
all-reduce instruction's operand bytes, times how often its path runs (straight
-line code: every update; the sync branch of the conditional: every H-th
update). Two columns: the optimized HLO of this backend (XLA:CPU widens bf16
all-reduces to f32, so `comm_dtype=bf16` saves nothing on CPU), and the HLO as
lowered, i.e. the dtype the program asks for, which GPU (NCCL) and TPU send.
Nothing touches a device at import time.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum import _hlo
from jaxaccum.bench.common import mlp_loss, mlp_params
from jaxaccum.lowcomm import diloco, local_sgd
from jaxaccum.parallel import pmean

_BYTES = _hlo._BYTES  # bytes per element of each HLO dtype
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_ALL_REDUCE = ("all-reduce", "all-reduce-start")


def _shape_bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(shape_text):
    total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def all_reduce_bytes(hlo_text: str) -> collections.Counter:
  """All-reduce operand bytes by where they run: "top" (every call), "branch", "loop"."""
  per_computation: collections.Counter = collections.Counter()
  current = None
  for line in hlo_text.splitlines():
    if current is None:
      m = _hlo._HEADER.match(line)  # noqa: SLF001  (the package's own private parser)
      if m and "=" not in line.split("(")[0]:
        current = m.group(2)
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _hlo._INSTRUCTION.match(line)  # noqa: SLF001
    if m and m.group(2) in _ALL_REDUCE:
      per_computation[current] += _shape_bytes(m.group(1))
  computations, entry = _hlo.parse(hlo_text)
  where: collections.Counter = collections.Counter()
  seen = set()

  def visit(name, context):
    if name not in computations or (name, context) in seen:
      return
    seen.add((name, context))
    where[context] += per_computation[name]
    for _, called in computations[name]:
      for kind, target in called:
        if kind in ("body", "condition"):
          visit(target, "loop")
        elif kind in ("true_computation", "false_computation", "branch_computations"):
          visit(target, context if context == "loop" else "branch")
        else:
          visit(target, context)

  if entry is not None:
    visit(entry, "top")
  return where


def _step_hlo(tx, params, batch, ndev):
  def step(params, state, batch):
    updates, state = tx.update(jax.grad(mlp_loss)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  rep = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (ndev,) + jnp.shape(a)), t)
  lowered = jax.pmap(step, axis_name="d").lower(rep(params), rep(tx.init(params)), batch)
  return lowered.as_text(dialect="hlo"), lowered.compile().as_text()


def run(quick: bool = False) -> list[dict]:
  ndev = min(8, jax.device_count())
  width, depth = (64, 2) if quick else (256, 4)
  syncs = (16,) if quick else (4, 16, 64)
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  batch = (jnp.ones((ndev, 8, width), jnp.float32), jnp.zeros((ndev, 8, width), jnp.float32))
  nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
  cases = {"synchronous (pmean + sgd)": (optax.chain(pmean("d"), optax.sgd(0.1)), 1)}
  for h in syncs:
    cases[f"local_sgd(H={h})"] = (local_sgd(optax.sgd(0.1), h, axis_name="d"), h)
    cases[f"diloco(H={h})"] = (diloco(optax.sgd(0.1), nesterov, h, axis_name="d"), h)
    cases[f"diloco(H={h}, bf16)"] = (diloco(optax.sgd(0.1), nesterov, h, axis_name="d", comm_dtype=jnp.bfloat16), h)

  data = {"devices": ndev, "param_bytes": param_bytes, "updates": 100, "cases": {}}
  rows = []
  for name, (tx, h) in cases.items():
    lowered_text, compiled_text = _step_hlo(tx, params, batch, ndev)
    per = {}
    for label, text in (("compiled", compiled_text), ("lowered", lowered_text)):
      where = all_reduce_bytes(text)
      per[label] = {
        "top_bytes_per_update": where["top"],
        "branch_bytes_per_sync": where["branch"],
        "loop_bytes": where["loop"],
        "bytes_per_100_updates": 100 * where["top"] + (100 // h) * where["branch"],
      }
    per["all_reduce_instructions"] = dict(_hlo.locate(compiled_text))
    data["cases"][name] = per
  base = data["cases"]["synchronous (pmean + sgd)"]
  for name, per in data["cases"].items():
    for label in ("compiled", "lowered"):
      per[label]["ratio_vs_synchronous"] = per[label]["bytes_per_100_updates"] / base[label]["bytes_per_100_updates"]
    where = per["all_reduce_instructions"]
    rows.append(
      f"| {name} | {where.get('top', 0)} / {where.get('branch', 0)} "
      f"| {per['compiled']['bytes_per_100_updates'] / 2**20:.2f} | {per['compiled']['ratio_vs_synchronous']:.4f} "
      f"| {per['lowered']['bytes_per_100_updates'] / 2**20:.2f} | {per['lowered']['ratio_vs_synchronous']:.4f} |"
    )
  table = "\n".join(
    [
      f"MLP {depth}x{width}, float32 params ({param_bytes / 2**20:.2f} MiB), pmap over {ndev} devices, "
      "inner sgd; DiLoCo outer Nesterov. Bytes are all-reduce operand bytes per device, "
      "from the HLO (compiled for this backend / as lowered, i.e. the requested wire dtype).",
      "",
      "| transform | all-reduces every step / on sync only | MiB per 100 updates (compiled) | ratio "
      "| MiB per 100 updates (lowered) | ratio |",
      "|---|---|---|---|---|---|",
      *rows,
    ]
  )
  sections = [{"title": "lowcomm: all-reduce bytes per 100 updates", "markdown": table, "data": data}]
  from jaxaccum.bench import textlm  # the bytes-vs-loss rows over a replica axis (issue 28)

  streaming = _streaming(params, batch, ndev, param_bytes, depth, width, quick)
  return sections + [streaming, fsdp_memory(quick), textlm.run(quick)]


def _peak(compiled) -> int:
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def fsdp_memory(quick: bool = False) -> dict:
  """diloco_train_step around ddp/fsdp, dense and sparse wire: per-device peak against the bare step's."""
  from jaxaccum import _sparse, sharded, slowlink, train_step  # noqa: PLC0415

  width, depth, data = (128, 2, 4) if quick else (1024, 4, 4)
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  leaf_bytes = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  batch = (jnp.ones((16, width), jnp.float32), jnp.zeros((16, width), jnp.float32))
  inner, outer = optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True)
  one = jax.make_mesh((data,), ("data",), devices=jax.devices()[:data])
  replicas = jax.make_mesh((2, data), ("replica", "data"), devices=jax.devices()[: 2 * data])
  topk = _sparse.TopK()
  rows, cases = [], {}
  for strategy in ("ddp", "fsdp"):
    bare = train_step.make_train_step(mlp_loss, inner, mesh=one, strategy=strategy)
    p, s = sharded.shard_train_state(params, inner, one, strategy=strategy)
    bare_peak = _peak(bare.lower(p, s, jax.tree.map(lambda a: a[:8], batch)).compile())
    for wire in ("dense", "TopK"):
      sparse = wire == "TopK"
      step = slowlink.diloco_train_step(
        train_step.make_train_step(mlp_loss, inner, mesh=replicas, strategy=strategy),
        outer,
        32,
        compress=topk if sparse else None,
        error_feedback=sparse,
      )
      p, s = step.init(params)
      peak = _peak(step.lower(p, s, batch).compile())
      # DiLoCo's own buffers: the anchor, the outer momentum and one outer gradient Delta (params-sized each),
      # and with the sparse wire its error-feedback residual; held 1/data per device around fsdp, whole around ddp.
      own = (4 if sparse else 3) * param_bytes / (data if strategy == "fsdp" else 1)
      excess = peak - bare_peak - own
      cases[f"{strategy} {wire}"] = {
        "bare_peak": bare_peak,
        "diloco_peak": peak,
        "diloco_buffers": own,
        "excess_over_bare_plus_buffers": excess,
        "excess_in_largest_leaves": excess / leaf_bytes,
        "ratio_without_buffers": (peak - own) / bare_peak,
      }
      rows.append(
        f"| {strategy} | {wire} | {bare_peak / 2**20:.2f} | {peak / 2**20:.2f} | {own / 2**20:.2f} "
        f"| {(bare_peak + own) / 2**20:.2f} | {(peak - own) / bare_peak:.3f}x | {excess / leaf_bytes:+.2f} |"
      )
  table = "\n".join(
    [
      f"MLP {depth}x{width}, float32 params ({param_bytes / 2**20:.1f} MiB, largest leaf "
      f"{leaf_bytes / 2**20:.1f} MiB), inner AdamW, outer Nesterov, H = 32; sparse wire `ja.TopK()` "
      f"(density 1/32, chunk 64, 2 bits) with error feedback. Bare: the step on a data={data} mesh; DiLoCo: "
      f"diloco_train_step around the same strategy on a (replica=2, data={data}) mesh. Per-device peak from "
      "compiled memory analysis (arguments + outputs + temporaries - aliased). DiLoCo's own buffers: anchor, "
      "outer momentum and one outer gradient (and the residual with TopK), divided by the data-axis size where "
      "the step shards parameters (fsdp). Last column: the peak beyond bare + buffers, in units of the largest "
      "leaf (whole).",
      "",
      "| strategy inside each replica | wire | bare step peak MiB | DiLoCo peak MiB | DiLoCo's buffers MiB "
      "| bare + buffers MiB | DiLoCo peak without its buffers / bare | beyond bare + buffers, largest leaves |",
      "|---|---|---|---|---|---|---|---|",
      *rows,
    ]
  )
  data_ = {
    "width": width,
    "depth": depth,
    "data_axis_size": data,
    "param_bytes": param_bytes,
    "largest_leaf_bytes": leaf_bytes,
    "cases": cases,
  }
  return {"title": "lowcomm: fsdp inside each replica, per-device peak", "markdown": table, "data": data_}


def _wire(hlo_text: str, ndev: int) -> tuple[int, float]:
  """(collective instructions, ring bytes per device) of everything in conditional branches.

  Each of diloco's collectives sits in the branch of its fragment's conditional, and each branch runs
  once per period of `sync_every` updates, so these are the counts and bytes per period.
  """
  found = [c for c in _hlo.collectives(hlo_text, num_devices=ndev) if c.where == "branch"]
  return len(found), sum(c.ring_bytes for c in found)


def _streaming(params, batch, ndev, param_bytes, depth, width, quick) -> dict:
  """Streaming DiLoCo: per configuration, the collectives and ring bytes of one period, from HLO."""
  h = 16
  nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
  stream: dict[str, Any] = dict(fragments=4, delay=1, alpha=0.5)
  configs: dict[str, dict[str, Any]] = {
    "plain (F=1, tau=0)": {},
    "F=4 tau=1 alpha=0.5": stream,
    "+ bf16": dict(stream, compress="bf16"),
    "+ int8": dict(stream, compress="int8"),
    "+ int4": dict(stream, compress="int4"),
    "+ int4 + error feedback": dict(stream, compress="int4", error_feedback=True),
  }
  data = {"devices": ndev, "param_bytes": param_bytes, "sync_every": h, "cases": {}}
  rows = []
  for name, kwargs in configs.items():
    tx = diloco(optax.sgd(0.1), nesterov, h, axis_name="d", **kwargs)
    lowered_text, compiled_text = _step_hlo(tx, params, batch, ndev)
    case = {}
    for label, text in (("compiled", compiled_text), ("lowered", lowered_text)):
      count, ring = _wire(text, ndev)
      case[label] = {"collectives_per_period": count, "ring_bytes_per_period": ring}
    data["cases"][name] = case
  base = data["cases"]["plain (F=1, tau=0)"]
  for name, case in data["cases"].items():
    for label in ("compiled", "lowered"):
      per = case[label]
      per["ratio_vs_plain"] = per["ring_bytes_per_period"] / base[label]["ring_bytes_per_period"]
    fragments = configs[name].get("fragments", 1)
    rows.append(
      f"| {name} | {case['compiled']['collectives_per_period']} "
      f"| {case['compiled']['ring_bytes_per_period'] / 2**20:.3f} | {case['compiled']['ratio_vs_plain']:.3f} "
      f"| {case['lowered']['ring_bytes_per_period'] / 2**20:.3f} | {case['lowered']['ratio_vs_plain']:.3f} "
      f"| {case['lowered']['ring_bytes_per_period'] / fragments / 2**10:.1f} |"
    )
  table = "\n".join(
    [
      f"MLP {depth}x{width}, float32 params ({param_bytes / 2**20:.2f} MiB), pmap over {ndev} devices, "
      f"sync_every={h}, inner sgd, outer Nesterov. Per period of {h} updates (each fragment syncs once): "
      "collective instructions (all in conditional branches) and ring bytes per device, from the compiled "
      "HLO of this backend and as lowered (the wire GPU/TPU send; XLA:CPU widens bf16 all-reduces to f32, "
      "keeps int8/int16). int8 codes are summed in int16 and int4 codes in int8 (8 replicas x 7 <= 127), "
      "plus one float32 max-all-reduce of the block scales per fragment.",
      "",
      "| configuration | collectives per period | MiB per period (compiled) | ratio | MiB per period (lowered) "
      "| ratio | mean KiB per fragment sync (lowered) |",
      "|---|---|---|---|---|---|---|",
      *rows,
    ]
  )
  return {"title": "lowcomm: streaming DiLoCo wire per period", "markdown": table, "data": data}
