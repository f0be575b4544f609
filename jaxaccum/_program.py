"""The user's loss, traced once: every check reads this jaxpr, and the per-device map evaluates it localised.

`make_train_step` and `ja.grad` on a mesh run the loss on each device's own
rows inside a `jax.shard_map` manual over the data axes. Model code written for
the global batch names those axes in sharding annotations
(`with_sharding_constraint(h, NamedSharding(mesh, P("data", ...)))`, Flax's
`nn.with_logical_constraint` under rules mapping "batch" to "data", the
cookbook's `out_sharding=P("data", ...)` and `jax.sharding.reshard`). JAX refuses
a manual axis in an annotation in its Python API, before anything is staged, so
such code cannot be traced inside the map. It can be traced outside it:

1. `trace` traces the loss ONCE with `jax.make_jaxpr`, on the shapes one
   device's microbatch has, under the mesh the user's own jit would see (on
   Explicit meshes with every data axis of size 1, so that an annotation naming
   it divides the local rows; Auto meshes check no divisibility at trace time).
   Every check (`refusal`) reads that jaxpr: the user's code is never traced
   again, so a module-level `@jax.shard_map` layer (whose wrapper keeps the
   context mesh of its first call) sees one trace. jnp's own functions stay
   `jit` equations in it (JAX would inline them while tracing:
   `_jax_private.jnp_calls_kept`): one called at the same shapes in every layer
   is one shared jaxpr, so the map's gradient reuses JAX's cached linearization
   of it as the user's own `jax.grad` does, instead of differentiating every
   layer equation by equation (the trace time of deep listed models).
2. `Program.__call__`, inside the per-device map, rewrites the jaxpr once per
   trace of the step (`_Localiser`), structurally: every mesh, sharding and
   PartitionSpec in the equations' parameters (sharding constraints, reshards,
   `out_sharding=`, jit's shardings and context mesh, a nested shard_map's mesh
   and specs), every aval's sharding and every equation's context mesh, in
   every nested jaxpr, is mapped to the mesh as seen inside the map (data axes
   Manual) with the data axes dropped from the specs and the other axes (e.g.
   "model") kept. Inside the map the data axes are already split, so dropping
   them keeps the model's meaning. The result is evaluated by JAX's own
   `jax.core.eval_jaxpr`: every equation is bound exactly as JAX binds it.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jaxaccum import _jax_private

# Parameters that name axes made manual (shard_map); collectives' axes (psum's "axes", all_gather's "axis_name").
_MANUAL_PARAMS = ("newly_manual_axes", "manual_axes")
_AXIS_PARAMS = ("axes", "axis_name")
# A custom derivative's rule, traced by JAX when it differentiates: custom_jvp's jvp, custom_vjp's fwd.
_RULE_THUNKS = ("jvp_jaxpr_fun", "fwd_jaxpr_thunk")
# The primal of a custom_vjp(optimize_remat=True), a thunk in its fwd's `remat_opt` equation (JAX 0.10-0.12).
_PRIMAL_THUNK = "fun_jaxpr_thunk"


_EMPTY = jax.sharding.AbstractMesh((), ())


class Program:
  """`fn` traced once at per-device shapes: call it inside the per-device map on arguments of those shapes.

  Attributes:
    closed: the traced `ClosedJaxpr` (what every check reads).
    data_axes: the mesh axes the per-device map makes manual.
    at: the mesh it was traced under (`trace_mesh`); None for a step on one device (no mesh).
  """

  def __init__(self, closed, in_tree, out_tree, data_axes, at):
    self.closed, self.in_tree, self.out_tree, self.data_axes = closed, in_tree, out_tree, tuple(data_axes)
    self.at = at  # the mesh it was traced under
    self._cache: dict = {}

  def __call__(self, *args):
    leaves, tree = jax.tree.flatten(args)
    if tree != self.in_tree:
      raise ValueError(f"the loss was traced for arguments {self.in_tree}, called with {tree}")
    inside = jax.sharding.get_abstract_mesh()
    closed = self._cache.get(inside) if self.at is not None else self.closed  # no mesh: nothing to localise
    if closed is None:
      closed = self._cache[inside] = localise(self.closed, inside, self.data_axes, self.at)
    out = jex_core.jaxpr_as_fun(closed)(*leaves)
    # An output that is a constant of the trace (eqx's `state.set(..., jnp.array(False))`) is a Literal, which
    # evaluates to its Python value: give it back as the array the user's code returned.
    out = [
      o if isinstance(o, (jax.Array, jax.core.Tracer)) else jax.numpy.asarray(o, v.aval.dtype)
      for o, v in zip(out, closed.jaxpr.outvars, strict=True)
    ]
    return jax.tree.unflatten(self.out_tree, out)


def trace_mesh(mesh, data_axes):
  """The abstract mesh the loss is traced under: the step's, with every data axis of size 1 if any is Explicit."""
  abstract = mesh.abstract_mesh
  types = dict(zip(abstract.axis_names, abstract.axis_types, strict=True))
  if not any(types[a] == AxisType.Explicit for a in data_axes):
    return abstract
  sizes = tuple(1 if n in data_axes else s for n, s in zip(abstract.axis_names, abstract.axis_sizes, strict=True))
  return abstract.update(axis_sizes=sizes)


