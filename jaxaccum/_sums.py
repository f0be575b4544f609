"""The microbatch loop and its reductions: plan -> local sums -> reduce (`finish`).

`local_sums` runs `fun` on each microbatch in a `lax.scan` and keeps, per
output leaf, an unnormalised running value on this device (a `Sums`):

  "mean": sum_i w_i o_i,  "sum": sum_i o_i,  "concat": the (m, K, ...) rows,  "last": o_{K-1},

with sum_i w_i alongside. `finish` then does the one all-reduce (with an
axis), divides the means by the total weight and puts concatenated rows back
in the batch's order. Nothing here divides or communicates before `finish`, so
`make_train_step` can reduce the same sums its own way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxaccum import _tree, _unreduced, parallel
from jaxaccum._split import Split, _typed_spec

REDUCTIONS = ("mean", "sum", "concat", "last")


_ADD = "add"  # internal (not a user's reduction): every microbatch's output added as it is
# Internal: the default of an aux / output leaf left unnamed (docs/guides/microbatch.md, "Per-example outputs"):
# "concat" when its leading size follows the rows (a per-example value, returned in row order), else "mean" (`per_row`).
PER_ROW = "per-row default"


def _check_reductions(reductions) -> None:
  """Every leaf of `reductions` must name a reduction (checked at construction)."""
  if reductions is None:
    return
  for path, r in jax.tree_util.tree_leaves_with_path(reductions, is_leaf=lambda x: x is None):
    if not (isinstance(r, str) and r in REDUCTIONS):
      raise ValueError(
        f"reductions{jax.tree_util.keystr(path)}={r!r} is not a reduction: use one of "
        f"{', '.join(repr(n) for n in REDUCTIONS)}"
      )


def check_prefix(reductions, tree, name: str) -> None:
  """A ValueError naming `name` and the paths when `reductions` is not a tree prefix of `tree`."""
  if reductions is None or isinstance(reductions, str):
    return
  try:
    jax.tree.structure(reductions).flatten_up_to(tree)  # type: ignore[attr-defined]
  except (ValueError, TypeError):
    have = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    named = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(reductions)]
    missing = [p for p in named if not any(h.startswith(p) for h in have)]
    raise ValueError(
      f"{name}={reductions!r} does not match the tree it names (a tree prefix of it is needed): "
      f"{name} has {', '.join(missing) or 'a different structure'} where the tree's leaves are at "
      f"{', '.join(have[:8]) or '(none)'}{' ...' if len(have) > 8 else ''}"
    ) from None


def _leaf_reductions(
  reductions, outs, name: str = "fun's output", arg: str = "reductions=", *, rows=None, probe=None
) -> list[str]:
  """The reduction of each leaf of `outs`, `reductions` being a tree prefix of `outs`; checks dtypes.

  `name` and `arg`: how errors name the outputs and the argument to change (make_train_step: "aux",
  "aux_reductions="). `PER_ROW` (the default) resolves by `per_row` with `rows` and `probe`; with `rows`
  unknown (None) a leaf of rank >= 1 keeps `PER_ROW` and its dtype is checked later.
  """
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(outs)]
  leaves = jax.tree.leaves(outs)
  if reductions is None:
    reds = ["mean"] * len(leaves)
  else:
    try:
      subtrees = jax.tree.structure(reductions).flatten_up_to(outs)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"reductions={reductions!r} is not a tree prefix of fun's outputs (structure {jax.tree.structure(outs)}): {e}"
      ) from None
    reds = [r for r, sub in zip(jax.tree.leaves(reductions), subtrees, strict=True) for _ in jax.tree.leaves(sub)]
  if rows is not None:
    reds = per_row(reds, leaves, paths, rows, probe, name, arg)
  else:
    reds = ["mean" if r == PER_ROW and not jnp.shape(leaf) else r for leaf, r in zip(leaves, reds, strict=True)]
  for path, leaf, r in zip(paths, leaves, reds, strict=True):
    if r == PER_ROW:
      continue
    dtype = leaf.dtype
    if (axes := _unreduced.axes_of(leaf)) and r not in ("mean", "sum"):
      raise ValueError(
        f"fun's output{path} is unreduced over {axes} (a partial sum per device, as ja.grad returns), reduced "
        f'with {r!r}: only "mean" and "sum" combine partial sums. Reduce it inside fun (jax.reshard(x, P())) '
        'or name "mean" or "sum" for it in reductions='
      )
    floating = jnp.issubdtype(dtype, jnp.inexact)
    if r == "mean" and not floating:
      raise TypeError(
        f'{name}{path} has dtype {dtype}: its weighted mean (the default reduction, "mean") '
        f"would be truncated. Name another reduction for it in {arg}: "
        '"sum" (a count), '
        '"last" (a flag, a counter, non-float state) or "concat" (per-example values); or '
        "return it as a float (e.g. count.astype(jnp.float32))"
      )
    if r in ("sum", _ADD) and not (floating or (jnp.issubdtype(dtype, jnp.integer))):
      raise TypeError(
        f'{name}{path} has dtype {dtype}, which has no sum: use reductions "last" or "concat" '
        "for it, or cast it to an integer or float"
      )
  return reds


def per_row(reds: list, leaves: list, paths: list, rows: int, probe, name: str, arg: str) -> list[str]:
  """The one per-example rule (docs/guides/microbatch.md, "Per-example outputs"): each `PER_ROW` leaf resolved.

  A leaf is per-example ("concat", returned in row order) when its leading
  size follows the rows: it is `rows` at `rows` rows per microbatch and `2 rows`
  at twice as many. One whose shape does not change with the rows is one value
  per microbatch ("mean"). Only a leaf whose leading size equals `rows` needs
  the second look: `probe(2 * rows)` gives the outputs' shapes (a flat list, the
  order of `leaves`) at twice the rows, traced abstractly. The rule never
  depends on K or on a coincidence of sizes (a per-class vector as long as a
  microbatch stays a mean at every K). A leaf whose leading size changes with
  the rows in another way, or outputs that cannot be traced at twice the rows,
  are refused, naming the leaf and `arg`.
  """
  reds = list(reds)
  undecided = []
  for j, (leaf, r) in enumerate(zip(leaves, reds, strict=True)):
    if r != PER_ROW:
      continue
    shape = tuple(jnp.shape(leaf))
    if shape and shape[0] == rows:
      undecided.append(j)
    else:
      reds[j] = "mean"
  if not undecided:
    return reds
  named = ", ".join(f"{name}{paths[j]}" for j in undecided)
  if probe is None:
    raise ValueError(
      f"{named} has {rows} rows first, as many as a microbatch: name its reduction in {arg} "
      '("concat" for per-example values, "mean" for one value per microbatch)'
    )
  try:
    again = [tuple(jnp.shape(x)) for x in probe(2 * rows)]
  except Exception as e:
    raise ValueError(
      f"{named} has {rows} rows first, as many as a microbatch. jaxaccum tells a per-example leaf (concatenated "
      f"in row order) from one value per microbatch (averaged) by whether its leading size follows the rows, "
      f"seen by tracing the shapes at {2 * rows} rows, which failed ({type(e).__name__}: {str(e)[:300]}). Name its "
      f'reduction in {arg}: "concat" for per-example values, "mean" otherwise'
    ) from None
  for j in undecided:
    shape = tuple(jnp.shape(leaves[j]))
    if again[j] == (2 * rows, *shape[1:]):
      reds[j] = "concat"
    elif again[j] == shape:
      reds[j] = "mean"
    else:
      raise ValueError(
        f"{name}{paths[j]} has shape {shape} at {rows} rows per microbatch and {again[j]} at {2 * rows}: its "
        "leading size changes with the rows but is not the rows, so it is neither per-example (concatenated in "
        f'row order) nor one value per microbatch (averaged). Name its reduction in {arg} ("sum", "last", ...)'
      )
  return reds


def shapes_at(run, first: tuple, axes: tuple, rows: int) -> list:
  """The abstract outputs of `run(microbatches, 0)` with `rows` rows on each batch argument's axis (no FLOPs).

  Each leaf keeps its dtype, its typed sharding and its varying manual axes,
  so that it traces where the real microbatch does.
  """

  def resized(x, a):
    t = jax.typeof(x)
    shape = list(t.shape)
    shape[a % len(shape)] = rows
    sharding = t.sharding if getattr(t.sharding, "spec", None) is not None and not t.sharding.mesh.empty else None
    return jax.ShapeDtypeStruct(tuple(shape), t.dtype, sharding=sharding, manual_axis_type=t.manual_axis_type)

  resized_mbs = tuple(jax.tree.map(lambda x, a=a: resized(x, a), mb) for mb, a in zip(first, axes, strict=True))
  return jax.tree.leaves(jax.eval_shape(lambda mbs: run(mbs, 0), resized_mbs))


def _check_concat_rows(like, reds, rows: int) -> None:
  """A "concat" leaf must have a microbatch's rows first (or be a scalar): anything else cannot be put in row order."""
  for (path, s), r in zip(jax.tree_util.tree_leaves_with_path(like), reds, strict=True):
    if r == "concat" and s.ndim and s.shape[0] != rows:
      raise ValueError(
        f'fun\'s output{jax.tree_util.keystr(path)} has shape {s.shape}, reduced with "concat": its leading size '
        f"{s.shape[0]} is not the {rows} rows of a microbatch, so it cannot be put back in the batch's row order. "
        'Return per-example values with the microbatch\'s rows first, a scalar per microbatch, or use "sum"/"last"'
      )


