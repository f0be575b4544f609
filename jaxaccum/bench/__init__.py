"""python -m jaxaccum.bench: every benchmark section as markdown, plus a JSON file.

Numbers, not tests: ratios measured side by side in one run; memory from XLA's
compiled memory analysis; communication as all-reduce instructions in the
compiled HLO. Multi-device sections run on 8 devices, simulated on CPU when
the machine has fewer.

One module per section (`accumulate`, `microbatch`, `flax`, `lowcomm`, `sharded`, `fsdp`,
`noise`, `grad`, `per_example`, `model_axis`, `fit`, `device`), each with
`run(quick) -> list of {"title", "markdown", "data"}`; `common` holds the MLP, its
data and the timing helpers they share. The JSON adds to each result its `id`
(section/title slug) and its `tables` as structured rows; `figures` rewrites the
docs' marked regions from them. `device` is the device check for a lent accelerator
(`python -m jaxaccum.bench.device`: one device, its own sizes, budget and markdown).
Importing this package touches no device.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import json
import os
import pathlib
import platform
import subprocess
import time

SECTIONS = (
  "accumulate",
  "microbatch",
  "flax",
  "lowcomm",
  "sharded",
  "fsdp",
  "noise",
  "grad",
  "per_example",
  "model_axis",
  "fit",
  "device",
)


def _setup_devices(num_devices: int) -> None:
  import jax  # noqa: PLC0415  (configured before any device is touched)

  # Only affects the CPU backend; on a GPU/TPU machine the real devices are used.
  try:
    jax.config.update("jax_num_cpu_devices", num_devices)
  except RuntimeError:  # the backend was already initialised by the caller: use what there is
    pass


# What each section measures, as file patterns under jaxaccum/: their hash is stored with each result, and
# `python -m jaxaccum.bench.figures --check` fails on a result whose measured code has changed since (a stale
# region). The section's own bench module and bench/common.py always count.
MEASURES = {
  "accumulate": ("accumulate.py", "_window.py", "_tree.py", "noise.py", "parallel.py"),
  "microbatch": (
    "microbatch.py",
    "train_step.py",
    "_engine.py",
    "_program.py",
    "_jax_private.py",
    "_split.py",
    "_sums.py",
    "parallel.py",
    "_tree.py",
  ),
  "flax": ("flax.py", "accumulate.py", "_window.py", "_tree.py", "parallel.py"),
  "lowcomm": (
    "lowcomm.py",
    "_lowcomm_util.py",
    "_local_sgd.py",
    "_stale.py",
    "_diloco.py",
    "_sparse.py",
    "_quantize.py",
    "slowlink.py",
    "train_step.py",
    "_engine.py",
    "_program.py",
    "_jax_private.py",
  ),
  "sharded": (
    "sharded.py",
    "train_step.py",
    "_engine.py",
    "_program.py",
    "_jax_private.py",
    "_unreduced.py",
    "parallel.py",
  ),
  "fsdp": (
    "train_step.py",
    "_engine.py",
    "_program.py",
    "_jax_private.py",
    "_layerwise.py",
    "sharded.py",
    "parallel.py",
  ),
  "noise": ("accumulate.py", "_window.py", "noise.py", "_tree.py", "parallel.py"),
  "grad": ("grad.py", "_program.py", "_jax_private.py", "accumulate.py", "_window.py", "_unreduced.py", "_tree.py"),
  "per_example": ("per_example.py", "_per_device.py", "_tree.py"),
  "model_axis": (
    "train_step.py",
    "_engine.py",
    "_program.py",
    "_jax_private.py",
    "_layerwise.py",
    "_sums.py",
    "sharded.py",
    "parallel.py",
    "hlo.py",
    "_hlo.py",
  ),
  "fit": (
    "sharded.py",
    "planner.py",
    "train_step.py",
    "_engine.py",
    "_program.py",
    "_jax_private.py",
    "_layerwise.py",
    "_sums.py",
    "parallel.py",
    "hlo.py",
    "_hlo.py",
  ),
}
# The device check (`python -m jaxaccum.bench.device`): accumulate, microbatch/make_train_step and the noise scale
# on one device, with bench/accumulate.py's and bench/noise.py's runners and targets.
MEASURES["device"] = tuple(sorted({*MEASURES["accumulate"], *MEASURES["microbatch"], "planner.py"}))
_BENCH_FILES = {
  "lowcomm": ("bench/lowcomm.py", "bench/textlm.py"),
  "fit": ("bench/fit.py",),
  "device": ("bench/device.py", "bench/accumulate.py", "bench/noise.py"),
  # model_axis includes the compile-time table (`compile_time.table`).
  "model_axis": ("bench/model_axis.py", "bench/compile_time.py"),
}


def measured_files(section: str) -> list[pathlib.Path]:
  """The files whose code a section's figures depend on (see `MEASURES`), sorted."""
  root = pathlib.Path(__file__).resolve().parents[1]
  patterns = (*MEASURES.get(section, ()), *_BENCH_FILES.get(section, (f"bench/{section}.py",)), "bench/common.py")
  return sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})


