"""Unreduced values on an Explicit mesh: the small pieces `ja.grad`, `accumulate` and `microbatch` share.

On a mesh whose axes are Explicit, inside the user's own `jax.jit`, a value
typed `{U:data}` (`P(unreduced={"data"})`) is held by each device as a partial
sum: its value is the sum over the devices of the axis, and no collective has
run yet. JAX 0.10 rules these helpers follow (measured, see
`shared/notes/background.md`, "Unreduced gradients"):

* unreduced + unreduced is unreduced (no collective): an accumulator stays
  unreduced across `jax.jit` calls;
* a replicated scalar times an unreduced value needs the scalar cast to
  `P(reduced={...})` first (`scale`);
* `jax.reshard(x, P())` is one all-reduce, `jax.reshard(x, P("data"))` a
  reduce-scatter (`reduce`);
* non-linear element-wise ops (`isfinite`, `/`) are not defined on unreduced
  values: reduce first, or multiply by a reduced reciprocal.
* unreduced outputs of a shard_map need it manual over every mesh axis, and
  Auto meshes have no unreduced type: `explicit_mesh` says so, by name.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _tree

_INSTEAD = (
  "use ja.make_train_step(..., mesh=mesh) (it owns the step and reduces once per update), or your own "
  "jax.shard_map over the data axis with ja.accumulate(..., axis_name=) inside it"
)


def names(axis_name) -> tuple[str, ...]:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def is_bound(axis_name) -> bool:
  """True inside pmap/shard_map/vmap binding every name of `axis_name` (manual axes)."""
  try:
    for name in names(axis_name):
      lax.axis_size(name)
  except NameError:
    return False
  return True


def mesh_of(tree=None):
  """The mesh of the context (`jax.set_mesh`, or the jit being traced), else of the first leaf that has one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not getattr(mesh, "empty", True):
    return mesh
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None) if not isinstance(leaf, jax.core.Tracer) else None
    if sharding is None:
      sharding = getattr(jax.typeof(leaf), "sharding", None) if hasattr(leaf, "shape") else None
    leaf_mesh: Any = getattr(sharding, "mesh", None)
    if leaf_mesh is not None and not getattr(leaf_mesh, "empty", False) and tuple(getattr(leaf_mesh, "axis_names", ())):
      return leaf_mesh
  return None


def mesh_context(tree):
  """A context in which a bare `PartitionSpec` means `tree`'s mesh: nothing when a mesh is set already.

  `jax.set_mesh(mesh)` for concrete arrays (eager), `jax.sharding.use_abstract_mesh` for tracers (under
  the user's jit): so that placing arguments on the mesh is enough, without `jax.set_mesh` around the call.
  """
  current = jax.sharding.get_abstract_mesh()
  if current is not None and not getattr(current, "empty", True):
    return contextlib.nullcontext()
  mesh = mesh_of(tree)
  if mesh is None:
    return contextlib.nullcontext()
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.set_mesh(mesh)
  return jax.sharding.use_abstract_mesh(mesh)


def zero_on(tree) -> jax.Array:
  """An int32 zero that reads a leaf of `tree`: a jit whose unreduced outputs are made from nothing (zeros) then
  keeps that argument, and so its devices; else it compiles for one device and JAX refuses the mesh's outputs."""
  leaf = next((x for x in jax.tree.leaves(tree) if hasattr(x, "shape")), None)
  if leaf is None or not isinstance(leaf, jax.core.Tracer):
    return jnp.zeros([], jnp.int32)
  return (jnp.any(leaf != leaf) & False).astype(jnp.int32)  # always 0, NaN or not


