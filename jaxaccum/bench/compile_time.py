"""Benchmark table: compile time of `make_train_step` against a plain `jax.jit` step, from abstract shapes.

Included by the "Beyond the data axis" section (`model_axis.run`). A plain-JAX
pre-norm transformer (RMS norm, one attention head of width D, a 4D gelu MLP,
sequence 64, vocabulary 512), its layers either listed (a Python loop over a
list of per-layer dicts, 32 x 512 and 96 x 256) or stacked and applied with
`lax.scan` (32 x 512), adam, batch 64, K = 4 microbatches, 8 devices.

Every step is lowered and compiled from `jax.ShapeDtypeStruct`s with
shardings (`ja.shard_train_state` on abstract parameters gives the layout):
nothing is allocated. Steps:

- plain: `jax.jit` of a `lax.scan` of `jax.grad` over the K microbatches then
  adam, GSPMD shardings: the fsdp layout (the baseline of the fsdp rows) and
  replicated parameters and state (the baseline of the ddp row);
- plain + skip: the same plain steps with the guarantee every jaxaccum step
  gives, written by hand: the update runs in a `lax.cond` on every gradient
  being finite (checked as jaxaccum checks it: one reduction of `x - x` per
  leaf), else parameters and state are kept. What that guarantee costs on its
  own, beside the plain step;
- jaxaccum: `ja.make_train_step(strategy="ddp")`, `strategy="fsdp"` with
  `fsdp_gather="per_microbatch"` and `"once"`.

Each rep clears JAX's caches (`jax.clear_caches()`) and builds fresh function
objects before each step is measured, so nothing is reused between steps or
reps; the order of the steps is rotated every rep. A ratio is jaxaccum's
trace + lower + compile seconds over its plain baseline's in the same rep; the
table prints its median and [min, max] over the reps. Compile seconds are
XLA's (`lowered.compile()`), trace + lower everything before (`jit(...).lower`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxaccum as ja
from jaxaccum.bench import common

SEQ, BATCH, VOCAB, K = 64, 64, 512, 4
STEPS = (
  "plain fsdp layout",
  "plain fsdp layout + skip",
  "plain replicated",
  "plain replicated + skip",
  "ddp",
  "fsdp per_microbatch",
  "fsdp once",
  "ddp, no check",
  "fsdp per_microbatch, no check",
)
# Each jaxaccum step against its plain baseline (the target's), and against that baseline with the skip.
# "no check": make_train_step(..., skip_nonfinite=False), held to the plain step with no allowance.
BASELINE = {
  "ddp": "plain replicated",
  "fsdp per_microbatch": "plain fsdp layout",
  "fsdp once": "plain fsdp layout",
  "ddp, no check": "plain replicated",
  "fsdp per_microbatch, no check": "plain fsdp layout",
}
WITH_SKIP = {n: f"{base} + skip" for n, base in BASELINE.items() if not n.endswith("no check")}
TARGET = {"listed": 1.25, "scanned": 1.05}


def _abstract_params(kind: str, depth: int, width: int) -> dict:
  f = jnp.float32
  lead = () if kind == "listed" else (depth,)
  s = lambda *shape: jax.ShapeDtypeStruct((*lead, *shape), f)
  layer = lambda: {
    "ln1": s(width),
    "qkv": s(width, 3 * width),
    "o": s(width, width),
    "ln2": s(width),
    "up": s(width, 4 * width),
    "down": s(4 * width, width),
  }
  layers = [layer() for _ in range(depth)] if kind == "listed" else layer()
  return {
    "emb": jax.ShapeDtypeStruct((VOCAB, width), f),
    "layers": layers,
    "out": jax.ShapeDtypeStruct((width, VOCAB), f),
  }


def _norm(x, g):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _block(p, x):
  width = x.shape[-1]
  h = _norm(x, p["ln1"])
  q, k, v = jnp.split(h @ p["qkv"], 3, -1)
  a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / float(np.sqrt(width)), -1)
  x = x + jnp.einsum("bts,bsd->btd", a, v) @ p["o"]
  return x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def make_loss(kind: str) -> Callable:
  """A fresh loss function object (nothing of an earlier trace attached to it)."""

  def loss(params, batch):
    x = params["emb"][batch["tok"]]
    if kind == "listed":
      for p in params["layers"]:
        x = _block(p, x)
    else:
      x, _ = lax.scan(lambda h, p: (_block(p, h), None), x, params["layers"])
    logits = x @ params["out"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"]))

  return loss


def _plain_step(loss: Callable, opt, k: int, *, skip: bool = False) -> Callable:
  """The plain step; `skip=True`: its update in a `lax.cond` on every gradient being finite.

  The check is written as jaxaccum's own (`_tree.all_finite`, inlined here: one reduction of `x - x` per leaf,
  0 or NaN), so that the reference rows cost what the guarantee costs and the ratio against them is what the
  rest of jaxaccum's step costs. `optax.apply_if_finite`'s `all(isfinite(x))` is two to three XLA:CPU kernels
  per leaf: dearer.
  """

  @jax.jit
  def step(params, opt_state, batch):
    mb = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

    def body(g, m):
      return jax.tree.map(jnp.add, g, jax.grad(loss)(params, m)), None

    g, _ = lax.scan(body, jax.tree.map(jnp.zeros_like, params), mb)
    g = jax.tree.map(lambda x: x / k, g)

    def update(ops):
      params, opt_state = ops
      updates, opt_state = opt.update(g, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    if not skip:
      return update((params, opt_state))
    finite = jnp.isfinite(sum(jnp.sum(x - x, dtype=jnp.float32) for x in jax.tree.leaves(g)))
    return lax.cond(finite, update, lambda ops: ops, (params, opt_state))

  return step


def _builders(kind: str, depth: int, width: int, mesh) -> dict[str, Callable]:
  """For each step, a function building (fresh step function, its abstract arguments)."""
  opt = optax.adam(1e-3)
  params = _abstract_params(kind, depth, width)
  fsdp_args = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
  ddp_args = ja.shard_train_state(params, opt, mesh, strategy="ddp")
  rows = NamedSharding(mesh, PartitionSpec("data"))
  batch = {n: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=rows) for n in ("tok", "tgt")}

  def ja_step(strategy, gather=None, check=True):
    options: dict = {} if gather is None else {"fsdp_gather": gather}
    return lambda: ja.make_train_step(
      make_loss(kind), opt, num_microbatches=K, mesh=mesh, strategy=strategy, skip_nonfinite=check, **options
    )

  return {
    "plain fsdp layout": lambda: (_plain_step(make_loss(kind), opt, K), (*fsdp_args, batch)),
    "plain replicated": lambda: (_plain_step(make_loss(kind), opt, K), (*ddp_args, batch)),
    "plain fsdp layout + skip": lambda: (_plain_step(make_loss(kind), opt, K, skip=True), (*fsdp_args, batch)),
    "plain replicated + skip": lambda: (_plain_step(make_loss(kind), opt, K, skip=True), (*ddp_args, batch)),
    "ddp": lambda: (ja_step("ddp")(), (*ddp_args, batch)),
    "fsdp per_microbatch": lambda: (ja_step("fsdp", "per_microbatch")(), (*fsdp_args, batch)),
    "fsdp once": lambda: (ja_step("fsdp", "once")(), (*fsdp_args, batch)),
    "ddp, no check": lambda: (ja_step("ddp", check=False)(), (*ddp_args, batch)),
    "fsdp per_microbatch, no check": lambda: (ja_step("fsdp", "per_microbatch", check=False)(), (*fsdp_args, batch)),
  }


def _measure_once(build: Callable) -> tuple[float, float]:
  jax.clear_caches()
  gc.collect()
  step, args = build()
  t0 = time.perf_counter()
  lowered = step.lower(*args)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1


def measure(kind: str, depth: int, width: int, reps: int, steps=STEPS) -> dict:
  """Trace + lower and compile seconds of each step, `reps` interleaved reps (order rotated each rep)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  builders = _builders(kind, depth, width, mesh)
  names = [s for s in STEPS if s in steps]
  lower: dict[str, list[float]] = {n: [] for n in names}
  compile_: dict[str, list[float]] = {n: [] for n in names}
  for r in range(reps):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      t_lower, t_compile = _measure_once(builders[name])
      lower[name].append(t_lower)
      compile_[name].append(t_compile)
  jax.clear_caches()
  total = {n: [a + b for a, b in zip(lower[n], compile_[n], strict=True)] for n in names}
  ratios = {
    n: common._quartiles([a / b for a, b in zip(total[n], total[base], strict=True)])
    for n, base in BASELINE.items()
    if n in names and base in names
  }
  lower_ratios = {
    n: common._quartiles([a / b for a, b in zip(lower[n], lower[base], strict=True)])
    for n, base in BASELINE.items()
    if n in names and base in names
  }
  compile_ratios = {
    n: common._quartiles([a / b for a, b in zip(compile_[n], compile_[base], strict=True)])
    for n, base in BASELINE.items()
    if n in names and base in names
  }
  # The plain step with the skip against the plain step, and each jaxaccum step against the former.
  skip_ratios = {
    n: common._quartiles([a / b for a, b in zip(total[n], total[base], strict=True)])
    for n, base in [*((WITH_SKIP[j], b) for j, b in BASELINE.items() if j in WITH_SKIP), *WITH_SKIP.items()]
    if n in names and base in names
  }
  return {
    "kind": kind,
    "depth": depth,
    "width": width,
    "reps": reps,
    "lower_seconds": lower,
    "compile_seconds": compile_,
    "ratio": ratios,
    "lower_ratio": lower_ratios,
    "compile_ratio": compile_ratios,
    "skip_ratio": skip_ratios,
  }


