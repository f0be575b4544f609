"""What the examples share: flags, device setup, the digits data and the check against the full batch.

Every example trains one model the plain full-batch way (the reference) and
then with jaxaccum in the mode(s) asked for, from the same initial parameters
on the same batches, and prints the largest relative difference of the final
parameters (and model state) from the reference: ~1e-16 in float64 (`--x64`),
~1e-6 in float32.
"""

from __future__ import annotations

import argparse

import numpy as np

MODES = ("accumulate", "microbatch", "data-parallel")


def parse_args(doc: str, *, steps: int = 30, batch_size: int = 64, k: int = 4, lr: float = 3e-3, extra=None):
  """The flags every example takes; `extra(parser)` adds an example's own."""
  parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  if extra is not None:
    extra(parser)
  parser.add_argument(
    "--mode",
    choices=MODES + ("all",),
    default="all",
    help="accumulate: ja.accumulate over K calls; microbatch: ja.microbatch in one step; "
    "data-parallel: ja.make_train_step over --devices devices; all: the three (default)",
  )
  parser.add_argument("--steps", type=int, default=steps, help=f"optimizer updates (default {steps})")
  parser.add_argument("--batch-size", type=int, default=batch_size, help=f"the large batch (default {batch_size})")
  parser.add_argument("--k", type=int, default=k, help=f"microbatches per update (default {k})")
  parser.add_argument("--lr", type=float, default=lr, help=f"adam learning rate (default {lr})")
  parser.add_argument(
    "--devices",
    type=int,
    default=8,
    help="CPU devices to simulate for data-parallel (default 8; a GPU/TPU uses what it has)",
  )
  parser.add_argument("--x64", action="store_true", help="float64: the differences shrink to ~1e-16")
  args = parser.parse_args()
  for name in ("steps", "batch_size", "k", "devices"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  if args.batch_size % args.k:
    parser.error(f"--batch-size={args.batch_size} must be divisible by --k={args.k}")
  args.modes = MODES if args.mode == "all" else (args.mode,)
  return args


def setup(args):
  """Configures jax (simulated CPU devices, float64) before anything touches a device; returns it."""
  import jax  # noqa: PLC0415

  jax.config.update("jax_num_cpu_devices", args.devices)
  if args.x64:
    jax.config.update("jax_enable_x64", True)
  if "data-parallel" in args.modes and args.batch_size % (jax.device_count() * args.k):
    raise SystemExit(
      f"--batch-size={args.batch_size} must be divisible by {jax.device_count()} devices "
      f"times --k={args.k} for data-parallel"
    )
  return jax


def float_dtype(args):
  return np.float64 if args.x64 else np.float32


def digits(args):
  """scikit-learn's bundled 8x8 digits (1,797 images, no download): images (N, 8, 8, 1) in [0, 1], labels."""
  from sklearn.datasets import load_digits  # noqa: PLC0415

  data = load_digits()
  return (data.images / 16.0).astype(float_dtype(args))[..., None], data.target.astype(np.int32)


def batch_indices(n: int, args, seed: int = 1) -> list[np.ndarray]:
  """One row-index array of --batch-size distinct rows per step."""
  rng = np.random.default_rng(seed)
  return [rng.choice(n, args.batch_size, replace=False) for _ in range(args.steps)]


def max_rel_diff(tree, reference) -> float:
  """max over leaves of max|a - b| / max|b|, computed in float64."""
  import jax  # noqa: PLC0415

  if jax.tree.structure(tree) != jax.tree.structure(reference):
    raise ValueError(f"trees differ: {jax.tree.structure(tree)} vs {jax.tree.structure(reference)}")
  worst = 0.0
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300)))
  return worst


def report(mode: str, diff: float, loss: float, against: str = "the full-batch run", extra: str = "") -> None:
  print(f"{mode:<14} max relative difference from {against}: {diff:.1e}   (last loss {loss:.4f}{extra})", flush=True)


def header(name: str, args, jax) -> None:
  dtype = "float64" if args.x64 else "float32"
  print(
    f"{name}: {args.steps} adam updates of batch {args.batch_size}, K={args.k} microbatches, {dtype}, "
    f"{jax.device_count()} {jax.default_backend()} devices",
    flush=True,
  )
