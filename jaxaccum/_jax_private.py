"""Every private JAX name jaxaccum uses, one function or alias per need, version differences handled here alone.

`grep -rn "_src" jaxaccum` finds this module and no other. Each entry says what
it relies on and the versions it was checked on (jax 0.10.2, 0.11.2 and
0.12.0.1: the range `pyproject.toml` declares). Everything else in jaxaccum
uses public JAX (`jax.extend.core`, `jax.core`, `jax.sharding`,
`jax.make_jaxpr`).

Only `_program` (the loss traced once, localised for the per-device map) needs
these: a traced jaxpr's avals carry the trace's mesh, and JAX's public API has
no way to retype them or the equations' recorded contexts.
"""

from __future__ import annotations

import contextlib
import os
import threading

import jax
from jax._src import ad_util as _ad_util  # noqa: PLC2701
from jax._src import config as _config  # noqa: PLC2701
from jax._src import core as _core  # noqa: PLC2701
from jax._src import linear_util as _lu  # noqa: PLC2701
from jax._src import literals as _literals  # noqa: PLC2701
from jax.extend import core as jex_core

# An aval's per-axis varying/unreduced/reduced record (`ShapedArray.manual_axis_type`): a frozen dataclass with
# those three frozensets, `dataclasses.replace`-able. Same fields on 0.10.2, 0.11.2, 0.12.0.1.
ManualAxisType = _core.ManualAxisType

# A literal's host array with its aval (`literals.TypedNdArray(array, aval)`; `.aval`). 0.10.2 - 0.12.0.1.
TypedNdArray = _literals.TypedNdArray

# A custom derivative's rule as JAX stores it in `custom_jvp_call`/`custom_vjp_call` params (a
# `linear_util.WrappedFun`: `.call_wrapped(*args)`, `.transforms`, `.debug_info`), and its constructor
# `wrap_init(f, debug_info=...)`. 0.10.2 - 0.12.0.1.
WrappedFun = _lu.WrappedFun
wrap_init = _lu.wrap_init

# The symbolic zero a custom_vjp bwd may return (`ad_util.Zero(aval)`, `.aval`). 0.10.2 - 0.12.0.1.
Zero = _ad_util.Zero


def disable_bwd_checks():
  """A context in which JAX does not check a custom_vjp bwd's output types (config state
  `jax_disable_bwd_checks`, used as a context manager). 0.10.2 - 0.12.0.1."""
  return _config.disable_bwd_checks(True)


def new_var(aval, like=None):
  """A jaxpr variable of type `aval` (`jax.extend.core.Var`), keeping `like`'s quasi-dynamic data.

  0.10.2: `Var(aval, initial_qdd=None, final_qdd=None)`; 0.11.2 and 0.12.0.1:
  `Var(aval)` (the qdd fields are gone). Only mutable refs carry qdd.
  """
  initial, final = getattr(like, "initial_qdd", None), getattr(like, "final_qdd", None)
  if initial is None and final is None:
    return jex_core.Var(aval)
  return jex_core.Var(aval, initial, final)  # type: ignore[call-arg, unused-ignore]  # 0.10 only: later ones have no qdd


def eqn_context(ctx, mesh):
  """The equation context `ctx` (`JaxprEqn.ctx`) with its abstract mesh replaced by `mesh`.

  Built without naming the context's fields: `ctx.manager` restores every
  setting the context recorded (compute type, threefry, xla metadata, and on
  0.12 the layout mode and `no_collectives`), then the mesh is set, and the
  context class's constructor reads them back. Checked on 0.10.2, 0.11.2,
  0.12.0.1 (where `JaxprEqnContext._create`'s positional fields differ).
  """
  with contextlib.ExitStack() as stack:
    stack.enter_context(ctx.manager)
    # Entered through the empty mesh: JAX refuses to change a set mesh's axis sizes directly.
    stack.enter_context(jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())))
    stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
    return type(ctx)()


def scan_layout(params) -> tuple[int, int]:
  """(number of consts, number of carries) of a `scan` equation's params; the xs follow.

  0.10.2: `num_consts`/`num_carry` params; 0.11.2 and 0.12.0.1: a flat tree
  `ft_in` of (consts, carry, xs) whose `unpack()` gives the three groups.
  """
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def call_flat_bwd(bwd, args, fix):
  """Calls a custom_vjp's flattened bwd rule (`custom_vjp_call`'s `bwd` param, a `WrappedFun`) on `args`, passes
  its input cotangents (a list of arrays and `Zero`s) through `fix`, and returns them as JAX's caller reads them.

  0.10.2: the rule returns the list of cotangents; 0.11.2 and 0.12.0.1: a pair
  (cotangents, logs), the logs being `defvjp_with_logs`'s backward-pass entries
  (None or a dict), passed on untouched. Told apart by that shape (a cotangent
  is never a list or tuple).
  """
  out = bwd.call_wrapped(*args)
  if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple)):
    cts, logs = out
    return fix(list(cts)), logs
  return fix(list(out))


