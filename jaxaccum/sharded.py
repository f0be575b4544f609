"""Sharded training: ddp, zero1, fsdp and hsdp over the data axes of a mesh, one reduction per step.

Strategies (P devices on the data axis, N parameters, K microbatches per step):

- `"ddp"`: parameters and optimizer state replicated; local accumulation, one
  all-reduce of the gradient per step.
- `"zero1"`: parameters replicated, optimizer state sharded over the data axis.
  Each device accumulates its K weighted microbatch gradients locally (no
  collective in the loop), then one reduce-scatter hands every device the
  global sum for its shard, the optimizer runs on that shard, and one
  all-gather rebuilds the replicated parameters: 2 (P-1)/P N elements on a
  ring, the bytes of one all-reduce, with optimizer memory / P.
- `"fsdp"`: parameters and optimizer state sharded over the data axis.
  `fsdp_gather="per_microbatch"` (memory-lean, the PyTorch FSDP2 default):
  every microbatch all-gathers the parameters, computes, and reduce-scatters
  its weighted gradient into a sharded accumulator: K all-gathers and K
  reduce-scatters per step, and a device never holds more than one gathered
  copy of the parameters plus a 1/P accumulator. `fsdp_gather="once"`
  (comm-lean): one all-gather per step, a local full-size accumulator, one
  reduce-scatter after the loop: 1 + 1 collectives instead of K + K, at the
  cost of one full parameter copy and one full (float32 or wider) accumulator
  per device for the whole step.
- `"hsdp"`: `data_axis=(replica_axis, shard_axis)`: fsdp within each group of
  `shard_axis`, replicated over `replica_axis`; the cross-replica all-reduce of
  the (sharded) gradient runs once per step whatever K.

How the step is built. The gradient part runs under a `jax.shard_map` that is
manual over the data axes only (other mesh axes, e.g. "model", stay with the
partitioner and keep the shardings the user gave the parameters): local
accumulation of sum_i w_i g_i in float32 or wider, the explicit collectives
above (`comm_dtype` on the wire), and one all-reduce of the scalar weight and
loss sums. The optimizer then runs *outside* the shard_map, under `jit`, on the
globally shaped gradient, optimizer state and parameter slice, all sharded over
the data axis: an elementwise optimizer touches only local data, and one whose
update needs a global quantity (lamb's trust ratio, `clip_by_global_norm`)
gets it from scalar all-reduces the partitioner inserts, so the update equals
the replicated one without special cases. For zero1 a second shard_map
all-gathers the new parameter shards.

Collectives are packed: the leaves sharded over the data axis only are laid
out in one flat buffer per dtype, so a step has one reduce-scatter and one
all-gather instruction (per dtype) however many leaves the model has. Leaves
that another mesh axis also shards get their own collective each; leaves with
no dimension divisible by the axis size stay replicated and join the scalar
all-reduce.

Layout rule (`ja.shard_train_state`): a leaf is sharded on its largest
dimension divisible by the data axis size that no other mesh axis already
shards; otherwise it is replicated over the data axis.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxaccum import _tree, parallel

STRATEGIES = ("ddp", "zero1", "fsdp", "hsdp")
FSDP_GATHERS = ("per_microbatch", "once")


# --------------------------------------------------------------------------- plan and layout


class _Plan(NamedTuple):
  """A strategy resolved on a mesh."""

  strategy: str
  # Every data axis: the batch is split over all of them; the step is manual over them.
  batch_axes: tuple[str, ...]
  # The axis the optimizer state (and for fsdp/hsdp the parameters) is sharded over; None for ddp.
  shard_axis: str | None
  # hsdp's replica axis: gradients are all-reduced over it once per step.
  replica_axis: str | None
  # Parameters sharded (fsdp, hsdp) or replicated (ddp, zero1) over shard_axis.
  params_sharded: bool


def _make_plan(strategy, mesh, data_axis) -> _Plan:
  if strategy not in STRATEGIES:
    raise ValueError(f"{strategy=} is not one of {STRATEGIES}")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh (e.g. jax.make_mesh or ja.data_mesh)")
  if strategy == "hsdp":
    if not (
      isinstance(data_axis, tuple)
      and len(data_axis) == 2
      and all(isinstance(a, str) for a in data_axis)
      and data_axis[0] != data_axis[1]
    ):
      raise ValueError(
        f"strategy='hsdp' needs data_axis=(replica_axis, shard_axis), two different mesh axis names; got {data_axis=}"
      )
    axes: tuple[str, ...] = data_axis
  else:
    if not isinstance(data_axis, str) or not data_axis:
      raise ValueError(f"{strategy=} needs data_axis to be one mesh axis name (a string); got {data_axis=}")
    axes = (data_axis,)
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(f"{data_axis=} names {a!r}, which is not an axis of the mesh (its axes: {mesh.axis_names})")
  if strategy == "ddp":
    return _Plan(strategy, axes, None, None, False)
  if strategy == "zero1":
    return _Plan(strategy, axes, axes[0], None, False)
  if strategy == "fsdp":
    return _Plan(strategy, axes, axes[0], None, True)
  return _Plan(strategy, axes, axes[1], axes[0], True)


class _Leaf(NamedTuple):
  """Where one parameter leaf lives."""

  param_spec: PartitionSpec  # the parameter's sharding (all mesh axes)
  opt_spec: PartitionSpec  # its optimizer state's and sharded gradient's sharding
  dim: int | None  # the dimension sharded over the plan's shard axis (None: replicated over it)
  other: bool  # another mesh axis shards the leaf too (its own collectives, no packing)


def _entries(spec, ndim) -> list:
  out = list(spec) + [None] * (ndim - len(spec))
  return [tuple(e) if isinstance(e, list) else e for e in out]


def _names(entry) -> tuple:
  if entry is None:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def _layout(shape, base: list, mesh: Mesh, axis: str | None) -> tuple[list, int | None]:
  """`base` plus `axis` on the largest dimension divisible by its size that no other axis shards."""
  if axis is None:
    return list(base), None
  size = mesh.shape[axis]
  free = [d for d in range(len(shape)) if base[d] is None and shape[d] >= size and shape[d] % size == 0]
  if not free:
    return list(base), None
  dim = max(free, key=lambda d: (shape[d], -d))
  out = list(base)
  out[dim] = axis
  return out, dim


def _spec(entries) -> PartitionSpec:
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return PartitionSpec(*entries)


def _sharding_of(x):
  return getattr(x, "sharding", None) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None


def _same_mesh(a, b: Mesh) -> bool:
  return (
    tuple(a.axis_names) == tuple(b.axis_names)
    and a.devices.shape == b.devices.shape
    and [d.id for d in a.devices.flat] == [d.id for d in b.devices.flat]
  )


def _leaf_layout(path, x, mesh: Mesh, plan: _Plan, *, placed: bool) -> _Leaf:
  """The layout of one parameter leaf, checked against what the user gave.

  `placed`: the leaf must already be laid out as the strategy wants (the step);
  otherwise (shard_train_state) a leaf may be anywhere, and only shardings over
  the data axes that contradict the strategy are errors.
  """
  where = f"params{jax.tree_util.keystr(path)}"
  shape = tuple(np.shape(x))
  sharding = _sharding_of(x)
  if isinstance(sharding, NamedSharding):
    if not _same_mesh(sharding.mesh, mesh):
      raise ValueError(f"{where} is placed on another mesh ({sharding.mesh}) than mesh={mesh}")
    given = _entries(sharding.spec, len(shape))
  elif sharding is None or not placed or len(sharding.device_set) == 1 and mesh.size == 1:
    given = [None] * len(shape)
  else:
    raise ValueError(
      f"{where} has sharding {sharding}, not a NamedSharding on the mesh: place the parameters and "
      "optimizer state with ja.shard_train_state(params, optimizer, mesh, strategy=...)"
    )
  data = set(plan.batch_axes)
  base = []
  for entry in given:
    names = _names(entry)
    if any(n in data for n in names) and len(names) > 1:
      raise ValueError(
        f"{where} has sharding spec {_spec(given)}: one dimension split over a data axis and another "
        f"axis together, which strategy={plan.strategy!r} does not handle"
      )
    base.append(None if any(n in data for n in names) else entry)
  used_data = [e for e in given if any(n in data for n in _names(e))]
  opt, dim = _layout(shape, base, mesh, plan.shard_axis)
  param = opt if plan.params_sharded else list(base)
  # shard_train_state takes any layout that does not contradict the strategy over the data axes;
  # a step takes exactly the layout shard_train_state gives (a silent reshard would cost a collective).
  if (used_data or (placed and sharding is not None)) and given != param:
    rule = (
      "its largest dimension not sharded otherwise and divisible by the data axis size, if any"
      if plan.params_sharded
      else "parameters stay replicated over the data axes"
    )
    raise ValueError(
      f"{where} has sharding spec {_spec(given)}, which conflicts with strategy={plan.strategy!r} "
      f"over data axes {plan.batch_axes}: it expects {_spec(param)} ({rule}). Place parameters and "
      "optimizer state with ja.shard_train_state(params, optimizer, mesh, strategy=...)."
    )
  other = any(e is not None for e in base)
  return _Leaf(_spec(param), _spec(opt), dim, other)


def _layouts(params, mesh, plan, *, placed):
  return jax.tree_util.tree_map_with_path(lambda p, x: _leaf_layout(p, x, mesh, plan, placed=placed), params)


def _is_leaf(x):
  return isinstance(x, _Leaf)


def _place(x, mesh: Mesh, spec: PartitionSpec):
  """Lays `x` out as `spec` inside jit: `reshard` over Explicit axes, a sharding constraint over Auto ones."""
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  entries = _entries(spec, np.ndim(x))

  def keep(kind):
    return _spec([tuple(n for n in _names(e) if types[n] == kind) or None for e in entries])

  explicit = any(t == AxisType.Explicit for t in types.values())
  auto = any(t == AxisType.Auto for t in types.values())
  if explicit:
    x = jax.sharding.reshard(x, NamedSharding(mesh, keep(AxisType.Explicit)))
  if auto:
    x = lax.with_sharding_constraint(x, NamedSharding(mesh, keep(AxisType.Auto)))
  return x


def _manual_spec(spec: PartitionSpec, axes) -> PartitionSpec:
  """`spec` restricted to the manual (data) axes, as a partial-manual shard_map's specs want."""
  out = []
  for e in spec:
    names = tuple(n for n in _names(e) if n in axes)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return _spec(out)


