"""Benchmark section: what measuring the gradient noise scale costs.

`ja.accumulate(..., noise_scale_ema=beta)` against the same accumulate without
it: time per window of K=8 micro-steps (target <= 2% more), and the window
end's all-reduces on 8 devices, counted as instructions in compiled HLO with
their result sizes (target: the same count, two scalars more).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxaccum import _hlo
from jaxaccum.accumulate import accumulate
from jaxaccum.bench.accumulate import _transform_runner
from jaxaccum.bench.common import interleaved_medians, mlp_params


def _collectives(params, k: int, noise_scale_ema):
  tx = accumulate(optax.adam(1e-3), k, axis_name="data", noise_scale_ema=noise_scale_ema)
  n = jax.device_count()
  step = jax.pmap(lambda g, s: tx.update(g, s, params, weight=8.0), axis_name="data", in_axes=(0, None))
  grads = jax.tree.map(lambda p: jnp.ones((n, *p.shape), p.dtype), params)
  return _hlo.all_reduce_sizes(step.lower(grads, tx.init(params)).compile().as_text())


def run(quick: bool = False) -> list[dict]:
  width, depth, k = (128, 4, 8) if quick else (512, 4, 8)
  repeats = 3 if quick else 21
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  inner = optax.adam(1e-3)
  rows, data = [], {}
  for micro_batch in (8, 128):
    batches = [
      (
        jax.random.normal(jax.random.PRNGKey(i), (micro_batch, width)),
        jax.random.normal(jax.random.PRNGKey(1000 + i), (micro_batch, width)),
      )
      for i in range(k)
    ]
    plain, _, _ = _transform_runner(accumulate(inner, k), params, batches)
    tracked, _, _ = _transform_runner(accumulate(inner, k, noise_scale_ema=0.99), params, batches)
    times = interleaved_medians({"accumulate": plain, "accumulate + noise_scale_ema": tracked}, repeats)
    ratio = times["accumulate + noise_scale_ema"] / times["accumulate"]
    data[f"B={micro_batch}"] = {"k": k, "micro_batch": micro_batch, "seconds_per_window": times, "ratio": ratio}
    rows.append(
      f"| K={k}, B={micro_batch} | {times['accumulate'] * 1e3:.2f} | "
      f"{times['accumulate + noise_scale_ema'] * 1e3:.2f} | {100 * (ratio - 1):+.1f}% |"
    )
  comm = {name: _collectives(params, k, ema) for name, ema in (("off", None), ("on", 0.99))}
  data["all_reduces"] = {name: {"instructions": c, "elements": e} for name, (c, e) in comm.items()}
  params_elements = sum(x.size for x in jax.tree.leaves(params))
  markdown = "\n".join(
    [
      f"MLP {depth} x {width} ({params_elements:,} parameters), adam, float32; time per window of K "
      f"micro-steps through the plain update API, median of {repeats} interleaved repeats, jitted and donated. "
      "Target: <= 2% more with tracking.",
      "",
      "| case | ms / window | with noise_scale_ema | overhead |",
      "|---|---:|---:|---:|",
    ]
    + rows
    + [
      "",
      f"All-reduces of one step on {jax.device_count()} devices (compiled HLO, pmap): "
      f"{comm['off'][0]} instruction(s) of {comm['off'][1]:,} elements without tracking, "
      f"{comm['on'][0]} of {comm['on'][1]:,} with it (the two scalars sum w|g|^2 and K join the "
      "window end's all-reduce; no parameter-sized collective is added).",
    ]
  )
  return [{"title": "noise scale: cost of measuring it", "markdown": markdown, "data": data}]
