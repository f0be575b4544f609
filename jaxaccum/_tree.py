"""Small private helpers shared by the public modules: dtypes, casts, checks."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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


def cast_like(tree, like):
  """Casts every leaf of `tree` to the dtype of the matching leaf of `like`."""
  return jax.tree.map(lambda x, y: x.astype(y.dtype) if x.dtype != y.dtype else x, tree, like)


def all_finite(tree) -> jax.Array:
  """A scalar bool: True when no leaf of `tree` holds a NaN or an Inf."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  if not leaves:
    return jnp.asarray(True)
  return jnp.stack(leaves).all()


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
  if td != rd:
    raise ValueError(
        f"{name} does not match {reference_name}: tree structure {td} != {rd}")
  for path_and_leaf, ref in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(reference)):
    path, leaf = path_and_leaf
    if jnp.shape(leaf) != jnp.shape(ref):
      raise ValueError(
          f"{name} does not match {reference_name} at {jax.tree_util.keystr(path)}: "
          f"shape {jnp.shape(leaf)} != {jnp.shape(ref)}")
