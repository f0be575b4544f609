"""python -m jaxaccum.bench: every benchmark section as markdown, plus a JSON file.

Numbers, not tests: ratios measured side by side in one run; memory from XLA's
compiled memory analysis; communication as all-reduce instructions in the
compiled HLO. Multi-device sections run on 8 devices, simulated on CPU when
the machine has fewer.

One module per section (`accumulate`, `microbatch`, `flax`, `lowcomm`, `sharded`, `fsdp`,
`noise`, `grad`, `per_example`), each with
`run(quick) -> list of {"title", "markdown", "data"}`; `common` holds the MLP, its
data and the timing helpers they share. The JSON adds to each result its `id`
(section/title slug) and its `tables` as structured rows; `figures` rewrites the
docs' marked regions from them. Importing this package touches no device.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform

SECTIONS = ("accumulate", "microbatch", "flax", "lowcomm", "sharded", "fsdp", "noise", "grad", "per_example")


def _setup_devices(num_devices: int) -> None:
  import jax  # noqa: PLC0415  (configured before any device is touched)

  # Only affects the CPU backend; on a GPU/TPU machine the real devices are used.
  try:
    jax.config.update("jax_num_cpu_devices", num_devices)
  except RuntimeError:  # the backend was already initialised by the caller: use what there is
    pass


def run_header(quick: bool) -> dict:
  """When, where and with what a run was measured: the JSON's header, printed under each docs table."""
  import jax  # noqa: PLC0415

  return {
    "date": datetime.date.today().isoformat(),
    "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
    "backend": jax.default_backend(),
    "devices": [str(d.device_kind) for d in jax.devices()][:1] + [f"x{jax.device_count()}"],
    "jax": jax.__version__,
    "python": platform.python_version(),
    "quick": quick,
  }


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
    f"# jaxaccum benchmark ({header['date']}, {header['backend']}, {header['machine']}, "
    f"jax {header['jax']}{', quick' if args.quick else ''})\n"
  )
  results: list[dict] = []
  for name in sections:
    module = importlib.import_module(f"jaxaccum.bench.{name}")
    for result in module.run(quick=args.quick):
      print(f"## {result['title']}\n\n{result['markdown']}\n", flush=True)
      # With its id and its tables as structured rows: what `python -m jaxaccum.bench.figures` reads.
      results.append(structured(name, {"section": name, **result}))
  report = {"header": header, "sections": results}
  with open(args.json, "w") as f:
    json.dump(report, f, indent=2, default=float)
  print(f"JSON written to {args.json}")
  return 0
