"""`python -m jaxaccum.bench.figures`: the docs' figures, rewritten from the bench's JSON.

Every figure the docs print comes from one place, `python -m jaxaccum.bench --json`
(each result's "markdown" and its "tables", the same cells as structured rows).
A region of a markdown page (docs/, README.md) or of a notebook's markdown
cell is marked with HTML comments, invisible once rendered, and rewritten:

    <!-- bench:fsdp/every-strategys-per-device-peak -->
    ... the result's markdown, then its run line ...
    <!-- /bench -->

The run line names the command, the commit, the date and time (UTC), the
machine, the jax version and the load average before and after the section
(`run_text`). The id is the section and the slug of the result's title
(`result_id`). Options after the id select part of a result:

- `table=N`: only its N-th table (from 1), with the run line;
- `cols="a;b"`: only those columns (by header), `rows="x;y"`: only the rows
  whose first cell is one of them (both imply a table, default the first);
- `row="listed;4;(c) jaxaccum fsdp once" col="peak (MiB)"`: one cell, inline
  (a row is chosen by its leading cells), for a figure in running text or in
  a table's cell (hence `;`, not `|`, between names); it carries its run line
  as a tooltip (`<span title="From ...">`).

The figures live in one store, docs/bench_results.json (every result the docs
print, each with its run's header and a hash of the code it measured).
`--json report.json` merges a fresh bench report into it (a run of a few
sections replaces those), drops the entries no page shows, then every page is
rewritten from it. `--check` rewrites nothing and exits 1 on anything
`problems` finds: a region unlike the store or without an entry, an entry no
page shows, an entry older than the code it measures, a figure or a target
verdict typed outside a region. `--verify fast|full` recomputes the
deterministic results (compiled memory, collective counts, HLO bytes: the same
for a given jax/XLA on any machine) and exits 1 when a page prints other
figures (tests/test_figures.py); `--refresh fast|full` stores those recomputed
results and rewrites the pages, without a timing run.
"""

from __future__ import annotations

import argparse
import html
import json
import pathlib
import re
import shlex
import sys
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Where regions may live: the docs' pages, the README, the notebooks' markdown cells.
# (docs/notebooks is a link to notebooks/: each notebook is rewritten once.)
PAGES = ("README.md", "docs/*.md", "docs/guides/*.md", "notebooks/*.ipynb")
STORE = "docs/bench_results.json"  # every result the docs print, each with its run's header

_REGION = re.compile(r"<!-- bench:(?P<id>[\w\-/]+)(?P<opts>[^>]*?)-->(?P<body>.*?)<!-- /bench -->", re.S)


# --------------------------------------------------------------------------- results as structured data


def slug(text: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("'", "").replace("`", "")).strip("-")


def result_id(section: str, title: str) -> str:
  """`section/slug of the title` without the title's "section:" prefix: `fsdp/every-strategys-per-device-peak`."""
  head, _, rest = title.partition(":")
  return f"{section}/{slug(rest if rest and slug(head) == slug(section) else title)}"


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(markdown: str) -> list[dict]:
  """The markdown tables of a result as `{"columns": [...], "rows": [[cell, ...], ...]}`, cells as printed."""
  out: list[dict] = []
  lines = markdown.splitlines()
  i = 0
  while i < len(lines):
    if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\s*\|[\s:|\-]+\|\s*", lines[i + 1]):
      columns = _cells(lines[i])
      rows = []
      i += 2
      while i < len(lines) and lines[i].lstrip().startswith("|"):
        rows.append(_cells(lines[i]))
        i += 1
      out.append({"columns": columns, "rows": rows, "align": _cells(lines[i - len(rows) - 1])})
    else:
      i += 1
  return out


def structured(section: str, result: dict) -> dict:
  """The result with its `id` and `tables` (structured rows) added where the section did not give them."""
  result = dict(result)
  result.setdefault("id", result_id(section, result["title"]))
  result.setdefault("tables", tables(result["markdown"]))
  return result


# --------------------------------------------------------------------------- rendering a region


