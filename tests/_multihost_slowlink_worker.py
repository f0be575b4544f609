"""Worker for tests/test_multihost.py's slowlink case: one of two processes, each one replica of DiLoCo.

Usage: python _multihost_slowlink_worker.py PORT PROCESS_ID OUT_PREFIX. Two processes x 2 CPU
devices make a (replica=2, data=2) mesh whose replica axis crosses the processes (process r holds
replica r); each process feeds only its replica's rows and runs ja.diloco_train_step over a ddp
step; each writes its replica's parameters and anchor to OUT_PREFIX.<process>.npz.
"""

import sys

import numpy as np

NUM_PROCESSES, LOCAL_DEVICES, ROWS, STEPS, SYNC_EVERY = 2, 2, 32, 5, 4
OPTIONS = dict(fragments=2, delay=1, alpha=0.5, compress="int8", error_feedback=True)


def problem():
  """Deterministic data and params in numpy (the parent rebuilds the same)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 3))
  y = np.sin(x @ rng.normal(size=(3, 2)))
  params = [
    {"w": rng.normal(size=(3, 24)) / np.sqrt(3), "b": np.full(24, 0.1)},
    {"w": rng.normal(size=(24, 2)) / np.sqrt(24), "b": np.full(2, 0.1)},
  ]
  return params, (x, y)


def loss_fn(params, batch):
  import jax.numpy as jnp  # noqa: PLC0415

  x, y = batch
  h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
  return jnp.mean(jnp.sum((h @ params[1]["w"] + params[1]["b"] - y) ** 2, axis=-1))


def optimizers():
  import optax  # noqa: PLC0415

  return optax.adam(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True)


def main(port: str, process_id: str, out: str) -> None:
  from _multihost import init_distributed  # noqa: PLC0415  (tests/ is this script's directory)

  jax = init_distributed(port, process_id, NUM_PROCESSES, LOCAL_DEVICES)
  from jax.sharding import Mesh  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415

  with ja.fail_fast():
    mesh = Mesh(np.array(jax.devices()).reshape(NUM_PROCESSES, LOCAL_DEVICES), ("replica", "data"))
    assert {d.process_index for d in mesh.devices[jax.process_index()]} == {jax.process_index()}
    params, (x, y) = problem()
    inner, outer = optimizers()
    step = ja.make_train_step(loss_fn, inner, mesh=mesh, data_axis="data")
    dstep = ja.diloco_train_step(step, outer, SYNC_EVERY, **OPTIONS)
    rows = ROWS // NUM_PROCESSES
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    batch = ja.shard_batch((x[mine], y[mine]), mesh, axis_name=("replica", "data"))
    p, s = dstep.init(params)
    for _ in range(STEPS):
      p, s, _ = dstep(p, s, batch)
    mine_of = lambda tree: [np.asarray(leaf.addressable_data(0))[0] for leaf in jax.tree.leaves(tree)]
    np.savez(f"{out}.{jax.process_index()}.npz", *mine_of(p), *mine_of(s.anchor))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