# --------------------------------------------------------------------------- shard_train_state


class _Base:
  """A parameter's other-axes layout, as an opaque pytree leaf for optax.tree_map_params."""

  def __init__(self, shape, base):
    self.shape, self.base = shape, base


def _state_specs(optimizer, params_shape, layouts, mesh, plan):
  """Specs of the optimizer state: parameter-shaped leaves follow their parameter, the rest the layout rule."""
  state_shape = jax.eval_shape(optimizer.init, params_shape)
  bases = jax.tree.map(
    lambda p, lay: _Base(p.shape, [None if e == plan.shard_axis else e for e in _entries(lay.opt_spec, p.ndim)]),
    params_shape,
    layouts,
    is_leaf=_is_leaf,
  )

  def for_param(s, b):
    base = b.base if tuple(s.shape) == tuple(b.shape) else [None] * s.ndim
    return _spec(_layout(s.shape, base, mesh, plan.shard_axis)[0])

  def for_other(s):
    return _spec(_layout(s.shape, [None] * s.ndim, mesh, plan.shard_axis)[0])

  specs = optax.tree_map_params(
    optimizer,
    for_param,
    state_shape,
    bases,
    transform_non_params=for_other,
    is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
  )
  return state_shape, specs


def _put(x, sharding):
  """Places a host or device value with `sharding`; each process passes the same full value."""
  if jax.process_count() > 1 and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.device_put(x, sharding)