def _options(text: str) -> dict[str, str]:
  opts = {}
  for word in shlex.split(text):
    key, sep, value = word.partition("=")
    if not sep or key not in ("table", "cols", "rows", "row", "col"):
      raise ValueError(f"bench region option {word!r}: expected table=, cols=, rows=, row= or col=")
    opts[key] = value
  return opts


def run_text(header: dict, section: str) -> str:
  """The run a figure comes from, as plain text: command, commit, date and time (UTC), machine, jax, load average."""
  unknown = "not recorded"
  load = header.get("load")
  after = header.get("load_after")
  fmt = lambda la: "/".join(f"{x:.2f}" for x in la)
  load_text = f"load average {fmt(load)}" + (f" to {fmt(after)}" if after else "") if load else f"load {unknown}"
  return (
    f"python -m jaxaccum.bench --sections {section} at commit {header.get('commit', unknown)}, {header['date']} "
    f"{header.get('time', '(time ' + unknown + ')')}, {header['backend']} ({header['machine']}), jax {header['jax']}, "
    f"{load_text}{', quick' if header.get('quick') else ''}"
  )


def run_line(header: dict, section: str) -> str:
  """The line under a block: which run measured it (`run_text`)."""
  return f"<sub>From `{run_text(header, section)}`; rewritten by `python -m jaxaccum.bench.figures`.</sub>"


_CELL = re.compile(r'<span title="From [^"]*">(?P<value>.*?)</span>', re.S)


def cell_value(text: str) -> str:
  """An inline cell's figure without its run line."""
  m = _CELL.fullmatch(text)
  return m.group("value") if m else text


def _table_markdown(table: dict, cols: list[str] | None, rows: list[str] | None) -> str:
  columns, align = table["columns"], table["align"]
  keep = list(range(len(columns)))
  if cols:
    missing = [c for c in cols if c not in columns]
    if missing:
      raise KeyError(f"columns {missing} not in {columns}")
    keep = [columns.index(c) for c in cols]
  body = table["rows"]
  if rows:
    missing = [r for r in rows if r not in [row[0] for row in body]]
    if missing:
      raise KeyError(f"rows {missing} not among {[row[0] for row in body]}")
    body = [row for row in body if row[0] in rows]
  line = lambda cells: "| " + " | ".join(cells[i] if i < len(cells) else "" for i in keep) + " |"
  return "\n".join([line(columns), "|" + "|".join(align[i] for i in keep) + "|"] + [line(r) for r in body])


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _escape_brackets(markdown: str) -> str:
  """Table rows with `][` written `]\\[` outside code spans: a cell like `params['w']['b']` is data, while
  markdown reads `[text][ref]` as a link reference (mkdocs --strict refuses an unresolved one)."""

  def row(line: str) -> str:
    if not line.startswith("|"):
      return line
    return "".join(p if p.startswith("`") else p.replace("][", "]\\[") for p in _CODE_SPAN.split(line))

  return "\n".join(row(line) for line in markdown.split("\n"))


def render(result: dict, opts: dict[str, str]) -> str:
  """What a region with these options holds (inline text for a cell, a block otherwise)."""
  if "row" in opts or "col" in opts:
    if not ("row" in opts and "col" in opts):
      raise ValueError(f"{result['id']}: a cell needs both row= and col=, got {opts}")
    table = result["tables"][int(opts.get("table", "1")) - 1]
    want = opts["row"].split(";")
    found = [r for r in table["rows"] if r[: len(want)] == want]
    if len(found) != 1:
      raise KeyError(f"{result['id']}: {len(found)} rows start with {want}")
    if opts["col"] not in table["columns"]:
      raise KeyError(f"{result['id']}: column {opts['col']!r} not in {table['columns']}")
    value = found[0][table["columns"].index(opts["col"])]
    # The run line rides along in a tooltip: inline cells sit in running text and in table cells.
    return f'<span title="From {html.escape(run_text(result["header"], result["section"]))}">{value}</span>'
  if opts:
    table = result["tables"][int(opts.get("table", "1")) - 1]
    split = lambda key: opts[key].split(";") if key in opts else None
    text = _table_markdown(table, split("cols"), split("rows"))
  else:
    text = result["markdown"]
  text = _escape_brackets(text)
  # Blank lines around the block: a marker line directly above a table would make it part of an HTML block.
  return f"\n\n{text}\n\n{run_line(result['header'], result['section'])}\n\n"