class Sums(NamedTuple):
  """The microbatch loop's result on one device, before any division or collective."""

  accs: list  # per output leaf: sum w o ("mean"), sum o ("sum"), the (m, K, ...) buffer ("concat"), last value
  wsum: jax.Array  # sum of the weights, in the accumulation dtype
  ok: jax.Array  # every weight finite and >= 0
  reds: list[str]  # each output leaf's reduction
  like: Any  # the output tree of one microbatch (abstract values), for the structure and dtypes
  single: Any  # K = 1 without skipping: fun's output itself (exact), else None


def _weight_ok(w) -> jax.Array:
  """A weight must be finite and >= 0 (0 meaning: this microbatch is all padding)."""
  return jnp.isfinite(w) & (w >= 0)


def _weighted(out, w, dtype):
  """w * out in `dtype`; exactly 0 where w == 0, so an all-padding microbatch (0/0 = NaN loss) adds nothing."""
  w = w.astype(dtype)
  value = out.astype(dtype) * w
  # lax.select, not jnp.where: jnp.where is a jitted function, one more call per leaf for XLA to inline.
  return lax.select(w == 0, jnp.zeros_like(value), value)  # a scalar predicate: the value's sharding kept


def _wdtype(leaves, reds, override) -> jnp.dtype:
  """The dtype weights are summed in: the widest accumulator of the averaged leaves (float32 at least)."""
  return _tree.widest(
    _tree.accumulator_dtype(o.dtype, override) for o, r in zip(leaves, reds, strict=True) if r in ("mean", "sum", _ADD)
  )


