"""Benchmark section: ja.flax.TrainState vs optax.MultiSteps through flax's TrainState.

Time per window of K micro-steps, each a jitted, donated `apply_gradients`
step (gradient included), measured side by side in interleaved rounds
(`common.timed`), each ratio with its spread.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxaccum.accumulate import accumulate
from jaxaccum.bench import accumulate as _ba
from jaxaccum.bench.common import (
  MIN_ROUNDS,
  count_big_copies,
  mlp_apply,
  mlp_loss,
  mlp_params,
  ratio_between,
  ratio_cell,
  timed,
  timing_note,
  verdict,
)


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
  rounds = MIN_ROUNDS if quick else 15
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
  runners = {
    "flax TrainState + optax.MultiSteps": ms_run,
    "ja.flax.TrainState + ja.accumulate": ja_run,
    "ja.accumulate, plain optax API": _ba._transform_runner(accumulate(inner, k), params, batches)[0],
    "add-only floor (two jitted functions)": _ba._add_only_runner(inner, params, batches),
  }
  base, floor = "flax TrainState + optax.MultiSteps", "add-only floor (two jitted functions)"
  t = timed(runners, base, rounds)
  vs_floor = {n: ratio_between(t, n, floor) for n in runners}
  targets = {
    "ja.flax.TrainState + ja.accumulate": (
      f"<= 0.55x MultiSteps: {verdict(t['ratio']['ja.flax.TrainState + ja.accumulate'], 0.55)}; "
      f"<= 1.10x add-only: {verdict(vs_floor['ja.flax.TrainState + ja.accumulate'], 1.10)}"
    )
  }
  rows = [
    f"| {name} | {t['seconds'][name] * 1e3:.1f} | {ratio_cell(t['ratio'][name])} | {ratio_cell(vs_floor[name])} | "
    f"{targets.get(name, '')} |"
    for name in runners
  ]
  data = {
    "k": k,
    "micro_batch": micro_batch,
    "width": width,
    "depth": depth,
    "rounds": rounds,
    "timing": t,
    "seconds_per_window": t["seconds"],
    "ratio_vs_multisteps": {n: q["median"] for n, q in t["ratio"].items()},
    "ratio_vs_add_only": vs_floor,
    "targets": targets,
    "big_copies_in_step_hlo": {"MultiSteps": count_big_copies(ms_hlo), "ja.flax.TrainState": count_big_copies(ja_hlo)},
  }
  table = "\n".join(
    [
      f"MLP {depth} x {width}, adam, float32, K={k}, B={micro_batch}; time per window of K jitted, donated "
      "`apply_gradients` steps (gradient included). Targets: ja.flax.TrainState <= 0.55x MultiSteps, and within 10% "
      'of the add-only floor; a verdict is "within noise" when the min-max range of its rounds straddles the bound.',
      "",
      "| method | ms / window | vs MultiSteps | vs add-only | target |",
      "|---|---:|---:|---:|---|",
    ]
    + rows
    + ["", timing_note(t)]
  )
  return [{"title": "flax: TrainState time per window", "markdown": table, "data": data}]
