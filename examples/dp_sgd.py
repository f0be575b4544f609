"""DP-SGD on the 8x8 digits: per-example clipping, a logical batch over devices, microbatches and calls.

  python examples/dp_sgd.py                     # train, then report test accuracy and epsilon
  python examples/dp_sgd.py --x64 --check --steps 3   # and compare with a plainly written DP-SGD step

Each update of DP-SGD (Abadi et al., 2016) takes a Poisson sample of the
training set (every example in with probability q = L / N, L the expected
batch size), clips each example's gradient to norm C, sums, adds Gaussian noise
N(0, sigma^2 C^2 I) once, and divides by L (not by the realised size: that
would make the sensitivity data dependent; opacus#420).

Here the logical batch spans
  - devices: 8 (simulated on CPU), each with its own rows, under `jax.shard_map`;
  - microbatches: `ja.micro_grad(..., num_microbatches=K)` holds K x fewer
    per-example gradients at a time;
  - accumulation calls: `ja.accumulate(inner, every_k=A, axis_name="data")`
    sums A calls locally and all-reduces once per logical batch.
`inner` adds the noise and normalises: it runs only at the window's end, once
per logical batch, and its own update count keys the noise. A Poisson batch of
any size is padded (`ja.pad_microbatches`, a row mask as weight) into A calls
of one compiled step: no recompiling, and padding microbatches are not run.
Privacy accounting: `dp-accounting` (`pip install "jaxaccum[dp]"`).
"""

from __future__ import annotations

import argparse
import math
from typing import NamedTuple

import common
import numpy as np


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=400, help="DP-SGD updates (logical batches; default 400)")
  parser.add_argument("--expected-batch-size", type=int, default=128, help="L = q N (default 128)")
  parser.add_argument("--k", type=int, default=2, help="microbatches per device per call (default 2)")
  parser.add_argument("--rows", type=int, default=4, help="rows per microbatch (default 4)")
  parser.add_argument("--clip", type=float, default=1.0, help="per-example L2 clipping norm C (default 1)")
  parser.add_argument("--noise-multiplier", type=float, default=1.5, help="sigma (default 1.5)")
  parser.add_argument("--lr", type=float, default=5e-3, help="adam learning rate (default 5e-3)")
  parser.add_argument("--delta", type=float, default=1e-5, help="delta of (epsilon, delta)-DP (default 1e-5)")
  parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--x64", action="store_true", help="float64")
  parser.add_argument("--check", action="store_true", help="also run a plainly written DP-SGD and compare")
  args = parser.parse_args()
  for name in ("steps", "expected_batch_size", "k", "rows", "devices"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  return args


args = parse_args()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)
if args.x64:
  jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum as ja  # noqa: E402

# --------------------------------------------------------------------------- data, model

images, labels = common.digits(args)
x_all = images.reshape(len(labels), -1)
n_train = 1437  # the first 80% train, the rest is the test set
x_train, y_train, x_test, y_test = x_all[:n_train], labels[:n_train], x_all[n_train:], labels[n_train:]
dtype = common.float_dtype(args)


def init_params(key):
  k1, k2 = jax.random.split(key)
  return {
    "w1": (jax.random.normal(k1, (64, 32)) / 8.0).astype(dtype),
    "b1": jnp.zeros(32, dtype),
    "w2": (jax.random.normal(k2, (32, 10)) / np.sqrt(32)).astype(dtype),
    "b2": jnp.zeros(10, dtype),
  }


def logits_fn(params, x):
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params, batch):
  """Mean cross-entropy over the batch's rows: micro_grad hands it one example (a batch of one) at a time."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, batch["x"]), batch["y"]).mean()


# --------------------------------------------------------------------------- DP-SGD with jaxaccum


def clip(grads):
  """Scales one example's gradient to norm at most C: its L2 sensitivity under add/remove is C."""
  norm = optax.tree.norm(grads)
  return jax.tree.map(lambda g: g * jnp.minimum(1.0, args.clip / norm), grads)


