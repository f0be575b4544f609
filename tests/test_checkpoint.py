"""ja.checkpoint: save mid-window, restore, continue == never interrupted, bit for bit."""

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import mlp_apply, mlp_init, mse_loss, regression_data
from flax import nnx

import jaxaccum as ja

K = 3
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def batches(n=7, rows=4):
  x, y = regression_data(jax.random.PRNGKey(1), n * rows)
  return [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(n)]


@jax.jit
def tx_step(params, state, batch):
  tx = ja.accumulate(optax.adam(0.05), K)
  updates, state = tx.update(jax.grad(mse_loss)(params, batch), state, params, weight=2.0)
  return optax.apply_updates(params, updates), state


def test_resume_params_and_accumulate_state_in_a_fresh_process(tmp_path):
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  data = batches()
  state = ja.accumulate(optax.adam(0.05), K).init(params)
  uninterrupted = (params, state)
  for batch in data:
    uninterrupted = tx_step(*uninterrupted, batch)

  carry = (params, state)
  for batch in data[:4]:
    carry = tx_step(*carry, batch)
  assert int(carry[1].micro_step) == 1  # mid-window: the partial sum must survive
  ja.checkpoint.save(tmp_path / "mid", carry)

  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {TESTS_DIR!r})
      import conftest  # float64, as in the parent
      import jax, optax
      import jaxaccum as ja
      import test_checkpoint as t
      params = conftest.mlp_init(jax.random.PRNGKey(1234), (3, 8, 2))  # other values: restore must overwrite
      like = (params, ja.accumulate(optax.adam(0.05), t.K).init(params))
      carry = ja.checkpoint.restore({str(tmp_path / "mid")!r}, like)
      assert int(carry[1].micro_step) == 1
      for batch in t.batches()[4:]:
        carry = t.tx_step(*carry, batch)
      ja.checkpoint.save({str(tmp_path / "end")!r}, carry)
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  resumed = ja.checkpoint.restore(tmp_path / "end", uninterrupted)
  assert isinstance(resumed[1], ja.AccumulateState)
  chex.assert_trees_all_equal(resumed, uninterrupted)


def test_resume_linen_trainstate(tmp_path):
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  create = lambda p: ja.flax.TrainState.create(
    apply_fn=mlp_apply, params=p, tx=ja.accumulate(optax.adam(0.05), K), batch_stats={"mean": jnp.zeros(3)}
  )

  @jax.jit
  def step(state, batch):
    stats = {"mean": 0.9 * state.batch_stats["mean"] + 0.1 * batch[0].mean(0)}  # stands in for BatchNorm
    return state.apply_gradients(grads=jax.grad(mse_loss)(state.params, batch), batch_stats=stats, weight=3.0)

  data = batches()
  uninterrupted = create(params)
  for batch in data:
    uninterrupted = step(uninterrupted, batch)
  state = create(params)
  for batch in data[:5]:
    state = step(state, batch)
  assert int(state.step) == 1 and int(state.micro_step) == 2
  ja.checkpoint.save(tmp_path / "ts", state)
  state = ja.checkpoint.restore(tmp_path / "ts", create(mlp_init(jax.random.PRNGKey(5), (3, 8, 2))))
  assert isinstance(state, ja.flax.TrainState) and state.apply_fn is mlp_apply
  assert int(state.step) == 1 and int(state.micro_step) == 2
  for batch in data[5:]:
    state = step(state, batch)
  assert int(state.step) == 2
  # The static tx is a new closure per create(); every array must match.
  chex.assert_trees_all_equal(state.replace(tx=uninterrupted.tx), uninterrupted)


