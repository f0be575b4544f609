"""make_train_step(): microbatched, data-parallel training step with one all-reduce per update.

Plain `jax.jit` over a batch sharded on a data axis, with a `lax.scan` over
microbatches inside, lets XLA's partitioner all-reduce the gradient inside the
loop: K all-reduces per update. Here the step body runs under `jax.shard_map`:
each device accumulates the weighted sum of its microbatches' gradients
locally (parameters cast to varying with `lax.pcast`, so autodiff does not sum
over devices behind our back), then one all-reduce of (sum w g, sum w) after
the loop gives the global weighted mean, and the optimizer update runs
replicated on every device. The compiled HLO holds one gradient all-reduce per
step whatever K (tests/test_train_step.py counts it).

BatchNorm. A Flax `BatchNorm` in training mode normalizes each microbatch with
that microbatch's own statistics ("ghost batch norm" with ghost size
B/(P K)), so loss and gradient are the mean over microbatches of the
microbatch-normalized losses, not the full-batch-normalized loss. The updated
`batch_stats`, returned as aux, are averaged over all P K microbatches. For G
equal-size groups with means mu_g, biased variances v_g, full-batch mean mu
and full-batch variance v:

  mean_g mu_g = mu                                   (exact)
  mean_g v_g  = v - var_g(mu_g),   var_g(mu_g) = mean_g (mu_g - mu)^2

(law of total variance): the averaged running variance is smaller than the
full-batch variance by the variance of the microbatch means.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxaccum import _tree
from jaxaccum import parallel
from jaxaccum.microbatch import check_binds, leading_size, microbatch

_CLOSURE_HINT = (
    "loss_fn must take the batch as its second argument: loss_fn(params, batch) (and a key third, "
    "loss_fn(params, batch, key), when the step is given one). A loss that closes over its batch, "
    "as in `def loss(params): ... batch ...`, cannot be split into microbatches: add the batch argument.")


class TrainStep:
  """The jitted step with a cheap check in front: no deleted (donated) array reaches XLA.

  With `donate=True` the buffers of `params` and `opt_state` belong to the step's
  outputs after a call; passing the old ones again is a use-after-free (on a
  multi-device mesh, jax 0.10 segfaults). `__call__` looks at `is_deleted()` of
  the array leaves (Python only, before the jitted call) and raises a ValueError
  naming the argument. Everything else (`lower`, `trace`, `eval_shape`, ...) is
  the jitted function's.
  """

  def __init__(self, jitted, arg_names: tuple[str, ...], fun):
    self._jitted = jitted
    self._arg_names = arg_names
    self.batch_argnum = arg_names.index("batch")  # for ja.plan_microbatches' default candidates
    functools.update_wrapper(self, fun)

  def __call__(self, *args, **kwargs):
    named = list(zip(self._arg_names, args, strict=False)) + list(kwargs.items())
    for name, tree in named:
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
          outs = ", ".join(n for n in self._arg_names if n not in ("batch", "key")) + ", metrics"
          raise ValueError(
              f"{name}{jax.tree_util.keystr(path)} was deleted: it was donated to a previous call of this "
              f"step (make_train_step(..., donate=True) gives the buffers of the inputs to the outputs). "
              f"Use the step's outputs for the next call, rebind: {outs} = step({', '.join(self._arg_names[:-1])})"
              ", or build the step with donate=False.")
    return self._jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._jitted.lower(*args, **kwargs)

  def __getattr__(self, name):
    return getattr(self._jitted, name)


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    num_microbatches: int = 1,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    has_aux: bool = False,
    weight_fn: Callable[[Any], Any] | None = None,
    donate: bool = True,
):
  r"""Returns a jitted `step(params, opt_state, batch, key=None) -> (params, opt_state, metrics)`.

  One step computes the weighted mean gradient over the whole batch,

  .. math:: g = \frac{\sum_{p,i} w_{p,i}\, \nabla L(\theta; b_{p,i})}{\sum_{p,i} w_{p,i}},

  over the K microbatches i of each of the P devices p of `data_axis`, then
  applies `optimizer` once. With equal weights and a mean loss this is the
  full-batch gradient.

  A step with nothing to average (every weight 0: an all-padding batch) applies
  no update: `params` and `opt_state` come back bit-identical, `metrics["applied"]`
  is False and `metrics["total_weight"]` is 0 (NaN when a weight was negative or
  non-finite: that step is skipped too). An empty batch (0 rows) is a ValueError.

  Args:
    loss_fn: `loss_fn(params, batch[, key]) -> loss` or `(loss, aux)` with
      `has_aux`. Should be a mean over the rows of `batch` (see `weight_fn`).
      It must take the batch as an argument (not close over it).
    optimizer: an optax transformation; it runs once per step, replicated.
    num_microbatches: K, microbatches per device per step (int >= 1). The
      batch's leading size must be divisible by P * K.
    mesh: None to run on the default device; otherwise a mesh with axis
      `data_axis` (e.g. `ja.data_mesh()`): the batch is split over that axis
      (pass it through `ja.shard_batch`, params and state through
      `ja.replicate`, in particular on several processes), and the gradient is
      all-reduced once per step. Other mesh axes see replicated computation.
    data_axis: the mesh axis the batch is split over.
    has_aux: `loss_fn` returns `(loss, aux)`; aux (array pytree) is averaged
      like the loss, e.g. Flax `batch_stats` (see the module docstring).
    weight_fn: `weight_fn(microbatch) -> scalar` weight of a microbatch, e.g.
      `lambda b: b["mask"].sum()` for a masked-mean loss; default equal weights.
    donate: donate `params` and `opt_state` buffers to the outputs: after a
      call, the arrays passed in are deleted, so rebind
      `params, opt_state, metrics = step(params, opt_state, batch)`. Passing a
      deleted array is a ValueError naming it.

  Returns:
    A `jax.jit`-wrapped step (`.lower(...)` works). `metrics` holds
    `"loss"` (plus `"aux"` with `has_aux`): global weighted means;
    `"total_weight"`: sum of all weights (the number of microbatches P K by
    default); `"applied"`: whether the optimizer update was applied.
    A `key`, when given, is passed to `loss_fn` as
    `fold_in(fold_in(key, device_index), i)` for microbatch i (device index 0
    without a mesh), so devices and microbatches draw different randomness.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn={loss_fn!r} must be callable")
  if not hasattr(optimizer, "update") or not hasattr(optimizer, "init"):
    raise TypeError(f"optimizer={optimizer!r} must be an optax GradientTransformation")
  k = _tree.check_positive_int(num_microbatches, "num_microbatches")
  if not isinstance(has_aux, bool):
    raise TypeError(f"{has_aux=} must be a bool")
  if not isinstance(donate, bool):
    raise TypeError(f"{donate=} must be a bool")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn={weight_fn!r} must be callable or None")
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh (see ja.data_mesh)")
    if data_axis not in mesh.axis_names:
      raise ValueError(f"{data_axis=} is not an axis of the mesh (its axes: {mesh.axis_names})")
  try:  # loss_fn(params, batch), or loss_fn(params, batch, key) for a step given a key
    check_binds(loss_fn, "loss_fn", (None, None, None), {}, _CLOSURE_HINT)
  except TypeError:
    check_binds(loss_fn, "loss_fn", (None, None), {}, _CLOSURE_HINT)
  axis = data_axis if mesh is not None else None
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

  def local_step(params, opt_state, batch, key):
    """The step as one device sees it (inside shard_map when there is a mesh)."""
    diff_params = params
    if axis is not None:
      # Varying params: per-device gradients stay local; the all-reduce is ours.
      diff_params = lax.pcast(params, axis, to="varying")
      if key is not None:
        key = jax.random.fold_in(key, lax.axis_index(axis))
    elif key is not None:
      key = jax.random.fold_in(key, 0)
    args = (diff_params, batch) if key is None else (diff_params, batch, key)
    fun = grad_fn
    if axis is not None:
      # The parameters are varying, so the gradients are per device by construction;
      # a loss or aux that is the same on every device (a constant) is then fine too.
      fun = lambda *a: parallel.to_varying(grad_fn(*a), axis)
    (value, grads), total = microbatch(
        fun, k, batch_argnums=1, weight_fn=weight_fn, key_argnum=None if key is None else 2,
        axis_name=axis, return_total_weight=True)(*args)
    # NaN (an invalid weight) compares False too: no update from it either.
    applied = total > 0

    def update(ops):
      params, opt_state, grads = ops
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    params, opt_state = parallel.cond(applied, update, lambda ops: ops[:2], (params, opt_state, grads))
    metrics = {"loss": value[0], "aux": value[1]} if has_aux else {"loss": value}
    metrics.update(total_weight=total, applied=applied)
    return params, opt_state, metrics

  def step(params, opt_state, batch, key=None):
    # Checked here, on the global shapes: inside shard_map a device sees only its rows.
    size = leading_size(batch)
    check_binds(loss_fn, "loss_fn", (None, None) if key is None else (None, None, None), {}, _CLOSURE_HINT)
    if mesh is None:
      return local_step(params, opt_state, batch, key)
    shards = mesh.shape[data_axis]
    if size % (shards * k):
      raise ValueError(
          f"the batch's leading size {size} is not divisible by {shards} devices on {data_axis=} "
          f"times num_microbatches={k}")
    replicated, split = PartitionSpec(), PartitionSpec(data_axis)
    key_spec = None if key is None else replicated
    body = jax.shard_map(
        lambda p, s, b, r: local_step(p, s, b, r), mesh=mesh,
        in_specs=(replicated, replicated, split, key_spec),
        out_specs=(replicated, replicated, replicated))
    return body(params, opt_state, batch, key)

  jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
  return TrainStep(jitted, ("params", "opt_state", "batch", "key"), step)
