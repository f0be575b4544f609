"""Shared pieces of the benchmark sections: the MLP, its data, sizes, timing and HLO copies.

Nothing here touches a device at import time (`python -m jaxaccum.bench` sets
the number of CPU devices first).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def mlp_params(key, width: int, depth: int):
  """`depth` square float32 layers of `width`: a list of {"w", "b"} dicts."""
  keys = jax.random.split(key, depth)
  return [
    {"w": jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width), "b": jnp.zeros((width,), jnp.float32)}
    for k in keys
  ]


def mlp_apply(params, x):
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def mlp_loss(params, batch):
  """Mean squared error of the MLP on `batch = (x, y)`."""
  x, y = batch
  return jnp.mean((mlp_apply(params, x) - y) ** 2)


def mlp_batch(key, rows: int, width: int):
  """A float32 regression batch `(x, y)` of `rows` rows."""
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (rows, width), jnp.float32), jax.random.normal(ky, (rows, width), jnp.float32)


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def interleaved_medians(runners: dict, repeats: int) -> dict:
  """Runs each runner twice to warm up, then `repeats` rounds in turn; median seconds per run.

  Interleaving spreads the shared machine's noise over every runner alike, so
  the ratios of one call are comparable even when the absolute times are not.
  """
  for run in runners.values():
    run()
    run()
  times: dict[str, list[float]] = {name: [] for name in runners}
  for _ in range(repeats):
    for name, run in runners.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def count_big_copies(hlo_text: str) -> int:
  """Copy instructions of non-scalar arrays in compiled HLO: what a pass-through costs."""
  count = 0
  for line in hlo_text.splitlines():
    if " copy(" in line:
      shape = line.split("=", 1)[1].split(" copy(")[0]
      count += "[]" not in shape
  return count