class Net(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(3, 8, use_bias=False, param_dtype=jnp.float64, rngs=rngs)
    self.bn = nnx.BatchNorm(8, param_dtype=jnp.float64, rngs=rngs)
    self.bn.mean = nnx.BatchStat(jnp.zeros(8, jnp.float64))  # nnx creates them in float32
    self.bn.var = nnx.BatchStat(jnp.ones(8, jnp.float64))
    # Dropout keeps a typed PRNG key and a counter in the state: both must round-trip.
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.l2 = nnx.Linear(8, 2, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(jnp.tanh(self.bn(self.l1(x)))))


def test_resume_nnx_state(tmp_path):
  def make(seed):
    model = Net(nnx.Rngs(seed))
    return model, ja.flax.AccumulatingOptimizer(model, ja.accumulate(optax.adam(0.05), K), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    x, y = batch
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)

  data = batches()
  model, optimizer = make(0)
  for batch in data:
    step(model, optimizer, batch)
  uninterrupted = nnx.as_pure(nnx.state((model, optimizer)))

  model, optimizer = make(0)
  for batch in data[:4]:
    step(model, optimizer, batch)
  ja.checkpoint.save(tmp_path / "nnx", nnx.state((model, optimizer)))
  model, optimizer = make(9)  # other values: the restore must put them back
  restored = ja.checkpoint.restore(tmp_path / "nnx", nnx.state((model, optimizer)))
  nnx.update((model, optimizer), restored)
  assert int(optimizer.step[...]) == 1 and int(optimizer.micro_step) == 1
  for batch in data[4:]:
    step(model, optimizer, batch)
  assert int(optimizer.step[...]) == 2
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state((model, optimizer))), uninterrupted)


def _digest(directory):
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
  return out


def test_mismatched_tree_is_a_clear_error_and_leaves_the_files(tmp_path):
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  state = ja.accumulate(optax.sgd(0.1), K).init(params)
  path = tmp_path / "ck"
  ja.checkpoint.save(path, (params, state))
  before = _digest(path)
  assert before

  wider = mlp_init(jax.random.PRNGKey(0), (3, 9, 2))
  with pytest.raises(ValueError, match=r"'0/0/b'.*float64\[8\].*float64\[9\]"):
    ja.checkpoint.restore(path, (wider, ja.accumulate(optax.sgd(0.1), K).init(wider)))
  with pytest.raises(ValueError, match=r"like has a leaf at 'extra'"):
    ja.checkpoint.restore(path, {"extra": jnp.zeros(2), "0": params, "1": state})
  with pytest.raises(ValueError, match=r"'1/inner_state/0/trace/0/b'"):
    ja.checkpoint.restore(path, (params, ja.accumulate(optax.sgd(0.1, momentum=0.9), K).init(params)))
  as_f32 = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.float64 else x, (params, state))
  with pytest.raises(ValueError, match="float64.*float32"):
    ja.checkpoint.restore(path, as_f32)
  assert _digest(path) == before

  with pytest.raises(FileExistsError, match="overwrite"):
    ja.checkpoint.save(path, (params, state))
  with pytest.raises(FileNotFoundError):
    ja.checkpoint.restore(tmp_path / "nothing", params)
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    ja.checkpoint.restore(tmp_path / "empty", params)
  # The same leaves in other containers (adamw's chain has two more, leafless, states than adam's).
  p = {"w": jnp.ones(3)}
  ja.checkpoint.save(tmp_path / "adam", optax.adam(0.1).init(p))
  with pytest.raises(ValueError, match="does not match like"):
    ja.checkpoint.restore(tmp_path / "adam", optax.adamw(0.1).init(p))
  with pytest.raises(TypeError, match="path=3"):
    ja.checkpoint.save(3, params)
  with pytest.raises(TypeError, match="overwrite=1"):
    ja.checkpoint.save(tmp_path / "other", params, overwrite=1)
  with pytest.raises(TypeError, match=r"like\[1\] is a str"):
    ja.checkpoint.restore(path, (params, "not an array"))
  assert _digest(path) == before
  restored = ja.checkpoint.restore(path, (params, state))  # the checkpoint still reads
  chex.assert_trees_all_equal(restored, (params, state))
  np.testing.assert_array_equal(restored[1].micro_step, 0)


