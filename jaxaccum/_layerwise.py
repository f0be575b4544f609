"""Layerwise FSDP inside a shard_map: gather each parameter where it is used, free it, re-gather it backwards.

`layerwise(loss_fn, dims, axis, size)` turns a loss written for full-size
parameters into a function of the local shards (P = `size` devices on the
manual axis `axis`). Under `jax.value_and_grad` it returns the loss and, for
every sharded leaf, the reduce-scattered gradient

.. math:: \\bar g_p = \\Big[\\sum_{q=1}^{P} \\nabla_\\theta L_q\\Big]_{\\text{block } p \\text{ of dim}},

what `lax.psum_scatter(g_full, axis, scatter_dimension=dim, tiled=True)` of
each device's full gradient would give, without ever holding a full-size copy
of the parameter tree or of its gradient.

How. `loss_fn` is traced once to a jaxpr with full-size abstract parameters,
then evaluated equation by equation as `jax.core.eval_jaxpr` does (each bound
with its own params); the interpreter only decides where a parameter-derived
value is read. A value computed from one parameter and constants only (a cast,
a reshape, `w.T * MASK`, `pos + PE`, `w @ PROJ`, `w[np_idx]`, `w * w`) stays
*lazy*: the shard plus a chain of steps, nothing gathered. A step is the
equation with its inputs as the evaluation read them: constants (constvars:
NumPy arrays, closed-over jnp arrays; literals; NumPy and Python scalars) kept
as they are, a hole where it reads the lazy value. Replaying a chain binds each
equation with the gathered value in its holes only, never in place of a
constant: "unary" means one parameter-derived input, not one non-literal
input. A value the program computes from constants only (`jnp.where`'s
broadcast 0.0, `jnp.triu`'s iota mask, jnp's normalisation of a NumPy index
array, a `pvary` under check_vma) stays a constant too (`_Const`: the equation,
bound again where it is read), so `where(np_mask, w, 0.0) @ x` is as layerwise
as `(w * MASK) @ x`. An equation that also reads a traced value (the
activations, another parameter) is not a step: at the first such equation (a
`dot_general` with the activations, the bias `add`), that one equation runs
through a `custom_vjp` "gather-and-apply":

- forward: all-gather the shard, replay the unary operations, apply the
  equation; save the shard (and the equation's other inputs when its
  derivative needs them) but not the gathered value, which is freed;
- backward: the parameter's cotangent first, `psum_scatter`ed at once (for a
  bilinear use such as `x @ w` it needs no gathered parameter), then the
  shard all-gathered again for the other inputs' cotangent (`ct @ w.T`), after
  the scatter: one full-size buffer alive at a time, the layer or its
  gradient. XLA drops a re-gather nothing needs (a bias add, the first layer).

Each gather carries a real data dependence that is numerically the identity
(the shard plus an exact -0.0 computed from one element of the equation's
other input, or of the incoming cotangent): XLA can neither hoist the
gathers of all layers to the start of the step nor merge the backward
re-gather into the forward gather (common-subexpression elimination would,
and then every gathered layer stays alive from the forward pass to the
backward one; measured on XLA CPU, see the notes). `pjit`/`closed_call` are
inlined, `jax.checkpoint` regions are re-wrapped with their policy, and
`lax.scan` bodies are interpreted per iteration, so that a stacked `(L, ...)`
parameter fed as `xs` (scanned layers: MaxText/Levanter, `nnx.scan`,
`linen.scan`) is gathered one layer per iteration. Any other equation that
consumes a parameter (a `cond`, a `custom_jvp` or `custom_vjp` function) is
applied whole through the same gather-and-apply: correct, if not finer.
An equation whose derivative cannot be replayed inside that custom_vjp's
backward pass (a nested `shard_map`, whose transpose must see the operands
it was traced with; a `while`) falls back, for that equation alone, to a
whole-leaf gather differentiated by JAX itself (`_fallback`): exact, the
gathered leaf possibly alive until the backward pass. So does a parameter in
a scan's carry, or a stacked one the scan cannot slice as a shard (sharded on
the layer axis; read through a chain that is not elementwise with scalar
constants), gathered before the loop. `fallbacks(why=True)` reports which
equations did and why (the bench's fsdp section tabulates it).

Tested by a differential fuzzer (tests/_fuzz_programs.py): seeded random
programs of what model code does with parameters and constants, against plain
`jax.grad` in float64.

`scale` (the microbatch's share of the total weight) multiplies each
parameter's cotangent just before its reduce-scatter: the gradient is
scaled, never the loss, so that a backward rule not linear in its cotangent
(a custom_vjp clipping it) sees the cotangent of the loss as written.

Replicated leaves (`dim=None`) are passed through untouched: their gradient is
whatever `jax.grad` gives inside the shard_map (local when the caller passed
them varying over the manual axes, psummed when invariant).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as jex_primitives
from jax.sharding import AxisType, PartitionSpec

from jaxaccum import _jax_private, parallel

# Equations whose VJP needs none of the primal inputs (only their types): the
# gather-and-apply saves nothing but the shard for them (a bias add).
_LINEAR = frozenset({"add", "sub", "add_any", "neg"})
# Elementwise operations: with scalar constants only, they commute with slicing the layer axis of a
# stacked parameter (`layers * 0.5` fed to a scan is sliced as a shard, one layer per iteration).
_ELEMENTWISE = frozenset(
  {
    *("convert_element_type", "copy", "copy_p", "reduce_precision", "neg", "abs", "sign", "square", "sqrt"),
    *("rsqrt", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "erf", "integer_pow"),
    *("add", "sub", "mul", "div", "max", "min", "pow"),
  }
)
# Equations applied to a whole gathered leaf with JAX's own derivative (`_fallback`): a nested
# `shard_map` (its transpose must see the full operand it was traced with, not a replay inside our
# custom_vjp's backward pass) and loops whose carry or consts hold a parameter.
_FALLBACK = frozenset({"shard_map", "while"})
_INLINE = {
  "jit": "jaxpr",
  "pjit": "jaxpr",
  "closed_call": "call_jaxpr",
  "call": "call_jaxpr",
  "core_call": "call_jaxpr",
  # A call equation in the user's loss by its primitive's own name ("eval_jaxpr" from jax 0.11 on, where call_p
  # is the same primitive).
  jex_primitives.closed_call_p.name: "call_jaxpr",
}


class _Step(NamedTuple):
  """One equation of a lazy value's chain, with its inputs as the jaxpr's evaluation read them."""

  eqn: Any
  args: tuple  # the equation's input values (constants, literals' values), `_HOLE` where it reads the lazy value


# Where a chain step reads the parameter-derived value it is replayed on (compared by identity).
_HOLE = object()


class _Const(NamedTuple):
  """A value of the program computed from constants only (`broadcast 0.0`, an iota mask, index arithmetic).

  Kept as the equation and its inputs, and bound where it is read (`_bind`), in
  whatever trace reads it: a chain step may then hold it, as it holds a NumPy
  constant, without closing over a traced value. XLA folds the repeats.
  """

  eqn: Any
  args: tuple

  @property
  def ndim(self) -> int:
    return self.eqn.outvars[0].aval.ndim


# Equations of constants only that are kept as `_Const` (pure array operations, no named axes, no effects).
_FOLD = frozenset(
  {
    *("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "iota", "transpose"),
    *("concatenate", "pad", "slice", "rev", "select_n", "add", "sub", "mul", "neg", "div", "rem", "max", "min"),
    *("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "abs", "sign", "clamp", "copy", "copy_p"),
    "pvary",  # a typed shard_map (check_vma=True) casts each constant to varying first
  }
)


class _Lazy(NamedTuple):
  """A parameter-derived value not yet gathered: `chain` applied to the gathered `shard`."""

  shard: Any  # the local block (a traced array)
  dim: int  # the dimension `shard` is a block of
  chain: tuple  # `_Step`s to replay on the gathered array, in order
  other: tuple = ()  # per dimension of `shard`, the other mesh axes (e.g. "model") sharding it, or None
  # (free mesh axes, dimension): the gradient is reduce-scattered split over those axes on that dimension (see
  # `layerwise`'s `splits`), None: on the block `other` gives
  split: Any = None


# --------------------------------------------------------------------------- small helpers


def _vma(x) -> frozenset:
  """The manual axes `x` (a value or an abstract value) varies over."""
  return parallel._varying_axes(x) or frozenset()


def _match_vma(x, target: frozenset):
  """`x` typed as varying over exactly `target`: psum over extra axes (what autodiff does), pcast over missing."""
  have = _vma(x)
  extra = tuple(sorted(have - target))
  if extra:
    x = lax.psum(x, extra)
  missing = tuple(sorted(target - _vma(x)))
  if missing:
    x = lax.pcast(x, missing, to="varying")
  return x


def _traced(x) -> bool:
  """Whether `x` is a value of the trace (an input, an activation): not a constant of the program.

  Constants are everything else a jaxpr's evaluation reads: constvars (NumPy
  arrays, closed-over concrete jax Arrays), literals' values, NumPy and Python
  scalars. A chain step may hold constants (they are the same in every replay);
  a traced value must go through `_gather_apply` as an input with a cotangent.
  """
  return isinstance(x, jax.core.Tracer)


def _dependence(tree):
  """An exact -0.0 computed from one element of the first floating array in `tree` (None if there is none).

  `-(|where(isfinite(s), s, 0)| * 0)` is -0.0 for every s (NaN and inf included), and
  `shard + (-0.0)` is `shard` bit for bit; XLA does not fold a float product by 0, so
  the dependence is real and survives to scheduling.
  """
  found = None
  for x in jax.tree.leaves(tree):
    if not _traced(x) or x.size == 0 or _typed_sharded(x):
      continue
    if jnp.issubdtype(x.dtype, jnp.floating):
      found = x
      break
    if found is None and jnp.issubdtype(x.dtype, jnp.integer):
      # Token ids (an embedding lookup reads nothing else): without a tie the lookup's gather depends on
      # nothing that changes per microbatch, XLA hoists it out of the loop, and the whole gathered table
      # stays alive across it (measured: 1 GiB per device for a 256k x 2048 bfloat16 embedding). The id is
      # cast to float first: XLA folds an integer product by 0, not a float one.
      found = x
  if found is None:
    return None
  if _free_auto():
    return _Barrier(found)
  s = lax.slice(found, (0,) * found.ndim, (1,) * found.ndim).reshape(())
  if not jnp.issubdtype(s.dtype, jnp.floating):
    s = s.astype(jnp.float32)
  return -(jnp.abs(jnp.where(jnp.isfinite(s), s, jnp.zeros((), s.dtype))) * jnp.zeros((), s.dtype))


class _Barrier(NamedTuple):
  """A dependence on `x` itself (`_tie` passes the shard through one `lax.optimization_barrier` with it)."""

  x: Any


def _free_auto() -> bool:
  """Whether the context mesh has a free Auto axis of size > 1 (e.g. "model"): there one element of a value may
  live on another device, and slicing it out costs an all-reduce per gather (the partitioner's masked fetch:
  19 [1,1,1]-sized ones over "model" per step for the MaxText port); a barrier moves nothing."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return False
  return any(t == AxisType.Auto and n > 1 for t, n in zip(mesh.axis_types, mesh.axis_sizes, strict=True))