def regions(text: str) -> Iterable[re.Match]:
  return _REGION.finditer(text)


def rewrite(text: str, results: dict[str, dict], where: str = "") -> tuple[str, list[str]]:
  """(the text with every region whose id is in `results` rewritten, [ids of regions it changed])."""
  changed: list[str] = []

  def one(m: re.Match) -> str:
    rid = m.group("id")
    if rid not in results:
      return m.group(0)
    body = render(results[rid], _options(m.group("opts")))
    if body != m.group("body"):
      changed.append(f"{where}: {rid}{m.group('opts').rstrip()}")
    return f"<!-- bench:{rid}{m.group('opts')}-->{body}<!-- /bench -->"

  return _REGION.sub(one, text), changed


def _notebook_rewrite(raw: str, results, where) -> tuple[str, list[str]]:
  nb = json.loads(raw)
  changed: list[str] = []
  for cell in nb["cells"]:
    if cell["cell_type"] != "markdown":
      continue
    source = "".join(cell["source"])
    new, ch = rewrite(source, results, where)
    if ch:
      cell["source"] = new.splitlines(keepends=True)
      changed += ch
  # The notebooks' own layout (nbformat's: one-space indent, a final newline), so a rewrite is a small diff.
  return json.dumps(nb, indent=1, ensure_ascii=False) + "\n", changed


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  return sorted({p for pattern in PAGES for p in root.glob(pattern)})


def load(path: str | pathlib.Path) -> dict[str, dict]:
  """{id: result} of a `python -m jaxaccum.bench --json` report (or of the store), each with its run's header."""
  report = json.loads(pathlib.Path(path).read_text())
  results = {}
  for r in report["sections"]:
    r = structured(r["section"], r)
    r.setdefault("header", report["header"])
    results[r["id"]] = r
  return results


def merge(store: dict[str, dict], new: dict[str, dict]) -> dict[str, dict]:
  """The store with `new`'s results in place of those with the same id (a run of a few sections updates those)."""
  return {**store, **new}


def save(results: dict[str, dict], path: str | pathlib.Path) -> None:
  latest: dict = max((r["header"] for r in results.values()), key=lambda h: (h["date"], h.get("time", "")), default={})
  report = {"header": latest, "sections": list(results.values())}
  pathlib.Path(path).write_text(json.dumps(report, indent=1, default=float) + "\n")


def update(results: dict[str, dict], root: pathlib.Path = ROOT, write: bool = True) -> list[str]:
  """Rewrites (or, write=False, only compares) every page's regions; returns what differs."""
  changed: list[str] = []
  for path in pages(root):
    raw = path.read_text()
    if "<!-- bench:" not in raw:
      continue
    where = str(path.relative_to(root))
    if path.suffix == ".ipynb":
      new, ch = _notebook_rewrite(raw, results, where)
    else:
      new, ch = rewrite(raw, results, where)
    changed += ch
    if write and new != raw:
      path.write_text(new)
  return changed


def unknown_regions(results: dict[str, dict], root: pathlib.Path = ROOT) -> list[str]:
  """Regions whose id no result has (a renamed title, a section left out of the run)."""
  out = []
  for path in pages(root):
    for m in regions(path.read_text()):
      if m.group("id") not in results:
        out.append(f"{path.relative_to(root)}: {m.group('id')}")
  return out


# --------------------------------------------------------------------------- what --check refuses