def _damaged_checkpoint_fixture(tmp_path):
  """A checkpoint with small leaves (inline in orbax's b-tree) and one 40x30 leaf (its own data range)."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  big = jnp.asarray(np.random.default_rng(0).normal(size=(40, 30)))  # random: zstd stores it raw
  tree = ({"params": params, "big": big}, ja.accumulate(optax.adam(0.05), K).init(params))
  path = tmp_path / "ck"
  ja.checkpoint.save(path, tree)
  manifest = json.loads((path / ja.checkpoint.MANIFEST).read_text())
  big_file = [r["file"] for r in manifest["ranges"] if r["leaves"] == ["0/big"]]
  assert len(big_file) == 1, manifest["ranges"]
  return path, tree, big_file[0]


def _flip(file, at=None):
  data = bytearray(file.read_bytes())
  at = len(data) // 2 if at is None else at
  data[at] ^= 0x40
  file.write_bytes(bytes(data))


def _restore_fails(path, like, capfd, match):
  """restore raises CheckpointCorruptedError matching `match`, prints nothing and leaves every file as it was."""
  before = _digest(path)
  capfd.readouterr()
  with pytest.raises(ja.checkpoint.CheckpointCorruptedError, match=match) as info:
    ja.checkpoint.restore(path, like)
  out, err = capfd.readouterr()
  assert out + err == "", (out + err)[-3000:]  # no TensorStore dump, no "Event loop is closed"
  assert _digest(path) == before
  assert isinstance(info.value, ValueError)
  message = str(info.value)
  assert str(path) in message and "partial_restore" not in message
  return message


def test_damaged_checkpoint_is_a_clear_error_naming_file_and_leaf(tmp_path, capfd):
  path, tree, big_file = _damaged_checkpoint_fixture(tmp_path)
  clean = {rel: (path / rel).read_bytes() for rel in _digest(path)}

  def reset():
    for rel in _digest(path):
      if rel not in clean:
        os.remove(path / rel)
    for rel, data in clean.items():
      (path / rel).parent.mkdir(parents=True, exist_ok=True)
      (path / rel).write_bytes(data)

  # One flipped byte in the big leaf's data (before checksums: restored silently with one wrong value).
  _flip(path / big_file)
  _restore_fails(path, tree, capfd, rf"array data file '{big_file}' differs.*leaf '0/big'")
  reset()
  # ... in orbax's b-tree node (small leaves are stored inline in it).
  node = [
    r["file"]
    for r in json.loads((path / ja.checkpoint.MANIFEST).read_text())["ranges"]
    if "0/params/0/w" in r["leaves"]
  ][0]
  _flip(path / node)
  _restore_fails(path, tree, capfd, rf"array data file '{node}' differs.*'0/params/0/w'")
  reset()
  # ... in the metadata: the checkpoint is damaged (not "like has an extra leaf").
  _flip(path / "_METADATA", at=40)
  message = _restore_fails(path, tree, capfd, r"is damaged: metadata file '_METADATA'")
  assert "like" not in message
  reset()
  # Truncated, and missing, files.
  (path / big_file).write_bytes(clean[big_file][:100])
  _restore_fails(path, tree, capfd, rf"'{big_file}' is truncated \(100 bytes, save wrote \d+\).*leaf '0/big'")
  reset()
  os.remove(path / big_file)
  _restore_fails(path, tree, capfd, rf"'{big_file}' is missing.*leaf '0/big'")
  reset()
  os.remove(path / "_sharding")
  _restore_fails(path, tree, capfd, r"metadata file '_sharding'.* is missing")
  reset()
  # A damaged manifest.
  _flip(path / ja.checkpoint.MANIFEST, at=60)
  _restore_fails(path, tree, capfd, r"manifest 'jaxaccum_manifest.json' is damaged")
  reset()

  # Damage the file checksums cannot see (here: the manifest rewritten to match a damaged file) is caught by
  # the leaf's value checksum once restored.
  _flip(path / big_file)
  manifest = json.loads((path / ja.checkpoint.MANIFEST).read_text())
  del manifest["sha256"]
  manifest["files"][big_file]["sha256"] = hashlib.sha256((path / big_file).read_bytes()).hexdigest()
  for r in manifest["ranges"]:
    if r["file"] == big_file:
      r["sha256"] = hashlib.sha256((path / big_file).read_bytes()[r["offset"] : r["offset"] + r["length"]]).hexdigest()
  manifest["sha256"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
  (path / ja.checkpoint.MANIFEST).write_text(json.dumps(manifest))
  _restore_fails(path, tree, capfd, r"leaf '0/big' was restored with values that differ")
  reset()

  restored = ja.checkpoint.restore(path, tree)  # the clean checkpoint still reads, bit for bit
  chex.assert_trees_all_equal(restored, tree)


def test_checkpoint_without_manifest_restores_with_a_warning(tmp_path):
  # As written by jaxaccum before checksums (plain orbax).
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "old", params)
  with pytest.warns(ja.checkpoint.UnverifiedCheckpointWarning, match="without verifying"):
    restored = ja.checkpoint.restore(tmp_path / "old", params)
  chex.assert_trees_all_equal(restored, params)
  # A fresh save leaves only the checkpoint (the temporary directory is renamed).
  ja.checkpoint.save(tmp_path / "new", params)
  assert sorted(os.listdir(tmp_path)) == ["new", "old"]
  assert (tmp_path / "new" / ja.checkpoint.MANIFEST).is_file()
  ja.checkpoint.save(tmp_path / "new", jax.tree.map(lambda x: x + 1, params), overwrite=True)
  chex.assert_trees_all_equal(ja.checkpoint.restore(tmp_path / "new", params), jax.tree.map(lambda x: x + 1, params))


def test_flax_trainstate_with_a_python_int_step_round_trips(tmp_path):
  """flax's own TrainState.create sets step=0, a Python int: save took it, restore must too."""
  from flax.training import train_state

  params = mlp_init(jax.random.PRNGKey(0), (3, 4, 2))
  state = train_state.TrainState.create(apply_fn=mlp_apply, params=params, tx=optax.adam(1e-2))
  assert isinstance(state.step, int)
  ja.checkpoint.save(tmp_path / "c", state)
  restored = ja.checkpoint.restore(tmp_path / "c", like=state)
  assert restored.step == 0
  chex.assert_trees_all_equal(restored.params, state.params)
  chex.assert_trees_all_equal(restored.opt_state, state.opt_state)
  with pytest.raises(TypeError, match=r"like\['w'\] is a str \('x'\)"):
    ja.checkpoint.restore(tmp_path / "c", like={"w": "x"})


