"""diloco_train_step(): (streaming) DiLoCo over a slow mesh axis, around any `make_train_step` step.

A pod trains with `ja.make_train_step` over its fast "data" axis (any
strategy: ddp, zero1, fsdp, hsdp); pods are joined by a slow link, the
"replica" axis of the same mesh. This wrapper runs the step once per replica,
each on its own rows and its own parameters, with `ja.diloco` as the
optimizer: the step's optimizer is DiLoCo's inner optimizer, and DiLoCo's
collectives (one fragment's outer gradient every H / F updates) are the only
ones that cross the replica axis.

Layout. Per-replica parameters, model state and optimizer state carry a
leading replica dimension of size R laid out over the replica axis
(`init` makes them from one copy of the parameters). The batch's rows are
split over the replica axis first (replica r gets the r-th of R contiguous
blocks of rows), then the step splits each block over its data axes. Inside,
one `jax.shard_map` is manual over the replica axis only; the step's own
shard_map over the data axes and its partitioner-laid-out update run inside
it per replica, exactly as they would on a mesh without the replica axis.

Equivalence. Replica r's update is `make_train_step`'s step on its rows,
with `ja.diloco(step's optimizer, outer, sync_every, axis_name=replica_axis,
...)` as optimizer: the same as the user's own `shard_map` over the replica
axis with `ja.diloco` and a data-parallel step per replica
(tests/test_slowlink.py checks it to 1e-12 in float64, and counts the
collectives that cross the replica axis in the compiled HLO).

Skipped steps. The step skips an update whose mean gradient is not finite (or
whose total weight is 0); the decision is each replica's own, reduced over its
data axes only. DiLoCo's schedule must agree across replicas (a sync is a
collective over all of them), so the optimizer runs on every call on every
replica and gates only its inner step: where a replica skips, its gradient is
replaced by zeros, its inner update is zero (u_p = 0, so local_p = theta_p)
and its inner optimizer state and model state are kept, while the update
count, the sends and the merges proceed as on the others. A skip thus adds no
collective, never leaves a replica behind, and lets no NaN into any state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxaccum import _engine, _hlo, _tree, lowcomm, sharded, train_step
from jaxaccum._split import leading_size


def _head(tree):
  # A squeeze, not a[0]: indexing lowers to a dynamic slice, across which the partitioner loses the
  # leaf's sharding over the (auto) data axes and gathers it whole; a squeeze keeps it.
  return jax.tree.map(lambda a: lax.squeeze(a, (0,)), tree)


def _stack(tree):
  return jax.tree.map(lambda a: a[None], tree)


def _stacked_spec(x, replica_axis: str) -> PartitionSpec:
  """A per-replica input's PartitionSpec from its type when it leads with the replica axis, else P(replica_axis)."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  if spec is not None and len(spec) and spec[0] == replica_axis:
    return spec
  return PartitionSpec(replica_axis)


def _replica_led(x, mesh, replica_axis: str, then: tuple[str, ...] = ()):
  """`x` typed with its leading dimension over the (Explicit) replica axis first, its other axes kept.

  A shard_map manual over an Explicit axis takes each input typed as its in_specs over that axis (jax
  >= 0.12 checks it, partial-manual maps included; older versions reshard silently): a leaf typed so
  already is returned as is; any other (a broadcast, a batch typed replicated or over the data axes
  only) is resharded with the replica axis moved to the front of its leading dimension, followed by
  the Explicit axes of `then` that shard none of its dimensions (the batch: its rows over the replica
  axis, then over the step's data axes, as the partitioner lays them out when nothing is typed).
  """
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  entries = sharded._entries(spec or PartitionSpec(), jnp.ndim(x))
  if not entries:
    return x
  first = sharded._names(entries[0])
  if first[:1] == (replica_axis,) and all(replica_axis not in sharded._names(e) for e in entries[1:]):
    return x
  used = {n for e in entries for n in sharded._names(e)}
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit}
  more = tuple(a for a in then if a in explicit and a not in used and a != replica_axis)
  entry = lambda names: None if not names else names[0] if len(names) == 1 else names
  lead = entry((replica_axis, *(n for n in first if n != replica_axis), *more))
  rest = [entry(tuple(n for n in sharded._names(e) if n != replica_axis)) for e in entries[1:]]
  return jax.sharding.reshard(x, NamedSharding(mesh, sharded._spec([lead, *rest])))


