"""`python -m jaxaccum.bench.device`: the device check, one command for a lent accelerator (issue 49, item 11).

Step-time and memory-peak figures on one device, each row measured side by side
with its references (`common.timed`: interleaved rounds, each ratio taken within
its round, median and min-max; ratios, not absolute timings, decide the verdicts):

- `ja.accumulate` against `optax.MultiSteps` and the plain-API floor (a window of
  K micro-steps through the plain optax API; the runners of `bench.accumulate`);
- `ja.microbatch` (in the user's jit) and `ja.make_train_step` on one device
  (K=1 and K) against the plain full-batch step, `optax.microbatching.microbatch`
  and a hand-written `lax.scan`;
- the noise-scale overhead: `ja.accumulate(..., noise_scale_ema=...)` against
  the same accumulate without it, against its <= 2% target (`bench.noise.BOUND`).

Memory: where the backend keeps allocator statistics (GPU, TPU), each row runs
alone in a fresh process (`--peak`) and its `memory_stats()["peak_bytes_in_use"]`
is read after a few steps; elsewhere (CPU) the compiled memory analysis of the
row's step (arguments + outputs - aliases + temp), where the row has one jitted
step.

    python -m jaxaccum.bench.device [--quick] [--json F] [--markdown F] [--budget S]

Sizes follow the backend: an accelerator gets a model of 134M parameters sized
to finish well inside `--budget` (480 s by default) on one GPU; a CPU the
bench sections' own sizes; `--quick` tiny sizes and seven rounds (seconds, the
default test run). The elapsed time of every part is printed as it ends, and
once past the budget the remaining parts and peaks are skipped (said in the
output). The JSON is a bench report (section "device"): `python -m
jaxaccum.bench.figures --json F` lands it in the docs' regions. It is also the
bench section "device" (`python -m jaxaccum.bench --sections device`).
Needs jax, jaxlib, optax and numpy only; no network.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxaccum.accumulate import accumulate
from jaxaccum.bench import accumulate as bench_accumulate
from jaxaccum.bench import noise as bench_noise
from jaxaccum.bench.common import (
  MIN_ROUNDS,
  mlp_batch,
  mlp_loss,
  mlp_params,
  ratio_between,
  ratio_cell,
  timed,
  timing_note,
  verdict,
)
from jaxaccum.microbatch import microbatch
from jaxaccum.planner import compiled_memory_bytes
from jaxaccum.train_step import make_train_step

DEFAULT_BUDGET_S = 480.0  # the bound: under 8 minutes on one GPU, everything included
QUICK_BUDGET_S = 120.0

# The targets read here, from the sections that set them.
ACCUMULATE_TARGETS = (("ja.accumulate", "optax.MultiSteps", 0.70), ("ja.accumulate", "plain-API floor", 1.05))
MICROBATCH_TARGETS = ((1.05, "full batch"), (1.00, "optax.microbatching"))
NOISE_BOUND = bench_noise.BOUND  # <= 2% more time per window with the noise scale measured


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The work of one run: the MLP, each part's cases, the rounds."""

  name: str
  width: int
  depth: int
  acc_k: int  # micro-steps per window (accumulate)
  acc_micro_batches: tuple[int, ...]  # rows per micro-step, one timed case each; peaks at the first
  mb_rows: int  # rows of the batch of one step (microbatch, make_train_step)
  mb_k: int
  noise_k: int
  noise_micro_batches: tuple[int, ...]
  rounds: int
  max_rounds: int

  def describe(self) -> str:
    params = self.depth * (self.width * self.width + self.width)
    return f"MLP {self.depth} x {self.width} ({params:,} parameters), adam, float32"


SIZES = {
  "quick": Sizes("quick", 64, 2, 4, (8,), 64, 4, 4, (8,), MIN_ROUNDS, MIN_ROUNDS),
  # The bench sections' own CPU sizes (bench/accumulate.py, bench/microbatch.py, bench/noise.py).
  "cpu": Sizes("cpu", 512, 4, 16, (8, 128), 1024, 16, 8, (8, 128), 15, 30),
  # One GPU: 134M parameters (0.5 GiB float32, adam's state 1 GiB); microbatches of 512 rows; about
  # 3-4 minutes of compiles, processes and rounds on an H100/H200-class device.
  "accelerator": Sizes("accelerator", 4096, 8, 16, (8, 256), 8192, 16, 8, (8, 256), 15, 30),
}


