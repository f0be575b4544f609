"""Every example in examples/, every mode, briefly in float64: each must equal its own full-batch run.

Each example runs as a subprocess (as a user runs it) with `--mode all`, so one
process imports jax once and compiles the full-batch reference once for its
three modes. The examples the session selected are all started by the first
test and run side by side (the compiles dominate; two cores halve the wall time).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each example is a subprocess that compiles its own steps

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--mode", "all", "--x64", "--steps", "2", "--batch-size", "32", "--k", "2"]  # 8 devices x K=2 x 2 rows
EXAMPLES = {
  "linen_cnn": TINY,
  "nnx_cnn": TINY,
  "equinox_cnn": TINY,
  "padded_lm": TINY + ["--seq-len", "16", "--width", "16"],
}
MODES = ("accumulate", "microbatch", "data-parallel")
TIMEOUT_S = 420
_RUNS: dict[str, subprocess.Popen] = {}


def _start(name: str) -> None:
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # XLA_FLAGS from conftest (collective timeout, -O0) pass on
  _RUNS[name] = subprocess.Popen(
    [sys.executable, str(ROOT / "examples" / f"{name}.py"), *EXAMPLES[name]],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _run_once(name: str, args: list[str]) -> str:
  """examples/<name>.py with `args`, run to the end; its output (stdout and stderr), checked for exit status 0."""
  proc = subprocess.run(
    [sys.executable, str(ROOT / "examples" / f"{name}.py"), *args],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    timeout=TIMEOUT_S,
  )
  assert proc.returncode == 0, proc.stdout
  return proc.stdout


def _output(name: str, request) -> str:
  if not _RUNS:
    selected = [
      item.callspec.params["example"]
      for item in request.session.items
      if getattr(item, "callspec", None) and "example" in item.callspec.params and item.module is request.module
    ]
    for other in dict.fromkeys(selected):
      _start(other)
  if name not in _RUNS:
    _start(name)
  proc = _RUNS[name]
  try:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    pytest.fail(f"examples/{name}.py ran over {TIMEOUT_S} s; its output:\n{out}")
  assert proc.returncode == 0, f"examples/{name}.py exited with {proc.returncode}:\n{out}"
  return out


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_equals_its_full_batch_run_in_every_mode(example, request):
  out = _output(example, request)
  diffs = {m: float(d) for m, d in re.findall(r"^(\S+)\s+max relative difference from [^:]*: (\S+)", out, re.M)}
  assert set(diffs) == set(MODES), f"expected one line per mode {MODES}, got:\n{out}"
  for mode, diff in diffs.items():
    assert diff < 1e-10, f"{example} {mode}: relative difference {diff} from the full batch:\n{out}"


def test_padded_lm_shows_multisteps_mean_of_means_off_and_token_weights_exact(request):
  out = _output("padded_lm", request)
  lines = re.findall(
    r"\((loaded order|sorted by length)\): optax.MultiSteps \(mean of means\) (\S+)% off, "
    r"ja.accumulate \(token-weighted\) (\S+)",
    out,
  )
  assert [label for label, _, _ in lines] == ["loaded order", "sorted by length"], out
  for label, multisteps_percent, weighted in lines:
    assert float(multisteps_percent) > 0.01, f"{label}: MultiSteps should be measurably off:\n{out}"
    assert float(weighted) < 1e-10, f"{label}: token-weighted accumulation should be exact:\n{out}"


def test_dp_sgd_equals_a_plain_dp_sgd_run():
  """examples/dp_sgd.py --check: Poisson batches padded over 8 devices x K microbatches x A calls, noise once per
  logical batch, equal DP-SGD written plainly (realised batch at once, same noise key) in float64, one compile."""
  import importlib.util  # noqa: PLC0415

  args = ["--x64", "--check", "--steps", "3", "--expected-batch-size", "24", "--rows", "2"]
  out = _run_once("dp_sgd", args)
  diff = re.search(r"max relative difference from the plain DP-SGD run: (\S+)", out)
  assert diff and float(diff.group(1)) < 1e-12, out
  assert re.search(r"Poisson batch sizes \d+\.\.\d+ \([2-9] distinct\) ran in 1 compiled step", out), out
  eps = re.search(r"epsilon (\S+) at delta", out)
  assert eps, out
  if importlib.util.find_spec("dp_accounting") is not None:
    assert 0 < float(eps.group(1)) < 1, out  # 3 updates at q = 24/1437, sigma 1.5


def test_flax_resnet_sharded_equals_the_original_pmap_step():
  """examples/flax_resnet_sharded.py: Flax's ImageNet train_step (BatchNorm, pmean over "batch") ported to zero1 and
  fsdp equals the original step run plainly under vmap over the same 8 x K groups of rows, float64; the whole batch
  as one BatchNorm group is printed as what is not exact (ghost batch norm), and must be measurably off."""
  args = ["--x64", "--steps", "3", "--batch-size", "32", "--k", "2"]  # 8 devices x K=2 x 2 rows
  out = _run_once("flax_resnet_sharded", args)
  diffs = dict(re.findall(r"^(zero1|fsdp)\s+max relative difference from the original step[^:]*: (\S+)", out, re.M))
  assert set(diffs) == {"zero1", "fsdp"}, out
  for strategy, diff in diffs.items():
    assert float(diff) < 1e-12, f"{strategy}: {diff} from the original step:\n{out}"
  held = dict(re.findall(r"^(zero1|fsdp) .*device 0 holds (\S+) of the parameters", out, re.M))
  assert held == {"zero1": "1.00", "fsdp": "0.13"}, out  # fsdp really shards the parameters
  ghost = re.search(r"one BatchNorm group differs by (\S+) in the parameters", out)
  assert ghost and float(ghost.group(1)) > 1e-3, out


def test_diloco_port_equals_a_plain_loop_over_replicas():
  """examples/diloco_port.py --check: torchft's DiLoCo example as plain ja.diloco under shard_map over 4 replicas
  equals the original's algorithm written as a loop over replicas (torch's AdamW and Nesterov written out), float64;
  the streaming runs (fragments by module, delay, alpha, int4 with error feedback) train."""
  args = ["--check", "--steps", "16", "--sync-every", "8", "--lr", "3e-3", "--fragments-by-module"]
  out = _run_once("diloco_port", args)
  diff = re.search(r"max \|param diff\| (\S+), max \|loss diff\| (\S+)", out)
  assert diff and float(diff.group(1)) < 1e-12 and float(diff.group(2)) < 1e-12, out
  initial = float(re.search(r"initial full-data loss (\S+)", out).group(1))
  runs = re.findall(r"^\((a|b|c)\) .*full-data loss: replicas (\S+), anchor (\S+)$", out, re.M)
  assert [r for r, _, _ in runs] == ["a", "b", "c"], out
  for run, replicas, anchor in runs:
    assert float(replicas) < initial and float(anchor) < initial, f"({run}) did not train:\n{out}"


def test_port_fsdp_grad_equals_the_plain_full_batch_step():
  """examples/port_fsdp_grad.py: Flax's VAE example through make_train_step(strategy="fsdp") (both gather modes) and
  through ja.grad + ja.accumulate(axis_name="data") in a user's jit equals jax.grad + optax on the whole batch on one
  device, two updates, float64; fsdp really gathers (per microbatch: 4 gathers and 3 reduce-scatters x K=2; once: 1
  and 1), and the own-jit step's only per-call collective is the scalar value's all-reduce."""
  out = _run_once("port_fsdp_grad", [])
  diffs = re.findall(r"^(.+?)\s*: params rel diff ([-+.e0-9]+), loss rel diff ([-+.e0-9]+)", out, re.M)
  assert len(diffs) == 3, out
  for name, dp, dl in diffs:
    assert float(dp) <= 1e-10 and float(dl) <= 1e-10, f"{name}: {dp}, {dl}\n{out}"
  assert "per step {'all-gather': 8, 'reduce-scatter': 6, 'all-reduce': 2}" in out, out
  assert "collectives per call {'all-reduce': 1}, with the window-end branch {'all-reduce': 2}" in out, out
  moved = float(re.search(r"moved a parameter by up to (\S+);", out).group(1))
  assert moved > 1e-3, out  # the updates did something: equal parameters are not a vacuous pass
  assert out.rstrip().endswith("OK"), out


def test_diloco_wrapper_port_equals_a_plain_loop_over_replicas():
  """examples/diloco_wrapper_port.py: MaxText's DiLoCo test through ja.diloco_train_step (ddp and fsdp steps on a
  (replica=2, data=4) mesh) equals the original's algorithm as a loop over replicas in float64; streaming
  (2 fragments, delay 1, alpha 0.5, int4 + error feedback) trains."""
  out = _run_once("diloco_wrapper_port", ["--steps", "12", "--sync-every", "6"])
  diffs = re.findall(r"^(ddp|fsdp): \|params - ref\| (\S+)  \|anchor - ref\| (\S+)  \|losses - ref\| (\S+)$", out, re.M)
  assert [d[0] for d in diffs] == ["ddp", "fsdp"], out
  for strategy, *ds in diffs:
    assert all(float(d) < 1e-12 for d in ds), f"{strategy}:\n{out}"
  held = dict(re.findall(r"(initial|ddp|DiLoCo anchor|streaming anchor) (\d+\.\d+)", out.split("held-out loss:")[-1]))
  assert len(held) == 4 and all(float(v) < float(held["initial"]) for k, v in held.items() if k != "initial"), out


def test_port_maxtext_layer_equals_the_plain_full_batch_step():
  """examples/port_maxtext_layer.py: a MaxText decoder reduced to CPU size, its logical annotations active on an Auto
  (data=4, model=2) mesh, through make_train_step ddp and fsdp (both gather modes) and an own jit step (shard_map +
  ja.accumulate(axis_name="data")), equals jax.value_and_grad + adam on the whole batch on one device (float64, two
  updates); ddp reduces the gradient over "data" once per step for K in 1, 2, 4 (HLO, per mesh axis)."""
  out = _run_once("port_maxtext_layer", ["--x64"])
  diffs = re.findall(r"^(\(.+?)\s*: params rel diff (\S+), loss rel diff (\S+), (\d+) constraints", out, re.M)
  assert len(diffs) == 5, out
  for name, dp, dl, n in diffs:
    assert float(dp) <= 1e-10 and float(dl) <= 1e-10, f"{name}: {dp}, {dl}\n{out}"
    assert int(n) > 0, f"{name}: no sharding constraint naming 'model' left: the annotations were not active\n{out}"
  for k in (1, 2, 4):
    assert f"ddp K={k}: over 'data' {{'all-reduce': 1}}," in out, out
  moved = float(re.search(r"moved a parameter by up to (\S+)\)", out).group(1))
  assert moved > 1e-3, out
  assert re.search(r"^OK: worst rel diff", out, re.M), out


def test_port_maxtext_layer_with_relu():
  """The same port with MaxText's mlp_activations=("relu",): jax.nn.relu's jvp rule (a custom_jvp) in the loss.

  It crashed under make_train_step on every mesh while the loss's custom_jvp rules were traced inside the map
  (port31's report); they are traced under the trace mesh and localised now.
  """
  _run_once("port_maxtext_layer", ["--x64", "--activation", "relu", "--no-explicit"])
