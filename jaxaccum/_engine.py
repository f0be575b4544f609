"""The one train step behind `make_train_step`: plan, local sums, reducer, update, for every strategy.

Without a mesh the step is the microbatch loop and the optimizer. With one, the
strategy's plan (`jaxaccum.sharded`: which data axes split the batch, which
axis shards optimizer state and parameters, every leaf's layout from the mesh
and the shapes) decides three things, and nothing else differs between
strategies:

1. the local sums: inside a `jax.shard_map` manual over the data axes only
   (other mesh axes, e.g. "model", stay with the partitioner), each device
   runs `ja.microbatch`'s loop over its rows (untyped, `check_vma=False`: the
   user's loss runs unchanged, loops whose carry starts as a constant too).
   The loss is traced once, outside the map, on one device's microbatch
   (`_program`): every check reads that jaxpr (a loss that runs its own
   shard_map over a data axis is refused up front), and the map evaluates it
   with its sharding annotations localised (the data axes dropped).
   Weights are known before the
   loop (`weights`), and their global total W is reduced first (a scalar
   all-reduce; none without a `weight_fn`: W = P K), so every microbatch's
   gradient enters the accumulator already normalised, (w_i / W) g_i (the
   gradient scaled, never the loss: a backward rule nonlinear in its
   cotangent sees the plain one). What
   later crosses the wire is a share of the mean gradient, never sum w g: a
   float16 `comm_dtype` cannot overflow on token-count weights;
2. the reducer: replicated leaves are all-reduced over the data axes together
   with the loss, aux, state and noise sums (one instruction); leaves sharded
   over the shard axis are reduce-scattered (packed, one instruction per
   dtype), after the loop, or per microbatch for fsdp's memory-lean gather;
   hsdp all-reduces its blocks once more across replicas;
3. the update: outside the shard_map, under jit, the optimizer runs on the
   globally shaped gradient (in the parameters' dtype), state and parameter
   slice, laid out per the plan (global-norm transforms get their scalar
   all-reduces from the partitioner); zero1 then all-gathers the parameters.

A step with nothing to average (total weight 0 or NaN) or a non-finite mean
gradient applies nothing: parameters, model state and optimizer state come
back unchanged. The update sits in one branch of a conditional (its
collectives too), so a skip costs no memory: the compiled peak equals that of
the same step with no skip (`always_applied`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum import _jax_private, _per_device, _program, _tree, parallel, sharded
from jaxaccum import noise as _noise
from jaxaccum._layerwise import layerwise
from jaxaccum._split import split, weights
from jaxaccum._sums import PER_ROW, _leaf_reductions, _weight_ok, _weighted, check_prefix, finish, local_sums, per_row


class Config(NamedTuple):
  """Everything `make_train_step` resolved and checked."""

  loss_fn: Any
  optimizer: Any
  k: int  # microbatches per device
  has_aux: bool
  has_state: bool
  weight_fn: Any
  aux_reductions: Any
  state_reductions: Any
  grad_norms: bool
  noise_scale: bool
  noise_sample: int | None  # noise_scale_sample: m microbatches measured per device, None: every one
  skip_empty: bool
  comm_dtype: Any  # the gradient's dtype on the wire (None: the accumulator's)
  lean: bool  # fsdp/hsdp gathering parameters per microbatch (not once per step)
  mesh: Any  # None: one device
  plan: Any  # sharded._Plan, None without a mesh
  donate: bool  # params, opt_state (and state) buffers given to the outputs
  # the guarantee: a non-finite mean gradient applies nothing (False: no check, as a plain step)
  skip_nonfinite: bool = True
  always_apply: bool = False  # private: no skip, the update always applies (the twin memory is measured against)
  # private (ja.diloco_train_step): the optimizer runs on every call and gates its own update with
  # `inner_applied=applied`, so its schedule and collectives run on replicas that skip too
  optimizer_gates_itself: bool = False


def step(cfg: Config, given, params, state, opt_state, batch, key, *, state_replicated: bool = False):
  """The traced step: `(params, state, opt_state, metrics)` after one update on `batch`.

  `state_replicated`: every leaf of `opt_state` was given replicated over the mesh (or with no layout of its own:
  a host value, an uncommitted array), read from the concrete arguments by the caller (`TrainStep._prepare`).
  """
  if cfg.mesh is None:
    program = _traced(cfg, params, state, batch, key)  # once, as on a mesh (its checks read this trace)
    cfg = cfg._replace(loss_fn=program, aux_reductions=_aux_rule(cfg, program, params, state, batch, key))
    grads, out = _local(cfg, None, params, state, batch, key)
    return _update(cfg, None, params, state, opt_state, jax.tree.unflatten(jax.tree.structure(params), grads), out)
  plan, mesh = cfg.plan, cfg.mesh
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    _jax_private.shard_map_keeps_free_explicit_axes()  # jax 0.10: see there (a no-op on later versions)
  program = _traced(cfg, params, state, batch, key)
  cfg = cfg._replace(loss_fn=program, aux_reductions=_aux_rule(cfg, program, params, state, batch, key))
  layouts = sharded._layouts(params, mesh, plan, placed=False, given=given)
  flat = jax.tree.leaves(layouts, is_leaf=sharded._is_leaf)
  manual = set(plan.batch_axes)
  axes = plan.batch_axes[0] if len(plan.batch_axes) == 1 else plan.batch_axes
  batch = jax.tree.map(lambda x: sharded._place(x, mesh, PartitionSpec(axes)), batch)
  param_in = jax.tree.map(lambda lay: sharded._manual_spec(lay.param_spec, manual), layouts, is_leaf=sharded._is_leaf)
  grad_out = [sharded._manual_spec(lay.opt_spec, manual) for lay in flat]
  body = jax.shard_map(
    functools.partial(_local, cfg, flat),
    mesh=mesh,
    axis_names=manual,
    in_specs=(param_in, PartitionSpec(), PartitionSpec(axes), None if key is None else PartitionSpec()),
    out_specs=(grad_out, PartitionSpec()),
    # Untyped: the user's loss runs here unchanged. With vma typing, a loop whose carry starts as a
    # constant (an RNN from zeros, a sum from 0.0) fails JAX's carry check (the constant is invariant,
    # the carry out varies with the batch) and asks for a pcast in code that has no shard_map. Every
    # reduction is ours and explicit, and the parameters' gradients are per device by construction.
    check_vma=False,
  )
  try:
    grads, out = body(params, state, batch, key)
  except Exception as e:
    explained = _per_device.explain(
      e,
      plan.batch_axes[0] if len(plan.batch_axes) == 1 else plan.batch_axes,
      entry="make_train_step",
      instead=_INSTEAD,
    )
    if explained is None:
      raise
    raise explained from e
  grads = jax.tree.unflatten(jax.tree.structure(params), grads)
  return _update(cfg, layouts, params, state, opt_state, grads, out, state_replicated=state_replicated)


def _traced(cfg: Config, params, state, batch, key) -> _program.Program:
  """The user's loss traced once, on one device's microbatch, and checked: the step evaluates this jaxpr.

  Traced outside the per-device map (see `_program`): model code annotated for
  the global batch traces there, and its annotations are localised when the
  map evaluates it. A loss that runs its own `jax.shard_map` over a data axis
  (the docs' hand-written data-parallel loss, with psum/pmean inside) is
  refused by name: the step splits the batch and reduces the gradient itself.
  """
  axes = () if cfg.plan is None else cfg.plan.batch_axes
  devices = int(np.prod([cfg.mesh.shape[a] for a in axes]))  # 1 without a mesh
  rows = lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] // (devices * cfg.k), *np.shape(x)[1:]), x.dtype)
  args = (params, *((state,) if cfg.has_state else ()), jax.tree.map(rows, batch))
  args += () if key is None else (key,)
  try:
    batch_at = len(args) - 1 - (key is not None)
    program = _program.trace(cfg.loss_fn, args, mesh=cfg.mesh, data_axes=axes, batch_argnums=(batch_at,))
  except Exception as e:
    explained = None
    if axes:  # on one device the loss runs as the user's own jit runs it: JAX's errors are the user's
      explained = _per_device.explain(e, axes[0] if len(axes) == 1 else axes, entry="make_train_step", instead=_INSTEAD)
    if explained is None:
      raise
    raise explained from e
  found = _program.data_axes_mapped_over(program.closed, axes)
  if found:
    raise _program.shard_map_refusal(sorted(found)[0], "make_train_step")
  return program


def _aux_rule(cfg: Config, program, params, state, batch, key):
  """`aux_reductions` with the per-example default resolved on the loss's outputs (`_sums.per_row`), once per trace.

  The loop (and on a mesh the per-device map, which evaluates the traced
  loss at one microbatch's shapes only) then sees named reductions. A leaf
  whose leading size is a microbatch's rows is told per-example or not by
  tracing the loss again at twice the rows (abstractly, only then).
  """
  if not cfg.has_aux or cfg.aux_reductions != PER_ROW:
    return cfg.aux_reductions
  devices = 1 if cfg.mesh is None else int(np.prod([cfg.mesh.shape[a] for a in cfg.plan.batch_axes]))
  rows = np.shape(jax.tree.leaves(batch)[0])[0] // (devices * cfg.k)

  def aux_of(out):
    return out[1][1] if cfg.has_state else out[1]

  def outputs_at(at):
    resized = jax.tree.map(lambda x: jax.ShapeDtypeStruct((at * devices, *np.shape(x)[1:]), x.dtype), batch)
    prog = program if at == rows else _traced(cfg._replace(k=1), params, state, resized, key)
    return jax.tree.unflatten(prog.out_tree, prog.closed.out_avals)

  aux = aux_of(outputs_at(rows))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(aux)]
  leaves, treedef = jax.tree.flatten(aux)
  probe = lambda at: jax.tree.leaves(aux_of(outputs_at(at)))
  reds = per_row([PER_ROW] * len(leaves), leaves, paths, rows, probe, "aux", "aux_reductions=")
  return jax.tree.unflatten(treedef, reds)


_INSTEAD = (
  "keep the code in your own jax.jit step with ja.microbatch(jax.value_and_grad(loss), K) and an optax optimizer "
  "(the partitioner reduces the gradient), or ja.accumulate without axis_name"
)


# --------------------------------------------------------------------------- local sums (per device)


def _local(cfg: Config, flat, params, state, batch, key):
  """One device's part: the microbatch loop, then the reducer. Returns (gradient leaves, outputs)."""
  plan = cfg.plan
  axes = () if plan is None else plan.batch_axes
  axis = None if not axes else axes[0] if len(axes) == 1 else axes
  coll = None if plan is None else _Collectives(plan, flat, cfg.mesh, cfg.comm_dtype)
  if key is not None:
    key = _tree.fold_keys(key, 0 if axis is None else lax.axis_index(axis), "key")
  if coll is not None and plan.params_sharded and not cfg.lean:
    params = coll.gather(params)  # fsdp_gather="once": the whole tree, once per step
  if axes:
    # Varying params: per-device gradients stay local; the reductions are ours.
    params = jax.tree.map(lambda x: sharded._vary(x, axes), params)
  sp = split((batch,), (0,), cfg.k)
  wdtype = _tree.widest(_tree.accumulator_dtype(x.dtype) for x in jax.tree.leaves(params))
  ws = weights(sp, cfg.weight_fn).astype(wdtype)
  total = _global_total(ws, cfg, axis)
  run, reductions, n_grads = _microbatch_fn(cfg, coll, params, state, key, ws, total)
  skip: Any = cfg.skip_empty
  if skip and coll is not None and plan.params_sharded and cfg.lean:
    # The loop body gathers and reduce-scatters: every device must run the same microbatches
    # (a device skipping a collective the others enter would hang them). Run slot i where any
    # device has a real microbatch there; padding then adds exactly nothing.
    skip = lax.psum((ws > 0).astype(jnp.int32), axis) > 0
  sums = local_sums(run, sp, ws, reductions=reductions, skip=skip)
  grads = sums.accs[:n_grads]
  if coll is not None and _layerwise_on(cfg, coll):
    grads = coll.unsplit(grads)  # the blocks the loop left split over a free axis, back in the plan's layout
  grads = grads if coll is None else coll.pin(grads)
  rest = sums._replace(accs=sums.accs[n_grads:], reds=sums.reds[n_grads:], like=sums.like[1:], single=None)
  if coll is None:
    out, _ = finish(rest, None, total=total)
  else:
    reduce_rest = lambda small: finish(rest, axis, total=total, extra=small)
    grads, (out, _, small) = coll.reduce(grads, reduce_rest, scattered=plan.params_sharded and cfg.lean)
    grads = coll.pin(coll.merge(grads, small))
  return grads, _outputs(cfg, out, state, axis, total)


def _global_total(ws, cfg: Config, axis):
  """W = sum of every device's weights, reduced before the loop (NaN if any weight is negative or not finite)."""
  if cfg.weight_fn is None:  # every weight is 1: W = P K, no collective
    return jnp.asarray(_unit_total(cfg, axis), ws.dtype)
  bad = jnp.sum(~_weight_ok(ws)).astype(ws.dtype)
  local = (jnp.sum(jnp.where(_weight_ok(ws), ws, 0)), bad)
  total, bad = local if axis is None else lax.psum(local, axis)
  return jnp.where(bad == 0, total, jnp.full((), jnp.nan, ws.dtype))


def _unit_total(cfg: Config, axis) -> int:
  """W without a `weight_fn`: every weight is 1, so W = P K (P devices over the data axes)."""
  devices = 1 if axis is None else int(np.prod([cfg.mesh.shape[a] for a in cfg.plan.batch_axes]))
  return devices * cfg.k


def _microbatch_fn(cfg: Config, coll, params, state, key, ws, total):
  """`run(microbatches, i)` for the loop, its outputs' reductions, and how many leading leaves are gradients.

  Outputs: ([(w_i / W) g_i per leaf], value, [|g_i|], [|g_i|^2, 1 (, w_i)], [ran]).
  With `noise_sample=m` the noise outputs are those of the first m microbatches
  of weight > 0 on this device (decided from the weights, before any gradient
  is seen) and zero for the others: sum_S w |g|^2 / W, |S| and B_S.
  """
  grad_fn = jax.value_and_grad(cfg.loss_fn, has_aux=cfg.has_aux or cfg.has_state)
  axes = () if cfg.plan is None else cfg.plan.batch_axes
  ran_flag = cfg.skip_empty and bool(axes)
  n_grads = len(jax.tree.leaves(params))
  state_red = cfg.state_reductions
  if cfg.has_state and state_red is None:
    state_red = jax.tree.map(lambda x: "mean" if jnp.issubdtype(x.dtype, jnp.inexact) else "last", state)
  aux_red = "mean" if cfg.aux_reductions is None else cfg.aux_reductions

  lean = coll is not None and cfg.plan.params_sharded and cfg.lean
  measured = None
  if cfg.noise_scale and cfg.noise_sample is not None:
    real = ws > 0  # False for NaN too
    measured = real & (jnp.cumsum(real.astype(jnp.int32)) <= cfg.noise_sample)
  lw = None
  if _layerwise_on(cfg, coll):
    dims = [lay.dim if j in coll.sharded else None for j, lay in enumerate(coll.flat)]
    others = [_other_axes(lay, cfg.plan) for lay in coll.flat]
    splits = coll.splits(jax.tree.leaves(params))
    lw = layerwise(cfg.loss_fn, dims, coll.axis, coll.size, comm_dtype=cfg.comm_dtype, others=others, splits=splits)

  # Without a weight_fn every share is the constant 1/W and never 0: each gradient leaf is scaled by that
  # constant (fused into the accumulator's add), with no weight-0 select, which is one compare, select and
  # broadcast per leaf that XLA would only fold away after tracing, lowering and partitioning them (compile
  # time of deep models with listed layers).
  unit = None if cfg.weight_fn is not None else 1.0 / _unit_total(cfg, axes or None)

  def run(mbs, i):
    rest = ((state,) if cfg.has_state else ()) + (mbs[0],) + (() if key is None else (_tree.fold_keys(key, i, "key"),))
    share = ws[i] / total
    if lw is not None:
      value, leaves = _layerwise_grads(lw, cfg, coll, params, rest, ws[i], share)
    else:
      p = params
      if lean:
        # Tie the shards to the loop index, so that XLA cannot hoist the gather out of
        # the loop (it would, as loop-invariant code) and keep a full copy across it.
        p, _ = lax.optimization_barrier((p, i))
        p = jax.tree.map(lambda x: sharded._vary(x, axes), coll.gather(p))
      value, g = _value_and_grad(grad_fn, cfg, (p, *rest))
      if unit is None:
        leaves = [_weighted(x, share, _tree.accumulator_dtype(x.dtype)) for x in jax.tree.leaves(g)]
      else:
        leaves = [x.astype(_tree.accumulator_dtype(x.dtype)) * unit for x in jax.tree.leaves(g)]
      if lean:
        leaves = coll.scatter(leaves)  # each microbatch's share, reduce-scattered as soon as it exists
    if cfg.has_state:  # checked here, before the state's reductions are matched against it
      new_state = value[1][0] if cfg.has_aux else value[1]
      _tree.check_same_structure(new_state, state, "the state loss_fn returned", "the state passed to the step")
    if cfg.has_aux:
      aux = value[1][1] if cfg.has_state else value[1]
      check_prefix(cfg.aux_reductions, aux, "aux_reductions")
      _leaf_reductions(aux_red, aux, "aux", "aux_reductions=")  # dtypes, named as the user wrote them
    if cfg.has_state:
      check_prefix(cfg.state_reductions, new_state, "state_reductions")
      _leaf_reductions(state_red, new_state, "the state loss_fn returned", "state_reductions=")
    out: tuple = (leaves, value)
    if cfg.grad_norms:
      out = (*out, optax.tree.norm(g))
    if cfg.noise_scale:  # |g_i|^2 (a weighted mean: S1) and 1 (a sum over microbatches of weight > 0: K)
      wide = _tree.widest(_tree.accumulator_dtype(x.dtype) for x in jax.tree.leaves(g))
      if measured is None:
        out = (*out, _noise.sq_norm(g, wide), jnp.ones([], wide))
      else:  # sampled: a microbatch outside the sample skips the read of its gradient (a cond, as ja.accumulate)
        zero = jnp.zeros([], wide)
        sq = lax.cond(measured[i], lambda g: _noise.sq_norm(g, wide), lambda g: zero, g)
        out = (*out, sq, measured[i].astype(wide), jnp.where(measured[i], ws[i].astype(wide), zero))
    if ran_flag:  # 1 on a device that ran a microbatch; "last": its init 0 on one that skipped them all
      out = (*out, jnp.ones([], jnp.float32))
    # The parameters are varying, so the gradients are per device by construction;
    # a loss or aux that is the same on every device (a constant) is then fine too.
    return parallel.to_varying(out, axes) if axes else out

  value_red: Any = "mean"
  if cfg.has_state or cfg.has_aux:
    inner = (state_red, aux_red) if cfg.has_state and cfg.has_aux else state_red if cfg.has_state else aux_red
    value_red = ("mean", inner)
  reductions = (["add"] * n_grads, value_red) + (("concat",) if cfg.grad_norms else ())
  reductions += (("mean", "sum") if cfg.noise_scale else ()) + (("sum",) if measured is not None else ())
  reductions += ("last",) if ran_flag else ()
  return run, reductions, n_grads


def _layerwise_on(cfg: Config, coll) -> bool:
  """Whether the loop runs the loss layer by layer (`_layerwise`): fsdp/hsdp gathering per microbatch.

  Each parameter is gathered where the loss uses it and its gradient reduce-scattered as soon as it
  exists. grad_norms and noise_scale measure each device's whole microbatch gradient, which that never
  holds: with them the tree is gathered whole per microbatch.
  """
  lean = coll is not None and cfg.plan.params_sharded and cfg.lean
  return lean and not (cfg.grad_norms or cfg.noise_scale)


def _other_axes(lay, plan) -> tuple:
  """A leaf's entries over the mesh axes other than the data axes (None where unknown or data)."""
  data = set(plan.batch_axes)
  entries = sharded._entries(lay.param_spec, lay.ndim)
  return tuple(
    None if e is None or e is PartitionSpec.UNCONSTRAINED or set(sharded._names(e)) & data else e for e in entries
  )


def _layerwise_grads(lw, cfg: Config, coll, params, rest, w, share):
  """(value, [gradient shares]) with the parameters gathered where used: sharded leaves come back as blocks.

  The gradient is scaled by the share w_i / W, never the loss: a backward rule
  that is not linear in its cotangent (a custom_vjp clipping it) then sees the
  cotangent of the plain loss, as under every other strategy. Sharded leaves
  are scaled inside the layerwise backward, before their reduce-scatter.
  """
  has_aux = cfg.has_aux or cfg.has_state
  keep = jnp.isfinite(w) & (w != 0)  # padding (weight 0, maybe NaN) adds exactly nothing to any block

  def loss(p):
    out = lw(p, *rest, keep=keep, scale=share)
    value = out[0] if has_aux else out
    if not has_aux and (isinstance(out, (tuple, list, dict)) or jnp.ndim(out) != 0):
      raise _not_scalar(f"it returned {jax.tree.structure(out)}")
    return value, out

  (_, value), g = jax.value_and_grad(loss, has_aux=True)(params)
  leaves = []
  for j, x in enumerate(jax.tree.leaves(g)):
    x = x.astype(_tree.accumulator_dtype(x.dtype))
    leaves.append(x if j in coll.sharded else jnp.where(keep, x * share.astype(x.dtype), jnp.zeros((), x.dtype)))
  return value, leaves


def _value_and_grad(grad_fn, cfg: Config, args):
  try:
    return grad_fn(*args)
  except TypeError as e:
    if "scalar-output" not in str(e) or cfg.has_aux or cfg.has_state:
      raise
    raise _not_scalar(str(e)) from None


def _not_scalar(detail: str) -> TypeError:
  return TypeError(
    f"loss_fn returned more than a scalar loss ({detail}). If it returns (loss, aux), pass "
    "make_train_step(..., has_aux=True); if it returns (loss, new_model_state), has_state=True "
    "(loss_fn(params, state, batch))."
  )


def _outputs(cfg: Config, out, state, axis, total) -> dict:
  """The reduced loop outputs as a dict: loss, aux, state, grad norms, noise sums; "last" from the last device."""
  value, extras = out[0], list(out[1:])
  ran = extras.pop() if cfg.skip_empty and axis is not None else None
  res: dict = {"total_weight": total}
  loss, new_state, aux = value, None, None
  if cfg.has_state:
    loss, rest = value
    new_state, aux = rest if cfg.has_aux else (rest, None)
  elif cfg.has_aux:
    loss, aux = value
  if axis is not None:
    state_red = cfg.state_reductions
    if cfg.has_state and state_red is None:
      state_red = jax.tree.map(lambda x: "mean" if jnp.issubdtype(x.dtype, jnp.inexact) else "last", state)
    new_state = _last_of_last_device(new_state, state_red, axis, ran)
    aux = _last_of_last_device(aux, "mean" if cfg.aux_reductions is None else cfg.aux_reductions, axis, ran)
  res["loss"] = loss
  if cfg.has_aux:
    res["aux"] = aux
  if cfg.has_state:
    res["state"] = _tree.cast_like(new_state, state)  # the same dtypes every step: no recompiles
  if cfg.grad_norms:
    res["grad_norms"] = extras.pop(0)
  if cfg.noise_scale:
    res["noise_sums"] = tuple(extras[: 2 if cfg.noise_sample is None else 3])
  return res


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
    # A typed PRNG key (jax.random.key) crosses as its raw uint32 data: JAX's all_gather of a key
    # array fails to lower ("all_gather_invariant" verifier errors). Re-wrapped after, bit for bit.
    impls = [_key_impl(leaves[i]) for i in picked]
    sent = [leaves[i] if m is None else jax.random.key_data(leaves[i]) for i, m in zip(picked, impls, strict=True)]
    sent += [] if ran is None else [ran]
    got = lax.all_gather(parallel.to_varying(sent, axis), axis, to="invarying")
    last: Any = -1  # the last device, or (skip_empty) a traced index
    if ran is not None:
      flags = got.pop() > 0
      n = flags.shape[0]
      last = jnp.where(jnp.any(flags), n - 1 - jnp.argmax(flags[::-1]), n - 1)
    for i, g, impl in zip(picked, got, impls, strict=True):
      leaves[i] = g[last] if impl is None else jax.random.wrap_key_data(g[last], impl=impl)
  return jax.tree.unflatten(treedef, leaves)


def _key_impl(x):
  """The PRNG implementation of a typed key array (`jax.random.key`), None for any other leaf."""
  dtype = getattr(x, "dtype", None)
  return jax.random.key_impl(x) if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) else None


# --------------------------------------------------------------------------- the reducer


class _Collectives:
  """The strategy's collectives over the data axes (inside the shard_map): gather, scatter, reduce."""

  def __init__(self, plan, flat, mesh, wire):
    self.plan, self.flat, self.wire, self.mesh = plan, flat, wire, mesh
    self.axis = plan.shard_axis
    self.size = 1 if self.axis is None else mesh.shape[self.axis]
    # Leaves sharded over the shard axis: reduce-scattered (and, for fsdp, gathered); the rest all-reduced.
    self.sharded = [j for j, lay in enumerate(flat) if self.axis is not None and lay.dim is not None]

  def pin(self, leaves):
    """Gradient leaves (full or blocks) laid out over the free Auto axes as their parameters are (`sharded._pin`)."""
    manual = set(self.plan.batch_axes)
    return [sharded._pin(x, lay, manual) for x, lay in zip(leaves, self.flat, strict=True)]

  def gather(self, params):
    """The sharded leaves of `params` all-gathered to full size (varying: each device computes with them)."""
    xs = list(jax.tree.leaves(params))
    full = sharded._all_gather([xs[j] for j in self.sharded], self._lay(), self.axis, self.size, to="varying")
    for j, f in zip(self.sharded, full, strict=True):
      xs[j] = f
    return jax.tree.unflatten(jax.tree.structure(params), xs)

  def scatter(self, leaves):
    """The sharded leaves reduce-scattered over the shard axis (the others untouched)."""
    xs = list(leaves)
    blocks = sharded._reduce_scatter([xs[j] for j in self.sharded], self._lay(), self.axis, self.size, self.wire)
    for j, b in zip(self.sharded, blocks, strict=True):
      xs[j] = b
    return xs

  def reduce(self, grads, finish, *, scattered: bool):
    """Sums every device's normalised gradient: (sharded blocks, finish's result with the small leaves summed).

    `finish(small)` all-reduces the loop's other sums over the data axes with
    the replicated leaves `small` (on the wire in `comm_dtype`) joined in.
    `scattered`: the loop reduce-scattered the sharded leaves already (fsdp's
    per-microbatch gather): they are blocks.
    """
    grads = list(grads)
    if not scattered:
      grads = self.scatter(grads)
    blocks = [grads[j] for j in self.sharded]
    small = [_cast(grads[j], self.wire) for j in range(len(grads)) if j not in self.sharded]
    if self.plan.replica_axis is not None and blocks:  # hsdp: once across replicas, whatever K
      sent = lax.psum([_cast(b, self.wire) for b in blocks], self.plan.replica_axis)
      blocks = [s.astype(b.dtype) for s, b in zip(sent, blocks, strict=True)]
    return blocks, finish(small)

  def splits(self, blocks) -> list:
    """Per leaf, `(free axes, dimension)` its gradient is reduce-scattered split over in the loop, or None.

    Layer by layer, a leaf sharded over the shard axis that no other mesh axis splits (a norm scale, an
    embedding on a ("data", "model") mesh whose model code leaves it replicated over "model") gets its
    gradient from activations the partitioner splits over "model", so it comes out split over "model" on
    their features dimension, its last one. Left to the partitioner, each reduce-scatter of it gathered it
    over "model" first: one all-gather per leaf per microbatch (the plain `jit` step keeps it split through
    its loop and gathers once). Here it is reduce-scattered split on its last dimension over every free Auto
    axis (each device's piece: no data moves where it was split there, a slice where it was replicated),
    the accumulated block stays split through the loop, and `unsplit` gathers every such leaf together,
    once per step. `blocks`: the local blocks (parameters or gradients, the same shapes). Not on Explicit
    axes (a gradient's type there says its layout) nor on a leaf whose layout is unknown (UNCONSTRAINED).
    """
    free = tuple(
      n
      for n, t in zip(self.mesh.axis_names, self.mesh.axis_types, strict=True)
      if n not in self.plan.batch_axes and t == jax.sharding.AxisType.Auto and self.mesh.shape[n] > 1
    )
    size = int(np.prod([self.mesh.shape[n] for n in free]))
    out: list = [None] * len(self.flat)
    if not free:
      return out
    for j in self.sharded:
      lay, shape = self.flat[j], np.shape(blocks[j])
      entries = sharded._entries(lay.param_spec, lay.ndim)
      if any(e is PartitionSpec.UNCONSTRAINED for e in entries) or any(
        e is not None for e in _other_axes(lay, self.plan)
      ):
        continue
      # On the sharded dimension itself the block is cut into `size` pieces (see `unsplit`).
      if shape and shape[-1] % size == 0:
        out[j] = (free, len(shape) - 1)
    return out

  def unsplit(self, blocks):
    """The blocks `splits` left split over the free axes, gathered: every such leaf together, once per step.

    A block split on another dimension than the sharded one holds its part of block p on device (p, m):
    one all-gather over the free axes. Split on the sharded dimension itself, device (p, m) holds piece
    m P + p of that dimension cut into M P pieces (the reduce-scatter of each device's model part of the
    gradient), where block p wants pieces p M ... p M + M - 1: one collective-permute of every such block
    first (piece p M + m to device (p, m)), then the same all-gather.
    """
    xs = list(blocks)
    splits = self.splits(xs)
    picked = [j for j, s in enumerate(splits) if s is not None]
    if not picked:
      return xs
    free = splits[picked[0]][0]
    ats = [splits[j][1] for j in picked]
    same = [i for i, j in enumerate(picked) if ats[i] == self.flat[j].dim]
    m_size, p_size = int(np.prod([self.mesh.shape[n] for n in free])), self.size
    # The collective names its axes in mesh order (JAX asks it): device numbers are mixed-radix in that order.
    names = tuple(n for n in self.mesh.axis_names if n in free or n == self.axis)

    def number(m, p):  # the device at index m over the free axes (in their order) and p over the shard axis
      coords = {self.axis: p}
      for n in reversed(free):
        m, coords[n] = divmod(m, self.mesh.shape[n])
      out = 0
      for n in names:
        out = out * self.mesh.shape[n] + coords[n]
      return out

    # Device (p, m) holds piece m P + p and wants piece p M + m, held by (p', m') with m' P + p' = p M + m.
    perm = [(number(*divmod(p * m_size + m, p_size)), number(m, p)) for m in range(m_size) for p in range(p_size)]

    def body(*given):
      pieces = list(given)
      out = list(given)
      for group in sharded._groups(range(len(pieces)), key=lambda i: pieces[i].dtype):  # one buffer per dtype
        swapped = [i for i in group if i in same]
        if swapped:
          sizes = [pieces[i].size for i in swapped]
          moved = lax.ppermute(jnp.concatenate([pieces[i].reshape(-1) for i in swapped]), names, perm)
          for i, piece in zip(swapped, sharded._pieces(moved, 0, sizes), strict=True):
            pieces[i] = piece.reshape(pieces[i].shape)
        flats = [jnp.moveaxis(pieces[i], ats[i], 0).reshape(-1) for i in group]
        full = lax.all_gather(jnp.concatenate(flats), free, axis=0, tiled=False)
        for i, piece in zip(group, sharded._pieces(full, 1, [f.size for f in flats]), strict=True):
          moved_shape = jnp.moveaxis(pieces[i], ats[i], 0).shape
          out[i] = jnp.moveaxis(piece.reshape((m_size * moved_shape[0], *moved_shape[1:])), 0, ats[i])
      return tuple(out)

    entry = free if len(free) > 1 else free[0]
    specs = tuple(PartitionSpec(*([None] * at + [entry])) for at in ats)
    mesh = jax.sharding.get_abstract_mesh()
    gathered = jax.shard_map(
      body,
      mesh=mesh,
      axis_names=set(free),
      in_specs=specs,
      out_specs=tuple(PartitionSpec() for _ in picked),
      check_vma=parallel.vma_tracking(self.axis),
    )(*[xs[j] for j in picked])
    for j, g in zip(picked, gathered, strict=True):
      xs[j] = g
    return xs

  def merge(self, blocks, small):
    """Sharded blocks and summed small leaves back in leaf order, in the accumulator's dtypes."""
    out = [None] * len(self.flat)
    for j, b in zip(self.sharded, blocks, strict=True):
      out[j] = b
    rest = [j for j in range(len(self.flat)) if j not in self.sharded]
    for j, s in zip(rest, small, strict=True):
      out[j] = s
    return out

  def _lay(self):
    return [self.flat[j] for j in self.sharded]


def _cast(x, dtype):
  return x if dtype is None else x.astype(dtype)


# --------------------------------------------------------------------------- the update


def _finite(grads, layouts, mesh) -> jax.Array:
  """A scalar bool: True when no gradient holds a NaN or an Inf, from ONE 4-byte all-reduce.

  Each device sums `x * 0` over its own blocks (`_tree.nonfinite_probe`: 0, or NaN where an entry is not
  finite; a `jax.shard_map` manual over every mesh axis, each gradient with the layout the map gave it) and
  one float32 sum crosses the axes some gradient is split over. Left to the partitioner, every leaf a mesh
  axis splits (a "model"-sharded weight, a zero1/fsdp block) had its own reduction (one combined all-reduce
  of a pred per leaf). With no layout known (an outer jit's UNCONSTRAINED), the partitioner's check.
  """
  leaves = jax.tree.leaves(grads)
  specs = [lay.opt_spec for lay in jax.tree.leaves(layouts, is_leaf=sharded._is_leaf)]
  if not leaves or any(e is PartitionSpec.UNCONSTRAINED for s in specs for e in s):
    return _tree.all_finite(grads)
  split = tuple(n for n in mesh.axis_names if any(n in sharded._names(e) for s in specs for e in s))
  if not split:  # every gradient whole on every device (ddp beside no other axis): nothing to add up
    return _tree.all_finite(grads)

  def count(*xs):
    return lax.psum(sum((_tree.nonfinite_probe(x) for x in xs), jnp.zeros((), jnp.float32)), split)

  bad = jax.shard_map(
    count,
    mesh=mesh,
    in_specs=tuple(specs),
    out_specs=PartitionSpec(),
    axis_names=set(mesh.axis_names),
    check_vma=False,
  )(*leaves)
  return jnp.isfinite(bad)


def _update(cfg: Config, layouts, params, state, opt_state, grads, out, *, state_replicated: bool = False):
  """The optimizer on the global arrays, laid out per the plan; nothing moves unless the step applies."""
  mesh = cfg.mesh
  total = out.pop("total_weight")
  grads = jax.tree.map(lambda g, p: g.astype(_tree.dtype_of(p)), grads, params)  # as plain optax would see them
  # NaN (an invalid weight) compares False too; a non-finite mean gradient never reaches the parameters.
  applied = total > 0
  if cfg.skip_nonfinite:
    applied = applied & (_tree.all_finite(grads) if layouts is None else _finite(grads, layouts, mesh))
  # Without the finite check and without a weight_fn, W = P K > 0 is a constant: nothing can skip the update,
  # so it runs unconditionally, as in a plain step (no conditional, no branch to keep the old values).
  unconditional = cfg.always_apply or (
    not cfg.skip_nonfinite and cfg.weight_fn is None and not cfg.optimizer_gates_itself
  )
  to_piece, specs, pinned = (lambda tree: tree), None, layouts is not None
  if layouts is not None:
    # Nothing to lay out at the outputs where every axis that splits anything is a data axis, every layout is
    # replicated (ddp on a data-only Auto mesh) and the optimizer state was given replicated: every input of the
    # update is then replicated, so the partitioner has no sharding to propagate into its outputs, which come
    # back replicated, as the inputs came. A sharding constraint per output leaf (three per leaf with adam)
    # costs the partitioner compile time and changes nothing there. Anywhere a layout is sharded, a mesh axis
    # is free (a "model" axis the partitioner could use) or Explicit (a layout is part of the type), or the
    # state came in another layout (zero1's, a checkpoint's), the outputs are laid out as the plan says.
    pinned = (
      not state_replicated
      or any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
      or any(size > 1 and name not in cfg.plan.batch_axes for name, size in mesh.shape.items())
    )
    pinned = pinned or not all(
      _replicated(lay.param_spec) and _replicated(lay.opt_spec)
      for lay in jax.tree.leaves(layouts, is_leaf=sharded._is_leaf)
    )
    specs = sharded.state_specs(opt_state, params, layouts, mesh, cfg.plan)
    place = lambda tree: jax.tree.map(lambda x, s: sharded._place(x, mesh, s), tree, specs, is_leaf=_is_spec)
    # Where the optimizer works on the parameters' own layout (ddp, fsdp) on an Auto mesh, parameters and
    # state are laid out once, at the update's outputs: the same constraints on its inputs (the state, each
    # branch's parameters) change nothing and cost the partitioner a constraint per leaf each (compile time of
    # deep models). On Explicit axes a layout is part of the type: a state given in another layout (say
    # replicated) is resharded first, or the branch that keeps it would differ in type from the one updating it.
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    if explicit or any(lay.opt_spec != lay.param_spec for lay in jax.tree.leaves(layouts, is_leaf=sharded._is_leaf)):
      to_piece = lambda tree: jax.tree.map(lambda x, lay: sharded._place(x, mesh, lay.opt_spec), tree, layouts)
      opt_state = place(opt_state)  # a replicated state given to zero1 is updated in zero1's layout
  new_state = out.pop("state", state)
  extra = _extra_args(cfg.optimizer, out["loss"])

  # Each branch takes its slice of the parameters (zero1's is 1/P of the replicated ones): taken
  # before the conditional, the slice would be one more buffer alive beside the branch's result.
  def update(ops):
    params, opt_state, state, new_state = ops
    piece = to_piece(params)
    updates, opt_state = cfg.optimizer.update(grads, opt_state, piece, **extra)
    return optax.apply_updates(piece, updates), opt_state, new_state

  def keep(ops):
    return to_piece(ops[0]), ops[1], ops[2]

  ops = (params, opt_state, state, new_state)
  if unconditional:  # skip_nonfinite=False with constant weights, or the twin the memory is measured against
    new_piece, new_opt, new_state = update(ops)
  elif cfg.optimizer_gates_itself:
    # ja.diloco over a replica axis: `applied` differs across replicas, and a replica that left the
    # optimizer out would fall behind in its schedule and miss the others' collectives (a hang).
    # It runs everywhere on zeros where skipped (no NaN flows in) and keeps only its inner step.
    piece = to_piece(params)
    safe = jax.tree.map(lambda g: jnp.where(applied, g, jnp.zeros_like(g)), grads)
    updates, new_opt = cfg.optimizer.update(safe, opt_state, piece, inner_applied=applied, **extra)
    new_piece = optax.apply_updates(piece, updates)
    new_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old), new_state, state)
  else:
    # A conditional, not compute-then-select: a select keeps the old and the new parameters and
    # optimizer state alive together (up to 1.3x the per-device peak); in a conditional XLA updates
    # them in place. The update's collectives (the partitioner's all-reduces of clip_by_global_norm's
    # or lamb's norms over sharded state) run inside the branch, as in ja.accumulate.
    new_piece, new_opt, new_state = parallel.cond(applied, update, keep, ops)
  new_opt = _tree.cast_like(new_opt, opt_state)  # the dtypes optimizer.init gave: no retrace
  if pinned:
    new_opt = place(new_opt)
    if cfg.plan.shard_axis is not None and not cfg.plan.params_sharded:
      new_piece = _zero1_gather(cfg, layouts, new_piece)
    else:
      new_piece = jax.tree.map(lambda x, lay: sharded._place(x, mesh, lay.param_spec), new_piece, layouts)
  metrics = {"loss": out.pop("loss")}
  if cfg.has_aux:
    metrics["aux"] = out.pop("aux")
  metrics.update(total_weight=total, applied=applied)
  if cfg.grad_norms:
    metrics["grad_norms"] = out.pop("grad_norms")
  if cfg.noise_scale:
    s1, count, *sampled_weight = out.pop("noise_sums")
    mean_sq = _noise.sq_norm(grads, s1.dtype)  # |g|^2 of the reduced mean (the partitioner sums shards)
    if sampled_weight:  # noise_scale_sample: ja.accumulate's sampled estimator on (sum_S w |g|^2, B_S, |S|)
      est = _noise.sampled_window_estimates(s1 * total.astype(s1.dtype), sampled_weight[0], count, total, mean_sq)
    else:
      est = _noise.window_estimates(s1 * total.astype(s1.dtype), total, mean_sq, count)
    grad_sq, trace_cov, valid = est
    metrics["noise_scale"] = _noise.step_estimate(grad_sq, trace_cov, valid)
  return new_piece, new_state, new_opt, metrics


