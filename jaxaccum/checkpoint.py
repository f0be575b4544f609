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

Checksums. orbax/TensorStore do not checksum array data: one flipped byte can
restore silently as a wrong value. `save` therefore writes, next to orbax's
files, `jaxaccum_manifest.json` holding

* the sha256 and size of every file orbax wrote, and the sha256 of every byte
  range that holds a leaf's data (from the OCDBT b-tree), so a damaged file is
  traced to the leaves it holds;
* per leaf: dtype, shape and the sha256 of its values (host bytes, C order;
  typed PRNG keys as their key data).

`restore` verifies every file before orbax reads anything, then every restored
leaf's values, and raises `CheckpointCorruptedError` (a ValueError) naming the
checkpoint, the file and the leaf. A checkpoint only becomes visible at `path`
once its manifest is written (it is saved under a temporary name and renamed),
so a checkpoint without a manifest was not written by this version of `save`
(an older jaxaccum, or plain orbax): `restore` reads it unverified and warns
(`UnverifiedCheckpointWarning`); turn the warning into an error with
`warnings.simplefilter("error", ja.checkpoint.UnverifiedCheckpointWarning)`.
A manifest that is there but cannot be read (a dangling link, a directory) is
damage (`CheckpointCorruptedError`), not a missing manifest.

Publishing. Each save writes into a temporary directory of its own
(`<path>.jaxaccum-tmp-<pid>-<host>-<random>`) and moves it to `path` with one
atomic rename (Linux renameat2: RENAME_NOREPLACE, or RENAME_EXCHANGE with
`overwrite`), so saves racing for one path (two jobs, two processes) never
touch each other's files: `path` holds one complete, verified checkpoint at
every moment, and every save either publishes or raises FileExistsError.
With `overwrite`, a symbolic link at `path` is replaced by the checkpoint, its
target left as it was.

Many processes (`jax.distributed`): as orbax, all processes call `save` and
`restore` with the same path on a filesystem they all see. Process 0 hashes the
files and writes the manifest. Value checksums cover the leaves whose whole
value each process holds (fully addressable, or fully replicated, arrays: the
usual data-parallel state); a leaf sharded across processes has no value
checksum (its bytes are still covered by the file checksums). Every process
verifies the files on restore (each reads the checkpoint once more).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import warnings
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxaccum import _unreduced

__all__ = ["save", "restore", "CheckpointCorruptedError", "UnverifiedCheckpointWarning", "MANIFEST"]

MANIFEST = "jaxaccum_manifest.json"
_FORMAT = "jaxaccum-checkpoint"
_VERSION = 1
_TMP_SUFFIX = ".jaxaccum-tmp"


class CheckpointCorruptedError(ValueError):
  """A checkpoint's files or values differ from the checksums `save` stored with it."""


class UnverifiedCheckpointWarning(UserWarning):
  """`restore` read a checkpoint that has no jaxaccum manifest, so nothing could be verified."""


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


def _host_value(x) -> np.ndarray | None:
  """The leaf's whole value on this host, as orbax stores it; None where this process holds only part of it."""
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:  # e.g. data-parallel params under jax.distributed: every process has it all
      return np.asarray(x.addressable_data(0))
    return None
  return np.asarray(x)