def _typed_sharded(x) -> bool:
  """Whether `x`'s type is sharded over an Explicit mesh axis (one element of it is not local: skip it)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is not None and any(e is not None for e in spec):
    return True
  # Typed on a mesh other than the context's (an Auto region of an Explicit mesh: `jax.sharding.auto_axes`, which
  # an embedding lookup with `out_sharding=` enters): JAX refuses to slice it here; skip it too.
  mesh = getattr(sharding, "mesh", None)
  return mesh is not None and not mesh.empty and mesh != jax.sharding.get_abstract_mesh()


def _tie(shard, z):
  if z is None or not (_vma(z.x if isinstance(z, _Barrier) else z) <= _vma(shard)):
    return shard
  if isinstance(z, _Barrier):
    return lax.optimization_barrier((shard, z.x))[0]
  return shard + z.astype(shard.dtype)


def _value(x):
  """`x`, a `_Const` bound in the current trace."""
  if isinstance(x, _Const):
    return _bind(x.eqn, x.args)[0]
  return x


def _foldable(eqn, invals) -> bool:
  """Whether `eqn` reads constants only and is kept as a `_Const`."""
  return (
    eqn.primitive.name in _FOLD
    and len(eqn.outvars) == 1
    and not eqn.effects
    and not any(isinstance(x, _Lazy) or _traced(x) for x in invals)
    and all(eqn.params.get(k) is None for k in ("sharding", "out_sharding"))
  )


def _bind(eqn, invals):
  """`eqn` bound on `invals` as `jax.core.eval_jaxpr` binds it (its own params and context)."""
  invals = [_value(x) for x in invals]
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _has_jaxpr(eqn) -> bool:
  return any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in eqn.params.values())


def _replay(chain, x):
  """Applies a lazy value's chain to `x`: each equation bound as JAX binds it, `x` only where it read the value.

  The hook over JAX's own evaluation: a step's other inputs are the constants
  the evaluation read for them (a NumPy mask, a positional table, a literal),
  never `x`.
  """
  for step in chain:
    (x,) = _bind(step.eqn, [x if a is _HOLE else a for a in step.args])
  return x


def _zeros(aval):
  """Zeros of `aval`'s type: shape, dtype, sharding over Explicit axes, and varying manual axes."""
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  typed = spec is not None and any(e is not None for e in spec)
  z = jnp.zeros(aval.shape, aval.dtype, out_sharding=aval.sharding if typed else None)
  vma = _vma(aval)
  return lax.pcast(z, tuple(sorted(vma)), to="varying") if vma else z


