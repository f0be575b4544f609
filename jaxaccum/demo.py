"""python -m jaxaccum.demo: one model trained four ways that must agree.

A small Flax CNN on scikit-learn's bundled 8x8 digits (1,797 images, shipped
inside the package: nothing is downloaded) is trained with the same large
batch four ways:

  full batch      one plain jitted optax step per batch (the reference);
  accumulate      `ja.accumulate`: K update calls of one microbatch each;
  microbatch      `ja.microbatch`: one jitted step, a lax.scan over K microbatches;
  data parallel   `ja.make_train_step` over a mesh of devices (simulated on CPU).

It prints a table (final loss, test accuracy, largest parameter difference
from the full-batch run, time, compiled memory of one step) and saves a PNG of
the loss curves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    prog="python -m jaxaccum.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--steps", type=int, default=200, help="optimizer updates per method (default 200)")
  parser.add_argument("--batch-size", type=int, default=128, help="the large batch (default 128)")
  parser.add_argument("--k", type=int, default=4, help="microbatches per update (default 4)")
  parser.add_argument(
    "--devices", type=int, default=8, help="devices for the data-parallel run; simulated on CPU (default 8)"
  )
  parser.add_argument("--lr", type=float, default=3e-3, help="adam learning rate (default 3e-3)")
  parser.add_argument("--out", default="jaxaccum_demo_loss.png", help="where to save the loss plot")
  parser.add_argument("--x64", action="store_true", help="float64 (differences then shrink to ~1e-15)")
  parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
  args = parser.parse_args(argv)
  for name in ("steps", "batch_size", "k", "devices"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  if args.batch_size % args.k:
    parser.error(f"--batch-size={args.batch_size} must be divisible by --k={args.k}")
  if args.batch_size % args.devices:
    parser.error(f"--batch-size={args.batch_size} must be divisible by --devices={args.devices}")
  if (args.batch_size // args.devices) % args.k:
    parser.error(f"the per-device batch {args.batch_size // args.devices} must be divisible by --k={args.k}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax  # noqa: PLC0415  (configured before any device is used)

  try:
    jax.config.update("jax_num_cpu_devices", args.devices)
  except RuntimeError:
    pass
  if args.x64:
    jax.config.update("jax_enable_x64", True)
  if jax.device_count() < args.devices:
    print(f"only {jax.device_count()} devices: the data-parallel run uses all of them", file=sys.stderr)

  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import linen as nn  # noqa: PLC0415
  from sklearn.datasets import load_digits  # noqa: PLC0415
  from tqdm.auto import tqdm  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415

  dtype = jnp.float64 if args.x64 else jnp.float32
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float64 if args.x64 else np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(labels))
  train, test = order[:1500], order[1500:]

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(16, (3, 3), dtype=dtype, param_dtype=dtype)(x))
      x = nn.avg_pool(x, (2, 2), (2, 2))
      x = nn.relu(nn.Conv(32, (3, 3), dtype=dtype, param_dtype=dtype)(x))
      x = nn.avg_pool(x, (2, 2), (2, 2))
      x = x.reshape(x.shape[0], -1)
      return nn.Dense(10, dtype=dtype, param_dtype=dtype)(x)

  model = CNN()
  params0 = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1), dtype))["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  rng = np.random.default_rng(1)
  batches = []
  for _ in range(args.steps):
    idx = rng.choice(train, args.batch_size, replace=False)
    batches.append({"image": jnp.asarray(images[idx]), "label": jnp.asarray(labels[idx])})
  optimizer = optax.adam(args.lr)
  k = args.k

  def total_memory(compiled):
    m = compiled.memory_analysis()
    if m is None:
      return float("nan")
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes

  # -- the four ways ---------------------------------------------------------------
  def one_step_per_batch(grad_fn, name):
    """One jitted optax step per large batch; `grad_fn` returns (loss, grads) of the whole batch."""

    def step(params, state, batch):
      loss, grads = grad_fn(params, batch)
      updates, state = optimizer.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    params, state = jax.tree.map(jnp.copy, params0), optimizer.init(params0)
    memory = total_memory(step.lower(params, state, batches[0]).compile())
    losses = []
    for batch in progress(batches, name):
      params, state, loss = step(params, state, batch)
      losses.append(loss)
    return params, losses, memory

  def full_batch():
    return one_step_per_batch(jax.value_and_grad(loss_fn), "full batch")

  def accumulate():
    tx = ja.accumulate(optimizer, k)

    def step(params, state, micro):
      loss, grads = jax.value_and_grad(loss_fn)(params, micro)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    params, state = jax.tree.map(jnp.copy, params0), tx.init(params0)
    split = lambda batch, i: jax.tree.map(lambda x: x[i::k], batch)
    memory = total_memory(step.lower(params, state, split(batches[0], 0)).compile())
    losses = []
    for batch in progress(batches, "accumulate"):
      window = []
      for i in range(k):
        params, state, loss = step(params, state, split(batch, i))
        window.append(loss)
      losses.append(sum(window) / k)
    return params, losses, memory

  def microbatch():
    # A drop-in for jax.value_and_grad: the same step, a lax.scan over K microbatches inside.
    return one_step_per_batch(ja.microbatch(jax.value_and_grad(loss_fn), k), "microbatch")

  def data_parallel():
    mesh = ja.data_mesh("data", jax.devices()[: args.devices])
    step = ja.make_train_step(loss_fn, optimizer, num_microbatches=k, mesh=mesh)
    params, state = ja.replicate((jax.tree.map(jnp.copy, params0), optimizer.init(params0)), mesh)
    memory = total_memory(step.lower(params, state, ja.shard_batch(batches[0], mesh)).compile())
    losses = []
    for batch in progress(batches, f"data parallel x{mesh.size}"):
      params, state, metrics = step(params, state, ja.shard_batch(batch, mesh))
      losses.append(metrics["loss"])
    return params, losses, memory

  def progress(items, name):
    return items if args.no_progress else tqdm(items, desc=f"{name:>18}", leave=False)

  def accuracy(params):
    logits: Any = model.apply({"params": params}, jnp.asarray(images[test]))
    return float(jnp.mean(jnp.argmax(logits, -1) == labels[test]))

  results = {}
  for name, run in [
    ("full batch", full_batch),
    ("accumulate", accumulate),
    ("microbatch", microbatch),
    ("data parallel", data_parallel),
  ]:
    start = time.perf_counter()
    params, losses, memory = run()
    jax.block_until_ready(params)
    results[name] = dict(
      params=params, losses=[float(x) for x in losses], seconds=time.perf_counter() - start, memory=memory
    )

  reference = results["full batch"]["params"]
  print(
    f"\n{len(batches)} updates of batch {args.batch_size} (K={k} microbatches of "
    f"{args.batch_size // k}), adam lr={args.lr}, {jnp.dtype(dtype).name}, "
    f"{jax.device_count()} {jax.default_backend()} devices\n"
  )
  print("| method | final loss | test accuracy | max abs param diff vs full batch | time (s) | step memory (KiB) |")
  print("|---|---:|---:|---:|---:|---:|")
  for name, r in results.items():
    diff = max(
      float(jnp.max(jnp.abs(a - b)))
      for a, b in zip(jax.tree.leaves(r["params"]), jax.tree.leaves(reference), strict=False)
    )
    r["max_diff"] = diff
    print(
      f"| {name} | {r['losses'][-1]:.4f} | {accuracy(r['params']):.3f} | {diff:.1e} | "
      f"{r['seconds']:.1f} | {r['memory'] / 1024:.0f} |"
    )
  print(
    "\ntime: wall clock including compilation. step memory: XLA's compiled total of one jitted call "
    "(arguments + outputs - donated aliases + temporaries), per device; for accumulate that call "
    "is one micro-step."
  )

  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4))
  styles = ["-", "--", ":", "-."]
  for (name, r), style in zip(results.items(), styles, strict=False):
    ax.plot(r["losses"], style, label=name, linewidth=2)
  ax.set_xlabel("update")
  ax.set_ylabel("training loss (batch mean)")
  ax.set_title(f"Digits CNN, batch {args.batch_size}: four ways, one trajectory")
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  print(f"\nloss curves saved to {os.path.abspath(args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
