"""Counting what a compiled step communicates: collectives per call, with loop trip counts.

One way to count everywhere (the bench, the guides, the notebooks): each
collective instruction of the compiled HLO, weighted by how many times its
computation runs per call of the step. An all-gather inside the microbatch
loop of K iterations counts K, inside a layer scan of L iterations inside it
K L; a plain instruction count (or a substring count of the text) would say 1.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import jax
import numpy as np

from jaxaccum import _hlo

_BRANCHES = ("all", "none")

AxisKey = _hlo.AxisKey
"""A mesh axis name (`"data"`), a tuple of names in mesh order (`("data", "model")`), or `()`."""


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


def _mesh_coords(compiled: Any, by_axis: bool, mesh: Any) -> np.ndarray | None:
  """Mesh coordinates of each logical device id of `compiled` (None unless `by_axis`)."""
  if not isinstance(by_axis, bool):
    raise ValueError(f"by_axis must be True or False, got {by_axis!r}")
  if not by_axis:
    if mesh is not None:
      raise ValueError("mesh is only read with by_axis=True: pass by_axis=True to split the counts by mesh axis")
    return None
  if not isinstance(mesh, jax.sharding.Mesh):
    got = "no mesh" if mesh is None else type(mesh).__name__
    raise ValueError(
      f"by_axis=True needs mesh=, the jax.sharding.Mesh the step was compiled over (with its devices), got {got}"
    )
  devices = np.asarray(mesh.devices)
  position = {int(d.id): np.unravel_index(k, devices.shape) for k, d in enumerate(devices.flat)}
  # XLA's replica groups name logical ids: positions in the executable's device assignment. A jit over
  # the mesh assigns its devices in mesh order; a compiled step says which devices it was given.
  ids = [int(d.id) for d in devices.flat]
  if not isinstance(compiled, str):
    try:
      assigned = [int(d.id) for d in compiled.runtime_executable().local_devices()]
    except Exception:  # noqa: BLE001 - no assignment to read (another backend or stage): keep mesh order
      assigned = []
    if len(assigned) == devices.size:
      ids = assigned
  missing = [i for i in ids if i not in position]
  if missing:
    raise ValueError(f"the compiled step runs on device {missing[0]}, which mesh does not hold: pass its own mesh")
  return np.array([position[i] for i in ids], dtype=np.int64).reshape(len(ids), devices.ndim)


@overload
def count_collectives(
  compiled: Any, *, branches: str = ..., by_axis: Literal[False] = ..., mesh: None = ...
) -> dict[str, int]: ...


@overload
def count_collectives(
  compiled: Any, *, branches: str = ..., by_axis: Literal[True], mesh: jax.sharding.Mesh
) -> dict[AxisKey, dict[str, int]]: ...


@overload
def count_collectives(
  compiled: Any, *, branches: str = ..., by_axis: bool, mesh: jax.sharding.Mesh | None = ...
) -> dict[str, int] | dict[AxisKey, dict[str, int]]: ...


def count_collectives(
  compiled: Any, *, branches: str = "all", by_axis: bool = False, mesh: jax.sharding.Mesh | None = None
) -> dict[str, int] | dict[AxisKey, dict[str, int]]:
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
    ja.count_collectives(compiled, by_axis=True, mesh=mesh)
    # e.g. {"data": {"all-reduce": 1}, "model": {"all-gather": 24, "all-reduce": 24}}

  With `by_axis=True` the same counts are split by the mesh axes each
  collective runs over: the axes along which the devices of its replica
  groups (a collective-permute: its source/target pairs) differ, read from the
  device ids in the HLO and `mesh.devices`. The result is
  `{axes: {opcode: executions}}`, where `axes` is one axis name (`"data"`), a
  tuple of names in mesh order (`("data", "model")`: one collective over both)
  or `()` (groups of one device); keys are ordered by number of axes, then
  mesh order. `result["data"]` is what the data axis carries, and summing over
  the axes gives the `by_axis=False` result. An instruction whose groups differ
  in their axes counts under the union of them.

  Args:
    compiled: a `jax.stages.Compiled` (`jax.jit(f).lower(...).compile()`) or
      its HLO text (`compiled.as_text()`).
    branches: `"all"` counts a collective inside a `lax.cond`/`lax.switch`
      branch as if the branch runs (an upper bound: e.g. `ja.accumulate`'s
      window-end reduction); `"none"` leaves branches out (what runs on every
      call). Their difference is what runs only when a branch is taken.
    by_axis: split the counts by the mesh axes each collective spans
      (needs `mesh`).
    mesh: with `by_axis=True`, the `jax.sharding.Mesh` the step was compiled
      over (a compiled step's device assignment maps its logical ids to
      devices; for HLO text, logical id `i` is `mesh.devices.flat[i]`).

  Returns:
    `{opcode: executions per call}` for the opcodes present among
    `"all-reduce"`, `"reduce-scatter"`, `"all-gather"`, `"all-to-all"` and
    `"collective-permute"`; with `by_axis=True`, `{axes: {opcode: executions
    per call}}`.

  Raises:
    TypeError: `compiled` is neither a compiled step nor a string (a
      `jax.stages.Lowered` must be compiled first).
    ValueError: `branches` is not `"all"` or `"none"`; `by_axis=True` without
      a `jax.sharding.Mesh` as `mesh` (or a mesh without by_axis), or a mesh
      that does not hold the devices the step names.
  """
  _check(branches, None)
  text = _text(compiled, "compiled")
  coords = _mesh_coords(compiled, by_axis, mesh)
  if coords is not None and mesh is not None:
    split = _hlo.per_call_by_axis(text, coords, tuple(mesh.axis_names), branches=branches)
    return {axes: {op: int(v["count"]) for op, v in ops.items()} for axes, ops in split.items()}
  found = _hlo.per_call(text, branches=branches)
  return {op: int(v["count"]) for op, v in found.items()}