def sizes_for(quick: bool, backend: str | None = None) -> Sizes:
  """`quick`: tiny; otherwise by backend: the CPU sections' sizes on "cpu", one GPU's on any other."""
  if quick:
    return SIZES["quick"]
  backend = jax.default_backend() if backend is None else backend
  return SIZES["cpu" if backend == "cpu" else "accelerator"]


@dataclasses.dataclass
class Row:
  """A built row: `run()` does one unit of work and waits; `compiled_bytes()` its step's compiled total.

  `compiled_bytes` is None for a row of more than one jitted function; it compiles once more when called
  (only where the backend keeps no allocator statistics).
  """

  run: Callable[[], None]
  compiled_bytes: Callable[[], int] | None = None


# --------------------------------------------------------------------------- the parts' rows (factories)


def _micro_batches(key_offset: int, k: int, rows: int, width: int):
  return [
    (
      jax.random.normal(jax.random.PRNGKey(key_offset + i), (rows, width)),
      jax.random.normal(jax.random.PRNGKey(key_offset + 1000 + i), (rows, width)),
    )
    for i in range(k)
  ]


def _update_step_bytes(tx, params, batch) -> int:
  """The compiled total of `bench.accumulate._transform_runner`'s micro-step (the same function, donated)."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, batch):
    grads = jax.grad(mlp_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  spec = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  return compiled_memory_bytes(step.lower(spec(params), spec(tx.init(params)), spec(batch)).compile())


def _window_row(tx, params, batches) -> Row:
  run = bench_accumulate._transform_runner(tx, params, batches)[0]  # noqa: SLF001
  return Row(run, lambda: _update_step_bytes(tx, params, batches[0]))


def accumulate_rows(s: Sizes, micro_batch: int) -> dict[str, Callable[[], Row]]:
  """A window of K micro-steps: optax.MultiSteps (the baseline), ja.accumulate, the plain-API floor."""
  params = mlp_params(jax.random.PRNGKey(0), s.width, s.depth)
  inner = optax.adam(1e-3)
  batches = _micro_batches(0, s.acc_k, micro_batch, s.width)
  return {
    "optax.MultiSteps": lambda: _window_row(optax.MultiSteps(inner, s.acc_k), params, batches),
    "ja.accumulate": lambda: _window_row(accumulate(inner, s.acc_k), params, batches),
    # Two jitted functions (a micro-step and the window's update): no one compiled total.
    "plain-API floor": lambda: Row(bench_accumulate._floor_runner(inner, params, batches, "plain-API")),  # noqa: SLF001
  }


def noise_rows(s: Sizes, micro_batch: int) -> dict[str, Callable[[], Row]]:
  """A window of K micro-steps: ja.accumulate (the baseline), + noise_scale_ema, + noise_scale_sample=1."""
  params = mlp_params(jax.random.PRNGKey(0), s.width, s.depth)
  inner = optax.adam(1e-3)
  batches = _micro_batches(0, s.noise_k, micro_batch, s.width)
  k = s.noise_k
  return {
    "ja.accumulate": lambda: _window_row(accumulate(inner, k), params, batches),
    "+ noise_scale_ema=0.99": lambda: _window_row(accumulate(inner, k, noise_scale_ema=0.99), params, batches),
    "+ noise_scale_sample=1": lambda: _window_row(
      accumulate(inner, k, noise_scale_ema=0.99, noise_scale_sample=1), params, batches
    ),
  }


def has_optax_microbatching() -> bool:
  return hasattr(optax, "microbatching") and hasattr(optax.microbatching, "microbatch")


def microbatch_rows(s: Sizes, case: int = 0) -> dict[str, Callable[[], Row]]:
  """One jitted, donated step on one device: the full batch (the baseline) against K microbatches five ways."""
  del case  # one case
  rows, k = s.mb_rows, s.mb_k
  params = mlp_params(jax.random.PRNGKey(0), s.width, s.depth)
  opt = optax.adam(1e-3)
  batch = mlp_batch(jax.random.PRNGKey(1), rows, s.width)

  def plain(grad_fn):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, batch):
      grads = grad_fn(params, batch)
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return step

  def full_grads(params, batch):
    return jax.grad(mlp_loss)(params, batch)

  def ja_grads(params, batch):
    return microbatch(jax.value_and_grad(mlp_loss), k)(params, batch)[1]

  def optax_grads(params, batch):
    grad_fn = optax.microbatching.microbatch(
      jax.value_and_grad(mlp_loss),
      argnums=1,
      microbatch_size=rows // k,
      accumulator=optax.microbatching.AccumulationType.MEAN,
    )
    return grad_fn(params, batch)[1]

  def scan_grads(params, batch):
    # The hand-written floor (as bench/microbatch.py's): contiguous microbatches, the sum of grads in a scan.
    mbs = jax.tree.map(lambda x: x.reshape(k, rows // k, *x.shape[1:]), batch)

    def body(acc, mb):
      return jax.tree.map(jnp.add, acc, jax.grad(mlp_loss)(params, mb)), None

    grads, _ = lax.scan(body, jax.tree.map(jnp.zeros_like, params), mbs)
    return jax.tree.map(lambda g: g / k, grads)

  def row(step) -> Row:
    carry = [jax.tree.map(jnp.copy, params), opt.init(params)]
    spec = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    compiled = lambda: compiled_memory_bytes(step.lower(spec(carry[0]), spec(carry[1]), spec(batch)).compile())

    def run():
      carry[0], carry[1], *_ = step(carry[0], carry[1], batch)
      jax.block_until_ready(carry)

    return Row(run, compiled)

  out = {
    "full batch (plain jit)": lambda: row(plain(full_grads)),
    "ja.make_train_step K=1": lambda: row(make_train_step(mlp_loss, opt)),
    f"ja.make_train_step K={k}": lambda: row(make_train_step(mlp_loss, opt, num_microbatches=k)),
    f"ja.microbatch K={k} (own jit)": lambda: row(plain(ja_grads)),
  }
  if has_optax_microbatching():
    out[f"optax.microbatching K={k}"] = lambda: row(plain(optax_grads))
  out[f"hand-written lax.scan K={k}"] = lambda: row(plain(scan_grads))
  return out


# (part, its factory of rows for one case, the cases (labels), the baseline row)
def _parts(s: Sizes) -> dict[str, tuple[Callable[[Sizes, int], dict], list[tuple[str, int]], str]]:
  return {
    "accumulate": (
      accumulate_rows,
      [(f"K={s.acc_k}, B={b}", b) for b in s.acc_micro_batches],
      "optax.MultiSteps",
    ),
    "microbatch": (microbatch_rows, [(f"B={s.mb_rows}, K={s.mb_k}", 0)], "full batch (plain jit)"),
    "noise": (noise_rows, [(f"K={s.noise_k}, B={b}", b) for b in s.noise_micro_batches], "ja.accumulate"),
  }


# --------------------------------------------------------------------------- memory


def memory_stats_available() -> bool:
  """Whether the default device's allocator reports `peak_bytes_in_use` (GPU, TPU; not CPU)."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001  (a backend without the call)
    return False
  return bool(stats) and "peak_bytes_in_use" in stats