# Figures typed by hand are refused on the markdown pages (not in notebooks, whose tables their own code
# cells print): a decimal number with a unit the bench prints (x, %, ms, MiB) outside a region and a fenced
# code block, unless a bound precedes it (a target: "<= 1.05x", "~ 3.8x") or its paragraph says why it is
# typed with an HTML comment `<!-- typed: why -->` (arithmetic on paper, say).
MARKDOWN_PAGES = ("README.md", "docs/*.md", "docs/guides/*.md")
_FIGURE = re.compile(r"(?<![\w.])[-+]?\d+\.\d+\s?(?:x|%|ms|MiB)(?!\w)")
_BOUND_BEFORE = re.compile(r"(?:<=|>=|<|>|≤|≥|~|≈|&lt;=|&lt;|&gt;)\s*$")
# Phrases that compare a measurement with its target: they must come from a region (a verdict cell), where
# the bench decides them from the spread ("within noise" when the min-max range of its rounds straddles the bound).
# "within noise" counts in a sentence that names a target (elsewhere it may compare two rows of a table).
_VERDICT = re.compile(
  r"\b(?:not met|(?:is|are|was|were|be) met|met only|targets? (?:is |are )?met|"
  r"meets? (?:the|its|their|every) targets?|miss(?:es)? (?:the|its|their) targets?)\b"
  r"|\bwithin noise\b(?=[^.;]*\btargets?\b)|\btargets?\b[^.;]*\bwithin noise\b",
  re.I,
)


def _blanked(text: str) -> str:
  """The text with regions and fenced code blocks blanked (newlines kept, so line numbers stay)."""
  blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))
  return re.sub(r"^```.*?^```", blank, _REGION.sub(blank, text), flags=re.S | re.M)


def _typed(pattern: re.Pattern, what: str, root: pathlib.Path, paths=None) -> list[str]:
  out = []
  for path in paths if paths is not None else sorted({p for g in MARKDOWN_PAGES for p in root.glob(g)}):
    text = _blanked(path.read_text())
    offset = 0
    for paragraph in re.split(r"(\n\s*\n)", text):
      if "<!-- typed:" not in paragraph:
        for m in pattern.finditer(paragraph):
          if what == "figure" and _BOUND_BEFORE.search(paragraph[: m.start()]):
            continue
          line = text.count("\n", 0, offset + m.start()) + 1
          out.append(f"{path.relative_to(root)}:{line}: {what} {m.group(0)!r} typed outside a bench region")
      offset += len(paragraph)
  return out


def typed_figures(root: pathlib.Path = ROOT, paths=None) -> list[str]:
  """Measured-looking figures typed by hand on the markdown pages (see `_FIGURE`), as "path:line: ..."."""
  return _typed(_FIGURE, "figure", root, paths)


def typed_verdicts(root: pathlib.Path = ROOT, paths=None) -> list[str]:
  """Target verdicts ("met", "not met", "within noise") typed by hand: prose must take them from a region."""
  return _typed(_VERDICT, "verdict", root, paths)


def unreferenced(results: dict[str, dict], root: pathlib.Path = ROOT) -> list[str]:
  """Store entries no page shows (a region removed or renamed): the store holds what the docs print, nothing else."""
  shown = set()
  for path in pages(root):
    shown |= {m.group("id") for m in regions(path.read_text())}
  return sorted(set(results) - shown)


def stale(results: dict[str, dict]) -> list[str]:
  """Entries measured on other code than the checkout's: the hash stored with each (`bench.code_hash`) differs."""
  from jaxaccum.bench import code_hash, measured_files  # noqa: PLC0415

  out = []
  for rid, r in sorted(results.items()):
    if "code" in r and r["code"] != code_hash(r["section"]):
      files = ", ".join(str(p.relative_to(ROOT)) for p in measured_files(r["section"]))
      out.append(
        f"{rid}: measured at commit {r['header'].get('commit', '?')}; the code it measures ({files}) has changed "
        f"since: rerun `python -m jaxaccum.bench --sections {r['section']}`"
      )
  return out


def unstamped(results: dict[str, dict]) -> list[str]:
  """Entries from runs before run lines named the commit, the time and the load (a warning: rerun to stamp them)."""
  return sorted(rid for rid, r in results.items() if not {"commit", "time", "load"} <= set(r["header"]))