def trace(fn, args, *, mesh, data_axes, batch_argnums=(), row_axis=None, entry: str = "make_train_step") -> Program:
  """`fn` traced once on abstract `args` (one device's shapes) under `trace_mesh(mesh, data_axes)`.

  Args:
    fn: the user's loss.
    args: its arguments as one device sees them (arrays or ShapeDtypeStructs;
      only shapes and dtypes are read).
    mesh: the step's mesh; None for a step on one device.
    data_axes: the axes the per-device map makes manual.
    batch_argnums: arguments whose leaves are rows split over the data axes
      (on Explicit meshes typed over `row_axis` on their leading dimension; the
      others keep their non-data axes).
    row_axis: the data axis the rows are split over (default: the one data
      axis; with several, none: the rows are typed unsharded). ja.grad names
      its `axis_name` (its data axes are every mesh axis, the others of size 1).
    entry: the entry point, for the messages.

  Raises:
    ValueError: a nested `jax.shard_map` that cannot be traced on one
      device's rows (`explain_trace_error`); JAX's own error otherwise.
  """
  data_axes = tuple(data_axes)
  at = _EMPTY if mesh is None else trace_mesh(mesh, data_axes)
  explicit = mesh is not None and any(t == AxisType.Explicit for t in at.axis_types)
  rows = row_axis if row_axis is not None else data_axes[0] if len(data_axes) == 1 else None

  def aval(x, batch):
    x = x if hasattr(x, "dtype") else jax.numpy.asarray(x)  # a Python scalar in the state, say
    shape, dtype = np.shape(x), x.dtype
    if not explicit:
      return jax.ShapeDtypeStruct(shape, dtype)
    # One data axis: the rows are typed as the step lays them out (split over it on their leading dimension,
    # here of size 1), so an annotation asserting that layout (Explicit-mesh `with_sharding_constraint(h,
    # P("data", ...))`, which JAX checks against the type) holds as in the user's own jit. Several (hsdp's
    # ("replica", "data")): typed unsharded, the same layout on size-1 axes, so that a model annotated for one
    # data axis (reshard to P("data")) meets its rows without a type conflict.
    spec = (PartitionSpec(rows) if rows and len(shape) else PartitionSpec()) if batch else _typed_spec(x, data_axes)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(at, spec))

  avals = tuple(jax.tree.map(lambda x, b=i in batch_argnums: aval(x, b), a) for i, a in enumerate(args))
  leaves, in_tree = jax.tree.flatten(avals)
  out_tree = []

  def flat(*xs):
    out = fn(*jax.tree.unflatten(in_tree, xs))
    outs, tree = jax.tree.flatten(out)
    out_tree.append(tree)
    return outs

  if mesh is None:
    # A step on one device (no mesh): the loss traced once, as the user's own jit traces it (no mesh entered,
    # nothing localised), and evaluated as traced; its checks read this trace, as on a mesh.
    closed = jax.make_jaxpr(_jax_private.jnp_calls_kept(flat))(*leaves)
    return Program(closed, in_tree, out_tree[0], (), None)

  step_mesh = mesh.abstract_mesh

  def retype(a):
    """An array the loss closes over, typed on the step's mesh and replicated over the data axes (a table
    put with `jax.device_put(x, NamedSharding(mesh, P()))`): typed on the trace mesh, as the user's own jit
    types it on theirs. One split over a data axis is left as it is: refused by name (`_per_device`)."""
    sharding = getattr(a, "sharding", None)
    if at == step_mesh or not isinstance(sharding, NamedSharding) or sharding.mesh != step_mesh:
      return None
    if jax.sharding.get_abstract_mesh() != at or _spec_names(sharding.spec) & set(data_axes):
      return None
    return a.update(sharding=NamedSharding(at, sharding.spec))

  # Entered through the empty mesh: JAX refuses to change a set mesh's size directly, and the size-1 data
  # axes are what lets an Explicit annotation divide one device's rows.
  try:
    with (
      _jax_private.arrays_typed_on(retype),
      jax.sharding.use_abstract_mesh(_EMPTY),
      jax.sharding.use_abstract_mesh(at),
    ):
      # The data axes bound, at their sizes in the step's mesh: a collective the model itself runs over one
      # (Flax's synchronized BatchNorm, a psum of a token count) means inside the map what it means in the
      # user's own shard_map, where they are bound the same way.
      closed = jax.make_jaxpr(_jax_private.jnp_calls_kept(flat), axis_env=[(a, mesh.shape[a]) for a in data_axes])(
        *leaves
      )
  except Exception as e:
    explained = explain_trace_error(e, mesh, data_axes, entry)
    if explained is None:
      raise
    raise explained from e
  return Program(closed, in_tree, out_tree[0], data_axes, at)


