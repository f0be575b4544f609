"""ja.grad / ja.value_and_grad: gradients left unreduced over the data axis, for the user's own jit step.

On a mesh with Explicit axes, inside the user's `jax.jit`, `jax.grad` of a loss
on a batch sharded over "data" comes back already all-reduced: the partitioner
inserted one all-reduce per call. Accumulated over K calls (`ja.accumulate`,
`optax.MultiSteps`) that is K all-reduces per update. `ja.grad` returns the same
gradient *unreduced* (typed `{U:data}`): each device holds its share

    g_d = (W_d / W) * grad L_d,   W_d = weight_fn(rows of device d) (default 1),  W = sum_d W_d,

where L_d is `fun` on device d's rows. Summed over devices, sum_d g_d is the
gradient of the W-weighted mean loss over the call's global batch: with L a
mean over rows and equal rows per device (or `weight_fn` = the rows or tokens
of each device's share), exactly `jax.grad(fun)` on the whole batch. Nothing
params-sized crosses the wire: only the scalar W (and the value, and aux, all
reduced with scalar collectives). `ja.accumulate(..., axis_name="data")` keeps
the sum unreduced across calls and reduces once per window; `jax.reshard(g, NamedSharding(mesh, P()))`
reduces by hand.

A device whose weight W_d is 0 (padding only: its loss may be 0/0) adds exactly
nothing: its terms are selected out, never multiplied by 0. Keys: device d's rows
get `fold_in(key, d)` (`key_argnum`, and typed keys found in the arguments), so
devices draw independent masks; not the plain step's draws (a mask drawn over the
global batch cannot be cut into per-device masks), deterministic given the key and
the device count. Aux leaves with a leading dimension of the device's rows come
back concatenated in row order; others as the weighted mean (`aux_reductions`).

How: a `jax.shard_map` manual over the mesh axis runs `fun` on each device's rows
without vma checking: autodiff then leaves each device its local gradient (no
psum over the replicated parameters), and loops whose carry starts as a constant
(an RNN from zeros) type-check as they do outside; the local gradient leaves as
unreduced (`out_specs=P(unreduced={axis})`). `fun` is traced once, outside the
map, on one device's shapes (`_program`): sharding annotations written for the
global batch (`reshard`, `out_sharding=P("data", ...)`) are localised there, the
data axis dropped from their specs. A loss that closes over a batch sharded over
the axis cannot run per device and is refused by name (`_per_device.explain`),
as is an annotation in a custom derivative's bwd rule that does not trace outside the map
(one that does is localised like the loss's own). The pieces are module
functions over `_Config` (what was given) and `_Args` (one call's arguments). JAX 0.10 limits (see
`_unreduced`): the mesh's other axes must have size 1 (a "model" axis beside the data
axis needs a JAX that types a partly manual map's output unreduced, 0.12; the map is
then manual over the data axis only), and Auto meshes have no unreduced type; both give
a ValueError that says what to use instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _per_device, _program, _sums, _tree, _unreduced


def _argnums_tuple(argnums) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums) if isinstance(argnums, Sequence) else None
  if not nums or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nums):
    raise TypeError(f"argnums={argnums!r} must be a non-negative int or a non-empty sequence of them")
  return nums


def _replicated(x) -> bool:
  return all(a is None for a in _spec_of(x))


def _spec_of(x) -> P:
  """The sharding spec `x` has here (P() for a value without one); unreduced/reduced parts dropped."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return P() if spec is None else P(*spec.partitions)  # `*spec` is refused with an unreduced/reduced set


_REDUCTIONS = ("mean", "sum", "concat")


def _check_reductions(aux_reductions) -> None:
  if aux_reductions is None:
    return
  bad = [r for r in jax.tree.leaves(aux_reductions) if r not in _REDUCTIONS]
  if bad or not jax.tree.leaves(aux_reductions):
    raise ValueError(
      f"aux_reductions={aux_reductions!r}: each leaf must be one of {_REDUCTIONS} (a single string applies to "
      "every aux leaf), or None (scalars and per-feature leaves: 'mean'; leaves with a leading dimension of "
      "the device's rows: 'concat')"
    )