def problems(results: dict[str, dict], root: pathlib.Path = ROOT) -> list[str]:
  """Everything `--check` refuses: regions unlike the store or without an entry, entries no page shows, entries
  older than the code they measure, figures and target verdicts typed outside a region."""
  out = [f"differs from the store: {c}" for c in update(results, root, write=False)]
  out += [f"no result in the store for the region {r}" for r in unknown_regions(results, root)]
  out += [f"store entry no page references: {r}" for r in unreferenced(results, root)]
  out += [f"stale: {r}" for r in stale(results)]
  out += typed_figures(root) + typed_verdicts(root)
  return out


# --------------------------------------------------------------------------- deterministic figures, recomputed

# (section module, function(quick) returning one result or a list, "fast" or "full", columns to compare or None: all).
# Compiled memory, collective counts and HLO bytes: the same for a given jax/XLA on any machine, so a page
# that prints another figure is stale. "fast" runs in the default tests (about a minute of compiles);
# "full" (every deterministic table, several minutes of compiles) in the slow test and CI.
DETERMINISTIC = (
  ("accumulate", "_state_memory", "fast", None),
  ("microbatch", "_all_reduces", "fast", None),
  ("grad", "run", "fast", None),
  ("lowcomm", "run", "full", None),
  ("microbatch", "_memory", "full", None),
  ("sharded", "run", "full", None),
  ("fsdp", "run", "full", None),
  ("per_example", "run", "full", ("memory MiB",)),
  ("fit", "run", "full", None),
)


def recompute(level: str = "fast", sections: Iterable[str] | None = None) -> dict[str, tuple[dict, tuple | None]]:
  """{id: (fresh result, columns to compare)} of the deterministic results at `level` ("fast" or "full"), of
  `sections` only when given."""
  import importlib  # noqa: PLC0415

  known = {entry[0] for entry in DETERMINISTIC}
  if sections is not None:
    sections = set(sections)
    if not sections or sections - known:
      raise ValueError(f"{sorted(sections)=} must name sections with deterministic figures: {sorted(known)}")
  out = {}
  for section, name, cost, cols in DETERMINISTIC:
    if (level == "fast" and cost != "fast") or (sections is not None and section not in sections):
      continue
    got = getattr(importlib.import_module(f"jaxaccum.bench.{section}"), name)(quick=False)
    for r in got if isinstance(got, list) else [got]:
      r = structured(section, {"section": section, **r})
      out[r["id"]] = (r, cols)
  return out


def _compare(region: re.Match, fresh: dict, cols: tuple | None, where: str) -> list[str]:
  """Where a region's figures differ from a fresh result (only the columns `cols` when given)."""
  opts = _options(region.group("opts"))
  have = region.group("body")
  if "row" in opts:
    if cols and opts["col"] not in cols:
      return []
    have, want = cell_value(have), cell_value(render({**fresh, "header": _NO_HEADER}, opts))
    return [] if have == want else [f"{where}: {fresh['id']} {opts}: the page says {have!r}, the bench {want!r}"]
  if cols is None and not opts:  # the whole result: prose and tables alike (the run line aside)
    strip = lambda text: re.sub(r"<sub>From .*?</sub>", "", text, flags=re.S).strip()
    same = strip(have) == strip(_escape_brackets(fresh["markdown"]))  # as `render` wrote it on the page
    return [] if same else [f"{where}: {fresh['id']}: the page differs from the bench:\n{fresh['markdown']}"]
  page_tables = tables(have)
  fresh_tables = tables(render({**fresh, "header": _NO_HEADER}, opts))
  out = []
  for on_page, from_bench in zip(page_tables, fresh_tables, strict=False):
    keep = [c for c in from_bench["columns"] if cols is None or c in cols]
    for c in keep:
      if c not in on_page["columns"]:
        out.append(f"{where}: {fresh['id']}: column {c!r} missing from the page")
        continue
      g = [row[on_page["columns"].index(c)] for row in on_page["rows"]]
      w = [row[from_bench["columns"].index(c)] for row in from_bench["rows"]]
      if g != w:
        out.append(f"{where}: {fresh['id']} {c!r}: the page says {g}, the bench {w}")
  if len(page_tables) != len(fresh_tables):
    out.append(f"{where}: {fresh['id']}: {len(page_tables)} tables on the page, {len(fresh_tables)} from the bench")
  return out