def test_saving_a_donated_array_names_the_leaf(tmp_path):
  params = {"w": jnp.ones(3)}
  jax.jit(lambda p: jax.tree.map(lambda x: 2 * x, p), donate_argnums=0)(params)
  with pytest.raises(ValueError, match=r"tree\['w'\] has been deleted \(donated"):
    ja.checkpoint.save(tmp_path / "c", params)
  assert not os.path.exists(tmp_path / "c")


# ---------------------------------------------------------------------------------------------
# Issue 22: faults.

CONCURRENT_WORKER = os.path.join(TESTS_DIR, "_checkpoint_concurrent_worker.py")


def _leftovers(directory, keep):
  return sorted(n for n in os.listdir(directory) if n not in keep and not n.startswith("go"))


@pytest.mark.slow  # two worker processes saving at once
def test_concurrent_saves_to_one_path_leave_one_complete_checkpoint_and_every_process_exits(tmp_path):
  """Two processes saving to the same paths at once (before: they deleted each other's temporary directory, so
  a loser raised from inside orbax and could hang at exit, or the winner published a checkpoint failing
  verification). One publishes with renameat2, the other through the portable fallback."""
  import _checkpoint_concurrent_worker as worker  # noqa: PLC0415

  go = tmp_path / "go"
  runs = [(1, "atomic"), (2, "fallback")]
  procs = [
    subprocess.Popen(
      [sys.executable, CONCURRENT_WORKER, str(tmp_path), str(seed), str(go), "4", how],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for seed, how in runs
  ]
  try:
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{go}.ready{seed}") for seed, _ in runs):
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.poll() for p in procs]
      time.sleep(0.05)
    go.touch()  # both start saving together
    logs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:  # every process exits (a hang is killed and fails the test)
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
  for (seed, how), p, log in zip(runs, procs, logs, strict=True):
    assert p.returncode == 0 and "over: saved 4" in log, f"worker {seed} ({how}) failed:\n{log[-3000:]}"
  with warnings.catch_warnings():
    warnings.simplefilter("error", ja.checkpoint.UnverifiedCheckpointWarning)  # verified, manifest and all
    like = worker.tree(0)
    over = ja.checkpoint.restore(tmp_path / "over", like)
    new = ja.checkpoint.restore(tmp_path / "new", like)
  # With overwrite the path holds one complete checkpoint of one of the savers (the last published), bit for bit.
  assert int(over["step"]) in (1, 2)
  chex.assert_trees_all_equal(over, worker.tree(int(over["step"])))
  # Without overwrite exactly one save wins, and it is what the path holds; the other is a FileExistsError.
  won = [seed for (seed, _), log in zip(runs, logs, strict=True) if "new: saved" in log]
  assert len(won) == 1 and sum("new: exists" in log for log in logs) == 1, logs
  chex.assert_trees_all_equal(new, worker.tree(won[0]))
  assert _leftovers(tmp_path, {"over", "new"}) == []  # no temporary directory left behind


