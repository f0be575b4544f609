"""Benchmark section: will a Llama-3-8B-shaped model fit? Answered from shapes, before anything is allocated.

`python -m jaxaccum.bench --sections fit` (8 devices, simulated on CPU). The
model is Llama-3-8B's shape: 32 layers of width 4096, grouped-query attention
(32 query heads, 8 key/value heads, head dimension 128, RoPE, a causal mask),
a SwiGLU feed-forward of 14336, RMSNorm, vocabulary 128256 with an untied
output head: 8.03e9 parameters. The layers are stacked and run with
`lax.scan` (the MaxText/Levanter layout), each layer rematerialised in the
backward pass (`jax.checkpoint`, nothing saved but its input). Parameters and
adam's state in float32 (MaxText's default `weight_dtype`); the forward pass
casts each weight to bfloat16 where it is used, the logits and the loss in
float32. Attention is plain XLA (the scores of a layer are materialised, no
flash kernel). Global batch 256 sequences of 4096 tokens (1M tokens per update)
over 8 devices: 32 sequences per device, K microbatches of 32/K.

Nothing is allocated: the parameters are `jax.ShapeDtypeStruct`s,
`ja.shard_train_state` turns them into the strategy's layout (abstract, with
shardings), `ja.make_train_step(...).lower(...).compile()` compiles the step,
and the figures are read from the compiled executable:

- peak per device: `memory_analysis()`'s argument + output - alias + temp
  (params and optimizer state donated), as `ja.plan_microbatches` counts it;
- the floor on paper (see `_floor`): what the layout holds (params, gradient
  accumulator, adam's two moments, per device) plus the activation term;
- bytes on the wire per update, by mesh axis: `ja.collective_bytes(compiled,
  by_axis=True, mesh=mesh)` (ring bytes one device sends, loop trip counts
  included);
- the plan: `ja.plan_microbatches` with candidates (1, 4, 16) for budgets of
  80 GiB and 16 GiB per device, over the same compiled steps (a cache: the plan
  compiles nothing twice).

Meshes: 8 devices as ("data",) for ddp, zero1 and fsdp; (2, 4) as ("replica",
"data") for hsdp (sharded over 4, replicated over 2). No model axis.
XLA:CPU's memory analysis is indicative: a GPU/TPU compiler schedules
differently (and may keep bfloat16 where the CPU widens to float32).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxaccum as ja
from jaxaccum.planner import compiled_memory_bytes

GiB = 2**30


class Shape(NamedTuple):
  """A decoder-only transformer's sizes (Llama 3 8B by default) and the batch it trains on."""

  layers: int = 32
  width: int = 4096
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  ffw: int = 14336
  vocab: int = 128256
  seq: int = 4096
  batch: int = 256  # sequences per update, over all devices


LLAMA3_8B = Shape()
QUICK = Shape(layers=2, width=256, heads=4, kv_heads=2, head_dim=64, ffw=512, vocab=1024, seq=128, batch=128)