# --------------------------------------------------------------------------- gather-and-apply


class _Ctx(NamedTuple):
  axis: str
  size: int
  keep: Any = None  # a boolean scalar per device (or None): False zeroes its gradient contributions
  wire: Any = None  # the dtype gradients are reduce-scattered in (None: the parameter's own)
  scale: Any = None  # a scalar per device (or None): each parameter gradient's factor, applied before the scatter


def _on_block(fn, shard, other: tuple, axis: str, *, every_explicit: bool = False, split=None):
  """`fn` (a collective over the manual data axis) on each device's block over the other mesh axes.

  A leaf that other axes (e.g. "model") shard too runs its data-axis collective
  inside a `jax.shard_map` manual over those axes: it moves only the model
  block (left to the partitioner, the operand is replicated over "model" first:
  twice the bytes), and JAX's collectives, which take no operand typed as
  sharded over other Explicit axes, see a plain local array. `other`: the
  leaf's entries over those axes (from the step's layout); on Explicit meshes
  the shard's type tells them too.

  `every_explicit` (the reduce-scatter): manual over every Explicit axis the
  mesh leaves free as well, those the leaf is replicated over included (no
  data moves for them). JAX 0.11 and 0.12 lower `psum_scatter` only where no
  mesh axis is Explicit: its reducer's scalar type keeps the operand's spec
  ("Length of sharding.spec (1) must be equal to aval's ndim (0)").

  `split` (axes, dimension), for a leaf those axes leave whole (see `layerwise`'s `splits`): the
  operand is taken split over them on that dimension instead (the reduce-scatter), or whole over them
  where the dimension is None (the gather).
  """
  entries = list(other)
  names: set = set()
  if split is not None:
    names, at = set(split[0]), split[1]
    entries = [None] * np.ndim(shard)
    if at is not None:
      entries[at] = split[0] if len(split[0]) > 1 else split[0][0]
  elif not any(e is not None for e in entries):
    spec = getattr(getattr(jax.typeof(shard), "sharding", None), "spec", None)
    entries = [] if spec is None else list(spec)
  names |= {n for e in entries if e is not None for n in ((e,) if isinstance(e, str) else e)}
  mesh = jax.sharding.get_abstract_mesh()
  if every_explicit and not mesh.empty:
    names |= {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit}
  if not names:
    return fn
  spec = PartitionSpec(*entries)
  # Typed as the enclosing shard_map types (make_train_step's is untyped): mixed, the types disagree.
  check = parallel.vma_tracking(axis)
  return jax.shard_map(fn, mesh=mesh, axis_names=names, in_specs=spec, out_specs=spec, check_vma=check)


