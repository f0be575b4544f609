"""Counting collectives in compiled HLO text, by instruction rather than by substring.

A plain text count of "all-reduce" also matches instruction names, metadata and
operand references; these helpers parse the instruction lines instead and know
which computation each instruction lives in, so that a test or a benchmark can
tell "one all-reduce per step" from "one all-reduce inside the loop body".
`collectives` also reads each collective's replica groups (to tell mesh axes
apart, see `mesh_groups`) and its bytes (to sum what a step sends).
"""

from __future__ import annotations

import collections
import re

import numpy as np

# `  %name = shape opcode(operands), attributes` (older XLA) or `  name = ...` (newer).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
  r"\b(body|condition|to_apply|calls|true_computation|false_computation|branch_computations)="
  r"(\{[^}]*\}|%?[\w.\-]+)"
)

# Async collectives are split into -start/-done pairs; count each start once.
_ALIASES = {
  "all-reduce-start": "all-reduce",
  "all-gather-start": "all-gather",
  "collective-permute-start": "collective-permute",
}


def _instructions(hlo_text: str):
  """({computation: [(opcode as written, result type, line, called computations)]}, entry name)."""
  computations: dict[str, list] = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m and "=" not in line.split("(")[0]:
        current = m.group(2)
        computations[current] = []
        if m.group(1):
          entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    called: list[tuple[str, str]] = []
    for kind, target in _CALLED.findall(line):
      names = target.strip("{}").split(",")
      called.extend((kind, n.strip().lstrip("%")) for n in names if n.strip())
    computations[current].append((m.group(2), m.group(1), line, called))
  return computations, entry


def _sub_context(kind: str, context: str) -> str:
  """Where a computation called as `kind` from `context` runs: "loop", "branch" or the caller's context."""
  if kind in ("body", "condition"):
    return "loop"
  if kind in ("true_computation", "false_computation", "branch_computations"):
    return context if context == "loop" else "branch"
  return context


def all_reduce_sizes(hlo_text: str) -> tuple[int, int]:
  """(all-reduce instructions, total elements of their results) anywhere in the module (async pairs once)."""
  count, elements = 0, 0
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m or _ALIASES.get(m.group(2), m.group(2)) != "all-reduce":
      continue
    count += 1
    for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1)):
      elements += int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
  return count, elements


def parse(hlo_text: str):
  """Returns ({computation: [(opcode, called_computations)]}, entry_name)."""
  computations, entry = _instructions(hlo_text)
  return {
    name: [(_ALIASES.get(opcode, opcode), called) for opcode, _, _, called in body]
    for name, body in computations.items()
  }, entry


def count(hlo_text: str, opcode: str = "all-reduce") -> int:
  """Number of `opcode` instructions anywhere in the module (async pairs counted once)."""
  computations, _ = parse(hlo_text)
  return sum(op == opcode for instrs in computations.values() for op, _ in instrs)


def locate(hlo_text: str, opcode: str = "all-reduce") -> collections.Counter:
  """Counts `opcode` instructions by where they run, reachable from the entry computation.

  Returns a Counter with keys "top" (straight-line code, run once per call),
  "loop" (inside a while body or condition: run once per iteration) and
  "branch" (inside a conditional branch, not in a loop: run only when taken).
  """
  computations, entry = parse(hlo_text)
  where: collections.Counter = collections.Counter()

  def visit(name, context, seen):
    if name not in computations or (name, context) in seen:
      return
    seen.add((name, context))
    for op, called in computations[name]:
      if op == opcode:
        where[context] += 1
      for kind, target in called:
        sub = _sub_context(kind, context)
        visit(target, sub, seen)

  if entry is not None:
    visit(entry, "top", set())
  return where


# --------------------------------------------------------------------------- collectives with shapes and groups

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[0-9,\s]*\},?\s*)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")


class Collective(collections.namedtuple("Collective", "opcode where groups result_bytes operand_bytes ring_bytes")):
  """One collective instruction of a compiled module.

  `where`: "top", "loop" or "branch" as in `locate`. `groups`: a frozenset of
  frozensets of logical device ids (positions in the mesh's device order), or
  None when the instruction names no groups (all devices). `result_bytes`,
  `operand_bytes`: bytes of the result and of the operand(s) on one device.
  `ring_bytes`: bytes one device sends in a ring implementation:
  2 (n-1)/n of the operand for an all-reduce, (n-1)/n for a reduce-scatter,
  (n-1) x the operand for an all-gather, for groups of n devices.
  """


def _array_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    size = _BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
    if size is None:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * size
  return total