def gaussian_noise(key, count, tree):
  """N(0, I) shaped like `tree`, keyed by fold_in(key, count): one draw per update."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.fold_in(key, count), len(leaves))
  return jax.tree.unflatten(
    treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
  )


class NoisySumState(NamedTuple):
  count: jax.Array  # int32: logical batches noised so far; the noise key is fold_in(key, count)


def noisy_normalized_sum(*, calls_per_window, noise_std, expected_batch_size, key):
  """`ja.accumulate`'s inner: the window's clipped sum plus N(0, noise_std^2 I), divided by L.

  `ja.accumulate` hands `inner` the mean over the window's calls (weight 1
  each, over every device): times `calls_per_window` (A P) it is the clipped
  sum over the whole logical batch. It runs only at the window's end, so the
  noise is drawn once per logical batch.
  """

  def init(params):
    del params
    return NoisySumState(jnp.zeros([], jnp.int32))

  def update(mean, state, params=None):
    del params
    noise = gaussian_noise(key, state.count, mean)
    out = jax.tree.map(lambda g, z: (g * calls_per_window + noise_std * z) / expected_batch_size, mean, noise)
    return out, NoisySumState(state.count + 1)

  return optax.GradientTransformation(init, update)


n_dev = jax.device_count()
K, M, L = args.k, args.rows, args.expected_batch_size
rows_per_call = n_dev * K * M
# Calls per logical batch: room for L plus 10 standard deviations of the Poisson sample's size
# (sd <= sqrt(L)); a larger sample stops the run rather than being truncated.
A = max(1, math.ceil((L + 10 * math.sqrt(L) + 1) / rows_per_call))
q = L / n_train
noise_key = jax.random.key(args.seed + 1)
opt = optax.adam(args.lr)
tx = ja.accumulate(
  optax.chain(
    noisy_normalized_sum(
      calls_per_window=A * n_dev,
      noise_std=args.noise_multiplier * args.clip,
      expected_batch_size=L,
      key=noise_key,
    ),
    opt,
  ),
  every_k=A,
  axis_name="data",
)
per_example_grads = ja.micro_grad(
  loss_fn,
  num_microbatches=K,
  transform_fn=clip,
  metrics_fn=optax.tree.norm,
  weight_fn=lambda example: example["mask"].sum(),  # padding rows weigh 0: they add nothing
)


def per_device(state, f):
  """The accumulator's per-device fields (the rest of the state is replicated)."""
  return state._replace(
    acc_grads=jax.tree.map(f, state.acc_grads), acc_weight=f(state.acc_weight), num_skipped=f(state.num_skipped)
  )


def local_step(params, state, batch):
  """One call on one device: its clipped per-example sum, added to the accumulator (no collective)."""
  grads, aux = per_example_grads(lax.pcast(params, "data", to="varying"), batch)
  params, state = tx.update.apply_gradients(grads, per_device(state, lambda a: a[0]), params)
  return params, per_device(state, lambda a: a[None]), aux.metrics


def poisson_batches(seed):
  """Index arrays, one per update: each training example in with probability q."""
  rng = np.random.default_rng(seed)
  return [np.flatnonzero(rng.random(n_train) < q) for _ in range(args.steps)]


def layout(indices):
  """A calls' padded batches: microbatches of M rows (the last one masked), pad_microbatches per call."""
  if len(indices) > A * rows_per_call:
    raise SystemExit(f"a Poisson batch of {len(indices)} rows exceeds {A} calls x {rows_per_call} rows")
  micro = []
  for start in range(0, len(indices), M):
    rows = indices[start : start + M]
    mask = np.zeros(M, dtype)
    mask[: len(rows)] = 1
    pad = M - len(rows)
    micro.append(
      {
        "x": np.concatenate([x_train[rows], np.zeros((pad, 64), dtype)]),
        "y": np.concatenate([y_train[rows], np.zeros(pad, np.int32)]),
        "mask": mask,
      }
    )
  empty = {"x": np.zeros((M, 64), dtype), "y": np.zeros(M, np.int32), "mask": np.zeros(M, dtype)}
  per_call = n_dev * K
  calls = []
  for c in range(A):
    chunk = micro[c * per_call : (c + 1) * per_call] or [empty]
    batch, _ = ja.pad_microbatches(chunk, K, num_devices=n_dev)  # padding microbatches: mask 0, not run
    calls.append(batch)
  return calls