def _aux_modes(aux_shapes, aux_reductions, rows, aux_at):
  """Per aux leaf: "mean", "sum" or "concat" (from `aux_reductions`, else the one per-example rule,
  `_sums.per_row`: "concat" where the leaf's leading size follows the rows, `aux_at(rows)` its shapes)."""
  if aux_reductions is None:
    leaves, treedef = jax.tree.flatten(aux_shapes)
    if rows is None:  # no argument sharded over the axis on its rows: nothing is per-row
      return jax.tree.unflatten(treedef, ["mean"] * len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(aux_shapes)]
    reds = _sums.per_row([_sums.PER_ROW] * len(leaves), leaves, paths, rows, aux_at, "aux", "aux_reductions=")
    return jax.tree.unflatten(treedef, reds)
  try:
    return jax.tree.broadcast(aux_reductions, aux_shapes)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"aux_reductions={aux_reductions!r} is not a tree prefix of aux {jax.tree.structure(aux_shapes)}"
    ) from e


def _local_rows(arrays, specs, axis_name) -> int | None:
  """The leading size of each device's rows: of the first argument leaf sharded over the axis on dim 0."""
  for x, s in zip(arrays, specs, strict=True):
    first = s[0] if len(s) else None
    if first is not None and axis_name in _unreduced.names(first):
      return x.shape[0] // _axis_size(x, axis_name)
  return None


def _local_shape(x, spec, mesh) -> tuple[int, ...]:
  """The shape of `x`'s block on one device of `mesh` under `spec`."""
  sizes = dict(mesh.shape)
  entries = list(spec) + [None] * (x.ndim - len(spec))
  return tuple(
    d // int(np.prod([sizes[n] for n in _unreduced.names(e)])) if e is not None else d
    for d, e in zip(x.shape, entries, strict=True)
  )


def _axis_size(x, axis_name) -> int:
  mesh = _unreduced.mesh_of(x)
  return dict(mesh.shape)[axis_name]


def value_and_grad(
  fun: Callable,
  argnums: int | Sequence[int] = 0,
  *,
  axis_name: str,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  key_argnum: int | None = None,
  aux_reductions: Any = None,
) -> Callable:
  """`jax.value_and_grad` whose gradient is left unreduced over `axis_name` (see the module docstring).

  Args:
    fun: the loss, `fun(*args) -> scalar` (or `(scalar, aux)` with `has_aux`),
      written for any number of rows: it runs on each device's rows. It must
      take its batch as an argument (a batch sharded over the axis read from
      the enclosing scope is refused). Sharding annotations naming
      `axis_name` (written for the global batch) are localised: each device
      already holds only its rows.
    argnums: which positional arguments to differentiate (int or sequence).
      They are replicated inside (a leaf sharded over the axis is gathered).
    axis_name: the Explicit mesh axis the batch is sharded over, e.g. "data".
    has_aux: `fun` returns (loss, aux).
    weight_fn: None (each device's share weighs 1: right for a mean loss with
      equal rows per device) or `weight_fn(batch) -> scalar`, `batch` the local
      rows of the arguments not in `argnums` (the one argument itself, or a
      tuple of several): e.g. the number of real tokens, so that padding or
      unequal shares weigh what they hold. A device whose weight is 0 (or not
      finite, or negative) contributes exactly nothing, even where its loss is
      0/0 = NaN (selected out, never multiplied by 0). All weights 0: a zero
      gradient and a NaN value (the plain step's 0/0).
    key_argnum: a positional argument holding PRNG keys (a key, or a pytree of
      them, typed or raw, with integer scalar counts kept as they are; any
      other leaf is refused by its path). Device d's rows get
      `jax.random.fold_in(key, d)` (every key of the tree), so devices draw
      independent dropout masks, as ja.microbatch does per microbatch. Typed
      keys (`jax.random.key`) in the other non-differentiated arguments (e.g.
      an nnx model's rng state) are folded the same way without being named;
      a raw `PRNGKey` must be named here. The draws are not the plain step's
      (its mask over the global batch cannot be cut into per-device masks);
      they are deterministic given the key and the device count.
    aux_reductions: how each aux leaf is combined over devices: "mean" (the
      weighted mean, like the loss: floating leaves), "sum", or "concat"
      (per-example leaves, returned in the global row order). A string, or a
      tree prefix of aux. None: "concat" for a leaf whose leading dimension is
      the device's rows (the leading size of the first argument sharded over
      the axis), "mean" for the others: the one default of every entry
      point (docs/guides/microbatch.md, "Per-example outputs").

  Returns:
    A function of `fun`'s arguments returning `(value, grads)` (`((value, aux),
    grads)` with `has_aux`): value and aux global, grads unreduced over
    `axis_name` (typed `{U:axis}`), in the structure of the argument(s) in
    `argnums`. Reduce them with `ja.accumulate(..., axis_name=)`,
    `ja.microbatch(..., axis_name=)` or `jax.reshard(g, NamedSharding(mesh, P()))`: an unreduced
    value given to plain optax fails inside JAX (e.g. `integer_pow` in adam).

  Raises:
    ValueError: `axis_name` bound by an enclosing pmap/shard_map (use
      `jax.grad` there, on parameters cast to varying), not an Explicit axis of
      the mesh, or a mesh with another axis of size > 1 on a JAX that cannot
      leave a partly manual map's output unreduced (0.10); a closure
      over a sharded batch; a sharding annotation naming the axis inside a
      custom derivative's bwd rule that does not trace outside the map; each
      says what to use instead. TypeError: bad `argnums`, `weight_fn` not
      callable, a non-floating "mean" aux leaf, a non-scalar loss.
  """
  cfg = _config(fun, argnums, axis_name, has_aux, weight_fn, key_argnum, aux_reductions)

  def wrapped(*args):
    return _call(cfg, args)

  return wrapped