class DiLoCoTrainStep:
  """The step `diloco_train_step` returns: `init`, then `step(params, opt_state, batch, key=None)`.

  Arguments and results are those of the wrapped step, with a leading replica
  dimension of size R on parameters, model state, optimizer state and on each
  metric; the batch keeps its rows (split over the replica axis first).
  The inputs' buffers are donated as `make_train_step`'s are: passing arrays a
  previous call consumed is the same `ValueError` (`train_step.check_not_donated`).
  """

  def __init__(self, cfg: _engine.Config, arg_names: tuple[str, ...], replica_axis: str, replicas: int):
    self._cfg, self._arg_names, self.replica_axis, self.replicas = cfg, arg_names, replica_axis, replicas
    self.optimizer = cfg.optimizer  # the ja.diloco transform each replica runs
    mesh, has_state = cfg.mesh, cfg.has_state
    rep = PartitionSpec(replica_axis)

    def body(*args):
      params, state, opt_state, batch, key = args if has_state else (args[0], None, *args[1:])
      if key is not None:  # replicas draw different randomness, as the step's devices do
        key = jax.random.fold_in(key, lax.axis_index(replica_axis))
      # The step's own shard_map and placements nested here see the replica axis as manual.
      inner = cfg._replace(mesh=jax.sharding.get_abstract_mesh())
      params, state, opt_state, metrics = _engine.step(
        inner, None, _head(params), None if state is None else _head(state), _head(opt_state), batch, key
      )
      out = (params, state, opt_state, metrics) if has_state else (params, opt_state, metrics)
      return _stack(out)

    explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit]
    replica_explicit = replica_axis in explicit
    inside = mesh
    if any(a != replica_axis for a in explicit):
      # jax 0.10 gathers a leaf sharded over an Explicit axis that a partial-manual shard_map leaves to
      # the partitioner, whole, at the map's boundary (fsdp's memory would be ddp's). Over the same
      # devices with those axes Auto, the partitioner keeps the data-axis shards as they come.
      types = tuple(
        AxisType.Auto if a != replica_axis else t for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
      )
      inside = mesh.abstract_mesh.update(axis_types=types)

    def fun(*args):
      *front, key = args
      if replica_explicit:
        # Per-replica buffers over the replica axis as they come; the batch's rows over it, then the data axes.
        *state_trees, batch = front
        front = [jax.tree.map(lambda x: _replica_led(x, mesh, replica_axis), t) for t in state_trees]
        front.append(jax.tree.map(lambda x: _replica_led(x, mesh, replica_axis, cfg.plan.batch_axes), batch))
        args = (*front, key)
      specs = (rep,) * len(front) + (None if key is None else PartitionSpec(),)
      n_out = 4 if has_state else 3
      # Untyped, as the step's own shard_map inside it is (make_train_step runs user code with
      # check_vma=False): a typed outer map would expect replica-varying cotangents from an untyped body.
      out = jax.shard_map(
        body, mesh=inside, in_specs=specs, out_specs=(rep,) * n_out, axis_names={replica_axis}, check_vma=False
      )(*args)
      if inside is mesh:
        return out
      # Back on the step's mesh, each per-replica buffer laid out as it came in (metrics over the replicas).
      back = lambda y, x: jax.sharding.reshard(y, NamedSharding(mesh, _stacked_spec(x, replica_axis)))
      return tuple(jax.tree.map(back, y, x) for y, x in zip(out[:-1], front, strict=False)) + (
        jax.tree.map(lambda y: jax.sharding.reshard(y, NamedSharding(mesh, rep)), out[-1]),
      )

    donate = tuple(range(3 if has_state else 2)) if cfg.donate else ()
    self._jitted = jax.jit(fun, donate_argnums=donate)

    def init(params, state=None):
      opt_state = jax.tree.map(lambda a: a[None], cfg.optimizer.init(_head(params)))
      return (params, state, opt_state) if has_state else (params, opt_state)

    def start(*trees):
      # One copy per replica, made on the devices (the caller's arrays are never donated or aliased).
      trees = jax.tree.map(lambda a: jnp.broadcast_to(a, (replicas, *jnp.shape(a))), trees)
      if replica_explicit:  # a broadcast is typed replicated: the map takes its inputs over the replica axis
        trees = jax.tree.map(lambda a: _replica_led(a, mesh, replica_axis), trees)
      return jax.shard_map(init, mesh=mesh, in_specs=rep, out_specs=rep, axis_names={replica_axis})(*trees)

    self._start = start

  def init(self, params, state=None):
    """(params, opt_state), or (params, state, opt_state) with has_state: every replica starts from `params`.

    Each leaf gains a leading replica dimension of size R laid out over the
    replica axis; the optimizer state is `ja.diloco`'s `init` on each replica.
    """
    if self._cfg.has_state and state is None:
      raise TypeError("the step has has_state=True: call init(params, state)")
    if not self._cfg.has_state and state is not None:
      raise TypeError("the step has has_state=False: call init(params) (no model state)")
    trees = (params,) + (() if state is None else (state,))
    return jax.jit(self._start, out_shardings=self.layout(params))(*trees)

  def layout(self, params) -> tuple:
    """The `NamedSharding`s of `init`'s outputs: each per-replica buffer as the wrapped step lays it out.

    The leading replica dimension over the replica axis; the rest as the step's
    strategy lays one replica's parameters and optimizer state over the data
    axes (`ja.shard_train_state`'s rule): around fsdp/hsdp the parameters, the
    inner state and DiLoCo's anchor, outer states, in-flight Delta and residual
    stay sharded over the data axes, so a replica holds 1/(data size) of each
    (not ddp's whole copy). Model state is replicated within a replica.
    """
    cfg, mesh = self._cfg, self._cfg.mesh
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), _tree.dtype_of(x)), params)
    layouts = sharded._layouts(params, mesh, cfg.plan, placed=False)
    stacked = lambda spec: jax.sharding.NamedSharding(mesh, PartitionSpec(self.replica_axis, *spec))
    param_sh = jax.tree.map(lambda lay: stacked(lay.param_spec), layouts, is_leaf=sharded._is_leaf)
    specs = sharded.state_specs(jax.eval_shape(cfg.optimizer.init, shapes), shapes, layouts, mesh, cfg.plan)
    state_sh = jax.tree.map(stacked, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if not cfg.has_state:
      return param_sh, state_sh
    return param_sh, jax.sharding.NamedSharding(mesh, PartitionSpec(self.replica_axis)), state_sh

  def _prepare(self, args, kwargs):
    names = self._arg_names
    named = dict(zip(names, args, strict=False)) | kwargs
    unknown = set(named) - set(names)
    if unknown or len(args) > len(names):
      raise TypeError(f"the step takes ({', '.join(names)}), got {len(args)} positional and {sorted(kwargs)}")
    for name in names[:-1]:
      if name not in named:
        raise TypeError(f"the step takes ({', '.join(names)}): {name} is missing")
    train_step.check_not_donated(named, names)
    for name in names:
      if name in ("batch", "key"):
        continue
      for path, leaf in jax.tree_util.tree_leaves_with_path(named[name]):
        shape = jnp.shape(leaf)
        if not shape or shape[0] != self.replicas:
          raise ValueError(
            f"{name}{jax.tree_util.keystr(path)} has shape {shape}: every leaf needs a leading replica dimension "
            f"of size {self.replicas} (the size of mesh axis {self.replica_axis!r}); make them with step.init(...)"
          )
    cfg = self._cfg
    devices = self.replicas * int(np.prod([cfg.mesh.shape[a] for a in cfg.plan.batch_axes]))
    size = leading_size(named["batch"])
    if size % (devices * cfg.k):
      raise ValueError(
        f"the batch's leading size {size} is not divisible by {self.replicas} replicas times "
        f"{devices // self.replicas} devices on data axes {cfg.plan.batch_axes} times num_microbatches={cfg.k}"
      )
    one = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), t)
    train_step._check_opt_state(cfg.optimizer, one(named["params"]), one(named["opt_state"]))
    return tuple(named.get(n) for n in names)

  def __call__(self, *args, **kwargs):
    return self._jitted(*self._prepare(args, kwargs))

  def lower(self, *args, **kwargs):
    return self._jitted.lower(*self._prepare(args, kwargs))

  def crossing_collectives(self, *args, **kwargs) -> list:
    """The collectives of the compiled step whose device groups span replicas (`jaxaccum._hlo.Collective`s).

    Arguments as for a call. Each runs once per sync of its fragment (`where == "branch"`).
    """
    return crossing(self.lower(*args, **kwargs).compile().as_text(), self._cfg.mesh, self.replica_axis)