def refuse(tree, what: str, arg: str = "grads") -> None:
  """Raises a ValueError naming the first leaf of `tree` that is unreduced: `what` cannot take partial sums."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    axes = axes_of(leaf) if hasattr(leaf, "shape") else ()
    if axes:
      raise ValueError(
        f"{what}: {arg}{jax.tree_util.keystr(path)} is unreduced over {axes} (typed {jax.typeof(leaf)}: each "
        "device holds a partial sum, as ja.grad returns it). Give it to ja.accumulate(..., "
        f"axis_name={axes[0]!r}) or ja.microbatch(..., axis_name={axes[0]!r}), which reduce once, or reduce it "
        f"first with jax.reshard(g, NamedSharding(mesh, P())) (one all-reduce)"
      )


def _axis_types(mesh) -> dict:
  return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


_PARTIAL_MANUAL: list[bool] = []  # whether this JAX has unreduced outputs from a partly manual shard_map (cached)


def partial_manual_unreduced() -> bool:
  """Whether the installed JAX types a `shard_map`'s output unreduced over its manual axes while other mesh axes
  stay with the partitioner (a tensor-parallel "model" axis beside the data axis).

  Asked of JAX itself, once per process, on an abstract mesh (nothing compiled or placed): jax 0.10.2 refuses
  it ("unreduced/reduced can only be passed to out_specs when shard_map is in full manual mode"), 0.12.0.1
  types it `f32[...@model]{U:data}`.
  """
  if not _PARTIAL_MANUAL:
    mesh = jax.sharding.AbstractMesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    f = jax.shard_map(
      lambda x: x, mesh=mesh, in_specs=P(), out_specs=P(unreduced={"a"}), axis_names={"a"}, check_vma=False
    )
    empty = jax.sharding.AbstractMesh((), ())
    try:  # entered through the empty mesh: JAX refuses to change a set mesh (the caller's) to another directly
      with jax.sharding.use_abstract_mesh(empty), jax.sharding.use_abstract_mesh(mesh):
        jax.eval_shape(f, jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P())))
      _PARTIAL_MANUAL.append(True)
    except (NotImplementedError, ValueError):
      _PARTIAL_MANUAL.append(False)
  return _PARTIAL_MANUAL[0]


def other_axes(mesh, axis_name) -> list[str]:
  """The mesh's axes of size > 1 that are not `axis_name`'s (a tensor-parallel "model" axis, say)."""
  return [n for n, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if s > 1 and n not in names(axis_name)]


def manual_axes(mesh, axis_name) -> tuple[str, ...]:
  """The axes a map that leaves its output unreduced over `axis_name` makes manual: every mesh axis when the
  others have size 1 (all of them manual costs nothing), else only `axis_name`'s (the others stay with the
  partitioner, which keeps the layouts the user gave them; `partial_manual_unreduced` says JAX allows it)."""
  return tuple(mesh.axis_names) if not other_axes(mesh, axis_name) else names(axis_name)


def usable(mesh, axis_name) -> bool:
  """True when `mesh` has every name of `axis_name` as an Explicit axis, and no other axis of size > 1 unless
  this JAX allows unreduced values beside it (`partial_manual_unreduced`)."""
  if mesh is None:
    return False
  types = _axis_types(mesh)
  if not all(types.get(n) == AxisType.Explicit for n in names(axis_name)):
    return False
  return not other_axes(mesh, axis_name) or partial_manual_unreduced()


def explicit_mesh(axis_name, tree=None, *, what: str, arg: str = "axis_name"):
  """The Explicit mesh that unreduced values over `axis_name` live on, or a ValueError saying why not.

  `what` names the caller in the message (e.g. "ja.grad").
  """
  mesh = mesh_of(tree)
  if mesh is None:
    raise ValueError(
      f"{what}: {arg}={axis_name!r} is not bound here and no mesh is set: call it inside jax.pmap / "
      f"jax.shard_map over that axis, or inside your jax.jit on a mesh made with jax.make_mesh(..., "
      f"axis_types=(AxisType.Explicit,)) and set with jax.set_mesh(mesh) (or with arguments placed on it)"
    )
  types = _axis_types(mesh)
  missing = [n for n in names(axis_name) if n not in types]
  if missing:
    raise ValueError(f"{what}: {arg}={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  auto = [n for n in names(axis_name) if types[n] != AxisType.Explicit]
  if auto:
    raise ValueError(
      f"{what}: axis {auto[0]!r} of the mesh {dict(mesh.shape)} is {types[auto[0]]}, not Explicit. On Auto (and "
      "Manual) axes JAX has no unreduced type, so gradients cannot be held unreduced across calls: make the mesh "
      f"with axis_types=(AxisType.Explicit, ...) (jax.make_mesh's default), or {_INSTEAD}"
    )
  others = other_axes(mesh, axis_name)
  if others and not partial_manual_unreduced():
    raise ValueError(
      f"{what}: the mesh {dict(mesh.shape)} has the axis {others[0]!r} besides {arg}={axis_name!r}. In JAX "
      f"{jax.__version__} (installed) unreduced outputs need a shard_map manual over every mesh axis "
      "(NotImplementedError otherwise), so a tensor-parallel axis cannot stay as it is. Upgrade JAX (0.12 "
      f"allows it: pip install -U jax), or {_INSTEAD}"
    )
  return mesh


def _sharding(x):
  """The typed sharding of an array or tracer, or the sharding a type (`jax.typeof`) or an eval_shape result holds."""
  if isinstance(x, (jax.ShapeDtypeStruct, jax.core.AbstractValue)):
    return getattr(x, "sharding", None)
  return getattr(jax.typeof(x), "sharding", None)


def axes_of(x) -> tuple[str, ...]:
  """The mesh axes `x` (an array, a tracer, or a `jax.eval_shape` result) is typed unreduced over, sorted;
  () for an ordinary value."""
  return tuple(sorted(getattr(getattr(_sharding(x), "spec", None), "unreduced", None) or ()))


def is_unreduced(x, axis_name) -> bool:
  """True when `x` (an array, a tracer, or a `jax.eval_shape` result) is typed unreduced over every name of
  `axis_name` (a partial sum per device). An empty array has nothing to sum: it counts as one (see `zeros`)."""
  return _empty(jnp.shape(x)) or all(n in axes_of(x) for n in names(axis_name))


def _empty(shape) -> bool:
  return any(n == 0 for n in shape)


def zeros_like(s, dtype) -> jax.Array:
  """Zeros of `s`'s shape in `dtype`, unreduced over the axes `s` is (on `s`'s mesh: no mesh need be set)."""
  return zeros(s.shape, dtype, getattr(_sharding(s), "mesh", None), axes_of(s))


def zeros(shape, dtype, mesh, axis_name) -> jax.Array:
  """Zeros typed unreduced over `axis_name`: the start of an unreduced accumulator.

  An empty shape gives ordinary zeros: from JAX 0.11 a zero-size array typed unreduced cannot be created
  or returned by a jit (Shardy: "'func.return' op has unreduced axes mismatch", plain JAX alike), and an
  empty leaf has nothing to sum (`_window.add` leaves it as it is)."""
  spec = P() if _empty(shape) else P(unreduced=set(names(axis_name)))
  if mesh is None:
    return jnp.zeros(shape, dtype, out_sharding=spec)
  with creating_on(mesh):
    return jnp.zeros(shape, dtype, out_sharding=NamedSharding(mesh, spec))


def creating_on(mesh):
  """A context for creating an array from nothing (`jnp.zeros`) with `out_sharding=NamedSharding(mesh, ...)`.

  `mesh` set as the context's when it is abstract (a tracer's, under the user's jit) and no mesh is set: from
  JAX 0.11 an `out_sharding` whose mesh neither the context nor an operand has is dropped (replicated zeros,
  an unreduced accumulator that is not one). Else nothing: a concrete mesh (eager) places the array itself.
  """
  current = jax.sharding.get_abstract_mesh()
  if isinstance(mesh, jax.sharding.AbstractMesh) and not mesh.empty and (current is None or current.empty):
    return jax.sharding.use_abstract_mesh(mesh)
  return contextlib.nullcontext()


def scale(x, weight, axis_name):
  """`x * weight` for an unreduced `x` and a replicated scalar `weight` (cast to reduced first, as JAX asks)."""
  if _empty(x.shape):
    return x
  w = jnp.asarray(weight).astype(x.dtype)
  return x * jax.reshard(w, _on_mesh_of(x, P(reduced=set(names(axis_name)))))


def _on_mesh_of(x, spec: P):
  """`spec` on `x`'s mesh (from its type), so that no `jax.set_mesh` is needed when the arguments carry it."""
  mesh = getattr(_sharding(x), "mesh", None)
  return NamedSharding(mesh, spec) if mesh is not None and not getattr(mesh, "empty", True) else spec