def local_sums(run, sp: Split, ws, *, reductions=None, accumulator_dtype=None, skip=False, check_batch=True) -> Sums:
  """The microbatch loop: `run(microbatches, i)` for i < K in a `lax.scan`, combined per `reductions`.

  `ws` holds the K weights (`weights`); with `skip=True` a microbatch of weight
  <= 0 (or NaN) is not run (`lax.cond`). `skip` may instead be a bool vector of
  K, the microbatches to run (the same on every device when `run` holds
  collectives: fsdp's per-microbatch gathers); a microbatch run with weight 0
  then writes nothing to any reduction ("concat" rows stay 0, "last" keeps
  the last microbatch of weight > 0). Nothing is divided and nothing crosses
  devices: `finish` (or make_train_step's reducer) does that. `PER_ROW`
  leaves resolve by `per_row` (traced at twice the rows only when a leaf's
  leading size is a microbatch's rows); `reductions` may be a function of the
  outputs' abstract tree giving the reductions.
  """
  first = sp.take(0)
  index = jax.ShapeDtypeStruct((), jnp.arange(sp.k).dtype)  # the scan's microbatch index
  # `run` is traced once, here: the loop below binds this jaxpr as one call instead of tracing
  # the user's loss, its gradient and the layerwise gathers a second time (half of the step's trace time).
  closed, like = jax.make_jaxpr(run, return_shape=True)(first, index)
  if sp.k > 1 and check_batch:
    _check_depends_on_batch(closed.jaxpr, len(jax.tree.leaves(first)), len(jax.tree.leaves(like)))
  shapes, treedef = jax.tree.flatten(like)
  if callable(reductions):  # ja.microbatch's default: a tree built from the outputs' structure
    reductions = reductions(like)
  probe = lambda rows: shapes_at(run, first, sp.axes, rows)
  reds = _leaf_reductions(reductions, like, rows=sp.rows, probe=probe)
  _check_concat_rows(like, reds, sp.rows)
  ws = ws.astype(_wdtype(shapes, reds, accumulator_dtype))
  ok, wsum = jnp.all(_weight_ok(ws)), jnp.sum(ws)
  flatten = treedef.flatten_up_to  # type: ignore[attr-defined]  # jaxlib types PyTreeDef loosely
  replay = _tree.bind_as_call(closed)

  def run(mbs, i):  # type: ignore[no-redef]  # the same function, traced once
    outs = replay(*jax.tree.leaves(mbs), jnp.asarray(i, index.dtype))
    # A constant output (a Python float) comes back as the jaxpr's literal: an array again, typed as traced.
    return jax.tree.unflatten(treedef, [jnp.asarray(o, s.dtype) for o, s in zip(outs, shapes, strict=True)])

  if sp.k == 1 and skip is False:
    out = run(first, 0)
    accs = [
      _update(_init(jax.typeof(o), r, 1, accumulator_dtype), o, ws[0], 0, r)
      for o, r in zip(flatten(out), reds, strict=True)
    ]
    return Sums(accs, wsum, ok, reds, like, out)
  acc0 = [_init(s, r, sp.k, accumulator_dtype) for s, r in zip(shapes, reds, strict=True)]
  masked = skip is not False and skip is not True

  def body(accs, i):
    w = ws[i]

    def add(accs):
      new = [_update(a, o, w, i, r) for a, o, r in zip(accs, flatten(run(sp.take(i), i)), reds, strict=True)]
      if masked:  # run for another device's sake: this device's padding leaves every reduction as it was
        new = [
          jnp.where(w > 0, n, a) if r in ("concat", "last") else n for n, a, r in zip(new, accs, reds, strict=True)
        ]
      return new

    # The sums travel through the cond, so a skipped microbatch writes nothing: no
    # zeros-sized output to add, and "last" keeps the last microbatch that ran.
    # NaN > 0 is False: an invalid weight is not run either (ok records it).
    if skip is False:
      return add(accs), None
    return parallel.cond(skip[i] if masked else w > 0, add, lambda accs: accs, accs), None

  accs, _ = lax.scan(body, acc0, jnp.arange(sp.k))
  return Sums(accs, wsum, ok, reds, like, None)


