"""python -m jaxaccum.bench --quick: a well-formed report with finite, positive ratios (no timing assertions)."""

import json
import math
import subprocess
import sys

import pytest

SECTIONS = ("accumulate", "microbatch", "flax", "lowcomm", "sharded", "fsdp", "noise", "grad", "per_example")


def _numbers(tree, path=""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _numbers(v, f"{path}.{k}")
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      yield from _numbers(v, f"{path}[{i}]")
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    yield path, tree


@pytest.mark.slow  # every section compiled in a subprocess (minutes): .ci/run's second step
def test_bench_quick_report(tmp_path):
  out = tmp_path / "bench.json"
  proc = subprocess.run(
    [sys.executable, "-m", "jaxaccum.bench", "--quick", "--json", str(out)],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=tmp_path,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["header"]["quick"] is True
  sections = {s["section"] for s in report["sections"]}
  assert sections == set(SECTIONS)
  for s in report["sections"]:
    assert s["title"] and s["markdown"].count("|") > 4, s
    assert f"## {s['title']}" in proc.stdout
  ratios = [(p, v) for p, v in _numbers(report) if "ratio" in p]
  assert ratios
  for path, value in ratios:
    assert math.isfinite(value) and value > 0, (path, value)


def test_bench_is_a_subpackage_with_one_module_per_section():
  import importlib
  import pathlib

  import jaxaccum
  import jaxaccum.bench as bench

  root = pathlib.Path(jaxaccum.__file__).parent
  assert not list(root.glob("_bench_*.py")) and not (root / "bench.py").exists()
  assert bench.SECTIONS == SECTIONS
  for name in bench.SECTIONS:
    assert callable(importlib.import_module(f"jaxaccum.bench.{name}").run), name
  proc = subprocess.run([sys.executable, "-m", "jaxaccum.bench", "--help"], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "--quick" in proc.stdout and "--sections" in proc.stdout, proc.stderr
  proc = subprocess.run(
    [sys.executable, "-m", "jaxaccum.bench", "--sections", "nope"], capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 2 and "unknown sections ['nope']" in proc.stderr, proc.stderr