def measure_peak(part: str, case: int, row: str, mode: str, steps: int = 3) -> dict:
  """In this process (a fresh one: `--peak`): build one row, run it `steps` times, read the allocator's peak."""
  s = SIZES[mode]
  factory, cases, _ = _parts(s)[part]
  built = factory(s, cases[case][1])[row]()
  for _ in range(steps):
    built.run()
  stats = jax.devices()[0].memory_stats() or {}
  return {
    "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
    "bytes_in_use": stats.get("bytes_in_use"),
  }


def _peak_in_subprocess(part: str, case: int, row: str, mode: str, timeout: float) -> dict:
  """`measure_peak` in a fresh process (an allocator's peak cannot be reset), this checkout first on the path."""
  root = str(pathlib.Path(__file__).resolve().parents[2])
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
  cmd = [sys.executable, "-m", "jaxaccum.bench.device", "--peak", part, str(case), row, "--mode", mode]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1.0), env=env, check=False)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}
  if proc.returncode != 0:
    return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]}
  try:
    return json.loads(proc.stdout.strip().splitlines()[-1])
  except (IndexError, ValueError):
    return {"error": f"no JSON line on stdout: {proc.stdout[-200:]!r}"}


# --------------------------------------------------------------------------- a run


class Budget:
  """The run's wall-clock budget: elapsed per part, printed as each ends; `over` once spent."""

  def __init__(self, seconds: float, log: Callable[[str], None]):
    self.seconds, self.start, self.log = seconds, time.perf_counter(), log
    self.parts: dict[str, float] = {}

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def left(self) -> float:
    return self.seconds - self.elapsed()

  def over(self) -> bool:
    return self.left() <= 0

  def done(self, part: str, started: float) -> None:
    self.parts[part] = round(time.perf_counter() - started, 1)
    self.log(
      f"[device] {part}: {self.parts[part]:.1f} s (total {self.elapsed():.1f} s of the {self.seconds:.0f} s budget)"
    )