def shard_train_state(params, optimizer, mesh: Mesh, *, strategy: str = "ddp", data_axis: Any = "data"):
  """Places `params` and initialises `optimizer`'s state in `strategy`'s layout on `mesh`.

  Layout: over the strategy's data axis a leaf is sharded on its largest
  dimension divisible by the axis size that no other mesh axis already shards,
  else replicated. zero1 shards the optimizer state only; fsdp and hsdp shard
  the parameters too (hsdp over its shard axis, replicated over its replica
  axis); ddp replicates both. Shardings the parameters already have over other
  mesh axes (e.g. "model") are kept.

  Nothing is ever materialised in full on one device: the parameters go
  straight to their shards, and the optimizer state is created by a jitted
  `optimizer.init` whose outputs are laid out sharded (for zero1 it runs on
  each device's slice of the replicated parameters).

  Args:
    params: the parameter pytree (host or device arrays; shardings over
      non-data mesh axes are kept).
    optimizer: an optax transformation.
    mesh: a mesh holding the data axis (axes).
    strategy: "ddp", "zero1", "fsdp" or "hsdp".
    data_axis: the data axis name; for hsdp `(replica_axis, shard_axis)`.

  Returns:
    `(params, opt_state)`, ready for a step made with the same strategy. The
    returned arrays never share buffers with `params` (steps donate them).
  """
  optimizer = _tree.check_optimizer(optimizer, "optimizer")
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    # A whole training state (e.g. flax's TrainState, with its int step) is the common slip.
    if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)):
      raise TypeError(
        f"params{jax.tree_util.keystr(path)} is {type(leaf).__name__} "
        f"{getattr(leaf, 'dtype', '')}: shard_train_state takes the parameters alone (float arrays), e.g. "
        "state.params of a Flax TrainState, not the whole state"
      )
  plan = _make_plan(strategy, mesh, data_axis)
  layouts = _layouts(params, mesh, plan, placed=False)
  param_sh = jax.tree.map(lambda lay: NamedSharding(mesh, lay.param_spec), layouts, is_leaf=_is_leaf)
  opt_specs = jax.tree.map(lambda lay: lay.opt_spec, layouts, is_leaf=_is_leaf)
  params_shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _tree.dtype_of(x)), params)
  _, state_specs = _state_specs(optimizer, params_shape, layouts, mesh, plan)
  state_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  placed = jax.tree.map(_put, params, param_sh)

  def init(p):
    # A copy, so that a donating step never deletes the caller's buffers.
    p = jax.tree.map(jnp.copy, p)
    piece = jax.tree.map(lambda x, s: _place(x, mesh, s), p, opt_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    state = optimizer.init(piece)
    state = jax.tree.map(
      lambda x, s: _place(x, mesh, s), state, state_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return p, state

  return jax.jit(init, out_shardings=(param_sh, state_sh))(placed)


# --------------------------------------------------------------------------- collectives (inside the shard_map)


def _vary(x, axes):
  """`x` cast to varying over the `axes` it is not yet varying over (inside shard_map)."""
  have = parallel._varying_axes(x) or frozenset()
  missing = tuple(a for a in axes if a not in have)
  return lax.pcast(x, missing, to="varying") if missing else x


def _typed(s):
  """The sharding of an abstract value when it has one in its type (Explicit axes), else None."""
  sharding = getattr(s, "sharding", None)
  spec = getattr(sharding, "spec", None)
  return sharding if spec is not None and any(e is not None for e in spec) else None


def _groups(items, key):
  out: dict = {}
  for item in items:
    out.setdefault(key(item), []).append(item)
  return out.values()


def _auto_other(fn, leaf, axis):
  """`fn` (a collective over the manual `axis`) on a leaf that Explicit non-data axes also shard.

  JAX's collectives take no operand typed as sharded over other Explicit axes;
  `auto_axes` lets the partitioner handle those axes for the one call.
  """
  mesh = jax.sharding.get_abstract_mesh()
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  entries = [None if axis in _names(e) else e for e in leaf.param_spec]
  explicit = sorted({n for e in entries for n in _names(e) if types.get(n) == AxisType.Explicit})
  if not explicit:
    return fn
  return jax.sharding.auto_axes(fn, axes=tuple(explicit), out_sharding=_spec(entries))


def _reduce_scatter(xs, leaves, axis, size, wire):
  """Sum over `axis`, each device keeping its block of dimension `leaf.dim`: one instruction per dtype.

  `xs`: local full-size arrays (one per leaf with a dim); returns the local blocks
  in each x's own dtype. `wire`: the dtype sent (None: each x's own).
  """
  out = [None] * len(xs)
  packable = []
  for j, (x, leaf) in enumerate(zip(xs, leaves, strict=True)):
    w = jnp.dtype(wire) if wire is not None else x.dtype
    if leaf.other:
      rs = lambda y, d=leaf.dim: lax.psum_scatter(y, axis, scatter_dimension=d, tiled=True)
      out[j] = _auto_other(rs, leaf, axis)(x.astype(w)).astype(x.dtype)
    else:
      packable.append((j, w))
  for group in _groups(packable, key=lambda jw: jw[1]):
    # Row p of the buffer holds block p of every leaf (dim moved to the front and flattened).
    rows = [jnp.moveaxis(xs[j], leaves[j].dim, 0).astype(w).reshape(size, -1) for j, w in group]
    mine = lax.psum_scatter(jnp.concatenate(rows, axis=1), axis, scatter_dimension=0, tiled=False)
    offset = 0
    for (j, _), row in zip(group, rows, strict=True):
      x, dim = xs[j], leaves[j].dim
      block = x.shape[dim] // size
      n = row.shape[1]
      piece = mine[offset : offset + n].reshape((block,) + tuple(np.delete(x.shape, dim)))
      out[j] = jnp.moveaxis(piece, 0, dim).astype(x.dtype)
      offset += n
  return out


def _all_gather(xs, leaves, axis, size, to):
  """Inverse of `_reduce_scatter`'s layout: local blocks -> full arrays, one instruction per dtype."""
  out = [None] * len(xs)
  packable = []
  for j, (x, leaf) in enumerate(zip(xs, leaves, strict=True)):
    if leaf.other:
      ag = lambda y, d=leaf.dim: lax.all_gather(y, axis, axis=d, tiled=True, to=to)
      out[j] = _auto_other(ag, leaf, axis)(x)
    else:
      packable.append(j)
  for group in _groups(packable, key=lambda j: xs[j].dtype):
    flats = [jnp.moveaxis(xs[j], leaves[j].dim, 0).reshape(-1) for j in group]
    full = lax.all_gather(jnp.concatenate(flats), axis, axis=0, tiled=False, to=to)
    offset = 0
    for j, flat in zip(group, flats, strict=True):
      x, dim = xs[j], leaves[j].dim
      rest = tuple(np.delete(x.shape, dim))
      piece = full[:, offset : offset + flat.size].reshape((size * x.shape[dim],) + rest)
      out[j] = jnp.moveaxis(piece, 0, dim)
      offset += flat.size
  return out


# --------------------------------------------------------------------------- the step


def make_sharded_train_step(
  loss_fn: Callable[..., Any],
  optimizer: optax.GradientTransformation,
  *,
  strategy: str,
  mesh: Mesh,
  data_axis: Any = "data",
  num_microbatches: int = 1,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  donate: bool = True,
  comm_dtype: Any = None,
  fsdp_gather: str = "per_microbatch",
):
  r"""Returns `step(params, opt_state, batch, key=None) -> (params, opt_state, metrics)` for `strategy`.

  The step computes the weighted mean gradient over the K microbatches of each
  of the P devices of the data axes,

  .. math:: g = \frac{\sum_{p,i} w_{p,i}\, \nabla L(\theta; b_{p,i})}{\sum_{p,i} w_{p,i}},

  and applies `optimizer` once, laid out as `strategy` says (see the module
  docstring): the result equals a single-device step on the whole batch.

  Args:
    loss_fn: `loss_fn(params, batch[, key]) -> loss` or `(loss, aux)`; a mean
      over the rows of `batch`.
    optimizer: any optax transformation (global-norm ones included).
    strategy: "ddp", "zero1", "fsdp" or "hsdp".
    mesh: the mesh; `params` and `opt_state` come from
      `ja.shard_train_state(..., strategy=strategy, data_axis=data_axis)` on it.
    data_axis: the data axis; for hsdp `(replica_axis, shard_axis)`. The batch
      is split over all data axes (its leading size divisible by their product
      times K).
    num_microbatches: K per device per step.
    has_aux, weight_fn: as `ja.make_train_step`.
    donate: donate `params` and `opt_state` to the outputs.
    comm_dtype: dtype of the gradient on the wire (reduce-scatters, ddp's
      all-reduce, hsdp's cross-replica all-reduce, and the all-reduce of the
      leaves too small to shard), e.g. `jnp.bfloat16`; accumulation stays in
      float32 or wider, the optimizer sees the accumulator's dtype; the weight
      and loss sums stay wide. With fsdp_gather="per_microbatch" each
      microbatch's gradient is rounded to it once before it is accumulated.
      Parameter all-gathers always move the parameters' own dtype.
    fsdp_gather: fsdp/hsdp only: "per_microbatch" (memory-lean: gather and
      reduce-scatter per microbatch) or "once" (comm-lean: one gather and one
      reduce-scatter per step, costing one full parameter copy and one full
      accumulator per device).

  Returns:
    A step with `.lower(params, opt_state, batch[, key])`. `metrics` holds
    `"loss"` (and `"aux"` with `has_aux`: weighted means over microbatches
    and devices), `"total_weight"` (the sum of all weights; P K by default)
    and `"applied"`, as `ja.make_train_step`'s. A step whose total weight is 0
    (an all-padding batch: loss 0) or NaN (some weight negative or not finite)
    leaves `params` and `opt_state` unchanged bit for bit. A `key` reaches
    `loss_fn` as `fold_in(fold_in(key, d), i)` for microbatch i of device d
    (the device's position in the batch's row order).
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn={loss_fn!r} must be callable")
  optimizer = _tree.check_optimizer(optimizer, "optimizer")
  plan = _make_plan(strategy, mesh, data_axis)
  k = _tree.check_positive_int(num_microbatches, "num_microbatches")
  if not isinstance(has_aux, bool):
    raise TypeError(f"{has_aux=} must be a bool")
  if not isinstance(donate, bool):
    raise TypeError(f"{donate=} must be a bool")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn={weight_fn!r} must be callable or None")
  if comm_dtype is not None:
    comm_dtype = jnp.dtype(comm_dtype)
    if not jnp.issubdtype(comm_dtype, jnp.floating):
      raise ValueError(f"{comm_dtype=} must be a floating dtype (an integer wire dtype truncates)")
  if fsdp_gather not in FSDP_GATHERS:
    raise ValueError(f"{fsdp_gather=} is not one of {FSDP_GATHERS}")
  return _ShardedStep(
    loss_fn,
    optimizer,
    plan,
    mesh,
    k,
    has_aux,
    weight_fn,
    donate,
    comm_dtype,
    lean=plan.params_sharded and fsdp_gather == "per_microbatch",
  )


class _ShardedStep:
  """The step: reads the arguments' layouts, then calls a jitted function cached per layout."""

  def __init__(self, loss_fn, optimizer, plan, mesh, k, has_aux, weight_fn, donate, comm_dtype, lean):
    self.loss_fn, self.optimizer, self.plan, self.mesh, self.k = loss_fn, optimizer, plan, mesh, k
    self.has_aux, self.weight_fn, self.donate, self.comm_dtype, self.lean = has_aux, weight_fn, donate, comm_dtype, lean
    self._cache: dict = {}

  def _jitted(self, params, opt_state):
    layouts = _layouts(params, self.mesh, self.plan, placed=True)
    flat, treedef = jax.tree.flatten(layouts, is_leaf=_is_leaf)
    state_sh = jax.tree.map(lambda x: _sharding_of(x) or NamedSharding(self.mesh, PartitionSpec()), opt_state)
    for path, sh in jax.tree_util.tree_leaves_with_path(state_sh):
      if not isinstance(sh, NamedSharding) or not _same_mesh(sh.mesh, self.mesh):
        raise ValueError(
          f"opt_state{jax.tree_util.keystr(path)} has sharding {sh}, not on the mesh: create it with "
          "ja.shard_train_state(params, optimizer, mesh, strategy=...)"
        )
    key = (treedef, tuple(flat), jax.tree.structure(state_sh), tuple(jax.tree.leaves(state_sh)))
    fn = self._cache.get(key)
    if fn is None:
      param_sh = jax.tree.map(lambda lay: NamedSharding(self.mesh, lay.param_spec), layouts, is_leaf=_is_leaf)
      fn = jax.jit(
        functools.partial(self._step, layouts, state_sh),
        donate_argnums=(0, 1) if self.donate else (),
        out_shardings=(param_sh, state_sh, None),
      )
      self._cache[key] = fn
    return fn

  def __call__(self, params, opt_state, batch, key=None):
    # A donated (deleted) buffer reaching XLA on a multi-device mesh segfaults (jax 0.10): refuse it here.
    for name, tree in (("params", params), ("opt_state", opt_state), ("batch", batch), ("key", key)):
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
          raise ValueError(
            f"{name}{jax.tree_util.keystr(path)} was deleted: it was donated to a previous call of this step "
            "(donate=True gives the buffers of params and opt_state to the outputs). Use the step's outputs "
            "for the next call, rebind: params, opt_state, metrics = step(params, opt_state, batch), or build "
            "the step with donate=False."
          )
    return self._jitted(params, opt_state)(params, opt_state, batch, key)

  def lower(self, params, opt_state, batch, key=None):
    return self._jitted(params, opt_state).lower(params, opt_state, batch, key)

  # ------------------------------------------------------------------------- traced

  def _step(self, layouts, state_sh, params, opt_state, batch, key):
    plan, mesh = self.plan, self.mesh
    shards = int(np.prod([mesh.shape[a] for a in plan.batch_axes]))
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
      if jnp.ndim(x) == 0:
        raise ValueError(f"batch{jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a leading batch axis")
      if jnp.shape(x)[0] % (shards * self.k):
        raise ValueError(
          f"the batch's leading size {jnp.shape(x)[0]} is not divisible by {shards} devices on "
          f"data axes {plan.batch_axes} times num_microbatches={self.k}"
        )
    manual = set(plan.batch_axes)
    batch_axes = plan.batch_axes[0] if len(plan.batch_axes) == 1 else plan.batch_axes
    param_in = jax.tree.map(lambda lay: _manual_spec(lay.param_spec, manual), layouts, is_leaf=_is_leaf)
    grad_out = jax.tree.map(lambda lay: _manual_spec(lay.opt_spec, manual), layouts, is_leaf=_is_leaf)
    key_spec = None if key is None else PartitionSpec()
    grads_body = functools.partial(self._grads, layouts)
    grads, metrics = jax.shard_map(
      grads_body,
      mesh=mesh,
      axis_names=manual,
      in_specs=(param_in, PartitionSpec(batch_axes), key_spec),
      out_specs=(grad_out, PartitionSpec()),
    )(params, batch, key)

    total = metrics.pop("weight")
    # NaN (an invalid weight somewhere) compares False too. A non-finite mean gradient (a
    # microbatch of weight > 0 whose loss was NaN) must not reach the parameters either: a
    # scalar per leaf, reduced by the partitioner (no parameter-sized collective).
    ok = jnp.isfinite(total) & (total > 0) & _tree.all_finite(grads)
    metrics.update(total_weight=total, applied=ok)
    # The optimizer on the globally shaped, data-sharded gradient, state and parameter slice.
    piece = jax.tree.map(lambda x, lay: _place(x, mesh, lay.opt_spec), params, layouts)
    updates, new_state = self.optimizer.update(grads, opt_state, piece)
    new_piece = optax.apply_updates(piece, updates)
    # Where the step has no weight, nothing moves (inside jit nothing can raise).
    new_piece = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_piece, piece)
    new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, opt_state)
    new_state = jax.tree.map(lambda x, sh: _place(x, mesh, sh.spec), new_state, state_sh)
    if plan.shard_axis is not None and not plan.params_sharded:
      new_params = self._gather_params(layouts, new_piece)
    else:
      new_params = jax.tree.map(lambda x, lay: _place(x, mesh, lay.param_spec), new_piece, layouts)
    return new_params, new_state, metrics

  def _gather_params(self, layouts, pieces):
    """zero1: the one all-gather that rebuilds the replicated parameters from their shards."""
    plan, mesh = self.plan, self.mesh
    manual = set(plan.batch_axes)
    flat_l, treedef = jax.tree.flatten(layouts, is_leaf=_is_leaf)
    axis, size = plan.shard_axis, mesh.shape[plan.shard_axis]

    def body(*xs):
      idx = [j for j, lay in enumerate(flat_l) if lay.dim is not None]
      full = _all_gather([xs[j] for j in idx], [flat_l[j] for j in idx], axis, size, to="invarying")
      out = list(xs)
      for j, f in zip(idx, full, strict=True):
        out[j] = f
      return tuple(out)

    out = jax.shard_map(
      body,
      mesh=mesh,
      axis_names=manual,
      in_specs=tuple(_manual_spec(lay.opt_spec, manual) for lay in flat_l),
      out_specs=tuple(_manual_spec(lay.param_spec, manual) for lay in flat_l),
    )(*jax.tree.leaves(pieces))
    return jax.tree.unflatten(treedef, out)

  def _grads(self, layouts, params, batch, key):
    """Inside the shard_map: (sharded weighted mean gradient, metrics). See the module docstring."""
    plan, k = self.plan, self.k
    axes = plan.batch_axes
    flat_l, treedef = jax.tree.flatten(layouts, is_leaf=_is_leaf)
    sharded_idx = [j for j, lay in enumerate(flat_l) if lay.dim is not None]
    axis = plan.shard_axis
    size = self.mesh.shape[axis] if axis is not None else 1
    wire = self.comm_dtype

    def gather(p):
      xs = jax.tree.leaves(p)
      if not plan.params_sharded or not sharded_idx:
        return p
      full = _all_gather([xs[j] for j in sharded_idx], [flat_l[j] for j in sharded_idx], axis, size, to="varying")
      xs = list(xs)
      for j, f in zip(sharded_idx, full, strict=True):
        xs[j] = f
      return jax.tree.unflatten(treedef, xs)

    def scatter(acc):
      """Reduce-scatter the data-sharded leaves of a full-size accumulator (replicated ones stay)."""
      xs = list(acc)
      if axis is None or not sharded_idx:
        return xs
      blocks = _reduce_scatter([xs[j] for j in sharded_idx], [flat_l[j] for j in sharded_idx], axis, size, wire)
      for j, b in zip(sharded_idx, blocks, strict=True):
        xs[j] = b
      return xs

    if key is not None:
      key = jax.random.fold_in(key, lax.axis_index(axes if len(axes) > 1 else axes[0]))
    grad_fn = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)
    full_params = gather(params) if not self.lean else None
    # The dtype weights are summed in (float32 at least, float64 with float64 parameters).
    wdtype = _tree.widest([_tree.accumulator_dtype(x.dtype) for x in jax.tree.leaves(params)])

    def one(mb, i):
      """Microbatch i: (weighted gradient leaves, local or scattered; w; w * value)."""
      if full_params is not None:
        p = full_params
      else:
        # Tie the shards to the loop index, so that XLA cannot hoist the gather out of
        # the loop (it would, as loop-invariant code) and keep a full copy across it.
        p, _ = lax.optimization_barrier((params, i))
        p = gather(p)
      p = jax.tree.map(lambda x: _vary(x, axes), p)
      args = (p, mb) if key is None else (p, mb, jax.random.fold_in(key, i))
      value, g = grad_fn(*args)
      w = jnp.ones((), jnp.float32) if self.weight_fn is None else jnp.asarray(self.weight_fn(mb))
      if w.shape != ():
        raise ValueError(f"weight_fn must return a scalar, got shape {w.shape}")
      w = _vary(w, axes)
      # A negative or non-finite weight makes the total NaN: the step is skipped (as
      # make_train_step does), so no wrongly weighted gradient reaches the parameters.
      w_total = jnp.where(jnp.isfinite(w) & (w >= 0), w.astype(wdtype), jnp.full((), jnp.nan, wdtype))

      def weigh(x):
        dtype = _tree.accumulator_dtype(x.dtype)
        # Exactly 0 where w == 0: an all-padding microbatch (NaN loss) adds nothing.
        return jnp.where(w == 0, jnp.zeros((), dtype), x.astype(dtype) * w.astype(dtype))

      g = [weigh(x) for x in jax.tree.leaves(g)]
      if self.lean:
        g = scatter(g)
      value = jax.tree.map(lambda v: _vary(weigh(v), axes), value)
      return g, w_total, value

    size_b = jnp.shape(jax.tree.leaves(batch)[0])[0]
    if k == 1:
      acc, wsum, vsum = one(batch, 0)
    else:
      views = jax.tree.map(lambda x: jnp.reshape(x, (size_b // k, k) + jnp.shape(x)[1:]), batch)

      def take(i):
        return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), views)

      shapes = jax.eval_shape(lambda: one(take(0), 0))
      # With Explicit axes the zeros carry the gradients' sharding type (e.g. over "model").
      zeros = jax.tree.map(lambda s: _vary(jnp.zeros(s.shape, s.dtype, out_sharding=_typed(s)), axes), shapes)

      def body(carry, i):
        g, w, v = one(take(i), i)
        acc, wsum, vsum = carry
        acc = [a + b for a, b in zip(acc, g, strict=True)]
        wsum = wsum + w
        vsum = jax.tree.map(jnp.add, vsum, v)
        return (acc, wsum, vsum), None

      (acc, wsum, vsum), _ = lax.scan(body, zeros, jnp.arange(k))
    if not self.lean:
      acc = scatter(acc)

    # The small sums (scalars and leaves replicated over the shard axis) and the sharded
    # gradient blocks; hsdp all-reduces across replicas once, everything in one instruction.
    # Gradient leaves go on the wire in comm_dtype; the weight and loss sums stay wide.
    small_idx = [j for j in range(len(acc)) if j not in sharded_idx or axis is None]
    on_wire = lambda xs: [x.astype(wire) if wire is not None else x for x in xs]
    small = (on_wire([acc[j] for j in small_idx]), wsum, vsum)
    blocks = [acc[j] for j in sharded_idx] if axis is not None else []
    if plan.replica_axis is None:
      small = lax.psum(small, axes if len(axes) > 1 else axes[0])
    else:
      small = lax.psum(small, axis)
      small, sent = lax.psum((small, on_wire(blocks)), plan.replica_axis)
      blocks = [s.astype(b.dtype) for s, b in zip(sent, blocks, strict=True)]
    small_leaves, total, vtotal = small
    out = list(acc)
    for j, x in zip(small_idx, small_leaves, strict=True):
      out[j] = x.astype(acc[j].dtype)
    for j, b in zip(sharded_idx if axis is not None else [], blocks, strict=True):
      out[j] = b
    grads = jax.tree.unflatten(treedef, [(x / total.astype(x.dtype)) for x in out])

    def mean(v):
      t = total.astype(v.dtype)
      return jnp.where(t == 0, jnp.zeros((), v.dtype), v / t)

    value = jax.tree.map(mean, vtotal)
    if self.has_aux:
      loss, aux = value
      metrics = {"loss": loss, "aux": aux, "weight": total}
    else:
      metrics = {"loss": value, "weight": total}
    return grads, metrics