class _Config(NamedTuple):
  """What `value_and_grad` was given, checked."""

  fun: Callable
  argnums: Any  # as given (an int: grads are not a tuple)
  nums: tuple[int, ...]
  axis_name: str
  has_aux: bool
  weight_fn: Callable | None
  key_argnum: int | None
  aux_reductions: Any


class _Args(NamedTuple):
  """One call's arguments, flattened: which leaves are arrays, differentiated, keys; their specs; fun traced."""

  treedef: Any
  leaves: list
  is_array: list[bool]
  key_leaf: list[bool]
  specs: list
  rows: int | None
  program: Any  # fun traced once on one device's shapes (`_program.Program` of the array leaves)
  aux_at: Any  # rows -> aux's leaves as fun gives them at that many rows per device (traced again, abstractly)


def _config(fun, argnums, axis_name, has_aux, weight_fn, key_argnum, aux_reductions) -> _Config:
  if not callable(fun):
    raise TypeError(f"fun={fun!r} must be callable")
  nums = _argnums_tuple(argnums)
  if not isinstance(axis_name, str) or not axis_name:
    raise TypeError(f"{axis_name=} must be a mesh axis name (a non-empty string)")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn={weight_fn!r} must be callable (batch -> scalar weight) or None")
  if not isinstance(has_aux, bool):
    raise TypeError(f"{has_aux=} must be a bool")
  if key_argnum is not None and (not isinstance(key_argnum, int) or isinstance(key_argnum, bool) or key_argnum < 0):
    raise TypeError(f"{key_argnum=} must be a non-negative int (a positional argument) or None")
  if key_argnum is not None and key_argnum in nums:
    raise ValueError(f"{key_argnum=} is also one of argnums={argnums!r}: a key is not differentiated")
  if aux_reductions is not None and not has_aux:
    raise ValueError(f"aux_reductions={aux_reductions!r} needs has_aux=True")
  _check_reductions(aux_reductions)
  return _Config(fun, argnums, nums, axis_name, has_aux, weight_fn, key_argnum, aux_reductions)


def _call(cfg: _Config, args):
  """One call: the arguments laid out, fun traced once, then the per-device map (see the module docstring)."""
  nums, key_argnum, axis_name = cfg.nums, cfg.key_argnum, cfg.axis_name
  if max(nums) >= len(args) or (key_argnum is not None and key_argnum >= len(args)):
    named = max(max(nums), -1 if key_argnum is None else key_argnum)
    raise TypeError(f"argnums={cfg.argnums!r}, {key_argnum=} name argument {named}, but the call has {len(args)}")
  if _unreduced.is_bound(axis_name):
    raise ValueError(
      f"ja.grad: {axis_name=} is bound by an enclosing pmap/shard_map: there, use jax.grad on parameters cast "
      f"to varying (jax.lax.pcast(params, {axis_name!r}, to='varying')) and ja.accumulate(..., axis_name=)"
    )
  mesh = _unreduced.explicit_mesh(axis_name, args, what="ja.grad")
  a, arrays = _arguments(cfg, mesh, args)
  # The body runs without vma checking: fun's own loops may start their carry from a constant (an RNN from
  # zeros, a fori_loop from 0.0), which a checked body would type as invariant against a varying output.
  # Unchecked, autodiff leaves each device its local gradient (no psum for the replicated parameters),
  # which is exactly the partial sum the unreduced output wants.
  # Manual over every mesh axis, or over the data axis only when another axis has size > 1 (a tensor-parallel
  # "model" axis stays with the partitioner, its layouts as the user gave them: `_unreduced.manual_axes`).
  smap = functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=tuple(a.specs),
    check_vma=False,
    axis_names=set(_unreduced.manual_axes(mesh, axis_name)),
  )
  modes = None
  if cfg.has_aux:
    probe = functools.partial(_probe, cfg, a)
    shapes = _trace(lambda: jax.eval_shape(smap(probe, out_specs=P(axis_name)), *arrays), axis_name)
    modes = _aux_modes(
      jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes), cfg.aux_reductions, a.rows, a.aux_at
    )
  aux_specs = jax.tree.map(lambda m: P(axis_name) if m == "concat" else P(), modes) if cfg.has_aux else None
  out_specs = ((P(), aux_specs) if cfg.has_aux else P(), P(unreduced={axis_name}))
  body = functools.partial(_body, cfg, a, modes)
  return _trace(lambda: smap(body, out_specs=out_specs)(*arrays), axis_name)