def code_hash(section: str) -> str:
  """A hash of the measured code: stored with each result, compared by `figures --check` (a stale region)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  h = hashlib.sha256()
  for path in measured_files(section):
    h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
  return h.hexdigest()[:16]


def _commit() -> str:
  """The checkout's commit (short), "+dirty" when jaxaccum/ has uncommitted changes; "unknown" outside git."""
  root = pathlib.Path(__file__).resolve().parents[2]
  try:
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=30, check=True)
    commit = run("rev-parse", "--short", "HEAD").stdout.strip()
    dirty = run("status", "--porcelain", "--", "jaxaccum").stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return commit + ("+dirty" if dirty else "")


def run_header(quick: bool) -> dict:
  """When, where and with what a run was measured: each result's header, printed under each docs figure."""
  import jax  # noqa: PLC0415

  now = datetime.datetime.now(datetime.UTC)
  return {
    "date": now.date().isoformat(),
    "time": now.strftime("%H:%M UTC"),
    "commit": _commit(),
    "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
    "backend": jax.default_backend(),
    "devices": [str(d.device_kind) for d in jax.devices()][:1] + [f"x{jax.device_count()}"],
    "jax": jax.__version__,
    "python": platform.python_version(),
    "load": _load(),
    "quick": quick,
  }


def _load() -> list[float]:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return []


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxaccum.bench", description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (seconds, for tests)")
  parser.add_argument("--json", default="bench_results.json", help="where to write the JSON report")
  parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
  args = parser.parse_args(argv)
  sections = [s.strip() for s in args.sections.split(",") if s.strip()]
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")

  _setup_devices(8)
  from jaxaccum.bench.figures import structured  # noqa: PLC0415

  header = run_header(args.quick)
  print(
    f"# jaxaccum benchmark ({header['date']} {header['time']}, {header['commit']}, {header['backend']}, "
    f"{header['machine']}, jax {header['jax']}, load {header['load']}{', quick' if args.quick else ''})\n"
  )
  results: list[dict] = []
  for name in sections:
    module = importlib.import_module(f"jaxaccum.bench.{name}")
    # Each section's own header (its start time, the load before and after it) and the hash of the code it measures.
    section_header = run_header(args.quick)
    start = time.perf_counter()
    section_results = module.run(quick=args.quick)
    section_header.update(load_after=_load(), seconds=round(time.perf_counter() - start, 1))
    for result in section_results:
      print(f"## {result['title']}\n\n{result['markdown']}\n", flush=True)
      # With its id and its tables as structured rows: what `python -m jaxaccum.bench.figures` reads.
      result = {"section": name, **result, "header": section_header, "code": code_hash(name)}
      results.append(structured(name, result))
    print(f"<!-- section {name}: {section_header['seconds']} s -->", flush=True)
  report = {"header": header, "sections": results}
  with open(args.json, "w") as f:
    json.dump(report, f, indent=2, default=float)
  print(f"JSON written to {args.json}")
  return 0
