"""Counting what a compiled step communicates: collectives per call, with loop trip counts.

One way to count everywhere (the bench, the guides, the notebooks): each
collective instruction of the compiled HLO, weighted by how many times its
computation runs per call of the step. An all-gather inside the microbatch
loop of K iterations counts K, inside a layer scan of L iterations inside it
K L; a plain instruction count (or a substring count of the text) would say 1.
"""

from __future__ import annotations

from typing import Any

from jaxaccum import _hlo

_BRANCHES = ("all", "none")


def _text(compiled: Any, name: str) -> str:
  if isinstance(compiled, str):
    return compiled
  as_text = getattr(compiled, "as_text", None)
  if not callable(as_text) or hasattr(compiled, "compile"):
    # A `jax.stages.Lowered` has `as_text` too, but its text is StableHLO: compile it first.
    raise TypeError(
      f"{name} must be a compiled step (`jax.jit(f).lower(...).compile()`) or its HLO text, "
      f"got {type(compiled).__name__}"
    )
  return as_text() or ""


def _check(branches: str, num_devices: int | None) -> None:
  if branches not in _BRANCHES:
    raise ValueError(f"branches must be one of {_BRANCHES}, got {branches!r}")
  if num_devices is not None and (isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1):
    raise ValueError(f"num_devices must be a positive int or None, got {num_devices!r}")


def count_collectives(compiled: Any, *, branches: str = "all") -> dict[str, int]:
  """Collective executions per call of a compiled step, by kind, with loop trip counts.

  Each collective instruction reachable from the entry computation counts
  once per time its computation runs in one call:

  $$ \\text{count}(\\text{op}) = \\sum_{i \\,:\\, \\text{opcode}(i) = \\text{op}} \\prod_{\\ell \\ni i} T_\\ell $$

  over the enclosing while loops $\\ell$ with known trip counts $T_\\ell$ (a
  `lax.scan` of K steps: K; nested loops multiply). Async `-start`/`-done`
  pairs count once. A loop whose trip count XLA does not record counts once
  per run (a lower bound).

  Example::

    compiled = step.lower(params, opt_state, batch).compile()
    ja.count_collectives(compiled)  # e.g. {"all-gather": 68, "reduce-scatter": 48, "all-reduce": 2}

  Args:
    compiled: a `jax.stages.Compiled` (`jax.jit(f).lower(...).compile()`) or
      its HLO text (`compiled.as_text()`).
    branches: `"all"` counts a collective inside a `lax.cond`/`lax.switch`
      branch as if the branch runs (an upper bound: e.g. `ja.accumulate`'s
      window-end reduction); `"none"` leaves branches out (what runs on every
      call). Their difference is what runs only when a branch is taken.

  Returns:
    `{opcode: executions per call}` for the opcodes present among
    `"all-reduce"`, `"reduce-scatter"`, `"all-gather"`, `"all-to-all"` and
    `"collective-permute"`.

  Raises:
    TypeError: `compiled` is neither a compiled step nor a string (a
      `jax.stages.Lowered` must be compiled first).
    ValueError: `branches` is not `"all"` or `"none"`.
  """
  _check(branches, None)
  found = _hlo.per_call(_text(compiled, "compiled"), branches=branches)
  return {op: int(v["count"]) for op, v in found.items()}


def collective_bytes(compiled: Any, *, num_devices: int | None = None, branches: str = "all") -> dict[str, float]:
  """Bytes one device sends per call of a compiled step, by collective kind, with loop trip counts.

  Counted as `count_collectives` does, each execution weighted by the bytes a
  ring implementation sends per device for a group of $n$ devices and a
  result of $b$ bytes: all-reduce $2 (n-1) b / n$, reduce-scatter $(n-1) b$
  (its result is the $1/n$ shard), all-gather $(n-1) b / n$, all-to-all and
  collective-permute $b$. An estimate of the wire traffic, read from the
  dtypes and shapes in the compiled HLO (XLA:CPU may widen bfloat16).

  Args:
    compiled: a `jax.stages.Compiled` or its HLO text.
    num_devices: the group size of a collective whose HLO names no replica
      groups (all devices); default: the largest device id named + 1.
    branches: `"all"` or `"none"`, as in `count_collectives`.

  Returns:
    `{opcode: ring bytes sent per device per call}`.

  Raises:
    TypeError: `compiled` is neither a compiled step nor a string.
    ValueError: a bad `branches` or `num_devices`.
  """
  _check(branches, num_devices)
  found = _hlo.per_call(_text(compiled, "compiled"), num_devices, branches=branches)
  return {op: float(v["bytes"]) for op, v in found.items()}
