"""python -m jaxaccum.bench.device --quick: the device check's report is well formed (no timing assertions).

The quick mode runs on CPU in a subprocess (seconds); the checks read the structure of what it writes (every
required row, the targets, finite and positive figures), never the values of its timings. The README's
"Device check" section is held to the commands a session with a GPU runs.
"""

import json
import math
import pathlib
import re
import shlex

import pytest
from conftest import numbers_in, run_module

ROOT = pathlib.Path(__file__).resolve().parent.parent
IDS = {
  "accumulate": "device/accumulate-against-optax-multisteps",
  "microbatch": "device/microbatch-and-make-train-step",
  "noise": "device/noise-scale-overhead",
}
K = 4  # the quick sizes' K for microbatch (jaxaccum.bench.device.SIZES["quick"].mb_k)
ROWS = {
  IDS["accumulate"]: {"optax.MultiSteps", "ja.accumulate", "plain-API floor"},
  IDS["microbatch"]: {
    "full batch (plain jit)",
    "ja.make_train_step K=1",
    f"ja.make_train_step K={K}",
    f"ja.microbatch K={K} (own jit)",
    f"optax.microbatching K={K}",
    f"hand-written lax.scan K={K}",
  },
  IDS["noise"]: {"ja.accumulate", "+ noise_scale_ema=0.99", "+ noise_scale_sample=1"},
}
VERDICT = re.compile(r"met|not met|within noise, median (over|under)")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("device")
  proc = run_module("jaxaccum.bench.device", "--quick", "--json", "d.json", "--markdown", "d.md", timeout=600, cwd=out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc, json.loads((out / "d.json").read_text()), (out / "d.md").read_text()


def test_quick_report_has_every_required_row_and_target(quick_run):
  proc, report, md = quick_run
  header = report["header"]
  assert header["quick"] is True and header["date"] and header["time"].endswith("UTC")
  assert header["device_kind"] and header["jax"] and header["jaxlib"] and header["commit"]
  assert header["memory_source"] in ("memory_stats", "compiled")
  sections = {s["id"]: s for s in report["sections"]}
  assert set(sections) == set(ROWS)
  for rid, rows in ROWS.items():
    s = sections[rid]
    assert s["section"] == "device" and len(s["code"]) == 16
    assert s["markdown"].startswith(f"Measured {header['date']}") and header["device_kind"] in s["markdown"]
    (table,) = s["tables"]
    name_col = 0 if rid == IDS["microbatch"] else 1
    assert {r[name_col] for r in table["rows"]} == rows, rid
    assert f"## {s['title']}" in md and s["markdown"] in md
  # The targets: accumulate against MultiSteps and the plain-API floor, microbatch/make_train_step against the
  # full batch and optax.microbatching, the noise scale against 2%; each verdict read from the rounds' range.
  acc = sections[IDS["accumulate"]]["data"]["K=4, B=8"]["verdicts"]
  assert set(acc) == {"ja.accumulate vs optax.MultiSteps <= 0.70x", "ja.accumulate vs plain-API floor <= 1.05x"}
  mb = sections[IDS["microbatch"]]["data"]["B=64, K=4"]["verdicts"]
  assert set(mb) == {
    f"{name} vs {what}"
    for name in (f"ja.microbatch K={K} (own jit)", f"ja.make_train_step K={K}")
    for what in ("full batch <= 1.05x", "optax.microbatching <= 1.00x")
  }
  noise = sections[IDS["noise"]]["data"]["K=4, B=8"]
  assert set(noise["verdicts"]) == {"+ noise_scale_ema=0.99", "+ noise_scale_sample=1"}
  assert "<= 2%" in sections[IDS["noise"]]["tables"][0]["columns"]
  for verdicts in (acc, mb, noise["verdicts"]):
    assert all(VERDICT.fullmatch(v) for v in verdicts.values()), verdicts
  # Each part's elapsed time, printed as it ends, and the budget.
  run = sections[IDS["noise"]]["data"]["run"]
  assert run["over_budget"] is False and set(run["parts_s"]) == {
    "accumulate K=4, B=8",
    "microbatch B=64, K=4",
    "noise K=4, B=8",
  }
  for part in run["parts_s"]:
    assert re.search(rf"\[device\] {re.escape(part)}: [\d.]+ s \(total [\d.]+ s of the 120 s budget\)", proc.stdout)
  assert "Wall time" in md and "JSON written to d.json, markdown to d.md" in proc.stdout


def test_quick_report_figures_are_finite_and_positive(quick_run):
  _, report, _ = quick_run
  for s in report["sections"]:
    for case in (v for k, v in s["data"].items() if k != "run"):
      for path, value in numbers_in({"seconds": case["timing"]["seconds"], "ratio": case["timing"]["ratio"]}):
        assert math.isfinite(value) and value > 0, (s["id"], path, value)
      peaks = case["peak_bytes"]
      # Every row with one jitted step has a peak (the plain-API floor is two: allocator statistics only).
      measured = {n for n, b in peaks.items() if b is not None}
      assert measured >= set(case["timing"]["seconds"]) - {"plain-API floor"}, (s["id"], peaks)
      assert all(isinstance(peaks[n], int) and peaks[n] > 0 for n in measured), peaks


def test_a_spent_budget_skips_the_rest_and_says_so():
  from jaxaccum.bench import device

  lines = []
  results = device.run(quick=True, budget_s=0, log=lines.append)
  assert [r["title"] for r in results] == [
    "device: accumulate against optax.MultiSteps",
    "device: microbatch and make_train_step",
    "device: noise-scale overhead",
  ]
  assert all("over the 0 s budget, not measured" in r["markdown"] for r in results)
  assert results[-1]["data"]["run"]["over_budget"] is True
  assert any("skipped (over the budget)" in line for line in lines) and "OVER" in lines[-1]


def test_sizes_follow_the_backend_and_the_peak_process_runs():
  from jaxaccum.bench import device

  assert device.sizes_for(True).name == "quick"
  assert device.sizes_for(False, "cpu").name == "cpu"
  gpu = device.sizes_for(False, "gpu")
  assert gpu.name == "accelerator" and device.sizes_for(False, "tpu") == gpu
  assert gpu.mb_rows % gpu.mb_k == 0 and gpu.acc_micro_batches[0] == 8  # the accumulate targets' B
  # One row's peak in a fresh process (what a GPU run does per row): on CPU the allocator reports none.
  got = device._peak_in_subprocess("noise", 0, "ja.accumulate", "quick", timeout=300)
  assert set(got) == {"peak_bytes_in_use", "bytes_in_use"}, got


def test_device_is_a_registered_section():
  import jaxaccum.bench as bench

  assert "device" in bench.SECTIONS
  files = {p.relative_to(ROOT).as_posix() for p in bench.measured_files("device")}
  assert {"jaxaccum/bench/device.py", "jaxaccum/bench/accumulate.py", "jaxaccum/bench/noise.py"} <= files
  assert {"jaxaccum/accumulate.py", "jaxaccum/microbatch.py", "jaxaccum/train_step.py"} <= files


def test_readme_names_the_commands_a_session_with_a_gpu_runs():
  from jaxaccum.bench import device

  readme = (ROOT / "README.md").read_text()
  section = readme.split("## Device check", 1)[1].split("\n## ", 1)[0]
  (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
  commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
  assert commands[0] == "pip install --no-deps ."
  argv = shlex.split(commands[1])
  assert argv[:3] == ["python", "-m", "jaxaccum.bench.device"]
  args = device.build_parser().parse_args(argv[3:])
  assert not args.quick and args.json == "device_check.json" and args.markdown == "device_check.md"
  # Where the output goes, and how it lands: the report's ids and the figures command.
  assert "device_check.json" in section and "device_check.md" in section and '"$OUT/device_check.json"' in section
  assert "python -m jaxaccum.bench.figures --json device_check.json" in section
  assert all(f"`{rid}`" in section for rid in IDS.values())
  assert "--budget" in section and "--quick" in section
