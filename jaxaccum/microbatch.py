"""In-step microbatching: one call, a `lax.scan` over K microbatches, memory of one.

`microbatch(fun, K)` wraps `fun` (typically `jax.value_and_grad(loss_fn)`) so
that one call runs `fun` on K slices of the batch in sequence and returns the
weighted mean of the K results:

  out = sum_i w_i out_i / sum_i w_i,   out_i = fun(..., batch_i, ...),

with w_i = weight_fn(batch_i) (default 1). When `fun`'s outputs are means over
the rows of their microbatch (a mean loss, its gradient) and w_i is the number
of rows (or tokens) batch_i holds, `out` is `fun` on the whole batch exactly.

Microbatch i holds rows i, i+K, i+2K, ... Each leaf of shape (B, ...) is viewed
as (B/K, K, ...) (a free reshape of a contiguous array) and the loop body takes
index i on axis 1. So the batch is never copied or transposed, and a batch
sharded on its leading axis over P devices (B/K divisible by P) keeps every
microbatch evenly sharded: no all-to-all, no collective-permute.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum import _tree
from jaxaccum import parallel


def _check_int_arg(value, name: str) -> int:
  """An int (not a bool: `key_argnum=True` is a bug, not argument 1)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
  return int(value)


def _normalize_argnums(batch_argnums) -> tuple[int, ...]:
  if isinstance(batch_argnums, numbers.Integral) and not isinstance(batch_argnums, (bool, np.bool_)):
    return (int(batch_argnums),)
  if isinstance(batch_argnums, (tuple, list)) and batch_argnums and all(
      isinstance(a, numbers.Integral) and not isinstance(a, (bool, np.bool_)) for a in batch_argnums):
    return tuple(int(a) for a in batch_argnums)
  raise TypeError(f"{batch_argnums=} must be an int or a non-empty tuple of ints")


def _resolve(argnums: tuple[int, ...], nargs: int, name: str, value) -> tuple[int, ...]:
  out = []
  for a in argnums:
    if not -nargs <= a < nargs:
      raise ValueError(f"{name}={value!r} is out of range for a call with {nargs} positional arguments")
    out.append(a % nargs)
  if len(set(out)) != len(out):
    raise ValueError(f"{name}={value!r} names the same argument twice")
  return tuple(out)


def leading_size(batches, name: str = "batch") -> int:
  """The leading (batch) size shared by every leaf of `batches`, or a ValueError naming the leaves.

  Sizes are those of the arrays as given (global shapes, before any shard_map
  splits them), so the message names the user's numbers.
  """
  first: dict[int, str] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(batches):
    where = f"{name}{jax.tree_util.keystr(path)}"
    if jnp.ndim(leaf) == 0:
      raise ValueError(f"{where} is a scalar; every batch leaf needs a leading batch axis")
    first.setdefault(jnp.shape(leaf)[0], where)
  if not first:
    raise ValueError(f"the {name} holds no arrays")
  if len(first) > 1:
    listed = ", ".join(f"{where} has {size} rows" for size, where in sorted(first.items(), reverse=True))
    raise ValueError(f"{name} leaves disagree on their leading (batch) size: {listed}")
  (size,) = first
  if size == 0:
    raise ValueError(f"the {name} is empty ({first[0]} has 0 rows): there is nothing to average")
  return size


def check_binds(fun, name: str, args, kwargs, hint: str) -> None:
  """Raises a TypeError, with `hint`, when `fun`'s signature cannot take `args`/`kwargs`.

  Called before tracing, so that a closure over the batch (`def loss(params)`)
  is reported as such rather than as a TypeError deep inside the trace. Callables
  without an inspectable signature are let through.
  """
  try:
    sig = inspect.signature(fun)
  except (TypeError, ValueError):
    return
  try:
    sig.bind(*args, **kwargs)
  except TypeError as e:
    raise TypeError(f"{name}{sig} cannot be called with {len(args)} positional argument(s)"
                    f"{' and keywords ' + str(sorted(kwargs)) if kwargs else ''} ({e}). {hint}") from None