def table(quick: bool = False) -> dict:
  """The compile-time table: {"title", "markdown", "data"} (a result as each section's `run` returns them)."""
  if quick:
    models = [("listed", 2, 64, 2), ("scanned", 2, 64, 2)]
  else:  # about 10 minutes on 2 cores: the 96-layer model (~4 minutes a rep) once
    models = [("listed", 32, 512, 3), ("listed", 96, 256, 1), ("scanned", 32, 512, 3)]
  load_before = common.load_average()
  start = time.perf_counter()
  results = [measure(kind, depth, width, reps) for kind, depth, width, reps in models]
  seconds = time.perf_counter() - start
  load_after = common.load_average()
  med = lambda xs: float(np.median(xs))
  lines = [
    f"Trace + lower + compile of one training step from abstract shapes (`jax.ShapeDtypeStruct`s with shardings, "
    f"nothing allocated): a pre-norm transformer (one attention head, 4x gelu MLP, sequence {SEQ}, vocabulary "
    f"{VOCAB}), layers listed (a Python loop) or stacked under `lax.scan`, adam, batch {BATCH}, K = {K}, 8 "
    "devices. Baselines: a plain `jax.jit` + `lax.scan` over the microbatches with GSPMD shardings, in the fsdp "
    "layout (for the fsdp rows) or replicated (for ddp); '+ skip': the same plain step with the guarantee every "
    "jaxaccum step gives (no update from a non-finite gradient), hand-written: its update in a `lax.cond` on "
    "the gradients being finite, checked as jaxaccum checks them (one reduction of `x - x` per leaf). Each "
    "rep clears JAX's caches and builds fresh functions before every step; steps interleaved, order rotated "
    "each rep. ', no check': `make_train_step(..., skip_nonfinite=False)`, the guarantee off, read against the "
    "plain step with no allowance. Seconds: medians over the reps; ratios: a step's total over the "
    "plain step's (and over the plain step with the skip) within each rep, median [min, max]. Targets "
    f"(against the plain step): <= {TARGET['listed']:.2f}x listed, <= {TARGET['scanned']:.2f}x scanned.",
    "",
    "| layers | step | trace + lower (s) | compile (s) | total (s) | total / plain | total / plain + skip | verdict |",
    "|---|---|---:|---:|---:|---:|---:|---|",
  ]
  data: dict = {"models": results}
  for res in results:
    label = f"{res['depth']} x {res['width']} {res['kind']}"
    for name in STEPS:
      lo, co = med(res["lower_seconds"][name]), med(res["compile_seconds"][name])
      skip = res["skip_ratio"].get(name)
      if name in res["ratio"]:
        q = res["ratio"][name]
        cell, verdict = common.ratio_cell(q), common.verdict(q, TARGET[res["kind"]])
        data[f"ratio_compile_time/{res['kind']}/{res['depth']}x{res['width']}/{name}"] = q["median"]
        skip_cell = "" if skip is None else common.ratio_cell(skip)
      elif skip is not None:  # the plain step with the skip, against the plain step
        cell, verdict, skip_cell = common.ratio_cell(skip), "", "(reference)"
      else:
        cell, verdict, skip_cell = "(baseline)", "", ""
      lines.append(f"| {label} | {name} | {lo:.2f} | {co:.2f} | {lo + co:.2f} | {cell} | {skip_cell} | {verdict} |")
  fmt = lambda la: "/".join(f"{x:.2f}" for x in la)
  lines += [
    "",
    f"Reps per model: {', '.join(str(r['reps']) for r in results)}; {seconds:.0f} s in all; load average "
    f"(1/5/15 min) {fmt(load_before)} before, {fmt(load_after)} after.",
  ]
  return {"title": "Beyond the data axis: compile time", "markdown": "\n".join(lines), "data": data}


if __name__ == "__main__":
  # python -m jaxaccum.bench.compile_time [--quick]: the table; `--model listed,32,512,1`: one model's
  # measurement as JSON (the before/after comparisons of two checkouts run it one process at a time).
  import json
  import sys

  from jaxaccum.bench import _setup_devices

  _setup_devices(8)
  if "--model" in sys.argv:
    kind, depth, width, reps = sys.argv[sys.argv.index("--model") + 1].split(",")
    print(json.dumps(measure(kind, int(depth), int(width), int(reps))))
  else:
    print(table(quick="--quick" in sys.argv)["markdown"])
