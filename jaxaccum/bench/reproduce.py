"""`python -m jaxaccum.bench.reproduce RUN.json`: does a second bench run reproduce what the docs print?

The docs print the figures of one run (the store, docs/bench_results.json).
A second full run at another time, `python -m jaxaccum.bench --json RUN.json`,
reproduces them when:

- every deterministic figure is equal: compiled memory, collective counts,
  HLO bytes, the stdlib LM's losses (every cell of a result that times
  nothing, its prose included, and the cells of a timed result that are not
  timings);
- every timing ratio's median lies inside the range the docs print beside it:
  a cell `0.55x [0.51, 0.60]` (or `+1.2% [-0.3, +2.5]`, or a ratio in prose)
  is reproduced when the second run's median is within [0.51, 0.60], the
  min-max of the first run's rounds (`common.ratio_cell`).

Not compared: raw times (a column in ms: the machine's speed, not a ratio),
verdicts (they follow the ranges; a flip is listed for the reader) and the
prose of timed results around their ranges (round counts, load averages).
Only results present in both are compared; the ids each side lacks are listed.

Exit codes: 0 every figure compared reproduced; 1 a figure not reproduced; 2 refused (a `--quick`
run against a full one, or bad arguments); 3 the run or the store cannot be read as a bench report
(missing, not JSON, no `sections` list, a malformed result); 4 nothing was compared (a side with no
results, no result id in common, or no figure in the results in common): a check that checked
nothing does not pass. Codes 3 and 4 print one line naming the file and what is wrong.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

from jaxaccum.bench import figures

# A median with the range printed beside it: "0.55x [0.51, 0.60]", "+1.2% [-0.3, +2.5]", "1.2% [0.3%, 2.5%]".
_RANGED = re.compile(r"([+-]?\d+(?:\.\d+)?)(x|%)? \[([+-]?\d+(?:\.\d+)?)%?x?, ([+-]?\d+(?:\.\d+)?)%?x?\]")
_NUMBER = re.compile(r"[-+]?[\d.,]+")
_VERDICTS = ("met", "not met", "within noise")
_RAW_TIME = re.compile(r"\bms\b|\bseconds?\b")  # a column header of raw times


def _timed(result: dict) -> bool:
  """Whether a result times something (its data holds a `common.timed` result)."""
  return "wall_rounds" in json.dumps(result.get("data", {}), default=str)


def _is_verdict(cell: str) -> bool:
  return any(v in cell for v in _VERDICTS)


def _ranged(text: str) -> list[tuple[float, float, float]]:
  return [(float(m.group(1)), float(m.group(3)), float(m.group(4))) for m in _RANGED.finditer(text)]


def _prose(markdown: str) -> str:
  """A result's markdown without its tables (the cells are compared one by one)."""
  return "\n".join(line for line in markdown.splitlines() if not line.lstrip().startswith("|"))