@contextlib.contextmanager
def arrays_typed_on(retype):
  """A context in which a concrete `jax.Array` met by a trace is typed `retype(aval)` (None: as JAX types it).

  JAX types an array a trace closes over by `core.pytype_aval_mappings[type(x)]` (for `ArrayImpl`: its aval with
  its sharding); the mapping is swapped for the context and restored after. Checked on 0.10.2 and 0.12.0.1.
  """
  from jax._src import array as _array  # noqa: PLC0415, PLC2701

  mappings = _core.pytype_aval_mappings
  before = mappings[_array.ArrayImpl]

  def typed(x):
    aval = before(x)
    return retype(aval) or aval

  mappings[_array.ArrayImpl] = typed
  try:
    yield
  finally:
    mappings[_array.ArrayImpl] = before


_SHARD_MAP_TYPED_BOUNDARY = False
# For each shard_map being lowered on this thread (innermost last): whether jaxaccum built it.
_LOWERING_OURS = threading.local()
# jaxaccum's own source files: a shard_map whose function is defined here is jaxaccum's (see `_built_here`).
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def shard_map_keeps_free_explicit_axes() -> None:
  """Makes jaxaccum's own partial-manual `jax.shard_map`s keep their values' shardings over the free Explicit axes.

  jax 0.10.2 lowers a `shard_map` manual over some axes of an Explicit mesh with boundary shardings built
  from its `in_specs`/`out_specs` alone (`jax._src.shard_map._shardy_shard_map_sharding(ctx, mesh,
  manual_axes, spec, aval_in)`), closed on the other axes: an argument typed `f32[64@model, 32]` enters
  replicated over "model" (an all-gather, and `dynamic-slice`s by partition id where the body's
  annotations shard it again), and every result leaves replicated over "model" (another all-gather, then
  a slice for the caller's type). jax 0.11 and later build them from the value's type when every mesh
  axis is Explicit or Manual (`aval.sharding.spec`). This gives 0.10 that rule, for jaxaccum's maps only:
  the same values, the collectives gone.

  Only jaxaccum's programs change. The rule is wrapped once, process-wide, by the first step built on such
  a mesh, and applies the typed boundary only while JAX lowers a shard_map whose function jaxaccum defined
  (`jax._src.shard_map._shard_map_lowering_shardy(ctx, in_nodes, jaxpr, ...)` is wrapped to note, per
  thread, whether `jaxpr.debug_info` names a source file of this package; JAX keeps it through jvp,
  partial evaluation and transposition). A user's own shard_map, outside any jaxaccum step or inside one
  (a tensor-parallel layer in the loss), lowers as JAX lowers it: the same HLO, the same float64 results
  bit for bit, whether or not a step was built in the process. The type's spec is used only where it
  names the same manual axes on every dimension as JAX's spec (which fixes the body's block shapes); it
  differs only over the free axes. A no-op where JAX already lowers so (its rule's last parameter is
  `aval`, not `aval_in`). Checked on 0.10.2 (patched) and 0.12.0.1 (left alone).
  """
  global _SHARD_MAP_TYPED_BOUNDARY
  if _SHARD_MAP_TYPED_BOUNDARY:
    return
  _SHARD_MAP_TYPED_BOUNDARY = True
  import inspect  # noqa: PLC0415

  from jax._src import shard_map as _shard_map  # noqa: PLC0415, PLC2701

  rule = getattr(_shard_map, "_shardy_shard_map_sharding", None)
  lowering = getattr(_shard_map, "_shard_map_lowering_shardy", None)
  if rule is None or lowering is None or list(inspect.signature(rule).parameters)[-1:] != ["aval_in"]:
    return
  if list(inspect.signature(lowering).parameters)[:3] != ["ctx", "in_nodes", "jaxpr"]:
    return

  def typed(ctx, mesh, manual_axes, spec, aval_in):
    ours = getattr(_LOWERING_OURS, "stack", None)
    if ours and ours[-1]:
      spec = _typed_boundary_spec(spec, aval_in, manual_axes)
    return rule(ctx, mesh, manual_axes, spec, aval_in)

  def lower(ctx, in_nodes, jaxpr, *args, **kwargs):
    stack = _LOWERING_OURS.__dict__.setdefault("stack", [])
    stack.append(_built_here(jaxpr))
    try:
      return lowering(ctx, in_nodes, jaxpr, *args, **kwargs)
    finally:
      stack.pop()

  _shard_map._shardy_shard_map_sharding = typed
  _shard_map._shard_map_lowering_shardy = lower


