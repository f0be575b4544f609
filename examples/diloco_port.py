"""torchft's DiLoCo example, ported to `ja.diloco` (plain and streaming) under `jax.shard_map`.

  python examples/diloco_port.py --check          # float64: (a) against a plain loop over replicas
  python examples/diloco_port.py --steps 400      # float32, losses of (a), (b), (c)

Where it comes from. pytorch/torchft `examples/diloco/train_diloco.py`
(https://github.com/pytorch/torchft/blob/main/examples/diloco/train_diloco.py,
BSD-style licence), re-written here, not copied. The original trains a small
CNN on CIFAR-10 with `torchft.local_sgd.DiLoCo(manager, model,
inner_optimizer, outer_optimizer, sync_every=100)`: each replica group takes
its own shard of the data (`DistributedSampler`), runs
`AdamW(lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))` on its own batches
(batch 64), and every `sync_every` inner steps the pseudo-gradient
`original - local` is averaged over the groups and fed to
`SGD(lr=0.7, momentum=0.9, nesterov=True)` on the original parameters, which
every group then takes as its new parameters. The model adds row 0 of a
"useless" 1 GB embedding to its logits, to make the sync expensive.

What changed in the port:
- CIFAR-10 32x32x3 -> scikit-learn's 8x8 digits (1 channel, same
  `Normalize(0.5, 0.5)`); the CNN shrunk to fit (conv 3x3 -> 6, pool, conv 2x2
  -> 16, pool, fc 16 -> 32 -> 24 -> 10); the useless embedding is 4 x 10 (only
  row 0 has a gradient; AdamW's weight decay still shrinks the others);
- 2 replica groups (processes under torchft's `Manager`) -> 4 replicas on 4 of
  8 simulated CPU devices, one `jax.shard_map` over a "replica" axis; batch
  64 -> 16 per replica, `sync_every` 100 -> 20, a fixed number of steps; the
  fault tolerance, quorum, profiler and checkpoint hooks dropped;
- torch's default inits (uniform +-1/sqrt(fan_in); embedding N(0, 1)),
  written in jax; the initial parameters are the same on every replica (the
  Manager's first sync does that in the original).

Three runs on the same data from the same parameters:
  (a) plain `ja.diloco(adamw, nesterov sgd, 20, axis_name="replica")`, torchft's
      example as it is;
  (b) streaming: fragments=4, delay=1, alpha=0.5 (torchft's
      `fragment_sync_delay`, `fragment_update_alpha` for a model in 4 fragments);
  (c) (b) + compress="int4", error_feedback=True (torchft's `should_quantize`).
`fragments=4` splits the 11 leaves in `jax.tree.leaves` order into runs of
3, 3, 3, 2 leaves (76, 928, 802 and 280 parameters: a layer's bias and weight
can land in different fragments); `--fragments-by-module` passes a function
instead that groups them as torchft's `model_fragments` (modules) would.
Each run prints the training loss and the loss on all digits of the
replicas' parameters and of the anchor (`state.anchor`, the global model).
`--check` (float64) compares (a) with `reference_diloco`, the original's
algorithm written as a plain Python loop over replicas with AdamW and Nesterov
written out as torch documents them, and requires agreement to 1e-12.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=200, help="inner steps (default 200)")
parser.add_argument("--sync-every", type=int, default=20, help="H, inner steps per outer step (default 20)")
parser.add_argument("--batch-size", type=int, default=16, help="per replica (default 16)")
parser.add_argument("--lr", type=float, default=4e-4, help="inner AdamW learning rate (default 4e-4)")
parser.add_argument("--check", action="store_true", help="float64; check (a) against the plain loop over replicas")
parser.add_argument(
  "--fragments-by-module",
  action="store_true",
  help="(b), (c): fragments by module (a function) instead of fragments=4 (4 runs of leaves)",
)
parser.add_argument("--x64", action="store_true", help="float64 (implied by --check)")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # before anything touches a device
if args.check or args.x64:
  jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jaxaccum as ja  # noqa: E402

REPLICAS = 4
DTYPE = jnp.float64 if (args.check or args.x64) else jnp.float32
INNER = dict(weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8)  # torch AdamW's betas/eps, the example's decay
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


# --- the model (the original's Net, shrunk) -------------------------------------------------------------------------


def init_params(key):
  """torch's defaults: weights and biases uniform +-1/sqrt(fan_in); nn.Embedding N(0, 1)."""

  def dense(key, shape, fan_in):
    kw, kb = jax.random.split(key)
    bound = 1.0 / np.sqrt(fan_in)
    w = jax.random.uniform(kw, shape, DTYPE, -bound, bound)
    b = jax.random.uniform(kb, shape[-1:], DTYPE, -bound, bound)
    return {"w": w, "b": b}

  keys = jax.random.split(key, 6)
  return {
    "conv1": dense(keys[0], (3, 3, 1, 6), 3 * 3 * 1),
    "conv2": dense(keys[1], (2, 2, 6, 16), 2 * 2 * 6),
    "fc1": dense(keys[2], (16, 32), 16),
    "fc2": dense(keys[3], (32, 24), 32),
    "fc3": dense(keys[4], (24, 10), 24),
    "useless": jax.random.normal(keys[5], (4, 10), DTYPE),
  }


