"""Worker for tests/test_multihost_sharded.py: one of two processes under jax.distributed on 127.0.0.1.

Usage: python _multihost_sharded_worker.py PORT PROCESS_ID OUT_DIR. Configures JAX before any
device use (2 CPU devices per process, gloo collectives, float64), feeds only this process's
rows through ja.shard_batch and runs every strategy of RUNS in turn with
jaxaccum.sharded.make_sharded_train_step on state from ja.shard_train_state: each process
writes OUT_DIR/<run>.<process>.npz with the gathered parameters and optimizer state, the
losses and metrics, and the bytes its own devices hold.
"""

import sys

import numpy as np

NUM_PROCESSES, LOCAL_DEVICES, ROWS, STEPS, K = 2, 2, 48, 3, 2
DEVICES = NUM_PROCESSES * LOCAL_DEVICES
SEED = 42  # the PRNG key passed to the step
# (name, strategy, options). hsdp: replicas across the processes, shards within one (the layout
# hsdp is for: the slow link between hosts carries one all-reduce per step).
RUNS = (
  ("zero1", "zero1", {}),
  ("fsdp", "fsdp", {}),
  ("fsdp_once", "fsdp", {"fsdp_gather": "once"}),
  ("hsdp", "hsdp", {}),
)


def problem():
  """Deterministic params and data in numpy (the parent rebuilds the same).

  A masked batch: weight_fn counts the real rows of a microbatch. Device 1's
  microbatch 0 (global rows 12, 14, ..., 22: microbatch i of a device is its
  rows i, i + K, ...) is all padding, so its masked-mean loss is 0/0 = NaN and
  must add nothing.
  """
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 3))
  y = np.sin(x @ rng.normal(size=(3, 2)))
  mask = (rng.random(ROWS) > 0.25).astype(np.float64)
  mask[12:24:2] = 0.0
  # (3, 8) and (8,) shard on their 8, (8, 2) on its 8 rows; the (2,) bias stays replicated.
  params = [
    {"w": rng.normal(size=(3, 8)) / np.sqrt(3), "b": np.full(8, 0.1)},
    {"w": rng.normal(size=(8, 2)) / np.sqrt(8), "b": np.full(2, 0.1)},
  ]
  return params, {"x": x, "y": y, "mask": mask}


def optimizer():
  import optax  # noqa: PLC0415

  # Global quantities across the processes: the clipping norm and lamb's per-leaf trust ratios.
  return optax.chain(optax.clip_by_global_norm(0.5), optax.lamb(1e-2))


def loss_fn(params, batch, key):
  """Masked mean of the squared error, each row scaled by a random factor drawn from `key`."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  h = jnp.tanh(batch["x"] @ params[0]["w"] + params[0]["b"])
  err = jnp.sum((h @ params[1]["w"] + params[1]["b"] - batch["y"]) ** 2, axis=-1)
  scale = 1.0 + 0.5 * jax.random.uniform(key, err.shape, err.dtype)
  return jnp.sum(batch["mask"] * scale * err) / jnp.sum(batch["mask"])


def weight_fn(batch):
  return batch["mask"].sum()


def mesh_for(strategy):
  import jax  # noqa: PLC0415
  from jax.sharding import AxisType, Mesh  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415

  if strategy != "hsdp":
    return ja.data_mesh(), "data"  # Auto axis type
  # Row r of the mesh is process r's devices; Explicit axes (jax.make_mesh's default).
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  grid = np.array(devices).reshape(NUM_PROCESSES, LOCAL_DEVICES)
  return Mesh(grid, ("rep", "shard"), axis_types=(AxisType.Explicit,) * 2), ("rep", "shard")


def main(port: str, process_id: str, out_dir: str) -> None:
  from _multihost import init_distributed  # noqa: PLC0415  (tests/ is this script's directory)

  jax = init_distributed(port, process_id, NUM_PROCESSES, LOCAL_DEVICES)
  from jax.experimental import multihost_utils  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415

  assert jax.process_count() == NUM_PROCESSES and jax.device_count() == DEVICES
  params, batch = problem()
  rows = ROWS // NUM_PROCESSES
  mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
  local = {name: x[mine] for name, x in batch.items()}
  # A host value, the same on every process (the step must place it on the mesh itself).
  key = np.asarray(jax.random.key_data(jax.random.PRNGKey(SEED)))
  opt = optimizer()
  for name, strategy, options in RUNS:
    mesh, axes = mesh_for(strategy)
    p, s = ja.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=axes)
    step = ja.make_train_step(
      loss_fn, opt, strategy=strategy, mesh=mesh, data_axis=axes, num_microbatches=K, weight_fn=weight_fn, **options
    )
    placed = ja.shard_batch(local, mesh, axes)
    losses, weights = [], []
    for _ in range(STEPS):
      p, s, metrics = step(p, s, placed, key)
      losses.append(np.asarray(metrics["loss"].addressable_data(0)))
      weights.append(np.asarray(metrics["total_weight"].addressable_data(0)))
    here = set(jax.local_devices())
    # Bytes this process's first device holds, and the total (global) bytes.
    first = jax.local_devices()[0]
    held = {
      f"held_{what}": sum(
        sh.data.nbytes for x in jax.tree.leaves(tree) for sh in x.addressable_shards if sh.device == first
      )
      for what, tree in (("params", p), ("state", s))
    }
    totals = {
      f"total_{what}": sum(x.nbytes for x in jax.tree.leaves(tree)) for what, tree in (("params", p), ("state", s))
    }
    assert all(sh.device in here for x in jax.tree.leaves(p) for sh in x.addressable_shards)
    # Collective: every process takes part, each gets the full values.
    full_p = multihost_utils.process_allgather(p, tiled=True)
    full_s = multihost_utils.process_allgather(s, tiled=True)
    leaves = {f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(full_p))}
    leaves.update({f"s{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(full_s))})
    np.savez(
      f"{out_dir}/{name}.{jax.process_index()}.npz",
      losses=np.stack(losses),
      weights=np.asarray(weights),
      **held,
      **totals,
      **leaves,
    )
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
