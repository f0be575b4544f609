"""Benchmark section: ja.flax.TrainState vs optax.MultiSteps through flax's TrainState.

Time per window of K micro-steps, each a jitted, donated `apply_gradients`
step (gradient included), measured side by side with interleaved repeats;
only the ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxaccum.accumulate import accumulate
from jaxaccum.bench import accumulate as _ba
from jaxaccum.bench.common import count_big_copies, interleaved_medians, mlp_apply, mlp_loss, mlp_params


def _runner(state, batches):
  """A window of donated `apply_gradients` steps; returns (run, compiled HLO text)."""

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, batch):
    return state.apply_gradients(grads=jax.grad(mlp_loss)(state.params, batch))

  carry = [state]
  hlo = step.lower(state, batches[0]).compile().as_text()

  def run():
    for batch in batches:
      carry[0] = step(carry[0], batch)
    jax.block_until_ready(carry[0])

  return run, hlo


def run(quick: bool = False) -> list[dict]:
  from flax.training import train_state as flax_train_state  # noqa: PLC0415

  from jaxaccum import flax as ja_flax  # noqa: PLC0415

  width, depth, k = (128, 4, 16) if quick else (512, 4, 16)
  repeats = 3 if quick else 15
  micro_batch = 8
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  inner = optax.adam(1e-3)
  batches = [
    (
      jax.random.normal(jax.random.PRNGKey(i), (micro_batch, width)),
      jax.random.normal(jax.random.PRNGKey(1000 + i), (micro_batch, width)),
    )
    for i in range(k)
  ]
  fresh = lambda: jax.tree.map(jnp.copy, params)  # each runner owns (and donates) its buffers
  ms_run, ms_hlo = _runner(
    flax_train_state.TrainState.create(apply_fn=mlp_apply, params=fresh(), tx=optax.MultiSteps(inner, k)), batches
  )
  ja_run, ja_hlo = _runner(
    ja_flax.TrainState.create(apply_fn=mlp_apply, params=fresh(), tx=accumulate(inner, k)), batches
  )
  tx_run, _, _ = _ba._transform_runner(accumulate(inner, k), params, batches)
  times = interleaved_medians(
    {
      "flax TrainState + optax.MultiSteps": ms_run,
      "ja.flax.TrainState + ja.accumulate": ja_run,
      "ja.accumulate, plain optax API": tx_run,
      "add-only floor (two jitted functions)": _ba._add_only_runner(inner, params, batches),
    },
    repeats,
  )
  base = times["flax TrainState + optax.MultiSteps"]
  rows = [f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x |" for name, t in times.items()]
  data = {
    "k": k,
    "micro_batch": micro_batch,
    "width": width,
    "depth": depth,
    "repeats": repeats,
    "seconds_per_window": times,
    "ratio_vs_multisteps": {n: t / base for n, t in times.items()},
    "big_copies_in_step_hlo": {"MultiSteps": count_big_copies(ms_hlo), "ja.flax.TrainState": count_big_copies(ja_hlo)},
  }
  table = "\n".join(
    [
      f"MLP {depth} x {width}, adam, float32, K={k}, B={micro_batch}; time per window of K jitted, donated "
      f"`apply_gradients` steps (gradient included), median of {repeats} interleaved repeats. "
      "Target: ja.flax.TrainState <= 0.55x.",
      "",
      "| method | ms / window | vs MultiSteps |",
      "|---|---:|---:|",
    ]
    + rows
  )
  return [{"title": "flax: TrainState time per window", "markdown": table, "data": data}]
