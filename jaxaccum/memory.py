"""Where a compiled step's peak memory goes: `ja.memory_breakdown`, read from XLA's own buffer live ranges.

`memory_analysis()` gives four totals (arguments, outputs, aliases, temporaries).
To see *which* buffers make the peak, `memory_breakdown(lowered)` compiles the
lowered step once more with XLA's dump switched on for that compile only
(`compiler_options={"xla_dump_to": ...}`, a public option of
`jax.stages.Lowered.compile`, into a temporary directory removed afterwards),
reads the live-range report XLA writes (`*after_optimizations-live-range.txt`:
the buffers alive at the scheduled peak, with their sizes) and names each
buffer by the JAX operation that made it: the `op_name` metadata of the
compiled HLO (`args[0]['layers']['w_up']` for an argument,
`jit(step)/while/body/transpose(jvp(jit(log_softmax)))/...` for a temporary).

A buffer's `kind` is one of:

- `"argument"`: an input buffer (`args[i]...`): parameters, optimizer state, the batch;
- `"gathered"`: the result of an all-gather (a gathered parameter under fsdp);
- `"collective"`: the result of another collective (a reduce-scatter, an all-reduce);
- `"loop state"`: a value as a loop body receives it or XLA's copy of a loop's carry (the parameters,
  optimizer state and accumulators as the microbatch loop carries them; a scan's stacked outputs). An
  accumulator's new value inside the loop body is a temporary;
- `"temporary"`: anything else the step computes (activations, logits, their gradients).

The figures are those of the compiler that compiled it (XLA:CPU here: it
widens bfloat16 collectives to float32, and schedules differently from the
GPU and TPU compilers), per device, and the peak is the one the compiler's
schedule reaches (it can differ from `memory_analysis()`'s total, which is the
size of the preallocated blocks).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import NamedTuple

_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):\s*$")
_LIVE = re.compile(r"^\s+(?P<name>[^\s{]+)\{(?P<index>[^}]*)\}: (?P<bytes>\d+) bytes")
# `name = shape opcode(`: a tuple shape holds spaces (`(s32[], f32[8]{0})`), an array shape none.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\S+) (?P<op>[\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')


class Buffer(NamedTuple):
  """One buffer alive at the compiled step's peak (per device)."""

  name: str  # the HLO instruction that defines it (with `{i}` for an element of a tuple)
  bytes: int
  shape: str  # its HLO shape, e.g. "f32[18,2048,16384]"
  kind: str  # "argument", "gathered", "collective", "loop state" or "temporary" (see the module docstring)
  op_name: str  # the JAX operation that made it (HLO metadata), "" where XLA recorded none


class MemoryBreakdown(NamedTuple):
  """The buffers alive at the peak of a compiled step, largest first."""

  peak_bytes: int  # their sum: the schedule's peak, per device
  buffers: list  # [Buffer], largest first

  def by_kind(self) -> dict[str, int]:
    """Bytes at the peak per kind, largest first."""
    out: dict[str, int] = {}
    for b in self.buffers:
      out[b.kind] = out.get(b.kind, 0) + b.bytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))

  def summary(self, top: int = 12) -> str:
    """A short text table: the totals per kind, then the `top` largest buffers with their JAX operation."""
    mib = lambda n: f"{n / 2**20:,.1f} MiB"
    lines = [f"peak {mib(self.peak_bytes)}: " + ", ".join(f"{k} {mib(v)}" for k, v in self.by_kind().items())]
    for b in self.buffers[:top]:
      lines.append(f"  {mib(b.bytes):>14}  {b.kind:<10}  {b.shape:<28}  {b.op_name or b.name}")
    return "\n".join(lines)


