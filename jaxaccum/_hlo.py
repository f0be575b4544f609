"""Counting collectives in compiled HLO text, by instruction rather than by substring.

A plain text count of "all-reduce" also matches instruction names, metadata and
operand references; these helpers parse the instruction lines instead and know
which computation each instruction lives in, so that a test or a benchmark can
tell "one all-reduce per step" from "one all-reduce inside the loop body".
"""

from __future__ import annotations

import collections
import re

# `  %name = shape opcode(operands), attributes` (older XLA) or `  name = ...` (newer).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
    r"\b(body|condition|to_apply|calls|true_computation|false_computation|branch_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)")

# Async collectives are split into -start/-done pairs; count each start once.
_ALIASES = {
    "all-reduce-start": "all-reduce",
    "all-gather-start": "all-gather",
    "collective-permute-start": "collective-permute",
}


def parse(hlo_text: str):
  """Returns ({computation: [(opcode, called_computations)]}, entry_name)."""
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
    opcode = _ALIASES.get(m.group(2), m.group(2))
    called = []
    for kind, target in _CALLED.findall(line):
      names = target.strip("{}").split(",")
      called.extend((kind, n.strip().lstrip("%")) for n in names if n.strip())
    computations[current].append((opcode, called))
  return computations, entry


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
        if kind in ("body", "condition"):
          sub = "loop"
        elif kind in ("true_computation", "false_computation", "branch_computations"):
          sub = context if context == "loop" else "branch"
        else:
          sub = context
        visit(target, sub, seen)

  if entry is not None:
    visit(entry, "top", set())
  return where