_NO_HEADER = {"date": "", "backend": "", "machine": "", "jax": ""}


def verify(level: str = "fast", root: pathlib.Path = ROOT, sections: Iterable[str] | None = None) -> list[str]:
  """Every page region showing a deterministic result (of `sections` when given), compared with the bench at
  HEAD; [differences]."""
  fresh = recompute(level, sections)
  out = []
  for path in pages(root):
    text = path.read_text()
    where = str(path.relative_to(root))
    sources = [text]
    if path.suffix == ".ipynb":
      sources = ["".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "markdown"]
    for source in sources:
      for m in regions(source):
        if m.group("id") in fresh:
          result, cols = fresh[m.group("id")]
          out += _compare(m, result, cols, where)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxaccum.bench.figures", description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", help="a fresh `python -m jaxaccum.bench --json` report to merge into the store first")
  parser.add_argument("--store", default=str(ROOT / STORE), help=f"the figures the docs print (default {STORE})")
  parser.add_argument(
    "--check",
    action="store_true",
    help="change nothing; exit 1 if a page differs from the store, a store entry is unreferenced or stale, or a "
    "page types a figure or a target verdict outside a region",
  )
  parser.add_argument("--root", default=str(ROOT), help="the checkout whose pages are read (default: this one)")
  parser.add_argument(
    "--verify",
    choices=("fast", "full"),
    help="recompute the deterministic results (fast: the small tables; full: all) and exit 1 if a page differs",
  )
  parser.add_argument(
    "--sections",
    help="with --verify or --refresh: only these comma-separated sections (the slow test checks one at a time)",
  )
  parser.add_argument(
    "--refresh",
    choices=("fast", "full"),
    help="recompute the deterministic results, merge them into the store and rewrite the pages (no timing run)",
  )
  args = parser.parse_args(argv)
  only = None if args.sections is None else [s for s in args.sections.split(",") if s]
  if only is not None:
    if not (args.verify or args.refresh):
      parser.error("--sections goes with --verify or --refresh")
    unknown = sorted(set(only) - {entry[0] for entry in DETERMINISTIC})
    if unknown or not only:
      parser.error(f"--sections {args.sections!r}: choose from {sorted({entry[0] for entry in DETERMINISTIC})}")
  if args.verify or args.refresh:
    from jaxaccum.bench import _setup_devices, run_header  # noqa: PLC0415

    _setup_devices(8)
  if args.refresh:
    header = run_header(quick=False)
    from jaxaccum.bench import code_hash  # noqa: PLC0415

    recomputed = recompute(args.refresh, only)
    fresh = {rid: {**r, "header": header, "code": code_hash(r["section"])} for rid, (r, _) in recomputed.items()}
    save(merge(load(args.store) if pathlib.Path(args.store).exists() else {}, fresh), args.store)
  if args.verify:
    differences = verify(args.verify, sections=only)
    for line in differences:
      print(line)
    print(f"{len(differences)} deterministic figure(s) differ from the bench at HEAD ({args.verify})")
    return 1 if differences else 0
  root = pathlib.Path(args.root).resolve()
  results = load(args.store) if pathlib.Path(args.store).exists() or args.check else {}
  if args.check:
    if args.json:
      parser.error("--check compares the pages with the store: run it without --json")
    found = problems(results, root)
    for line in found:
      print(line, file=sys.stderr)
    warn = unstamped(results)
    if warn:
      print(
        f"warning: {len(warn)} entries come from runs without a commit, time and load in their run line",
        file=sys.stderr,
      )
    if found:
      print(f"{len(found)} problem(s): see docs/benchmarks.md, 'How the figures are kept'", file=sys.stderr)
      return 1
    return 0
  if args.json:
    results = merge(results, load(args.json))
  dropped = unreferenced(results, root)
  for rid in dropped:  # the store holds what the pages print
    print(f"dropped from the store (no page shows it): {rid}")
    del results[rid]
  if args.json or dropped:
    save(results, args.store)
  for line in update(results, root):
    print("rewritten: " + line)
  for line in unknown_regions(results, root):
    print(f"no result in {args.store} for the region {line}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
