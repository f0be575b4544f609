"""Two processes under jax.distributed on 127.0.0.1 (gloo) equal one process on all the data."""

import os
import signal
import subprocess
import sys
import time

import _multihost_worker as worker
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _multihost import free_port, run_workers, worker_env

pytestmark = pytest.mark.slow  # worker processes under jax.distributed (pytest -m slow; .ci/run)

WORKER = os.path.join(os.path.dirname(__file__), "_multihost_worker.py")
TIMEOUT_S = 120


def test_two_processes_equal_one(tmp_path):
  out = tmp_path / "result.npz"
  run_workers(WORKER, worker.NUM_PROCESSES, out, TIMEOUT_S)

  # The reference: one process, the whole batch, adam written with optax's plain API.
  params, batch = worker.problem()
  opt = optax.adam(1e-2)
  state = opt.init(params)
  losses = []
  for _ in range(worker.STEPS):
    loss, grads = jax.value_and_grad(worker.loss_fn)(params, batch)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(loss)
  result = np.load(out)
  got = [result[f"arr_{i}"] for i in range(len(jax.tree.leaves(params)))]
  assert got[0].dtype == np.float64
  chex.assert_trees_all_close(got, jax.tree.leaves(params), rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(result["losses"], jnp.stack(losses), rtol=1e-12)


RECOVERY_WORKER = os.path.join(os.path.dirname(__file__), "_multihost_recovery_worker.py")


def _launch(outdir, mode, env):
  port = free_port()
  return [
    subprocess.Popen(
      [sys.executable, RECOVERY_WORKER, str(port), str(i), str(outdir), mode],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(worker.NUM_PROCESSES)
  ]


def _wait_all(runs, timeout_s):
  """{run: [(returncode, seconds since start, log)]}; kills whatever is still running after timeout_s."""
  start, ended = time.monotonic(), {}
  try:
    while len(ended) < sum(len(procs) for procs in runs.values()) and time.monotonic() - start < timeout_s:
      for name, procs in runs.items():
        for i, p in enumerate(procs):
          if (name, i) not in ended and p.poll() is not None:
            ended[name, i] = time.monotonic() - start
      time.sleep(0.1)
  finally:
    for procs in runs.values():
      for p in procs:
        if p.poll() is None:
          p.kill()
        p.wait(timeout=10)
  return {
    name: [(p.returncode, ended.get((name, i)), p.stdout.read()) for i, p in enumerate(procs)]
    for name, procs in runs.items()
  }


def test_a_failed_worker_ends_both_and_the_last_checkpoint_resumes_exactly(tmp_path):
  """One of two workers raises (or is killed) after the checkpoint of step 3: both end within the bound
  set by jax.distributed.initialize(heartbeat_timeout_seconds=...), and a fresh 2-process run restores
  step 3 bit for bit and finishes equal to an uninterrupted run."""
  import _multihost_recovery_worker as rw  # noqa: PLC0415

  env = worker_env()
  (tmp_path / "raise").mkdir()
  (tmp_path / "kill").mkdir()
  # Both failure modes at once (4 processes): the machine's startup time is paid once.
  failed = _wait_all({mode: _launch(tmp_path / mode, mode, env) for mode in ("raise", "kill")}, TIMEOUT_S)
  for mode, ((rc0, end0, log0), (rc1, end1, log1)) in failed.items():
    assert end0 is not None and end1 is not None, f"{mode}: a process hung:\n{log0[-2000:]}\n{log1[-2000:]}"
    assert rc1 == (1 if mode == "raise" else -signal.SIGKILL), log1[-3000:]
    if mode == "raise":
      assert "RuntimeError: worker 1 fails after step 3" in log1
    # The survivor is blocked in a collective: JAX terminates it (SIGABRT) once the failed process's
    # heartbeats stop, within heartbeat_timeout_seconds (no Python exception can be raised there).
    assert rc0 == -signal.SIGABRT, log0[-3000:]
    assert "stopped sending heartbeats" in log0
    assert end0 - end1 < rw.HEARTBEAT_S + 10, (mode, end0, end1)
    assert rw.checkpoints(str(tmp_path / mode)) == [1, 2, 3]

  resumed = _wait_all({"resume": _launch(tmp_path / "kill", "resume", env)}, TIMEOUT_S)["resume"]
  for i, (rc, _, log) in enumerate(resumed):
    assert rc == 0, f"resume process {i} failed:\n{log[-3000:]}"
  saved, restored = np.load(tmp_path / "kill" / "saved.npz"), np.load(tmp_path / "kill" / "restored.npz")
  assert len(saved.files) == len(restored.files) > 4
  for name in saved.files:  # what the failed run saved, as the fresh run restored it: bit for bit
    np.testing.assert_array_equal(restored[name], saved[name])

  # The uninterrupted run, written plainly: one process, the whole batch, adam on the mean gradient of
  # each window of EVERY_K steps (the last, incomplete, window applies nothing).
  params, batch = worker.problem()
  opt = optax.adam(1e-2)
  state, acc = opt.init(params), None
  for i in range(rw.STEPS):
    grads = jax.grad(worker.loss_fn)(params, batch)
    acc = grads if acc is None else jax.tree.map(jnp.add, acc, grads)
    if (i + 1) % rw.EVERY_K == 0:
      updates, state = opt.update(jax.tree.map(lambda g: g / rw.EVERY_K, acc), state, params)
      params, acc = optax.apply_updates(params, updates), None
  final = np.load(tmp_path / "kill" / "final.npz")
  got = [final[f"arr_{i}"] for i in range(len(jax.tree.leaves(params)))]
  chex.assert_trees_all_close(got, jax.tree.leaves(params), rtol=1e-12, atol=1e-15)


SLOWLINK_WORKER = os.path.join(os.path.dirname(__file__), "_multihost_slowlink_worker.py")


@pytest.mark.slow
def test_diloco_train_step_with_the_replica_axis_across_processes(tmp_path):
  """ja.diloco_train_step, process r = replica r, equals one process's shard_map + ja.diloco (1e-12)."""
  import _multihost_slowlink_worker as sw
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  import jaxaccum as ja

  out = tmp_path / "replica"
  run_workers(SLOWLINK_WORKER, sw.NUM_PROCESSES, out, TIMEOUT_S)
  params, (x, y) = sw.problem()
  inner, outer = sw.optimizers()
  tx = ja.diloco(inner, outer, sw.SYNC_EVERY, axis_name="r", **sw.OPTIONS)
  mesh = Mesh(np.array(jax.devices()[: sw.NUM_PROCESSES]), ("r",))
  head = lambda t: jax.tree.map(lambda a: a[0], t)
  stack = lambda t: jax.tree.map(lambda a: a[None], t)

  def body(params, state, batch):
    params, state = head(params), head(state)
    updates, state = tx.update(jax.grad(sw.loss_fn)(params, head(batch)), state, params)
    return stack(optax.apply_updates(params, updates)), stack(state)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))
  rep = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (sw.NUM_PROCESSES, *np.shape(a))), t)
  p, s = rep(params), rep(tx.init(params))
  split = (x.reshape(sw.NUM_PROCESSES, -1, 3), y.reshape(sw.NUM_PROCESSES, -1, 2))
  for _ in range(sw.STEPS):
    p, s = fn(p, s, split)
  n = len(jax.tree.leaves(params))
  for r in range(sw.NUM_PROCESSES):
    got = np.load(f"{out}.{r}.npz")
    leaves = [got[f"arr_{i}"] for i in range(2 * n)]
    want = [np.asarray(v)[r] for v in jax.tree.leaves(p)] + [np.asarray(v)[r] for v in jax.tree.leaves(s.anchor)]
    chex.assert_trees_all_close(leaves, want, rtol=1e-12, atol=1e-12)