def target_spec(like) -> P:
  """The spec a reduced value takes: `like`'s (a parameter's) sharding without any unreduced/reduced part."""
  if like is None:
    return P()
  spec = getattr(getattr(jax.typeof(like), "sharding", None), "spec", None)
  if spec is None:
    return P()
  return P(*spec.partitions)  # `*spec` is refused on a spec with an unreduced/reduced set


def reduce(x, axis_name, spec: P = P(), comm_dtype: Any = None):  # noqa: B008 -- an immutable spec
  """Sums the unreduced `x` over `axis_name` into `spec`: an all-reduce for P(), a reduce-scatter for a
  spec that shards over the axis. `comm_dtype` is the dtype on the wire; the result has `x`'s dtype."""
  del axis_name  # the type says which axes `x` is unreduced over
  sent = x if comm_dtype is None else x.astype(comm_dtype)
  return jax.reshard(sent, _on_mesh_of(x, spec)).astype(x.dtype)


def check_unreduced(tree, axis_name, arg: str = "grads") -> None:
  """Raises a ValueError naming the first leaf of `tree` that is not unreduced over `axis_name`."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not is_unreduced(leaf, axis_name):
      raise ValueError(
        f"{arg}{jax.tree_util.keystr(path)} is not unreduced over {axis_name=} (its type is "
        f"{jax.typeof(leaf)}): on an Explicit mesh, jax.grad's gradient of a loss on a sharded batch comes "
        "back already all-reduced, so accumulating it would cost one all-reduce per micro-step. Take the "
        f"gradient with ja.grad(loss, axis_name={axis_name!r}) (or ja.value_and_grad): it leaves the result "
        "unreduced, and the window end reduces once"
      )


def dtype_of(x):
  return _tree.dtype_of(x)


# Checkpoints. orbax cannot write an unreduced array (JAX: "device_indices_map doesn't work with unreduced"), and
# reducing it on save would change the run (the window end sums once, in its own order). So a checkpoint holds each
# device's partial sum, stacked on a new leading axis sharded over the unreduced axes, and restore unstacks them:
# every device gets back its own bits, and the run continues as if never interrupted.


def _stack_specs(sharding):
  spec = sharding.spec
  axes = tuple(sorted(spec.unreduced))
  inner = P(*spec.partitions, unreduced=set(spec.unreduced))
  return inner, P(axes if len(axes) > 1 else axes[0], *spec.partitions)


def stacked_struct(x) -> jax.ShapeDtypeStruct:
  """What `to_stacked(x)` gives, for an unreduced array or a struct of one on a concrete mesh."""
  sharding = _sharding(x)
  size = 1
  for n in axes_of(x):
    size *= dict(sharding.mesh.shape)[n]
  return jax.ShapeDtypeStruct(
    (size, *x.shape), x.dtype, sharding=NamedSharding(sharding.mesh, _stack_specs(sharding)[1])
  )


def to_stacked(x) -> jax.Array:
  """The partial sums of an unreduced `x`, one per device of its unreduced axes, stacked on a new leading axis."""
  sharding = _sharding(x)
  inner, outer = _stack_specs(sharding)
  fun = jax.shard_map(lambda a: a[None], mesh=sharding.mesh, in_specs=inner, out_specs=outer, check_vma=False)
  return jax.jit(fun)(x)


def from_stacked(stacked, like) -> jax.Array:
  """The inverse of `to_stacked`: an array unreduced as `like` (an array or a struct with a concrete sharding)."""
  sharding = _sharding(like)
  inner, outer = _stack_specs(sharding)
  fun = jax.shard_map(lambda a: a[0], mesh=sharding.mesh, in_specs=outer, out_specs=inner, check_vma=False)
  return jax.jit(fun)(stacked)