def _typed_spec(x, data_axes) -> PartitionSpec:
  """The spec `x` is typed with (its Explicit axes), data axes dropped; P() for a value without one."""
  sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else getattr(x, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return PartitionSpec()
  return drop_axes(PartitionSpec(*spec), data_axes)


def drop_axes(spec: PartitionSpec, axes) -> PartitionSpec:
  """`spec` without the mesh axes `axes` (an entry left with none becomes None); unreduced/reduced too."""
  axes = set(axes)

  def entry(e):
    if e is None or e is PartitionSpec.UNCONSTRAINED:
      return e
    names = tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n not in axes)
    return None if not names else names[0] if len(names) == 1 else names

  return PartitionSpec(*(entry(e) for e in spec), unreduced=spec.unreduced - axes, reduced=spec.reduced - axes)


# --------------------------------------------------------------------------- what the checks read


def data_axes_mapped_over(closed, data_axes) -> set:
  """The data axes a `shard_map` in the loss maps over AND uses (in its specs or its collectives).

  A nested shard_map made manual over every axis of the context (one written
  without `axis_names=`, like the docs' `gemm_tp`) covers the data axes too,
  but if neither its specs nor its body name them, it is replicated over them:
  inside the per-device map it runs on the device's rows unchanged. One that
  names a data axis splits the batch and reduces over it itself (the docs'
  hand-written data-parallel loss).
  """
  data = set(data_axes)
  found: set = set()
  for eqn in _eqns(closed.jaxpr):
    if eqn.primitive.name != "shard_map":
      continue
    manual = set(eqn.params.get("newly_manual_axes", ())) & data
    named = set()
    for spec in (*eqn.params["in_specs"], *eqn.params["out_specs"]):
      named |= _spec_names(spec)
    named |= _collective_axes(eqn.params["jaxpr"])
    found |= manual & named
  return found


def _spec_names(spec) -> set:
  names: set = set()
  for e in spec if isinstance(spec, PartitionSpec) else ():
    if e is not None and e is not PartitionSpec.UNCONSTRAINED:
      names |= set(e if isinstance(e, tuple) else (e,))
  return names


def _collective_axes(jaxpr) -> set:
  names: set = set()
  for eqn in _eqns(jaxpr):
    for p in _AXIS_PARAMS:
      v = eqn.params.get(p)
      if isinstance(v, str):
        names.add(v)
      elif isinstance(v, (tuple, list, frozenset, set)):
        names |= {a for a in v if isinstance(a, str)}
  return names


