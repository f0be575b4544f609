"""`python -m jaxaccum.bench.reproduce`: a second run against what the docs print."""

import json

import pytest

from jaxaccum.bench import reproduce

TIMED_DATA = {"timing": {"wall_rounds": {"a": [1.0]}, "baseline": "a"}}


def _result(rid, rows, prose="", data=None, columns=("case", "ms / window", "vs base", "target")):
  table = "\n".join(
    ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(r) + " |" for r in rows]
  )
  markdown = f"{prose}\n\n{table}\n"
  return {"id": rid, "section": rid.split("/")[0], "title": rid, "markdown": markdown, "data": data or {}}


def _report(path, results, **header):
  path.write_text(json.dumps({"header": {"date": "2026-11-26", "quick": False, **header}, "sections": results}))
  return str(path)


def test_a_median_inside_the_printed_range_reproduces_and_one_outside_does_not(tmp_path, capsys):
  printed = _result(
    "t/timed", [["B=8", "13.7", "0.44x [0.40, 0.60]", "met"]], "padding median 1.2% [0.3%, 2.5%]", TIMED_DATA
  )
  # Raw milliseconds and the verdict may change; the median must stay inside [0.40, 0.60].
  inside = _result(
    "t/timed", [["B=8", "20.1", "0.59x [0.55, 0.70]", "within noise"]], "padding median 2.5% [1.0%, 4.0%]", TIMED_DATA
  )
  outside = _result(
    "t/timed", [["B=8", "13.7", "0.61x [0.58, 0.63]", "met"]], "padding median 1.2% [0.3%, 2.5%]", TIMED_DATA
  )
  store = _report(tmp_path / "store.json", [printed])
  assert reproduce.main([_report(tmp_path / "in.json", [inside]), "--store", store]) == 0
  out = capsys.readouterr().out
  assert "inside the printed range: 2 of 2" in out and "verdict flip" in out
  assert reproduce.main([_report(tmp_path / "out.json", [outside]), "--store", store]) == 1
  out = capsys.readouterr().out
  assert "NOT REPRODUCED t/timed [B=8] vs base" in out and "0.61 outside [0.4, 0.6]" in out
  assert "inside the printed range: 1 of 2" in out


def test_a_deterministic_figure_must_be_equal(tmp_path, capsys):
  cols = ("strategy", "peak (MiB)", "all-reduces")
  printed = _result("t/memory", [["fsdp", "32.05", "1"]], "MLP 4 x 1024.", columns=cols)
  moved = _result("t/memory", [["fsdp", "32.06", "1"]], "MLP 4 x 1024.", columns=cols)
  prose = _result("t/memory", [["fsdp", "32.05", "1"]], "MLP 4 x 2048.", columns=cols)
  store = _report(tmp_path / "store.json", [printed])
  assert reproduce.main([_report(tmp_path / "same.json", [printed]), "--store", store]) == 0
  assert "deterministic figures equal: 4 of 4" in capsys.readouterr().out  # 3 cells and the prose
  assert reproduce.main([_report(tmp_path / "moved.json", [moved]), "--store", store]) == 1
  assert "t/memory [fsdp] peak (MiB): printed '32.05', rerun '32.06'" in capsys.readouterr().out
  assert reproduce.main([_report(tmp_path / "prose.json", [prose]), "--store", store]) == 1
  assert "(prose)" in capsys.readouterr().out
  # A cell of a timed result that is not a timing (a memory column) is compared too.
  timed = _result("t/timed", [["B=8", "13.7", "0.44x [0.40, 0.60]", "1.5"]], data=TIMED_DATA)
  timed_moved = _result("t/timed", [["B=8", "13.7", "0.44x [0.40, 0.60]", "1.6"]], data=TIMED_DATA)
  store = _report(tmp_path / "store2.json", [timed])
  assert reproduce.main([_report(tmp_path / "t.json", [timed_moved]), "--store", store]) == 1
  assert "printed '1.5', rerun '1.6'" in capsys.readouterr().out


def test_results_only_one_side_has_are_listed_not_compared(tmp_path, capsys):
  a = _result("t/a", [["x", "1", "2", "3"]])
  b = _result("t/b", [["x", "1", "2", "3"]])
  both = _result("t/both", [["x", "1", "2", "3"]])
  run, store = _report(tmp_path / "run.json", [b, both]), _report(tmp_path / "s.json", [a, both])
  assert reproduce.main([run, "--store", store]) == 0
  out = capsys.readouterr().out
  assert "only printed: t/a" in out and "only in the rerun: t/b" in out
  assert "deterministic figures equal: 5 of 5" in out  # t/both's 4 cells and its prose
  # With no result in common nothing is compared, and a check that checked nothing does not pass.
  run = _report(tmp_path / "run_b.json", [b])
  assert reproduce.main([run, "--store", _report(tmp_path / "s_a.json", [a])]) == reproduce.NOTHING_COMPARED == 4
  captured = capsys.readouterr()
  assert "only printed: t/a" in captured.out and "only in the rerun: t/b" in captured.out
  err = captured.err.strip()
  assert "\n" not in err and "nothing compared" in err and "run_b.json" in err and "no result id in common" in err