@overload
def collective_bytes(
  compiled: Any,
  *,
  num_devices: int | None = ...,
  branches: str = ...,
  by_axis: Literal[False] = ...,
  mesh: None = ...,
) -> dict[str, float]: ...


@overload
def collective_bytes(
  compiled: Any,
  *,
  num_devices: int | None = ...,
  branches: str = ...,
  by_axis: Literal[True],
  mesh: jax.sharding.Mesh,
) -> dict[AxisKey, dict[str, float]]: ...


@overload
def collective_bytes(
  compiled: Any,
  *,
  num_devices: int | None = ...,
  branches: str = ...,
  by_axis: bool,
  mesh: jax.sharding.Mesh | None = ...,
) -> dict[str, float] | dict[AxisKey, dict[str, float]]: ...


def collective_bytes(
  compiled: Any,
  *,
  num_devices: int | None = None,
  branches: str = "all",
  by_axis: bool = False,
  mesh: jax.sharding.Mesh | None = None,
) -> dict[str, float] | dict[AxisKey, dict[str, float]]:
  """Bytes one device sends per call of a compiled step, by collective kind, with loop trip counts.

  Counted as `count_collectives` does, each execution weighted by the bytes a
  ring implementation sends per device for a group of $n$ devices and a
  result of $b$ bytes: all-reduce $2 (n-1) b / n$, reduce-scatter $(n-1) b$
  (its result is the $1/n$ shard), all-gather $(n-1) b / n$, all-to-all and
  collective-permute $b$. An estimate of the wire traffic, read from the
  dtypes and shapes in the compiled HLO (XLA:CPU may widen bfloat16).

  Example::

    ja.collective_bytes(compiled, by_axis=True, mesh=mesh)["data"]  # {"all-reduce": 1572864.0}

  Args:
    compiled: a `jax.stages.Compiled` or its HLO text.
    num_devices: the group size of a collective whose HLO names no replica
      groups (all devices); default: the largest device id named + 1 (with
      a mesh: `mesh.size`).
    branches: `"all"` or `"none"`, as in `count_collectives`.
    by_axis: split the bytes by the mesh axes each collective spans, as in
      `count_collectives` (needs `mesh`).
    mesh: with `by_axis=True`, the `jax.sharding.Mesh` the step was compiled
      over.

  Returns:
    `{opcode: ring bytes sent per device per call}`; with `by_axis=True`,
    `{axes: {opcode: ring bytes}}`, keyed as in `count_collectives`.

  Raises:
    TypeError: `compiled` is neither a compiled step nor a string.
    ValueError: a bad `branches` or `num_devices`; `by_axis=True` without a
      `jax.sharding.Mesh` as `mesh` (or a mesh without by_axis), or a mesh
      that does not hold the devices the step names.
  """
  _check(branches, num_devices)
  text = _text(compiled, "compiled")
  coords = _mesh_coords(compiled, by_axis, mesh)
  if coords is not None and mesh is not None:
    split = _hlo.per_call_by_axis(text, coords, tuple(mesh.axis_names), num_devices, branches=branches)
    return {axes: {op: float(v["bytes"]) for op, v in ops.items()} for axes, ops in split.items()}
  found = _hlo.per_call(text, num_devices, branches=branches)
  return {op: float(v["bytes"]) for op, v in found.items()}