def _eqns(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters."""
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):  # a NamedTuple of jaxprs too (custom_linear_solve)
        if isinstance(sub, jex_core.ClosedJaxpr):
          yield from _eqns(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          yield from _eqns(sub)


def shard_map_refusal(data_axis: str, entry: str) -> ValueError:
  """The refusal of a loss that runs its own `jax.shard_map` over the data axis `data_axis`."""
  return ValueError(
    f"loss_fn calls jax.shard_map over the data axis {data_axis!r} itself (with psum/pmean inside): "
    f"{entry} splits the batch over the data axes, runs the loss per device and reduces the "
    "gradient for you. Pass the plain per-batch loss, loss_fn(params, batch) -> the mean loss over "
    "that batch's rows, without the shard_map or the pmean."
  )


def explain_trace_error(e: Exception, mesh, data_axes, entry: str) -> Exception | None:
  """A jaxaccum error for JAX's `e` raised while tracing the loss on one device's rows, or None.

  Two ways a nested `jax.shard_map` fails there: one that splits the rows over
  a data axis itself (its in_specs name it: the device's rows do not divide
  over it), and one bound to a mesh other than the context the loss is traced
  under (`mesh=` given on an Explicit mesh, traced with its data axes of size
  1, or a module-level `@jax.shard_map`, which keeps the mesh of its first call).
  """
  text = str(e)
  if "shard_map" in text and "evenly divisible" in text:
    # JAX names one axis ("to mesh axis 'data'") or a tuple of them ("to mesh axes ('rep', 'shard')", hsdp).
    named = [a for a in data_axes if f"mesh axis {a!r}" in text or re.search(rf"mesh axes \([^)]*{a!r}", text)]
    if named:
      return shard_map_refusal(named[0], entry)
  if "in_specs passed to shard_map" in text and "does not match the specs of the input" in text:
    return ValueError(
      f"{entry}: loss_fn applies a jax.shard_map manual over every mesh axis (written without axis_names=, like "
      "the JAX docs' gemm_tp) on a mesh with Explicit axes, where JAX requires each input's type to match the "
      "in_specs exactly; the batch is split over the data axis, so it does not (JAX raises the same in your own "
      "jax.jit with the batch sharded over the data axis). Make the mesh with Auto axes (jax.make_mesh(..., "
      f"axis_types=(AxisType.Auto,) * n)): {entry} runs such a layer there exactly"
    )
  if "should match the mesh passed to shard_map" in text:
    at = trace_mesh(mesh, data_axes)
    sized = (
      ""
      if at == mesh.abstract_mesh
      else " with its data axes of size 1 (Explicit axes: so that an annotation naming one divides the rows)"
    )
    return ValueError(
      f"{entry}: loss_fn calls a jax.shard_map bound to a mesh other than the one {entry} traces the loss under: "
      f"the loss is traced once, on one device's rows, under the step's mesh{sized}, and JAX binds a module-level "
      "@jax.shard_map to the context mesh of its first call (or to its mesh=). If it maps over the data axis with "
      "a pmean inside (the JAX docs' hand-written data-parallel loss), pass the plain per-batch loss instead: "
      f"{entry} splits the batch over the data axes and reduces the gradient for you. A layer over other axes "
      "(tensor parallel): write it without mesh= and apply jax.shard_map inside the loss, on a mesh with Auto axes"
    )
  return None


def primitives(closed) -> set:
  """The names of every primitive in the traced loss (nested jaxprs included)."""
  return {eqn.primitive.name for eqn in _eqns(closed.jaxpr)}


# --------------------------------------------------------------------------- localising the annotations


def localise(closed, inside, data_axes, at):
  """`closed` with every mesh mapped to `inside` (the per-device map's mesh) and the data axes dropped.

  `at`: the mesh `closed` was traced under; a custom derivative's rule, which
  JAX traces only when it differentiates, is traced under it too (on the avals
  of the original trace) and localised the same way.
  """
  return _Localiser(inside, data_axes, at).closed(closed)


class _Localiser:
  """One structural rewrite of a traced jaxpr (see the module docstring), memoised per variable."""

  def __init__(self, inside, data_axes, at):
    self.inside, self.data, self.at = inside, frozenset(data_axes), at
    self.vars: dict = {}
    self.meshes: dict = {}
    self.contexts: dict = {}
    self.jaxprs: dict = {}

  def mesh(self, m):
    """The mesh `m` (a trace-time mesh, concrete or abstract) as seen inside the map, its manual axes kept."""
    if m is None or getattr(m, "empty", False):
      return m
    key = m.abstract_mesh if hasattr(m, "abstract_mesh") else m
    got = self.meshes.get(key)
    if got is None:
      names = set(key.axis_names)
      if not names <= set(self.inside.axis_names):
        raise ValueError(
          f"the loss names a mesh with axes {key.axis_names}, but it runs on the step's mesh with axes "
          f"{self.inside.axis_names}: annotate with the step's mesh (or its axis names)"
        )
      # Its manual axes kept, and its other non-data axes typed as it types them: inside `jax.sharding.auto_axes`
      # (which `table.at[tokens].get(out_sharding=...)` enters on an Explicit mesh) "model" is Auto, and the
      # reshards to P() there leave the layout to the partitioner, as in the user's own jit. Typed Explicit as
      # the map's mesh is, they would be real reshards: the whole table all-gathered over "model".
      inside = dict(zip(self.inside.axis_names, self.inside.axis_types, strict=True))
      types = {
        n: t
        for n, t in zip(key.axis_names, key.axis_types, strict=True)
        if t == AxisType.Manual or (n not in self.data and t != inside[n])
      }
      got = self.meshes[key] = self.inside.update_axis_types(types) if types else self.inside
    return got

  def spec(self, s: PartitionSpec, mesh=None) -> PartitionSpec:
    """`s` without the data axes; on a mesh (`mesh`, else the map's) with no Auto axis left, its UNCONSTRAINED
    entries None: JAX refuses UNCONSTRAINED there, and with no axis left to choose it means None (vmap of a
    `with_sharding_constraint` inserts one for the mapped dimension)."""
    s = drop_axes(s, self.data)
    mesh = self.inside if mesh is None else mesh
    if any(t == AxisType.Auto for t in getattr(mesh, "axis_types", ())):
      return s
    entries = [None if e is PartitionSpec.UNCONSTRAINED else e for e in s]
    return PartitionSpec(*entries, unreduced=s.unreduced, reduced=s.reduced)

  def sharding(self, s):
    if isinstance(s, NamedSharding):
      mesh = self.mesh(s.mesh)
      return NamedSharding(mesh, self.spec(s.spec, mesh), memory_kind=s.memory_kind)
    return s

  def aval(self, a):
    if not isinstance(a, jax.core.ShapedArray):
      return a
    sharding = a.sharding
    mat = a.manual_axis_type
    if sharding is not None and not sharding.mesh.empty:
      sharding = self.sharding(sharding)
    elif not self.inside.empty:
      return a
    mat = _jax_private.ManualAxisType(
      varying=mat.varying - self.data, unreduced=mat.unreduced - self.data, reduced=mat.reduced - self.data
    )
    return a.update(sharding=sharding, manual_axis_type=mat)

  def const(self, x):
    """A constant of the trace, its type localised: a literal's host array carries the trace's mesh in its aval
    (a trace inside a caller's shard_map, ja.diloco_train_step's)."""
    if isinstance(x, _jax_private.TypedNdArray):
      return _jax_private.TypedNdArray(np.asarray(x), self.aval(x.aval))
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      # An array the loss closes over, typed on the step's Explicit mesh (replicated over the data axes: `trace`
      # types only those on its mesh): inside the map that type names axes that are Manual there, so its value
      # is taken as a constant of the map (each device holds all of it, as in the user's own jit).
      mesh = getattr(jax.typeof(x).sharding, "mesh", None)
      if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
        return np.asarray(x)
    return x

  def var(self, v):
    if isinstance(v, jex_core.Literal):
      return jex_core.Literal(self.const(v.val), self.aval(v.aval))
    got = self.vars.get(v)
    if got is None:
      got = self.vars[v] = _jax_private.new_var(self.aval(v.aval), v)
    return got

  def closed(self, c):
    # One localised jaxpr per traced one: a jnp function called at the same shapes in every layer is one shared
    # jaxpr (`_jax_private.jnp_calls_kept`), and stays one, so that JAX's caches keyed on it hit.
    got = self.jaxprs.get(id(c))
    if got is None or got[0] is not c:
      got = self.jaxprs[id(c)] = (c, jex_core.ClosedJaxpr(self.jaxpr(c.jaxpr), [self.const(x) for x in c.consts]))
    return got[1]

  def jaxpr(self, j):
    return j.replace(
      constvars=[self.var(v) for v in j.constvars],
      invars=[self.var(v) for v in j.invars],
      outvars=[self.var(v) for v in j.outvars],
      eqns=[self.eqn(e) for e in j.eqns],
    )

  def eqn(self, e):
    # A custom_vjp's fwd and bwd meet here: the bwd is traced on the types the fwd's trace gave its residuals.
    link = _VjpLink(e) if "bwd" in e.params and "fwd_jaxpr_thunk" in e.params else None
    params = {k: self.param(k, v, link) for k, v in e.params.items()}
    return jex_core.new_jaxpr_eqn(
      [self.var(v) for v in e.invars],
      [self.var(v) for v in e.outvars],
      e.primitive,
      params,
      e.effects,
      e.source_info,
      self.ctx(e.ctx),
    )

  def ctx(self, ctx):
    got = self.contexts.get(ctx)  # contexts are interned: one rebuilt per distinct one
    if got is None:
      m = ctx.cur_abstract_mesh
      got = self.contexts[ctx] = _jax_private.eqn_context(ctx, self.mesh(m) if not m.empty else self.inside)
    return got

  def param(self, name, v, link=None):
    if name in _MANUAL_PARAMS and isinstance(v, (frozenset, set, tuple)):
      return type(v)(a for a in v if a not in self.data)
    if name in _RULE_THUNKS and isinstance(v, _jax_private.WrappedFun):
      return self.rule(v, link)
    if name == "bwd" and isinstance(v, _jax_private.WrappedFun):
      return self.bwd(v, link)
    if name == _PRIMAL_THUNK and callable(v):
      return self.primal(v)
    return self.value(v)

  def primal(self, thunk):
    """`custom_vjp(optimize_remat=True)`'s primal thunk (`() -> (jaxpr, consts)`, called when JAX finds the fwd's
    residuals unused): traced under the trace's mesh, as `rule` traces a fwd, its jaxpr and consts localised."""
    memo: list = []

    def traced():
      if not memo:
        with jax.sharding.use_abstract_mesh(_EMPTY), jax.sharding.use_abstract_mesh(self.at):
          jaxpr, consts = thunk()
        inner = _Localiser(self.inside, self.data, self.at)
        memo.append((inner.jaxpr(jaxpr), [inner.const(c) for c in consts]))
      return memo[0]

    return traced

  def bwd(self, bwd, link=None):
    """A custom_vjp's (flattened) bwd, run inside the map with its annotations localised.

    JAX traces a bwd rule on the cotangents, inside the per-device map, where
    the data axes are manual: an annotation written for the global batch
    (`with_sharding_constraint(g, P("data", ...))`, `reshard`) would be refused
    there. It is traced instead under the trace's mesh (the data axes not
    manual), its jaxpr localised and evaluated on the map's values, as the
    loss is. First on the types its arguments have inside the map (`map_types`:
    what it met there before, so a rule that ran there runs the same); if that
    trace fails (an Explicit-mesh `with_sharding_constraint` asserting the rows'
    split over "data"), on the types the loss's trace gave its residuals and
    cotangents (`_VjpLink`), as the user's own jit types them; if that fails
    too, or a symbolic zero is among its arguments, it runs inside the map as
    JAX runs it (and JAX's error, explained by `_per_device`, is what the user
    sees).

    JAX checks the bwd rule's cotangents against the primal avals of the
    original trace (typed on the trace's mesh), which the cotangents computed
    inside the map never match on an Explicit mesh. The same check (shape and
    dtype) is made here on the localised avals, and symbolic zeros get them.
    """
    avals = next((static[1] for gen, static in bwd.transforms if getattr(gen, "__name__", "") == "_flatten_bwd"), None)
    local = None if avals is None else [self.aval(a) for a in avals]

    def check(outs):
      for i, o in enumerate(outs):
        want = None if local is None or i >= len(local) else local[i].to_ct_aval()
        if isinstance(o, _jax_private.Zero):
          outs[i] = _jax_private.Zero(self.aval(o.aval) if want is None else want)
        elif want is not None and (jax.numpy.shape(o) != want.shape or jax.numpy.result_type(o) != want.dtype):
          raise ValueError(
            f"Custom VJP bwd rule must produce an output with the same type as the args tuple of the primal "
            f"function, but at output[{i}] the bwd rule produced {jax.typeof(o).str_short()} for an input of "
            f"type {want.str_short()}"
          )
      return outs

    memo: dict = {}

    def run(*args):
      with _jax_private.disable_bwd_checks():
        for typed in (self.map_types(args), None if link is None else link.arg_avals(args)):
          if typed is None:
            continue
          key = tuple((s.shape, s.dtype, s.sharding) for s in typed)
          if key not in memo:
            try:
              memo[key] = self.traced_bwd(bwd, typed)
            except Exception:  # noqa: BLE001  (the next way, and last JAX's own, says what is wrong)
              memo[key] = None
          if memo[key] is not None:
            closed, shape = memo[key]
            return shape(jex_core.jaxpr_as_fun(closed)(*args), check)
        return _jax_private.call_flat_bwd(bwd, args, check)

    return _jax_private.wrap_init(run, debug_info=bwd.debug_info)

  def map_types(self, args) -> list | None:
    """The bwd's `args` (values inside the map) typed as they are there, on the trace's mesh: the same types, the
    data axes not manual. None if one is not an array (a symbolic zero, with `symbolic_zeros=True`)."""
    if not all(isinstance(x, (jax.Array, jax.core.Tracer)) for x in args):
      return None
    explicit = AxisType.Explicit in self.at.axis_types

    def struct(x):
      a = jax.typeof(x)
      sharding = getattr(a, "sharding", None)
      spec = sharding.spec if explicit and isinstance(sharding, NamedSharding) else None
      return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=None if spec is None else NamedSharding(self.at, spec))

    return [struct(x) for x in args]

  def traced_bwd(self, bwd, typed):
    """`bwd` traced under the trace's mesh on `typed` (ShapeDtypeStructs), localised: (the jaxpr, a function that
    rebuilds what the bwd returns from the jaxpr's outputs: its cotangents, symbolic zeros in place, any logs)."""
    form: list = []

    def flat(*xs):
      def keep(cts):
        form.append([(i, c.aval) for i, c in enumerate(cts) if isinstance(c, _jax_private.Zero)])
        return cts

      out = _jax_private.call_flat_bwd(bwd, xs, keep)
      cts, logs = out if isinstance(out, tuple) else (out, None)
      leaves, tree = jax.tree.flatten(logs)
      form.append((isinstance(out, tuple), tree, len(leaves)))
      return [c for c in cts if not isinstance(c, _jax_private.Zero)] + leaves

    with jax.sharding.use_abstract_mesh(_EMPTY), jax.sharding.use_abstract_mesh(self.at):
      closed = jax.make_jaxpr(flat, axis_env=[(a, self.inside.shape[a]) for a in sorted(self.data)])(*typed)
    local = _Localiser(self.inside, self.data, self.at).closed(closed)
    zeros, (paired, tree, n_logs) = form

    def shape(outs, check):
      outs = list(outs)
      logs = jax.tree.unflatten(tree, outs[len(outs) - n_logs :])
      cts = outs[: len(outs) - n_logs]
      for i, aval in zeros:
        cts.insert(i, _jax_private.Zero(aval))
      cts = check(cts)
      return (cts, logs) if paired else cts

    return local, shape

  def rule(self, thunk, link=None):
    """A custom_jvp's jvp / custom_vjp's fwd thunk: traced under the trace's mesh, its jaxpr localised.

    JAX traces the rule when it differentiates, on the avals of the original
    trace (typed on the trace's mesh); traced inside the map instead, a
    `full_like` of such an aval (relu's jvp) would name the trace's mesh.
    A custom_vjp's fwd tells `link` the types of the residuals it returns.
    """

    def traced(*zeros):
      with jax.sharding.use_abstract_mesh(_EMPTY), jax.sharding.use_abstract_mesh(self.at):
        jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
      if link is not None:
        link.fwd = jaxpr
      return (_Localiser(self.inside, self.data, self.at).jaxpr(jaxpr), consts, *rest)

    return _jax_private.wrap_init(traced, debug_info=thunk.debug_info)

  def value(self, v):
    if isinstance(v, jex_core.ClosedJaxpr):
      return self.closed(v)
    if isinstance(v, jex_core.Jaxpr):
      return self.jaxpr(v)
    if isinstance(v, NamedSharding):
      return self.sharding(v)
    if isinstance(v, PartitionSpec):
      return self.spec(v)
    if isinstance(v, (Mesh, AbstractMesh)):
      return self.mesh(v)
    if isinstance(v, jax.core.ShapedArray):
      return self.aval(v)
    if isinstance(v, (tuple, list)):
      # A NamedTuple too (custom_linear_solve's `jaxprs`, the solve's matvec/vecmat/solve/transpose_solve
      # ClosedJaxprs): rebuilt only where an item changed, so one holding none (a PRNG implementation) is kept.
      items = [self.value(x) for x in v]
      if all(a is b for a, b in zip(items, v, strict=True)):
        return v
      return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    return v


def _typed_sharding(aval):
  """The sharding a `ShapeDtypeStruct` of `aval` carries: its own on a mesh with Explicit axes, else none."""
  sharding = getattr(aval, "sharding", None)
  if isinstance(sharding, NamedSharding) and AxisType.Explicit in sharding.mesh.axis_types:
    return sharding
  return None


class _VjpLink:
  """What a `custom_vjp_call` equation's localised bwd needs from its fwd: the types of the bwd's arguments.

  JAX calls the bwd on `(*residuals, *cotangents)`. As the loss's trace types them (on the trace's mesh): the
  residuals are the fwd's first outputs, except those that are the equation's own inputs (`out_trees()`'s
  input forwards, indices into its operands), and the cotangents are typed as the equation's outputs. The fwd
  (`_Localiser.rule`) records its jaxpr, traced on the trace's mesh, in `fwd`.
  """

  def __init__(self, eqn):
    self.ins = [v.aval for v in eqn.invars]
    self.outs = [v.aval for v in eqn.outvars]
    self.out_trees = eqn.params.get("out_trees")
    self.fwd = None

  def arg_avals(self, args) -> list | None:
    """The trace's types of the bwd's `args` (inside the map), or None where they cannot be told."""
    if self.fwd is None or not callable(self.out_trees):
      return None
    try:
      _, res_tree, forwards = self.out_trees()
    except Exception:  # noqa: BLE001  (JAX's store not filled: the fwd was not traced for this call)
      return None
    n_res = res_tree.num_leaves
    fwd_outs = [v.aval for v in self.fwd.outvars]
    produced = iter(fwd_outs[: n_res - sum(f is not None for f in forwards)])
    res = [next(produced, None) if f is None else self.ins[f] if f < len(self.ins) else None for f in forwards]
    typed = [*res, *(a.to_ct_aval() for a in self.outs)]
    if len(typed) != len(args) or any(a is None for a in typed):
      return None
    for a, x in zip(typed, args, strict=True):
      if not isinstance(x, (jax.Array, jax.core.Tracer)) or not isinstance(a, jax.core.ShapedArray):
        return None  # a symbolic zero (symbolic_zeros=True), a non-array residual
      if tuple(a.shape) != tuple(jax.numpy.shape(x)) or a.dtype != jax.numpy.result_type(x):
        return None
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_typed_sharding(a)) for a in typed]
