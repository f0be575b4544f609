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
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _tree, _unreduced, parallel
from jaxaccum._split import leading_size, split, weights
from jaxaccum._sums import PER_ROW, _check_reductions, _checked_total, _reduce_partial_sums, _single, finish, local_sums


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


def _locate(args, kwargs, argnums, names, batch_argnums, key_argnum) -> tuple[tuple[int, ...], int | None]:
  """The call's batch positions and key position (None without `key_argnum`), checked against its arguments."""
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
  return idx, kidx


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

  - `"mean"`: the weighted mean above (the default, except for per-example
    outputs: see `reductions`);
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
      `jax.random.fold_in(key, i)` (also when K = 1). A tree of keys (an
      `nnx.Rngs` state from `nnx.split`, a dict of `jax.random.key`s or raw
      `jax.random.PRNGKey`s) has every key folded so, typed or raw, and its
      integer scalars (the counts) kept; any other leaf is refused by its path
      (it cannot be told from a key, and unfolded it would repeat the draws).
      A key in any other argument is the same for every microbatch, as a key
      in make_train_step's model state.
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
      Default (None): "concat" for a leaf whose leading size is a
      microbatch's rows (a per-example aux), "mean" for the others and for a
      subtree shaped as an unsplit argument (the gradient): the one default of
      every entry point (docs/guides/microbatch.md, "Per-example outputs").
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
    idx, kidx = _locate(args, kwargs, argnums, names, batch_argnums, key_argnum)
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
        call_args[kidx] = _tree.fold_keys(args[kidx], i)
      # Python scalars (a float returned as a metric) become arrays, as jit would make them.
      return jax.tree.map(jnp.asarray, fun(*call_args, **call_kwargs))

    ws = weights(sp, weight_fn, num_real_microbatches)
    skip = skip_empty or num_real_microbatches is not None
    # num_real_microbatches=0 asks for nothing: zeros (total weight 0) eagerly too, as under jit and in optax.
    none_real = num_real_microbatches is not None and _tree.is_concrete(num_real_microbatches)
    none_real = none_real and int(num_real_microbatches) == 0
    reds = reductions
    if reductions is None:
      unsplit = [a for j, a in enumerate(args) if j not in idx] + [v for n, v in kwargs.items() if n not in names]
      reds = functools.partial(default_reductions, unsplit=unsplit)
    sums = local_sums(run, sp, ws, reductions=reds, accumulator_dtype=accumulator_dtype, skip=skip)
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


def default_reductions(like, unsplit):
  """`microbatch`'s reductions when none are named: the one per-example default (docs/guides/microbatch.md).

  A subtree of the outputs with the structure and shapes of an unsplit
  argument (the gradient of `jax.value_and_grad(loss)` w.r.t. the parameters)
  is averaged; every other leaf gets `PER_ROW`: concatenated in row order when
  its leading size is a microbatch's rows (a per-example aux such as logits),
  averaged otherwise.
  """
  signatures = {_signature(a) for a in unsplit}

  def walk(tree):
    if _signature(tree) in signatures:
      return jax.tree.map(lambda _: "mean", tree)
    children, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
    if treedef.num_leaves == 1 and len(children) == 1 and children[0] is tree:  # type: ignore[attr-defined]
      return PER_ROW
    return jax.tree_util.tree_unflatten(treedef, [walk(c) for c in children])

  return walk(like)


def _signature(tree):
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return None
  return treedef, tuple(tuple(jnp.shape(x)) if hasattr(x, "shape") else None for x in leaves)


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