def _groups(line: str):
  m = _IOTA_GROUPS.search(line)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return frozenset(frozenset(int(i) for i in row) for row in ids.reshape(shape))
  m = _MESH_GROUPS.search(line)
  if m:  # replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: one group per value of the other axes
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    ids = ids.transpose([i for i in range(len(sizes)) if i not in over] + over)
    return frozenset(frozenset(int(i) for i in row) for row in ids.reshape(-1, int(np.prod([sizes[i] for i in over]))))
  m = _LIST_GROUPS.search(line)
  if m and m.group(1).strip():
    rows = re.findall(r"\{([0-9,\s]*)\}", m.group(1))
    return frozenset(frozenset(int(i) for i in row.split(",") if i.strip()) for row in rows)
  return None


def collectives(hlo_text: str, num_devices: int | None = None) -> list[Collective]:
  """Every collective instruction reachable from the entry, with where it runs, its groups and bytes.

  Async `-start`/`-done` pairs count once (at the start). `num_devices` sizes
  the group of an instruction that names none (default: the largest id seen + 1).
  """
  computations, entry = _instructions(hlo_text)

  found: list = []
  seen: set = set()

  def visit(name, context):
    if name not in computations or (name, context) in seen:
      return
    seen.add((name, context))
    for opcode, result, line, called in computations[name]:
      base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
      if base in COLLECTIVES and not opcode.endswith("-done"):
        out = _ARRAY.findall(result)
        # An async start returns (operands..., results...): the result is the last array.
        result_bytes = _array_bytes(result) if base == opcode else _array_bytes("{}[{}]".format(*out[-1])) if out else 0
        found.append((base, context, _groups(line), result_bytes))
      for kind, target in called:
        sub = _sub_context(kind, context)
        visit(target, sub)

  if entry is not None:
    visit(entry, "top")
  biggest = max((max(max(g) for g in groups) + 1 for _, _, groups, _ in found if groups), default=1)
  n_all = num_devices or biggest
  out = []
  for opcode, where, groups, result_bytes in found:
    n = len(next(iter(groups))) if groups else n_all
    if opcode == "reduce-scatter":
      operand, ring = result_bytes * n, result_bytes * (n - 1)
    elif opcode == "all-gather":
      operand = result_bytes // n
      ring = operand * (n - 1)
    elif opcode == "all-reduce":
      operand, ring = result_bytes, 2 * (n - 1) * result_bytes / n
    else:
      operand, ring = result_bytes, result_bytes
    out.append(Collective(opcode, where, groups, result_bytes, operand, ring))
  return out


def mesh_groups(shape: tuple[int, ...], names: tuple[str, ...], axes) -> frozenset:
  """The replica groups of a collective over `axes` of a mesh of `shape` and axis `names`.

  Logical device ids are positions in the mesh's device order, as XLA numbers
  them for a `jit` over that mesh.
  """
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  ids = np.arange(int(np.prod(shape))).reshape(shape)
  moved = [names.index(a) for a in axes]
  rest = [i for i in range(len(shape)) if i not in moved]
  ids = ids.transpose(rest + moved).reshape(-1, int(np.prod([shape[i] for i in moved])))
  return frozenset(frozenset(int(i) for i in row) for row in ids)


# --------------------------------------------------------------------------- executions per call, with trip counts

# XLA records a while loop's trip count, when it knows it, in the instruction's backend config.
_TRIP = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
_BRANCH_KINDS = ("true_computation", "false_computation", "branch_computations")


def _ring(opcode: str, nbytes: int, n: int) -> float:
  """Bytes one device sends for one execution of `opcode` with a result of `nbytes` in groups of `n`."""
  if opcode == "all-gather":
    return nbytes // n * (n - 1)
  if opcode == "reduce-scatter":
    return nbytes * (n - 1)
  if opcode == "all-reduce":
    return 2 * (n - 1) * nbytes / n
  return nbytes


def _executions(hlo_text: str, branches: str) -> list[tuple[str, str, int, int]]:
  """[(opcode, instruction line, result bytes, executions per call)] of every collective reachable from the entry."""
  computations, entry = _instructions(hlo_text)
  found: list[tuple[str, str, int, int]] = []

  def visit(name, times, depth):
    if name not in computations or depth > 64:
      return
    for opcode, result, line, called in computations[name]:
      base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
      if base in COLLECTIVES and not opcode.endswith("-done"):
        arrays = _ARRAY.findall(result)
        # A synchronous collective's result may be a tuple (leaves packed into one instruction): all of it.
        # An async start returns (operands..., results...): the result is the last array.
        nbytes = _array_bytes(result) if base == opcode else _array_bytes("{}[{}]".format(*arrays[-1])) if arrays else 0
        found.append((base, line, nbytes, times))
      trip = _TRIP.search(line) if opcode == "while" else None
      for kind, target in called:
        if kind == "condition" or (kind in _BRANCH_KINDS and branches == "none"):
          continue
        visit(target, times * (int(trip.group(1)) if trip and kind == "body" else 1), depth + 1)

  if entry is not None:
    visit(entry, 1, 0)
  return found