def device_header(quick: bool) -> dict:
  """`bench.run_header` plus what a device check names: the device kind, jaxlib, optax, the memory source."""
  import jaxlib  # noqa: PLC0415

  from jaxaccum.bench import run_header  # noqa: PLC0415  (the package imports this module lazily)

  header = run_header(quick)
  header.update(
    device_kind=str(jax.devices()[0].device_kind),
    device_count=jax.device_count(),
    jaxlib=str(getattr(jaxlib, "__version__", "unknown")),
    optax=str(getattr(optax, "__version__", "unknown")),
    memory_source="memory_stats" if memory_stats_available() else "compiled",
  )
  return header


def header_line(h: dict) -> str:
  return (
    f"Measured {h['date']} {h['time']} on {h['device_kind']} ({h['backend']}, one of {h['device_count']} "
    f"device(s)), jax {h['jax']}, jaxlib {h['jaxlib']}, optax {h['optax']}, commit {h['commit']}"
    f"{', quick sizes' if h['quick'] else ''}."
  )


def _mib(b) -> str:
  return "n/a" if b is None else f"{b / 2**20:,.1f}"


def _peak_ratio(peaks: dict, name: str, base: str) -> str:
  a, b = peaks.get(name), peaks.get(base)
  return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def _time_part(part: str, s: Sizes, budget: Budget, use_stats: bool, peak_timeout: float) -> list[dict]:
  """Each case of a part timed side by side; the first case's rows' memory peaks. One entry per case."""
  factory, cases, baseline = _parts(s)[part]
  out = []
  for index, (label, arg) in enumerate(cases):
    started = time.perf_counter()
    entry: dict = {"case": label}
    if budget.over():
      entry["skipped"] = f"over the {budget.seconds:.0f} s budget"
      budget.log(f"[device] {part} {label}: skipped (over the budget)")
      out.append(entry)
      continue
    factories = factory(s, arg)
    built = {name: f() for name, f in factories.items()}
    t = timed({n: r.run for n, r in built.items()}, baseline, s.rounds, max_rounds=s.max_rounds)
    peaks: dict[str, int | None] = {}
    peak_errors: dict[str, str] = {}
    if index == 0:
      if use_stats:
        del built  # free this process's copies before the fresh processes allocate theirs
        for name in factories:
          if budget.over():
            peak_errors[name] = "skipped (over the budget)"
            continue
          got = _peak_in_subprocess(part, index, name, s.name, min(peak_timeout, max(budget.left(), 30.0)))
          peaks[name] = got.get("peak_bytes_in_use")
          if peaks[name] is None:
            peak_errors[name] = got.get("error", "the backend reports no peak_bytes_in_use")
      else:
        peaks = {n: r.compiled_bytes() if r.compiled_bytes else None for n, r in built.items()}
    entry.update(timing=t, peaks=peaks, peak_errors=peak_errors, baseline=baseline)
    out.append(entry)
    budget.done(f"{part} {label}", started)
  return out


def _peak_note(use_stats: bool) -> str:
  if use_stats:
    return (
      "Peak: `memory_stats()['peak_bytes_in_use']` of a fresh process running the row alone for a few steps "
      "(parameters, their donated working copy, optimizer state, batches and the step's temporaries)."
    )
  return (
    "Peak: this backend keeps no allocator statistics; the compiled memory analysis of the row's jitted step "
    "(arguments + outputs - aliases + temp; n/a for a row of two jitted functions)."
  )