def _check_depends_on_batch(jaxpr, n_batch: int, n_out: int) -> None:
  """Raises when none of `fun`'s outputs depends on the batch (the first `n_batch` inputs).

  A backward pass over the top-level equations (an equation with a sub-jaxpr
  counts as using all its inputs), so it can only err towards "depends".
  """
  needed = {v for v in jaxpr.outvars[:n_out] if not isinstance(v, jax.extend.core.Literal)}
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars):
      needed.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
  if n_batch and n_out and not any(v in needed for v in jaxpr.invars[:n_batch]):
    raise ValueError(
      "fun's outputs do not depend on its batch argument(s) (batch_argnums, argnames), so every "
      "microbatch would compute the same thing. If fun closes over the batch (def loss(params): "
      "... batch ...), take the batch as an argument instead: def loss(params, batch), and pass "
      "it in the call; microbatch splits that argument."
    )


def _zeros(s, dtype, shape=None):
  """Zeros of `shape` (default `s.shape`) with `s`'s varying axes and typed sharding: a scan carry must keep them.

  A concat buffer (m, K, ...) of an output typed as sharded over an Explicit axis
  (a batch sharded over "data") keeps that sharding on its rows.
  """
  sharding = _typed_spec(s)
  if sharding is not None:
    entries = list(sharding.spec) + [None] * (len(s.shape) - len(sharding.spec))
    if shape is not None and shape != s.shape:
      entries = [entries[0], None, *entries[1:]] if s.shape else [None]
    with _unreduced.creating_on(sharding.mesh):  # under the user's jit with no mesh set: JAX 0.11+ needs it set
      z = jnp.zeros(
        s.shape if shape is None else shape, dtype, out_sharding=NamedSharding(sharding.mesh, PartitionSpec(*entries))
      )
  else:
    z = jnp.zeros(s.shape if shape is None else shape, dtype)
  axes = tuple(sorted((parallel._varying_axes(s) or frozenset()) - (parallel._varying_axes(z) or frozenset())))
  return lax.pcast(z, axes, to="varying") if axes else z


def _concat_shape(shape, k) -> tuple[int, ...]:
  """A per-example leaf (m, ...) is kept as (m, K, ...) (row j of microbatch i at [j, i]); a scalar as (K,)."""
  return (k,) if not shape else (shape[0], k) + tuple(shape[1:])