def _all_gather_bits(v, axis: str, dim: int):
  """`lax.all_gather` of `v`; a 16-bit float is gathered as its bits (uint16), bit for bit the same result.

  XLA:CPU widens a bfloat16 all-gather to float32 (a float32 buffer of the gathered size, twice the bytes);
  an integer one it gathers as it is. A bitcast is free on every backend, so GPU and TPU gather the same
  16 bits they would have gathered anyway.
  """
  if v.dtype in (jnp.bfloat16, jnp.float16):
    bits = lax.all_gather(lax.bitcast_convert_type(v, jnp.uint16), axis, axis=dim, tiled=True, to="varying")
    return lax.bitcast_convert_type(bits, v.dtype)
  return lax.all_gather(v, axis, axis=dim, tiled=True, to="varying")


def _gather(ctx, lz, shard, z):
  gather = lambda v: _all_gather_bits(v, ctx.axis, lz.dim)
  # A leaf the free axes leave whole is gathered whole over them, as it is placed: left open, its layout
  # there follows its consumer (an embedding lookup's output split over "model"), and the partitioner
  # split the placed shard over "model" and all-gathered it back before the gather over the data axis.
  whole = None if lz.split is None else (lz.split[0], None)
  return _on_block(gather, shard, lz.other, ctx.axis, split=whole)(_tie(shard, z))


def _scatter(ctx, ct, lz, shard):
  scatter = lambda v: lax.psum_scatter(v, ctx.axis, scatter_dimension=lz.dim, tiled=True)
  ct = ct.astype(shard.dtype)
  if ctx.scale is not None:
    # The gradient is scaled, never the loss: a backward rule that is not linear in its
    # cotangent (a custom_vjp clipping it) sees the cotangent the plain loss gives.
    ct = ct * ctx.scale.astype(ct.dtype)
  if ctx.keep is not None:
    # Exactly 0 from a device whose microbatch does not count (an all-padding one: NaN loss).
    ct = jnp.where(ctx.keep, ct, jnp.zeros((), ct.dtype))
  on_block = _on_block(scatter, shard, lz.other, ctx.axis, every_explicit=True, split=lz.split)
  if ctx.wire is not None:
    return on_block(ct.astype(ctx.wire)).astype(shard.dtype)
  return on_block(ct)


def _narrowing(lz: _Lazy) -> int:
  """How many leading steps of `lz`'s chain cast to a narrower float type: they run on the shard, before the gather.

  A float32 weight cast to bfloat16 where it is used (mixed precision: MaxText, the fit bench's models) is
  then gathered in bfloat16: half the gathered buffer and half the bytes on the wire, as MaxText casts
  before its all-gather. A cast is elementwise, so `cast(gather(shard)) == gather(cast(shard))` bit for
  bit. The custom_vjp's input is still the shard in the parameter's dtype, and `_scatter` casts the
  cotangent to it before the reduce-scatter: the gradient's sums are the same as before, in the same order.
  """
  pre = 0
  dtype = jnp.dtype(lz.shard.dtype)
  for step in lz.chain:
    eqn = step.eqn
    new = eqn.params.get("new_dtype") if eqn.primitive.name == "convert_element_type" else None
    if (
      new is None
      or eqn.params.get("sharding") is not None
      or len(step.args) != 1
      or step.args[0] is not _HOLE
      or not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(new, jnp.floating))
      or jnp.dtype(new).itemsize >= dtype.itemsize
    ):
      break
    pre, dtype = pre + 1, jnp.dtype(new)
  return pre