def _accumulate_result(entries: list[dict], s: Sizes, h: dict, use_stats: bool) -> dict:
  rows, notes, data = [], [], {}
  for e in entries:
    if "skipped" in e:
      notes.append(f"{e['case']}: {e['skipped']}, not measured.")
      continue
    t, peaks = e["timing"], e["peaks"]
    vs = {
      "optax.MultiSteps": t["ratio"],
      "plain-API floor": {n: ratio_between(t, n, "plain-API floor") for n in t["seconds"]},
    }
    verdicts = {
      f"{m} vs {b} <= {bound:.2f}x": verdict(vs[b][m], bound)
      for m, b, bound in ACCUMULATE_TARGETS
      if e["case"].endswith(f"B={bench_accumulate.TARGET_MICRO_BATCH}")
    }
    for name in t["seconds"]:
      target = "; ".join(
        f"<= {bound:.2f}x {b}: {verdict(vs[b][m], bound)}" for m, b, bound in ACCUMULATE_TARGETS if m == name
      )
      target = target if verdicts else ""
      rows.append(
        f"| {e['case']} | {name} | {t['seconds'][name] * 1e3:.2f} | {ratio_cell(vs['optax.MultiSteps'][name])} | "
        f"{ratio_cell(vs['plain-API floor'][name])} | {_mib(peaks.get(name))} | "
        f"{_peak_ratio(peaks, name, 'optax.MultiSteps')} | {target} |"
      )
    notes += _case_notes(e, t)
    data[e["case"]] = {
      "timing": t,
      "seconds_per_window": t["seconds"],
      "ratios": vs,
      "peak_bytes": peaks,
      "verdicts": verdicts,
    }
  return _result(
    "device: accumulate against optax.MultiSteps",
    h,
    f"{s.describe()}; time per window of K={s.acc_k} micro-steps through the plain optax API (`update`, then "
    "`optax.apply_updates` in the same jit, donated: `bench.accumulate`'s runners); the plain-API floor is one "
    "jitted gradient-and-add per micro-step with a params-sized zero update decided at run time, and one update "
    f"per window. Targets (at B={bench_accumulate.TARGET_MICRO_BATCH}): ja.accumulate <= 0.70x optax.MultiSteps "
    'and <= 1.05x the plain-API floor; a verdict is "within noise" when the min-max range of its rounds straddles '
    f"the bound. {_peak_note(use_stats)}",
    [
      "| case | method | ms / window | vs optax.MultiSteps | vs plain-API floor | peak MiB | peak vs MultiSteps | "
      "target |",
      "|---|---|---:|---:|---:|---:|---:|---|",
    ],
    rows,
    notes,
    data,
  )


def _case_notes(e: dict, t: dict) -> list[str]:
  """A case's notes under its table: how its timing went, and each row whose peak was not measured, and why."""
  return [f"{e['case']}: {timing_note(t)}"] + [
    f"{e['case']}, {n}: peak not measured ({why})." for n, why in e["peak_errors"].items()
  ]


def _result(title: str, h: dict, description: str, header: list[str], rows: list, notes: list, data: dict) -> dict:
  """A bench result: the run's header line, what was measured, the table and its notes."""
  md = [header_line(h), "", description, "", *header, *rows, "", *notes]
  return {"title": title, "markdown": "\n".join(md), "data": data}


