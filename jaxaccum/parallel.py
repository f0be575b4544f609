"""Synchronous data parallelism: gradient all-reduce transforms, data meshes, batch sharding.

Everything here works the same on one device, on many devices of one process
and on many processes under `jax.distributed.initialize()`.

The shard_map pitfall. Inside `jax.shard_map` (with its default `check_vma=True`)
a parameter passed in replicated (`P()`) is *invariant* over the data axis, and
the transpose of its implicit broadcast is a `psum`: `jax.grad` already returns
the *sum* over devices of the per-device gradients. Averaging again (the code
that was right under `pmap`) gives a gradient P times too large, silently.
`check_varying` catches that: a gradient that is invariant over the axis while
varying-manual-axis typing is active is a `ValueError` telling the user to cast
the parameters to varying with `lax.pcast(params, axis_name, to="varying")`
before taking the gradient (then the per-device gradient is local and the one
all-reduce is ours).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxaccum import _tree

# --------------------------------------------------------------------------- axis checks


def validate_axis_name(axis_name: Any, arg: str = "axis_name") -> None:
  """Raises a TypeError unless `axis_name` is a non-empty string or tuple of them."""
  ok = isinstance(axis_name, str) and bool(axis_name)
  ok = ok or (isinstance(axis_name, tuple) and bool(axis_name) and all(isinstance(n, str) and n for n in axis_name))
  if not ok:
    raise TypeError(f"{arg}={axis_name!r} must be a non-empty string (or a tuple of them)")


def check_axis_name(axis_name: Any, arg: str = "axis_name") -> int:
  """Returns the size of the bound axis `axis_name`, or raises a ValueError naming it.

  Must be called while tracing inside `pmap`, `shard_map` or `vmap(axis_name=...)`.
  """
  validate_axis_name(axis_name, arg)
  try:
    return lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
      f"{arg}={axis_name!r} is not bound here: call this inside jax.pmap(..., "
      f"axis_name={axis_name!r}) or jax.shard_map over a mesh with that axis"
    ) from None


def _varying_axes(x) -> frozenset | None:
  """The manual axes `x` varies over (None where this JAX has no such typing)."""
  aval = x if isinstance(x, (jax.ShapeDtypeStruct, jax.core.AbstractValue)) else jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    mat = getattr(aval, "manual_axis_type", None)
    vma = getattr(mat, "varying", None)
  return None if vma is None else frozenset(vma)


def _manual_axes() -> tuple:
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(getattr(mesh, "manual_axes", ()) or ())


def _join_dtypes(a, b):
  """The promotion of two numeric dtypes; `a` itself when either is not numeric (e.g. a PRNG key)."""
  if a == b or jax.dtypes.issubdtype(a, jax.dtypes.extended) or jax.dtypes.issubdtype(b, jax.dtypes.extended):
    return a
  return jnp.promote_types(a, b)


def cond(pred, true_fun, false_fun, operands):
  """`lax.cond` whose branches may differ in output dtypes or in the manual axes they vary over.

  Dtypes: an optimizer state may change dtype when `inner` runs (optax's adam
  promotes a bf16 moment to float32 on its first float32 gradient), while the
  branch that passes the state through keeps the old one; each output leaf is
  cast to the promotion of the two, as a plain optax step would leave it.
  Varying axes: inside `jax.shard_map` (check_vma=True) an all-reduced value is
  invariant while a local one is varying; each output leaf is cast to varying
  over the union of the two branches' axes. Both are found by tracing the
  branches once each with `jax.make_jaxpr`; the conditional's branches then
  bind those jaxprs as one `closed_call` each instead of running the Python
  functions (or replaying every equation) a second time: an optimizer's
  update, or a microbatch's whole gradient, is traced once.
  Only numeric dtypes are promoted: a typed PRNG key (`optax.noisy_sgd`'s and
  `optax.add_noise`'s state) has no promotion and passes as it is.
  """
  traced = [_trace_branch(fun, operands) for fun in (true_fun, false_fun)]
  (_, true_out, true_tree), (_, false_out, false_tree) = traced
  if true_tree != false_tree:  # lax.cond's own message, from the original functions
    return lax.cond(pred, true_fun, false_fun, operands)
  dtypes = [_join_dtypes(a.dtype, b.dtype) for a, b in zip(true_out, false_out, strict=True)]
  manual = bool(_manual_axes())
  axes = [
    (_varying_axes(a) or frozenset()) | (_varying_axes(b) or frozenset())
    for a, b in zip(true_out, false_out, strict=True)
  ]

  def widen(closed, avals):
    def cast(x, aval, dtype, axes):
      if not isinstance(x, (jax.Array, jax.core.Tracer)):  # a constant output comes back as its literal
        x = jnp.asarray(x, aval.dtype)
      if x.dtype != dtype:
        x = x.astype(dtype)
      missing = tuple(sorted(axes - (_varying_axes(x) or frozenset()))) if manual else ()
      return lax.pcast(x, missing, to="varying") if missing else x

    def wrapped(ops):
      outs = _tree.bind_as_call(closed)(*jax.tree.leaves(ops))
      return jax.tree.unflatten(true_tree, list(map(cast, outs, avals, dtypes, axes)))

    return wrapped

  return lax.cond(pred, widen(traced[0][0], true_out), widen(traced[1][0], false_out), operands)


def _trace_branch(fun, operands):
  """`fun` traced once on `operands`' types: (closed jaxpr, output avals, output tree)."""
  closed, shape = jax.make_jaxpr(fun, return_shape=True)(operands)
  return closed, list(closed.out_avals), jax.tree.structure(shape)


def vma_tracking(axis_name) -> bool:
  """True inside `jax.shard_map(check_vma=True)` over `axis_name`; False under pmap."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  vma = _varying_axes(lax.axis_index(names))
  return vma is not None and all(n in vma for n in names)


def to_varying(tree, axis_name):
  """Casts every leaf of `tree` to varying over `axis_name` where it is not yet (a no-op under pmap)."""
  if not vma_tracking(axis_name):
    return tree
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

  def vary(x):
    missing = tuple(n for n in names if n not in (_varying_axes(x) or frozenset()))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(vary, tree)


def check_varying(tree, axis_name, arg: str = "grads") -> None:
  """Raises when `tree` is already reduced over `axis_name` (see the module docstring)."""
  if not vma_tracking(axis_name):
    return
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    vma = _varying_axes(leaf)
    if vma is not None and not all(n in vma for n in names):
      raise ValueError(
        f"{arg}{jax.tree_util.keystr(path)} is invariant over {axis_name=}: inside "
        "jax.shard_map, a gradient with respect to replicated parameters has already been "
        "summed over the axis by autodiff, so averaging it again would scale it by the axis "
        "size. Cast the parameters to varying before taking the gradient: "
        f"params = jax.lax.pcast(params, {axis_name!r}, to='varying'). (If this is not a gradient but "
        "a value that is the same on every device, e.g. a constant, cast that value to varying instead.)"
      )


def all_reduce_sum(tree, axis_name, comm_dtype=None):
  """`lax.psum` of `tree` over `axis_name` with `comm_dtype` on the wire.

  Leaves come back in their own dtype. One `psum` of the whole tree: XLA
  combines the leaves into as few all-reduce instructions as it can.
  """
  if comm_dtype is None:
    return lax.psum(tree, axis_name)
  sent = _tree.cast_tree(tree, jnp.dtype(comm_dtype))
  return _tree.cast_like(lax.psum(sent, axis_name), tree)


# --------------------------------------------------------------------------- transforms


class AllReduceState(NamedTuple):
  """`pmean`/`psum` keep no state."""


def _all_reduce_transform(axis_name, comm_dtype, mean: bool) -> optax.GradientTransformationExtraArgs:
  validate_axis_name(axis_name)
  if comm_dtype is not None:
    comm_dtype = jnp.dtype(comm_dtype)
    if not jnp.issubdtype(comm_dtype, jnp.floating):
      raise ValueError(f"{comm_dtype=} must be a floating dtype (an integer wire dtype truncates)")

  def init(params):
    del params
    return AllReduceState()

  def update(updates, state, params=None, **extra_args):
    del params, extra_args
    size = check_axis_name(axis_name)
    check_varying(updates, axis_name, arg="updates")
    out = all_reduce_sum(updates, axis_name, comm_dtype)
    if mean:
      out = jax.tree.map(lambda x: x / jnp.asarray(size, x.dtype), out)
    return out, state

  return optax.GradientTransformationExtraArgs(init, update)


def pmean(axis_name, *, comm_dtype=None) -> optax.GradientTransformationExtraArgs:
  """Averages updates over the devices of `axis_name`: g -> (1/P) sum_p g_p.

  A stateless transform for `optax.chain`, inside `jax.pmap` or `jax.shard_map`.
  Under shard_map, pass gradients taken with respect to varying parameters (see
  the module docstring); gradients already reduced by autodiff raise a ValueError.

  Args:
    axis_name: the mapped axis to average over.
    comm_dtype: dtype on the wire (e.g. `jnp.bfloat16` halves the bytes); the
      result comes back in each leaf's own dtype.
  """
  return _all_reduce_transform(axis_name, comm_dtype, mean=True)


def psum(axis_name, *, comm_dtype=None) -> optax.GradientTransformationExtraArgs:
  """Sums updates over the devices of `axis_name`: g -> sum_p g_p. See `pmean`."""
  return _all_reduce_transform(axis_name, comm_dtype, mean=False)


# --------------------------------------------------------------------------- meshes and data


def data_mesh(axis_name: str = "data", devices=None) -> Mesh:
  """A one-dimensional mesh over `devices` (default: every device of every process).

  `devices` is a sequence of jax Devices (e.g. `jax.devices()[:4]`); one device
  alone is written `[device]`. Anything else is a TypeError naming `devices`.
  """
  if not isinstance(axis_name, str) or not axis_name:
    raise TypeError(f"{axis_name=} must be a non-empty string")
  given = devices
  if isinstance(devices, jax.Device):
    raise TypeError(
      f"devices={devices!r} is one device; devices must be a sequence of jax Devices: pass devices=[{devices!r}]"
    )
  if devices is not None and (isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__")):
    raise TypeError(
      f"devices={devices!r} must be a sequence of jax Devices (e.g. jax.devices()), got {type(devices).__name__}"
    )
  devices = jax.devices() if devices is None else list(devices)
  if not devices:
    raise ValueError(f"devices={given!r} must name at least one device")
  seen = set()
  for i, device in enumerate(devices):
    if not isinstance(device, jax.Device):
      raise TypeError(
        f"devices[{i}]={device!r} must be a jax Device (e.g. from jax.devices()), got "
        f"{type(device).__name__}: devices={given!r}"
      )
    if device in seen:
      raise ValueError(f"devices={given!r} lists {device} twice; each device may appear once in a mesh")
    seen.add(device)
  return Mesh(np.asarray(devices), (axis_name,))


def _check_mesh_axis(mesh, axis_name):
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh (see ja.data_mesh)")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"{axis_name=} is not an axis of the mesh (its axes: {mesh.axis_names})")


def shard_batch(batch, mesh: Mesh, axis_name: str | tuple[str, ...] = "data"):
  """Puts this process's rows of `batch` on its devices of `mesh`, split along `axis_name`.

  Each process passes only its own rows (as with
  `jax.make_array_from_process_local_data`); the result is one global array per
  leaf whose leading size is the sum over processes. On one process this is
  simply the batch split over the devices.

  Args:
    batch: a pytree of arrays with a leading batch axis.
    mesh: the mesh, e.g. `ja.data_mesh()` or `jax.make_mesh(...)`.
    axis_name: the mesh axis the rows are split over, or a tuple of axes (e.g.
      `("replica", "shard")` for `strategy="hsdp"`): rows are split over their
      product, the first axis major.

  Raises:
    ValueError: a leaf is a scalar, has 0 rows (an empty batch, refused as
      `make_train_step` refuses it), or rows not divisible by this process's
      shards; the message names the leaf.
  """
  if isinstance(axis_name, tuple):
    validate_axis_name(axis_name)
    for name in axis_name:
      _check_mesh_axis(mesh, name)
    if len(set(axis_name)) != len(axis_name):
      raise ValueError(f"{axis_name=} names an axis twice")
  else:
    _check_mesh_axis(mesh, axis_name)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  sharding = NamedSharding(mesh, PartitionSpec(axis_name))
  local_devices = len(mesh.local_devices)
  shards = int(np.prod([mesh.shape[n] for n in names]))
  local_share = local_devices * shards // mesh.devices.size

  def put(path, x):
    x = np.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim == 0:
      raise ValueError(f"batch{jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a leading batch axis")
    if x.shape[0] == 0:  # as make_train_step refuses an empty batch: 0 rows are nothing to train on
      raise ValueError(
        f"batch{jax.tree_util.keystr(path)} has 0 rows on this process: the batch is empty, there is nothing to "
        "shard (make_train_step refuses an empty batch too)"
      )
    if x.shape[0] % local_share:
      raise ValueError(
        f"batch{jax.tree_util.keystr(path)} has {x.shape[0]} local rows, not divisible by the "
        f"{local_share} shards of {axis_name=} on this process"
      )
    return jax.make_array_from_process_local_data(sharding, x)

  return jax.tree_util.tree_map_with_path(put, batch)


def replicate(tree, mesh: Mesh):
  """Places a full copy of `tree` on every device of `mesh` (every process passes the same values).

  The result never shares buffers with `tree`: a train step that donates its
  parameters (`ja.make_train_step(..., donate=True)`) must not delete the
  caller's arrays.
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh (see ja.data_mesh)")
  sharding = NamedSharding(mesh, PartitionSpec())
  if jax.process_count() == 1:
    # device_put may hand back the caller's own buffer as one of the shards (even
    # with may_alias=False, checked on jax 0.10), so put a private copy instead.
    return jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), tree), sharding)

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(put, tree)