def train_jaxaccum(params, batches):
  mesh = ja.data_mesh()
  state = per_device(tx.init(params), lambda a: jnp.stack([a] * n_dev))
  spec = per_device(jax.tree.map(lambda _: P(), state), lambda _: P("data"))
  step = jax.jit(
    jax.shard_map(local_step, mesh=mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec, P("data"))),
    donate_argnums=(0, 1),
  )
  # Placed as the step returns them, so that the first call compiles the only version.
  params = ja.replicate(jax.tree.map(jnp.copy, params), mesh)
  state = jax.device_put(state, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), spec))
  for indices in batches:
    for call in layout(indices):
      params, state, _ = step(params, state, ja.shard_batch(call, mesh))
  assert int(state.update_count) == len(batches), (int(state.update_count), len(batches))
  return params, step._cache_size()


# --------------------------------------------------------------------------- the same, written plainly


def train_plain(params, batches):
  """DP-SGD as written in the paper: the realised batch at once, on one device, no padding."""

  @jax.jit
  def step(params, opt_state, x, y, t):
    grads = jax.vmap(lambda x1, y1: jax.grad(loss_fn)(params, {"x": x1[None], "y": y1[None]}))(x, y)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, args.clip / norms)
    clipped_sum = jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grads)
    noise = gaussian_noise(noise_key, t, clipped_sum)
    noisy = jax.tree.map(
      lambda s, z: (s + args.noise_multiplier * args.clip * z) / L, clipped_sum, noise
    )  # the same key, the same draw
    updates, opt_state = opt.update(noisy, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = opt.init(params)
  for t, indices in enumerate(batches):
    params, opt_state = step(params, opt_state, x_train[indices], y_train[indices], t)
  return params


def epsilon(steps: int) -> float | None:
  try:
    import dp_accounting  # noqa: PLC0415
  except ImportError:
    return None
  event = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(args.noise_multiplier)), steps
  )
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(event)
  return float(accountant.get_epsilon(args.delta))


def accuracy(params) -> float:
  return float(np.mean(np.argmax(np.asarray(logits_fn(params, x_test)), -1) == y_test))


print(
  f"DP-SGD on the digits: {args.steps} updates, expected batch L={L} of N={n_train} (q={q:.4f}), "
  f"C={args.clip}, sigma={args.noise_multiplier}; a logical batch = {A} calls x {n_dev} devices x K={K} "
  f"microbatches x {M} rows ({A * rows_per_call} rows of room), {'float64' if args.x64 else 'float32'}",
  flush=True,
)
params0 = init_params(jax.random.key(args.seed))
batches = poisson_batches(args.seed)
sizes = [len(b) for b in batches]
params, compiles = train_jaxaccum(params0, batches)
print(
  f"Poisson batch sizes {min(sizes)}..{max(sizes)} ({len(set(sizes))} distinct) ran in {compiles} compiled step",
  flush=True,
)
if args.check:
  reference = train_plain(params0, batches)
  print(f"max relative difference from the plain DP-SGD run: {common.max_rel_diff(params, reference):.1e}")
eps = epsilon(args.steps)
eps_text = f"{eps:.2f}" if eps is not None else "n/a (pip install 'jaxaccum[dp]' for dp-accounting)"
print(f"test accuracy {accuracy(params):.3f}   epsilon {eps_text} at delta={args.delta:g}", flush=True)