def test_save_over_a_symlink_replaces_the_link_and_leaves_its_target(tmp_path, monkeypatch):
  """`latest -> step_1` with overwrite=True (before: the whole checkpoint written, then "Cannot call rmtree on a
  symbolic link", naming no path, and `latest.jaxaccum-tmp` left behind)."""
  one, two, three = ({"w": jnp.full(3, float(i))} for i in (1, 2, 3))
  ja.checkpoint.save(tmp_path / "step_1", one)
  before = _digest(tmp_path / "step_1")
  os.symlink(tmp_path / "step_1", tmp_path / "latest")
  ja.checkpoint.save(tmp_path / "latest", two, overwrite=True)
  assert not os.path.islink(tmp_path / "latest") and os.path.isdir(tmp_path / "latest")
  chex.assert_trees_all_equal(ja.checkpoint.restore(tmp_path / "latest", one), two)
  assert _digest(tmp_path / "step_1") == before  # the link's target is untouched
  chex.assert_trees_all_equal(ja.checkpoint.restore(tmp_path / "step_1", one), one)
  assert sorted(os.listdir(tmp_path)) == ["latest", "step_1"]
  # The same without renameat2 (the portable fallback).
  os.symlink(tmp_path / "step_1", tmp_path / "latest2")
  monkeypatch.setattr(ja.checkpoint, "_renameat2", None)
  ja.checkpoint.save(tmp_path / "latest2", three, overwrite=True)
  assert not os.path.islink(tmp_path / "latest2")
  chex.assert_trees_all_equal(ja.checkpoint.restore(tmp_path / "latest2", one), three)
  assert _digest(tmp_path / "step_1") == before
  assert sorted(os.listdir(tmp_path)) == ["latest", "latest2", "step_1"]
  # Without overwrite, a link (even a dangling one) is something at `path`: refused before writing.
  os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
  with pytest.raises(FileExistsError, match=r"dangling'.* already exists; pass overwrite=True"):
    ja.checkpoint.save(tmp_path / "dangling", one)
  assert sorted(os.listdir(tmp_path)) == ["dangling", "latest", "latest2", "step_1"]


def test_a_failed_save_leaves_nothing_behind_and_stale_temporaries_are_removed(tmp_path, monkeypatch):
  params = {"w": jnp.ones(3)}

  def fail(*args):
    raise OSError("disk full")

  with monkeypatch.context() as m:
    m.setattr(ja.checkpoint, "_write_manifest", fail)
    with pytest.raises(OSError, match="disk full"):
      ja.checkpoint.save(tmp_path / "ck", params)
  assert os.listdir(tmp_path) == []
  # A killed save's temporary directory (its process gone) is removed by the next save to that path; a
  # running one (its process alive) is left alone.
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
  host = ja.checkpoint._host_id() & 0x7FFFFFFF
  stale = tmp_path / f"ck.jaxaccum-tmp-{int(dead.stdout)}-{host:08x}-{'0' * 16}"
  running = tmp_path / f"ck.jaxaccum-tmp-{os.getpid()}-{host:08x}-{'1' * 16}"
  for d in (stale, running, tmp_path / f"{stale.name}.orbax-checkpoint-tmp-123"):
    (d / "d").mkdir(parents=True)
  ja.checkpoint.save(tmp_path / "ck", params)
  assert sorted(os.listdir(tmp_path)) == ["ck", running.name]