def memory_breakdown(lowered) -> MemoryBreakdown:
  """The buffers alive at the peak of `lowered` once compiled, named by the JAX operation that made each.

  Args:
    lowered: a `jax.stages.Lowered` (`jax.jit(f).lower(*args)`, `ja.make_train_step(...).lower(*args)`);
      abstract arguments (`jax.ShapeDtypeStruct`s with shardings) are enough: nothing is allocated.

  Returns:
    A `MemoryBreakdown`: `peak_bytes` and the `buffers` alive then, largest first (`.by_kind()`,
    `.summary()`). `peak_bytes` is the peak of the compiled schedule (what is alive at once); the figure
    `memory_analysis()` gives (argument + output - alias + temp, what `ja.plan_microbatches` and the bench's
    tables read) is the size of the blocks XLA preallocates, which also holds what its allocator could not
    pack, so it is at or above this one.

  Raises:
    ValueError: `lowered` is not a lowered computation, or its compiler wrote no live-range report.
  """
  if not hasattr(lowered, "compile"):
    hint = (
      "; call its .lower(...) with the arguments it is called with first (e.g. step.lower(params, opt_state, "
      "batch); from shapes alone: ja.shard_train_state on jax.ShapeDtypeStruct params)"
      if hasattr(lowered, "lower")
      else ""
    )
    raise ValueError(
      f"lowered must be a jax.stages.Lowered (jax.jit(f).lower(...)), got {type(lowered).__name__}{hint}"
    )
  where = tempfile.mkdtemp(prefix="jaxaccum-memory-")
  try:
    compiled = lowered.compile(compiler_options={"xla_dump_to": where})
    ranges = sorted(glob.glob(os.path.join(where, "*after_optimizations-live-range.txt")))
    if not ranges:
      raise ValueError(f"the compiler wrote no live-range report (files: {sorted(os.listdir(where))[:8]})")
    # The step's own module is the last (and largest) one compiled; small helper modules may come first.
    report = max(ranges, key=os.path.getsize)
    with open(report) as f:
      live = _peak_buffers(f.read())
    text = compiled.as_text() or ""
  finally:
    shutil.rmtree(where, ignore_errors=True)
  info = _instructions(text)
  buffers = []
  for name, index, size in live:
    shape, op, op_name = info.get(name, ("?", "", ""))
    if index and shape.startswith("("):
      shape = _tuple_element(shape, index)
    buffers.append(Buffer(name + (f"{{{index}}}" if index else ""), size, shape, _kind(name, op, op_name), op_name))
  buffers.sort(key=lambda b: -b.bytes)
  return MemoryBreakdown(sum(b.bytes for b in buffers), buffers)


def _peak_buffers(report: str) -> list[tuple[str, str, int]]:
  """(instruction, tuple index, bytes) of each buffer the live-range report lists at the peak."""
  out, inside = [], False
  for line in report.splitlines():
    if _PEAK.match(line):
      inside = True
      continue
    if inside:
      m = _LIVE.match(line)
      if not m:
        break
      out.append((m.group("name"), m.group("index"), int(m.group("bytes"))))
  return out


def _instructions(text: str) -> dict[str, tuple[str, str, str]]:
  """{instruction name: (shape, opcode, op_name)} over every computation of the compiled HLO."""
  out = {}
  for line in text.splitlines():
    m = _INSTR.match(line)
    if m:
      op_name = _OP_NAME.search(line)
      # The HLO text escapes the quotes of an argument's path (args[0][\\'w\\']): shown as JAX names them.
      name = op_name.group("op_name").replace("\\'", "'").replace('\\"', '"') if op_name else ""
      out[m.group("name")] = (m.group("shape"), m.group("op"), name)
  return out


def _tuple_element(shape: str, index: str) -> str:
  """The element `index` ("2" or "1,0") of a tuple shape "(f32[2], s32[], ...)"; the whole shape if unsure."""
  depth, parts, cur = 0, [], ""
  for ch in shape[1:-1]:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append(cur.strip())
      cur = ""
    else:
      cur += ch
  parts.append(cur.strip())
  first = index.split(",")[0].strip()
  if first.isdigit() and int(first) < len(parts):
    return re.sub(r"/\*index=\d+\*/", "", parts[int(first)]).strip()
  return shape


def _kind(name: str, op: str, op_name: str) -> str:
  if op == "parameter" and op_name and "/" not in op_name:
    return "argument"  # an input of the step, named by its argument path (args[0]['w'], params['w'])
  if "all-gather" in op or "all_gather" in op or "all-gather" in name or "all_gather" in name:
    return "gathered"
  if any(c in op or c in name for c in ("all-reduce", "reduce-scatter", "reduce_scatter", "collective-permute")):
    return "collective"
  if op in ("parameter", "while", "copy") or name.startswith(("wide.", "while", "copy")):
    return "loop state"
  if op_name.startswith("args"):
    return "argument"
  if "all_gather" in op_name.rsplit("/", 1)[-1]:
    return "gathered"
  return "temporary"
