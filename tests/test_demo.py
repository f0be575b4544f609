"""python -m jaxaccum.demo with small flags: it runs, writes the PNG, and the four ways agree."""

import re

from conftest import run_module


def test_demo_small(tmp_path):
  png = tmp_path / "loss.png"
  flags = ["--steps", "4", "--batch-size", "64", "--k", "2", "--devices", "4", "--x64", "--no-progress"]
  proc = run_module("jaxaccum.demo", *flags, "--out", str(png), timeout=600, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert str(png) in proc.stdout
  rows = {}
  for line in proc.stdout.splitlines():
    m = re.match(r"\| (full batch|accumulate|microbatch|data parallel) \| ([\d.]+) \| ([\d.]+) \| ([\d.e+-]+) \|", line)
    if m:
      rows[m.group(1)] = (float(m.group(2)), float(m.group(3)), float(m.group(4)))
  assert set(rows) == {"full batch", "accumulate", "microbatch", "data parallel"}, proc.stdout
  final_loss = rows["full batch"][0]
  for name, (loss, accuracy, max_diff) in rows.items():
    assert 0.0 <= accuracy <= 1.0
    assert max_diff < 1e-10, (name, max_diff)  # float64: the four ways are one trajectory
    assert abs(loss - final_loss) <= 1e-4 * max(1.0, final_loss), (name, loss, final_loss)


def test_demo_help_and_bad_flags():
  proc = run_module("jaxaccum.demo", "--help")
  assert proc.returncode == 0 and "--steps" in proc.stdout and "--k" in proc.stdout
  proc = run_module("jaxaccum.demo", "--batch-size", "10", "--k", "3")
  assert proc.returncode == 2 and "--batch-size=10 must be divisible by --k=3" in proc.stderr