def test_restore_into_structs_or_numpy_goes_to_the_default_device(tmp_path):
  """A leaf of `like` without a sharding restores to the default device, as documented (before: to the saved
  sharding over 8 devices; in a process with other devices, orbax's "Topology mismatch")."""
  mesh = jax.make_mesh((8,), ("data",))
  tree = lambda: {"w": jnp.arange(64.0).reshape(16, 4), "b": jnp.arange(8.0)}  # noqa: E731
  sharded = jax.device_put(tree(), jax.NamedSharding(mesh, jax.P("data")))  # as fsdp lays it out
  ja.checkpoint.save(tmp_path / "fsdp", sharded)
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for like in (jax.eval_shape(tree), jax.tree.map(np.asarray, tree())):
    restored = ja.checkpoint.restore(tmp_path / "fsdp", like)
    chex.assert_trees_all_equal(restored, tree())
    for leaf in jax.tree.leaves(restored):
      assert leaf.sharding == default, leaf.sharding
  # jax.eval_shape of sharded arrays gives shardings over an abstract mesh: no devices to restore to.
  abstract = jax.eval_shape(lambda t: t, sharded)
  with pytest.raises(ValueError, match=r"like\['b'\] has a sharding over an abstract mesh"):
    ja.checkpoint.restore(tmp_path / "fsdp", abstract)
  with jax.set_mesh(mesh):  # ... unless the mesh it abstracts is set
    restored = ja.checkpoint.restore(tmp_path / "fsdp", abstract)
  chex.assert_trees_all_equal(restored, tree())
  assert restored["w"].sharding.is_equivalent_to(sharded["w"].sharding, 2)

  # The case: the 8-device checkpoint restored in a process with 4 devices.
  script = textwrap.dedent(f"""
      import jax, jax.numpy as jnp, numpy as np
      jax.config.update("jax_num_cpu_devices", 4)
      jax.config.update("jax_enable_x64", True)
      import jaxaccum as ja
      tree = lambda: {{"w": jnp.arange(64.0).reshape(16, 4), "b": jnp.arange(8.0)}}
      for like in (jax.eval_shape(tree), jax.tree.map(np.asarray, tree())):
        restored = ja.checkpoint.restore({str(tmp_path / "fsdp")!r}, like)
        assert all(leaf.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
                   for leaf in jax.tree.leaves(restored)), restored
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree())))
      print("ok")
  """)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_an_unreadable_manifest_is_corruption_not_a_missing_one(tmp_path):
  """A manifest that is a dangling link (or a directory) cannot be read: the checkpoint is damaged (before: it
  counted as "no manifest", restore only warned and returned unverified data)."""
  params = {"w": jnp.ones(3)}
  path = tmp_path / "ck"
  ja.checkpoint.save(path, params)
  manifest = path / ja.checkpoint.MANIFEST
  os.rename(manifest, tmp_path / "moved.json")
  os.symlink(tmp_path / "nowhere.json", manifest)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ja.checkpoint.UnverifiedCheckpointWarning)
    with pytest.raises(
      ja.checkpoint.CheckpointCorruptedError,
      match=rf"checkpoint at {path} is damaged: its checksum manifest 'jaxaccum_manifest.json' cannot be read "
      r"\(a link to nothing\)",
    ):
      ja.checkpoint.restore(path, params)
    os.unlink(manifest)
    manifest.mkdir()
    with pytest.raises(
      ja.checkpoint.CheckpointCorruptedError, match=r"manifest 'jaxaccum_manifest.json' cannot be read"
    ):
      ja.checkpoint.restore(path, params)
  assert os.path.islink(manifest) is False and manifest.is_dir()  # restore changed nothing
  manifest.rmdir()
  os.rename(tmp_path / "moved.json", manifest)
  chex.assert_trees_all_equal(ja.checkpoint.restore(path, params), params)


def _settled(directory, want, seconds=3.0):
  """os.listdir(directory) once it equals `want`, or after `seconds` (orbax creates directories from a thread)."""
  end = time.monotonic() + seconds
  while sorted(os.listdir(directory)) != want and time.monotonic() < end:
    time.sleep(0.05)
  return sorted(os.listdir(directory))


