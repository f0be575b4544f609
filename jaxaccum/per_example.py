"""Per-example gradients and outputs, microbatched: `micro_grad` and `micro_vmap`.

`micro_grad(fun)` is `jax.value_and_grad` at the level of one example: for a
batch of B rows it returns

  grads = sum_r w_r T(g_r),    g_r = grad fun(params, row r),

with T = `transform_fn` (e.g. clipping to a norm: DP-SGD) and w_r =
`weight_fn(row r)` (default 1; 0 for a padding row), together with the
per-example values fun(params, row r), fun's aux and `metrics_fn(g_r)` (e.g.
the norms), in the batch's row order. `micro_vmap(fun)` is `jax.vmap` with the
same microbatching, its outputs concatenated ("concat") or reduced over the
examples ("sum", "mean").

Both are `optax.microbatching.micro_grad` / `micro_vmap` (its SUM accumulator)
built on `ja.microbatch`: the batch is split into K microbatches (microbatch i
holds rows i, i+K, ...) run in a `lax.scan`, each one `jax.vmap`ped over its
rows, so at most one microbatch of per-example gradients (B/K of them) is alive
at a time. On top of optax: weights (a row of weight 0 contributes nothing, and
a microbatch of only padding is not run: `ja.microbatch`'s `skip_empty`), and
devices (`axis_name`: the sums over every device's examples in one all-reduce,
per-example outputs gathered in global row order).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _tree, parallel
from jaxaccum.microbatch import microbatch


class MicroGradAux(NamedTuple):
  """The per-example outputs of `micro_grad`, each with a leading axis of B rows in the batch's row order.

  The fields are those of `optax.microbatching.micro_grad`'s aux, in its order.
  """

  values: Any  # fun's value on each example (the per-example loss), shape (B,).
  metrics: Any  # metrics_fn of each example's gradient (None without metrics_fn), leading axis B.
  aux: Any  # fun's aux on each example (None without has_aux), leading axis B.


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _int_tuple(value, name: str, *, allow_empty: bool = False) -> tuple[int, ...]:
  if _is_int(value):
    return (int(value),)
  if isinstance(value, (tuple, list)) and (value or allow_empty) and all(_is_int(a) for a in value):
    return tuple(int(a) for a in value)
  raise TypeError(f"{name}={value!r} must be an int or a {'' if allow_empty else 'non-empty '}tuple of ints")


def _str_tuple(value, name: str) -> tuple[str, ...]:
  if isinstance(value, str):
    return (value,)
  if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
    return tuple(value)
  raise TypeError(f"{name}={value!r} must be a string or a tuple of strings")


def _check_callable(value, name: str, what: str) -> None:
  if value is not None and not callable(value):
    raise TypeError(f"{name}={value!r} must be callable ({what}) or None")


def _num_microbatches(num_microbatches, microbatch_size) -> int | None:
  """K as given, or None when it is to be read from `microbatch_size` at call time."""
  if microbatch_size is None:
    return _tree.check_positive_int(num_microbatches, "num_microbatches")
  _tree.check_positive_int(microbatch_size, "microbatch_size")
  if num_microbatches != 1:
    raise ValueError(
      f"give num_microbatches={num_microbatches!r} or microbatch_size={microbatch_size!r}, not both "
      "(K = rows / microbatch_size)"
    )
  return None


def _resolve_k(k, microbatch_size, batch_values, axes) -> int:
  if k is not None:
    return k
  leaves = [(jnp.shape(x)[ax], ax) for b, ax in zip(batch_values, axes, strict=True) for x in jax.tree.leaves(b)]
  if not leaves:
    raise ValueError("the batch holds no arrays")
  rows = leaves[0][0]
  if rows % microbatch_size:
    raise ValueError(f"the batch's size {rows} is not divisible by microbatch_size={microbatch_size}")
  return max(rows // microbatch_size, 1)


def _row_view(x, ax: int, keep_batch_dim: bool):
  """One example as `fun` sees it: with `keep_batch_dim`, a batch of one (the size-1 axis put back at `ax`)."""
  return jax.tree.map(lambda leaf: jnp.expand_dims(leaf, ax), x) if keep_batch_dim else x


def _zero_where(w, x):
  """x with the rows of weight 0 set to zero (x has a leading axis of rows)."""
  keep = jnp.reshape(w != 0, w.shape + (1,) * (jnp.ndim(x) - 1))
  return jnp.where(keep, x, jnp.zeros((), x.dtype))


def _weighted_rows_sum(w, x):
  """sum_r w_r x_r over the leading axis; a row of weight 0 adds exactly nothing (even a NaN)."""
  if w is None:
    return jnp.sum(x, axis=0)
  wb = jnp.reshape(w, w.shape + (1,) * (jnp.ndim(x) - 1)).astype(x.dtype)
  return jnp.sum(jnp.where(wb == 0, jnp.zeros((), x.dtype), x * wb), axis=0)


def _row_weight(weight_fn, rows):
  w = jnp.asarray(weight_fn(rows[0] if len(rows) == 1 else tuple(rows)))
  if w.shape != ():
    raise ValueError(f"weight_fn must return a scalar weight per example, got shape {w.shape}")
  if not (jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer) or w.dtype == jnp.bool_):
    raise TypeError(f"weight_fn must return a real number per example, got dtype {w.dtype}")
  return w


def _microbatch_weight(weight_fn, axes, keep_batch_dim):
  """A microbatch's weight (its batch arguments as a tuple): the sum of its rows' weights, NaN if one is invalid."""

  def weigh(mb: tuple):
    one = lambda *rows: _row_weight(
      weight_fn, [_row_view(r, a, keep_batch_dim) for r, a in zip(rows, axes, strict=True)]
    )
    w = jax.vmap(one, in_axes=tuple(axes))(*mb)
    w = w.astype(jnp.result_type(w.dtype, jnp.float32))
    ok = jnp.all(jnp.isfinite(w) & (w >= 0))
    return jnp.where(ok, jnp.sum(w), jnp.full((), jnp.nan, w.dtype))

  return weigh


def micro_grad(
  fun: Callable[..., Any],
  has_aux: bool = False,
  argnums: int | Sequence[int] = 0,
  *,
  batch_argnums: int | Sequence[int] = 1,
  num_microbatches: int = 1,
  transform_fn: Callable[[Any], Any] | None = None,
  metrics_fn: Callable[[Any], Any] | None = None,
  weight_fn: Callable[[Any], Any] | None = None,
  axis_name: Any = None,
  keep_batch_dim: bool = True,
  microbatch_size: int | None = None,
  argnames: str | Sequence[str] = (),
  in_axes: int | Sequence[int] = 0,
  num_real_microbatches: Any = None,
) -> Callable[..., tuple[Any, MicroGradAux]]:
  r"""Per-example gradients, transformed and summed, microbatched: optax's `micro_grad` with weights and devices.

  For a batch of B examples (rows r of the batch arguments) the returned
  function gives `(grads, aux)` with

  .. math:: \mathrm{grads} = \sum_{r} w_r\, T(g_r), \qquad g_r = \nabla_\theta\, \mathrm{fun}(\theta, x_r),

  T = `transform_fn` (identity by default; DP-SGD clips: T(g) = g
  min(1, C / |g|)), w_r = `weight_fn` of example r (default 1), and
  `aux = MicroGradAux(values, metrics, aux)` holding, for every example in the
  batch's row order, fun's value, `metrics_fn(g_r)` (e.g. `optax.tree.norm`)
  and fun's aux. This is `optax.microbatching.micro_grad` with its SUM
  accumulator (Roulet & Agarwala, arXiv 2510.00236), names and semantics kept.

  The batch is split into K = `num_microbatches` microbatches (microbatch i:
  rows i, i+K, i+2K, ..., as `ja.microbatch` and optax split) that run in a
  `lax.scan`, each `jax.vmap`ped over its B/K rows: peak memory holds one
  microbatch of per-example gradients, B/K of them, plus the running sum.

  Weights. A row of weight 0 (padding) contributes exactly nothing to
  `grads`, even if its gradient is NaN, and its per-example outputs are zeros;
  a microbatch whose rows all weigh 0 is not run at all (`ja.microbatch`'s
  `skip_empty`), so one compiled function serves batches of any number of real
  rows. A negative or non-finite weight: a ValueError when called eagerly;
  under jit every leaf of `grads` is NaN (so `ja.accumulate(...,
  skip_nonfinite=True)` or `make_train_step` drop it rather than apply it).
  Called eagerly, a batch whose rows all weigh 0 is a ValueError (under jit:
  zero gradients).

  Devices. With `axis_name` (inside `jax.shard_map` or `jax.pmap`; each device
  holds its own rows), `grads` is the sum over every device's examples, reduced
  in one all-reduce after the loop, and the per-example outputs are gathered
  (one all-gather) in global row order: device p's rows after device p-1's.
  The differentiated arguments are cast to varying first, so replicated
  parameters under shard_map are differentiated per device, not summed by
  autodiff once per example.

  Args:
    fun: `fun(params, batch, ...)` returning a scalar (a mean over its rows
      works unchanged: with `keep_batch_dim` it sees a batch of one), or
      `(scalar, aux)` with `has_aux`.
    has_aux: fun returns `(value, aux)`; aux comes back per example.
    argnums: the argument(s) to differentiate (no batch axis).
    batch_argnums: the positional argument(s) with a batch axis.
    num_microbatches: K >= 1, dividing the number of rows (per device with
      `axis_name`). Or give `microbatch_size` instead (optax's name: rows per
      microbatch, K = rows / microbatch_size).
    transform_fn: applied to each example's gradient before the sum (e.g.
      clipping); its output is what is summed (any pytree of float arrays).
    metrics_fn: applied to each example's raw gradient; returned per example.
    weight_fn: `weight_fn(example) -> scalar` w_r, the example as fun sees it
      (a tuple when there are several batch arguments), e.g.
      `lambda ex: ex["mask"].sum()`.
    axis_name: the data axis inside shard_map/pmap (see Devices).
    keep_batch_dim: fun sees each example with a batch axis of size 1 (True,
      optax's default) or without it (False).
    microbatch_size: rows per microbatch, instead of `num_microbatches`.
    argnames: keyword argument(s) with a batch axis (passed to
      `ja.microbatch`).
    in_axes: the batch axis of each batch argument (`batch_argnums` then
      `argnames`), an int for all; default 0. A negative axis counts from
      the end of each leaf (as in `jax.vmap`); one out of range is a
      ValueError naming the argument and its shape.
    num_real_microbatches: only microbatches i < n run (an int or a traced
      scalar: no recompile); the others contribute nothing and their rows'
      per-example outputs are zeros. n = 0: zero gradients, eagerly as
      under jit.

  Returns:
    A function with fun's arguments returning `(grads, MicroGradAux)`; `grads`
    has the structure of `transform_fn`'s output (of the gradient w.r.t.
    `argnums` without it).
  """
  if not callable(fun):
    raise TypeError(f"fun={fun!r} must be callable: a loss fun(params, batch, ...)")
  if not isinstance(has_aux, bool):
    raise TypeError(f"{has_aux=} must be a bool")
  if not isinstance(keep_batch_dim, bool):
    raise TypeError(f"{keep_batch_dim=} must be a bool")
  diff = _int_tuple(argnums, "argnums")
  batch = _int_tuple(batch_argnums, "batch_argnums", allow_empty=True)
  names = _str_tuple(argnames, "argnames")
  if not batch and not names:
    raise ValueError(f"{batch_argnums=} and {argnames=} name no batch argument")
  k = _num_microbatches(num_microbatches, microbatch_size)
  _check_callable(transform_fn, "transform_fn", "per-example gradient -> what is summed")
  _check_callable(metrics_fn, "metrics_fn", "per-example gradient -> per-example metrics")
  _check_callable(weight_fn, "weight_fn", "example -> scalar weight")
  if axis_name is not None:
    parallel.validate_axis_name(axis_name)
  axes = (
    _int_tuple(in_axes, "in_axes") * (len(batch) + len(names)) if _is_int(in_axes) else _int_tuple(in_axes, "in_axes")
  )
  if len(axes) != len(batch) + len(names):
    raise ValueError(f"{in_axes=} must give one axis per batch argument ({batch_argnums=}, {argnames=})")
  argnums_out = argnums if _is_int(argnums) else diff
  value_and_grad = jax.value_and_grad(
    fun if has_aux else lambda *a, **kw: (fun(*a, **kw), None), argnums_out, has_aux=True
  )

  def per_microbatch(*args, **kwargs):
    """One microbatch: per-example gradients by vmap, transformed, weighted, summed; per-example outputs."""
    nargs = len(args)
    idx = [i % nargs for i in batch]
    values = [args[i] for i in idx] + [kwargs[n] for n in names]

    def one(*rows):
      views = [_row_view(r, a, keep_batch_dim) for r, a in zip(rows, axes, strict=True)]
      call_args, call_kwargs = list(args), dict(kwargs)
      for i, v in zip(idx, views, strict=False):
        call_args[i] = v
      for n, v in zip(names, views[len(idx) :], strict=True):
        call_kwargs[n] = v
      (value, aux), g = value_and_grad(*call_args, **call_kwargs)
      w = None if weight_fn is None else _row_weight(weight_fn, views)
      summed = g if transform_fn is None else transform_fn(g)
      metrics = None if metrics_fn is None else metrics_fn(g)
      return summed, MicroGradAux(value, metrics, aux), w

    summed, per, w = jax.vmap(one, in_axes=tuple(axes))(*values)
    grads = jax.tree.map(functools.partial(_weighted_rows_sum, w), summed)
    if w is not None:
      per = jax.tree.map(functools.partial(_zero_where, w), per)
    return grads, per

  def wrapped(*args, **kwargs):
    nargs = len(args)
    for name, nums in (("argnums", diff), ("batch_argnums", batch)):
      for a in nums:
        if not -nargs <= a < nargs:
          raise ValueError(f"{name}={a} is out of range for a call with {nargs} positional arguments")
    if {a % nargs for a in diff} & {a % nargs for a in batch}:
      raise ValueError(f"{argnums=} and {batch_argnums=} name the same argument: the parameters have no batch axis")
    missing = [n for n in names if n not in kwargs]
    if missing:
      raise ValueError(f"{argnames=}: the call has no keyword argument {missing[0]!r}")
    call = list(args)
    if axis_name is not None:
      parallel.check_axis_name(axis_name)
      for a in diff:
        call[a] = parallel.to_varying(call[a], axis_name)
    values = [call[i] for i in batch] + [kwargs[n] for n in names]
    mb_weight = None
    if weight_fn is not None:
      by_rows = _microbatch_weight(weight_fn, axes, keep_batch_dim)
      mb_weight = lambda mb: by_rows((mb,) if len(values) == 1 else tuple(mb))
    run = microbatch(
      per_microbatch,
      _resolve_k(k, microbatch_size, values, axes),
      batch_argnums=batch,
      argnames=names,
      in_axes=axes,
      weight_fn=mb_weight,
      axis_name=axis_name,
      reductions=("sum", "concat"),
      return_total_weight=True,
      skip_empty=weight_fn is not None,
      num_real_microbatches=num_real_microbatches,
    )
    (grads, per), total = run(*call, **kwargs)
    if weight_fn is not None:
      # An invalid traced weight makes the total NaN: make the gradient say so too.
      grads = jax.tree.map(lambda g: jnp.where(jnp.isnan(total), jnp.full((), jnp.nan, g.dtype), g), grads)
    return grads, per

  return wrapped


REDUCTIONS = ("concat", "sum", "mean")


def micro_vmap(
  fun: Callable[..., Any],
  in_axes: int | None | Sequence[int | None] = 0,
  out_axes: int = 0,
  *,
  num_microbatches: int = 1,
  reductions: Any = "concat",
  weight_fn: Callable[[Any], Any] | None = None,
  axis_name: Any = None,
  microbatch_size: int | None = None,
  num_real_microbatches: Any = None,
) -> Callable[..., Any]:
  r"""`jax.vmap`, microbatched: `optax.microbatching.micro_vmap` with weights and devices.

  `micro_vmap(fun, in_axes)(*args, **kwargs)` equals `jax.vmap(fun,
  in_axes)(*args, **kwargs)` (outputs with a leading axis of B examples, in
  row order) while holding only one microbatch of B/K examples' intermediate
  values at a time: the examples are split into K microbatches (microbatch i:
  examples i, i+K, ...) run in a `lax.scan` by `ja.microbatch`. Keyword
  arguments are mapped over their axis 0, as `jax.vmap` maps them.

  `reductions` (a tree prefix of fun's output; a single string for all):
  `"concat"` (default: the vmap's stacked outputs), `"sum"` (sum_r w_r o_r
  over the examples, never materialising them all) or `"mean"`
  (sum_r w_r o_r / sum_r w_r), w_r = `weight_fn(example r)` (default 1).
  A row of weight 0 adds nothing to sums and means (its "concat" output is
  zeros); a microbatch of only such rows is not run. With `axis_name`, sums
  and means run over every device's examples (one all-reduce) and "concat" is
  gathered in global row order.

  Args:
    fun: the function to map over examples.
    in_axes: as `jax.vmap`'s, per positional argument (None: not mapped), or
      one int for all of them (negative: from the end of each leaf). Every
      mapped axis holds the B examples.
    out_axes: 0 (the only value supported, as in optax).
    num_microbatches: K >= 1 dividing B (per device with `axis_name`); or
      `microbatch_size` (examples per microbatch) instead.
    reductions: how each output leaf combines over examples (see above).
    weight_fn: `weight_fn(example) -> scalar`, the example being the mapped
      arguments of one row (a tuple when there are several; keyword arguments
      are not passed to it).
    axis_name: the data axis inside shard_map/pmap.
    microbatch_size: examples per microbatch, instead of `num_microbatches`.
    num_real_microbatches: only microbatches i < n run (int or traced scalar);
      the others contribute nothing ("concat": zeros).

  Returns:
    The mapped function.
  """
  if not callable(fun):
    raise TypeError(f"fun={fun!r} must be callable")
  if out_axes != 0:
    raise ValueError(f"{out_axes=} is not supported: outputs are mapped over axis 0")
  if in_axes is not None and not _is_int(in_axes):
    if not (isinstance(in_axes, (tuple, list)) and all(a is None or _is_int(a) for a in in_axes)):
      raise TypeError(f"{in_axes=} must be an int, None, or a tuple of ints and Nones (one per positional argument)")
  k = _num_microbatches(num_microbatches, microbatch_size)
  _check_callable(weight_fn, "weight_fn", "example -> scalar weight")
  if axis_name is not None:
    parallel.validate_axis_name(axis_name)
  for path, r in jax.tree_util.tree_leaves_with_path(reductions):
    if r not in REDUCTIONS:
      raise ValueError(f"reductions{jax.tree_util.keystr(path)}={r!r} is not one of {', '.join(map(repr, REDUCTIONS))}")

  def wrapped(*args, **kwargs):
    nargs = len(args)
    axes: list[int | None]
    if in_axes is None or isinstance(in_axes, int):
      axes = [in_axes] * nargs
    else:
      axes = list(in_axes)
      if len(axes) != nargs:
        raise ValueError(f"{in_axes=} gives {len(axes)} axes for a call with {nargs} positional arguments")
    mapped = [i for i, a in enumerate(axes) if a is not None]
    if not mapped and not kwargs:
      raise ValueError(f"{in_axes=} maps no argument: there are no examples to map over")
    # Keyword arguments travel as one extra positional dict, mapped over axis 0 (jax.vmap's rule for them).
    batch = tuple(mapped) + ((nargs,) if kwargs else ())
    weight_axes = tuple(a for a in axes if a is not None)  # those of the mapped positional arguments, in order
    batch_axes = weight_axes + ((0,) if kwargs else ())
    seen: dict[str, Any] = {}

    def per_microbatch(*call):
      pos, kw = (call[:nargs], call[nargs]) if kwargs else (call, {})
      out = jax.vmap(lambda p, k_: fun(*p, **k_), in_axes=(axes, 0 if kw else None))(list(pos), kw)
      leaves, seen["treedef"] = jax.tree.flatten(out)
      seen["reductions"] = reds = _leaf_reductions(reductions, out)
      if weight_fn is None:
        w, wsum = None, jnp.asarray(leaves[0].shape[0] if leaves else 0, jnp.float32)
      else:
        rows = [pos[i] for i in mapped]
        w = jax.vmap(lambda *r: _row_weight(weight_fn, list(r)), in_axes=weight_axes)(*rows)
        w = w.astype(jnp.result_type(w.dtype, jnp.float32))
        wsum = jnp.sum(w)
      if axis_name is not None:  # a count of rows is the same on every device: mark it as this device's own
        wsum = parallel.to_varying(wsum, axis_name)
      concat = [o if w is None else _zero_where(w, o) for o, r in zip(leaves, reds, strict=True) if r == "concat"]
      summed = [_weighted_rows_sum(w, o) for o, r in zip(leaves, reds, strict=True) if r != "concat"]
      return concat, summed, wsum

    mb_weight = None
    if weight_fn is not None:
      by_rows = _microbatch_weight(weight_fn, weight_axes, False)
      mb_weight = lambda mb: by_rows(tuple((mb,) if len(batch) == 1 else mb)[: len(mapped)])
    values = [args[i] for i in mapped] + ([kwargs] if kwargs else [])
    run = microbatch(
      per_microbatch,
      _resolve_k(k, microbatch_size, values, batch_axes),
      batch_argnums=batch,
      weight_fn=mb_weight,
      axis_name=axis_name,
      in_axes=batch_axes,
      reductions=("concat", "sum", "sum"),
      skip_empty=weight_fn is not None,
      num_real_microbatches=num_real_microbatches,
    )
    concat, summed, wsum = run(*args, *([kwargs] if kwargs else []))
    concat, summed = iter(concat), iter(summed)
    safe = jnp.where(wsum == 0, jnp.ones((), wsum.dtype), wsum)
    out = []
    for r in seen["reductions"]:
      if r == "concat":
        out.append(next(concat))
      elif r == "sum":
        out.append(next(summed))
      else:  # "mean": sum_r w_r o_r / sum_r w_r (0 when nothing ran)
        o = next(summed)
        out.append(jnp.where(wsum == 0, jnp.zeros((), o.dtype), o / safe.astype(o.dtype)))
    return jax.tree.unflatten(seen["treedef"], out)

  return wrapped


def _leaf_reductions(reductions, outs) -> list[str]:
  """The reduction of each leaf of `outs` (`reductions` a tree prefix of it)."""
  if isinstance(reductions, str):
    return [reductions] * len(jax.tree.leaves(outs))
  try:
    subtrees = jax.tree.structure(reductions).flatten_up_to(outs)  # type: ignore[attr-defined]
  except (ValueError, TypeError) as e:
    raise ValueError(f"reductions={reductions!r} is not a tree prefix of fun's outputs: {e}") from None
  return [r for r, sub in zip(jax.tree.leaves(reductions), subtrees, strict=True) for _ in jax.tree.leaves(sub)]
