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

Outputs that are not means are combined per `reductions`: "sum" (counts),
"concat" (per-example outputs, back in the batch's row order; a scalar per
microbatch, such as its gradient norm, becomes a vector of K), "last" (flags,
counters, non-float state).

In your own `jax.jit` on an Explicit mesh, `microbatch(ja.grad(loss,
axis_name="data"), K, axis_name="data")` adds the gradients as partial sums
per device (typed unreduced: no collective in the loop) and reduces them once
after it; without `axis_name` they stay unreduced for `ja.accumulate`.

`skip_empty=True` runs `fun` under a `lax.cond` on the microbatch's weight,
so microbatches of weight 0 (padding) cost next to nothing and one compiled
function serves any number of real microbatches up to K; `pad_microbatches`
lays n microbatches out that way.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxaccum import _tree, _unreduced, parallel


def _check_int_arg(value, name: str) -> int:
  """An int (not a bool: `key_argnum=True` is a bug, not argument 1)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
  return int(value)


def _normalize_argnums(batch_argnums, allow_empty: bool = False) -> tuple[int, ...]:
  if isinstance(batch_argnums, numbers.Integral) and not isinstance(batch_argnums, (bool, np.bool_)):
    return (int(batch_argnums),)
  if (
    isinstance(batch_argnums, (tuple, list))
    and (batch_argnums or allow_empty)
    and all(isinstance(a, numbers.Integral) and not isinstance(a, (bool, np.bool_)) for a in batch_argnums)
  ):
    return tuple(int(a) for a in batch_argnums)
  raise TypeError(f"{batch_argnums=} must be an int or a non-empty tuple of ints (or () with argnames)")


def _normalize_argnames(argnames) -> tuple[str, ...]:
  names = (argnames,) if isinstance(argnames, str) else argnames
  if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
    raise TypeError(f"{argnames=} must be a keyword argument name or a tuple of them")
  if len(set(names)) != len(names):
    raise ValueError(f"{argnames=} names the same argument twice")
  return tuple(names)


def _normalize_in_axes(in_axes, n: int) -> tuple[int, ...]:
  if isinstance(in_axes, numbers.Integral) and not isinstance(in_axes, (bool, np.bool_)):
    return (int(in_axes),) * n
  if (
    isinstance(in_axes, (tuple, list))
    and len(in_axes) == n
    and all(isinstance(a, numbers.Integral) and not isinstance(a, (bool, np.bool_)) for a in in_axes)
  ):
    return tuple(int(a) for a in in_axes)
  raise TypeError(f"{in_axes=} must be an int or one int per batch argument ({n}: batch_argnums, then argnames)")


def _check_num_real(n, k: int) -> None:
  if n is None:
    return
  if isinstance(n, (bool, np.bool_)) or not (isinstance(n, numbers.Integral) or hasattr(n, "dtype")):
    raise TypeError(f"num_real_microbatches={n!r} must be None, an int or an integer scalar array")
  if hasattr(n, "dtype") and (np.shape(n) != () or not jnp.issubdtype(n.dtype, jnp.integer)):
    raise TypeError(f"num_real_microbatches must be an integer scalar, got shape {np.shape(n)} dtype {n.dtype}")
  if _tree.is_concrete(n) and not 0 <= int(n) <= k:
    raise ValueError(f"num_real_microbatches={int(n)} must be between 0 and num_microbatches={k}")


def check_accumulator_dtype(accumulator_dtype, name: str = "accumulator_dtype") -> None:
  """None or a floating dtype (an integer running sum or wire would truncate every term: 1.72 comes back as 1.5)."""
  if accumulator_dtype is None:
    return
  try:
    acc_dtype = jnp.dtype(accumulator_dtype)
  except TypeError:
    raise TypeError(f"{name}={accumulator_dtype!r} is not a dtype (e.g. jnp.float32)") from None
  if not jnp.issubdtype(acc_dtype, jnp.floating):
    raise ValueError(f"{name}={accumulator_dtype!r} must be a floating dtype (e.g. jnp.float32)")


def check_skip_empty(skip_empty, weight_fn) -> None:
  if not isinstance(skip_empty, bool):
    raise TypeError(f"{skip_empty=} must be a bool")
  if skip_empty and weight_fn is None:
    raise ValueError(
      f"{skip_empty=} needs a weight_fn: a microbatch is empty when its weight is 0 "
      "(e.g. weight_fn=lambda b: b['mask'].sum())"
    )


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


def batch_size(batches: tuple, axes: tuple[int, ...], name: str = "batch") -> int:
  """The batch size shared by every batch argument along its batch axis (`leading_size` per argument).

  An axis counts from the end when negative (as `jax.vmap`'s `in_axes`), leaf by
  leaf; one out of range for a leaf is a ValueError naming the argument, the
  leaf and its shape.
  """
  if all(a == 0 for a in axes):
    return leading_size(batches if len(batches) > 1 else batches[0], name)
  sizes = {}
  for j, (b, a) in enumerate(zip(batches, axes, strict=True)):
    for path, x in jax.tree_util.tree_leaves_with_path(b):
      if not -jnp.ndim(x) <= a < jnp.ndim(x):
        raise ValueError(
          f"in_axes={a} is out of range for {name} argument {j}{jax.tree_util.keystr(path)} of shape "
          f"{jnp.shape(x)}: its batch axis must be one of {-jnp.ndim(x)}, ..., {jnp.ndim(x) - 1}"
        )
    moved = jax.tree.map(lambda x, a=a: _BatchAxis(x, a), b)
    sizes[leading_size(moved, f"{name} argument {j}")] = j
  if len(sizes) > 1:
    raise ValueError(f"the batch arguments disagree on their batch size along in_axes: {sorted(sizes)}")
  (size,) = sizes
  return size


class _BatchAxis:
  """A leaf seen with its batch axis first (shape and ndim only), for `leading_size`."""

  def __init__(self, x, axis):
    shape = list(jnp.shape(x))
    self.shape = (shape.pop(axis),) + tuple(shape)
    self.ndim = len(self.shape)


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
    raise TypeError(
      f"{name}{sig} cannot be called with {len(args)} positional argument(s)"
      f"{' and keywords ' + str(sorted(kwargs)) if kwargs else ''} ({e}). {hint}"
    ) from None


def microbatch(
  fun: Callable[..., Any],
  num_microbatches: int,
  *,
  batch_argnums: int | tuple[int, ...] = 1,
  argnames: str | tuple[str, ...] = (),
  in_axes: int | tuple[int, ...] = 0,
  weight_fn: Callable[[Any], Any] | None = None,
  key_argnum: int | None = None,
  axis_name: Any = None,
  accumulator_dtype: Any = None,
  reductions: Any = None,
  return_total_weight: bool = False,
  skip_empty: bool = False,
  num_real_microbatches: Any = None,
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
  Keyword arguments of the wrapped call are passed to `fun` unchanged (not split),
  except those named in `argnames`, which are batches.

  Weights. The K weights are computed first, from the batch alone (one
  vectorised call of `weight_fn` over the microbatches), then the loop runs.
  A microbatch of weight 0 (all padding) adds exactly nothing, even if its
  outputs are NaN (0/0). When the total weight sum_i w_i is 0 (every row is
  padding) there is nothing to average: called eagerly that is a ValueError;
  under a trace (jit, the normal case) every output is 0 rather than NaN, and
  `return_total_weight=True` lets the caller see it (`make_train_step` then
  skips the optimizer update). A negative or non-finite weight is an error
  when concrete; traced, it makes the total weight and the outputs NaN.

  Reductions. Not every output is a mean: `reductions` names, per output leaf,

  - `"mean"` (default): the weighted mean above;
  - `"sum"`: sum_i o_i, unweighted (a count of correct predictions, a summed
    loss); integer leaves are summed in their own dtype;
  - `"concat"`: per-example outputs (logits, per-token losses) of shape
    (B/K, ...) per microbatch, returned as (B, ...) in the batch's original
    row order although microbatch i holds rows i, i+K, ...: each microbatch
    writes its rows in place into a (B/K, K, ...) buffer, which a free
    reshape turns into row order (no stack and transpose). A scalar output
    gives a vector of K values, one per microbatch, e.g. the per-microbatch
    gradient norm `optax.global_norm(grads)`. Any other leading size is a
    ValueError naming the output and both sizes (it could not be put back in
    row order);
  - `"last"`: the last microbatch's value (counters, flags, non-float model
    state).

  A microbatch of weight 0 adds nothing to a mean or a sum; "concat" and
  "last" take every microbatch's values as they come. Integer and bool
  outputs have no exact mean: they need an explicit "sum", "concat" or "last".
  With `axis_name`, means and sums are reduced over all devices (one
  all-reduce together), "concat" is gathered over devices in global row order
  (device p's rows after device p-1's, as `ja.shard_batch` splits them; one
  all-gather, invariant over the axis under shard_map), and "last" stays the
  local last microbatch of each device (varying under shard_map: return it with
  `out_specs=P(axis_name)` or reduce it yourself).

  Skipping microbatches (`skip_empty=True`, needs `weight_fn`; or
  `num_real_microbatches=n`). `fun` runs under `lax.cond(w_i > 0, ...)`: a
  microbatch of weight 0 costs a branch that passes the running sums
  through, no forward or backward pass. So one compiled function runs any
  number n <= K of real microbatches, n read from the data (e.g. from a mask;
  see `pad_microbatches`) or given as `num_real_microbatches` (an int or a
  traced scalar: microbatches n, ..., K-1 have weight 0), with no recompile.
  Means and sums are those of the real microbatches, as without the option;
  "concat" leaves hold zeros in a skipped microbatch's rows (or entry), not
  `fun`'s output on padding; "last" is the last microbatch that ran (zeros if
  none ran). With `axis_name` each device skips its own empty microbatches
  (the cond is local: no collective inside the loop). Under `jax.vmap` a
  batched predicate turns the cond into a select that runs both branches:
  correct, but nothing is skipped.

  Flax BatchNorm statistics returned as aux are averaged like everything else;
  see `make_train_step` for what that means next to full-batch statistics.

  Args:
    fun: the function to wrap; its outputs (any pytree of arrays or Python
      scalars) are combined over microbatches per `reductions`.
    num_microbatches: K, an int >= 1 dividing the batch size of every batch
      leaf. K = 1 calls `fun` once, with no loop (with skipping, a loop of one).
    batch_argnums: the positional argument(s) holding the batch (pytrees whose
      leaves share a batch size); `()` when every batch is passed by keyword
      (`argnames`). With K > 1 the outputs must depend on them: a `fun` that
      closes over its batch is a ValueError.
    argnames: keyword argument(s) of the wrapped call holding batches, split
      like the positional ones (as `optax.microbatching.microbatch`'s).
    in_axes: the batch axis of each batch argument: an int for all of them, or
      one int per batch argument (`batch_argnums` first, then `argnames`); a
      negative axis counts from the end of each leaf, as in `jax.vmap`.
      Microbatch i takes entries i, i+K, ... along that axis (a free reshape);
      `fun` sees the axis where it was. "concat" outputs are returned with
      their rows on axis 0.
    weight_fn: `weight_fn(microbatch) -> scalar` w_i, where `microbatch` is the
      slice of the batch argument (a tuple of slices when there are several).
      It is vectorised over the K microbatches with `jax.vmap`. Default: every
      microbatch weighs 1.
    key_argnum: a positional PRNG-key argument; microbatch i receives
      `jax.random.fold_in(key, i)` (also when K = 1).
    axis_name: inside `jax.shard_map`/`jax.pmap`, the data axis: after the loop
      one all-reduce of (sum_i w_i o_i, sum_i w_i) gives the weighted mean over
      all microbatches of all devices. Under shard_map, gradients must vary
      over the axis (take them w.r.t. `lax.pcast(params, axis_name,
      to="varying")`); gradients already summed by autodiff raise a ValueError.
      Inside your own `jax.jit` on a mesh whose `axis_name` axis is Explicit
      (not bound by shard_map), `fun = ja.grad(loss, axis_name=...)` (or
      `ja.value_and_grad`): its gradients are partial sums per device
      (unreduced), added in the loop with no collective and reduced once after
      it (one all-reduce); everything else is global already. A `fun` with
      no unreduced output (plain `jax.grad`: all-reduced on every microbatch)
      is a ValueError naming `ja.grad`. Without `axis_name`, unreduced outputs
      come back unreduced (their weighted mean, a partial sum per device), for
      `ja.accumulate(..., axis_name=)` to reduce once per window.
    accumulator_dtype: a floating dtype for the running sums; default the
      wider of float32 and each output's dtype.
    reductions: how each output leaf is combined: a tree prefix of `fun`'s
      outputs whose leaves are "mean", "sum", "concat" or "last" (a single
      string applies to every leaf), e.g. `(("mean", {"logits": "concat",
      "correct": "sum"}), "mean")` for `value_and_grad(loss, has_aux=True)`.
      Default: every leaf "mean".
    return_total_weight: return `(outputs, total_weight)`, the total weight
      sum_i w_i (over all devices with `axis_name`) as a scalar in the
      accumulation dtype: 0 when nothing was averaged.
    skip_empty: do not run `fun` on a microbatch whose weight is 0 (see
      "Skipping microbatches" above). A negative or NaN weight is not run
      either (and makes the total weight NaN, as without the option).
    num_real_microbatches: None (all K are real), or n (an int in [0, K] or a
      scalar array, traced or not): only microbatches 0..n-1 run and count.
      n = 0 runs none: every mean and sum is 0 and the total weight 0, called
      eagerly as under jit (and as in optax), not the all-padding error.

  Returns:
    A function with `fun`'s signature and output structure (a pair with the
    total weight when `return_total_weight`).
  """
  if not callable(fun):
    raise TypeError(f"fun={fun!r} must be callable, e.g. jax.value_and_grad(loss_fn)")
  k = _tree.check_positive_int(num_microbatches, "num_microbatches")
  names = _normalize_argnames(argnames)
  argnums = _normalize_argnums(batch_argnums, allow_empty=bool(names))
  axes = _normalize_in_axes(in_axes, len(argnums) + len(names))
  if key_argnum is not None:
    _check_int_arg(key_argnum, "key_argnum")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn={weight_fn!r} must be callable (microbatch -> scalar weight) or None")
  if axis_name is not None:
    parallel.validate_axis_name(axis_name)
  check_accumulator_dtype(accumulator_dtype)
  if not isinstance(return_total_weight, bool):
    raise TypeError(f"{return_total_weight=} must be a bool")
  _check_reductions(reductions)
  check_skip_empty(skip_empty, weight_fn)
  _check_num_real(num_real_microbatches, k)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    nargs = len(args)
    idx = _resolve(argnums, nargs, "batch_argnums", batch_argnums)
    for name in names:
      if name not in kwargs:
        raise TypeError(f"argnames names {name!r}, but the call has no keyword argument {name!r}")
    kidx = None
    if key_argnum is not None:
      (kidx,) = _resolve((key_argnum,), nargs, "key_argnum", key_argnum)
      if kidx in idx:
        raise ValueError(f"{key_argnum=} is also one of {batch_argnums=}")
    check_binds(
      fun,
      "fun",
      args,
      kwargs,
      "microbatch calls fun with the wrapped call's arguments, the batch argument(s) "
      f"{batch_argnums=} split into microbatches; a function that closes over its batch "
      "(def loss(params): ... batch ...) must take it as an argument: def loss(params, batch).",
    )
    # Own-jit mode: `axis_name` is not bound (no pmap/shard_map) but is an Explicit axis of the mesh, where
    # arrays are global and ja.grad's gradients are partial sums per device (see `_reduce_partial_sums`).
    own_jit = axis_name is not None and not _unreduced.is_bound(axis_name)
    if own_jit:
      _unreduced.explicit_mesh(axis_name, args, what="ja.microbatch")
    elif axis_name is not None:
      parallel.check_axis_name(axis_name)
    batches = tuple(args[i] for i in idx) + tuple(kwargs[n] for n in names)
    sp = split(batches, axes, k)

    def run(mbs, i):
      call_args, call_kwargs = list(args), dict(kwargs)
      for j, b in zip(idx, mbs, strict=False):
        call_args[j] = b
      for n, b in zip(names, mbs[len(idx) :], strict=True):
        call_kwargs[n] = b
      if kidx is not None:
        call_args[kidx] = jax.random.fold_in(args[kidx], i)
      # Python scalars (a float returned as a metric) become arrays, as jit would make them.
      return jax.tree.map(jnp.asarray, fun(*call_args, **call_kwargs))

    ws = weights(sp, weight_fn, num_real_microbatches)
    skip = skip_empty or num_real_microbatches is not None
    # num_real_microbatches=0 asks for nothing: zeros (total weight 0) eagerly too, as under jit and in optax.
    none_real = num_real_microbatches is not None and _tree.is_concrete(num_real_microbatches)
    none_real = none_real and int(num_real_microbatches) == 0
    sums = local_sums(run, sp, ws, reductions=reductions, accumulator_dtype=accumulator_dtype, skip=skip)
    # Partial sums (ja.grad's, without axis_name) are divided in `finish`, by a reduced reciprocal.
    has_partial_sums = any(_unreduced.axes_of(s) for s in jax.tree.leaves(sums.like))
    if own_jit:
      out, total = finish(_reduce_partial_sums(sums, axis_name), None, none_real=none_real)
    elif sums.single is not None and axis_name is None and not has_partial_sums:
      # One microbatch is its own mean (exactly: no w*o/w rounding), its own sum and its own last.
      total = _checked_total(sums.wsum, sums.ok, none_real=none_real)
      leaves, treedef = jax.tree.flatten(sums.single)
      out = jax.tree.unflatten(treedef, [_single(o, r, total) for o, r in zip(leaves, sums.reds, strict=True)])
    else:
      out, total = finish(sums, axis_name, none_real=none_real)
    return (out, total) if return_total_weight else out

  return wrapped


# --------------------------------------------------------------------------- the loop (shared with make_train_step)


class Split(NamedTuple):
  """The batch arguments of one call viewed as K microbatches, without a copy."""

  views: tuple  # each batch argument, its batch axis a reshaped to (size / K, K) at (a, a + 1)
  axes: tuple[int, ...]  # each batch argument's batch axis
  k: int  # the number of microbatches
  rows: int  # rows per microbatch (size / K)

  def take(self, i) -> tuple:
    """Microbatch i (rows i, i + K, ...) of every batch argument."""
    return tuple(
      jax.tree.map(lambda x, a=a: lax.dynamic_index_in_dim(x, i, axis=_k_axis(a), keepdims=False), v)
      for v, a in zip(self.views, self.axes, strict=True)
    )


def _k_axis(a: int) -> int:
  """Where a view holds the microbatch index for batch axis `a`: after the (size / K) axis, counted from the end
  when `a` is (axis -1 of a leaf becomes (size / K, K) at -2, -1 of its view)."""
  return a + 1 if a >= 0 else a


def split(batches: tuple, axes: tuple[int, ...], k: int, name: str = "batch") -> Split:
  """Views each batch argument as (size / K, K) on its batch axis: a free reshape, rows stay on their devices.

  Row r = j K + i lands at [j, i], so index i on the new axis is microbatch i.
  A negative axis counts from the end of each leaf. A leaf whose batch axis is
  typed as sharded over D devices (an Explicit mesh) needs size / K divisible
  by D (each microbatch keeps the batch's sharding); otherwise a ValueError
  names K, the rows and the devices.
  """
  size = batch_size(batches, axes, name)
  if size % k:
    raise ValueError(f"the {name}'s leading size {size} is not divisible by num_microbatches={k}")

  def view(x, a):
    shape = jnp.shape(x)
    a = a % len(shape)  # in range: batch_size checked it
    _check_rows_per_device(x, a, size, k, name)
    return jnp.reshape(x, shape[:a] + (size // k, k) + shape[a + 1 :])

  views = tuple(jax.tree.map(lambda x, a=a: view(x, a), b) for b, a in zip(batches, axes, strict=True))
  return Split(views, axes, k, size // k)


def _check_rows_per_device(x, a: int, size: int, k: int, name: str) -> None:
  """Refuses, naming K, the rows and the devices, a split whose microbatches cannot keep x's typed sharding.

  Microbatch i holds rows i, i + K, ...: on a batch sharded over D devices of
  an Explicit mesh, its size / K rows are spread as the batch's are, so each
  device holds (size / K) / D of them, which must be whole. JAX's reshape
  would otherwise fail with a ShardingTypeError that names neither.
  """
  sharding = _typed_spec(jax.typeof(x))
  if sharding is None:
    return
  spec = tuple(sharding.spec) + (None,) * (jnp.ndim(x) - len(sharding.spec))
  entry = spec[a]
  names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
  devices = math.prod(sharding.mesh.shape[n] for n in names)
  rows = size // k
  if devices <= 1 or rows % devices == 0:
    return
  per_device = size // devices
  fits = [d for d in range(1, per_device + 1) if per_device % d == 0]
  below = max(d for d in fits if d < k)
  above = [d for d in fits if d > k]
  hint = f"num_microbatches={below}" + (f" or {above[0]}" if above else "")
  axes = names[0] if len(names) == 1 else names
  raise ValueError(
    f"num_microbatches={k} splits the {name}'s {size} rows into microbatches of {rows} rows, but the {name} is "
    f"sharded over the {devices} devices of mesh axis {axes!r} and a microbatch keeps that sharding: {rows} rows "
    f"do not divide among {devices} devices. Use a num_microbatches that divides the {per_device} rows per device "
    f"(e.g. {hint}), or a batch of a multiple of {k * devices} rows."
  )


def weights(sp: Split, weight_fn, num_real=None) -> jax.Array:
  """The K microbatch weights, from the batch alone: `weight_fn` vectorised over the microbatches."""
  if weight_fn is None:
    ws = jnp.ones((sp.k,), jnp.float32)
  else:

    def one(*mbs):
      w = jnp.asarray(weight_fn(mbs[0] if len(mbs) == 1 else mbs))
      if w.shape != ():
        raise ValueError(f"weight_fn must return a scalar, got shape {w.shape}")
      if not (jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer) or w.dtype == jnp.bool_):
        raise TypeError(f"weight_fn must return a real number, got dtype {w.dtype}")
      return w

    ws = jax.vmap(one, in_axes=tuple(_k_axis(a) for a in sp.axes))(*sp.views)
  if num_real is not None:
    ws = jnp.where(jnp.arange(sp.k) < num_real, ws, jnp.zeros((), ws.dtype))
  return ws


class Sums(NamedTuple):
  """The microbatch loop's result on one device, before any division or collective."""

  accs: list  # per output leaf: sum w o ("mean"), sum o ("sum"), the (m, K, ...) buffer ("concat"), last value
  wsum: jax.Array  # sum of the weights, in the accumulation dtype
  ok: jax.Array  # every weight finite and >= 0
  reds: list[str]  # each output leaf's reduction
  like: Any  # the output tree of one microbatch (abstract values), for the structure and dtypes
  single: Any  # K = 1 without skipping: fun's output itself (exact), else None


def local_sums(run, sp: Split, ws, *, reductions=None, accumulator_dtype=None, skip=False, check_batch=True) -> Sums:
  """The microbatch loop: `run(microbatches, i)` for i < K in a `lax.scan`, combined per `reductions`.

  `ws` holds the K weights (`weights`); with `skip=True` a microbatch of weight
  <= 0 (or NaN) is not run (`lax.cond`). `skip` may instead be a bool vector of
  K, the microbatches to run (the same on every device when `run` holds
  collectives: fsdp's per-microbatch gathers); a microbatch run with weight 0
  then writes nothing to any reduction ("concat" rows stay 0, "last" keeps
  the last microbatch of weight > 0). Nothing is divided and nothing crosses
  devices: `finish` (or make_train_step's reducer) does that.
  """
  first = sp.take(0)
  closed, like = jax.make_jaxpr(lambda mbs: run(mbs, 0), return_shape=True)(first)
  if sp.k > 1 and check_batch:
    _check_depends_on_batch(closed.jaxpr, len(jax.tree.leaves(first)), len(jax.tree.leaves(like)))
  shapes, treedef = jax.tree.flatten(like)
  reds = _leaf_reductions(reductions, like)
  _check_concat_rows(like, reds, sp.rows)
  ws = ws.astype(_wdtype(shapes, reds, accumulator_dtype))
  ok, wsum = jnp.all(_weight_ok(ws)), jnp.sum(ws)
  flatten = treedef.flatten_up_to  # type: ignore[attr-defined]  # jaxlib types PyTreeDef loosely
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


def pad_microbatches(microbatches, num_microbatches: int, *, num_devices: int = 1):
  """Lays out n <= P K microbatches as one batch of P K microbatches (the rest padding), and a row mask.

  For a step built with `num_microbatches=K` (K_max) and `skip_empty=True`
  that should run a number of real microbatches that changes from step to
  step without recompiling: the batch always has P K microbatches of m rows
  (P = `num_devices`, the size of the data axis), of which the first n given
  here are real and the others zeros. Microbatch j goes to device j mod P,
  microbatch slot j // P there, so real microbatches are spread over the
  devices (each runs ceil(n/P) or fewer) and, in the layout `microbatch`
  splits (slot i of a device holds rows i, i+K, i+2K, ... of its contiguous
  block of m K rows), row t of microbatch j lands at global row

    p m K + t K + i,   p = j mod P,  i = j // P.

  Host-side (numpy), for the data loader; pass the result through
  `ja.shard_batch` on a mesh.

  Args:
    microbatches: a non-empty sequence of n pytrees with the same structure,
      leaf shapes and dtypes, whose leaves share a leading size m.
    num_microbatches: K, microbatches per device per step (n <= P K).
    num_devices: P, the number of devices on the data axis (1 without a mesh).

  Returns:
    `(batch, mask)`: `batch` has the microbatches' structure with leaves of
    P K m rows (numpy, zeros in padding rows); `mask` is a bool vector of P K m
    rows, True on real rows. The step needs it as weight: put it in the
    batch and pass `weight_fn=lambda b: b["mask"].sum()` (a batch that already
    carries its own row mask gets zeros, weight 0, in the padding rows
    anyway). Without a `weight_fn` every padding microbatch weighs 1 and its
    masked-mean loss is 0/0: `make_train_step` then skips the whole step
    (`metrics["applied"]` False) rather than apply a NaN.
  """
  k = _tree.check_positive_int(num_microbatches, "num_microbatches")
  p = _tree.check_positive_int(num_devices, "num_devices")
  if isinstance(microbatches, dict) or not hasattr(microbatches, "__len__") or not len(microbatches):
    raise ValueError(f"microbatches must be a non-empty list of microbatches (pytrees), got {microbatches!r}")
  n = len(microbatches)
  if n > p * k:
    raise ValueError(f"{n} microbatches do not fit in num_devices={p} x num_microbatches={k} = {p * k}")
  leaves0, treedef = jax.tree.flatten(microbatches[0])
  m = leading_size(microbatches[0], "microbatches[0]")
  flat = []
  for j, mb in enumerate(microbatches):
    leaves, td = jax.tree.flatten(mb)
    if td != treedef:  # type: ignore[operator]  # jaxlib types PyTreeDef loosely
      raise ValueError(f"microbatches[{j}] has structure {td}, microbatches[0] has {treedef}")
    leading_size(mb, f"microbatches[{j}]")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mb), leaves0, strict=True):
      a, b = np.asarray(a), np.asarray(b)
      if a.shape != b.shape or a.dtype != b.dtype:
        where = jax.tree_util.keystr(path)
        raise ValueError(
          f"microbatches[{j}]{where} has shape {a.shape} and dtype {a.dtype} where "
          f"microbatches[0]{where} has {b.shape} and {b.dtype}: every microbatch needs "
          "the same shapes and dtypes"
        )
    flat.append(leaves)
  out = []
  for col in zip(*flat, strict=True):
    first = np.asarray(col[0])
    # (P, m, K, ...): device p, row t, slot i; a C-order reshape gives row p m K + t K + i.
    buf = np.zeros((p, m, k) + first.shape[1:], first.dtype)
    for j, leaf in enumerate(col):
      buf[j % p, :, j // p] = np.asarray(leaf)
    out.append(buf.reshape((p * m * k,) + first.shape[1:]))
  mask = np.zeros((p, m, k), bool)
  for j in range(n):
    mask[j % p, :, j // p] = True
  return jax.tree.unflatten(treedef, out), mask.reshape(-1)


REDUCTIONS = ("mean", "sum", "concat", "last")
_ADD = "add"  # internal (not a user's reduction): every microbatch's output added as it is


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


def _leaf_reductions(reductions, outs, name: str = "fun's output", arg: str = "reductions=") -> list[str]:
  """The reduction of each leaf of `outs`, `reductions` being a tree prefix of `outs`; checks dtypes.

  `name` and `arg`: how errors name the outputs and the argument to change (make_train_step: "aux",
  "aux_reductions=").
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
  for path, leaf, r in zip(paths, leaves, reds, strict=True):
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


def _vma_kwargs(s) -> dict:
  """ShapeDtypeStruct keywords that keep `s`'s varying axes (none outside shard_map)."""
  mat = getattr(s, "manual_axis_type", None)
  return {} if mat is None else {"manual_axis_type": mat}


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


def _weight_ok(w) -> jax.Array:
  """A weight must be finite and >= 0 (0 meaning: this microbatch is all padding)."""
  return jnp.isfinite(w) & (w >= 0)


def _weighted(out, w, dtype):
  """w * out in `dtype`; exactly 0 where w == 0, so an all-padding microbatch (0/0 = NaN loss) adds nothing."""
  w = w.astype(dtype)
  return jnp.where(w == 0, jnp.zeros((), dtype), out.astype(dtype) * w)


def _wdtype(leaves, reds, override) -> jnp.dtype:
  """The dtype weights are summed in: the widest accumulator of the averaged leaves (float32 at least)."""
  return _tree.widest(
    _tree.accumulator_dtype(o.dtype, override) for o, r in zip(leaves, reds, strict=True) if r in ("mean", "sum", _ADD)
  )


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


def _gather_rows(x, axis_name):
  """All devices' rows in device order (tiled on axis 0); invariant over the axis under shard_map."""
  if parallel.vma_tracking(axis_name):
    return lax.all_gather(parallel.to_varying(x, axis_name), axis_name, axis=0, tiled=True, to="invarying")
  return lax.all_gather(x, axis_name, axis=0, tiled=True)


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


def _check_concat_rows(like, reds, rows: int) -> None:
  """A "concat" leaf must have a microbatch's rows first (or be a scalar): anything else cannot be put in row order."""
  for (path, s), r in zip(jax.tree_util.tree_leaves_with_path(like), reds, strict=True):
    if r == "concat" and s.ndim and s.shape[0] != rows:
      raise ValueError(
        f'fun\'s output{jax.tree_util.keystr(path)} has shape {s.shape}, reduced with "concat": its leading size '
        f"{s.shape[0]} is not the {rows} rows of a microbatch, so it cannot be put back in the batch's row order. "
        'Return per-example values with the microbatch\'s rows first, a scalar per microbatch, or use "sum"/"last"'
      )


def _typed_spec(s):
  """The PartitionSpec in `s`'s type over Explicit mesh axes (None when it has none)."""
  sharding = getattr(s, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or not any(e is not None for e in spec):
    return None
  return sharding


def _merge_rows(a):
  """(m, K, ...) -> (m K, ...): row j of microbatch i is batch row j K + i (free; keeps a typed row sharding)."""
  shape = (a.shape[0] * a.shape[1],) + tuple(a.shape[2:])
  sharding = _typed_spec(jax.typeof(a))
  if sharding is None:
    return jnp.reshape(a, shape)
  entries = list(sharding.spec) + [None] * (a.ndim - len(sharding.spec))
  return jnp.reshape(a, shape, out_sharding=NamedSharding(sharding.mesh, PartitionSpec(entries[0], *entries[2:])))