def _arguments(cfg: _Config, mesh, args) -> tuple[_Args, list]:
  """The call's leaves, masks and specs, differentiated leaves gathered, and fun traced once; and the arrays."""
  nums, key_argnum, axis_name = cfg.nums, cfg.key_argnum, cfg.axis_name
  leaves, treedef = jax.tree.flatten(list(args))
  is_array = [isinstance(x, (jax.Array, jnp.ndarray)) or hasattr(x, "__jax_array__") for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array, strict=True) if a]
  # Which flat leaves belong to differentiated arguments (replicated inside), which are keys (folded inside).
  owner = jax.tree.flatten([[i] * len(jax.tree.leaves(a)) for i, a in enumerate(args)])[0]
  owners = [o for o, a in zip(owner, is_array, strict=True) if a]
  diff_leaf = [o in nums for o in owners]
  # A typed key sharded over the axis is per-row data (each row its key) and reaches its device as it is;
  # a replicated one would give every device the same draws, so it is folded, as is all of key_argnum.
  # Every key of key_argnum's tree, typed or raw, is folded (its counters kept; anything else refused by name).
  named = iter([] if key_argnum is None else _tree.key_mask(args[key_argnum], "key_argnum"))
  key_leaf = [
    next(named) if o == key_argnum else (o not in nums and _tree.is_key(x) and _replicated(x))
    for o, x in zip(owners, arrays, strict=True)
  ]
  manual = _unreduced.manual_axes(mesh, axis_name)
  auto = [n for n in mesh.axis_names if n not in manual]  # left to the partitioner: a "model" axis, say
  # The map's in_specs name its manual axes only; a leaf's layout over the others travels with its type.
  specs = [P() if d else _program.drop_axes(_spec_of(x), auto) for x, d in zip(arrays, diff_leaf, strict=True)]
  rows = _local_rows(arrays, specs, axis_name)
  # A differentiated leaf sharded over the manual axes (FSDP-style) is gathered over them once here: each
  # device's loss needs all of it (a tensor-parallel sharding over the other axes is kept). Its gradient comes
  # back unreduced at full size; ja.accumulate reduce-scatters it at the window end.
  over_manual = lambda x: any(e is not None and set(_unreduced.names(e)) & set(manual) for e in _spec_of(x))
  with _unreduced.mesh_context(arrays):  # placed arguments are enough: no jax.set_mesh needed
    arrays = [
      jax.reshard(x, _program.drop_axes(_spec_of(x), manual)) if d and over_manual(x) else x
      for x, d in zip(arrays, diff_leaf, strict=True)
    ]
  # fun traced once, on one device's shapes, outside the per-device map (`_program`): annotations naming the
  # mesh's axes are localised there (every axis is manual inside, the others of size 1), and no check traces
  # fun again.
  # One device's shapes over the manual axes; over the others the leaves keep their global shape and layout.
  local = [
    jax.ShapeDtypeStruct(
      _local_shape(x, s, mesh),
      x.dtype,
      sharding=NamedSharding(mesh, _program.drop_axes(_spec_of(x), manual)) if auto else None,
    )
    for x, s in zip(arrays, specs, strict=True)
  ]
  rebuild = lambda xs: _rebuild(treedef, leaves, is_array, xs)
  # The leaves split over the axis on their rows are typed so (P(axis_name) on the size-1 axis), as the user's
  # own jit types them: an Explicit-mesh `with_sharding_constraint(h, P(axis_name, ...))` asserts that layout,
  # and a loop whose body reshards its carry over the axis keeps its type. A loss that types only in the
  # unsharded layout (an RNN whose scan carry starts from replicated zeros: the body runs unchecked, see the
  # module docstring) is traced so when the first trace raises; if both raise, the unsharded trace's error.
  on_rows = lambda s: bool(len(s)) and s[0] is not None and axis_name in _unreduced.names(s[0])
  batch_leaves = tuple(i for i, s in enumerate(specs) if on_rows(s))
  trace = lambda shapes, batch: _program.trace(
    lambda *xs: cfg.fun(*rebuild(xs)),
    shapes,
    mesh=mesh,
    data_axes=manual,
    batch_argnums=batch,
    row_axis=axis_name,
    entry="ja.grad",
  )

  def traced(shapes):
    if not batch_leaves:
      return trace(shapes, ())
    try:
      return trace(shapes, batch_leaves)
    except Exception:  # noqa: BLE001  (the unsharded trace raises its own error if it fails too)
      return trace(shapes, ())

  program = _trace(lambda: traced(local), axis_name)

  def aux_at(at: int) -> list:
    """aux's leaves with `at` rows per device on every argument split over the axis on its rows."""
    again = [
      jax.ShapeDtypeStruct((at, *x.shape[1:]) if on_rows(s) else x.shape, x.dtype)
      for x, s in zip(local, specs, strict=True)
    ]
    prog = traced(again)
    return jax.tree.leaves(jax.tree.unflatten(prog.out_tree, prog.closed.out_avals)[1])

  return _Args(treedef, leaves, is_array, key_leaf, specs, rows, program, aux_at), arrays