def _init(s, r, k, override):
  if r == "mean" or (r in ("sum", _ADD) and jnp.issubdtype(s.dtype, jnp.inexact)):
    if _unreduced.axes_of(s):  # ja.grad's partial sums: the running sum stays one (no collective in the loop)
      return _unreduced.zeros_like(s, _tree.accumulator_dtype(s.dtype, override))
    return _zeros(s, _tree.accumulator_dtype(s.dtype, override))
  if r == "concat":
    return _zeros(s, s.dtype, _concat_shape(s.shape, k))
  return _zeros(s, s.dtype)  # "sum" of integers (in their dtype), "last"


def _update(acc, o, w, i, r):
  """The carry after microbatch i of weight w contributed output o."""
  if r in ("mean", "sum") and (axes := _unreduced.axes_of(acc)):
    # A partial sum per device: the replicated weight is cast to reduced to scale it, and the weight-0 case
    # selects unreduced zeros (a replicated 0 cannot be added to an unreduced value).
    v = o.astype(acc.dtype)
    v = _unreduced.scale(v, w, axes) if r == "mean" else v
    return acc + jnp.where(w == 0, jnp.zeros_like(v), v)
  if r == "mean":
    return acc + _weighted(o, w, acc.dtype)
  if r == _ADD:  # make_train_step's gradient shares: weighted already, and after fsdp's reduce-scatter
    return acc + o.astype(acc.dtype)  # they hold the other devices' terms too, whatever the local weight
  if r == "sum":  # unweighted, but a weight-0 microbatch (padding) adds nothing
    return acc + jnp.where(w == 0, jnp.zeros((), acc.dtype), o.astype(acc.dtype))
  if r == "concat":
    # In place into the (m, K, ...) buffer: no (K, m, ...) stack to transpose afterwards.
    return lax.dynamic_update_index_in_dim(acc, o.astype(acc.dtype), i, axis=0 if o.ndim == 0 else 1)
  return o  # "last"


def _checked_total(wsum, ok, *, none_real: bool = False):
  """The total weight, NaN when some weight was invalid; a ValueError when concrete and unusable.

  `none_real`: the caller asked for no microbatch (`num_real_microbatches=0`), so a total of 0 is the answer
  (zeros, as under jit and as optax gives), not an all-padding batch.
  """
  total = jnp.where(ok, wsum, jnp.full((), jnp.nan, wsum.dtype))
  if _tree.is_concrete(total):
    if not bool(ok):
      raise ValueError(
        "weight_fn returned a negative or non-finite weight for a microbatch: weights "
        "must be finite and >= 0 (e.g. the number of real rows or tokens)"
      )
    if float(total) == 0 and not none_real:
      raise ValueError(
        "every microbatch has weight 0 (weight_fn gave 0 for all of them: the batch is all "
        "padding?), so there is nothing to average"
      )
  return total


def _single(o, r, total):
  """K = 1 without an axis: the reduction of one microbatch, exactly."""
  if r == "mean":
    nan = jnp.full((), jnp.nan, o.dtype)
    return jnp.where(total == 0, jnp.zeros((), o.dtype), jnp.where(jnp.isnan(total), nan, o))
  if r == "sum":
    return jnp.where(total == 0, jnp.zeros((), o.dtype), o)
  if r == "concat" and o.ndim == 0:
    return o[None]
  return o


