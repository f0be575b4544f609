"""Worker for tests/test_multihost.py: one of two processes under jax.distributed on 127.0.0.1.

Usage: python _multihost_worker.py PORT PROCESS_ID OUT.npz. Configures JAX before any
device use (2 CPU devices, gloo collectives, float64), feeds only this process's rows
through ja.shard_batch and runs make_train_step; process 0 writes the results.
"""

import sys

import numpy as np

NUM_PROCESSES, LOCAL_DEVICES, ROWS, STEPS, K = 2, 2, 48, 3, 2


def problem():
  """Deterministic data and params in numpy (the parent rebuilds the same)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 3))
  y = np.sin(x @ rng.normal(size=(3, 2)))
  params = [
    {"w": rng.normal(size=(3, 8)) / np.sqrt(3), "b": np.full(8, 0.1)},
    {"w": rng.normal(size=(8, 2)) / np.sqrt(8), "b": np.full(2, 0.1)},
  ]
  return params, (x, y)


def loss_fn(params, batch):
  import jax.numpy as jnp  # noqa: PLC0415

  x, y = batch
  h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
  return jnp.mean(jnp.sum((h @ params[1]["w"] + params[1]["b"] - y) ** 2, axis=-1))


def main(port: str, process_id: str, out: str) -> None:
  from _multihost import init_distributed  # noqa: PLC0415  (tests/ is this script's directory)

  jax = init_distributed(port, process_id, NUM_PROCESSES, LOCAL_DEVICES)
  import optax  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415

  assert jax.process_count() == NUM_PROCESSES and jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES
  params, (x, y) = problem()
  rows = ROWS // NUM_PROCESSES
  mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
  mesh = ja.data_mesh()
  opt = optax.adam(1e-2)
  step = ja.make_train_step(loss_fn, opt, num_microbatches=K, mesh=mesh)
  p, s = ja.replicate(params, mesh), ja.replicate(opt.init(params), mesh)
  batch = ja.shard_batch((x[mine], y[mine]), mesh)
  losses = []
  for _ in range(STEPS):
    p, s, metrics = step(p, s, batch)
    losses.append(np.asarray(metrics["loss"].addressable_data(0)))
  flat = [np.asarray(leaf.addressable_data(0)) for leaf in jax.tree.leaves(p)]
  if jax.process_index() == 0:
    np.savez(out, *flat, losses=np.stack(losses))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