def _rebuild(treedef, leaves, is_array, array_values):
  """The argument list with the array leaves replaced by `array_values` (static leaves kept)."""
  it = iter(array_values)
  return jax.tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)])


def _local_call(cfg: _Config, a: _Args, local_args):
  """fun's arguments on this device (keys folded with the device index), and fun of the differentiated ones."""
  index = lax.axis_index(cfg.axis_name)
  folded = [_tree.fold_key(x, index) if k else x for x, k in zip(local_args, a.key_leaf, strict=True)]
  full = _rebuild(a.treedef, a.leaves, a.is_array, folded)

  def loss_of(*d):
    call = list(full)
    for i, v in zip(cfg.nums, d, strict=True):
      call[i] = v
    flat = jax.tree.leaves(call)
    return a.program(*[x for x, is_arr in zip(flat, a.is_array, strict=True) if is_arr])

  return full, loss_of


def _probe(cfg: _Config, a: _Args, *local_args):
  """aux's structure and per-device shapes (trace only): each leaf with a leading axis of one per device."""
  full, loss_of = _local_call(cfg, a, local_args)
  return jax.tree.map(lambda x: jnp.asarray(x)[None], loss_of(*(full[i] for i in cfg.nums))[1])


def _body(cfg: _Config, a: _Args, modes, *local_args):
  """One device: fun's value and gradient on its rows, weighted into its share; value and aux reduced."""
  axis_name, nums = cfg.axis_name, cfg.nums
  full, loss_of = _local_call(cfg, a, local_args)
  out, grads = jax.value_and_grad(loss_of, argnums=tuple(range(len(nums))), has_aux=cfg.has_aux)(
    *(full[i] for i in nums)
  )
  loss, aux = out if cfg.has_aux else (out, None)
  if jnp.ndim(loss) != 0:
    raise TypeError(f"fun must return a scalar loss, got shape {jnp.shape(loss)}")
  keep, share, total = _shares(cfg, full, jnp.result_type(loss))

  def part(x):
    """This device's term share * x of the weighted mean; exactly 0 where the device does not count."""
    x = share.astype(x.dtype) * x
    return x if keep is None else jnp.where(keep, x, jnp.zeros_like(x))

  value = lax.psum(part(loss), axis_name)
  if total is not None:
    value = jnp.where(total > 0, value, jnp.full_like(value, jnp.nan))  # no rows at all: the plain step's 0/0
  if cfg.has_aux:
    aux = jax.tree.map(lambda x, m, p: _reduce_aux(x, m, p, part, axis_name), aux, modes, _paths(aux))
  grads = jax.tree.map(part, grads)
  grads = grads[0] if isinstance(cfg.argnums, int) else grads
  return ((value, aux) if cfg.has_aux else value), grads


