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
  layer by layer (`jaxaccum._layerwise`): in every microbatch each parameter
  is all-gathered where the loss uses it, freed, all-gathered again for its
  backward equation, and its gradient reduce-scattered into the 1/P
  accumulator as soon as it exists: per layer K forward gathers, up to K
  backward re-gathers and K reduce-scatters per step, and a device holds at
  most one gathered layer (or its gradient) beside its shards. With
  `grad_norms` or `noise_scale` the whole tree is gathered per microbatch
  (they measure each device's whole gradient). `fsdp_gather="once"`
  (comm-lean): one all-gather per step, a local full-size accumulator, one
  reduce-scatter after the loop: 1 + 1 collectives instead of K + K, at the
  cost of one full parameter copy and one full (float32 or wider) accumulator
  per device for the whole step.
- `"hsdp"`: `data_axis=(replica_axis, shard_axis)`: fsdp within each group of
  `shard_axis`, replicated over `replica_axis`; the cross-replica all-reduce of
  the (sharded) gradient runs once per step whatever K.

How the step is built: `jaxaccum._engine` (the one engine of
`ja.make_train_step`) takes the plan and the layouts from here, and the
packed collectives below. The gradient part runs under a `jax.shard_map` that
is manual over the data axes only (other mesh axes, e.g. "model", stay with
the partitioner and keep the shardings the user gave the parameters); the
optimizer then runs outside it, under `jit`, on the globally shaped gradient,
optimizer state and parameter slice, all laid out per the plan: an
elementwise optimizer touches only local data, and one whose update needs a
global quantity (lamb's trust ratio, `clip_by_global_norm`) gets it from
scalar all-reduces the partitioner inserts.

Collectives are packed: the leaves sharded over the data axis are laid out in
one flat buffer per dtype, so a step has one reduce-scatter and one all-gather
instruction (per dtype) however many leaves the model has. Leaves that another
mesh axis also shards join it as their local blocks, in one map manual over
those axes (`_model_blocks`); leaves with
no dimension divisible by the axis size stay replicated and join the scalar
all-reduce.

Layout rule (`ja.shard_train_state`): a leaf is sharded on its largest
dimension divisible by the data axis size that no other mesh axis already
shards; otherwise it is replicated over the data axis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
      raise ValueError(
        f"{data_axis=} names {a!r}, which is not an axis of the mesh (its axes: {mesh.axis_names}): pass the mesh's "
        f"data axis as data_axis=... to make_train_step, shard_train_state and shard_batch alike"
        + (f" (here data_axis={mesh.axis_names[0]!r})" if len(mesh.axis_names) == 1 else "")
      )
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
  other: bool  # another mesh axis shards the leaf too (packed as its local blocks, `_model_blocks`)
  ndim: int = 0  # the leaf's number of dimensions


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
  if not isinstance(a, Mesh):  # an AbstractMesh (a sharding from `jax.eval_shape` on Explicit axes): no devices
    return tuple(a.shape_tuple) == tuple(b.shape_tuple)
  return (
    tuple(a.axis_names) == tuple(b.axis_names)
    and a.devices.shape == b.devices.shape
    and [d.id for d in a.devices.flat] == [d.id for d in b.devices.flat]
  )


def given_spec(x, mesh: Mesh):
  """The entries (one per dimension) of the sharding `x` was given on `mesh`, or what else is known of it.

  A concrete array tells its sharding; a traced one (inside an outer `jax.jit`)
  tells it in its type over Explicit axes only. On an Auto mesh a tracer's
  layout is the partitioner's business: None, and the step leaves the
  dimensions no data axis takes unconstrained. Otherwise: "one device" (a host
  value or an array on one device: not placed on the mesh yet), "other mesh"
  or "not named" (sharded over several devices, not by a NamedSharding).
  """
  if isinstance(x, jax.core.Tracer):
    aval = jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(t == AxisType.Explicit for t in mesh.axis_types):
      return None
    return tuple(_entries(spec, aval.ndim))
  sharding = _sharding_of(x)
  if isinstance(sharding, NamedSharding) and _same_mesh(sharding.mesh, mesh):
    return tuple(_entries(sharding.spec, len(np.shape(x))))
  if isinstance(sharding, NamedSharding) and not isinstance(sharding.mesh, Mesh):
    return "other mesh"  # an abstract mesh of other axes or sizes
  if sharding is None or len(sharding.device_set) == 1:
    return "one device"
  return "other mesh" if isinstance(sharding, NamedSharding) else "not named"


_PLACE = (
  "Place parameters and optimizer state with ja.shard_train_state(params, optimizer, mesh, strategy=...), "
  "which lays out parameters placed in any way (or on one device) for the strategy."
)


def _leaf_layout(path, x, mesh: Mesh, plan: _Plan, *, placed: bool, given: Any = "read") -> _Leaf:
  """The layout of one parameter leaf, checked against what the user gave.

  One rule for every strategy. `placed=False` (`ja.shard_train_state`, the
  placement call): a leaf may be anywhere (host, one device, another layout
  over the data axes, another mesh) and is re-laid in the strategy's layout,
  keeping its sharding over the other axes of this mesh. `placed=True` (a
  step): a leaf on one device (or a host value) is re-laid by the step, as
  `jax.jit` places an argument; a leaf placed over several devices must be
  laid out over the data axes exactly as `ja.shard_train_state` lays it (a
  silent reshard would cost a collective on every step), else a ValueError
  naming the leaf, its layout and the one expected, the same for every
  strategy. `given`: the leaf's entries (`given_spec`), None when unknown
  (dimensions not taken by a data axis are then left unconstrained).
  """
  where = f"params{jax.tree_util.keystr(path)}"
  shape = tuple(np.shape(x))
  if given == "read":
    given = given_spec(x, mesh)
  if placed and given in ("other mesh", "not named"):
    what = (
      f"placed on another mesh ({_sharding_of(x).mesh})" if given == "other mesh" else "not placed by a NamedSharding"
    )
    raise ValueError(
      f"{where} is {what}, not laid out on mesh={mesh} for strategy={plan.strategy!r} (sharding "
      f"{_sharding_of(x)}). {_PLACE}"
    )
  check = placed and isinstance(given, tuple)  # a step given a leaf placed on the mesh
  if isinstance(given, str):  # one device, or (shard_train_state) anywhere else: laid out from scratch
    given = (None,) * len(shape)
  unknown = given is None
  if unknown:
    given = (None,) * len(shape)
  data = set(plan.batch_axes)
  base = []
  for entry in given:
    names = _names(entry)
    if any(n in data for n in names) and len(names) > 1:
      raise ValueError(
        f"{where} has sharding spec {_spec(list(given))}: one dimension split over a data axis and another "
        f"axis together, which strategy={plan.strategy!r} does not handle"
      )
    base.append(None if any(n in data for n in names) else entry)
  opt, dim = _layout(shape, base, mesh, plan.shard_axis)
  param = opt if plan.params_sharded else list(base)
  if check and list(given) != param:
    rule = (
      "its largest dimension not sharded otherwise and divisible by the data axis size, if any"
      if plan.params_sharded
      else "parameters stay replicated over the data axes"
    )
    raise ValueError(
      f"{where} has sharding spec {_spec(list(given))}, which conflicts with strategy={plan.strategy!r} "
      f"over data axes {plan.batch_axes}: it expects {_spec(param)} ({rule}). {_PLACE}"
    )
  other = any(e is not None for e in base)
  if unknown:  # inside an outer jit on an Auto mesh: the partitioner keeps what it was given on other axes
    opt = [e if e is not None or d == dim else PartitionSpec.UNCONSTRAINED for d, e in enumerate(opt)]
    param = [
      e if e is not None or (plan.params_sharded and d == dim) else PartitionSpec.UNCONSTRAINED
      for d, e in enumerate(param)
    ]
  return _Leaf(_spec(param), _spec(opt), dim, other, len(shape))


def _layouts(params, mesh, plan, *, placed, given=None):
  """Every leaf's `_Leaf`; `given`: a tree of `given_spec`s (default: read from the leaves)."""
  if given is None:
    return jax.tree_util.tree_map_with_path(lambda p, x: _leaf_layout(p, x, mesh, plan, placed=placed), params)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  flat = [_leaf_layout(p, x, mesh, plan, placed=placed, given=g) for (p, x), g in zip(leaves, given, strict=True)]
  return jax.tree.unflatten(jax.tree.structure(params), flat)


def _is_leaf(x):
  return isinstance(x, _Leaf)


def _place(x, mesh: Mesh, spec: PartitionSpec):
  """Lays `x` out as `spec` inside jit: `reshard` over Explicit axes, a sharding constraint over Auto ones."""
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  entries = _entries(spec, np.ndim(x))

  def keep(kind):
    # UNCONSTRAINED (a layout not known inside an outer jit on an Auto mesh) stays so for the partitioner.
    return _spec(
      [
        (e if kind == AxisType.Auto else None)
        if e is PartitionSpec.UNCONSTRAINED
        else tuple(n for n in _names(e) if types[n] == kind) or None
        for e in entries
      ]
    )

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


def _path_key(path) -> tuple:
  return tuple(jax.tree_util.keystr((k,)) for k in path)


def state_specs(state_shape, params_shape, layouts, mesh: Mesh, plan: _Plan):
  """The sharding spec of every optimizer-state leaf, from shapes and the parameters' layouts.

  A state leaf that stands for a parameter (optax nests the parameter tree in
  its states: `mu[1]['w']`, `inner_states['a'].inner_state[0].nu[1]['w']`) is
  found by the longest parameter path that ends its own path with the same
  shape, and follows that parameter's layout (its other-axes sharding, the
  shard axis on the same dimension). Any other leaf (counts, factored or
  reduced statistics, masked-out entries) gets the layout rule on its own
  shape. No optax structure is assumed, so masked states (`optax.masked`,
  `multi_transform` with `set_to_zero`), chains, factored states, muon and
  `inject_hyperparams` all work.
  """
  by_path = {}
  for (path, p), lay in zip(
    jax.tree_util.tree_leaves_with_path(params_shape), jax.tree.leaves(layouts, is_leaf=_is_leaf), strict=True
  ):
    by_path[_path_key(path)] = (tuple(p.shape), lay)

  def spec(path, s):
    key = _path_key(path)
    for n in range(len(key), 0, -1):
      hit = by_path.get(key[-n:])
      if hit is not None and hit[0] == tuple(s.shape):
        return hit[1].opt_spec
    return _spec(_layout(s.shape, [None] * len(s.shape), mesh, plan.shard_axis)[0])

  return jax.tree_util.tree_map_with_path(spec, state_shape)


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
  mesh axes (e.g. "model") are kept. With $P$ devices on the shard axis, $N$
  parameter bytes and $S$ optimizer-state bytes (adam: $S = 2N$ in the
  parameters' dtype), one device holds

  $$ \\text{ddp}: N + S, \\quad \\text{zero1}: N + S/P, \\quad
     \\text{fsdp}: (N + S)/P, \\quad \\text{hsdp}: (N + S)/P_\\text{shard} $$

  (up to the leaves no dimension of which the axis size divides: those stay
  replicated).

  Parameters may come placed in any way: host values, on one device,
  replicated, sharded over the data axes by hand or in another strategy's
  layout, on another mesh; they are re-laid in this strategy's layout (the
  same rule for every strategy). A step then takes them as they are, or
  re-lays parameters given on one device; parameters placed on the mesh in
  another layout it refuses (see `make_train_step`).

  Nothing is ever materialised in full on one device: the parameters go
  straight to their shards, and the optimizer state is created by a jitted
  `optimizer.init` whose outputs are laid out sharded (for zero1 it runs on
  each device's slice of the replicated parameters).

  Abstract parameters ("will it fit?" before anything is allocated): given
  `jax.ShapeDtypeStruct`s (any leaf of `params` one; a sharding they carry on
  `mesh`'s other axes is kept), it allocates nothing and returns the layout as
  `jax.ShapeDtypeStruct`s, each with its `NamedSharding` on `mesh`: the shapes,
  dtypes and shardings the concrete call gives, ready for
  `step.lower(params, opt_state, batch)` and `ja.plan_microbatches`::

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    params_s, opt_state_s = ja.shard_train_state(abstract, opt, mesh, strategy="fsdp")

  Under a trace (`jax.eval_shape`, `jax.jit`) it lays the traced values out
  with sharding constraints (`reshard` over Explicit axes) instead of
  placing them, on Auto and Explicit meshes alike. `jax.eval_shape` then
  reports the layout in the types over Explicit axes (shardings on the
  mesh's `AbstractMesh`); over Auto axes the types carry no sharding, so
  `jax.eval_shape` reports none: pass `jax.ShapeDtypeStruct`s instead. Inside
  a trace on an Auto mesh a parameter's sharding over other axes is not
  known and is left to the partitioner.

  Args:
    params: the parameter pytree (host or device arrays, or
      `jax.ShapeDtypeStruct`s; shardings over non-data mesh axes are kept).
    optimizer: an optax transformation.
    mesh: a mesh holding the data axis (axes).
    strategy: "ddp", "zero1", "fsdp" or "hsdp".
    data_axis: the data axis name; for hsdp `(replica_axis, shard_axis)`.

  Returns:
    `(params, opt_state)`, ready for a step made with the same strategy. The
    returned arrays never share buffers with `params` (steps donate them).
    For abstract `params`: the same trees of `jax.ShapeDtypeStruct`s with
    their shardings (nothing allocated, nothing compiled).
  """
  optimizer = _tree.check_optimizer(optimizer, "optimizer")
  leaves = jax.tree_util.tree_leaves_with_path(params)
  for path, leaf in leaves:
    # A whole training state (e.g. flax's TrainState, with its int step) is the common slip.
    if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)):
      raise TypeError(
        f"params{jax.tree_util.keystr(path)} is {type(leaf).__name__} "
        f"{getattr(leaf, 'dtype', '')}: shard_train_state takes the parameters alone (float arrays), e.g. "
        "state.params of a Flax TrainState, not the whole state"
      )
  plan = _make_plan(strategy, mesh, data_axis)
  layouts = _layouts(params, mesh, plan, placed=False)
  param_specs = jax.tree.map(lambda lay: lay.param_spec, layouts, is_leaf=_is_leaf)
  opt_specs = jax.tree.map(lambda lay: lay.opt_spec, layouts, is_leaf=_is_leaf)
  params_shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _tree.dtype_of(x)), params)
  state_shape = jax.eval_shape(optimizer.init, params_shape)
  specs = state_specs(state_shape, params_shape, layouts, mesh, plan)
  is_spec = lambda x: isinstance(x, PartitionSpec)
  place = lambda tree, specs: jax.tree.map(lambda x, s: _place(x, mesh, s), tree, specs, is_leaf=is_spec)

  def init(p):
    # A copy, so that a donating step never deletes the caller's buffers.
    p = jax.tree.map(jnp.copy, p)
    return p, place(optimizer.init(place(p, opt_specs)), specs)

  if any(isinstance(x, jax.ShapeDtypeStruct) for _, x in leaves):
    # Abstract: the layout alone, as the concrete call's outputs would be typed (nothing allocated).
    typed = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
    return (
      jax.tree.map(typed, params_shape, param_specs, is_leaf=is_spec),
      jax.tree.map(typed, state_shape, specs, is_leaf=is_spec),
    )
  if any(isinstance(x, jax.core.Tracer) for _, x in leaves):
    # Under a trace (jax.eval_shape, an outer jit): constraints in place of placement; a layout not
    # known on an Auto mesh (UNCONSTRAINED entries) stays the partitioner's.
    return init(place(params, param_specs))
  param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs, is_leaf=is_spec)
  state_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
  placed = jax.tree.map(_put, params, param_sh)
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


def _free_explicit() -> set:
  """The Explicit axes of the context mesh (those the enclosing map leaves free)."""
  mesh = jax.sharding.get_abstract_mesh()
  return (
    set()
    if mesh.empty
    else {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit}
  )


def _pin(x, leaf, manual):
  """Inside the per-device map: `x` (a leaf's gradient, local block or full) laid out over the Auto axes the map
  leaves free as the leaf's parameter is (`leaf.param_spec` less the `manual` axes).

  A parameter's gradient left open there is the partitioner's choice: on a (data, model) mesh it may keep
  a replicated norm scale's gradient split over "model" across the reduction and the update, then gather it
  (one all-gather per leaf per step, or per microbatch), or split a "model"-sharded one another way. The plain
  `jit` step gets the layout its update wants from its outputs; this gives the map's gradients the same
  one. Explicit axes need nothing: the gradient's type already says it; UNCONSTRAINED (a layout unknown
  inside an outer jit) stays open.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  auto = {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Auto and n not in manual}
  if not auto:
    return x
  entries = [
    e if e is PartitionSpec.UNCONSTRAINED else tuple(n for n in _names(e) if n in auto) or None
    for e in _entries(leaf.param_spec, np.ndim(x))
  ]
  return lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*entries)))


def _auto_other(fn, leaf, axis, *, every_explicit: bool = False):
  """`fn` (a collective over the manual `axis`) on a leaf that other mesh axes (e.g. "model") also shard.

  Run inside a `jax.shard_map` manual over those axes too, on each device's
  model block: the data-axis collective then moves only the block (left to
  the partitioner, it replicates the operand over "model" first and sends
  twice the bytes), and JAX's collectives, which take no operand typed as
  sharded over other Explicit axes, see a plain local array.
  `every_explicit` (a reduce-scatter): manual over every free Explicit axis as
  well (no data moves for those the leaf is replicated over): JAX 0.11 and
  0.12 lower `psum_scatter` only where no mesh axis is Explicit.
  """
  entries = [None if axis in _names(e) or e is PartitionSpec.UNCONSTRAINED else e for e in leaf.param_spec]
  others = {n for e in entries for n in _names(e)}
  if every_explicit:
    others |= _free_explicit()
  if not others:
    return fn
  spec = _spec(entries)
  # Typed as the enclosing shard_map types (the step's is untyped): mixed, the types disagree.
  check = parallel.vma_tracking(axis)
  mesh = jax.sharding.get_abstract_mesh()
  return jax.shard_map(fn, mesh=mesh, axis_names=others, in_specs=spec, out_specs=spec, check_vma=check)


def _model_blocks(fn, leaves, axis, xs):
  """`fn(local xs) -> local outs` run on each device's model blocks: one `jax.shard_map` for every leaf together.

  Manual over every mesh axis other than the data axis that some leaf is sharded over (and every free
  Explicit one, see `_auto_other`), each leaf with its own spec over them: inside, a leaf that "model"
  shards is its local block and a replicated one is whole, both plain local arrays, so one packed buffer
  (one collective per dtype) carries them all, as it does with no model axis. Before, each such leaf had
  its own map and its own collective (17 all-gathers per step for the MaxText layer port's fsdp "once").
  With no such axis, `fn` runs as it is.
  """
  specs, others = [], set()
  for leaf in leaves:
    entries = [None if axis in _names(e) or e is PartitionSpec.UNCONSTRAINED else e for e in leaf.param_spec]
    others |= {n for e in entries for n in _names(e)}
    specs.append(_spec(entries))
  if not others:
    return fn(list(xs), None)
  names = others | _free_explicit()
  check = parallel.vma_tracking(axis)
  # Typed (the zero1 gather's map): a buffer mixing blocks that vary over "model" with whole leaves would make
  # those vary too, so each set of axes gets its own buffer; untyped (the step's map), one buffer.
  kinds = [frozenset(n for e in spec for n in _names(e)) if check else None for spec in specs]
  mesh = jax.sharding.get_abstract_mesh()
  body = lambda *ys: tuple(fn(list(ys), kinds))
  mapped = jax.shard_map(
    body, mesh=mesh, axis_names=names, in_specs=tuple(specs), out_specs=tuple(specs), check_vma=check
  )
  return list(mapped(*xs))


def _reduce_scatter(xs, leaves, axis, size, wire):
  """Sum over `axis`, each device keeping its block of dimension `leaf.dim`: one instruction per dtype.

  `xs`: local full-size arrays (one per leaf with a dim); returns the local blocks
  in each x's own dtype. `wire`: the dtype sent (None: each x's own). Leaves that
  another mesh axis shards are packed with the rest (`_model_blocks`).
  """
  if any(leaf.other for leaf in leaves):
    rs = lambda ys, kinds: _packed_reduce_scatter(ys, leaves, axis, size, wire, free=False, kinds=kinds)
    return _model_blocks(rs, leaves, axis, xs)
  return _packed_reduce_scatter(xs, leaves, axis, size, wire, free=True)


def _packed_reduce_scatter(xs, leaves, axis, size, wire, *, free: bool, kinds=None):
  out: list[Any] = [None] * len(xs)
  packable = [(j, jnp.dtype(wire) if wire is not None else x.dtype) for j, x in enumerate(xs)]
  for group in _groups(packable, key=lambda jw: (jw[1], None if kinds is None else kinds[jw[0]])):
    # Row p of the buffer holds block p of every leaf (dim moved to the front and flattened).
    rows = [jnp.moveaxis(xs[j], leaves[j].dim, 0).astype(w).reshape(size, -1) for j, w in group]
    scatter = lambda buf: lax.psum_scatter(buf, axis, scatter_dimension=0, tiled=False)
    if free and (names := _free_explicit()):  # see `_auto_other`: the buffer is replicated over them, nothing moves
      mesh = jax.sharding.get_abstract_mesh()
      check = parallel.vma_tracking(axis)
      scatter = jax.shard_map(
        scatter, mesh=mesh, axis_names=names, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=check
      )
    mine = scatter(jnp.concatenate(rows, axis=1))
    for (j, _), piece in zip(group, _pieces(mine, 0, [row.shape[1] for row in rows]), strict=True):
      x, dim = xs[j], leaves[j].dim
      piece = piece.reshape((x.shape[dim] // size,) + tuple(np.delete(x.shape, dim)))
      out[j] = jnp.moveaxis(piece, 0, dim).astype(x.dtype)
  return out


def _all_gather(xs, leaves, axis, size, to):
  """Inverse of `_reduce_scatter`'s layout: local blocks -> full arrays, one instruction per dtype (leaves that
  another mesh axis shards packed with the rest, `_model_blocks`)."""
  if any(leaf.other for leaf in leaves):
    return _model_blocks(lambda ys, kinds: _packed_all_gather(ys, leaves, axis, size, to, kinds), leaves, axis, xs)
  return _packed_all_gather(xs, leaves, axis, size, to)


def _packed_all_gather(xs, leaves, axis, size, to, kinds=None):
  out: list[Any] = [None] * len(xs)
  for group in _groups(range(len(xs)), key=lambda j: (xs[j].dtype, None if kinds is None else kinds[j])):
    flats = [jnp.moveaxis(xs[j], leaves[j].dim, 0).reshape(-1) for j in group]
    full = lax.all_gather(jnp.concatenate(flats), axis, axis=0, tiled=False, to=to)
    for j, piece in zip(group, _pieces(full, 1, [flat.size for flat in flats]), strict=True):
      x, dim = xs[j], leaves[j].dim
      piece = piece.reshape((size * x.shape[dim],) + tuple(np.delete(x.shape, dim)))
      out[j] = jnp.moveaxis(piece, 0, dim)
  return out


def _pieces(buf, axis: int, sizes: list[int]) -> list:
  """`buf` cut along `axis` into consecutive pieces of `sizes` (a packed collective's buffer, leaf by leaf).

  On CPU each piece is a `dynamic_slice` at an offset XLA cannot fold (the
  offsets pass through one `optimization_barrier`): the kernels that read a
  piece (the slice, fused into its consumer) are then the same code for every
  leaf of the same shape, and XLA:CPU compiles each distinct kernel once. With
  static slices every piece's kernel differs by its offset, and compiling one
  kernel per leaf made fsdp "once" compile 1.4-1.8x the plain step on a
  32-layer transformer (194 leaves, twice: the gather and the scatter).
  Elsewhere (GPU, TPU), and for a buffer past int32 offsets, static slices.
  """
  starts = [int(s) for s in np.cumsum([0, *sizes])[:-1]]
  if len(sizes) < 2 or jax.default_backend() != "cpu" or buf.shape[axis] > np.iinfo(np.int32).max:
    return [lax.slice_in_dim(buf, s, s + n, axis=axis) for s, n in zip(starts, sizes, strict=True)]
  offsets = lax.optimization_barrier(tuple(jnp.asarray(s, jnp.int32) for s in starts))
  vma = tuple(sorted(parallel._varying_axes(buf) or ()))
  if vma:  # typed (the zero1 gather's map): the offsets vary as the buffer does
    offsets = tuple(lax.pcast(o, vma, to="varying") for o in offsets)
  return [lax.dynamic_slice_in_dim(buf, o, n, axis=axis) for o, n in zip(offsets, sizes, strict=True)]