def _microbatch_result(entries: list[dict], s: Sizes, h: dict, use_stats: bool) -> dict:
  rows, notes, data = [], [], {}
  k = s.mb_k
  optax_name = f"optax.microbatching K={k}"
  for e in entries:
    if "skipped" in e:
      notes.append(f"{e['case']}: {e['skipped']}, not measured.")
      continue
    t, peaks, base = e["timing"], e["peaks"], e["baseline"]
    has_optax = optax_name in t["seconds"]
    vs_optax = {n: ratio_between(t, n, optax_name) for n in t["seconds"]} if has_optax else {}
    verdicts: dict[str, str] = {}
    for name in (f"ja.microbatch K={k} (own jit)", f"ja.make_train_step K={k}"):
      verdicts[f"{name} vs full batch <= 1.05x"] = verdict(t["ratio"][name], MICROBATCH_TARGETS[0][0])
      if has_optax:
        verdicts[f"{name} vs optax.microbatching <= 1.00x"] = verdict(vs_optax[name], MICROBATCH_TARGETS[1][0])
    for name in t["seconds"]:
      target = "; ".join(
        f"<= {bound:.2f}x {what}: {verdicts[key]}"
        for bound, what in MICROBATCH_TARGETS
        if (key := f"{name} vs {what} <= {bound:.2f}x") in verdicts
      )
      rows.append(
        f"| {name} | {t['seconds'][name] * 1e3:.2f} | {ratio_cell(t['ratio'][name])} | "
        f"{ratio_cell(vs_optax[name]) if has_optax else 'n/a'} | {_mib(peaks.get(name))} | "
        f"{_peak_ratio(peaks, name, base)} | {target} |"
      )
    if not has_optax:
      notes.append(f"optax {h['optax']} has no `optax.microbatching.microbatch`: that row is left out.")
    notes += _case_notes(e, t)
    data[e["case"]] = {
      "timing": t,
      "seconds": t["seconds"],
      "ratio_quartiles_vs_full": t["ratio"],
      "ratio_quartiles_vs_optax": vs_optax,
      "peak_bytes": peaks,
      "verdicts": verdicts,
    }
  return _result(
    "device: microbatch and make_train_step",
    h,
    f"{s.describe()}; one jitted, donated step of B={s.mb_rows} rows on one device, K={k} microbatches of "
    f"{s.mb_rows // k} rows: the plain full-batch step (`jax.grad`, `update`, `apply_updates`), "
    "`ja.make_train_step` (K=1 and K; its finite check included), `ja.microbatch(jax.value_and_grad(loss), K)` "
    "in the same plain step, `optax.microbatching.microbatch` (mean) in it, and a hand-written `lax.scan`. "
    "Targets: ja.microbatch and ja.make_train_step at K <= 1.05x the full batch and <= 1.00x optax.microbatching "
    f"(taken within each round). {_peak_note(use_stats)}",
    [
      "| step | ms / step | vs full batch | vs optax.microbatching | peak MiB | peak vs full batch | target |",
      "|---|---:|---:|---:|---:|---:|---|",
    ],
    rows,
    notes,
    data,
  )


def _noise_result(entries: list[dict], s: Sizes, h: dict, use_stats: bool) -> dict:
  rows, notes, data = [], [], {}
  for e in entries:
    if "skipped" in e:
      notes.append(f"{e['case']}: {e['skipped']}, not measured.")
      continue
    t, peaks = e["timing"], e["peaks"]
    verdicts = {n: verdict(t["ratio"][n], NOISE_BOUND, percent=True) for n in t["seconds"] if n != "ja.accumulate"}
    for name in t["seconds"]:
      rows.append(
        f"| {e['case']} | {name} | {t['seconds'][name] * 1e3:.2f} | {ratio_cell(t['ratio'][name], percent=True)} | "
        f"{_mib(peaks.get(name))} | {_peak_ratio(peaks, name, 'ja.accumulate')} | {verdicts.get(name, '')} |"
      )
    notes += _case_notes(e, t)
    data[e["case"]] = {
      "timing": t,
      "seconds_per_window": t["seconds"],
      "overhead": {n: q["median"] for n, q in t["ratio"].items()},
      "peak_bytes": peaks,
      "verdicts": verdicts,
    }
  return _result(
    "device: noise-scale overhead",
    h,
    f"{s.describe()}; time per window of K={s.noise_k} micro-steps through the plain update API, jitted and "
    "donated, against ja.accumulate alone; `noise_scale_ema=0.99` measures the gradient noise scale every "
    "microbatch, `noise_scale_sample=1` on the window's first only. Target: <= 2% more wall time with the noise "
    f'scale measured (a verdict is "within noise" when the min-max range of its rounds straddles it). '
    f"{_peak_note(use_stats)}",
    [
      "| case | variant | ms / window | overhead | peak MiB | peak vs accumulate | <= 2% |",
      "|---|---|---:|---:|---:|---:|---|",
    ],
    rows,
    notes,
    data,
  )


_RESULTS = {"accumulate": _accumulate_result, "microbatch": _microbatch_result, "noise": _noise_result}