def compare_result(printed: dict, rerun: dict) -> tuple[dict, list[str], list[str]]:
  """One result: ({"inside", "outside", "equal", "differ"}: counts, [not reproduced], [verdict flips])."""
  counts = {"inside": 0, "outside": 0, "equal": 0, "differ": 0}
  missed: list[str] = []
  flips: list[str] = []
  rid, timed = printed["id"], _timed(printed)

  def ranges(where: str, have: str, got: str) -> None:
    for (_, lo, hi), (median, _, _) in zip(_ranged(have), _ranged(got), strict=False):
      if lo <= median <= hi:
        counts["inside"] += 1
      else:
        counts["outside"] += 1
        missed.append(f"{rid} {where}: printed {have!r}, rerun median {median:g} outside [{lo:g}, {hi:g}]")

  def equal(where: str, have: str, got: str) -> None:
    if have == got:
      counts["equal"] += 1
    else:
      counts["differ"] += 1
      missed.append(f"{rid} {where}: printed {have!r}, rerun {got!r}")

  tables_a, tables_b = printed.get("tables", []), rerun.get("tables", [])
  if len(tables_a) != len(tables_b):
    missed.append(f"{rid}: {len(tables_a)} tables printed, {len(tables_b)} in the rerun")
  for t, (ta, tb) in enumerate(zip(tables_a, tables_b, strict=False)):
    if ta["columns"] != tb["columns"] or len(ta["rows"]) != len(tb["rows"]):
      missed.append(f"{rid} table {t + 1}: columns or row count differ: {ta['columns']} vs {tb['columns']}")
      continue
    for ra, rb in zip(ta["rows"], tb["rows"], strict=True):
      # A row is named by its first cell, and its second where that is a label (not a number).
      two = len(ra) > 2 and not _RAW_TIME.search(ta["columns"][1]) and not _NUMBER.fullmatch(ra[1].strip())
      label = f"{ra[0]} | {ra[1]}" if two else ra[0]
      for col, a, b in zip(ta["columns"], ra, rb, strict=True):
        where = f"[{label}] {col}"
        if timed and _ranged(a):
          ranges(where, a, b)
        elif timed and _is_verdict(a):
          if a != b:
            flips.append(f"{rid} {where}: {a!r} -> {b!r}")
        elif timed and _RAW_TIME.search(col):
          continue
        else:
          equal(where, a, b)
  prose_a, prose_b = _prose(printed.get("markdown", "")), _prose(rerun.get("markdown", ""))
  if timed:
    ranges("(prose)", prose_a, prose_b)
  else:
    equal("(prose)", prose_a, prose_b)
  return counts, missed, flips


def compare(printed: dict[str, dict], rerun: dict[str, dict]) -> tuple[dict, list[str], list[str], list[str]]:
  """Every result in both: (summed counts, [not reproduced], [verdict flips], [ids only one side has])."""
  total = {"inside": 0, "outside": 0, "equal": 0, "differ": 0}
  missed, flips = [], []
  for rid in sorted(set(printed) & set(rerun)):
    counts, m, f = compare_result(printed[rid], rerun[rid])
    total = {k: total[k] + counts[k] for k in total}
    missed += m
    flips += f
  one_side = [f"only printed: {r}" for r in sorted(set(printed) - set(rerun))]
  one_side += [f"only in the rerun: {r}" for r in sorted(set(rerun) - set(printed))]
  return total, missed, flips, one_side


def _mismatch(printed: dict[str, dict], rerun: dict[str, dict]) -> tuple[list[str], list[str]]:
  """([refusals]: a --quick run against a full one measures other sizes, [warnings]: another jax or backend)."""
  refuse, warn = [], []
  for rid in sorted(set(printed) & set(rerun)):
    a, b = printed[rid].get("header", {}), rerun[rid].get("header", {})
    if bool(a.get("quick")) != bool(b.get("quick")):
      refuse.append(f"{rid}: quick={bool(a.get('quick'))} printed, quick={bool(b.get('quick'))} rerun")
    for key in ("jax", "backend"):
      if a.get(key) != b.get(key):
        warn.append(f"{rid}: {key} {a.get(key)} printed, {b.get(key)} rerun (deterministic figures may differ)")
  return refuse, warn


UNREADABLE = 3  # the run or the store is not a readable bench report
NOTHING_COMPARED = 4  # no figure was compared: the check checked nothing


class ReportError(Exception):
  """A run or store that cannot be read as a bench report; the message is one line naming the file."""


