"""The docs' figures: regions rewritten from the bench's JSON, and the deterministic ones equal to the bench at HEAD."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import run_module, xla_default_level_env

from jaxaccum.bench import figures

RESULT = {
  "section": "demo",
  "title": "demo: two tables",
  "markdown": "Some prose, N = 1.50 MiB.\n\n| case | K | peak (MiB) | ms |\n|---|---:|---:|---:|\n"
  "| a | 4 | 7.59 | 10.1 |\n| b | 4 | 40.71 | 12.0 |\n\n| x | y |\n|---|---|\n| 1 | 2 |",
  "header": {
    "date": "2026-01-02",
    "time": "05:12 UTC",
    "commit": "abc1234",
    "backend": "cpu",
    "machine": "x86_64, 2 cores, Linux",
    "jax": "0.10.2",
    "load": [1.5, 1.25, 1.0],
    "load_after": [1.75, 1.5, 1.0],
  },
}


def _results(**changes):
  r = figures.structured("demo", {**RESULT, **changes})
  return {r["id"]: r}


def test_results_carry_an_id_and_their_tables_as_rows():
  (rid, r), *_ = _results().items()
  assert rid == "demo/two-tables"
  assert r["tables"][0]["columns"] == ["case", "K", "peak (MiB)", "ms"]
  assert r["tables"][0]["rows"] == [["a", "4", "7.59", "10.1"], ["b", "4", "40.71", "12.0"]]
  assert r["tables"][1]["rows"] == [["1", "2"]]
  assert figures.result_id("fsdp", "fsdp: every strategy's per-device peak") == "fsdp/every-strategys-per-device-peak"
  assert figures.result_id("noise", "noise scale: cost") == "noise/noise-scale-cost"


def test_regions_are_rewritten_whole_as_a_table_or_a_cell():
  page = (
    "# Page\n<!-- bench:demo/two-tables -->\nstale\n<!-- /bench -->\n"
    'peak <!-- bench:demo/two-tables row="b;4" col="peak (MiB)" -->9.99<!-- /bench --> MiB\n'
    '<!-- bench:demo/two-tables cols="case;peak (MiB)" rows="b" -->\n<!-- /bench -->\n'
    "<!-- bench:demo/two-tables table=2 --><!-- /bench -->\n<!-- bench:other/thing -->keep<!-- /bench -->\n"
  )
  new, changed = figures.rewrite(page, _results(), "page.md")
  assert len(changed) == 4
  assert "Some prose, N = 1.50 MiB." in new and "stale" not in new
  assert "peak <!-- bench:demo/two-tables" in new and "40.71</span><!-- /bench --> MiB" in new
  assert "| case | peak (MiB) |\n|---|---:|\n| b | 40.71 |\n" in new
  assert "| x | y |\n|---|---|\n| 1 | 2 |\n" in new
  # The run each table and each cell comes from: commit, date and time (UTC), machine, jax, load average.
  for run in ("abc1234", "2026-01-02 05:12 UTC", "x86_64, 2 cores", "jax 0.10.2", "load average 1.50/1.25/1.00"):
    assert new.count(run) == 4, run
  assert "<!-- bench:other/thing -->keep<!-- /bench -->" in new  # no such result: left alone
  again, changed = figures.rewrite(new, _results(), "page.md")
  assert again == new and changed == []  # idempotent: a second run changes nothing


def test_a_cell_that_reads_as_a_link_reference_is_escaped():
  # `[text][ref]` in a table cell (a buffer named params['layers']['w_up']) is a link reference to markdown:
  # mkdocs --strict refused the page (CI, issue 48's breakdown table). Code spans are left as written.
  table = "| case | buffer |\n|---|---|\n| a | params['layers']['w_up'] and `x['a']['b']` |"
  out = figures._escape_brackets("Prose with [a link][ref].\n\n" + table)
  assert "| a | params['layers']\\['w_up'] and `x['a']['b']` |" in out
  assert "Prose with [a link][ref]." in out  # outside tables: the page's own markdown
  assert figures._escape_brackets(out) == out


def test_a_whole_result_with_escaped_cells_equals_its_own_rewritten_page():
  # The page holds the escaped table (`render`); `--verify` compares a fresh result with it: the fresh markdown is
  # escaped alike, or every breakdown table reads as differing (CI at 498f74d).
  table = "| case | buffer |\n|---|---|\n| a | params['layers']['w_up'] |"
  results = _results(markdown="Where the bytes go.\n\n" + table)
  page, _ = figures.rewrite("<!-- bench:demo/two-tables -->\n<!-- /bench -->\n", results)
  assert "params['layers']\\['w_up']" in page
  (m,) = figures.regions(page)
  assert figures._compare(m, results["demo/two-tables"], None, "page.md") == []
  other = _results(markdown="Where the bytes go.\n\n" + table.replace("w_up", "w_gate"))["demo/two-tables"]
  assert figures._compare(m, other, None, "page.md")  # and a real difference is still one


def test_bad_region_options_are_refused_by_name():
  with pytest.raises(ValueError, match="option"):
    figures.rewrite("<!-- bench:demo/two-tables colour=red --><!-- /bench -->", _results())
  with pytest.raises(KeyError, match="nope"):
    figures.rewrite('<!-- bench:demo/two-tables cols="nope" --><!-- /bench -->', _results())
  with pytest.raises(KeyError, match="rows start"):
    figures.rewrite('<!-- bench:demo/two-tables row="c" col="K" --><!-- /bench -->', _results())


def test_check_and_update_on_pages_and_notebooks(tmp_path):
  (tmp_path / "docs" / "guides").mkdir(parents=True)
  (tmp_path / "notebooks").mkdir()
  (tmp_path / "README.md").write_text("<!-- bench:demo/two-tables table=2 -->\n<!-- /bench -->\n")
  (tmp_path / "docs" / "guides" / "g.md").write_text("nothing marked, 7.59 MiB\n")
  cell = {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["x <!-- bench:demo/two-tables "]}
  cell["source"].append('row="a" col="ms" -->?<!-- /bench -->')
  nb = {"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
  (tmp_path / "notebooks" / "n.ipynb").write_text(json.dumps(nb, indent=1) + "\n")
  results = _results()
  assert len(figures.update(results, tmp_path, write=False)) == 2  # --check: both stale, nothing written
  assert "?" in (tmp_path / "notebooks" / "n.ipynb").read_text()
  figures.update(results, tmp_path)
  assert figures.update(results, tmp_path, write=False) == []
  source = "".join(json.loads((tmp_path / "notebooks" / "n.ipynb").read_text())["cells"][0]["source"])
  assert source.startswith('x <!-- bench:demo/two-tables row="a" col="ms" --><span title="From python -m jaxaccum')
  assert source.endswith('">10.1</span><!-- /bench -->')
  assert figures.unknown_regions(results, tmp_path) == []
  assert figures.unknown_regions({}, tmp_path) == ["README.md: demo/two-tables", "notebooks/n.ipynb: demo/two-tables"]


def test_a_region_that_disagrees_with_a_fresh_result_is_reported():
  page = '<!-- bench:demo/two-tables cols="case;peak (MiB);ms" -->\n<!-- /bench -->'
  page, _ = figures.rewrite(page, _results())
  match = next(figures.regions(page))
  fresh = _results()["demo/two-tables"]
  assert figures._compare(match, fresh, ("peak (MiB)",), "p") == []
  slower = figures.structured("demo", {**RESULT, "markdown": RESULT["markdown"].replace("10.1", "11.3")})
  assert figures._compare(match, slower, ("peak (MiB)",), "p") == []  # a timing: not compared
  leaner = figures.structured("demo", {**RESULT, "markdown": RESULT["markdown"].replace("40.71", "38.00")})
  (diff,) = figures._compare(match, leaner, ("peak (MiB)",), "p")
  assert "40.71" in diff and "38.00" in diff


def test_every_page_matches_the_store():
  """`python -m jaxaccum.bench.figures --check`: no page prints a figure other than the stored run's, no store
  entry is unreferenced or older than the code it measures, no figure or target verdict is typed by hand."""
  results = figures.load(figures.ROOT / figures.STORE)
  assert figures.problems(results) == []
  marked = [p for p in figures.pages() if "<!-- bench:" in p.read_text()]
  for path in marked:  # a `|` in a marker would split the markdown table row it sits in
    assert all("|" not in m.group("opts") for m in figures.regions(path.read_text())), path
  assert pathlib.Path(figures.ROOT / "docs" / "benchmarks.md") in marked


def _page(tmp_path, text):
  (tmp_path / "docs").mkdir(exist_ok=True)
  (tmp_path / "README.md").write_text(text)
  return tmp_path


def test_a_figure_typed_outside_a_region_is_refused(tmp_path):
  region = '<!-- bench:demo/two-tables row="a" col="ms" --><!-- /bench -->'
  results = _results()
  figures.update(results, _page(tmp_path, f"The step takes {region} ms.\n"))
  assert figures.problems(results, tmp_path) == []
  page = (tmp_path / "README.md").read_text()
  (tmp_path / "README.md").write_text(page + "\nA skipped update: up to 1.32x lower peak.\n")
  (found,) = figures.problems(results, tmp_path)
  assert found.startswith("README.md:3: figure '1.32x' typed outside a bench region"), found
  # Targets (a bound before the figure), code blocks, and paragraphs that say why they are typed pass.
  for fine in ("Target: <= 1.05x the full batch.", "```\n1.32x\n```", "L = 1.00 MiB <!-- typed: on paper -->"):
    (tmp_path / "README.md").write_text(page + "\n" + fine + "\n")
    assert figures.problems(results, tmp_path) == [], fine


def test_a_target_verdict_typed_outside_a_region_is_refused(tmp_path):
  results = _results()
  for typed in (
    "The 2% target is met only for large microbatches.",
    "Time at B=128: not met.",
    "The overhead is within noise of its target.",
  ):
    _page(tmp_path, typed + "\n")
    (found,) = figures.typed_verdicts(tmp_path)
    assert "verdict" in found and "typed outside a bench region" in found, found
  # From a region it is the bench's word; "within noise" comparing two rows (no target named) is prose.
  _page(
    tmp_path,
    'Target: <!-- bench:demo/two-tables table=2 row="1" col="y" --><!-- /bench -->.\n'
    "int4 lands within noise of the float rows.\n",
  )
  figures.update(results, tmp_path)
  assert figures.problems(results, tmp_path) == []


def test_an_unreferenced_or_stale_entry_is_refused(tmp_path):
  from jaxaccum.bench import code_hash

  results = _results()
  other = figures.structured("noise", {**RESULT, "section": "noise", "title": "noise scale: cost of measuring it"})
  results[other["id"]] = other
  figures.update(results, _page(tmp_path, "<!-- bench:demo/two-tables table=2 --><!-- /bench -->\n"))
  assert figures.problems(results, tmp_path) == [
    "store entry no page references: noise/noise-scale-cost-of-measuring-it"
  ]
  del results[other["id"]]
  results["demo/two-tables"]["code"] = "0123456789abcdef"  # measured on other code than the checkout's
  (found,) = figures.problems(results, tmp_path)
  assert found.startswith("stale: demo/two-tables: measured at commit abc1234"), found
  results["demo/two-tables"]["code"] = code_hash("demo")
  assert figures.problems(results, tmp_path) == []


def test_check_command_fails_on_a_page_with_a_typed_figure(tmp_path):
  """The command line, as CI runs it: exit 1 and the line that says where."""
  results = _results()
  figures.update(results, _page(tmp_path, "<!-- bench:demo/two-tables table=2 --><!-- /bench -->\n"))
  figures.save(results, tmp_path / "store.json")
  check = [sys.executable, "-m", "jaxaccum.bench.figures", "--check", "--root", str(tmp_path)]
  check += ["--store", str(tmp_path / "store.json")]
  proc = subprocess.run(check, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  with open(tmp_path / "README.md", "a") as f:
    f.write("\nAccumulate is 0.55x MultiSteps.\n")
  proc = subprocess.run(check, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1 and "README.md:11: figure '0.55x' typed outside a bench region" in proc.stderr


def _verify(level, *sections):
  only = ["--sections", ",".join(sections)] if sections else []
  # The figures were computed at XLA's default LLVM level (trained losses among them).
  proc = run_module("jaxaccum.bench.figures", "--verify", level, *only, timeout=3600, env=xla_default_level_env())
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_deterministic_figures_equal_the_bench_at_head():
  """The small deterministic tables (state bytes, all-reduces per update, own-jit collectives), recomputed."""
  _verify("fast")


FULL_SECTIONS = sorted({section for section, _, cost, _ in figures.DETERMINISTIC if cost == "full"})


@pytest.mark.slow
@pytest.mark.parametrize("section", FULL_SECTIONS)
def test_every_deterministic_figure_equals_the_bench_at_head(section):
  """Every compiled-memory, collective-count and HLO-bytes table (fsdp, sharded, microbatch memory, ...), one
  section per cell (CI samples the cells by date: .ci/run)."""
  _verify("full", section)


def test_verify_sections_are_checked_by_name():
  with pytest.raises(ValueError, match="sections"):
    figures.recompute("full", ["nope"])
  proc = run_module("jaxaccum.bench.figures", "--verify", "full", "--sections", "nope")
  assert proc.returncode == 2 and "--sections 'nope'" in proc.stderr