def _gather_cast(ctx, lz: _Lazy, pre: int, shard, z):
  """The gathered value the chain's rest is replayed on: the shard cast first where the chain narrows it."""
  return _gather(ctx, lz, _replay(lz.chain[:pre], shard), z)


def _gather_apply(ctx, fn: Callable, invals: list, *, linear: bool = False) -> list:
  """`fn(values)` where the lazy values of `invals` are gathered inside a custom_vjp (see the module docstring)."""
  lazy_pos = [i for i, x in enumerate(invals) if isinstance(x, _Lazy)]
  dyn_pos = [i for i, x in enumerate(invals) if not isinstance(x, _Lazy) and _traced(x)]
  lazies = [invals[i] for i in lazy_pos]
  pres = [_narrowing(lz) for lz in lazies]
  others_in = tuple(invals[i] for i in dyn_pos)
  other_avals = [jax.typeof(x) for x in others_in]
  diff = [jnp.issubdtype(a.dtype, jnp.inexact) for a in other_avals]

  def assemble(fulls, others):
    vals = list(invals)
    for i, f in zip(lazy_pos, fulls, strict=True):
      vals[i] = f
    for i, o in zip(dyn_pos, others, strict=True):
      vals[i] = o
    return fn(vals)

  def primal(shards, others):
    z = _dependence(others)
    fulls = [
      _replay(lz.chain[p:], _gather_cast(ctx, lz, p, s, z)) for lz, p, s in zip(lazies, pres, shards, strict=True)
    ]
    return assemble(fulls, others)

  # `keep` and `scale` are arguments (and residuals), not read from `ctx` in `bwd`: a closure over
  # a tracer from outside a layer scan cannot enter the scan's backward pass.
  @jax.custom_vjp
  def ga(shards, others, keep, scale):
    return primal(shards, others)

  def fwd(shards, others, keep, scale):
    # Only the shards (and the other inputs where the VJP needs their values): never the gathered arrays.
    return primal(shards, others), (shards, None if linear else others, keep, scale)

  def bwd(res, cts):
    shards, others, keep, scale = res
    bctx = ctx._replace(keep=keep, scale=scale)
    if others is None:
      others = tuple(_zeros(a) for a in other_avals)
    diff_in = [o for o, d in zip(others, diff, strict=True) if d]

    def g(raw, diff_in):
      it = iter(diff_in)
      merged = [next(it) if d else o for o, d in zip(others, diff, strict=True)]
      fulls = [_replay(lz.chain[p:], r) for lz, p, r in zip(lazies, pres, raw, strict=True)]
      return assemble(fulls, merged)

    # The parameters' cotangents first, reduce-scattered at once. For a bilinear use (x @ w,
    # x * scale) they do not need the gathered parameter: XLA drops this gather.
    z = _dependence(cts)
    raw = [_gather_cast(ctx, lz, p, s, z) for lz, p, s in zip(lazies, pres, shards, strict=True)]
    _, vjp_p = jax.vjp(lambda raw: g(raw, diff_in), raw)
    (ct_raw,) = vjp_p(cts)
    ct_shards = []
    for lz, s, c in zip(lazies, shards, ct_raw, strict=True):
      block = _scatter(bctx, c, lz, s)
      ct_shards.append(_match_vma(block, _vma(s)))
    # Then the other inputs' cotangents (ct @ w.T) with a re-gather that waits for the
    # scattered gradient: one full-size buffer at a time, the gathered layer or its gradient.
    ct_diff: list = []
    if diff_in:
      z = _dependence(ct_shards)
      raw = [_gather_cast(ctx, lz, p, s, z) for lz, p, s in zip(lazies, pres, shards, strict=True)]
      # Differentiated in both (the parameters' share unused, dropped by XLA): some transpose rules
      # assume their operand is linear whenever another input is (`pad`'s padding value).
      _, vjp_o = jax.vjp(g, raw, diff_in)
      _, ct_diff = vjp_o(cts)
    it = iter(ct_diff)
    ct_others = tuple(next(it) if d else None for d in diff)
    return tuple(ct_shards), ct_others, None, None

  ga.defvjp(fwd, bwd)
  return list(ga(tuple(lz.shard for lz in lazies), others_in, ctx.keep, ctx.scale))


# Which equations fell back to a whole-leaf gather, counted by (primitive name, why) at trace time (a
# debug record for the tests and the bench: `fallbacks()`; `clear_fallbacks()` before a trace).
_FALLBACKS: dict[tuple[str, str], int] = {}


def _note(name: str, why: str) -> None:
  _FALLBACKS[name, why] = _FALLBACKS.get((name, why), 0) + 1