def forward(params, x):
  """x: [B, 8, 8, 1] -> logits [B, 10]."""

  def conv(p, x):
    y = lax.conv_general_dilated(x, p["w"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + p["b"]

  def pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

  x = pool(jax.nn.relu(conv(params["conv1"], x)))  # 6x6x6 -> 3x3x6
  x = pool(jax.nn.relu(conv(params["conv2"], x)))  # 2x2x16 -> 1x1x16
  x = x.reshape(x.shape[0], -1)
  x = jax.nn.relu(x @ params["fc1"]["w"] + params["fc1"]["b"])
  x = jax.nn.relu(x @ params["fc2"]["w"] + params["fc2"]["b"])
  x = x @ params["fc3"]["w"] + params["fc3"]["b"]
  return x + params["useless"][0]


def loss_fn(params, x, y):
  """nn.CrossEntropyLoss: the batch mean of -log softmax at the label."""
  logp = jax.nn.log_softmax(forward(params, x))
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


# --- the data: each replica its own shard, shuffled (DistributedSampler) --------------------------------------------


def make_data(steps, batch):
  digits = load_digits()
  x = (digits.images / 16.0 - 0.5) / 0.5  # ToTensor's [0, 1], then Normalize(0.5, 0.5)
  x = x[..., None].astype(np.float64)
  y = digits.target.astype(np.int32)
  rng = np.random.default_rng(0)
  shards = np.array_split(rng.permutation(len(y)), REPLICAS)
  idx = np.empty((steps, REPLICAS, batch), np.int64)
  for p, shard in enumerate(shards):
    order = np.concatenate([rng.permutation(shard) for _ in range(steps * batch // len(shard) + 1)])
    idx[:, p] = order[: steps * batch].reshape(steps, batch)
  return jnp.asarray(x, DTYPE), jnp.asarray(y), idx  # batch t of replica p: rows idx[t, p]


# --- the port: ja.diloco inside jax.shard_map over "replica" ---------------------------------------------------------


def make_tx(**streaming):
  inner = optax.adamw(args.lr, **INNER)
  outer = optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
  return ja.diloco(inner, outer, args.sync_every, axis_name="replica", **streaming)


def run_port(tx, params0, data, steps):
  """Every replica holds its own params and state: leading replica axis, sharded over "replica"."""
  x_all, y_all, idx = data
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:REPLICAS]), ("replica",))
  own = P("replica")

  def unstack(tree):  # this replica's block [1, ...] -> its value
    return jax.tree.map(lambda a: a[0], tree)

  def stack(tree):
    return jax.tree.map(lambda a: a[None], tree)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=own, out_specs=own)
  def init(params):
    return stack(tx.init(unstack(params)))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(own, own, own, own), out_specs=own)
  def step(params, state, x, y):
    params, state, x, y = unstack((params, state, x, y))
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return stack((optax.apply_updates(params, updates), state, loss))

  params = jax.tree.map(lambda a: jnp.broadcast_to(a, (REPLICAS, *a.shape)), params0)
  state = init(params)
  losses = []
  for t in range(steps):
    params, state, loss = step(params, state, x_all[idx[t]], y_all[idx[t]])
    losses.append(loss)
  return params, state, np.asarray(jnp.stack(losses))  # [steps, REPLICAS]


# --- the reference: the original's algorithm as a plain loop over replicas ------------------------------------------