def _built_here(jaxpr) -> bool:
  """Whether a shard_map's body `jaxpr` comes from a function defined in jaxaccum (`debug_info.func_src_info`,
  "name at path:line"; a `functools.partial`'s function is the one named)."""
  info = getattr(getattr(jaxpr, "debug_info", None), "func_src_info", None) or ""
  _, at, where = info.rpartition(" at ")
  return bool(at) and os.path.abspath(where.rsplit(":", 1)[0]).startswith(_PACKAGE_DIR)


def _typed_boundary_spec(spec, aval, manual_axes):
  """`aval`'s own spec where its mesh's axes are all Explicit or Manual and it splits every dimension over the same
  manual axes as `spec` (JAX's, from in_specs/out_specs); `spec` otherwise."""
  sharding = getattr(aval, "sharding", None)
  m = getattr(sharding, "mesh", None)
  # The mesh's "every axis Explicit or Manual" (0.10 names it with a leading underscore, 0.12 without).
  every = getattr(m, "_are_all_axes_explicit_or_manual", None) or getattr(m, "are_all_axes_explicit_or_manual", False)
  if sharding is None or m is None or m.empty or not every:
    return spec
  own = sharding.spec
  ndim = len(getattr(aval, "shape", ()))
  manual = set(manual_axes)

  def names(s, i):
    parts = getattr(s, "partitions", None)  # not `s[i]`: JAX refuses it on a spec with unreduced axes
    parts = tuple(s) if parts is None else tuple(parts)
    e = parts[i] if i < len(parts) else None
    e = () if e is None or e is jax.sharding.PartitionSpec.UNCONSTRAINED else e if isinstance(e, tuple) else (e,)
    return tuple(n for n in e if n in manual)

  if any(names(own, i) != names(spec, i) for i in range(max(ndim, len(own.partitions), len(spec.partitions)))):
    return spec
  return own


def jnp_calls_kept(fn):
  """`fn` with the `jit` equations JAX inlines while tracing (jnp's own functions) kept, where `fn` itself stages them.

  jnp functions are `jit(inline=True)`: staged into a jaxpr, their equation is inlined at once
  (`pjit.pjit_staging_rule`, `params["inline"]` truthy on 0.10, `Inline.JAX_EARLY` from 0.11). Kept as
  equations, the same function at the same shapes is one shared jaxpr (jit's trace cache), so differentiating
  the jaxpr later reuses JAX's cached linearization of it, as differentiating the Python code does; evaluated
  by `eval_jaxpr` into a trace, each is inlined then, as it would have been.

  Only equations staged directly into the trace `fn` runs in are kept: a nested trace (the body of a jnp
  function traced on a cache miss, a scan's body, another thread's trace) stages as JAX does, so what jit's
  trace cache stores for a jnp function is what it stores anywhere else. The staging rule of `jit_p`
  (`interpreters.partial_eval.custom_staging_rules`) is wrapped once, process-wide, by one that keeps an
  equation only for the trace on top of this thread's stack (pushed while `fn` runs) and otherwise calls
  JAX's own rule; it also calls it for what only that rule handles (mutable consts, `compiler_options`, 0.10's
  quantity-dependent types). Checked on 0.10.2, 0.11.2, 0.12.0.1.
  """
  _install_kept_rule()

  def traced(*args):
    stack = _KEPT.__dict__.setdefault("tops", [])
    stack.append(_core.trace_ctx.trace)
    try:
      return fn(*args)
    finally:
      stack.pop()

  return traced


_KEPT = threading.local()  # .tops: the traces whose jnp calls are kept, innermost last
_KEPT_RULE: list = []  # the rule installed (once)


def _install_kept_rule() -> None:
  if _KEPT_RULE:
    return
  from jax._src import pjit as _pjit  # noqa: PLC0415, PLC2701
  from jax._src.interpreters import partial_eval as _pe  # noqa: PLC0415, PLC2701

  before = _pe.custom_staging_rules[_pjit.jit_p]

  def kept(trace, source_info, *args, **params):
    tops = getattr(_KEPT, "tops", None)
    if not tops or trace is not tops[-1] or params["compiler_options_kvs"]:
      return before(trace, source_info, *args, **params)
    jaxpr = params["jaxpr"]
    if any(isinstance(c, _core.Ref) for c in jaxpr.consts) or any(
      getattr(v, "initial_qdd", None) for v in (*getattr(jaxpr, "constvars", ()), *getattr(jaxpr, "invars", ()))
    ):
      return before(trace, source_info, *args, **params)
    return trace.default_process_primitive(_pjit.jit_p, args, params, source_info=source_info)

  _pe.custom_staging_rules[_pjit.jit_p] = kept
  _KEPT_RULE.append(kept)