def finish(sums: Sums, axis_name, *, total=None, extra=None, none_real: bool = False):
  """`Sums` -> (outputs, total weight): means divided by the total, sums as they are, concat buffers reshaped.

  With `axis_name`, one all-reduce of (every mean and sum carry, sum w, bad
  count) and one all-gather of the concat buffers; "last" stays per device.
  A total weight of 0 gives means of 0 (not 0/0); an invalid weight gives NaN.
  `total`: the global total weight when the caller reduced it already (then
  only the carries are reduced). `extra`: more arrays summed over the axis in
  the same all-reduce (make_train_step's replicated gradient leaves); given,
  the result is `(outputs, total, extra summed)`. `none_real`: see `_checked_total`.
  """
  like_leaves, treedef = jax.tree.flatten(sums.like)
  reds, wsum, ok = sums.reds, sums.wsum, sums.ok
  reduced = [i for i, r in enumerate(reds) if r in ("mean", "sum", _ADD)]
  accs = list(sums.accs)
  if axis_name is not None:
    parallel.check_varying([accs[i] for i in reduced], axis_name, arg="outputs")
    # One psum over operands of mixed varying-ness lowers to several
    # all-reduces (invariant ones apart); cast all to varying to get one.
    # The validity flag travels as a count of bad microbatches in the same psum.
    bad = (~ok).astype(wsum.dtype)
    scalars = () if total is not None else (wsum, bad)
    sent = parallel.to_varying(([accs[i] for i in reduced], scalars, extra), axis_name)
    got, scalars, extra = parallel.all_reduce_sum(sent, axis_name)
    for i, a in zip(reduced, got, strict=True):
      accs[i] = a
    if total is None:
      wsum, bad = scalars
      ok = bad == 0
  if total is None:
    total = _checked_total(wsum, ok, none_real=none_real)
  safe = jnp.where(total == 0, jnp.ones((), total.dtype), total)
  outs = []
  for a, o, r in zip(accs, like_leaves, reds, strict=True):
    if r == "mean" and (axes := _unreduced.axes_of(a)):  # still partial sums: no `/` on them, a reduced reciprocal
      a = _unreduced.scale(a, jnp.where(total == 0, jnp.zeros((), total.dtype), 1 / safe), axes)
    elif r == "mean":
      a = jnp.where(total == 0, jnp.zeros((), a.dtype), a / safe.astype(a.dtype))
    elif r == "concat":
      a = _merge_rows(a) if o.ndim else a
      if axis_name is not None:
        a = _gather_rows(a, axis_name)
    outs.append(a.astype(o.dtype))
  out = jax.tree.unflatten(treedef, outs)
  return (out, total) if extra is None else (out, total, extra)


def _reduce_partial_sums(sums: Sums, axis_name) -> Sums:
  """Own-jit mode (`axis_name` an Explicit mesh axis, not bound): the unreduced carries summed over the devices.

  Inside the user's `jax.jit` on an Explicit mesh arrays are global: the weights
  (weight_fn ran on the global microbatches), a loss that `ja.grad` reduced, a
  "concat" buffer. Only `ja.grad`'s gradients are partial sums, and their
  running sums stayed so in the loop; each is reduced here, once per call (one
  all-reduce: `jax.reshard` to replicated). `finish` without an axis then
  divides. When no output is unreduced, `fun`'s gradients came back reduced on
  every microbatch (jax.grad on a sharded batch: K all-reduces per call): refused.
  """
  like = jax.tree.leaves(sums.like)
  if not any(_unreduced.is_unreduced(s, axis_name) for s in like):
    raise ValueError(
      f"ja.microbatch(..., {axis_name=}) in a jax.jit on an Explicit mesh: none of fun's outputs is unreduced over "
      f"{axis_name!r}, so they are global already; a jax.grad gradient of a loss on a batch sharded over "
      f"{axis_name!r} was all-reduced on every microbatch (K all-reduces per call). Take it with "
      f"ja.grad(loss, axis_name={axis_name!r}) (or ja.value_and_grad): the loop then adds partial sums and "
      "the call reduces once. (Without gradients there is nothing to reduce: leave axis_name out.)"
    )
  accs = [
    _unreduced.reduce(a, axis_name) if _unreduced.is_unreduced(s, axis_name) else a
    for a, s in zip(sums.accs, like, strict=True)
  ]
  return sums._replace(accs=accs)


def _gather_rows(x, axis_name):
  """All devices' rows in device order (tiled on axis 0); invariant over the axis under shard_map."""
  if parallel.vma_tracking(axis_name):
    return lax.all_gather(parallel.to_varying(x, axis_name), axis_name, axis=0, tiled=True, to="invarying")
  return lax.all_gather(x, axis_name, axis=0, tiled=True)


def _merge_rows(a):
  """(m, K, ...) -> (m K, ...): row j of microbatch i is batch row j K + i (free; keeps a typed row sharding)."""
  shape = (a.shape[0] * a.shape[1],) + tuple(a.shape[2:])
  sharding = _typed_spec(jax.typeof(a))
  if sharding is None:
    return jnp.reshape(a, shape)
  entries = list(sharding.spec) + [None] * (a.ndim - len(sharding.spec))
  return jnp.reshape(a, shape, out_sharding=NamedSharding(sharding.mesh, PartitionSpec(entries[0], *entries[2:])))