def fallbacks(why: bool = False) -> dict:
  """The equations traced with a whole-leaf gather since the last `clear_fallbacks()`.

  Args:
    why: False: {primitive name: count}; True: {(primitive name, reason): count}.

  A whole-leaf gather keeps the gathered leaf alive past one equation: a nested
  `shard_map` or a `while` differentiated by JAX itself (`_fallback`), a
  parameter in a scan's carry, or a stacked parameter that a scan cannot slice
  as a shard (sharded on the layer axis, or a non-elementwise chain before the
  loop), gathered before the loop.
  """
  if why:
    return dict(_FALLBACKS)
  out: dict[str, int] = {}
  for (name, _), n in _FALLBACKS.items():
    out[name] = out.get(name, 0) + n
  return out


def clear_fallbacks() -> None:
  _FALLBACKS.clear()


def _fallback(ctx, eqn, invals: list) -> list:
  """`eqn` applied to whole gathered leaves, differentiated by JAX itself (correct, not layerwise).

  Each lazy input is all-gathered (its unary chain replayed) by a custom_vjp
  that does nothing else: forwards the gather, backwards the gradient's share
  (scaled, masked by `keep`) reduce-scattered at once. The equation between
  them is bound as written, so its own derivative rule (a nested shard_map's
  transpose, a while loop's) runs unchanged; the gathered leaf may stay alive
  until the backward pass reaches it.
  """
  _note(eqn.primitive.name, "differentiated by JAX on the whole gathered leaf")
  vals = [_gather_whole(ctx, x) if isinstance(x, _Lazy) else x for x in invals]
  return _bind(eqn, vals)


def _gather_whole(ctx, lz: _Lazy):
  @jax.custom_vjp
  def gather(shard, keep, scale):
    return _replay(lz.chain, _gather(ctx, lz, shard, None))

  def fwd(shard, keep, scale):
    return gather(shard, keep, scale), (shard, keep, scale)

  def bwd(res, ct):
    shard, keep, scale = res
    _, vjp = jax.vjp(lambda full: _replay(lz.chain, full), _gather(ctx, lz, shard, None))
    (ct_full,) = vjp(ct)
    block = _scatter(ctx._replace(keep=keep, scale=scale), ct_full, lz, shard)
    return _match_vma(block, _vma(shard)), None, None

  gather.defvjp(fwd, bwd)
  return gather(lz.shard, ctx.keep, ctx.scale)


def _materialize(ctx, x):
  """A lazy value gathered in full (where it leaves the interpreter or enters an opaque region)."""
  if not isinstance(x, _Lazy):
    return _value(x)
  return _gather_apply(ctx, lambda vals: vals, [x])[0]


# --------------------------------------------------------------------------- the interpreter


def _eval(ctx, jaxpr, consts, args) -> list:
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  def write(v, x):
    if not isinstance(v, jcore.DropVar):
      env[v] = x

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    write(v, x)
  for v, x in zip(jaxpr.invars, args, strict=True):
    write(v, x)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    # The parameter-derived inputs, by identity: `w * w` reads one value twice.
    lazy = list({id(x): x for x in invals if isinstance(x, _Lazy)}.values())
    name = eqn.primitive.name
    if not lazy and _foldable(eqn, invals):
      outs = [_Const(eqn, tuple(invals))]
    elif not lazy:
      outs = _bind(eqn, invals)
    elif (
      len(lazy) == 1
      and len(eqn.outvars) == 1
      and not _has_jaxpr(eqn)
      and not eqn.effects
      and not any(_traced(x) for x in invals if not isinstance(x, _Lazy))
    ):
      # A function of one parameter-derived value and constants: stays lazy (nothing gathered
      # yet). The step keeps the constants it read; the value's own positions are holes.
      (lz,) = lazy
      args = tuple(_HOLE if x is lz else x for x in invals)
      outs = [lz._replace(chain=lz.chain + (_Step(eqn, args),))]  # type: ignore[list-item]
    elif name in _INLINE:
      closed = eqn.params[_INLINE[name]]
      if isinstance(closed, jcore.ClosedJaxpr):
        outs = _eval(ctx, closed.jaxpr, closed.consts, invals)
      else:
        outs = _eval(ctx, closed, (), invals)
    elif name in ("remat2", "checkpoint", "remat"):
      outs = _remat(ctx, eqn, invals)
    elif name == "scan":
      outs = _scan(ctx, eqn, invals)
    elif name in _FALLBACK:
      outs = _fallback(ctx, eqn, invals)
    else:
      # dot_general, a bias add, or anything opaque (cond, while, custom_jvp_call): gather-and-apply.
      outs = _gather_apply(ctx, lambda vals, eqn=eqn: _bind(eqn, vals), invals, linear=name in _LINEAR)
    for v, x in zip(eqn.outvars, outs, strict=True):
      write(v, x)
  return [read(v) for v in jaxpr.outvars]


def _split(invals):
  """(the traced values, how to rebuild the list) of a list with lazies and constants.

  Traced values are the lazies' shards and the trace's other values; constants
  (NumPy arrays, literals' values) stay out of the list and are put back as
  they are, so that a region's body reads them as constants.
  """
  flat = [x.shard if isinstance(x, _Lazy) else x for x in invals if isinstance(x, _Lazy) or _traced(x)]
  specs = [
    ("lazy", (x.dim, x.chain, x.other, x.split))
    if isinstance(x, _Lazy)
    else ("traced", None)
    if _traced(x)
    else ("const", x)
    for x in invals
  ]
  return flat, specs