def microbatch(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    batch_argnums: int | tuple[int, ...] = 1,
    weight_fn: Callable[[Any], Any] | None = None,
    key_argnum: int | None = None,
    axis_name: Any = None,
    accumulator_dtype: Any = None,
    return_total_weight: bool = False,
) -> Callable[..., Any]:
  r"""Runs `fun` over `num_microbatches` slices of the batch in a `lax.scan`; returns the weighted mean.

  For K = `num_microbatches` and microbatch i (rows i, i+K, i+2K, ... of every
  batch argument), the wrapped function returns, leaf by leaf,

  .. math:: \bar{o} = \frac{\sum_i w_i\, o_i}{\sum_i w_i}, \qquad o_i = \mathrm{fun}(\ldots, b_i, \ldots)

  accumulated in `accumulator_dtype` and returned in each output's own dtype.
  With `fun = jax.value_and_grad(mean_loss)` and equal weights this is the
  full-batch loss and gradient; with padded/masked rows, a per-microbatch
  masked-mean loss and `weight_fn = lambda b: b["mask"].sum()` give the
  full-batch masked mean, whatever the number of real rows per microbatch.
  Peak memory is one microbatch's activations plus one output-sized accumulator.
  Keyword arguments of the wrapped call are passed to `fun` unchanged (not split).

  Weights. A microbatch of weight 0 (all padding) adds exactly nothing, even if
  its outputs are NaN (0/0). When the total weight sum_i w_i is 0 (every row is
  padding) there is nothing to average: called eagerly that is a ValueError;
  under a trace (jit, the normal case) every output is 0 rather than NaN, and
  `return_total_weight=True` lets the caller see it (`make_train_step` then
  skips the optimizer update). A negative or non-finite weight is an error
  when concrete; traced, it makes the total weight and the outputs NaN.

  Flax BatchNorm statistics returned as aux are averaged like everything else;
  see `make_train_step` for what that means next to full-batch statistics.

  Args:
    fun: the function to wrap; its outputs must be floating arrays or Python
      floats (any pytree): each is averaged, so an integer output is a
      TypeError rather than a truncated mean.
    num_microbatches: K, an int >= 1 dividing the leading size of every batch
      leaf. K = 1 calls `fun` once, with no loop.
    batch_argnums: the positional argument(s) holding the batch (pytrees whose
      leaves share a leading batch size). With K > 1 the outputs must depend
      on them: a `fun` that closes over its batch is a ValueError.
    weight_fn: `weight_fn(microbatch) -> scalar` w_i, where `microbatch` is the
      slice of the batch argument (a tuple of slices when `batch_argnums` is a
      tuple). Default: every microbatch weighs 1.
    key_argnum: a positional PRNG-key argument; microbatch i receives
      `jax.random.fold_in(key, i)` (also when K = 1).
    axis_name: inside `jax.shard_map`/`jax.pmap`, the data axis: after the loop
      one all-reduce of (sum_i w_i o_i, sum_i w_i) gives the weighted mean over
      all microbatches of all devices. Under shard_map, gradients must vary
      over the axis (take them w.r.t. `lax.pcast(params, axis_name,
      to="varying")`); gradients already summed by autodiff raise a ValueError.
    accumulator_dtype: a floating dtype for the running sums; default the
      wider of float32 and each output's dtype.
    return_total_weight: return `(outputs, total_weight)`, the total weight
      sum_i w_i (over all devices with `axis_name`) as a scalar in the
      accumulation dtype: 0 when nothing was averaged.

  Returns:
    A function with `fun`'s signature and output structure (a pair with the
    total weight when `return_total_weight`).
  """
  if not callable(fun):
    raise TypeError(f"fun={fun!r} must be callable, e.g. jax.value_and_grad(loss_fn)")
  k = _tree.check_positive_int(num_microbatches, "num_microbatches")
  argnums = _normalize_argnums(batch_argnums)
  if key_argnum is not None:
    _check_int_arg(key_argnum, "key_argnum")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn={weight_fn!r} must be callable (microbatch -> scalar weight) or None")
  if axis_name is not None:
    parallel.validate_axis_name(axis_name)
  if accumulator_dtype is not None:
    try:
      acc_dtype = jnp.dtype(accumulator_dtype)
    except TypeError:
      raise TypeError(f"{accumulator_dtype=} is not a dtype") from None
    if not jnp.issubdtype(acc_dtype, jnp.floating):
      # An integer running sum would truncate every term: 1.72 comes back as 1.5.
      raise ValueError(f"{accumulator_dtype=} must be a floating dtype (e.g. jnp.float32)")
  if not isinstance(return_total_weight, bool):
    raise TypeError(f"{return_total_weight=} must be a bool")

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    nargs = len(args)
    idx = _resolve(argnums, nargs, "batch_argnums", batch_argnums)
    kidx = None
    if key_argnum is not None:
      (kidx,) = _resolve((key_argnum,), nargs, "key_argnum", key_argnum)
      if kidx in idx:
        raise ValueError(f"{key_argnum=} is also one of {batch_argnums=}")
    check_binds(fun, "fun", args, kwargs,
                "microbatch calls fun with the wrapped call's arguments, the batch argument(s) "
                f"{batch_argnums=} split into microbatches; a function that closes over its batch "
                "(def loss(params): ... batch ...) must take it as an argument: def loss(params, batch).")
    if axis_name is not None:
      parallel.check_axis_name(axis_name)
    batches = tuple(args[i] for i in idx)
    size = leading_size(batches if len(batches) > 1 else batches[0])
    if size % k:
      raise ValueError(
          f"the batch's leading size {size} is not divisible by num_microbatches={k}")

    def call(mb_batches, i):
      call_args = list(args)
      for j, b in zip(idx, mb_batches, strict=True):
        call_args[j] = b
      if kidx is not None:
        call_args[kidx] = jax.random.fold_in(args[kidx], i)
      # Python scalars (a float returned as a metric) become arrays, as jit would make them.
      out = jax.tree.map(jnp.asarray, fun(*call_args, **kwargs))
      if weight_fn is None:
        w = jnp.ones((), jnp.float32)
      else:
        w = jnp.asarray(weight_fn(mb_batches[0] if len(mb_batches) == 1 else mb_batches))
        if w.shape != ():
          raise ValueError(f"weight_fn must return a scalar, got shape {w.shape}")
        if not (jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer)
                or w.dtype == jnp.bool_):
          raise TypeError(f"weight_fn must return a real number, got dtype {w.dtype}")
      return out, w

    if k == 1:
      out, w = call(batches, 0)
      _check_float_outputs(out)
      wdtype = _wdtype(out, accumulator_dtype)
      w = w.astype(wdtype)
      if axis_name is None:
        # The weighted mean of one microbatch is the microbatch (exactly: no w*o/w rounding).
        total = _checked_total(w, _weight_ok(w))
        out = jax.tree.map(lambda o: jnp.where(total == 0, jnp.zeros((), o.dtype),
                                               jnp.where(jnp.isnan(total), jnp.full((), jnp.nan, o.dtype), o)), out)
        return (out, total) if return_total_weight else out
      acc = jax.tree.map(lambda o: _weighted(o, w, _tree.accumulator_dtype(o.dtype, accumulator_dtype)), out)
      out, total = _finish(acc, w, _weight_ok(w), out, axis_name)
      return (out, total) if return_total_weight else out

    # (B, ...) -> (B/K, K, ...): row r = j*K + i lands at [j, i], so index i on
    # axis 1 is microbatch i. Contiguous reshape: no copy, shards stay put.
    views = jax.tree.map(lambda x: jnp.reshape(x, (size // k, k) + jnp.shape(x)[1:]), batches)

    def take(i):
      return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), views)

    # One trace of the body for the shapes (as eval_shape would) that also shows
    # whether the outputs depend on the batch at all.
    first = take(0)
    closed, (out_shape, w_shape) = jax.make_jaxpr(lambda mb: call(mb, 0), return_shape=True)(first)
    _check_depends_on_batch(closed.jaxpr, len(jax.tree.leaves(first)), len(jax.tree.leaves(out_shape)),
                            batch_argnums)
    _check_float_outputs(out_shape)
    wdtype = _wdtype(out_shape, accumulator_dtype)

    def zeros(s, dtype):
      z = jnp.zeros(s.shape, dtype)
      # Inside shard_map the carry must have the varying-ness of what is added to it.
      axes = tuple(sorted((parallel._varying_axes(s) or frozenset()) - (parallel._varying_axes(z) or frozenset())))
      return lax.pcast(z, axes, to="varying") if axes else z

    acc0 = jax.tree.map(lambda s: zeros(s, _tree.accumulator_dtype(s.dtype, accumulator_dtype)), out_shape)
    wsum0 = zeros(w_shape, wdtype)
    ok0 = zeros(jax.ShapeDtypeStruct((), jnp.bool_, **_vma_kwargs(w_shape)), jnp.bool_) | True

    def body(carry, i):
      acc, wsum, ok = carry
      out, w = call(take(i), i)
      w = w.astype(wsum.dtype)
      acc = jax.tree.map(lambda a, o: a + _weighted(o, w, a.dtype), acc, out)
      return (acc, wsum + w, ok & _weight_ok(w)), None

    (acc, wsum, ok), _ = lax.scan(body, (acc0, wsum0, ok0), jnp.arange(k))
    out, total = _finish(acc, wsum, ok, out_shape, axis_name)
    return (out, total) if return_total_weight else out

  return wrapped


def _vma_kwargs(s) -> dict:
  """ShapeDtypeStruct keywords that keep `s`'s varying axes (none outside shard_map)."""
  mat = getattr(s, "manual_axis_type", None)
  return {} if mat is None else {"manual_axis_type": mat}


def _check_depends_on_batch(jaxpr, n_batch: int, n_out: int, batch_argnums) -> None:
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
        f"fun's outputs do not depend on its batch argument(s) ({batch_argnums=}), so every "
        "microbatch would compute the same thing. If fun closes over the batch (def loss(params): "
        "... batch ...), take the batch as an argument instead: def loss(params, batch), and pass "
        "it in the call; microbatch splits that argument.")


