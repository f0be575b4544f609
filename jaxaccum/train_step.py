"""make_train_step(): one microbatched, data-parallel training step for every strategy and option.

Plain `jax.jit` over a batch sharded on a data axis, with a `lax.scan` over
microbatches inside, lets XLA's partitioner all-reduce the gradient inside the
loop: K all-reduces per update. Here every strategy (none, ddp, zero1, fsdp,
hsdp) runs one engine (`jaxaccum._engine`): inside a `jax.shard_map` manual
over the data axes, each device accumulates its microbatches' gradients
locally (parameters cast to varying with `lax.pcast`, so autodiff does not sum
over devices behind our back), already normalised by the global total weight
(a scalar reduced before the loop), and after the loop one reduction per step
(an all-reduce, a reduce-scatter, or fsdp's reduce-scatter per layer as each
gradient appears) gives the global weighted mean; the optimizer then runs on
the global arrays in the strategy's layout. This module holds the argument
checks and the `TrainStep` wrapper; tests/test_engine.py holds every option
under every strategy against a plain reference.

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
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jaxaccum import _engine, _tree, sharded
from jaxaccum import noise as _noise
from jaxaccum._split import leading_size
from jaxaccum._sums import PER_ROW, _check_reductions
from jaxaccum.microbatch import check_accumulator_dtype, check_binds, check_skip_empty

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


def check_not_donated(named: dict, arg_names: tuple[str, ...]) -> None:
  """Raise the documented ValueError if an argument holds a deleted (donated) array.

  One guard for every step object (`TrainStep`, `DiLoCoTrainStep`): a donated
  buffer belongs to the previous call's outputs, and handing it to XLA again is
  a use-after-free that kills the interpreter on a multi-device mesh.
  """
  for name, tree in named.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
        outs = ", ".join(n for n in arg_names if n not in ("batch", "key")) + ", metrics"
        raise ValueError(
          f"{name}{jax.tree_util.keystr(path)} was deleted: it was donated to a previous call of this "
          f"step (make_train_step(..., donate=True) gives the buffers of the inputs to the outputs). "
          f"Use the step's outputs for the next call, rebind: {outs} = step({', '.join(arg_names[:-1])})"
          ", or build the step with donate=False."
        )


class TrainStep:
  """The step `make_train_step` returns: argument checks in front of one jitted function.

  Before the jitted call (Python only, cheap): no deleted (donated) array may
  reach XLA (with `donate=True` the buffers of `params`, `opt_state` and
  `state` belong to the step's outputs; passing the old ones again is a
  use-after-free, which segfaults on a multi-device mesh in jax 0.10), the
  batch's size must split into devices times microbatches, `opt_state` must be
  the optimizer's, and the parameters' layouts are read (on an Auto mesh a
  user's sharding over other axes, e.g. "model", is known only there) and
  passed to the trace as a static argument. Called inside an outer `jax.jit`,
  the layouts come from the mesh, the shapes and (Explicit axes) the types, so
  the step keeps its shardings there too.
  """

  def __init__(self, cfg: _engine.Config, arg_names: tuple[str, ...], hint: str):
    self._cfg, self._arg_names, self._hint = cfg, arg_names, hint
    self.batch_argnum = arg_names.index("batch")  # for ja.plan_microbatches' default candidates
    has_state = cfg.has_state

    def fun(*args, given=None, state_replicated=False):
      params, state, opt_state, batch, key = args if has_state else (args[0], None, *args[1:])
      out = _engine.step(cfg, given, params, state, opt_state, batch, key, state_replicated=state_replicated)
      return out if has_state else (out[0], *out[2:])

    donate = tuple(range(3 if has_state else 2)) if cfg.donate else ()
    self._jitted = jax.jit(fun, donate_argnums=donate, static_argnames=("given", "state_replicated"))
    functools.update_wrapper(self, cfg.loss_fn, assigned=("__doc__",), updated=())

  def _prepare(self, args, kwargs):
    named = dict(zip(self._arg_names, args, strict=False)) | kwargs
    unknown = set(named) - set(self._arg_names)
    if unknown or len(args) > len(self._arg_names):
      raise TypeError(f"the step takes ({', '.join(self._arg_names)}), got {len(args)} positional and {sorted(kwargs)}")
    for name in self._arg_names[:-1]:
      if name not in named:
        raise TypeError(f"the step takes ({', '.join(self._arg_names)}): {name} is missing")
    check_not_donated(named, self._arg_names)
    cfg, key = self._cfg, named.get("key")
    head = (None,) * (self._arg_names.index("batch") - 1 if cfg.has_state else 1)
    check_binds(cfg.loss_fn, "loss_fn", head + (None,) * (1 if key is None else 2), {}, self._hint)
    size = leading_size(named["batch"])
    devices = 1 if cfg.mesh is None else int(np.prod([cfg.mesh.shape[a] for a in cfg.plan.batch_axes]))
    if size % (devices * cfg.k):
      where = "" if cfg.mesh is None else f" {devices} devices on data axes {cfg.plan.batch_axes} times"
      raise ValueError(f"the batch's leading size {size} is not divisible by{where} num_microbatches={cfg.k}")
    _check_opt_state(cfg.optimizer, named["params"], named["opt_state"])
    given = None
    if cfg.mesh is not None:
      params = named["params"]
      given = tuple(sharded.given_spec(x, cfg.mesh) for x in jax.tree.leaves(params))
      # Parameters placed on the mesh must be laid out as the strategy wants (a silent reshard costs a
      # collective every step); ones on one device (or host values) are placed here, as jit would.
      layouts = sharded._layouts(params, cfg.mesh, cfg.plan, placed=True, given=list(given))
      if "one device" in given:
        flat = jax.tree.leaves(layouts, is_leaf=sharded._is_leaf)
        leaves = [
          sharded._put(x, NamedSharding(cfg.mesh, lay.param_spec)) if g == "one device" else x
          for x, g, lay in zip(jax.tree.leaves(params), given, flat, strict=True)
        ]
        named["params"] = jax.tree.unflatten(jax.tree.structure(params), leaves)
        given = tuple(sharded.given_spec(x, cfg.mesh) for x in leaves)
    args = tuple(named.get(n) for n in self._arg_names)
    replicated = cfg.mesh is not None and all(_replicated_on(x, cfg.mesh) for x in jax.tree.leaves(named["opt_state"]))
    return args, {"given": given, "state_replicated": replicated}

  def __call__(self, *args, **kwargs):
    args, statics = self._prepare(args, kwargs)
    return self._jitted(*args, **statics)

  def lower(self, *args, **kwargs):
    args, statics = self._prepare(args, kwargs)
    return self._jitted.lower(*args, **statics)

  def trace(self, *args, **kwargs):
    args, statics = self._prepare(args, kwargs)
    return self._jitted.trace(*args, **statics)

  def eval_shape(self, *args, **kwargs):
    args, statics = self._prepare(args, kwargs)
    return self._jitted.eval_shape(*args, **statics)

  def __getattr__(self, name):
    return getattr(self._jitted, name)


def _replicated_on(x, mesh) -> bool:
  """Whether `x` (a leaf of the optimizer state) has no layout but a replicated one on `mesh`'s devices.

  A host value or an uncommitted array has none of its own (jit lays it out as the computation wants); a
  traced value (inside an outer jit) or an array laid out otherwise (sharded, on other devices) does.
  """
  if isinstance(x, jax.core.Tracer):
    return False
  if isinstance(x, jax.Array) and not x.committed:
    return True
  sharding = getattr(x, "sharding", None)  # an array's, a ShapeDtypeStruct's, or None (a host value)
  if sharding is None:
    return True
  return bool(sharding.is_fully_replicated) and set(sharding.device_set) == set(mesh.devices.flat)


def _check_opt_state(optimizer, params, opt_state) -> None:
  """`opt_state` must have the structure `optimizer.init(params)` gives (e.g. not another optimizer's)."""
  try:
    want = jax.eval_shape(optimizer.init, params)
  except Exception:  # an init that cannot run abstractly: the step will say what is wrong
    return
  if jax.tree.structure(want) != jax.tree.structure(opt_state):  # type: ignore[operator]  # jaxlib types PyTreeDef loosely
    raise ValueError(
      f"opt_state does not match optimizer={optimizer!r}: it has structure {_tree.describe(opt_state)}, "
      f"optimizer.init(params) gives {_tree.describe(want)}. Create it with optimizer.init(params) "
      "(or ja.shard_train_state(params, optimizer, mesh, strategy=...)) for the optimizer given to make_train_step."
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
  noise_scale_sample: int | None = None,
  skip_empty: bool = False,
  skip_nonfinite: bool = True,
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
  that of the last microbatch of the last device (a typed `jax.random.key`
  too, bit for bit). The new state must have the
  structure of the state passed in; it comes back in its dtypes.

  Args:
    loss_fn: `loss_fn(params, batch[, key]) -> loss` or `(loss, aux)` with
      `has_aux` (with `has_state`: see above). Should be a mean over the rows
      of `batch` (see `weight_fn`). It must take the batch as an argument
      (not close over it).
    optimizer: an optax transformation; it runs once per step, under `jit`
      on the globally shaped gradient, state and parameters in their layout:
      replicated under ddp, each device updating its shard under zero1, fsdp
      and hsdp (the same update: a global quantity such as
      `clip_by_global_norm`'s norm comes from scalar all-reduces the
      partitioner inserts).
      One that takes extra arguments (`optax.GradientTransformationExtraArgs`
      whose `update` accepts `value` or `**kwargs`, e.g. `optax.contrib.
      reduce_on_plateau`) is called with `value=` the step's loss,
      `metrics["loss"]`.
    num_microbatches: K, microbatches per device per step (int >= 1). The
      batch's leading size must be divisible by P * K.
    mesh: None to run on the default device; otherwise a mesh with axis
      `data_axis` (e.g. `ja.data_mesh()`): the batch is split over that axis
      (pass it through `ja.shard_batch`, params and state through
      `ja.replicate`, in particular on several processes), and the gradient is
      all-reduced once per step. Other mesh axes see replicated computation.
      Placement, the same rule for every strategy: parameters on one device
      (or host values) are re-laid by the step; parameters placed on the
      mesh must be laid out as `ja.shard_train_state` lays them for the
      strategy, else a ValueError naming the leaf (that call places any
      layout). A `loss_fn` that runs its own `jax.shard_map` over the data
      axis (pmean inside) is a ValueError: pass the plain per-batch loss.
    data_axis: the mesh axis the batch is split over.
    has_aux: `loss_fn` returns `(loss, aux)`; aux (array pytree) is combined
      per `aux_reductions` (by default per-example leaves concatenated, the
      others averaged like the loss).
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
      is the last microbatch of the last device. Default: "concat" for a
      leaf whose leading size is a microbatch's rows (per-example values,
      back in row order), "mean" for the others: the one default of every
      entry point (docs/guides/microbatch.md, "Per-example outputs").
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
      group, one cross-replica all-reduce per step). Every option works
      under every strategy; strategies need a `mesh` (so does `comm_dtype`:
      without one there is no wire). A user's sharding of the parameters
      over other mesh axes (e.g. "model") is kept.
    comm_dtype: dtype of the gradient on the wire (e.g. `jnp.bfloat16`);
      accumulation stays in float32 or wider. What crosses the wire is each
      device's share of the mean gradient (sum w g / sum w, the total weight
      reduced first), so a float16 wire does not overflow on token-count
      weights.
    fsdp_gather: "fsdp"/"hsdp" only: "per_microbatch" (memory-lean, the
      default: each parameter is gathered where the loss uses it, re-gathered
      for the backward pass and its gradient reduce-scattered as soon as it
      exists, so a device never holds the whole model; with `grad_norms` or
      `noise_scale`, which measure each device's whole microbatch gradient,
      the tree is gathered whole per microbatch; an equation it cannot
      replay layer by layer, a nested `jax.shard_map` or a `while` loop,
      gathers the leaves it uses whole, for that equation only: see
      docs/guides/train-step.md) or "once" (comm-lean: one
      parameter all-gather per step instead of K, at the cost of one full
      parameter copy and one full accumulator per device). Given with another
      strategy it is a ValueError (there is nothing to gather).
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
    noise_scale_sample: None (every microbatch measured), or m >= 1: only
      the first m microbatches of weight > 0 of the step on each device have
      their squared norm taken (under a `lax.cond`: the others skip that read
      of their gradient), and `ja.accumulate(..., noise_scale_sample=m)`'s
      estimator for a sample is used (`jaxaccum.noise`, "Sampling"): still
      unbiased, with more variance per step, for about m/K of the
      per-microbatch cost. With P devices the sample is up to P m
      microbatches; the estimate needs one measured microbatch and one more
      in the step (else NaN). The update is the same bit for bit, and no
      collective is added (one more scalar joins the all-reduce). Needs
      `noise_scale=True`.
    skip_empty: skip microbatches of weight 0 (see above); needs
      `weight_fn`. Under fsdp's per-microbatch gather (collectives in the
      loop body) a slot is skipped only where every device's microbatch is
      empty.
    skip_nonfinite: the guarantee that a non-finite mean gradient never
      reaches the parameters (default True): the step checks the reduced
      gradient (one 4-byte all-reduce, one reduction per leaf) and applies
      nothing when it holds a NaN or an Inf (`metrics["applied"]` False).
      False turns the check off, as optax's `apply_if_finite` is opt-in and a
      plain step has none: the step then costs what the plain step costs
      (no check, and without a `weight_fn` no conditional around the update),
      and a NaN or Inf gradient reaches the optimizer and the parameters, as
      in plain JAX. A step whose total weight is 0 or invalid (with a
      `weight_fn`) still applies nothing. `ja.accumulate`'s `skip_nonfinite`
      is the same guarantee per microbatch, opt-in there (it drops a
      non-finite microbatch from the window rather than the whole update).

  Returns:
    A `jax.jit`-wrapped step (`.lower(...)` works). `metrics` holds
    `"loss"` (plus `"aux"` with `has_aux`): global weighted means;
    `"total_weight"`: sum of all weights (the number of microbatches P K by
    default); `"applied"`: whether the optimizer update was applied;
    `"grad_norms"` with `grad_norms`.
    A `key`, when given, is passed to `loss_fn` as
    `fold_in(fold_in(key, device_index), i)` for microbatch i (device index 0
    without a mesh), so devices and microbatches draw different randomness.
    It may be a tree of keys (typed `jax.random.key`s or raw
    `jax.random.PRNGKey`s, e.g. one per stream): every key is folded so,
    integer scalars beside them (counts) are kept, any other leaf is refused
    by its path.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn={loss_fn!r} must be callable")
  optimizer = _tree.check_optimizer(optimizer, "optimizer")
  k = _tree.check_positive_int(num_microbatches, "num_microbatches")
  for name, value in (
    ("has_aux", has_aux),
    ("donate", donate),
    ("has_state", has_state),
    ("grad_norms", grad_norms),
    ("noise_scale", noise_scale),
    ("skip_nonfinite", skip_nonfinite),
  ):
    if not isinstance(value, bool):
      raise TypeError(f"{name}={value!r} must be a bool")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn={weight_fn!r} must be callable or None")
  check_skip_empty(skip_empty, weight_fn)
  noise_sample = _noise.check_sample(noise_scale_sample, noise_scale or None, switch="noise_scale=True")
  if aux_reductions is not None and not has_aux:
    raise ValueError(f"{aux_reductions=} needs has_aux=True (loss_fn returning (loss, aux))")
  if state_reductions is not None and not has_state:
    raise ValueError(f"{state_reductions=} needs has_state=True")
  # Names checked now; the trees against the outputs when the step is traced.
  _check_reductions(aux_reductions)
  _check_reductions(state_reductions)
  if has_aux and aux_reductions is None:  # the one default of every entry point (docs/guides/microbatch.md)
    aux_reductions = PER_ROW
  check_accumulator_dtype(comm_dtype, "comm_dtype")
  comm_dtype = None if comm_dtype is None else jnp.dtype(comm_dtype)
  if not isinstance(strategy, str) or strategy not in sharded.STRATEGIES:
    raise ValueError(f"{strategy=} must be one of {sharded.STRATEGIES}")
  if fsdp_gather is not None and fsdp_gather not in sharded.FSDP_GATHERS:
    raise ValueError(f"{fsdp_gather=} is not one of {sharded.FSDP_GATHERS}")
  if fsdp_gather is not None and strategy not in ("fsdp", "hsdp"):
    # zero1 keeps whole parameters on every device and ddp shards nothing: there is nothing to gather.
    raise ValueError(f"{fsdp_gather=} applies to strategy='fsdp' or 'hsdp' only, not {strategy=}")
  plan = None
  if mesh is None:
    if strategy != "ddp" or comm_dtype is not None:
      what = f"{strategy=}" if strategy != "ddp" else f"comm_dtype={comm_dtype}"
      raise ValueError(f"{what} needs a mesh (make_train_step(..., mesh=...)): without one there is no wire")
  else:
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh (see ja.data_mesh)")
    plan = sharded._make_plan(strategy, mesh, data_axis)
  hint = _STATE_HINT if has_state else _CLOSURE_HINT
  head = (None, None, None) if has_state else (None, None)
  try:  # loss_fn(params[, state], batch), or with a key last for a step given a key
    check_binds(loss_fn, "loss_fn", head + (None,), {}, hint)
  except TypeError:
    check_binds(loss_fn, "loss_fn", head, {}, hint)
  cfg = _engine.Config(
    loss_fn=loss_fn,
    optimizer=optimizer,
    k=k,
    has_aux=has_aux,
    has_state=has_state,
    weight_fn=weight_fn,
    aux_reductions=aux_reductions,
    state_reductions=state_reductions,
    grad_norms=grad_norms,
    noise_scale=noise_scale,
    noise_sample=noise_sample,
    skip_empty=skip_empty,
    comm_dtype=comm_dtype,
    lean=fsdp_gather != "once",
    mesh=mesh,
    plan=plan,
    donate=donate,
    skip_nonfinite=skip_nonfinite,
  )
  names = ("params", "state", "opt_state", "batch", "key") if has_state else ("params", "opt_state", "batch", "key")
  return TrainStep(cfg, names, hint)