def per_call(hlo_text: str, num_devices: int | None = None, branches: str = "all") -> dict[str, dict[str, float]]:
  """{opcode: {"count", "bytes"}}: collective executions per call and ring bytes sent per device.

  Every instruction reachable from the entry counts once per time its computation
  runs: a while body runs its known trip count times per run of the loop (nested
  loops multiply; a loop whose trip count XLA does not record counts once), a
  conditional branch once if `branches == "all"` (as if taken) and not at all if
  `branches == "none"`. Ring bytes as in `Collective.ring_bytes`.
  """
  found = [(opcode, _groups(line), nbytes, times) for opcode, line, nbytes, times in _executions(hlo_text, branches)]
  biggest = max((max(max(g) for g in groups) + 1 for _, groups, _, _ in found if groups), default=1)
  out: dict[str, dict[str, float]] = {}
  for opcode, groups, nbytes, times in found:
    n = len(next(iter(groups))) if groups else (num_devices or biggest)
    slot = out.setdefault(opcode, {"count": 0, "bytes": 0.0})
    slot["count"] += times
    slot["bytes"] += times * _ring(opcode, nbytes, n)
  return out


# --------------------------------------------------------------------------- the mesh axes a collective spans

_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,\s]*\},?\s*)*)\}")

AxisKey = str | tuple[str, ...]


def _pairs(line: str) -> list[tuple[int, int]]:
  """A collective-permute's `source_target_pairs={{0,1},{1,0}}` as [(source, target)]."""
  m = _PAIRS.search(line)
  if not m:
    return []
  rows = (row.split(",") for row in re.findall(r"\{([0-9,\s]*)\}", m.group(1)))
  return [(int(r[0]), int(r[1])) for r in rows if len(r) == 2]


def spanned_axes(opcode: str, line: str, coords: np.ndarray, names: tuple[str, ...]) -> AxisKey:
  """The mesh axes along which the devices of one collective's groups differ.

  `coords[i]` is the mesh coordinate of logical device id `i` (the ids XLA's
  replica groups name). A collective-permute's groups are its source/target
  pairs; an instruction that names no groups spans every device. Returns `()`
  when no axis varies (groups of one device), the axis name for one axis, and
  a tuple of names in mesh order for several. Raises ValueError for an id
  with no coordinate.
  """
  groups: list[list[int]]
  if opcode == "collective-permute":
    groups = [[s, t] for s, t in _pairs(line)]
  else:
    named = _groups(line)
    groups = [list(range(len(coords)))] if named is None else [sorted(g) for g in named]
  varying: set[int] = set()
  for group in groups:
    bad = [i for i in group if not 0 <= i < len(coords)]
    if bad:
      raise ValueError(
        f"mesh has {len(coords)} devices, but a {opcode} of the compiled step names device id {bad[0]}: "
        "pass the mesh the step was compiled for"
      )
    at = coords[group]
    varying.update(int(d) for d in np.flatnonzero((at != at[0]).any(axis=0)))
  axes = tuple(names[d] for d in sorted(varying))
  return axes[0] if len(axes) == 1 else axes


def per_call_by_axis(
  hlo_text: str, coords: np.ndarray, names: tuple[str, ...], num_devices: int | None = None, branches: str = "all"
) -> dict[AxisKey, dict[str, dict[str, float]]]:
  """{axes: {opcode: {"count", "bytes"}}}: `per_call` split by the mesh axes each collective spans.

  `coords` and `names` as in `spanned_axes`; an instruction that names no
  groups has `num_devices` devices (default: `len(coords)`).
  """
  out: dict[AxisKey, dict[str, dict[str, float]]] = {}
  for opcode, line, nbytes, times in _executions(hlo_text, branches):
    axes = spanned_axes(opcode, line, coords, names)
    groups = _groups(line)
    n = len(next(iter(groups))) if groups else (num_devices or len(coords))
    slot = out.setdefault(axes, {}).setdefault(opcode, {"count": 0, "bytes": 0.0})
    slot["count"] += times
    slot["bytes"] += times * _ring(opcode, nbytes, n)
  order = {name: i for i, name in enumerate(names)}

  def rank(axes: AxisKey) -> tuple[int, list[int]]:
    t = (axes,) if isinstance(axes, str) else axes
    return len(t), [order[a] for a in t]

  return {axes: out[axes] for axes in sorted(out, key=rank)}