def run(
  quick: bool = False,
  budget_s: float | None = None,
  log: Callable[[str], None] = print,
  peak_timeout: float = 180.0,
  memory: str = "auto",
) -> list[dict]:
  """The device check as bench results (`{"title", "markdown", "data"}`), one per part.

  Args:
    quick: tiny sizes and `MIN_ROUNDS` rounds (seconds on CPU), else sizes by backend (`sizes_for`).
    budget_s: the wall-clock budget (default 480 s, 120 s quick); once past it the remaining cases and
      peaks are skipped, and the results say so.
    log: where the per-part elapsed lines go.
    peak_timeout: the most seconds one fresh process measuring a peak may take.
    memory: "auto" (allocator statistics where the backend has them, else compiled totals), "stats" or
      "compiled".

  Returns:
    One result per part: accumulate, microbatch (with make_train_step), noise; each result's "data" has
    per case the timing (`common.timed`), the ratios, the peaks in bytes and the verdicts, and the last
    result's "data" the run's header, sizes, budget and elapsed seconds per part.
  """
  s = sizes_for(quick)
  budget = Budget((QUICK_BUDGET_S if quick else DEFAULT_BUDGET_S) if budget_s is None else budget_s, log)
  h = device_header(quick)
  use_stats = memory == "stats" or (memory == "auto" and h["memory_source"] == "memory_stats")
  h["memory_source"] = "memory_stats" if use_stats else "compiled"
  log(f"[device] {header_line(h)} Sizes {s.name}: {s.describe()}; budget {budget.seconds:.0f} s.")
  results = []
  for part in _parts(s):
    entries = _time_part(part, s, budget, use_stats, peak_timeout)
    results.append(_RESULTS[part](entries, s, h, use_stats))
  over = budget.elapsed() > budget.seconds
  log(f"[device] done in {budget.elapsed():.1f} s ({'OVER' if over else 'within'} the {budget.seconds:.0f} s budget)")
  results[-1]["data"]["run"] = {
    "header": h,
    "sizes": dataclasses.asdict(s),
    "budget_s": budget.seconds,
    "elapsed_s": round(budget.elapsed(), 1),
    "over_budget": over,
    "parts_s": budget.parts,
  }
  return results


def report(results: list[dict], header: dict) -> dict:
  """A bench report (`python -m jaxaccum.bench --json`'s schema): what `bench.figures --json` merges."""
  from jaxaccum.bench import code_hash  # noqa: PLC0415
  from jaxaccum.bench.figures import structured  # noqa: PLC0415

  sections = [
    structured("device", {"section": "device", **r, "header": header, "code": code_hash("device")}) for r in results
  ]
  return {"header": header, "sections": sections}


def markdown(results: list[dict]) -> str:
  """The run as one markdown page: a heading per part, its tables, then the elapsed time per part."""
  run_data = results[-1]["data"]["run"]
  parts = ", ".join(f"{p} {sec:.1f} s" for p, sec in run_data["parts_s"].items())
  lines = ["# jaxaccum device check", ""]
  for r in results:
    lines += [f"## {r['title']}", "", r["markdown"], ""]
  lines += [
    f"Wall time {run_data['elapsed_s']:.1f} s of a {run_data['budget_s']:.0f} s budget"
    f"{' (over it)' if run_data['over_budget'] else ''}: {parts}.",
    "",
  ]
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  """The command line of `python -m jaxaccum.bench.device`."""
  parser = argparse.ArgumentParser(prog="python -m jaxaccum.bench.device", description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes and seven rounds (seconds on CPU, for tests)")
  parser.add_argument("--json", default="device_check.json", help="where to write the JSON report")
  parser.add_argument("--markdown", default="device_check.md", help="where to write the tables as markdown")
  parser.add_argument(
    "--budget", type=float, default=None, help="wall-clock budget in seconds (default 480, quick 120)"
  )
  parser.add_argument("--memory", choices=("auto", "stats", "compiled"), default="auto", help="where peaks come from")
  parser.add_argument("--peak", nargs=3, metavar=("PART", "CASE", "ROW"), help=argparse.SUPPRESS)
  parser.add_argument("--mode", choices=tuple(SIZES), default="quick", help=argparse.SUPPRESS)
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.peak:  # a fresh process measuring one row's peak (see `_peak_in_subprocess`)
    part, case, row = args.peak
    print(json.dumps(measure_peak(part, int(case), row, args.mode)))
    return 0
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before the backend starts: peaks in fresh processes
  results = run(args.quick, args.budget, memory=args.memory)
  header = results[-1]["data"]["run"]["header"]
  pathlib.Path(args.json).write_text(json.dumps(report(results, header), indent=2, default=float) + "\n")
  pathlib.Path(args.markdown).write_text(markdown(results))
  print("\n" + markdown(results))
  print(f"JSON written to {args.json}, markdown to {args.markdown}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