def _replicated(spec: PartitionSpec) -> bool:
  """Whether `spec` names no mesh axis (UNCONSTRAINED, a layout not known inside an outer jit, is not)."""
  return all(e is None for e in spec)


def _extra_args(optimizer, loss) -> dict:
  """`{"value": loss}` for an optimizer that takes extra arguments (optax's `GradientTransformationExtraArgs`).

  optax passes per-step values to `update` as keyword arguments:
  `optax.contrib.reduce_on_plateau` (and `polyak_sgd`) need `value=`, the
  loss being minimised. The step's `value` is its loss, `metrics["loss"]`: the
  global weighted mean over every microbatch of every device, the number a
  plain loop would pass. `optax.chain` forwards it to the transforms that take
  it and drops it for the others. An update without `**kwargs` or a `value`
  parameter gets nothing extra.
  """
  if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
    return {}
  try:
    params = inspect.signature(optimizer.update).parameters
  except (TypeError, ValueError):  # no signature to read (a C callable): optax's contract says it takes kwargs
    return {"value": loss}
  if "value" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return {"value": loss}
  return {}


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def _zero1_gather(cfg: Config, layouts, pieces):
  """zero1: the one all-gather that rebuilds the replicated parameters from their shards."""
  plan, mesh = cfg.plan, cfg.mesh
  manual = set(plan.batch_axes)
  flat = jax.tree.leaves(layouts, is_leaf=sharded._is_leaf)
  coll = _Collectives(plan, flat, mesh, None)

  def body(*xs):
    full = sharded._all_gather([xs[j] for j in coll.sharded], coll._lay(), coll.axis, coll.size, to="invarying")
    out = list(xs)
    for j, f in zip(coll.sharded, full, strict=True):
      out[j] = f
    return tuple(out)

  out = jax.shard_map(
    body,
    mesh=mesh,
    axis_names=manual,
    in_specs=tuple(sharded._manual_spec(lay.opt_spec, manual) for lay in flat),
    out_specs=tuple(sharded._manual_spec(lay.param_spec, manual) for lay in flat),
  )(*jax.tree.leaves(pieces))
  return jax.tree.unflatten(jax.tree.structure(pieces), out)


def always_applied(train_step):
  """The same `make_train_step` step with no skip: its update always applies (private; the bench and tests).

  A skipped update must cost no memory: the step's compiled per-device peak is
  compared with this twin's.
  """
  # The step's own class, taken from the object: this module never imports train_step (which imports it).
  return type(train_step)(train_step._cfg._replace(always_apply=True), train_step._arg_names, train_step._hint)
