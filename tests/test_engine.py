"""The one train step: every option under every strategy, against a plainly written per-microbatch reference.

Each cell of the matrix (option x strategy) builds a step with that option
and compares one update, float64, with a reference written with jax and optax
alone: the microbatches the engine sees (device p's microbatch i holds rows
p B/P + i + K j), their gradients taken one by one, weighted, averaged, and
adam applied once. A cell is either exact (<= 1e-12) or refused for a stated
reason.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_init, regression_data
from jax.sharding import AxisType

import jaxaccum as ja

RTOL = 1e-12
K = 2
ROWS = 32  # 8 devices x K=2 microbatches x 2 rows
SIZES = (3, 8, 2)  # (3, 8) and (8, 2) and (8,) shard over 8 devices; the (2,) bias stays replicated
STRATEGIES = ("none", "ddp", "zero1", "fsdp", "fsdp_once", "hsdp")
OPTIONS = ("weights", "aux", "state", "grad_norms", "noise_scale", "skip_empty", "key", "comm_dtype")
# A cell that means nothing is refused; the reason is part of the contract.
REFUSED = {("comm_dtype", "none"): "needs a mesh"}


def masked_loss(params, batch, key=None):
  """Masked mean squared error over the microbatch's real rows (0/0 on an all-padding microbatch)."""
  err = jnp.sum((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
  loss = jnp.sum(batch["mask"] * err) / jnp.sum(batch["mask"])
  if key is not None:  # randomness that reaches the gradient
    loss = loss + 0.1 * jax.random.uniform(key) * jnp.sum(params[0]["b"])
  return loss


def aux_loss(params, batch):
  pred = mlp_apply(params, batch["x"])
  err = jnp.sum((pred - batch["y"]) ** 2, axis=-1)
  aux = {"pred": pred, "n": jnp.sum(err > 0.5), "m": jnp.mean(batch["x"]), "first": batch["x"][0, 0]}
  return masked_loss(params, batch), aux


def state_loss(params, state, batch):
  new = {"mean_x": jnp.mean(batch["x"], axis=0), "calls": state["calls"] + 1}
  return masked_loss(params, batch), new


AUX_RED = {"pred": "concat", "n": "sum", "m": "mean", "first": "last"}


def setup(option, strategy):
  """(step kwargs, mesh, data axis, batch, state or None, key or None)."""
  x, y = regression_data(jax.random.PRNGKey(1), ROWS)
  mask = np.ones(ROWS)
  if option in ("weights", "skip_empty"):
    mask[[0, 5, 6, 11, 30]] = 0.0  # unequal microbatch weights
  if option == "skip_empty":
    mask[[r for r in range(ROWS) if r % K == 1 and r < ROWS // 8]] = 0.0  # device 0's microbatch 1: all padding
  batch = {"x": x, "y": y, "mask": jnp.asarray(mask)}
  kwargs = dict(num_microbatches=K, donate=False)
  if strategy != "none":
    kwargs["strategy"] = "fsdp" if strategy == "fsdp_once" else strategy
    if strategy == "fsdp_once":
      kwargs["fsdp_gather"] = "once"
  if option in ("weights", "skip_empty"):
    kwargs["weight_fn"] = lambda b: jnp.sum(b["mask"])
  kwargs.update(
    {
      "aux": dict(has_aux=True, aux_reductions=AUX_RED),
      "state": dict(has_state=True, state_reductions={"mean_x": "mean", "calls": "last"}),
      "grad_norms": dict(grad_norms=True),
      "noise_scale": dict(noise_scale=True),
      "skip_empty": dict(skip_empty=True),
      "comm_dtype": dict(comm_dtype=jnp.float32),
    }.get(option, {})
  )
  mesh, axis = None, "data"
  if strategy == "hsdp":
    mesh, axis = jax.make_mesh((2, 4), ("rep", "shard"), axis_types=(AxisType.Auto,) * 2), ("rep", "shard")
  elif strategy != "none":
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  state = {"mean_x": jnp.zeros(3), "calls": jnp.zeros((), jnp.int32)} if option == "state" else None
  key = jax.random.PRNGKey(7) if option == "key" else None
  return kwargs, mesh, axis, batch, state, key


def microbatches(batch, devices):
  """(device, i, rows) in the engine's order: device p's block of rows, microbatch i = rows i, i + K, ..."""
  per = ROWS // devices
  return [(p, i, np.arange(p * per + i, (p + 1) * per, K)) for p in range(devices) for i in range(K)]


def reference(option, params, batch, state, key, devices):
  """One update and its metrics, written plainly: a loop over microbatches, weights, adam."""
  opt = optax.adam(1e-2)
  take = lambda rows: jax.tree.map(lambda v: v[rows], batch)
  mbs = microbatches(batch, devices)
  ws, grads, losses, norms, extra = [], [], [], [], []
  for p, i, rows in mbs:
    mb = take(rows)
    w = float(jnp.sum(mb["mask"])) if option in ("weights", "skip_empty") else 1.0
    ws.append(w)
    if w == 0:
      grads.append(None), losses.append(0.0), norms.append(0.0), extra.append(None)
      continue
    if option == "key":
      k = jax.random.fold_in(jax.random.fold_in(key, p), i)
      loss, g = jax.value_and_grad(masked_loss)(params, mb, k)
    else:
      loss, g = jax.value_and_grad(masked_loss)(params, mb)
    grads.append(g), losses.append(loss), norms.append(float(optax.tree.norm(g)))
    extra.append(
      aux_loss(params, mb)[1] if option == "aux" else state_loss(params, state, mb)[1] if option == "state" else None
    )
  total = sum(ws)
  real = [j for j, w in enumerate(ws) if w > 0]
  mean = jax.tree.map(
    lambda *gs: sum(ws[j] * g for j, g in zip(real, gs, strict=True)) / total, *[grads[j] for j in real]
  )
  updates, _ = opt.update(mean, opt.init(params), params)
  out = {"params": optax.apply_updates(params, updates), "loss": sum(ws[j] * losses[j] for j in real) / total}
  if option == "aux":
    pred = np.zeros((ROWS, 2))
    for (_, _, rows), e in zip(mbs, extra, strict=True):
      pred[rows] = e["pred"]
    out["aux"] = {
      "pred": pred,
      "n": sum(int(extra[j]["n"]) for j in real),
      "m": sum(ws[j] * extra[j]["m"] for j in real) / total,
      "first": extra[real[-1]]["first"],
    }
  if option == "state":
    out["state"] = {"mean_x": sum(ws[j] * extra[j]["mean_x"] for j in real) / total, "calls": 1}
  if option == "grad_norms":
    out["grad_norms"] = np.asarray(norms)
  if option == "noise_scale":  # McCandlish et al. (2018), unbiased for unequal sizes (b_i = w_i)
    s1 = sum(ws[j] * float(optax.tree.norm(grads[j])) ** 2 for j in real) / total
    s2 = float(optax.tree.norm(mean)) ** 2
    n = len(real)
    trace = (s1 - s2) * total / (n - 1)
    out["noise_scale"] = (s2 - trace / total, trace)
  return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_under_every_strategy(option, strategy):
  kwargs, mesh, axis, batch, state, key = setup(option, strategy)
  loss = {"aux": aux_loss, "state": state_loss}.get(option, masked_loss)
  opt = optax.adam(1e-2)
  if (option, strategy) in REFUSED:
    with pytest.raises(ValueError, match=REFUSED[option, strategy]):
      ja.make_train_step(loss, opt, mesh=mesh, data_axis=axis, **kwargs)
    return
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  step = ja.make_train_step(loss, opt, mesh=mesh, data_axis=axis, **kwargs)
  devices = 1
  if mesh is None:
    p, s, b = params, opt.init(params), batch
  else:
    devices = 8
    p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
    b = ja.shard_batch(batch, mesh, axis)
  args = (p, state, s, b) if state is not None else (p, s, b)
  out = step(*args) if key is None else step(*args, key)
  new_p, metrics = out[0], out[-1]
  want = reference(option, params, batch, state, key, devices)
  tol = dict(rtol=1e-5, atol=1e-7) if option == "comm_dtype" else dict(rtol=RTOL, atol=1e-15)
  assert bool(metrics["applied"])
  chex.assert_trees_all_close(jax.device_get(new_p), want["params"], **tol)
  np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=RTOL)
  if option == "aux":
    got = jax.device_get(metrics["aux"])
    assert jnp.issubdtype(got["n"].dtype, jnp.integer) and int(got["n"]) == want["aux"]["n"]
    chex.assert_trees_all_close(
      {n: got[n] for n in ("pred", "m", "first")},
      {n: want["aux"][n] for n in ("pred", "m", "first")},
      rtol=RTOL,
      atol=1e-15,
    )
  if option == "state":
    new_state = jax.device_get(out[1])
    np.testing.assert_allclose(new_state["mean_x"], want["state"]["mean_x"], rtol=RTOL)
    assert new_state["calls"].dtype == jnp.int32 and int(new_state["calls"]) == 1
  if option == "grad_norms":
    np.testing.assert_allclose(metrics["grad_norms"], want["grad_norms"], rtol=RTOL)
  if option == "noise_scale":
    ns = metrics["noise_scale"]
    np.testing.assert_allclose((ns.grad_sq, ns.trace_cov), want["noise_scale"], rtol=1e-10)
