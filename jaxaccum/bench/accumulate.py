"""Benchmark section: accumulate() vs optax.MultiSteps vs the add-only floor.

Time per window of K micro-steps, measured side by side with interleaved
repeats (the machine is shared and noisy: only ratios within one run mean
anything), and optimizer-state bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxaccum.accumulate import accumulate
from jaxaccum.bench.common import count_big_copies, interleaved_medians, mlp_loss, mlp_params, tree_bytes


def _transform_runner(tx, params, batches):
  """A window of micro-steps through the plain GradientTransformation API, donated."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, batch):
    grads = jax.grad(mlp_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  carry = [jax.tree.map(jnp.copy, params), tx.init(params)]
  hlo = step.lower(*carry, batches[0]).compile().as_text()

  def run():
    for batch in batches:
      carry[0], carry[1] = step(carry[0], carry[1], batch)
    jax.block_until_ready(carry)

  return run, carry, hlo


def _add_only_runner(inner, params, batches):
  """The physical floor: one jitted add per micro-step, one jitted inner update per window."""
  k = len(batches)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def add(acc, params, batch):
    return jax.tree.map(jnp.add, acc, jax.grad(mlp_loss)(params, batch))

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def apply(params, state, acc):
    updates, state = inner.update(jax.tree.map(lambda a: a / k, acc), state, params)
    return optax.apply_updates(params, updates), state, jax.tree.map(jnp.zeros_like, acc)

  carry = [jax.tree.map(jnp.copy, params), inner.init(params), jax.tree.map(jnp.zeros_like, params)]

  def run():
    for batch in batches:
      carry[2] = add(carry[2], carry[0], batch)
    carry[0], carry[1], carry[2] = apply(*carry)
    jax.block_until_ready(carry)

  return run


def _state_memory(quick: bool = False) -> dict:
  """Optimizer-state bytes of adam, MultiSteps and ja.accumulate (deterministic: no device run)."""
  width, depth, k = (128, 4, 16) if quick else (512, 4, 16)
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  inner = optax.adam(1e-3)
  params_bytes = tree_bytes(params)
  state_bytes = {
    "inner (adam)": tree_bytes(inner.init(params)),
    "optax.MultiSteps": tree_bytes(optax.MultiSteps(inner, k).init(params)),
    "ja.accumulate": tree_bytes(accumulate(inner, k).init(params)),
  }
  state_table = "\n".join(
    ["| optimizer state | bytes | x params |", "|---|---:|---:|"]
    + [f"| {n} | {b:,} | {b / params_bytes:.2f} |" for n, b in state_bytes.items()]
  )
  return {
    "title": "accumulate: optimizer-state memory",
    "markdown": state_table,
    "data": {"params_bytes": params_bytes, "state_bytes": state_bytes},
  }


def _time(quick: bool = False) -> dict:
  width, depth, k = (128, 4, 16) if quick else (512, 4, 16)
  repeats = 3 if quick else 15
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  inner = optax.adam(1e-3)
  rows: list[str] = []
  data: dict[str, object] = {}
  for micro_batch in (8, 128):
    batches = [
      (
        jax.random.normal(jax.random.PRNGKey(i), (micro_batch, width)),
        jax.random.normal(jax.random.PRNGKey(1000 + i), (micro_batch, width)),
      )
      for i in range(k)
    ]
    ms_run, ms_carry, ms_hlo = _transform_runner(optax.MultiSteps(inner, k), params, batches)
    ja_run, ja_carry, ja_hlo = _transform_runner(accumulate(inner, k), params, batches)
    times = interleaved_medians(
      {"MultiSteps": ms_run, "accumulate": ja_run, "add-only": _add_only_runner(inner, params, batches)}, repeats
    )
    base = times["MultiSteps"]
    entry = {
      "k": k,
      "micro_batch": micro_batch,
      "width": width,
      "depth": depth,
      "seconds_per_window": times,
      "ratio_vs_multisteps": {n: t / base for n, t in times.items()},
      "big_copies_in_step_hlo": {"MultiSteps": count_big_copies(ms_hlo), "accumulate": count_big_copies(ja_hlo)},
    }
    data[f"B={micro_batch}"] = entry
    for name, t in times.items():
      rows.append(f"| K={k}, B={micro_batch} | {name} | {t * 1e3:.1f} | {t / base:.2f}x |")

  time_table = "\n".join(
    [
      f"MLP {depth} x {width}, adam, float32; time per window of K micro-steps, median of {repeats} "
      "interleaved repeats, jitted and donated.",
      "",
      "| case | method | ms / window | vs MultiSteps |",
      "|---|---|---:|---:|",
    ]
    + rows
  )
  return {
    "title": "accumulate: time per window",
    "markdown": time_table,
    "data": {k_: v for k_, v in data.items() if k_.startswith("B=")},
  }


def run(quick: bool = False) -> list[dict]:
  return [_time(quick), _state_memory(quick)]
