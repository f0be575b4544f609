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
  tied: bool = False  # the output head is the embedding's transpose (Gemma), not a parameter of its own


LLAMA3_8B = Shape()
# Gemma 2B's sizes (Flax's Gemma example): 18 layers of 2048, 8 query heads and 1 key/value head of 256, a
# feed-forward of 16384, vocabulary 256128, tied embedding: 2.51e9 parameters. 128 sequences of 1024 tokens,
# so that K = 16 divides the 16 rows of each of 8 devices. The layer is this module's (SwiGLU, not GeGLU:
# the same shapes and bytes).
GEMMA_2B = Shape(
  layers=18, width=2048, heads=8, kv_heads=1, head_dim=256, ffw=16384, vocab=256128, seq=1024, batch=128, tied=True
)
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
    **({} if shape.tied else {"head": s(d, shape.vocab)}),
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
    head = params["embed"].T if shape.tied else params["head"]
    logits = (x @ head.astype(compute_dtype)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))

  return loss


# --------------------------------------------------------------------------- the cases


class Case(NamedTuple):
  name: str
  strategy: str  # a make_train_step strategy, or "plain": the plain GSPMD step (`plain_step`) in `layout`'s layout
  gather: str | None  # fsdp_gather
  mesh_shape: tuple[int, ...]
  axes: Any  # data_axis
  plain: str  # the name of the plain step this row is read against


PLAIN_REPLICATED = "plain step, replicated"
PLAIN_FSDP = "plain step, fsdp layout"
PLAIN_HSDP = "plain step, hsdp layout"
CASES = (
  Case(PLAIN_REPLICATED, "plain", "ddp", (8,), "data", PLAIN_REPLICATED),
  Case("ddp", "ddp", None, (8,), "data", PLAIN_REPLICATED),
  Case("zero1", "zero1", None, (8,), "data", PLAIN_REPLICATED),
  Case(PLAIN_FSDP, "plain", "fsdp", (8,), "data", PLAIN_FSDP),
  Case("fsdp per_microbatch", "fsdp", "per_microbatch", (8,), "data", PLAIN_FSDP),
  Case("fsdp once", "fsdp", "once", (8,), "data", PLAIN_FSDP),
  Case(PLAIN_HSDP, "plain", "hsdp", (2, 4), ("replica", "data"), PLAIN_HSDP),
  Case("hsdp (2 x 4)", "hsdp", "per_microbatch", (2, 4), ("replica", "data"), PLAIN_HSDP),
)


def plain_step(loss: Callable, optimizer, k: int, params, opt_state):
  """The step a user writes without jaxaccum: `jax.jit` + `lax.scan` over K microbatches, GSPMD partitions it.

  Parameters and optimizer state keep the layout they are given (their
  shardings, donated); microbatch i takes rows i, i+K, ... (each device keeps
  its rows), the float32 accumulator is constrained to each parameter's
  layout, and the optimizer runs on the mean gradient. No skip: every update
  applies. `params`, `opt_state`: placed arrays or `jax.ShapeDtypeStruct`s with
  shardings (`ja.shard_train_state`).
  """
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  param_sh = shardings(params)

  def step(params, opt_state, batch):
    mbs = jax.tree.map(lambda v: jnp.moveaxis(v.reshape((v.shape[0] // k, k) + v.shape[1:]), 1, 0), batch)

    def body(carry, mb):
      acc, total = carry
      value, g = jax.value_and_grad(loss)(params, mb)
      return (jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, g), total + value), None

    zeros = jax.tree.map(
      lambda x, sh: lax.with_sharding_constraint(jnp.zeros(x.shape, jnp.float32), sh), params, param_sh
    )
    (acc, total), _ = lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), mbs)
    grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, total / k

  return jax.jit(step, donate_argnums=(0, 1), out_shardings=(param_sh, shardings(opt_state), None))


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
  # A plain step holds what the strategy of its layout holds (GSPMD gathers a layer where it is used).
  strategy = str(case.gather) if case.strategy == "plain" else case.strategy
  gather = "per_microbatch" if case.strategy == "plain" else case.gather
  p = 4 if strategy == "hsdp" else 8
  state = {
    "ddp": 4 * n,
    "zero1": 2 * n + 2 * n // p,
    "fsdp": 4 * n // p + 2 * layer if gather == "per_microbatch" else 2 * n + 3 * n // p,
    "hsdp": 4 * n // p + 2 * layer,
  }[strategy]
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


def _compile_case(case: Case, loss, opt, k: int, p, s, batch):
  if case.strategy == "plain":
    return plain_step(loss, opt, k, p, s).lower(p, s, batch)
  options: dict[str, Any] = {} if case.gather is None else {"fsdp_gather": case.gather}
  step = ja.make_train_step(
    loss, opt, num_microbatches=k, mesh=p_mesh(p), strategy=case.strategy, data_axis=case.axes, **options
  )
  return step.lower(p, s, batch)


def p_mesh(params):
  """The mesh the (abstract) parameters are laid out on."""
  return jax.tree.leaves(params)[0].sharding.mesh


def case_inputs(shape: Shape, case: Case, opt):
  """(params, opt_state, batch) of `case` as `jax.ShapeDtypeStruct`s with shardings: nothing allocated."""
  mesh = _mesh(case)
  layout = str(case.gather) if case.strategy == "plain" else case.strategy
  p, s = ja.shard_train_state(abstract_params(shape), opt, mesh, strategy=layout, data_axis=case.axes)
  rows_sh = NamedSharding(mesh, PartitionSpec(case.axes))
  tokens = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32, sharding=rows_sh)
  return p, s, {"inputs": tokens, "targets": tokens}