def crossing(hlo_text: str, mesh, replica_axis: str) -> list:
  """The collectives of `hlo_text` (compiled over `mesh`) whose groups hold devices of two replicas or more."""
  replica_of = np.moveaxis(
    np.arange(mesh.devices.size).reshape(mesh.devices.shape), mesh.axis_names.index(replica_axis), 0
  ).reshape(mesh.shape[replica_axis], -1)
  index = {int(d): r for r, row in enumerate(replica_of) for d in row}
  out = []
  for c in _hlo.collectives(hlo_text, num_devices=mesh.devices.size):
    spans = c.groups is None or any(len({index[d] for d in g}) > 1 for g in c.groups)
    if spans:
      out.append(c)
  return out


def diloco_train_step(
  step: train_step.TrainStep,
  outer,
  sync_every: int,
  *,
  replica_axis: str = "replica",
  comm_dtype: Any = None,
  fragments: Any = 1,
  delay: int = 0,
  alpha: float = 0.0,
  compress: str | lowcomm.TopK | None = None,
  error_feedback: bool = False,
) -> DiLoCoTrainStep:
  """(Streaming) DiLoCo over `replica_axis` of the step's mesh, around a `make_train_step` step.

  Each of the R replicas runs `step` (its strategy over its data axes) on its
  own rows and parameters, with optimizer

      ja.diloco(inner=step's optimizer, outer, sync_every, axis_name=replica_axis,
                comm_dtype=..., fragments=..., delay=..., alpha=..., compress=..., error_feedback=...)

  so the only collectives over `replica_axis` are DiLoCo's: for each fragment,
  once per `sync_every` updates, one all-reduce of its outer gradient (plus a
  small max-all-reduce of block scales with int8/int4). See `ja.diloco` for
  the math and every option. MaxText's `build_diloco_train_step(train_step,
  mesh)` has this shape; the step's mesh is the one used here.

      mesh = jax.make_mesh((2, 4), ("replica", "data"))
      step = ja.make_train_step(loss_fn, optax.adamw(1e-3), mesh=mesh, data_axis="data", strategy="fsdp")
      dstep = ja.diloco_train_step(step, optax.sgd(0.7, momentum=0.9, nesterov=True), 32, fragments=4,
                                   delay=1, alpha=0.5, compress="int4", error_feedback=True)
      params, opt_state = dstep.init(params)            # leading replica dimension
      params, opt_state, metrics = dstep(params, opt_state, batch)   # metrics per replica

  The batch's rows are split over `replica_axis` first, then over the step's
  data axes. A `key` is folded with the replica index. See the module
  docstring for layouts and for steps that skip an update.

  Args:
    step: a `ja.make_train_step` step built on a mesh holding `replica_axis`
      (not one of its data axes); its optimizer is DiLoCo's inner optimizer.
    outer: the outer optimizer, as for `ja.diloco`.
    sync_every: H, as for `ja.diloco`.
    replica_axis: the slow mesh axis the replicas lie on.
    comm_dtype: as for `ja.diloco`.
    fragments: as for `ja.diloco`.
    delay: as for `ja.diloco`.
    alpha: as for `ja.diloco`.
    compress: as for `ja.diloco`.
    error_feedback: as for `ja.diloco`.

  Returns:
    A `DiLoCoTrainStep`: `init(params[, state])`, then
    `step(params[, state], opt_state, batch, key=None)`, `.lower(...)`,
    `.crossing_collectives(...)`.

  Raises:
    TypeError/ValueError: `step` not a `make_train_step` step or built without
      a mesh; `replica_axis` not an axis of its mesh or one of its data axes;
      every `ja.diloco` error.
  """
  if not isinstance(step, train_step.TrainStep):
    raise TypeError(f"step={step!r} must be a step made by ja.make_train_step")
  cfg = step._cfg
  if cfg.mesh is None:
    raise ValueError(
      "step was built without a mesh: make it with make_train_step(..., mesh=mesh) on a mesh with "
      f"the replica axis {replica_axis!r} and the data axis"
    )
  if not isinstance(replica_axis, str) or replica_axis not in cfg.mesh.axis_names:
    raise ValueError(f"{replica_axis=} is not an axis of the step's mesh {dict(cfg.mesh.shape)}")
  if replica_axis in cfg.plan.batch_axes:
    raise ValueError(
      f"{replica_axis=} is one of the step's data axes {cfg.plan.batch_axes}: the step would average "
      "gradients over it every update; build the step with the other axes as data_axis"
    )
  tx = lowcomm.diloco(
    cfg.optimizer,
    outer,
    sync_every,
    axis_name=replica_axis,
    comm_dtype=comm_dtype,
    fragments=fragments,
    delay=delay,
    alpha=alpha,
    compress=compress,
    error_feedback=error_feedback,
  )
  cfg = cfg._replace(optimizer=tx, optimizer_gates_itself=True)  # see "Skipped steps" in the module docstring
  return DiLoCoTrainStep(cfg, step._arg_names, replica_axis, cfg.mesh.shape[replica_axis])
