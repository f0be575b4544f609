"""python -m jaxaccum.bench --quick: a well-formed report with finite, positive ratios (no timing assertions)."""

import json
import math
import pathlib

import pytest
from conftest import numbers_in, run_module

# The sections, read off the package independently of `bench.SECTIONS`: every module of jaxaccum/bench/ but the
# shared ones (a new section module must be registered, and a registered one must exist).
SHARED = {"__init__", "__main__", "common", "figures", "reproduce", "textlm", "compile_time"}
SECTIONS = (
  frozenset(p.stem for p in (pathlib.Path(__file__).resolve().parent.parent / "jaxaccum" / "bench").glob("*.py"))
  - SHARED
)


@pytest.mark.slow  # each section compiled in a subprocess (seconds to minutes): CI samples the cells by date
@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_bench_quick_report(section, tmp_path):
  out = tmp_path / "bench.json"
  proc = run_module("jaxaccum.bench", "--quick", "--sections", section, "--json", str(out), timeout=900, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["header"]["quick"] is True
  assert {s["section"] for s in report["sections"]} == {section}
  for s in report["sections"]:
    assert s["title"] and s["markdown"].count("|") > 4, s
    assert f"## {s['title']}" in proc.stdout
  numbers = list(numbers_in(report))
  assert numbers
  for path, value in [(p, v) for p, v in numbers if "ratio" in p]:  # the fit section has none: its check below
    assert math.isfinite(value) and value > 0, (path, value)
  check = {"fit": _check_fit_quick, "model_axis": _check_compile_time_quick}.get(section)
  if check is not None:
    check({s["title"]: s for s in report["sections"]})


def _check_fit_quick(results):
  """The fit section plans the smallest K whose compiled peak fits each budget."""
  from jaxaccum.bench import fit

  (result,) = results.values()
  rows, plans = result["data"]["rows"], result["data"]["plans"]
  assert {r["case"] for r in rows} == {fit.PLAIN_FSDP, "fsdp per_microbatch"}
  assert all(r["plain_peak_bytes"] > 0 for r in rows)
  for key, plan in plans.items():
    case, budget = key.split("/")
    size = float(budget.split()[0]) * 2 ** (30 if budget.endswith("GiB") else 20)
    fitting = [r["K"] for r in rows if r["case"] == case and r["peak_bytes"] <= size]
    assert plan["K"] == (min(fitting) if fitting else None), (key, plan, rows)
  for r in rows:
    assert r["peak_bytes"] > 0 and r["floor_bytes"] > 0 and r["axis_bytes"]["data"] > 0


def _check_compile_time_quick(results):
  """The model-axis section's compile-time table: each step against its plain baseline (and the skip's)."""
  from jaxaccum.bench import compile_time

  (result,) = [r for r in results.values() if "models" in r["data"]]
  for model in result["data"]["models"]:
    assert set(model["ratio"]) == set(compile_time.BASELINE)  # each jaxaccum step against its plain baseline
    assert all(q["min"] <= q["median"] <= q["max"] for q in model["ratio"].values())
    # The plain steps with the skip against the plain steps, and each jaxaccum step that keeps the check against
    # them (the ", no check" steps are read against the plain steps alone, in "ratio").
    assert set(model["skip_ratio"]) == set(compile_time.WITH_SKIP) | set(compile_time.WITH_SKIP.values())


def test_bench_is_a_subpackage_with_one_module_per_section():
  import importlib

  import jaxaccum
  import jaxaccum.bench as bench

  root = pathlib.Path(jaxaccum.__file__).parent
  assert not list(root.glob("_bench_*.py")) and not (root / "bench.py").exists()
  assert set(bench.SECTIONS) == SECTIONS and len(bench.SECTIONS) == len(SECTIONS)
  for name in bench.SECTIONS:
    assert callable(importlib.import_module(f"jaxaccum.bench.{name}").run), name
  proc = run_module("jaxaccum.bench", "--help")
  assert proc.returncode == 0 and "--quick" in proc.stdout and "--sections" in proc.stdout, proc.stderr
  proc = run_module("jaxaccum.bench", "--sections", "nope")
  assert proc.returncode == 2 and "unknown sections ['nope']" in proc.stderr, proc.stderr


def test_timed_interleaves_rotates_and_reports_the_spread():
  """`common.timed`, the bench's one timing helper: >= 7 rounds, the order rotated, ratios per round."""
  from jaxaccum.bench import common

  calls = []
  runners = {name: (lambda name=name: calls.append(name)) for name in "abc"}
  with pytest.raises(ValueError, match="rounds=3"):
    common.timed(runners, "a", rounds=3)
  with pytest.raises(ValueError, match="baseline='z'"):
    common.timed(runners, "z")
  with pytest.raises(ValueError, match="max_rounds=5"):
    common.timed(runners, "a", rounds=7, max_rounds=5)
  t = common.timed(runners, "a", rounds=7, warmup=1, max_rounds=7)
  timed_calls = calls[3:]
  assert timed_calls[:9] == list("abcbcacab")  # A B C, then B C A, then C A B
  assert t["rounds"] == 7 and all(len(t["wall_rounds"][n]) == 7 for n in "abc")
  assert t["stopped"] in ("spread", "max_rounds")  # microsecond runners: their ratios may well stay wide
  assert t["ratio"]["a"] == {"median": 1.0, "q1": 1.0, "q3": 1.0, "min": 1.0, "max": 1.0}
  assert len(t["load_before"]) == 3 and len(t["load_after"]) == 3
  q = common.ratio_between({"wall_rounds": {"x": [2.0, 4.0, 6.0], "y": [1.0, 2.0, 2.0]}}, "x", "y")
  assert q["median"] == 2.0 and q["min"] == 2.0 and q["max"] == 3.0


def test_verdicts_say_within_noise_when_the_printed_range_straddles_the_target():
  """A verdict reads the range its cell prints (min-max over the rounds), never the median alone."""
  from jaxaccum.bench import common

  q = lambda lo, median, hi: {"min": lo, "q1": median, "median": median, "q3": median, "max": hi}
  assert common.verdict(q(0.50, 0.55, 0.60), 0.70) == "met"
  assert common.verdict(q(0.72, 0.75, 0.80), 0.70) == "not met"
  assert common.verdict(q(0.65, 0.69, 0.74), 0.70) == "within noise, median under"  # the median alone: met
  assert common.verdict(q(0.65, 0.72, 0.74), 0.70) == "within noise, median over"  # the median alone: not met
  # Quartiles inside the bound, the slowest round beyond it: the printed range straddles, so not "met".
  tail = {"min": 0.60, "q1": 0.62, "median": 0.64, "q3": 0.66, "max": 0.75}
  assert common.verdict(tail, 0.70) == "within noise, median under"
  assert common.ratio_cell(q(0.53, 0.55, 0.57)) == "0.55x [0.53, 0.57]"
  assert common.ratio_cell(q(0.997, 1.012, 1.025), percent=True) == "+1.2% [-0.3, +2.5]"
  # Compared as printed: a fastest round of 0.7012x prints "0.70", so the cell straddles <= 0.70x.
  edge = q(0.7012, 0.94, 1.21)
  assert common.ratio_cell(edge) == "0.94x [0.70, 1.21]"
  assert common.verdict(edge, 0.70) == "within noise, median over"
  assert common.verdict(q(0.9, 0.95, 1.0504), 1.05) == "met"  # prints [0.90, 1.05]
  assert common.verdict(q(0.99, 1.0, 1.0204), 1.02, percent=True) == "met"  # prints [-1.0, +2.0]
  assert common.verdict(q(0.99, 1.0, 1.0204), 1.02) == "met"
  assert common.verdict(q(0.99, 1.0, 1.0251), 1.02, percent=True) == "within noise, median under"  # +2.5


def test_every_section_names_the_code_it_measures():
  """The hash stored with each result (a region older than its code fails `figures --check`)."""
  import jaxaccum.bench as bench

  assert set(bench.MEASURES) == SECTIONS
  for name in SECTIONS:
    files = [p.name for p in bench.measured_files(name)]
    assert "common.py" in files and len(files) >= 3, (name, files)
    assert len(bench.code_hash(name)) == 16
  assert bench.code_hash("accumulate") != bench.code_hash("noise")


def test_fit_models_llama_3_8b_from_shapes():
  """The fit section's model is Llama-3-8B's shape (8.03e9 parameters), as ShapeDtypeStructs: nothing allocated."""
  import jax

  from jaxaccum.bench import fit

  params = fit.abstract_params(fit.LLAMA3_8B)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
  assert sum(x.size for x in jax.tree.leaves(params)) == 8_030_261_248  # Llama 3 8B's count
  n = 4 * 8_030_261_248
  cases = {c.name: c for c in fit.CASES}
  ddp = fit._floor(fit.LLAMA3_8B, cases["ddp"], n, 16)
  fsdp = fit._floor(fit.LLAMA3_8B, cases["fsdp per_microbatch"], n, 16)
  assert ddp["state"] == 4 * n and fsdp["state"] < n // 2 + n // 10  # 4N/8 and one layer and its gradient
  assert ddp["saved_layer_inputs"] == 32 * 2 * 4096 * 4096 * 2  # 2 sequences of 4096 tokens per microbatch
  # Gemma 2B (tied embedding): 2.51e9 parameters; every strategy is read against a plain step of its layout.
  assert round(sum(x.size for x in jax.tree.leaves(fit.abstract_params(fit.GEMMA_2B))) / 1e7) == 251
  plains = {c.name for c in fit.CASES if c.strategy == "plain"}
  assert all(c.plain in plains for c in fit.CASES) and len(plains) == 3


def test_fit_compiles_again_without_ynn_fusion_and_reads_each_step_against_its_plain_one():
  from jaxaccum.bench import fit

  tiny = fit.QUICK._replace(layers=1, width=64, ffw=128, head_dim=16, vocab=256, seq=16, batch=16)
  cases = (fit.CASES[3], fit.CASES[4])  # the plain fsdp layout, fsdp per_microbatch
  got = {
    "rows": [{"case": fit.PLAIN_FSDP, "K": 1, "peak_bytes": 4000}, {"case": cases[1].name, "K": 1, "peak_bytes": 3000}]
  }
  result = fit.without_ynn_fusion(tiny, got, (1,), cases=cases)  # the table's peaks as given, compiled again
  (row,) = result["data"]["rows"]
  assert row["case"] == "fsdp per_microbatch" and row["plain"] == fit.PLAIN_FSDP
  assert row["peak_bytes"] == 3000 and row["ratio"] == 0.75 and row["no_ynn_peak_bytes"] > 0
  assert 0 < row["no_ynn_ratio"] < 10 and "| fsdp per_microbatch | 1 | 0.0 | 0.75 |" in result["markdown"]


def test_compile_time_models_are_one_function_listed_or_scanned():
  """The compile-time table's transformer: listed and scanned layers give the same loss (abstract shapes only)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxaccum.bench import compile_time

  def concrete(kind, key):
    shapes = compile_time._abstract_params(kind, 2, 16)
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
      tree, [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    )

  listed = concrete("listed", jax.random.key(0))
  scanned = dict(listed, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *listed["layers"]))
  batch = {"tok": jnp.arange(8 * 4).reshape(8, 4) % 512, "tgt": jnp.arange(8 * 4).reshape(8, 4)[::-1] % 512}
  a = compile_time.make_loss("listed")(listed, batch)
  b = compile_time.make_loss("scanned")(scanned, batch)
  np.testing.assert_allclose(a, b, rtol=1e-5)


def test_compile_time_plain_step_with_the_skip_keeps_everything_on_a_non_finite_gradient():
  """The reference '+ skip' step: the plain step, its update skipped when a gradient is not finite."""
  import jax.numpy as jnp
  import numpy as np
  import optax

  from jaxaccum.bench import compile_time

  loss = lambda p, b: jnp.mean(b["x"] @ p["w"])
  opt = optax.adam(0.1)
  params = {"w": jnp.ones((3, 2))}
  state = opt.init(params)
  x = np.ones((4, 3))
  for skip in (False, True):
    step = compile_time._plain_step(loss, opt, 2, skip=skip)
    new, _ = step(params, state, {"x": x})
    assert not np.allclose(new["w"], params["w"])  # finite: applied
    new, new_state = step(params, state, {"x": np.where(np.arange(12).reshape(4, 3) == 5, np.inf, x)})
    if skip:
      np.testing.assert_array_equal(new["w"], params["w"])
      assert int(new_state[0].count) == 0
    else:
      assert not np.all(np.isfinite(new["w"]))
