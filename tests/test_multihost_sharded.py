"""Sharded strategies on two processes (gloo, 127.0.0.1, 2 CPU devices each) equal one process on all the data."""

import os

import _multihost_sharded_worker as worker
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _multihost import run_workers

WORKER = os.path.join(os.path.dirname(__file__), "_multihost_sharded_worker.py")
TIMEOUT_S = 240


def reference():
  """One process, the whole batch, written plainly: (params, opt_state leaves, losses, total weights) per step.

  Device p of the 4 (batch order) holds rows [12 p, 12 (p + 1)); its microbatch i
  is its rows i, i + K, ...; their rows are scaled by uniform draws from
  fold_in(fold_in(key, p), i). The full-batch loss is the masked mean over all rows.
  """
  params, batch = worker.problem()
  key = jax.random.PRNGKey(worker.SEED)
  per_device = worker.ROWS // worker.DEVICES
  scale = np.zeros(worker.ROWS)
  for p in range(worker.DEVICES):
    for i in range(worker.K):
      rows = np.arange(p * per_device + i, (p + 1) * per_device, worker.K)
      draw = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, p), i), (len(rows),), jnp.float64)
      scale[rows] = 1.0 + 0.5 * np.asarray(draw)

  def loss(params):
    h = jnp.tanh(batch["x"] @ params[0]["w"] + params[0]["b"])
    err = jnp.sum((h @ params[1]["w"] + params[1]["b"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(batch["mask"] * scale * err) / jnp.sum(batch["mask"])

  opt = worker.optimizer()
  state = opt.init(params)
  losses = []
  for _ in range(worker.STEPS):
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = opt.update(grads, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    losses.append(value)
  return params, state, np.stack(losses), batch["mask"].sum()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """Runs the two workers once (every strategy in the same pair: start-up is paid once)."""
  out = tmp_path_factory.mktemp("multihost_sharded")
  run_workers(WORKER, worker.NUM_PROCESSES, out, TIMEOUT_S)
  return {
    (name, i): dict(np.load(out / f"{name}.{i}.npz")) for name, _, _ in worker.RUNS for i in range(worker.NUM_PROCESSES)
  }


@pytest.mark.slow  # the two worker processes (the `results` fixture)
@pytest.mark.parametrize("name", [name for name, _, _ in worker.RUNS])
def test_two_processes_equal_one(results, name):
  want_params, want_state, want_losses, want_weight = reference()
  for i in range(worker.NUM_PROCESSES):
    got = results[name, i]
    assert got["p0"].dtype == np.float64
    chex.assert_trees_all_close(
      [got[f"p{j}"] for j in range(len(jax.tree.leaves(want_params)))],
      jax.tree.leaves(want_params),
      rtol=1e-12,
      atol=1e-15,
    )
    # The optimizer state too (lamb's moments; the clip and lamb counters), gathered from its shards.
    chex.assert_trees_all_close(
      [got[f"s{j}"] for j in range(len(jax.tree.leaves(want_state)))],
      jax.tree.leaves(want_state),
      rtol=1e-12,
      atol=1e-15,
    )
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-12)
    np.testing.assert_array_equal(got["weights"], np.full(worker.STEPS, want_weight))


@pytest.mark.slow  # the two worker processes (the `results` fixture)
@pytest.mark.parametrize("name", [name for name, _, _ in worker.RUNS])
def test_per_device_bytes(results, name):
  """What one device holds: zero1 replicates params and shards state 4 ways; fsdp shards both 4 ways;
  hsdp shards both over its 2-device shard axis. The (2,) bias divides 2 but not 4: replicated over 4."""
  strategy = dict((n, s) for n, s, _ in worker.RUNS)[name]
  # The (2,) bias and lamb's two moments for it, where they stay replicated.
  bias_p, bias_s = (0, 0) if strategy == "hsdp" else (2 * 8, 2 * 2 * 8)
  shards = {"zero1": 4, "fsdp": 4, "hsdp": 2}[strategy]
  for i in range(worker.NUM_PROCESSES):
    got = results[name, i]
    total_p, total_s = int(got["total_params"]), int(got["total_state"])
    want_p = total_p if strategy == "zero1" else bias_p + (total_p - bias_p) // shards
    assert int(got["held_params"]) == want_p
    # The state's scalars (counts) are replicated too: at most a few dozen bytes beside the bias.
    sharded_s = (total_s - bias_s) // shards
    assert sharded_s + bias_s <= int(got["held_state"]) <= sharded_s + bias_s + 64


# --------------------------------------------------------------------------- one process, 8 devices: fixes


def _mesh8():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _masked_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params[0]["w"] + params[0]["b"])
  err = jnp.sum((h @ params[1]["w"] + params[1]["b"] - batch["y"]) ** 2, axis=-1)
  return jnp.sum(batch["w"] * err) / jnp.sum(batch["w"])


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_invalid_or_zero_weights_skip_the_step(strategy):
  """A negative (or NaN) row weight anywhere skips the step, as make_train_step does (before: a negative
  weight entered the weighted mean and moved the parameters); an all-zero batch skips it with loss 0."""
  import optax  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415
  from jaxaccum import sharded  # noqa: PLC0415

  mesh, opt = _mesh8(), optax.adam(1e-2)
  params, batch = worker.problem()
  rows = 32
  data = {"x": batch["x"][:rows], "y": batch["y"][:rows]}
  p, s = sharded.shard_train_state(params, opt, mesh, strategy=strategy)
  step = ja.make_train_step(
    _masked_loss, opt, strategy=strategy, mesh=mesh, num_microbatches=2, weight_fn=lambda b: b["w"].sum(), donate=False
  )
  compiled = None
  for weights, want_total in (
    (np.where(np.arange(rows) == 5, -5.0, 1.0), np.nan),
    (np.where(np.arange(rows) == 9, np.nan, 1.0), np.nan),
    (np.zeros(rows), 0.0),
  ):
    placed = jax.device_put(dict(data, w=weights), NamedSharding(mesh, P("data")))
    compiled = compiled or step.lower(p, s, placed).compile()
    p2, s2, metrics = compiled(p, s, placed, None)
    chex.assert_trees_all_equal(jax.device_get(p2), jax.device_get(p))
    chex.assert_trees_all_equal(jax.device_get(s2), jax.device_get(s))
    assert not bool(metrics["applied"])
    np.testing.assert_array_equal(metrics["total_weight"], want_total)
    if want_total == 0:
      assert float(metrics["loss"]) == 0.0
  # Valid weights: applied, the total is the sum of the weights.
  placed = jax.device_put(dict(data, w=np.full(rows, 0.5)), NamedSharding(mesh, P("data")))
  _, _, metrics = compiled(p, s, placed, None)
  assert bool(metrics["applied"]) and float(metrics["total_weight"]) == rows * 0.5


def test_ddp_sends_comm_dtype():
  """comm_dtype reaches ddp's all-reduce (before: silently ignored, the gradient went in float64)."""
  import optax  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415
  from jaxaccum import _hlo, sharded  # noqa: PLC0415

  mesh, opt = _mesh8(), optax.sgd(0.1)
  params, batch = worker.problem()
  data = {"x": batch["x"][:32], "y": batch["y"][:32], "w": np.ones(32)}
  p, s = sharded.shard_train_state(params, opt, mesh, strategy="ddp")
  step = ja.make_train_step(_masked_loss, opt, strategy="ddp", mesh=mesh, comm_dtype=jnp.float32)
  placed = jax.device_put(data, NamedSharding(mesh, P("data")))
  compiled = step.lower(p, s, placed).compile()
  n = sum(x.size for x in jax.tree.leaves(params))
  found = _hlo.collectives(compiled.as_text(), num_devices=8)
  # The gradient in float32; the total weight (float64) is reduced before the loop, so that the
  # wire carries the normalised gradient; the loss sum (float64) rides in an all-reduce of its own.
  got_sizes = sorted(c.operand_bytes for c in found)
  assert [(c.opcode, c.where) for c in found] == [("all-reduce", "top")] * len(found)
  assert got_sizes[-1] == 4 * n and all(b <= 2 * 8 for b in got_sizes[:-1]), got_sizes
  got, _, _ = compiled(p, s, placed, None)
  grads = jax.grad(_masked_loss)(params, data)
  want = jax.tree.map(lambda x, g: x - 0.1 * g, params, grads)
  chex.assert_trees_all_close(jax.device_get(got), want, rtol=1e-6, atol=1e-8)
  assert jax.tree.leaves(got)[0].dtype == jnp.float64


def test_donated_arguments_raise_instead_of_crashing():
  """Passing the params/opt_state a donating step consumed is a ValueError naming the leaf (before: XLA got
  deleted buffers and the process died with a segmentation fault on the 8-device mesh)."""
  import optax  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415
  from jaxaccum import sharded  # noqa: PLC0415

  mesh, opt = _mesh8(), optax.adam(0.1)
  params, batch = worker.problem()
  placed = jax.device_put(
    {"x": batch["x"][:32], "y": batch["y"][:32], "w": np.ones(32)}, NamedSharding(mesh, P("data"))
  )
  p, s = sharded.shard_train_state(params, opt, mesh, strategy="zero1")
  step = ja.make_train_step(_masked_loss, opt, strategy="zero1", mesh=mesh)
  new_p, new_s, _ = step(p, s, placed)
  with pytest.raises(ValueError, match=r"params\[0\]\['b'\] was deleted: it was donated"):
    step(p, new_s, placed)
  with pytest.raises(ValueError, match=r"opt_state.* was deleted"):
    step(new_p, s, placed)
  step(new_p, new_s, placed)  # the outputs are fine