def test_a_leaf_orbax_refuses_is_named_and_leaves_no_orbax_debris(tmp_path, monkeypatch):
  """A `str` leaf: refused by name before orbax starts (before: orbax's "Unsupported type" raised while its own
  thread went on to create `<tmp>.orbax-checkpoint-tmp` beside the checkpoint, and the next good save left it)."""
  before = set(threading.enumerate())
  with pytest.raises(ValueError) as refused:
    ja.checkpoint.save(tmp_path / "ck", {"w": jnp.ones(3), "name": "run-1"})
  for thread in set(threading.enumerate()) - before:  # orbax's, if it started any: let them finish
    with contextlib.suppress(Exception):  # orbax's threads re-raise their own failure from join
      thread.join(30)
  ja.checkpoint.save(tmp_path / "ck", {"w": jnp.ones(3)})
  assert sorted(os.listdir(tmp_path)) == ["ck"]
  assert "tree['name'] is a str" in str(refused.value)
  # A directory orbax's thread creates after a failed save has raised goes with the next save to the path.
  tmp = str(tmp_path / f"ck2.jaxaccum-tmp-{os.getpid()}-00000000-{'0' * 16}")
  monkeypatch.setattr(ja.checkpoint, "_tmp_path", lambda path: tmp)
  monkeypatch.setattr(ja.checkpoint, "_host_id", lambda: 0)
  with monkeypatch.context() as m:
    m.setattr(ja.checkpoint, "_write_manifest", lambda *a: exec("raise OSError('disk full')"))
    with pytest.raises(OSError, match="disk full"):
      ja.checkpoint.save(tmp_path / "ck2", {"w": jnp.ones(3)})
  os.makedirs(tmp + ".orbax-checkpoint-tmp")  # as orbax's thread would, late
  monkeypatch.setattr(ja.checkpoint, "_tmp_path", lambda path: tmp + "1")
  ja.checkpoint.save(tmp_path / "ck2", {"w": jnp.ones(3)})
  assert sorted(os.listdir(tmp_path)) == ["ck", "ck2"]
  np.testing.assert_array_equal(ja.checkpoint.restore(tmp_path / "ck2", like={"w": jnp.zeros(3)})["w"], np.ones(3))


def test_interrupted_and_misdirected_saves_leave_no_orbax_debris(tmp_path, monkeypatch):
  params = {"w": jnp.ones(3)}

  def interrupt(self):
    raise KeyboardInterrupt  # Ctrl-C while orbax writes in the background

  with monkeypatch.context() as m:
    m.setattr(ocp.StandardCheckpointer, "wait_until_finished", interrupt)
    with pytest.raises(KeyboardInterrupt):
      ja.checkpoint.save(tmp_path / "ck", params)
  assert _settled(tmp_path, []) == []
  (tmp_path / "file").write_text("not a directory")
  with pytest.raises(OSError):
    ja.checkpoint.save(tmp_path / "file" / "ck", params)
  assert _settled(tmp_path, ["file"]) == ["file"]
  ja.checkpoint.save(tmp_path / "ck", params)
  assert sorted(os.listdir(tmp_path)) == ["ck", "file"]


@pytest.mark.parametrize("saved_after,saved_on,resumed_on", [(1, 8, 4), (3, 8, 4), (2, 4, 8)])
def test_own_jit_partial_sums_resume_on_another_device_count(saved_after, saved_on, resumed_on, tmp_path):
  """ja.accumulate(axis_name=)'s unreduced accumulator saved on 8 devices, restored on a 4-device mesh (a
  preempted job resumed on a smaller slice), mid-window or at a window's end, and 4 -> 8: the partial sums are
  summed and re-laid, and the run equals the plain float64 one (before: "stored float64[8, ...], like [4, ...]")."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(5), 6 * 16)
  micro = [(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]) for i in range(6)]
  tx = ja.accumulate(optax.adam(0.1), 3, axis_name="data")

  @jax.jit
  def step(p, state, batch):
    grads = ja.grad(mse_loss, axis_name="data")(p, batch)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  def mesh_of(n):
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])

  def run(mesh, p, state, bs):
    with jax.set_mesh(mesh):
      for b in bs:
        p, state = step(p, state, jax.device_put(b, NamedSharding(mesh, P("data"))))
    return p, state

  mesh = mesh_of(saved_on)
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(p)
  p, state = run(mesh, p, state, micro[:saved_after])
  ja.checkpoint.save(tmp_path / "ck", (p, state))
  mesh = mesh_of(resumed_on)
  with jax.set_mesh(mesh):
    fresh_p = jax.device_put(params, NamedSharding(mesh, P()))
    like = (fresh_p, tx.init(fresh_p))
  p, state = ja.checkpoint.restore(tmp_path / "ck", like=like)
  assert all(a.sharding.mesh.size == resumed_on for a in jax.tree.leaves(state.acc_grads))
  p, state = run(mesh, p, state, micro[saved_after:])
  opt, ref = optax.adam(0.1), params  # plain float64: one adam step per window on its rows' mean gradient
  ref_state = opt.init(ref)
  for w in range(2):
    window = jax.tree.map(lambda *xs: jnp.concatenate(xs), *micro[3 * w : 3 * w + 3])
    updates, ref_state = opt.update(jax.grad(mse_loss)(ref, window), ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  chex.assert_trees_all_close(p, ref, rtol=1e-12, atol=1e-14)
  assert int(state.micro_step) == 0
