"""Small private helpers shared by the public modules: dtypes, casts, checks."""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives


def accumulator_dtype(dtype: Any, override: Any = None) -> jnp.dtype:
  """The dtype a running sum of `dtype` values is kept in.

  `override=None` picks the wider of float32 and `dtype`: bf16/f16 sums drift
  after a few hundred adds, while float64 gradients must stay float64 for the
  exactness guarantees.
  """
  if override is not None:
    return jnp.dtype(override)
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return jnp.dtype(jnp.float32)
  return jnp.promote_types(dtype, jnp.float32)


def widest(dtypes) -> jnp.dtype:
  """The promotion of all `dtypes` (float32 when there are none)."""
  out = jnp.dtype(jnp.float32)
  for d in dtypes:
    out = jnp.promote_types(out, d)
  return out


def cast_tree(tree, dtype):
  """Casts every leaf of `tree` to `dtype` (a no-op where it already is)."""
  if dtype is None:
    return tree
  return jax.tree.map(lambda x: x.astype(dtype) if x.dtype != dtype else x, tree)


def dtype_of(x) -> jnp.dtype:
  """The dtype of an array, or the one JAX gives a Python scalar (optax accepts `{"w": 1.0}`)."""
  dtype = getattr(x, "dtype", None)
  return jnp.dtype(dtype) if dtype is not None else jnp.result_type(x)


def cast_like(tree, like):
  """Casts every leaf of `tree` to the dtype of the matching leaf of `like` (Python scalars included)."""

  def cast(x, y):
    if jnp.issubdtype(getattr(y, "dtype", None) or jnp.float32, jax.dtypes.prng_key):
      return x  # a typed PRNG key (optax.add_noise's state) has no cast
    x, dtype = jnp.asarray(x), dtype_of(y)
    return x.astype(dtype) if x.dtype != dtype else x

  return jax.tree.map(cast, tree, like)


def nonfinite_probe(x) -> jax.Array:
  """A float32 scalar: 0 when every entry of `x` is finite, NaN when one is a NaN or an Inf.

  `x * 0` is 0 for every finite x and NaN for a NaN or an Inf, so its sum is 0 or NaN and cannot
  overflow. It is one reduction per leaf; `all(isfinite(x))` is three kernels on XLA:CPU (the
  predicate array, its reduction, a reduce-window), a compile-time cost of every leaf of a deep model.
  """
  x = jnp.asarray(x)  # a Python scalar leaf too ({"w": 1.0} is a valid optax tree)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros((), jnp.float32)
  z = x - x  # not x * 0: XLA CSEs that broadcast zero with an accumulator's zero init, keeping it alive
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    z = z.real + z.imag
  return jnp.sum(z, dtype=jnp.float32)


def all_finite(tree) -> jax.Array:
  """A scalar bool: True when no leaf of `tree` holds a NaN or an Inf."""
  probes = [nonfinite_probe(x) for x in jax.tree.leaves(tree)]
  return jnp.isfinite(sum(probes, jnp.zeros((), jnp.float32)))


def is_concrete(x) -> bool:
  """True when `x` has a value now (not a tracer inside jit, vmap, grad...)."""
  return not isinstance(x, jax.core.Tracer)