def abstract_params(shape: Shape, dtype=jnp.float32) -> dict:
  """The parameters as `jax.ShapeDtypeStruct`s: nothing allocated (the layers stacked on a leading axis)."""
  s = lambda *dims: jax.ShapeDtypeStruct(dims, dtype)
  L, d, q, kv = shape.layers, shape.width, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
  return {
    "embed": s(shape.vocab, d),
    "layers": {
      "attn_norm": s(L, d),
      "wq": s(L, d, q),
      "wk": s(L, d, kv),
      "wv": s(L, d, kv),
      "wo": s(L, q, d),
      "mlp_norm": s(L, d),
      "w_gate": s(L, d, shape.ffw),
      "w_up": s(L, d, shape.ffw),
      "w_down": s(L, shape.ffw, d),
    },
    "final_norm": s(d),
    "head": s(d, shape.vocab),
  }


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x, theta: float = 500000.0):
  """Rotary position embedding on (batch, seq, heads, head_dim), Llama 3's base."""
  seq, dim = x.shape[1], x.shape[-1]
  freqs = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def make_loss(shape: Shape, compute_dtype=jnp.bfloat16) -> Callable:
  """Next-token cross-entropy of the model on `batch = {"inputs", "targets"}` (int32, (rows, seq))."""
  h, kvh, hd = shape.heads, shape.kv_heads, shape.head_dim

  def layer(x, w):
    w = jax.tree.map(lambda a: a.astype(compute_dtype), w)
    b, s, _ = x.shape
    y = _rms_norm(x, w["attn_norm"])
    q = _rope((y @ w["wq"]).reshape(b, s, kvh, h // kvh, hd).reshape(b, s, h, hd))
    k = _rope((y @ w["wk"]).reshape(b, s, kvh, hd))
    v = (y @ w["wv"]).reshape(b, s, kvh, hd)
    q = q.reshape(b, s, kvh, h // kvh, hd)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / np.sqrt(hd)
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(compute_dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, h * hd)
    x = x + out @ w["wo"]
    y = _rms_norm(x, w["mlp_norm"])
    x = x + (jax.nn.silu(y @ w["w_gate"]) * (y @ w["w_up"])) @ w["w_down"]
    return x, None

  def loss(params, batch):
    x = params["embed"].astype(compute_dtype)[batch["inputs"]]
    x, _ = lax.scan(jax.checkpoint(layer), x, params["layers"])
    x = _rms_norm(x, params["final_norm"])
    logits = (x @ params["head"].astype(compute_dtype)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))

  return loss


# --------------------------------------------------------------------------- the cases


class Case(NamedTuple):
  name: str
  strategy: str
  gather: str | None  # fsdp_gather
  mesh_shape: tuple[int, ...]
  axes: Any  # data_axis


CASES = (
  Case("ddp", "ddp", None, (8,), "data"),
  Case("zero1", "zero1", None, (8,), "data"),
  Case("fsdp per_microbatch", "fsdp", "per_microbatch", (8,), "data"),
  Case("fsdp once", "fsdp", "once", (8,), "data"),
  Case("hsdp (2 x 4)", "hsdp", "per_microbatch", (2, 4), ("replica", "data")),
)


def _mesh(case: Case):
  names = case.axes if isinstance(case.axes, tuple) else (case.axes,)
  devices = jax.devices()[:8]
  return jax.make_mesh(case.mesh_shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def _floor(shape: Shape, case: Case, params_bytes: int, k: int) -> dict[str, int]:
  """The floor on paper of one device (bytes), term by term.

  $N$ = the float32 parameters' bytes, $P$ = the devices the state is sharded
  over (8; hsdp's shard axis 4), $L$ = one layer's float32 weights. The state
  (params, the float32 gradient accumulator, adam's two moments):

  - ddp $4N$; zero1 $2N + 2N/P$ (params and the accumulator full size, adam
    sharded);
  - fsdp per_microbatch and hsdp $4N/P + 2L$ (one gathered layer and its
    full-size gradient beside the shards);
  - fsdp once $2N + 3N/P$ (the gathered copy and the full accumulator beside
    the sharded params and moments).

  The activation term of one microbatch of $b = 32/K$ sequences of $S$
  tokens: the scan's saved layer inputs, $32\\, b S d$ bfloat16 values; the
  float32 logits with their gradient, $2 \\cdot 4\\, b S V$ bytes; the float32
  attention scores of one layer, $4\\, b H S^2$ bytes ($H$ query heads: plain
  XLA attention materialises them; a flash kernel would not). Left out: the
  rest of one layer's rematerialised activations.
  """
  n = params_bytes
  layer = sum(int(np.prod(x.shape[1:])) * 4 for x in jax.tree.leaves(abstract_params(shape)["layers"]))
  p = 4 if case.strategy == "hsdp" else 8
  state = {
    "ddp": 4 * n,
    "zero1": 2 * n + 2 * n // p,
    "fsdp": 4 * n // p + 2 * layer if case.gather == "per_microbatch" else 2 * n + 3 * n // p,
    "hsdp": 4 * n // p + 2 * layer,
  }[case.strategy]
  rows = shape.batch // 8 // k
  tokens = rows * shape.seq
  return {
    "state": state,
    "saved_layer_inputs": shape.layers * tokens * shape.width * 2,
    "logits_and_grad": 2 * tokens * shape.vocab * 4,
    "attention_scores": 4 * rows * shape.heads * shape.seq**2,
  }


class _Cached:
  """A step whose `lower(...).compile()` returns a compiled executable already made (the plan reuses the table's)."""

  def __init__(self, compiled):
    self._compiled = compiled

  def lower(self, *args):
    return self

  def compile(self):
    return self._compiled


def _axis_bytes(compiled, mesh) -> dict[str, float]:
  """Ring bytes one device sends per update, by the mesh axes the collective spans ("a+b" for several)."""
  got = ja.collective_bytes(compiled, by_axis=True, mesh=mesh)
  out: dict[str, float] = {}
  for axes, ops in got.items():
    key = axes if isinstance(axes, str) else "+".join(axes) or "none"
    out[key] = out.get(key, 0.0) + sum(ops.values())
  return out


def fit_table(shape: Shape = LLAMA3_8B, ks=(1, 4, 16), budgets=(80 * GiB, 16 * GiB), cases=CASES) -> dict:
  """Every case at every K, compiled from shapes: rows and plans (see the module docstring)."""
  opt = optax.adam(3e-4)
  loss = make_loss(shape)
  params = abstract_params(shape)
  n = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  rows: list[dict] = []
  plans: dict[tuple[str, int], dict[str, Any]] = {}
  for case in cases:
    mesh = _mesh(case)
    p, s = ja.shard_train_state(params, opt, mesh, strategy=case.strategy, data_axis=case.axes)
    rows_sh = NamedSharding(mesh, PartitionSpec(case.axes))
    tokens = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32, sharding=rows_sh)
    batch = {"inputs": tokens, "targets": tokens}
    options = {} if case.gather is None else {"fsdp_gather": case.gather}
    compiled = {}
    for k in ks:
      step = ja.make_train_step(
        loss, opt, num_microbatches=k, mesh=mesh, strategy=case.strategy, data_axis=case.axes, **options
      )
      start = time.perf_counter()
      compiled[k] = step.lower(p, s, batch).compile()
      seconds = time.perf_counter() - start
      m = compiled[k].memory_analysis()
      floor = _floor(shape, case, n, k)
      rows.append(
        {
          "case": case.name,
          "K": k,
          "peak_bytes": compiled_memory_bytes(compiled[k]),
          "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes),
          "alias_bytes": int(m.alias_size_in_bytes),
          "temp_bytes": int(m.temp_size_in_bytes),
          "floor": floor,
          "floor_bytes": sum(floor.values()),
          "axis_bytes": _axis_bytes(compiled[k], mesh),
          "compile_seconds": round(seconds, 1),
        }
      )

    def cached(k: int, compiled: dict = compiled) -> _Cached:
      return _Cached(compiled[k])

    for budget in budgets:
      try:
        plan = ja.plan_microbatches(cached, p, s, batch, memory_budget_bytes=budget, candidates=ks)
        plans[case.name, budget] = {"K": int(plan), "bytes": plan.memory_bytes}
      except ValueError:
        plans[case.name, budget] = {"K": None, "bytes": min(r["peak_bytes"] for r in rows if r["case"] == case.name)}
  return {"param_bytes": n, "params": sum(x.size for x in jax.tree.leaves(params)), "rows": rows, "plans": plans}


def _unit(n: int) -> tuple[str, int]:
  """GiB for the real model, MiB for the quick one."""
  return ("GiB", GiB) if n >= GiB else ("MiB", 2**20)


def _plan_cell(plan: dict) -> str:
  return f"K={plan['K']}" if plan["K"] is not None else "none fits"


def run(quick: bool = False) -> list[dict]:
  shape, budgets = LLAMA3_8B, (80 * GiB, 16 * GiB)
  ks: tuple[int, ...] = (1, 4, 16)
  cases: tuple[Case, ...] = CASES
  if quick:  # a few MiB, three strategies, two Ks (the bench test's smoke run)
    shape, ks, cases, budgets = QUICK, (1, 4), CASES[::2], (64 * 2**20, 8 * 2**20)
  start = time.perf_counter()
  got = fit_table(shape, ks=ks, budgets=budgets, cases=cases)
  seconds = time.perf_counter() - start
  n = got["param_bytes"]
  unit, size = _unit(n)
  _gib = lambda x: f"{x / size:.1f}"
  label = lambda b: f"{b / GiB:g} GiB" if b >= GiB else f"{b / 2**20:g} MiB"
  lines = [
    f"{'Quick model' if quick else 'Llama-3-8B shape'}: {shape.layers} layers of width {shape.width}, "
    f"{shape.heads} query heads and {shape.kv_heads} key/value heads of {shape.head_dim}, feed-forward "
    f"{shape.ffw}, vocabulary {shape.vocab}: {got['params'] / 1e9:.3g}e9 parameters, N = {_gib(n)} {unit} in "
    f"float32 (adam's state float32 too; the forward pass in bfloat16, layers scanned and rematerialised). "
    f"Global batch {shape.batch} sequences of {shape.seq} tokens, 8 devices; K microbatches of "
    f"{shape.batch // 8}/K sequences per device. Compiled on CPU from `jax.ShapeDtypeStruct`s "
    "(nothing allocated; the section's wall time is in its JSON, `data.seconds`). Peak: XLA's argument + output "
    "- alias + "
    f"temp per device, {unit}, params and state donated. Floor: the layout's state + one microbatch's saved layer "
    "inputs, its float32 logits and their gradient, and one layer's float32 attention scores (see the guide). "
    "Wire: ring bytes one device sends per update "
    f"over each mesh axis (`ja.collective_bytes(by_axis=True)`), {unit}. Plan: `ja.plan_microbatches` over K in "
    f"{ks}.",
    "",
    f"| strategy | K | peak ({unit}) | floor ({unit}) | peak / floor | data axis ({unit}) | replica axis ({unit}) "
    f"| plan, {label(budgets[0])} | plan, {label(budgets[1])} |",
    "|---|---:|---:|---:|---:|---:|---:|---|---|",
  ]
  for r in got["rows"]:
    ax = r["axis_bytes"]
    other = {a: b for a, b in ax.items() if a not in ("data", "replica")}
    replica = ax.get("replica", 0.0) + sum(other.values())  # hsdp's all-reduce over the replicas (and both axes)
    first = r["K"] == 1
    plan = lambda b, r=r: _plan_cell(got["plans"][r["case"], b]) if first else ""
    lines.append(
      f"| {r['case']} | {r['K']} | {_gib(r['peak_bytes'])} | {_gib(r['floor_bytes'])} "
      f"| {r['peak_bytes'] / r['floor_bytes']:.2f} | {_gib(ax.get('data', 0.0))} "
      f"| {_gib(replica) if r['case'].startswith('hsdp') else '-'} | {plan(budgets[0])} | {plan(budgets[1])} |"
    )
  data = {
    "shape": shape._asdict(),
    "param_bytes": n,
    "params": got["params"],
    "seconds": round(seconds, 1),
    "rows": got["rows"],
    "plans": {f"{case}/{label(b)}": v for (case, b), v in got["plans"].items()},
  }
  return [
    {"title": "fit: will a Llama-3-8B-shaped model fit on 8 devices?", "markdown": "\n".join(lines), "data": data}
  ]