def _check_float_outputs(outs) -> None:
  """Every output is averaged, so it must be floating: an integer mean would be truncated."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(outs):
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(
          f"fun's output{jax.tree_util.keystr(path)} has dtype {leaf.dtype}: microbatch returns the "
          "weighted mean of every output, so return it as a float (e.g. count.astype(jnp.float32))")


def _weight_ok(w) -> jax.Array:
  """A weight must be finite and >= 0 (0 meaning: this microbatch is all padding)."""
  return jnp.isfinite(w) & (w >= 0)


def _weighted(out, w, dtype):
  """w * out in `dtype`; exactly 0 where w == 0, so an all-padding microbatch (0/0 = NaN loss) adds nothing."""
  w = w.astype(dtype)
  return jnp.where(w == 0, jnp.zeros((), dtype), out.astype(dtype) * w)


def _wdtype(outs, override) -> jnp.dtype:
  return _tree.widest(_tree.accumulator_dtype(o.dtype, override) for o in jax.tree.leaves(outs))


def _checked_total(wsum, ok):
  """The total weight, NaN when some weight was invalid; a ValueError when concrete and unusable."""
  total = jnp.where(ok, wsum, jnp.full((), jnp.nan, wsum.dtype))
  if _tree.is_concrete(total):
    if not bool(ok):
      raise ValueError("weight_fn returned a negative or non-finite weight for a microbatch: weights "
                       "must be finite and >= 0 (e.g. the number of real rows or tokens)")
    if float(total) == 0:
      raise ValueError("every microbatch has weight 0 (weight_fn gave 0 for all of them: the batch is all "
                       "padding?), so there is nothing to average")
  return total


def _finish(acc, wsum, ok, like, axis_name):
  """(sum w o, sum w) -> (sum w o / sum w, total weight), all-reduced first when `axis_name` is given.

  A total weight of 0 gives outputs of 0 (not 0/0); an invalid weight gives NaN.
  """
  if axis_name is not None:
    parallel.check_varying(acc, axis_name, arg="outputs")
    # One psum over operands of mixed varying-ness lowers to several
    # all-reduces (invariant ones apart); cast all to varying to get one.
    # The validity flag travels as a count of bad microbatches in the same psum.
    bad = (~ok).astype(wsum.dtype)
    acc, wsum, bad = parallel.to_varying((acc, wsum, bad), axis_name)
    acc, wsum, bad = parallel.all_reduce_sum((acc, wsum, bad), axis_name)
    ok = bad == 0
  total = _checked_total(wsum, ok)
  safe = jnp.where(total == 0, jnp.ones((), total.dtype), total)

  def mean(a, o):
    return jnp.where(total == 0, jnp.zeros((), a.dtype), a / safe.astype(a.dtype)).astype(o.dtype)

  return jax.tree.map(mean, acc, like), total