def _rebuild(flat, specs):
  it = iter(flat)
  out = []
  for kind, spec in specs:
    out.append(_Lazy(next(it), *spec) if kind == "lazy" else next(it) if kind == "traced" else spec)
  return out


def _remat(ctx, eqn, invals):
  """A `jax.checkpoint` region: interpreted inside a new checkpoint with the same policy."""
  p = eqn.params
  jaxpr = p["jaxpr"]
  flat, specs = _split(invals)

  def fun(*flat):
    outs = _eval(ctx, jaxpr, (), _rebuild(list(flat), specs))
    return [_materialize(ctx, o) for o in outs]

  return list(jax.checkpoint(fun, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))(*flat))


def _per_layer(step: _Step) -> bool:
  """Whether a chain step commutes with slicing the layer axis (elementwise, scalar constants only)."""
  return step.eqn.primitive.name in _ELEMENTWISE and all(a is _HOLE or _ndim(a) == 0 for a in step.args)


def _ndim(x) -> int:
  return x.ndim if isinstance(x, _Const) else np.ndim(x)


def _scan(ctx, eqn, invals):
  """`lax.scan` with parameters among its inputs: interpreted per iteration.

  A stacked parameter fed as `xs` and sharded on a dimension other than the
  layer axis is sliced as a shard (one layer's block per iteration, `dim - 1`
  in the body) and gathered there; parameters among the consts are gathered
  in each iteration that uses them. A parameter in the carry, or a stacked one
  sharded on the layer axis, is gathered whole before the loop (correct, not
  layerwise).
  """
  p = eqn.params
  nc, ncar = _jax_private.scan_layout(p)
  closed = p["jaxpr"]
  consts, carry, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
  if any(isinstance(x, _Lazy) for x in carry):
    _note("scan", "a parameter in the carry, gathered before the loop")
  carry = [_materialize(ctx, x) for x in carry]
  x_flat: list = []
  x_specs: list[tuple[int, tuple, tuple, Any] | None] = []
  for x in xs:
    why = None
    if isinstance(x, _Lazy):
      why = (
        "sharded on the layer axis"
        if x.dim == 0
        else "its gradient split on the layer axis"
        if x.split is not None and x.split[1] == 0
        else None
        if all(_per_layer(step) for step in x.chain)
        else "read through a non-elementwise chain"
      )
    if isinstance(x, _Lazy) and why is None:
      x_flat.append(x.shard)
      split = None if x.split is None else (x.split[0], x.split[1] - 1)
      x_specs.append((x.dim - 1, x.chain, tuple(x.other[1:]), split))
    else:
      if why is not None:
        _note("scan", f"a stacked parameter {why}, gathered before the loop")
      x_flat.append(_materialize(ctx, x))
      x_specs.append(None)

  def body(c, x):
    x = [v if spec is None else _Lazy(v, *spec) for v, spec in zip(x, x_specs, strict=True)]
    vals = list(consts) + list(c) + x
    outs = [_materialize(ctx, o) for o in _eval(ctx, closed.jaxpr, closed.consts, vals)]
    return outs[:ncar], outs[ncar:]

  kwargs = {"length": p["length"], "reverse": p["reverse"], "unroll": p["unroll"]}
  c_out, ys = lax.scan(body, carry, x_flat, **kwargs)
  return list(c_out) + list(ys)


# --------------------------------------------------------------------------- the entry point


def _check_dims(dims, leaves) -> list:
  flat = jax.tree.leaves(dims, is_leaf=lambda d: d is None)
  if len(flat) != len(leaves):
    raise ValueError(
      f"dims={dims!r} has {len(flat)} entries; the shards have {len(leaves)} leaves (one int or None per leaf)"
    )
  for j, (d, x) in enumerate(zip(flat, leaves, strict=True)):
    if d is None:
      continue
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < np.ndim(x):
      raise ValueError(f"dims[{j}]={d!r} must be None or a dimension of its shard (shape {np.shape(x)})")
  return [None if d is None else int(d) for d in flat]


