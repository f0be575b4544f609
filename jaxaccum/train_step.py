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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxaccum import _tree, parallel
from jaxaccum import noise as _noise
from jaxaccum.microbatch import _check_reductions, _leaf_reductions, check_binds, leading_size, microbatch

_CLOSURE_HINT = (
  "loss_fn must take the batch as its second argument: loss_fn(params, batch) (and a key third, "
  "loss_fn(params, batch, key), when the step is given one). A loss that closes over its batch, "
  "as in `def loss(params): ... batch ...`, cannot be split into microbatches: add the batch argument."
)
_STATE_HINT = (
  "With has_state=True, loss_fn must take the model state second and the batch third: "
  "loss_fn(params, state, batch) (and a key fourth when the step is given one), returning "
  "(loss, new_state), or (loss, (new_state, aux)) with has_aux. A loss that closes over its batch "
  "cannot be split into microbatches: add the batch argument."
)


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
            ", or build the step with donate=False."
          )
    return self._jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._jitted.lower(*args, **kwargs)

  def __getattr__(self, name):
    return getattr(self._jitted, name)


def _sharded_step(
  loss_fn,
  optimizer,
  *,
  num_microbatches,
  mesh,
  data_axis,
  has_aux,
  weight_fn,
  donate,
  aux_reductions,
  has_state,
  state_reductions,
  grad_norms,
  strategy,
  comm_dtype,
  fsdp_gather,
  noise_scale=False,
  skip_empty=False,
):
  """make_train_step for a sharded strategy (or ddp with a wire dtype): `jaxaccum.sharded` builds it."""
  from jaxaccum import sharded  # sharded imports only _tree and parallel: no cycle

  if not isinstance(strategy, str) or strategy not in sharded.STRATEGIES:
    raise ValueError(f"{strategy=} must be one of {sharded.STRATEGIES}")
  if fsdp_gather is not None and strategy not in ("fsdp", "hsdp"):
    raise ValueError(f"{fsdp_gather=} applies to strategy='fsdp' or 'hsdp' only, not {strategy=}")
  if mesh is None:
    raise ValueError(f"{strategy=} (or comm_dtype/fsdp_gather) needs a mesh: make_train_step(..., mesh=...)")
  for name, value in (
    ("has_state", has_state),
    ("grad_norms", grad_norms),
    ("noise_scale", noise_scale),
    ("skip_empty", skip_empty),
  ):
    if value is not False:
      raise ValueError(f"{name}={value!r} is not supported with {strategy=} yet (only with strategy='ddp')")
  for name, value in (("aux_reductions", aux_reductions), ("state_reductions", state_reductions)):
    if value is not None:
      raise ValueError(f"{name}={value!r} is not supported with {strategy=} yet (only with strategy='ddp')")
  return sharded.make_sharded_train_step(
    loss_fn,
    optimizer,
    strategy=strategy,
    mesh=mesh,
    data_axis=data_axis,
    num_microbatches=num_microbatches,
    has_aux=has_aux,
    weight_fn=weight_fn,
    donate=donate,
    comm_dtype=comm_dtype,
    fsdp_gather="per_microbatch" if fsdp_gather is None else fsdp_gather,
  )


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
  aux_reductions: Any = None,
  has_state: bool = False,
  state_reductions: Any = None,
  grad_norms: bool = False,
  strategy: str = "ddp",
  comm_dtype: Any = None,
  fsdp_gather: str | None = None,
  noise_scale: bool = False,
  skip_empty: bool = False,
):
  r"""Returns a jitted `step(params, opt_state, batch, key=None) -> (params, opt_state, metrics)`.

  One step computes the weighted mean gradient over the whole batch,

  .. math:: g = \frac{\sum_{p,i} w_{p,i}\, \nabla L(\theta; b_{p,i})}{\sum_{p,i} w_{p,i}},

  over the K microbatches i of each of the P devices p of `data_axis`, then
  applies `optimizer` once. With equal weights and a mean loss this is the
  full-batch gradient.

  A step with nothing to average (every weight 0: an all-padding batch) applies
  no update: `params`, `opt_state` (and `state`) come back bit-identical,
  `metrics["applied"]` is False and `metrics["total_weight"]` is 0 (NaN when a
  weight was negative or non-finite: that step is skipped too). So is a step
  whose mean gradient holds a NaN or an Inf (e.g. a microbatch of padding only,
  0/0, given weight 1 because there is no `weight_fn`): `applied` is False with a
  positive `total_weight`, and nothing changes. An empty batch (0 rows) is a
  ValueError.

  A varying number of microbatches (`skip_empty=True`, needs `weight_fn`): a
  microbatch of weight 0 is not run (no forward or backward pass, see
  `ja.microbatch`), so one compiled step with K = K_max runs however many real
  microbatches the batch holds, n <= K_max per device, read from the data:
  no recompile when n changes. `ja.pad_microbatches` lays out n microbatches
  as a batch of K_max (P K_max on a mesh) with a row mask. The result equals
  the full-batch step on the real rows; skipped microbatches contribute
  nothing to the loss, gradient, aux, state or noise scale; their
  `grad_norms` entries and "concat" rows are 0; "last" is the last microbatch
  that ran (of the last device that ran one).

  Model state (`has_state=True`): state that is not trained but updated by the
  forward pass (Flax `batch_stats`, `eqx.nn.State`, nnx `BatchStat`/RNG state)
  goes through the step beside the parameters:

    loss_fn(params, state, batch[, key]) -> (loss, new_state)      or, with has_aux,
    loss_fn(params, state, batch[, key]) -> (loss, (new_state, aux))
    step(params, state, opt_state, batch[, key]) -> (params, state, opt_state, metrics)

  Every microbatch sees the `state` passed in (not its predecessor's), and the
  new states of all P K microbatches are combined per `state_reductions`:
  by default a floating leaf is their weighted mean (BatchNorm running
  statistics: see the module docstring for how that compares with the full
  batch) and any other leaf (counters, flags, PRNG keys) is the last one's,
  that of the last microbatch of the last device. The new state must have the
  structure of the state passed in; it comes back in its dtypes.

  Args:
    loss_fn: `loss_fn(params, batch[, key]) -> loss` or `(loss, aux)` with
      `has_aux` (with `has_state`: see above). Should be a mean over the rows
      of `batch` (see `weight_fn`). It must take the batch as an argument
      (not close over it).
    optimizer: an optax transformation; it runs once per step, replicated.
    num_microbatches: K, microbatches per device per step (int >= 1). The
      batch's leading size must be divisible by P * K.
    mesh: None to run on the default device; otherwise a mesh with axis
      `data_axis` (e.g. `ja.data_mesh()`): the batch is split over that axis
      (pass it through `ja.shard_batch`, params and state through
      `ja.replicate`, in particular on several processes), and the gradient is
      all-reduced once per step. Other mesh axes see replicated computation.
    data_axis: the mesh axis the batch is split over.
    has_aux: `loss_fn` returns `(loss, aux)`; aux (array pytree) is combined
      per `aux_reductions`, by default averaged like the loss.
    weight_fn: `weight_fn(microbatch) -> scalar` weight of a microbatch, e.g.
      `lambda b: b["mask"].sum()` for a masked-mean loss; default equal weights.
    donate: donate `params`, `opt_state` (and `state`) buffers to the outputs:
      after a call the arrays passed in are deleted, so rebind
      `params, opt_state, metrics = step(params, opt_state, batch)`. Passing a
      deleted array is a ValueError naming it.
    aux_reductions: how aux leaves are combined over microbatches and devices,
      as `ja.microbatch`'s `reductions` (a tree prefix of aux; "mean", "sum",
      "concat", "last"), e.g. `{"logits": "concat", "correct": "sum"}`: per-
      example logits come back for the whole batch in its row order. "last"
      is the last microbatch of the last device. Default: every leaf "mean".
    has_state: thread model state through the step (see above).
    state_reductions: a tree prefix of the state naming each leaf's
      reduction; default "mean" for floating leaves, "last" for the others.
    grad_norms: also return `metrics["grad_norms"]`, the global L2 norm of each
      microbatch's gradient, shape (P K,) (device p's microbatch i at p K + i):
      one extra pass over the gradient per microbatch, one small all-gather.
    strategy: how parameters and optimizer state are laid out over the data
      axis (see `ja.shard_train_state`, which places them): "ddp" (replicated;
      one gradient all-reduce per step), "zero1" (optimizer state sharded; one
      reduce-scatter and one all-gather), "fsdp" (parameters and state
      sharded), "hsdp" (`data_axis=(replica_axis, shard_axis)`: fsdp within a
      group, one cross-replica all-reduce per step). Strategies other than
      "ddp" need a `mesh` and do not take `has_state`, `aux_reductions` or
      `grad_norms`.
    comm_dtype: dtype of the gradient on the wire (e.g. `jnp.bfloat16`);
      accumulation stays in float32 or wider.
    fsdp_gather: "fsdp"/"hsdp" only: "per_microbatch" (memory-lean, the
      default) or "once" (comm-lean: one parameter all-gather per step instead
      of K, at the cost of one full parameter copy and one full accumulator per
      device). Given with another strategy it is a ValueError.
    noise_scale: also return `metrics["noise_scale"]`, a `ja.NoiseScale` of
      this step's unbiased estimates of |G|^2 and tr(Sigma) (and their ratio
      B_simple) from its P K microbatches (see `jaxaccum.noise`; NaN when
      fewer than 2 microbatches have weight > 0), in the units of the weights:
      examples with `weight_fn` returning row counts, microbatches without a
      `weight_fn`. Cost: one squared norm per
      microbatch; two scalars join the gradient's all-reduce. One step's
      estimate is noisy: smooth it across steps with
      `ema = ja.noise_scale_smooth(ema, metrics["noise_scale"], decay)`
      (start from `ema = None`) and read `ja.noise_scale(ema)`.
    skip_empty: skip microbatches of weight 0 (see above); needs
      `weight_fn`; "ddp" only.

  Returns:
    A `jax.jit`-wrapped step (`.lower(...)` works). `metrics` holds
    `"loss"` (plus `"aux"` with `has_aux`): global weighted means;
    `"total_weight"`: sum of all weights (the number of microbatches P K by
    default); `"applied"`: whether the optimizer update was applied;
    `"grad_norms"` with `grad_norms`.
    A `key`, when given, is passed to `loss_fn` as
    `fold_in(fold_in(key, device_index), i)` for microbatch i (device index 0
    without a mesh), so devices and microbatches draw different randomness.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn={loss_fn!r} must be callable")
  if strategy != "ddp" or comm_dtype is not None or fsdp_gather is not None:
    return _sharded_step(
      loss_fn,
      optimizer,
      num_microbatches=num_microbatches,
      mesh=mesh,
      data_axis=data_axis,
      has_aux=has_aux,
      weight_fn=weight_fn,
      donate=donate,
      aux_reductions=aux_reductions,
      has_state=has_state,
      state_reductions=state_reductions,
      grad_norms=grad_norms,
      strategy=strategy,
      comm_dtype=comm_dtype,
      fsdp_gather=fsdp_gather,
      noise_scale=noise_scale,
      skip_empty=skip_empty,
    )
  if not hasattr(optimizer, "update") or not hasattr(optimizer, "init"):
    raise TypeError(f"optimizer={optimizer!r} must be an optax GradientTransformation")
  k = _tree.check_positive_int(num_microbatches, "num_microbatches")
  for name, value in (
    ("has_aux", has_aux),
    ("donate", donate),
    ("has_state", has_state),
    ("grad_norms", grad_norms),
    ("noise_scale", noise_scale),
    ("skip_empty", skip_empty),
  ):
    if not isinstance(value, bool):
      raise TypeError(f"{name}={value!r} must be a bool")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn={weight_fn!r} must be callable or None")
  if skip_empty and weight_fn is None:
    raise ValueError(
      f"{skip_empty=} needs a weight_fn: a microbatch is empty when its weight is 0 "
      "(e.g. weight_fn=lambda b: b['mask'].sum())"
    )
  if aux_reductions is not None and not has_aux:
    raise ValueError(f"{aux_reductions=} needs has_aux=True (loss_fn returning (loss, aux))")
  if state_reductions is not None and not has_state:
    raise ValueError(f"{state_reductions=} needs has_state=True")
  # Names checked now; the tree against the outputs when the step is traced.
  _check_reductions(aux_reductions)
  _check_reductions(state_reductions)
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh (see ja.data_mesh)")
    if data_axis not in mesh.axis_names:
      raise ValueError(f"{data_axis=} is not an axis of the mesh (its axes: {mesh.axis_names})")
  head = (None, None, None) if has_state else (None, None)
  hint = _STATE_HINT if has_state else _CLOSURE_HINT
  try:  # loss_fn(params[, state], batch), or with a key last for a step given a key
    check_binds(loss_fn, "loss_fn", head + (None,), {}, hint)
  except TypeError:
    check_binds(loss_fn, "loss_fn", head, {}, hint)
  axis = data_axis if mesh is not None else None
  # With skipping on a mesh, "last" leaves come from the last device that ran a microbatch.
  ran_flag = skip_empty and axis is not None
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux or has_state)
  nbatch = len(head) - 1  # the batch's position among loss_fn's arguments

  def local_step(params, state, opt_state, batch, key):
    """The step as one device sees it (inside shard_map when there is a mesh)."""
    diff_params = params
    if axis is not None:
      # Varying params: per-device gradients stay local; the all-reduce is ours.
      diff_params = lax.pcast(params, axis, to="varying")
      if key is not None:
        key = jax.random.fold_in(key, lax.axis_index(axis))
    elif key is not None:
      key = jax.random.fold_in(key, 0)
    args = (diff_params,) + ((state,) if has_state else ()) + (batch,) + (() if key is None else (key,))

    def fun(*a):
      try:
        value, grads = grad_fn(*a)
      except TypeError as e:
        if "scalar-output" not in str(e) or has_aux or has_state:
          raise
        raise TypeError(
          f"loss_fn returned more than a scalar loss ({e}). If it returns (loss, aux), pass "
          "make_train_step(..., has_aux=True); if it returns (loss, new_model_state), has_state=True "
          "(loss_fn(params, state, batch))."
        ) from None
      if has_state:  # checked here, before the state's reductions are matched against it
        new_state = value[1][0] if has_aux else value[1]
        _tree.check_same_structure(new_state, state, "the state loss_fn returned", "the state passed to the step")
      out = (value, grads, optax.tree.norm(grads)) if grad_norms else (value, grads)
      if noise_scale:  # |g_i|^2 (a weighted mean: S1) and 1 (a sum over microbatches of weight > 0: K)
        wide = _tree.widest(_tree.accumulator_dtype(x.dtype) for x in jax.tree.leaves(grads))
        out = (*out, _noise.sq_norm(grads, wide), jnp.ones([], wide))
      if ran_flag:  # 1 on a device that ran a microbatch, "last": its init 0 on one that skipped them all
        out = (*out, jnp.ones([], jnp.float32))
      # The parameters are varying, so the gradients are per device by construction;
      # a loss or aux that is the same on every device (a constant) is then fine too.
      return out if axis is None else parallel.to_varying(out, axis)

    state_red = None
    if has_state:
      state_red = state_reductions
      if state_red is None:
        state_red = jax.tree.map(lambda x: "mean" if jnp.issubdtype(x.dtype, jnp.inexact) else "last", state)
    aux_red = "mean" if aux_reductions is None else aux_reductions
    value_red: Any = "mean"
    if has_state or has_aux:
      value_red = ("mean", (state_red, aux_red) if has_state and has_aux else state_red if has_state else aux_red)
    reductions = (value_red, "mean") + (("concat",) if grad_norms else ()) + (("mean", "sum") if noise_scale else ())
    reductions += ("last",) if ran_flag else ()
    out, total = microbatch(
      fun,
      k,
      batch_argnums=nbatch,
      weight_fn=weight_fn,
      key_argnum=None if key is None else nbatch + 1,
      axis_name=axis,
      reductions=reductions,
      return_total_weight=True,
      skip_empty=skip_empty,
    )(*args)
    ran = None
    if ran_flag:
      ran, out = out[-1], out[:-1]
    value, grads = out[0], out[1]
    loss, new_state, aux = value, None, None
    if has_state:
      loss, rest = value
      new_state, aux = rest if has_aux else (rest, None)
      if axis is not None:
        new_state = _last_of_last_device(new_state, state_red, axis, ran)
      new_state = _tree.cast_like(new_state, state)  # the same dtypes every step: no recompiles
    elif has_aux:
      loss, aux = value
    if has_aux and axis is not None:
      aux = _last_of_last_device(aux, aux_red, axis, ran)
    # NaN (an invalid weight) compares False too: no update from it either. Nor from a
    # non-finite mean gradient (a microbatch of weight > 0 whose loss was NaN, e.g. padding
    # without a weight_fn): the grads are all-reduced, so every device decides the same.
    applied = (total > 0) & _tree.all_finite(grads)

    def update(ops):
      params, state, opt_state, grads, new_state = ops
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), new_state, opt_state

    params, state, opt_state = parallel.cond(
      applied, update, lambda ops: ops[:3], (params, state, opt_state, grads, new_state)
    )
    metrics = {"loss": loss}
    if has_aux:
      metrics["aux"] = aux
    metrics.update(total_weight=total, applied=applied)
    if grad_norms:
      metrics["grad_norms"] = out[2]
    if noise_scale:
      s1, count = out[-2], out[-1]
      # |g|^2 of the all-reduced mean: the same on every device, no collective.
      mean_sq = _noise.sq_norm(grads, s1.dtype)
      grad_sq, trace_cov, valid = _noise.window_estimates(s1 * total.astype(s1.dtype), total, mean_sq, count)
      metrics["noise_scale"] = _noise.step_estimate(grad_sq, trace_cov, valid)
    return params, state, opt_state, metrics

  def step(params, state, opt_state, batch, key=None):
    # Checked here, on the global shapes: inside shard_map a device sees only its rows.
    size = leading_size(batch)
    check_binds(loss_fn, "loss_fn", head if key is None else head + (None,), {}, hint)
    if mesh is None:
      return local_step(params, state, opt_state, batch, key)
    shards = mesh.shape[data_axis]
    if size % (shards * k):
      raise ValueError(
        f"the batch's leading size {size} is not divisible by {shards} devices on {data_axis=} "
        f"times num_microbatches={k}"
      )
    replicated, split = PartitionSpec(), PartitionSpec(data_axis)
    key_spec = None if key is None else replicated
    body = jax.shard_map(
      lambda p, st, s, b, r: local_step(p, st, s, b, r),
      mesh=mesh,
      in_specs=(replicated, replicated, replicated, split, key_spec),
      out_specs=(replicated, replicated, replicated, replicated),
    )
    return body(params, state, opt_state, batch, key)

  if has_state:

    def stateful_step(params, state, opt_state, batch, key=None):
      return step(params, state, opt_state, batch, key)

    jitted = jax.jit(stateful_step, donate_argnums=(0, 1, 2) if donate else ())
    return TrainStep(jitted, ("params", "state", "opt_state", "batch", "key"), stateful_step)

  def plain_step(params, opt_state, batch, key=None):
    params, _, opt_state, metrics = step(params, None, opt_state, batch, key)
    return params, opt_state, metrics

  jitted = jax.jit(plain_step, donate_argnums=(0, 1) if donate else ())
  return TrainStep(jitted, ("params", "opt_state", "batch", "key"), plain_step)


def _last_of_last_device(tree, reductions, axis, ran=None):
  """Leaves reduced with "last" hold each device's own last microbatch: take the last device's.

  So that the step's outputs are replicated, and "last" means the last
  microbatch of the whole batch. One small all-gather of those leaves. `ran`
  (skip_empty): per device, > 0 where it ran a microbatch; the last such
  device's values are taken (the last device's when none ran: the step then
  applies nothing anyway).
  """
  if tree is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  reds = _leaf_reductions(reductions, tree)
  picked = [i for i, r in enumerate(reds) if r == "last"]
  if picked:
    sent = [leaves[i] for i in picked] + ([] if ran is None else [ran])
    got = lax.all_gather(parallel.to_varying(sent, axis), axis, to="invarying")
    last: Any = -1  # the last device, or (skip_empty) a traced index
    if ran is not None:
      flags = got.pop() > 0
      n = flags.shape[0]
      last = jnp.where(jnp.any(flags), n - 1 - jnp.argmax(flags[::-1]), n - 1)
    for i, g in zip(picked, got, strict=True):
      leaves[i] = g[last]
  return jax.tree.unflatten(treedef, leaves)
