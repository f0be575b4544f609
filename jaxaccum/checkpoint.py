"""Checkpoint helpers over orbax-checkpoint: save any state tree, restore it into a template.

Everything jaxaccum keeps between calls is arrays (an `AccumulateState` holds
the window's partial sum, its weight and `micro_step`), so a checkpoint taken
in the middle of a window resumes exactly: restore, continue, and the run is
bit-identical to one that was never interrupted. The recipe::

  ja.checkpoint.save(path, (params, opt_state))          # any time, mid-window too
  params, opt_state = ja.checkpoint.restore(path, like=(params, opt_state))

Works the same for a `ja.flax.TrainState` (its static `apply_fn`/`tx` come
from `like`) and for nnx state (`graphdef, state = nnx.split((model,
optimizer))`; restore into `state`, then `nnx.merge(graphdef, restored)` or
`nnx.update((model, optimizer), restored)`).

`restore` checks the checkpoint's tree against `like` before reading any
array: a missing or extra leaf, or a different shape or dtype, raises a
ValueError naming the path, and nothing on disk is touched.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["save", "restore"]


def _path(path) -> str:
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path={path!r} must be a str or os.PathLike")
  # orbax wants absolute paths.
  return os.path.abspath(os.fspath(path))


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _flat(tree, is_leaf=None) -> dict[str, Any]:
  """{"a/0/b": leaf}: paths as orbax writes them (NamedTuples and dataclasses become dicts)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {"/".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def save(path, tree, *, overwrite: bool = False) -> None:
  """Writes `tree` (a pytree of arrays) to the directory `path`; returns once it is on disk.

  Args:
    path: the checkpoint directory (created; it must not exist unless `overwrite`).
    tree: e.g. `(params, opt_state)`, a `ja.flax.TrainState`, an nnx `State`.
    overwrite: replace an existing checkpoint at `path`.

  Raises:
    FileExistsError: `path` exists and `overwrite` is False.
  """
  path = _path(path)
  if not isinstance(overwrite, bool):
    raise TypeError(f"{overwrite=} must be a bool")
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"{path=} already exists; pass overwrite=True to replace it")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree, force=overwrite)
    checkpointer.wait_until_finished()


def _abstract(x):
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  if hasattr(x, "shape") and hasattr(x, "dtype"):  # numpy arrays and scalars
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  raise TypeError(f"like holds a {type(x).__name__} leaf ({x!r}); restore needs arrays or jax.ShapeDtypeStruct")


def _as_stored(abstract):
  """The shape and dtype orbax writes for a leaf: a typed PRNG key is stored as its raw key data."""
  if jax.dtypes.issubdtype(abstract.dtype, jax.dtypes.prng_key):
    return jax.eval_shape(jax.random.key_data, abstract)
  return abstract


def restore(path, like):
  """Reads the checkpoint at `path` into the structure, dtypes and shardings of `like`.

  Args:
    path: a directory written by `save`.
    like: a tree of the same structure as the saved one, of arrays or
      `jax.ShapeDtypeStruct`s (e.g. a freshly initialised state, or
      `jax.eval_shape` of its constructor). Restored arrays take each leaf's
      sharding (a `jax.ShapeDtypeStruct` without one: the default device).

  Returns:
    A tree like `like` (same pytree types, static fields from `like`).

  Raises:
    FileNotFoundError: no checkpoint at `path`.
    ValueError: the checkpoint's tree differs from `like` (the message names
      the first differing path); the files are left as they were.
  """
  path = _path(path)
  if not os.path.isdir(path) or not os.listdir(path):
    raise FileNotFoundError(f"no checkpoint at {path=}")
  abstract = jax.tree.map(_abstract, like)
  with ocp.StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(path).item_metadata
    stored = metadata.tree if hasattr(metadata, "tree") else metadata
    stored = _flat(stored, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    wanted = _flat(abstract)
    for name in sorted(set(stored) | set(wanted)):
      if name not in stored:
        raise ValueError(f"checkpoint at {path} does not match like: like has a leaf at {name!r} that the "
                         f"checkpoint lacks (checkpoint leaves: {sorted(stored)[:8]}...)")
      if name not in wanted:
        raise ValueError(f"checkpoint at {path} does not match like: the checkpoint has a leaf at {name!r} "
                         "that like lacks")
      s, w = stored[name], _as_stored(wanted[name])
      if tuple(s.shape) != tuple(w.shape) or jax.numpy.dtype(s.dtype) != jax.numpy.dtype(w.dtype):
        raise ValueError(f"checkpoint at {path} does not match like at {name!r}: stored "
                         f"{s.dtype}{list(s.shape)}, like {w.dtype}{list(w.shape)}")
    try:
      return checkpointer.restore(path, abstract)
    except ValueError as e:  # same leaves, other containers (e.g. adam's state against adamw's)
      if "structure" not in str(e):
        raise
      raise ValueError(f"checkpoint at {path} does not match like: {e}") from None