def layerwise(
  loss_fn: Callable[..., Any],
  dims: Sequence[int | None] | Any,
  axis: str,
  size: int,
  *,
  comm_dtype: Any = None,
  others: Sequence[tuple] | None = None,
  splits: Sequence[tuple | None] | None = None,
):
  """Returns `f(shards, *args, keep=None, scale=None)`: `loss_fn(full_params, *args)`, parameters gathered where used.

  Call it inside a `jax.shard_map` that is manual over `axis` (with `size`
  devices). `shards` is the parameter pytree with each leaf's local block
  (leaf j sharded on dimension `dims[j]`, `size` blocks in device order, as
  `in_specs` with `axis` on that dimension gives), or the full leaf where
  `dims[j]` is None. `jax.value_and_grad(f)(shards, *args)` returns
  `loss_fn(full_params, *args)` and, for a sharded leaf, the sum over the
  devices of `axis` of each device's gradient, block p on device p (what
  `lax.psum_scatter(g, axis, scatter_dimension=dims[j], tiled=True)` gives);
  for a replicated leaf, what `jax.grad` gives for it (local when it is passed
  varying over the manual axes).

  Each parameter is all-gathered at the equation that uses it, freed after,
  all-gathered again for its backward equation, and its gradient is
  reduce-scattered there: per call, 2 all-gathers and 1 reduce-scatter per use
  of a sharded leaf (one leaf used once per layer: 2 and 1 per layer; XLA
  drops the backward re-gather where nothing needs it, e.g. for a bias add or
  for the first layer, whose input needs no cotangent).

  `keep` (optional, a boolean scalar per device, e.g. `weight != 0`): where
  False, this device adds exactly 0 to every sharded leaf's reduce-scattered
  gradient, even if its loss or gradient is NaN (an all-padding microbatch).
  Scaling the loss by a weight of 0 is not enough for that (0 x NaN is NaN),
  and the reduce-scatter would spread the NaN to every device's block.
  Replicated leaves' gradients are local: the caller masks those.

  `scale` (optional, a scalar per device, e.g. the microbatch's w_i / W):
  every sharded leaf's gradient is multiplied by it before its
  reduce-scatter (after every backward rule of `loss_fn` ran on the plain
  cotangent). Replicated leaves' gradients are unscaled: the caller scales
  those.

  Args:
    loss_fn: `loss_fn(params, *args)` for full-size `params` (any JAX code:
      listed layers, `lax.scan` over stacked layers, flax modules' `apply`).
      It may return a pytree (e.g. `(loss, aux)` with `has_aux=True`).
    dims: one int or None per leaf of `shards` (`jax.tree.leaves` order, or a
      pytree of the same structure with None leaves).
    axis: the manual mesh axis the shards are split over.
    size: the number of devices on `axis`.
    comm_dtype: the dtype gradients go on the wire in (e.g. `jnp.bfloat16`;
      the reduce-scatter sums in it), cast back to the parameter's dtype;
      None: the parameter's own. Parameters are gathered in their own dtype.
    others: per leaf, its entries (one per dimension of the shard) over the
      mesh axes other than `axis` that shard it too (e.g. `(None, "model")`),
      None where none does: its collectives then run on each "model" block
      (see `_on_block`). Default: read from the shards' types (Explicit axes).
    splits: per leaf, None or `(axes, d)`: free Auto mesh axes that leave
      the leaf whole (its `others` all None) and a dimension of it. Its
      gradient is then reduce-scattered split over `axes` on dimension `d`
      (each device's piece of it: `_on_block`), and the block comes back
      split so. Left to the partitioner, a gradient that comes out split over
      "model" (computed from activations split there, as a norm scale's or
      an embedding's is) is gathered over "model" before each reduce-scatter:
      one all-gather per use per call. Where `d` is the leaf's `dims` entry
      itself, device (p, m) gets piece m * size + p of that dimension cut into
      `size` times as many pieces, not its part of block p: the caller puts
      them back in block order (make_train_step does, once per step).

  Returns:
    `f(shards, *args, keep=None, scale=None)`, returning what `loss_fn` returns.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn={loss_fn!r} must be callable")
  if not isinstance(axis, str) or not axis:
    raise ValueError(f"axis={axis!r} must be one manual mesh axis name (a string)")
  if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
    raise ValueError(f"size={size!r} must be a positive int (the number of devices on axis {axis!r})")
  if comm_dtype is not None:
    comm_dtype = jnp.dtype(comm_dtype)
    if not jnp.issubdtype(comm_dtype, jnp.floating):
      raise ValueError(f"{comm_dtype=} must be a floating dtype (an integer wire dtype truncates)")

  def f(shards, *args, keep=None, scale=None):
    ctx = _Ctx(axis, int(size), None if keep is None else jnp.asarray(keep, bool), comm_dtype, scale)
    leaves, treedef = jax.tree.flatten(shards)
    flat_dims = _check_dims(dims, leaves)
    full = []
    for x, d in zip(leaves, flat_dims, strict=True):
      aval = jax.typeof(x)
      if d is not None:
        shape = list(aval.shape)
        shape[d] *= ctx.size
        aval = aval.update(shape=tuple(shape))
      full.append(aval)
    closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(jax.tree.unflatten(treedef, full), *args)
    other = [()] * len(leaves) if others is None else [tuple(o) for o in others]
    split = [None] * len(leaves) if splits is None else list(splits)
    vals = [
      x if d is None else _Lazy(x, d, (), o, sp) for x, d, o, sp in zip(leaves, flat_dims, other, split, strict=True)
    ]
    outs = _eval(ctx, closed.jaxpr, closed.consts, vals + jax.tree.leaves(args))
    outs = [_materialize(ctx, o) for o in outs]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return f
