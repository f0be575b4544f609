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
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum import _tree
from jaxaccum import parallel


def _normalize_argnums(batch_argnums) -> tuple[int, ...]:
  if isinstance(batch_argnums, numbers.Integral) and not isinstance(batch_argnums, bool):
    return (int(batch_argnums),)
  if isinstance(batch_argnums, (tuple, list)) and batch_argnums and all(
      isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in batch_argnums):
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


def _leading_size(batches) -> int:
  sizes = set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(batches):
    if jnp.ndim(leaf) == 0:
      raise ValueError(f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a leading batch axis")
    sizes.add(jnp.shape(leaf)[0])
  if not sizes:
    raise ValueError("the batch arguments hold no arrays")
  if len(sizes) > 1:
    raise ValueError(f"batch leaves disagree on their leading (batch) size: {sorted(sizes)}")
  return sizes.pop()


def microbatch(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    batch_argnums: int | tuple[int, ...] = 1,
    weight_fn: Callable[[Any], Any] | None = None,
    key_argnum: int | None = None,
    axis_name: Any = None,
    accumulator_dtype: Any = None,
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

  Flax BatchNorm statistics returned as aux are averaged like everything else;
  see `make_train_step` for what that means next to full-batch statistics.

  Args:
    fun: the function to wrap; its outputs must be floating arrays (any
      pytree): each is averaged, so an integer output is a TypeError rather
      than a truncated mean.
    num_microbatches: K, an int >= 1 dividing the leading size of every batch
      leaf. K = 1 calls `fun` once, with no loop.
    batch_argnums: the positional argument(s) holding the batch (pytrees whose
      leaves share a leading batch size).
    weight_fn: `weight_fn(microbatch) -> scalar` w_i, where `microbatch` is the
      slice of the batch argument (a tuple of slices when `batch_argnums` is a
      tuple). Default: every microbatch weighs 1. A microbatch of weight 0
      (all padding) adds exactly nothing, even if its outputs are NaN; the
      weights must not all be 0.
    key_argnum: a positional PRNG-key argument; microbatch i receives
      `jax.random.fold_in(key, i)` (also when K = 1).
    axis_name: inside `jax.shard_map`/`jax.pmap`, the data axis: after the loop
      one all-reduce of (sum_i w_i o_i, sum_i w_i) gives the weighted mean over
      all microbatches of all devices. Under shard_map, gradients must vary
      over the axis (take them w.r.t. `lax.pcast(params, axis_name,
      to="varying")`); gradients already summed by autodiff raise a ValueError.
    accumulator_dtype: dtype of the running sums; default the wider of float32
      and each output's dtype.

  Returns:
    A function with `fun`'s signature and output structure.
  """
  k = _tree.check_positive_int(num_microbatches, "num_microbatches")
  argnums = _normalize_argnums(batch_argnums)
  if key_argnum is not None and (isinstance(key_argnum, bool) or not isinstance(key_argnum, numbers.Integral)):
    raise TypeError(f"{key_argnum=} must be an int or None")
  if axis_name is not None:
    parallel.validate_axis_name(axis_name)

  @functools.wraps(fun)
  def wrapped(*args):
    nargs = len(args)
    idx = _resolve(argnums, nargs, "batch_argnums", batch_argnums)
    kidx = None
    if key_argnum is not None:
      (kidx,) = _resolve((key_argnum,), nargs, "key_argnum", key_argnum)
      if kidx in idx:
        raise ValueError(f"{key_argnum=} is also one of {batch_argnums=}")
    if axis_name is not None:
      parallel.check_axis_name(axis_name)
    batches = tuple(args[i] for i in idx)
    size = _leading_size(batches)
    if size % k:
      raise ValueError(
          f"the batch's leading size {size} is not divisible by num_microbatches={k}")

    def call(mb_batches, i):
      call_args = list(args)
      for j, b in zip(idx, mb_batches):
        call_args[j] = b
      if kidx is not None:
        call_args[kidx] = jax.random.fold_in(args[kidx], i)
      out = fun(*call_args)
      if weight_fn is None:
        w = jnp.ones((), jnp.float32)
      else:
        w = jnp.asarray(weight_fn(mb_batches[0] if len(mb_batches) == 1 else mb_batches))
        if w.shape != ():
          raise ValueError(f"weight_fn must return a scalar, got shape {w.shape}")
      return out, w

    if k == 1:
      out, w = call(batches, 0)
      _check_float_outputs(out)
      if axis_name is None:
        return out  # the weighted mean of one microbatch is the microbatch
      acc = jax.tree.map(lambda o: _weighted(o, w, _tree.accumulator_dtype(o.dtype, accumulator_dtype)), out)
      return _finish(acc, w.astype(_wdtype(out, accumulator_dtype)), out, axis_name)

    # (B, ...) -> (B/K, K, ...): row r = j*K + i lands at [j, i], so index i on
    # axis 1 is microbatch i. Contiguous reshape: no copy, shards stay put.
    views = jax.tree.map(lambda x: jnp.reshape(x, (size // k, k) + jnp.shape(x)[1:]), batches)

    def take(i):
      return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), views)

    out_shape, w_shape = jax.eval_shape(lambda: call(take(0), 0))
    _check_float_outputs(out_shape)
    wdtype = _wdtype(out_shape, accumulator_dtype)

    def zeros(s, dtype):
      z = jnp.zeros(s.shape, dtype)
      # Inside shard_map the carry must have the varying-ness of what is added to it.
      axes = tuple(sorted((parallel._varying_axes(s) or frozenset()) - (parallel._varying_axes(z) or frozenset())))
      return lax.pcast(z, axes, to="varying") if axes else z

    acc0 = jax.tree.map(lambda s: zeros(s, _tree.accumulator_dtype(s.dtype, accumulator_dtype)), out_shape)
    wsum0 = zeros(w_shape, wdtype)

    def body(carry, i):
      acc, wsum = carry
      out, w = call(take(i), i)
      acc = jax.tree.map(lambda a, o: a + _weighted(o, w, a.dtype), acc, out)
      return (acc, wsum + w.astype(wsum.dtype)), None

    (acc, wsum), _ = lax.scan(body, (acc0, wsum0), jnp.arange(k))
    return _finish(acc, wsum, out_shape, axis_name)

  return wrapped


def _check_float_outputs(outs) -> None:
  """Every output is averaged, so it must be floating: an integer mean would be truncated."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(outs):
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(
          f"fun's output{jax.tree_util.keystr(path)} has dtype {leaf.dtype}: microbatch returns the "
          "weighted mean of every output, so return it as a float (e.g. count.astype(jnp.float32))")


def _weighted(out, w, dtype):
  """w * out in `dtype`; exactly 0 where w == 0, so an all-padding microbatch (0/0 = NaN loss) adds nothing."""
  w = w.astype(dtype)
  return jnp.where(w == 0, jnp.zeros((), dtype), out.astype(dtype) * w)


def _wdtype(outs, override) -> jnp.dtype:
  return _tree.widest(_tree.accumulator_dtype(o.dtype, override) for o in jax.tree.leaves(outs))


def _finish(acc, wsum, like, axis_name):
  """(sum w o, sum w) -> sum w o / sum w, all-reduced first when `axis_name` is given."""
  if axis_name is not None:
    parallel.check_varying(acc, axis_name, arg="outputs")
    # One psum over operands of mixed varying-ness lowers to several
    # all-reduces (invariant ones apart); cast all to varying to get one.
    acc, wsum = parallel.to_varying((acc, wsum), axis_name)
    acc, wsum = parallel.all_reduce_sum((acc, wsum), axis_name)
  return jax.tree.map(lambda a, o: (a / wsum.astype(a.dtype)).astype(o.dtype), acc, like)
