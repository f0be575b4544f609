"""Two processes under jax.distributed on 127.0.0.1 (gloo) equal one process on all the data."""

import os
import socket
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import _multihost_worker as worker

WORKER = os.path.join(os.path.dirname(__file__), "_multihost_worker.py")
TIMEOUT_S = 120


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
  out = tmp_path / "result.npz"
  port = free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
  procs = []
  try:
    for i in range(worker.NUM_PROCESSES):
      procs.append(subprocess.Popen([sys.executable, WORKER, str(port), str(i), str(out)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    for i, p in enumerate(procs):
      assert p.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)

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