def fit_table(shape: Shape = LLAMA3_8B, ks=(1, 4, 16), budgets=(80 * GiB, 16 * GiB), cases=CASES) -> dict:
  """Every case at every K, compiled from shapes: rows and plans (see the module docstring)."""
  opt = optax.adamw(3e-4)
  loss = make_loss(shape)
  params = abstract_params(shape)
  n = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  rows: list[dict] = []
  plans: dict[tuple[str, int], dict[str, Any]] = {}
  for case in cases:
    p, s, batch = case_inputs(shape, case, opt)
    mesh = p_mesh(p)
    compiled = {}
    for k in ks:
      start = time.perf_counter()
      compiled[k] = _compile_case(case, loss, opt, k, p, s, batch).compile()
      seconds = time.perf_counter() - start
      m = compiled[k].memory_analysis()
      floor = _floor(shape, case, n, k)
      rows.append(
        {
          "case": case.name,
          "plain": case.plain,
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
  plain = {(r["case"], r["K"]): r["peak_bytes"] for r in rows if r["case"] == r["plain"]}
  for r in rows:
    r["plain_peak_bytes"] = plain.get((r["plain"], r["K"]))
  return {"param_bytes": n, "params": sum(x.size for x in jax.tree.leaves(params)), "rows": rows, "plans": plans}


def _unit(n: int) -> tuple[str, int]:
  """GiB for the real model, MiB for the quick one."""
  return ("GiB", GiB) if n >= GiB else ("MiB", 2**20)


def _plan_cell(plan: dict) -> str:
  return f"K={plan['K']}" if plan["K"] is not None else "none fits"


def _table(shape: Shape, got: dict, ks, budgets, title: str, quick: bool) -> dict:
  n = got["param_bytes"]
  unit, size = _unit(n)
  _gib = lambda x: f"{x / size:.1f}"
  label = lambda b: f"{b / GiB:g} GiB" if b >= GiB else f"{b / 2**20:g} MiB"
  lines = [
    f"{shape.layers} layers of width {shape.width}, {shape.heads} query heads and {shape.kv_heads} key/value "
    f"heads of {shape.head_dim}, feed-forward {shape.ffw}, vocabulary {shape.vocab}"
    f"{' (tied embedding)' if shape.tied else ''}: {got['params'] / 1e9:.3g}e9 parameters, N = {_gib(n)} {unit} "
    "in float32 (adamw's state float32 too; the forward pass in bfloat16, layers scanned and rematerialised). "
    f"Global batch {shape.batch} sequences of {shape.seq} tokens, 8 devices; K microbatches of "
    f"{shape.batch // 8}/K sequences per device. Compiled on CPU from `jax.ShapeDtypeStruct`s "
    "(nothing allocated; the section's wall time is in its JSON, `data.seconds`). Peak: XLA's argument + output "
    f"- alias + temp per device, {unit}, params and state donated. **vs plain**: the peak against the plain "
    "GSPMD step (`jax.jit` + `lax.scan` over the same K microbatches, no skip) in the layout named: ddp and "
    "zero1 against the replicated one, fsdp against the fsdp layout, hsdp against the hsdp layout. Floor: the "
    "layout's state + one microbatch's saved layer inputs, its float32 logits and their gradient, and one layer's "
    "float32 attention scores (see the guide). Wire: ring bytes one device sends per update over each mesh axis "
    f"(`ja.collective_bytes(by_axis=True)`), {unit}. Plan: `ja.plan_microbatches` over K in {tuple(ks)}.",
    "",
    f"| strategy | K | peak ({unit}) | vs plain | floor ({unit}) | peak / floor | data axis ({unit}) "
    f"| replica axis ({unit}) | plan, {label(budgets[0])} | plan, {label(budgets[1])} |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
  ]
  for r in got["rows"]:
    ax = r["axis_bytes"]
    other = {a: b for a, b in ax.items() if a not in ("data", "replica")}
    replica = ax.get("replica", 0.0) + sum(other.values())  # hsdp's all-reduce over the replicas (and both axes)
    first = r["K"] == ks[0]
    plan = lambda b, r=r: _plan_cell(got["plans"][r["case"], b]) if first else ""
    vs = "-" if r["case"] == r["plain"] else f"{r['peak_bytes'] / r['plain_peak_bytes']:.2f}"
    hsdp_layout = r["case"].startswith("hsdp") or r["case"] == PLAIN_HSDP
    lines.append(
      f"| {r['case']} | {r['K']} | {_gib(r['peak_bytes'])} | {vs} | {_gib(r['floor_bytes'])} "
      f"| {r['peak_bytes'] / r['floor_bytes']:.2f} | {_gib(ax.get('data', 0.0))} "
      f"| {_gib(replica) if hsdp_layout else '-'} | {plan(budgets[0])} | {plan(budgets[1])} |"
    )
  data = {
    "shape": shape._asdict(),
    "param_bytes": n,
    "params": got["params"],
    "rows": got["rows"],
    "plans": {f"{case}/{label(b)}": v for (case, b), v in got["plans"].items()},
  }
  return {"title": title, "markdown": "\n".join(lines), "data": data}


BREAKDOWN_CASES = (CASES[3], CASES[4], CASES[1], CASES[0])  # plain fsdp layout, fsdp per_microbatch, ddp, plain


def breakdown_table(shape: Shape = GEMMA_2B, ks=(1, 16), cases=BREAKDOWN_CASES) -> list[dict]:
  """Where the bytes go at the compiled peak (`ja.memory_breakdown`): per kind, and the largest buffers."""
  opt = optax.adamw(3e-4)
  loss = make_loss(shape)
  out = []
  for k in ks:
    for case in cases:
      p, s, batch = case_inputs(shape, case, opt)
      got = ja.memory_breakdown(_compile_case(case, loss, opt, k, p, s, batch))
      top = [
        {"bytes": b.bytes, "kind": b.kind, "shape": b.shape.split("{")[0], "op": _short_op(b.op_name or b.name)}
        for b in got.buffers[:4]
      ]
      out.append({"case": case.name, "K": k, "peak_bytes": got.peak_bytes, "by_kind": got.by_kind(), "top": top})
  return out


def _short_op(op_name: str) -> str:
  """The tail of a JAX op name that says what made a buffer (`transpose(jvp(jit(log_softmax)))/reduce_sum`)."""
  parts = [p for p in op_name.split("/") if p not in ("eval_jaxpr", "shard_map", "while", "body")]
  return "/".join(parts[-2:]) if len(parts) > 1 else op_name


def _breakdown_markdown(shape: Shape, rows: list[dict]) -> str:
  kinds = ("argument", "gathered", "collective", "loop state", "temporary")
  lines = [
    "Gemma-2B shape as above, adamw. The buffers alive at the peak of XLA:CPU's schedule "
    "(`ja.memory_breakdown`: XLA's live-range report, named by the JAX operation that made each buffer), GiB per "
    "device, by kind, and the two largest buffers. This peak is the schedule's; `memory_analysis()`'s total (the "
    "table above) is the preallocated block, which also holds what the allocator could not pack.",
    "",
    "| case | K | peak at schedule (GiB) | " + " | ".join(kinds) + " | largest buffers |",
    "|---|---:|---:|" + "---:|" * len(kinds) + "---|",
  ]
  for r in rows:
    cells = [f"{r['by_kind'].get(k, 0) / GiB:.1f}" for k in kinds]
    top = "; ".join(f"{t['shape']} {t['bytes'] / GiB:.1f} ({t['op']})" for t in r["top"][:2])
    lines.append(f"| {r['case']} | {r['K']} | {r['peak_bytes'] / GiB:.1f} | " + " | ".join(cells) + f" | {top} |")
  return "\n".join(lines)


# XLA:CPU's YNNPACK fusion: a CPU-only matmul library that fuses a dot with elementwise consumers. In the
# per-device program it takes the logits' float32 convert (and the softmax's max) into the logits matmul, so
# the float32 logits are materialised beside their exponential; in the plain step's partitioned program the
# vocabulary-sharded dot has several consumers and stays bfloat16. GPU and TPU have no such fusion.
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
YNN_CASES = (CASES[3], CASES[4], CASES[6], CASES[7])  # plain fsdp layout, fsdp per_microbatch, plain hsdp, hsdp


def without_ynn_fusion(shape: Shape, got: dict, ks, cases=YNN_CASES, name: str = "Gemma-2B") -> dict:
  """The per-microbatch strategies and their plain steps compiled again with XLA:CPU's YNNPACK fusion off."""
  opt = optax.adamw(3e-4)
  loss = make_loss(shape)
  peaks = {}
  for case in cases:
    p, s, batch = case_inputs(shape, case, opt)
    for k in ks:
      peaks[case.name, k] = compiled_memory_bytes(
        _compile_case(case, loss, opt, k, p, s, batch).compile(compiler_options=NO_YNN)
      )
  default = {(r["case"], r["K"]): r["peak_bytes"] for r in got["rows"]}
  rows = [
    {
      "case": case.name,
      "K": k,
      "plain": case.plain,
      "peak_bytes": default[case.name, k],
      "ratio": default[case.name, k] / default[case.plain, k],
      "no_ynn_peak_bytes": peaks[case.name, k],
      "no_ynn_ratio": peaks[case.name, k] / peaks[case.plain, k],
    }
    for case in cases
    if case.name != case.plain
    for k in ks
  ]
  lines = [
    f"The {name} shape as above ({shape.layers} layers of width {shape.width}, vocabulary {shape.vocab}): the "
    "per-microbatch "
    "strategies against the plain step of their layout, compiled as above and again with XLA:CPU's YNNPACK "
    '(a CPU-only matmul library) fusion off (`compile(compiler_options={"xla_cpu_experimental_ynn_fusion_type": '
    '""})`, the plain step too). With it on, the per-device program\'s logits matmul absorbs the float32 '
    "convert, so the float32 logits are held beside their exponential; GPU and TPU compilers have no such fusion. "
    "Peak per device, GiB.",
    "",
    "| strategy | K | peak | vs plain | peak, YNNPACK fusion off | vs plain, YNNPACK fusion off |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['case']} | {r['K']} | {r['peak_bytes'] / GiB:.1f} | {r['ratio']:.2f} | "
      f"{r['no_ynn_peak_bytes'] / GiB:.1f} | {r['no_ynn_ratio']:.2f} |"
    )
  return {
    "title": f"fit: the {name} shape without XLA:CPU's YNNPACK fusion",
    "markdown": "\n".join(lines),
    "data": {"rows": rows},
  }


def run(quick: bool = False) -> list[dict]:
  budgets = (80 * GiB, 16 * GiB)
  ks: tuple[int, ...] = (1, 4, 16)
  shapes: tuple[tuple[Shape, str], ...] = (
    (LLAMA3_8B, "fit: will a Llama-3-8B-shaped model fit on 8 devices?"),
    (GEMMA_2B, "fit: will a Gemma-2B-shaped model fit on 8 devices?"),
  )
  cases: tuple[Case, ...] = CASES
  if quick:  # a few MiB, two Ks (the bench test's smoke run)
    shapes, ks, budgets = ((QUICK, "fit: quick model"),), (1, 4), (64 * 2**20, 8 * 2**20)
    cases = tuple(c for c in CASES if c.plain == PLAIN_FSDP and c.gather != "once")  # the plain step and fsdp
  out = []
  for shape, title in shapes:
    start = time.perf_counter()
    got = fit_table(shape, ks=ks, budgets=budgets, cases=cases)
    result = _table(shape, got, ks, budgets, title, quick)
    result["data"]["seconds"] = round(time.perf_counter() - start, 1)
    out.append(result)
    if shape is GEMMA_2B and jax.default_backend() == "cpu":
      start = time.perf_counter()
      out.append(without_ynn_fusion(shape, got, ks))
      out[-1]["data"]["seconds"] = round(time.perf_counter() - start, 1)
  if not quick:
    start = time.perf_counter()
    rows = breakdown_table()
    out.append(
      {
        "title": "fit: where the bytes go (Gemma-2B shape)",
        "markdown": _breakdown_markdown(GEMMA_2B, rows),
        "data": {"rows": rows, "seconds": round(time.perf_counter() - start, 1)},
      }
    )
  return out