def check_positive_int(value, name: str) -> int:
  """Returns `value` as an int, or raises naming `name` and the value.

  Booleans are rejected: `every_k=True` is a bug, not a 1.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name}={value!r} must be an integer >= 1, got {type(value).__name__}")
  if value < 1:
    raise ValueError(f"{name}={value!r} must be an integer >= 1")
  return int(value)


def check_same_structure(tree, reference, name: str, reference_name: str) -> None:
  """Raises a ValueError when `tree` does not have the structure and shapes of `reference`."""
  td, rd = jax.tree.structure(tree), jax.tree.structure(reference)
  if td != rd:  # type: ignore[operator]  # jaxlib types PyTreeDef loosely
    # Name the user's leaves where the two differ; the treedefs only when the
    # leaf paths agree (a container type differs, e.g. a tuple for a list).
    paths, ref_paths = leaf_paths(tree), leaf_paths(reference)
    in_tree, in_ref = set(paths), set(ref_paths)
    extra = [q for q in paths if q not in in_ref]
    missing = [q for q in ref_paths if q not in in_tree]
    if extra or missing:
      parts = []
      if extra:
        parts.append(f"{name} has leaves {_first(extra)} that {reference_name} lacks")
      if missing:
        parts.append(f"{name} lacks the leaves {_first(missing)} that {reference_name} has")
      raise ValueError(f"{name} does not match {reference_name}: " + "; ".join(parts))
    raise ValueError(
      f"{name} does not match {reference_name}: same leaves, other containers: tree structure {td} != {rd}"
    )
  for path_and_leaf, ref in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(reference), strict=False):
    path, leaf = path_and_leaf
    if jnp.shape(leaf) != jnp.shape(ref):
      raise ValueError(
        f"{name} does not match {reference_name} at {jax.tree_util.keystr(path)}: "
        f"shape {jnp.shape(leaf)} != {jnp.shape(ref)}"
      )


def _first(items, n: int = 6) -> str:
  shown = " ".join(items[:n])
  return f"{shown} ... ({len(items) - n} more)" if len(items) > n else shown


def check_optimizer(value, name: str = "inner"):
  """Returns `value` when it is an optax-style transformation (callable `init` and `update`), else raises.

  The commonest slip is passing the factory (`optax.adam`) instead of the
  optimizer (`optax.adam(1e-3)`); the message says to call it.
  """
  if callable(getattr(value, "init", None)) and callable(getattr(value, "update", None)):
    return value
  if callable(value):
    fn = getattr(value, "__name__", None) or type(value).__name__
    module = getattr(value, "__module__", None) or ""
    shown = f"optax.{fn}" if module.split(".")[0] == "optax" else fn
    try:
      takes_lr = "learning_rate" in inspect.signature(value).parameters
    except (TypeError, ValueError):
      takes_lr = False
    example = f"{shown}(1e-3)" if takes_lr else f"{shown}(...)"
    raise TypeError(
      f"{name}={shown} is a function that makes an optimizer, not an optimizer: call it: {name}={example}"
    )
  raise TypeError(
    f"{name}={value!r} must be an optax GradientTransformation (e.g. optax.adam(1e-3)), got {type(value).__name__}"
  )


def describe(tree, depth: int = 2) -> str:
  """A short name for the container types of `tree` (for error messages): `tuple(ScaleByAdamState, EmptyState)`."""
  if isinstance(tree, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, numbers.Number)):
    return "array"
  name = type(tree).__name__
  if depth > 0 and isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
    return f"{name}({', '.join(describe(x, depth - 1) for x in tree)})"
  return name


def leaf_paths(tree) -> list[str]:
  """The key paths of the leaves of `tree`, as `jax.tree_util.keystr` writes them (`['w']`, `[0]['b']`)."""
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def zeros_like_sharded(x, dtype=None):
  """Zeros of `x`'s shape, carrying `x`'s sharding but not its varying manual axes.

  `jnp.zeros(shape)` drops the sharding (a full copy on one device, and a type
  that differs from `x`'s under Explicit mesh axes); `jnp.zeros_like` keeps it,
  but inside `jax.shard_map` it also keeps `x`'s varying axes, making zeros that
  should be the same on every device (a micro-step's zero updates) varying.
  """
  dtype = dtype_of(x) if dtype is None else jnp.dtype(dtype)
  if not isinstance(x, jax.core.Tracer):
    return jnp.zeros_like(x, dtype=dtype)  # a concrete array: its committed sharding
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is not None and any(axis is not None for axis in spec):
    # The sharding itself (its mesh included), not its bare spec: a bare PartitionSpec needs a mesh
    # context (`jax.set_mesh`), which a step jitted by make_train_step on Explicit axes does not enter.
    return jnp.zeros(jnp.shape(x), dtype, out_sharding=sharding)
  return jnp.zeros(jnp.shape(x), dtype)


def is_key(x) -> bool:
  """A typed PRNG key array (`jax.random.key`), or its abstract value."""
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _raw_key_shape() -> tuple[int, ...]:
  """The trailing shape of a raw key of the default PRNG implementation (uint32[2] for threefry)."""
  return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)


def _is_raw_key(x) -> bool:
  """A raw key array (`jax.random.PRNGKey`, or a stack of them): uint32[..., *key_shape] of the default impl."""
  tail = _raw_key_shape()
  shape = tuple(jnp.shape(x))
  return jnp.result_type(x) == jnp.uint32 and len(shape) >= len(tail) and shape[len(shape) - len(tail) :] == tail


def _is_counter(x) -> bool:
  """An integer or bool scalar beside keys (an `nnx.Rngs` stream's count): kept as it is, never folded."""
  return jnp.ndim(x) == 0 and (jnp.issubdtype(jnp.result_type(x), jnp.integer) or jnp.result_type(x) == jnp.bool_)


def fold_key(key, index, where: str = "key_argnum"):
  """`jax.random.fold_in(key, index)` for a typed key array of any shape, or a raw key (uint32[..., 2])."""
  if is_key(key):
    flat = key.reshape(-1)
    return jax.vmap(lambda k: jax.random.fold_in(k, index))(flat).reshape(key.shape)
  raw = jnp.asarray(key)
  if not _is_raw_key(raw):
    raise TypeError(
      f"{where} has a leaf of {raw.dtype}{list(raw.shape)}: a PRNG key is a typed key "
      f"(jax.random.key) or a raw uint32{list(_raw_key_shape())} key (jax.random.PRNGKey)"
    )
  tail = _raw_key_shape()
  flat = raw.reshape(-1, *tail)
  return jax.vmap(lambda k: jax.random.fold_in(k, index))(flat).reshape(raw.shape)


def key_mask(tree, where: str = "key_argnum") -> list[bool]:
  """Which leaves of a key tree are keys to fold, typed (`jax.random.key`) or raw (`jax.random.PRNGKey`).

  Integer scalars beside the keys (an `nnx.Rngs` state's counts) are kept (False). Any other leaf is refused by
  its path: it is neither a key nor a counter, cannot be told from a raw key of another shape or dtype, and
  passed on unchanged it would give every microbatch the same draws (issue 49). A tree with no key at all is
  refused too. `where` names the argument in the messages (`key_argnum`, `key`).
  """
  with_paths = jax.tree_util.tree_leaves_with_path(tree)
  if not any(is_key(x) or _is_raw_key(x) for _, x in with_paths):
    raise TypeError(
      f"{where} names an argument with no PRNG key in it (a tree of "
      f"{[f'{jnp.result_type(x)}{list(jnp.shape(x))}' for _, x in with_paths][:6]}): give a typed key "
      "(jax.random.key), a raw uint32[2] key (jax.random.PRNGKey), or a tree of them (an nnx.Rngs state)"
    )
  mask = []
  for path, x in with_paths:
    if not (is_key(x) or _is_raw_key(x) or _is_counter(x)):
      raise TypeError(
        f"{where}{jax.tree_util.keystr(path)} is {jnp.result_type(x)}{list(jnp.shape(x))}, beside PRNG keys: "
        "neither a key (typed jax.random.key, or raw uint32[2] from jax.random.PRNGKey) nor an integer scalar "
        "(a counter); it cannot be told from a key, and passed on unchanged it would give every microbatch "
        "the same draws. Pass keys (and counters) only in this argument"
      )
    mask.append(not _is_counter(x))
  return mask


def fold_keys(tree, index, where: str = "key_argnum"):
  """Every key of `tree` folded with `index` (see `key_mask`: typed and raw keys folded, counters kept)."""
  leaves, treedef = jax.tree.flatten(tree)
  mask = key_mask(tree, where)
  return jax.tree.unflatten(treedef, [fold_key(x, index, where) if m else x for x, m in zip(leaves, mask, strict=True)])


def bind_as_call(closed):
  """A function binding the closed jaxpr `closed` as ONE `closed_call` equation (consts passed as arguments).

  Replaying a traced jaxpr equation by equation (`jaxpr_as_fun`) costs a second trace of the whole program; one
  call equation costs nothing, and lowers to one function XLA inlines.
  """
  jaxpr, consts = closed.jaxpr, closed.consts
  if consts:
    jaxpr = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
  prim = jex_primitives.closed_call_p
  # How `eval_jaxpr` binds a call equation (jax 0.10 wants the body as a function too; 0.11 on, the jaxpr only).
  params = prim.get_bind_params({"call_jaxpr": jex_core.ClosedJaxpr(jaxpr, [])})
  return lambda *args: prim.bind(*consts, *args, **params)