def _digest(value: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()


def _file_sha256(file: str, offset: int = 0, length: int | None = None) -> tuple[str, int]:
  """(sha256, bytes read) of `length` bytes from `offset` (the rest of the file if None)."""
  h, read = hashlib.sha256(), 0
  with open(file, "rb") as f:
    f.seek(offset)
    while length is None or read < length:
      chunk = f.read(1 << 20 if length is None else min(1 << 20, length - read))
      if not chunk:
        break
      h.update(chunk)
      read += len(chunk)
  return h.hexdigest(), read


def _files(path: str) -> list[str]:
  out = []
  for root, _, names in os.walk(path):
    out += [os.path.relpath(os.path.join(root, n), path) for n in names]
  return sorted(f for f in out if f != MANIFEST)


def _leaf_ranges(path: str, names) -> list[dict]:
  """The byte ranges of orbax's OCDBT store that hold leaf data, with the leaves each holds.

  Read from TensorStore's dump of the b-tree: an "indirect" value is a chunk of
  one leaf in a data file; a b-tree node holds the small leaves inline. Best
  effort: on any surprise in the dump format, no ranges (the whole-file
  checksums still catch every damage; only the leaf names are lost).
  """
  try:
    import tensorstore as ts  # noqa: PLC0415  (orbax's own dependency)

    base = ts.KvStore.open({"driver": "file", "path": path + os.sep}).result()
    versions = ts.ocdbt.dump(base).result()["versions"]
    by_key = {n.replace("/", "."): n for n in names}

    def leaf_of(key) -> str:
      key = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
      parts = key.split("/")  # "<leaf, '.'-joined>/<zarr chunk or .zarray>"
      for i in range(len(parts) - 1, 0, -1):
        if "/".join(parts[:i]) in by_key:
          return by_key["/".join(parts[:i])]
      return parts[0]

    ranges: dict[tuple[str, int, int], set[str]] = {}

    def add(location: str, leaves) -> None:
      # "btreenode::d/<id>:<offset>:<length>" or "value:ocdbt.process_0/:d/<id>:<offset>:<length>"
      ref, offset, length = location.split(":", 1)[1].lstrip(":").rsplit(":", 2)
      ranges.setdefault((ref.replace(":", ""), int(offset), int(length)), set()).update(leaves)

    def walk(location: str) -> None:
      node = ts.ocdbt.dump(base, location).result()
      inline = set()
      for entry in node.get("entries", []):
        for value in entry.values():
          if isinstance(value, str) and value.startswith("btreenode::"):
            walk(value)
        if "indirect_value" in entry:
          add(entry["indirect_value"], {leaf_of(entry["key"])})
        elif "inline_value" in entry:
          inline.add(leaf_of(entry["key"]))
      add(location, inline)

    if versions and "location" in versions[-1].get("root", {}):
      walk(versions[-1]["root"]["location"])
  except Exception:  # noqa: BLE001  (a format we do not know: file checksums only)
    return []
  out = []
  for (file, offset, length), leaves in sorted(ranges.items()):
    if not os.path.isfile(os.path.join(path, file)):
      return []
    digest, read = _file_sha256(os.path.join(path, file), offset, length)
    out.append(
      {
        "file": file,
        "offset": offset,
        "length": length,
        "sha256": digest if read == length else None,
        "leaves": sorted(leaves),
      }
    )
  return out


def _manifest_body_sha256(body: dict) -> str:
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_manifest(path: str, leaves: dict) -> None:
  files = {}
  for rel in _files(path):
    digest, size = _file_sha256(os.path.join(path, rel))
    files[rel] = {"sha256": digest, "size": size}
  body = {
    "format": _FORMAT,
    "version": _VERSION,
    "files": files,
    "leaves": leaves,
    "ranges": _leaf_ranges(path, list(leaves)),
  }
  with open(os.path.join(path, MANIFEST), "w") as f:
    json.dump({**body, "sha256": _manifest_body_sha256(body)}, f, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    ocp.multihost.sync_global_processes(name)


# --------------------------------------------------------------------------------------------
# Publishing a checkpoint: a temporary directory of its own per save, then one atomic rename.


def _host_id() -> int:
  """A 32-bit tag of this machine, so that a stale temporary directory is only judged on its own host."""
  return zlib.crc32(socket.gethostname().encode())


def _tmp_path(path: str) -> str:
  """`<path>.jaxaccum-tmp-<pid>-<host>-<random>`: a name no other save (another process, job or thread) uses.

  Under `jax.distributed` every process must write into the same directory:
  process 0 draws the name and broadcasts it.
  """
  tag = np.asarray([os.getpid(), _host_id() & 0x7FFFFFFF, secrets.randbits(31), secrets.randbits(31)], np.int32)
  if jax.process_count() > 1:
    tag = np.asarray(ocp.multihost.broadcast_one_to_all(tag))
  pid, host, r1, r2 = (int(v) for v in tag)
  return f"{path}{_TMP_SUFFIX}-{pid}-{host:08x}-{r1:08x}{r2:08x}"


def _remove_stale_tmps(path: str) -> None:
  """Removes temporary directories of earlier saves to `path` whose process (on this host) is gone.

  A save that was killed leaves its `<path>.jaxaccum-tmp-<pid>-...` (and orbax's
  own `....orbax-checkpoint-tmp*`) behind; a save still running (its process
  alive, or on another host) is never touched.
  """
  parent, base = os.path.split(path)
  pattern = re.compile(re.escape(base + _TMP_SUFFIX) + r"-(\d+)-([0-9a-f]{8})-[0-9a-f]{16}(\..*)?$")
  try:
    names = os.listdir(parent)
  except OSError:
    return
  for name in names:
    match = pattern.match(name)
    if not match or int(match.group(2), 16) != _host_id() & 0x7FFFFFFF:
      continue
    own = os.path.join(parent, name[: len(name) - len(match.group(3) or "")])
    if own in _ABANDONED or not _process_alive(int(match.group(1))):
      _remove_entry(os.path.join(parent, name))


# Temporary directories of saves in this process that failed: orbax may still create one of them from its
# own thread after the save raised; the next save to the same path removes it.
_ABANDONED: set[str] = set()


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # e.g. EPERM: it exists (another user's)
    return True
  return True


def _remove_entry(entry: str) -> None:
  """Removes a directory tree, or a file or a symbolic link itself (never what a link points to)."""
  if os.path.islink(entry) or not os.path.isdir(entry):
    try:
      os.unlink(entry)
    except FileNotFoundError:
      pass
  else:
    shutil.rmtree(entry, ignore_errors=True)


_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


def _load_renameat2():
  try:
    fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28 (Linux)
  except (AttributeError, OSError, TypeError):
    return None
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  fn.restype = ctypes.c_int
  return fn


_renameat2 = _load_renameat2()


def _rename(src: str, dst: str, flags: int) -> bool:
  """renameat2(src, dst, flags): True when done, False where the system or filesystem lacks it; else OSError."""
  if _renameat2 is None:
    return False
  if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
    return False
  raise OSError(err, os.strerror(err), dst)


def _publish(tmp: str, path: str, overwrite: bool) -> None:
  """Moves the finished checkpoint `tmp` to `path` atomically.

  Without `overwrite`: one rename that fails if anything (a checkpoint, a file,
  a link, even a dangling one) is at `path`. With it: one atomic exchange of
  `tmp` and what is at `path` (a symbolic link is exchanged as a link: its
  target is left alone), then the old entry is removed. Concurrent saves to the
  same path each exchange in turn, so `path` always holds one complete
  checkpoint and ends with the last one published. Without renameat2 (not
  Linux, or a filesystem without it) the old entry is first renamed aside, so
  `path` is briefly absent; the end state is the same.
  """
  appeared = f"path={path!r} appeared while saving (another save?); pass overwrite=True to replace it"
  if not overwrite:
    try:
      if _rename(tmp, path, _RENAME_NOREPLACE):
        return
      if os.path.lexists(path):
        raise FileExistsError(appeared)
      os.rename(tmp, path)
    except OSError as e:
      if isinstance(e, FileExistsError) or e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
        raise FileExistsError(appeared) from None
      raise
    return
  for attempt in range(1000):  # each retry means another save published in between: bounded, and rare
    try:
      if _rename(tmp, path, _RENAME_EXCHANGE):
        _remove_entry(tmp)  # now the old checkpoint (or link, or file)
        return
    except FileNotFoundError:  # nothing at `path` to exchange with
      try:
        if _rename(tmp, path, _RENAME_NOREPLACE):
          return
      except FileExistsError:
        continue  # another save got there first: exchange with it
    # No renameat2: move the old entry aside (a name of our own), then rename.
    aside = f"{tmp}.old{attempt}"
    try:
      os.rename(path, aside)
    except FileNotFoundError:
      pass
    try:
      os.rename(tmp, path)
    except OSError:  # another save's checkpoint arrived at `path` in between: it is complete; retry
      continue
    finally:
      _remove_entry(aside)
    return
  raise OSError(f"could not publish the checkpoint at {path!r}: other saves kept replacing it")


def save(path, tree, *, overwrite: bool = False) -> None:
  """Writes `tree` (a pytree of arrays) and its checksums to the directory `path`; returns once on disk.

  orbax writes into a temporary directory of this save's own,
  `<path>.jaxaccum-tmp-<pid>-<host>-<random>`; the manifest of checksums
  (`jaxaccum_manifest.json`, see the module docstring) is added, and only then
  is the directory renamed to `path`, in one atomic step: at no time does
  `path` hold a partial checkpoint. An interrupted save leaves no checkpoint at
  `path` (its temporary directory is removed by the next save to `path` on the
  same host once its process is gone; or delete it by hand). Saves to the same
  path from several processes at once are safe: each writes its own directory,
  and `path` ends holding one complete checkpoint (with `overwrite`, the one
  published last; without, the first, the others raising FileExistsError).

  With `overwrite=True`, what is at `path` is replaced as one directory entry: a
  symbolic link (e.g. `latest -> step_1`) is replaced by the new checkpoint
  directory and the checkpoint it pointed to is left as it was.

  Args:
    path: the checkpoint directory (created; it must not exist unless `overwrite`).
    tree: e.g. `(params, opt_state)`, a `ja.flax.TrainState`, an nnx `State`.
    overwrite: replace what is at `path` (a checkpoint, or a link: the link
      itself, never its target).

  Raises:
    FileExistsError: something is at `path` (a dangling link included) and
      `overwrite` is False, checked before writing and again at the rename.
    ValueError: a leaf is not an array or a Python number (a `str`), raised
      before anything is written.
  """
  path = _path(path)
  if not isinstance(overwrite, bool):
    raise TypeError(f"{overwrite=} must be a bool")
  if os.path.lexists(path) and not overwrite:
    raise FileExistsError(f"{path=} already exists; pass overwrite=True to replace it")
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      raise ValueError(
        f"tree{jax.tree_util.keystr(key_path)} has been deleted (donated to a jitted step?): "
        "save the arrays the step returned, e.g. params, opt_state, metrics = step(...)"
      )
  _check_leaves(tree)
  # Unreduced leaves (ja.accumulate(axis_name=)'s accumulator in the user's own jit) are saved as each device's
  # partial sum, stacked over the axis: restore gives every device its own bits back (see `_unreduced`).
  tree = jax.tree.map(lambda x: _unreduced.to_stacked(x) if _is_unreduced(x) else x, tree)
  tmp = _tmp_path(path)
  primary = jax.process_index() == 0
  if primary:
    _remove_stale_tmps(path)
  _sync("jaxaccum_checkpoint_save_start")
  leaves = {}
  for name, leaf in _flat(tree).items():
    value = _host_value(leaf)
    stored = _as_stored(_abstract(leaf if hasattr(leaf, "dtype") else np.asarray(leaf)))  # a Python scalar
    leaves[name] = {
      "dtype": str(np.dtype(stored.dtype)),
      "shape": list(stored.shape),
      "sha256": None if value is None else _digest(value),
    }
  failure: BaseException | None = None
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp, tree, force=True)
      checkpointer.wait_until_finished()
    if primary:
      _write_manifest(tmp, leaves)
      _publish(tmp, path, overwrite)
  except BaseException as e:
    failure = e
    if primary:  # nothing half-written stays behind: our own temporary directories only
      # orbax creates its `<tmp>.orbax-checkpoint-tmp*` in a thread of its own, which can still be running
      # when its save has raised (waiting on it can hang): what it makes after this is removed by the next
      # save to `path` (`_ABANDONED`).
      _ABANDONED.add(tmp)
      _remove_entry(tmp)
      _remove_orbax_tmps(tmp)  # orbax's own `<tmp>.orbax-checkpoint-tmp*`, our `<tmp>.old*`
    if jax.process_count() == 1:
      raise
  _sync("jaxaccum_checkpoint_save_done")  # no process returns before the checkpoint is at `path`
  if jax.process_count() > 1:
    published = bool(ocp.multihost.broadcast_one_to_all(np.asarray(failure is None, np.int32)))
    if failure is not None:
      raise failure
    if not published:
      raise RuntimeError(f"process 0 could not write or publish the checkpoint at {path}; see its error")


def _check_leaves(tree) -> None:
  """A ValueError naming the first leaf orbax cannot store (a str, an object), before any file is written."""
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
      raise ValueError(
        f"tree{jax.tree_util.keystr(key_path)} is a {type(leaf).__name__} ({leaf!r:.60}): ja.checkpoint.save "
        "stores arrays and Python numbers only. Keep other values out of the saved tree (e.g. write them "
        "with json beside the checkpoint), or make them static fields of the state's class"
      )


def _remove_orbax_tmps(tmp: str) -> None:
  parent, base = os.path.split(tmp)
  try:
    names = os.listdir(parent)
  except OSError:
    return
  for name in names:
    if name.startswith(base + "."):
      _remove_entry(os.path.join(parent, name))


def _default_device() -> jax.Device:
  """Where a leaf of `like` without a sharding is restored: jax's default device (one of this process's)."""
  device = jax.config.jax_default_device  # type: ignore[attr-defined, unused-ignore]  # a config option (typed on some jax)
  if isinstance(device, jax.Device):
    return device
  return jax.local_devices(backend=device if isinstance(device, str) else None)[0]


def _concrete_sharding(sharding, path):
  """`sharding`, with an abstract mesh (from `jax.eval_shape` of sharded arrays) made concrete, or raises."""
  mesh = getattr(sharding, "mesh", None)
  if not isinstance(mesh, jax.sharding.AbstractMesh):
    return sharding
  current = jax.sharding.get_mesh()
  if not current.empty and current.abstract_mesh == mesh:
    return jax.sharding.NamedSharding(current, sharding.spec, memory_kind=sharding.memory_kind)
  raise ValueError(
    f"like{jax.tree_util.keystr(tuple(path))} has a sharding over an abstract mesh ({mesh}), as jax.eval_shape gives "
    "for sharded arrays, which names no devices: restore inside `with jax.set_mesh(mesh):` for that mesh, give "
    "the leaf a concrete sharding (jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))), or "
    "none (sharding=None restores to the default device)"
  )


def _abstract(x, path=()):
  """The target orbax restores a leaf of `like` into; no sharding (numpy, a bare struct): the default device.

  Without this, orbax would take the sharding the checkpoint was saved with:
  arrays spread over devices the user did not ask for, and "Topology mismatch"
  in a process with other devices than the saving one.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    if x.sharding is None:
      return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(_default_device()), weak_type=x.weak_type
      )
    sharding = _concrete_sharding(x.sharding, path)
    return x if sharding is x.sharding else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if isinstance(x, (bool, int, float)) or isinstance(x, np.generic) and not hasattr(x, "shape"):
    return x  # a Python scalar (flax's TrainState.step=0): orbax restores it as one
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  if hasattr(x, "shape") and hasattr(x, "dtype"):  # numpy arrays and scalars
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(_default_device()))
  raise TypeError(
    f"like{jax.tree_util.keystr(tuple(path))} is a {type(x).__name__} ({x!r}); restore needs arrays, "
    "Python scalars or jax.ShapeDtypeStruct leaves"
  )


def _as_stored(abstract):
  """The shape and dtype orbax writes for a leaf: a typed PRNG key is stored as its raw key data."""
  if jax.dtypes.issubdtype(abstract.dtype, jax.dtypes.prng_key):
    return jax.eval_shape(jax.random.key_data, abstract)
  return abstract


def _damaged(path: str, what: str) -> CheckpointCorruptedError:
  return CheckpointCorruptedError(
    f"checkpoint at {path} is damaged: {what}. restore read no array from it and left every file as it "
    "was; restore an earlier checkpoint (or save again from a state you trust)"
  )


def _read_manifest(path: str) -> dict | None:
  file = os.path.join(path, MANIFEST)
  if not os.path.lexists(file):  # lexists: a dangling link is a manifest that cannot be read, not "no manifest"
    return None
  try:
    with open(file, "rb") as f:
      data = f.read()
  except OSError as e:  # a dangling link, a directory, no permission: the checkpoint cannot be verified
    reason = "a link to nothing" if os.path.islink(file) and not os.path.exists(file) else e.strerror or str(e)
    raise _damaged(path, f"its checksum manifest {MANIFEST!r} cannot be read ({reason})") from None
  try:
    manifest = json.loads(data.decode("utf-8"))
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("format") != _FORMAT or manifest.get("sha256") != _manifest_body_sha256(body):
      raise ValueError("checksum")
    if manifest["version"] > _VERSION:
      raise CheckpointCorruptedError(
        f"checkpoint at {path} was written by a newer jaxaccum (manifest version "
        f"{manifest['version']}); upgrade jaxaccum to restore it"
      )
  except CheckpointCorruptedError:
    raise
  except (ValueError, UnicodeDecodeError, KeyError, TypeError):
    raise _damaged(path, f"its checksum manifest {MANIFEST!r} is damaged (it fails its own checksum)") from None
  return manifest


def _verify_files(path: str, manifest: dict) -> None:
  """Raises CheckpointCorruptedError naming the first file (and its leaves) that differs from the manifest."""
  ranges: dict[str, list[dict]] = {}
  for r in manifest.get("ranges", []):
    ranges.setdefault(r["file"], []).append(r)
  for rel, want in sorted(manifest["files"].items()):
    file = os.path.join(path, rel)
    if not os.path.isfile(file):
      problem = "is missing"
    else:
      digest, size = _file_sha256(file)
      if size != want["size"]:
        problem = (
          f"is {'truncated' if size < want['size'] else 'longer than written'} ({size} bytes, save "
          f"wrote {want['size']})"
        )
      elif digest != want["sha256"]:
        problem = "differs from what save wrote (sha256 mismatch)"
      else:
        continue
    held = ranges.get(rel, [])
    if held:
      hit = [
        r
        for r in held
        if not os.path.isfile(file) or _file_sha256(file, r["offset"], r["length"]) != (r["sha256"], r["length"])
      ]
      leaves = sorted({leaf for r in (hit or held) for leaf in r["leaves"]})
      shown = ", ".join(repr(leaf) for leaf in leaves[:8]) + (f" and {len(leaves) - 8} more" if len(leaves) > 8 else "")
      what = (
        f"array data file {rel!r} {problem}; the damaged data belongs to leaf {shown}"
        if len(leaves) == 1
        else f"array data file {rel!r} {problem}; it holds the data of leaves {shown}"
      )
    elif rel.startswith("d" + os.sep) or (os.sep + "d" + os.sep) in rel:
      what = f"orbax data file {rel!r} {problem}"
    else:
      what = f"metadata file {rel!r} (orbax's record of the tree, shapes and dtypes) {problem}"
    raise _damaged(path, what)


def _verify_values(path: str, manifest: dict, restored) -> None:
  saved = manifest["leaves"]
  for name, leaf in _flat(restored).items():
    want = saved.get(name)
    if not want or want.get("sha256") is None:
      continue
    value = _host_value(leaf)
    if value is None or str(value.dtype) != want["dtype"] or list(value.shape) != want["shape"]:
      continue
    if _digest(value) != want["sha256"]:
      raise CheckpointCorruptedError(
        f"checkpoint at {path} is damaged: leaf {name!r} was restored with values that differ from those "
        "saved (sha256 of its values mismatch) although its files match their checksums; do not use this "
        "restored state"
      )


def restore(path, like):
  """Reads the checkpoint at `path` into the structure, dtypes and shardings of `like`, verifying checksums.

  Args:
    path: a directory written by `save`.
    like: a tree of the same structure as the saved one, of arrays or
      `jax.ShapeDtypeStruct`s (e.g. a freshly initialised state, or
      `jax.eval_shape` of its constructor). Restored arrays take each leaf's
      sharding; a leaf without one (a numpy array, a `jax.ShapeDtypeStruct`
      with `sharding=None`) restores to jax's default device, whatever
      sharding or device count the checkpoint was saved with (e.g. an fsdp
      checkpoint of 8 devices read in a process with 4). A sharding over an
      abstract mesh (`jax.eval_shape` of sharded arrays) is used with the mesh
      set by `jax.set_mesh` when it matches, else refused naming the leaf.
      An own-jit `ja.accumulate(axis_name=)` accumulator (unreduced) saved on
      P devices restores into a `like` on P' devices: its partial sums are
      re-laid, partial i added to device i mod P' (the same sum).

  Returns:
    A tree like `like` (same pytree types, static fields from `like`).

  Raises:
    FileNotFoundError: no checkpoint at `path`.
    CheckpointCorruptedError: (a ValueError) a file is missing, truncated or
      differs from its checksum, or a restored leaf's values differ from those
      saved; the message names the file and the leaf. Raised before orbax reads
      any array from a damaged file. A manifest that exists but cannot be read
      (a dangling link, a directory, no permission) is damage too, not "no
      manifest".
    ValueError: the checkpoint's tree differs from `like` (the message names
      the first differing path). In every case the files are left as they were.

  Warns:
    UnverifiedCheckpointWarning: the checkpoint has no manifest (written by
      jaxaccum before checksums, or by plain orbax); it is restored unverified.
  """
  path = _path(path)
  if not os.path.isdir(path) or not os.listdir(path):
    raise FileNotFoundError(f"no checkpoint at {path=}")
  abstract = jax.tree_util.tree_map_with_path(lambda p, x: _abstract(x, p), like)
  targets = abstract  # the unreduced leaves' own types, for after the read
  abstract = jax.tree.map(lambda x: _unreduced.stacked_struct(x) if _is_unreduced(x) else x, abstract)
  manifest = _read_manifest(path)
  if manifest is None:
    warnings.warn(
      f"checkpoint at {path} has no {MANIFEST} (written by jaxaccum before checkpoints carried "
      "checksums, or by plain orbax): restoring it without verifying its data",
      UnverifiedCheckpointWarning,
      stacklevel=2,
    )
  else:
    _verify_files(path, manifest)
  problem, restored = None, None
  with ocp.StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(path).item_metadata
    stored = metadata.tree if hasattr(metadata, "tree") else metadata
    stored = _flat(stored, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    relaid = _relaid(stored, _flat(abstract), _flat(targets))
    abstract = jax.tree_util.tree_map_with_path(lambda p, x: relaid.get(_name(p), (x,))[0], abstract)
    problem = _mismatch(path, stored, _flat(abstract))
    if problem is None:
      try:
        restored = checkpointer.restore(path, abstract)
      except ValueError as e:  # same leaves, other containers (e.g. adam's state against adamw's)
        if "structure" not in str(e):
          raise
        # orbax's message suggests restore options (partial_restore=...) that ja.checkpoint.restore does not take.
        problem = (
          f"checkpoint at {path} does not match like: the same leaves sit in other containers (e.g. the "
          f"state of another optimizer); checkpoint leaves: {sorted(stored)[:8]}"
        )
  # Raised outside the checkpointer's context, so that its shutdown runs first.
  if problem is not None:
    raise ValueError(problem)
  if manifest is not None:
    _verify_values(path, manifest, restored)
  # Partial sums saved on another number of devices: re-laid on this mesh's (see `_relaid`).
  restored = jax.tree_util.tree_map_with_path(
    lambda p, r: _relay(r, relaid[_name(p)][1]) if _name(p) in relaid else r, restored
  )
  return jax.tree.map(lambda t, r: _unreduced.from_stacked(r, t) if _is_unreduced(t) else r, targets, restored)


def _name(key_path) -> str:
  return "/".join(_key_name(k) for k in key_path)


def _relaid(stored: dict, wanted: dict, targets: dict) -> dict:
  """{name: (what to read, the stacked struct wanted)} for unreduced leaves saved on another device count.

  An unreduced leaf (`ja.accumulate(axis_name=)`'s accumulator in the user's
  own jit) is saved as its P partial sums, stacked; its value is their sum. A
  job resumed on P' != P devices (a preempted run on a smaller slice) reads the
  P partial sums to the default device and re-lays them, partial i added to
  device i mod P' (`_relay`): the sum over devices, which is all a window end
  reads, is the saved one, mid-window too.
  """
  out = {}
  for name, target in targets.items():
    if name not in stored or not _is_unreduced(target):
      continue
    have, want = stored[name], wanted[name]
    if tuple(have.shape) != tuple(want.shape) and tuple(have.shape[1:]) == tuple(want.shape[1:]):
      read = jax.ShapeDtypeStruct(
        tuple(have.shape), want.dtype, sharding=jax.sharding.SingleDeviceSharding(_default_device())
      )
      out[name] = (read, want)
  return out


def _relay(stacked, want):
  """The P partial sums of `stacked` as `want`'s P' (its leading size), partial i added to device i mod P'."""
  old = np.asarray(stacked)
  new = np.zeros(want.shape, old.dtype)
  for i in range(old.shape[0]):
    new[i % want.shape[0]] += old[i]
  return jax.device_put(new, want.sharding)


def _is_unreduced(x) -> bool:
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and bool(_unreduced.axes_of(x))


def _mismatch(path: str, stored: dict, wanted: dict) -> str | None:
  for name in sorted(set(stored) | set(wanted)):
    if name not in stored:
      return (
        f"checkpoint at {path} does not match like: like has a leaf at {name!r} that the checkpoint lacks "
        f"(checkpoint leaves: {sorted(stored)[:8]}...)"
      )
    if name not in wanted:
      return f"checkpoint at {path} does not match like: the checkpoint has a leaf at {name!r} that like lacks"
    w = wanted[name] if hasattr(wanted[name], "dtype") else np.asarray(wanted[name])  # a Python scalar
    s, w = stored[name], _as_stored(w)
    if tuple(s.shape) != tuple(w.shape) or np.dtype(s.dtype) != np.dtype(w.dtype):
      return (
        f"checkpoint at {path} does not match like at {name!r}: stored {s.dtype}{list(s.shape)}, "
        f"like {w.dtype}{list(w.shape)}"
      )
  return None