def _shares(cfg: _Config, full, dtype):
  """(keep, share, total): this device's share W_d / W of the weighted mean (see the module docstring)."""
  axis_name = cfg.axis_name
  if cfg.weight_fn is None:
    # Equal shares: 1/n, known here, so no scalar collective for the total.
    return None, jnp.asarray(1 / lax.axis_size(axis_name), dtype), None
  rest = [full[i] for i in range(len(full)) if i not in cfg.nums]
  w = jnp.asarray(cfg.weight_fn(rest[0] if len(rest) == 1 else tuple(rest)), dtype)
  if jnp.ndim(w) != 0:
    raise TypeError(f"weight_fn must return a scalar, got shape {jnp.shape(w)}")
  # A device of weight 0 (padding only: its loss may be 0/0) or of an invalid weight adds exactly nothing.
  keep = jnp.isfinite(w) & (w > 0)
  w = jnp.where(keep, w, jnp.zeros_like(w))
  total = lax.psum(w, axis_name)  # a scalar: the only collective of a micro-step
  return keep, w / jnp.where(total > 0, total, jnp.ones_like(total)), total


def _trace(call, axis_name):
  """`call()`, with JAX's errors about model code written for the global batch turned into ja.grad's own."""
  try:
    return call()
  except Exception as e:
    explained = _per_device.explain(
      e,
      axis_name,
      entry="ja.grad",
      instead="keep the annotated code and take jax.grad in your jit with ja.accumulate(...) without axis_name "
      "(one all-reduce per call), or ja.microbatch(jax.value_and_grad(loss), K) inside your jit",
    )
    if explained is None and "should match the aval mesh" in str(e):
      # A tracer of the user's jit closed over by fun: typed on the whole mesh, it meets fun's values traced on
      # one device's. Its type is fixed by the enclosing trace (a concrete array is retyped, see _program).
      raise ValueError(
        "ja.grad: the loss reads a value traced by your jit from the enclosing scope (a closure over an argument "
        "of your jit, or over a value computed in it), typed on the whole mesh; ja.grad traces the loss on one "
        "device's shapes and cannot retype it. Pass it to the loss as an argument instead, e.g. "
        "ja.grad(lambda params, batch, t: loss(params, batch, t), axis_name=...)(params, batch, t): a "
        f"replicated value reaches every device whole, one sharded over {axis_name!r} each device its part"
      ) from e
    if explained is None:
      e.add_note(
        f"(raised inside ja.grad, which runs fun on each device's rows in a jax.shard_map manual over "
        f"{axis_name!r}, without vma checking; see the own-jit guide, 'What runs, and what is refused')"
      )
      raise
    raise explained from e


def grad(
  fun: Callable,
  argnums: int | Sequence[int] = 0,
  *,
  axis_name: str,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  key_argnum: int | None = None,
  aux_reductions: Any = None,
) -> Callable:
  """`jax.grad` whose result is left unreduced over `axis_name`: `ja.value_and_grad` without the value.

  Returns grads (or `(grads, aux)` with `has_aux`). See `value_and_grad`.
  """
  vg = value_and_grad(
    fun,
    argnums,
    axis_name=axis_name,
    has_aux=has_aux,
    weight_fn=weight_fn,
    key_argnum=key_argnum,
    aux_reductions=aux_reductions,
  )

  def wrapped(*args):
    out, grads = vg(*args)
    return (grads, out[1]) if has_aux else grads

  return wrapped


def _paths(tree):
  return jax.tree.unflatten(jax.tree.structure(tree), _tree_paths(tree))


def _tree_paths(tree):
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _reduce_aux(x, mode, path, part, axis_name):
  """One aux leaf over the devices: the weighted mean (as the loss), the sum, or the rows in order ("concat")."""
  x = jnp.asarray(x)
  if mode == "concat":
    if x.ndim == 0:
      raise ValueError(f"aux{path} is a scalar: 'concat' needs a leading dimension of rows (use 'mean' or 'sum')")
    return x
  if mode == "sum":
    return lax.psum(x, axis_name)
  if _tree.is_key(x):
    raise TypeError(
      f"aux{path} is a PRNG key: ja.grad folds the typed keys of its arguments with each device's index (each "
      "device draws its own), so a key returned in aux differs per device and has no mean over them: advance "
      "the key in your step, outside ja.grad (e.g. model state with a key: keep the key out of fun's aux)"
    )
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
      f"aux{path} has dtype {x.dtype}: ja.grad returns aux as the weighted mean over devices, which needs "
      "floating leaves (return a count as a float, or pass aux_reductions='sum' or 'concat' for it)"
    )
  return lax.psum(part(x), axis_name)