def _load(path: str, what: str) -> dict[str, dict]:
  """`figures.load`, with each way a file can fail to be a report turned into a one-line `ReportError`."""
  name = f"{what} {path!r}"
  try:
    text = pathlib.Path(path).read_text()
  except FileNotFoundError:
    raise ReportError(f"{name}: no such file") from None
  except IsADirectoryError:
    raise ReportError(f"{name}: is a directory, not a report file") from None
  except UnicodeDecodeError as e:
    raise ReportError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  except OSError as e:
    raise ReportError(f"{name}: cannot be read ({e.strerror or e})") from None
  if not text.strip():
    raise ReportError(f"{name}: the file is empty, not a report (`python -m jaxaccum.bench --json FILE`)")
  try:
    report = json.loads(text)
  except json.JSONDecodeError as e:
    raise ReportError(f"{name}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
  if not isinstance(report, dict):
    raise ReportError(f"{name}: not a bench report (a JSON {type(report).__name__}, not an object)")
  if not isinstance(report.get("sections"), list):
    got = "no 'sections' key" if "sections" not in report else f"'sections' is a {type(report['sections']).__name__}"
    raise ReportError(f"{name}: not a bench report ({got}; `python -m jaxaccum.bench --json FILE` writes a list)")
  if not isinstance(report.get("header"), dict):
    raise ReportError(f"{name}: not a bench report (no 'header' object)")
  for i, r in enumerate(report["sections"]):
    missing = [k for k in ("section", "title", "markdown") if not isinstance(r, dict) or k not in r]
    if missing:
      raise ReportError(f"{name}: result {i} of 'sections' is not a bench result (no {', '.join(map(repr, missing))})")
  try:
    return figures.load(path)
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise ReportError(f"{name}: not a bench report ({type(e).__name__}: {e})") from None


def _error(message: str, code: int) -> int:
  print(f"python -m jaxaccum.bench.reproduce: error: {message}", file=sys.stderr)
  return code


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxaccum.bench.reproduce", description=__doc__.split("\n\n")[0])
  parser.add_argument("run", help="a second run: `python -m jaxaccum.bench --json RUN.json`")
  parser.add_argument(
    "--store",
    default=None,
    help="what the docs print (the store): docs/bench_results.json of a jaxaccum checkout; "
    "the default is the one beside this package's source tree",
  )
  args = parser.parse_args(argv)
  if args.store is None:
    args.store = str(figures.ROOT / figures.STORE)
    if not pathlib.Path(args.store).is_file():
      # An installed wheel ships the package, not the docs: there is no store beside it.
      return _error(
        f"no figures store at {args.store!r}: the store (docs/bench_results.json) is part of a jaxaccum "
        "source checkout, not of the installed package; pass it as --store PATH/docs/bench_results.json "
        "(git clone the release you installed, or download that file from it)",
        UNREADABLE,
      )
  try:
    printed, rerun = _load(args.store, "store"), _load(args.run, "run")
  except ReportError as e:
    return _error(str(e), UNREADABLE)
  for what, path, results in (("store", args.store, printed), ("run", args.run, rerun)):
    if not results:
      return _error(f"nothing compared: {what} {path!r} holds no results (its 'sections' is empty)", NOTHING_COMPARED)
  refuse, warn = _mismatch(printed, rerun)
  if refuse:
    parser.error(
      f"run={args.run!r} measures other sizes than the store ({len(refuse)} results, e.g. {refuse[0]}): "
      "compare a full run (no --quick) with a full run"
    )
  for line in warn:
    print("warning: " + line)
  total, missed, flips, one_side = compare(printed, rerun)
  for line in missed:
    print("NOT REPRODUCED " + line)
  for line in flips:
    print("verdict flip " + line)
  for line in one_side:
    print(line)
  print(
    f"timing medians inside the printed range: {total['inside']} of {total['inside'] + total['outside']}; "
    f"deterministic figures equal: {total['equal']} of {total['equal'] + total['differ']}; "
    f"verdict flips: {len(flips)}"
  )
  if missed:
    return 1
  if not sum(total.values()):
    common = len(set(printed) & set(rerun))
    why = "no result id in common" if not common else f"the {common} results in common hold no figure"
    return _error(
      f"nothing compared: run {args.run!r} against store {args.store!r}: {why}; a check that checked nothing fails",
      NOTHING_COMPARED,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