def test_results_in_common_that_hold_no_figure_compare_nothing(tmp_path, capsys):
  """A timed result with no range printed and no table: in both, yet not one figure to compare."""
  empty = {"id": "t/timed", "section": "t", "title": "t/timed", "markdown": "no ranges here", "data": TIMED_DATA}
  store = _report(tmp_path / "s.json", [empty])
  assert reproduce.main([_report(tmp_path / "run.json", [empty]), "--store", store]) == 4
  captured = capsys.readouterr()
  assert "inside the printed range: 0 of 0" in captured.out
  assert "nothing compared" in captured.err and "the 1 results in common hold no figure" in captured.err


# Each way a file can fail to be a report: (writes the file at path or not, what the one-line error says, code).
_BAD = {
  "missing": (None, "no such file", 3),
  "empty file": ("", "the file is empty", 3),
  "not JSON": ("{'sections': [", "not JSON", 3),
  "a JSON list": ("[]", "a JSON list, not an object", 3),
  "no sections": (json.dumps({"header": {"date": "2026-11-26"}}), "no 'sections' key", 3),
  "sections not a list": (json.dumps({"header": {}, "sections": {}}), "'sections' is a dict", 3),
  "no header": (json.dumps({"sections": []}), "no 'header' object", 3),
  "a result without markdown": (
    json.dumps({"header": {}, "sections": [{"section": "t", "title": "x"}]}),
    "result 0 of 'sections' is not a bench result (no 'markdown')",
    3,
  ),
  "empty sections": (json.dumps({"header": {"date": "2026-11-26"}, "sections": []}), "holds no results", 4),
}


@pytest.mark.parametrize("side", ["run", "store"])
@pytest.mark.parametrize("case", list(_BAD))
def test_an_unreadable_or_empty_run_or_store_is_one_line_naming_the_file(tmp_path, capsys, side, case):
  text, says, code = _BAD[case]
  bad = tmp_path / "bad.json"
  if text is not None:
    bad.write_text(text)
  good = _report(tmp_path / "good.json", [_result("t/a", [["x", "1", "2", "3"]])])
  argv = [str(bad), "--store", good] if side == "run" else [good, "--store", str(bad)]
  assert reproduce.main(argv) == code
  captured = capsys.readouterr()
  err = captured.err.strip()
  assert "\n" not in err and "Traceback" not in err, err  # one line, no traceback
  assert f"{side} {str(bad)!r}" in err, err  # names which file, and which side it is
  assert says in err, err
  if code == 4:
    assert "nothing compared" in err
  assert "NOT REPRODUCED" not in captured.out and "inside the printed range" not in captured.out


def test_a_quick_run_against_a_full_store_is_refused_by_name(tmp_path, capsys):
  """--quick measures other sizes: every figure would differ, so the comparison is refused, not failed cell by cell."""
  a = _result("t/a", [["x", "1", "2", "3"]])
  store = _report(tmp_path / "s.json", [a])
  with pytest.raises(SystemExit) as e:
    reproduce.main([_report(tmp_path / "quick.json", [a], quick=True), "--store", store])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "quick.json" in err and "quick=False printed, quick=True rerun" in err
  # Another jax version is compared, with a warning (deterministic figures are per jax/XLA).
  assert reproduce.main([_report(tmp_path / "jax.json", [a], jax="0.11.0"), "--store", store]) == 0
  assert "warning: t/a: jax None printed, 0.11.0 rerun" in capsys.readouterr().out


def test_without_a_store_beside_the_package_it_says_to_pass_store(tmp_path, capsys, monkeypatch):
  """From an installed wheel (no docs/ beside the package) the default store is missing: the error names --store."""
  from jaxaccum.bench import figures

  monkeypatch.setattr(figures, "ROOT", tmp_path / "site-packages")  # where an installed package's ROOT points
  run = tmp_path / "run.json"
  run.write_text(json.dumps({"header": {}, "sections": []}))
  assert reproduce.main([str(run)]) == reproduce.UNREADABLE
  err = capsys.readouterr().err
  assert "no figures store at" in err and "--store PATH/docs/bench_results.json" in err, err
  assert err.count("\n") == 1  # one line