def reference_diloco(params0, data, steps):
  """torchft DiLoCo with torch's AdamW and SGD(nesterov) written out; no optax, no collectives."""
  x_all, y_all, idx = data
  lr, wd, b1, b2, eps = args.lr, INNER["weight_decay"], INNER["b1"], INNER["b2"], INNER["eps"]
  grad = jax.jit(jax.value_and_grad(loss_fn))
  tmap = jax.tree.map
  theta = [params0] * REPLICAS
  m = [tmap(jnp.zeros_like, params0)] * REPLICAS
  v = [tmap(jnp.zeros_like, params0)] * REPLICAS
  original = params0  # torchft's original_parameters
  buf = tmap(jnp.zeros_like, params0)  # outer momentum buffer
  losses = np.zeros((steps, REPLICAS))
  for t in range(1, steps + 1):
    for p in range(REPLICAS):
      loss, g = grad(theta[p], x_all[idx[t - 1, p]], y_all[idx[t - 1, p]])
      losses[t - 1, p] = loss
      m[p] = tmap(lambda m, g: b1 * m + (1 - b1) * g, m[p], g)
      v[p] = tmap(lambda v, g: b2 * v + (1 - b2) * g * g, v[p], g)
      # torch AdamW: decay first (p *= 1 - lr wd), then p -= lr m_hat / (sqrt(v_hat) + eps)
      theta[p] = tmap(
        lambda th, m, v: th * (1 - lr * wd) - lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps),
        theta[p],
        m[p],
        v[p],
      )
    if t % args.sync_every == 0:
      pseudo = tmap(lambda o, *th: sum(o - x for x in th) / REPLICAS, original, *theta)  # all-reduce mean
      buf = tmap(lambda b, g: OUTER_MOMENTUM * b + g, buf, pseudo)
      original = tmap(lambda o, g, b: o - OUTER_LR * (g + OUTER_MOMENTUM * b), original, pseudo, buf)
      theta = [original] * REPLICAS
  return jax.tree.map(lambda *th: jnp.stack(th), *theta), losses


def full_loss(params, data):
  """The loss on all 1797 digits of each replica's parameters (leading axis), averaged over replicas."""
  x_all, y_all, _ = data
  return float(jnp.mean(jax.vmap(loss_fn, in_axes=(0, None, None))(params, x_all, y_all)))


def by_module(path, leaf):
  """torchft's `model_fragments` are modules: conv layers, fc1, fc2, fc3 with the embedding."""
  return {"conv1": 0, "conv2": 0, "fc1": 1, "fc2": 2, "fc3": 3, "useless": 3}[path[0].key]


def main():
  data = make_data(args.steps, args.batch_size)
  params0 = init_params(jax.random.key(0))
  H = args.sync_every
  frag = by_module if args.fragments_by_module else 4
  runs = {
    "(a) plain": {},
    "(b) streaming F=4 delay=1 alpha=0.5": dict(fragments=frag, delay=1, alpha=0.5),
    "(c) (b) + int4 + error feedback": dict(fragments=frag, delay=1, alpha=0.5, compress="int4", error_feedback=True),
  }
  print(f"{REPLICAS} replicas, {args.steps} steps, sync_every={H}, batch {args.batch_size}/replica, {DTYPE.__name__}")
  print(f"initial full-data loss {full_loss(jax.tree.map(lambda a: a[None], params0), data):.4f}")
  results = {}
  for name, streaming in runs.items():
    params, state, losses = run_port(make_tx(**streaming), params0, data, args.steps)
    results[name] = params, losses
    last = losses[-H:].mean()
    print(
      f"{name:38s} train loss (last {H} steps, replica mean) {last:.4f}; full-data loss: replicas "
      f"{full_loss(params, data):.4f}, anchor {full_loss(state.anchor, data):.4f}"
    )
  if args.check:
    ref_params, ref_losses = reference_diloco(params0, data, args.steps)
    params, losses = results["(a) plain"]
    diff = max(
      float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
    )
    ldiff = float(np.max(np.abs(losses - ref_losses)))
    print(f"(a) vs the plain loop over replicas: max |param diff| {diff:.3e}, max |loss diff| {ldiff:.3e}")
    assert diff < 1e-12 and ldiff < 1e-12, (diff, ldiff)
    print("check passed")


if __name__ == "__main__":
  main()
