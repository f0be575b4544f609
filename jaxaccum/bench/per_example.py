"""Benchmark section: per-example clipped gradients, `ja.micro_grad` vs optax's and jax_privacy's.

The DP-SGD inner loop: per-example gradients of an MLP's loss, each clipped to
norm 1, summed, with the per-example norms returned. At B=256 rows and K in
{1, 8} microbatches (B/K per-example gradients alive at a time), side by side
in one run:

- `ja.micro_grad(loss, num_microbatches=K, transform_fn=clip, metrics_fn=norm)`;
- `optax.microbatching.micro_grad(loss, microbatch_size=B/K, ...)` (the same
  semantics; `ja.micro_grad` is built on `ja.microbatch` instead);
- `jax_privacy.clipping.clipped_grad(loss, l2_clip_norm=1, microbatch_size=B/K,
  return_grad_norms=True)` where jax-privacy is installed (optional: the
  library does not depend on it).

Time: `common.timed`, interleaved rounds of the jitted function. Memory: XLA's
compiled memory analysis (arguments + outputs - aliases + temp).
Touches no device at import.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import optax

from jaxaccum.bench.common import MIN_ROUNDS, mlp_batch, mlp_loss, mlp_params, ratio_cell, timed, timing_note
from jaxaccum.per_example import micro_grad
from jaxaccum.planner import compiled_memory_bytes

CLIP = 1.0


def _clip(grads):
  norm = optax.tree.norm(grads)
  return jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / norm), grads)


def _candidates(rows: int, k: int) -> dict:
  """name -> a function (params, batch) -> (clipped sum, per-example norms)."""

  def norms_of(grad_fn, field):
    def fn(params, batch):
      grads, aux = grad_fn(params, batch)
      return grads, getattr(aux, field)

    return fn

  out = {
    f"ja.micro_grad K={k}": norms_of(
      micro_grad(mlp_loss, num_microbatches=k, transform_fn=_clip, metrics_fn=optax.tree.norm), "metrics"
    ),
    f"optax.microbatching.micro_grad K={k}": norms_of(
      optax.microbatching.micro_grad(
        mlp_loss, microbatch_size=rows // k, transform_fn=_clip, metrics_fn=optax.tree.norm
      ),
      "metrics",
    ),
  }
  try:  # optional: the library does not depend on jax-privacy
    clipping = importlib.import_module("jax_privacy.clipping")
  except ImportError:
    return out
  out[f"jax_privacy clipped_grad K={k}"] = norms_of(
    clipping.clipped_grad(
      mlp_loss, l2_clip_norm=CLIP, batch_argnums=1, microbatch_size=rows // k, return_grad_norms=True
    ),
    "grad_norms",
  )
  return out


def run(quick: bool = False) -> list[dict]:
  width, depth, rows = (64, 2, 64) if quick else (256, 4, 256)
  # 21 rounds at least: its quartiles settle within 5% early, and a min-max over 11 rounds (the printed range)
  # missed a second run's median (0.88x [0.80, 0.91], then 0.92x).
  repeats = MIN_ROUNDS if quick else 21
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  batch = mlp_batch(jax.random.PRNGKey(1), rows, width)
  fns, memory = {}, {}
  reference = None
  for k in (1, 8):
    for name, fn in _candidates(rows, k).items():
      jitted = jax.jit(fn)
      memory[name] = compiled_memory_bytes(jitted.lower(params, batch).compile())
      grads, norms = jitted(params, batch)
      if reference is None:
        reference = (grads, norms)
      else:  # all compute the same thing (float32 rounding apart)
        diff = max(
          float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
          for a, b in zip(jax.tree.leaves((grads, norms)), jax.tree.leaves(reference), strict=True)
        )
        assert diff < 1e-4, (name, diff)
      fns[name] = lambda f=jitted: jax.block_until_ready(f(params, batch))
  t = timed(fns, "ja.micro_grad K=1", repeats)
  times = t["seconds"]
  md = [
    f"MLP {depth} x {width}, float32, B={rows}: per-example gradients clipped to norm {CLIP:g}, summed, "
    f"and the per-example norms; jitted. Memory: XLA's compiled "
    "memory analysis (arguments + outputs + temp). jax_privacy rows appear where jax-privacy is installed.",
    "",
    "| function | ms | vs ja.micro_grad K=1 | memory MiB |",
    "|---|---:|---:|---:|",
  ]
  md += [f"| {n} | {s * 1e3:.2f} | {ratio_cell(t['ratio'][n])} | {memory[n] / 2**20:.1f} |" for n, s in times.items()]
  md += ["", timing_note(t)]
  return [
    {
      "title": "micro_grad: per-example clipped gradients",
      "markdown": "\n".join(md),
      "data": {
        "width": width,
        "depth": depth,
        "batch": rows,
        "seconds": times,
        "memory_bytes": memory,
        "time_ratio_vs_micro_grad_k1": {n: q["median"] for n, q in t["ratio"].items()},
        "timing": t,
      },
    }
  ]
