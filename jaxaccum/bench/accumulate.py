"""Benchmark section: accumulate() vs optax.MultiSteps vs the floors of the plain API and of an add.

Time per window of K micro-steps, measured side by side in interleaved rounds
(`common.timed`: the machine may be shared, so each ratio is taken within its
round and reported with its spread), and optimizer-state bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxaccum.accumulate import accumulate
from jaxaccum.bench.common import (
  MIN_ROUNDS,
  count_big_copies,
  mlp_loss,
  mlp_params,
  ratio_between,
  ratio_cell,
  timed,
  timing_note,
  tree_bytes,
  verdict,
)


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


def _plain_floor_runner(inner, params, batches):
  """The floor of the plain optax API: the add-only floor plus a params-sized zero update and its `apply_updates`.

  Through `update` a micro-step returns updates whose zeros are decided at run
  time (is this call the window's last?), so the floor makes them from a
  run-time 0, in the micro-step's jit: XLA folds a literal zero update
  (p + 0 = p) away, a floor no transformation of the plain API can reach.
  """
  k = len(batches)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def add(params, acc, batch, zero):
    updates = jax.tree.map(lambda p: jnp.full_like(p, zero), params)
    return optax.apply_updates(params, updates), jax.tree.map(jnp.add, acc, jax.grad(mlp_loss)(params, batch))

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def apply(params, state, acc):
    updates, state = inner.update(jax.tree.map(lambda a: a / k, acc), state, params)
    return optax.apply_updates(params, updates), state, jax.tree.map(jnp.zeros_like, acc)

  carry = [jax.tree.map(jnp.copy, params), inner.init(params), jax.tree.map(jnp.zeros_like, params)]
  zero = jnp.zeros([], jnp.float32)

  def run():
    for batch in batches:
      carry[0], carry[2] = add(carry[0], carry[2], batch, zero)
    carry[0], carry[1], carry[2] = apply(*carry)
    jax.block_until_ready(carry)

  return run


def _own_jit_runner(tx, params, batches):
  """The own-jit recipe that applies only at a window's end: `tx.update.apply_gradients` in the user's jit, donated."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, batch):
    return tx.update.apply_gradients(jax.grad(mlp_loss)(params, batch), state, params)

  carry = [jax.tree.map(jnp.copy, params), tx.init(params)]

  def run():
    for batch in batches:
      carry[0], carry[1] = step(carry[0], carry[1], batch)
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


# (method, against, bound): the targets this section checks (DESIGN.md; issue 32 item 4 for the floors).
TARGETS = (
  ("accumulate", "MultiSteps", 0.70),
  ("accumulate", "plain-API floor", 1.05),
  ("own jit, apply_gradients", "add-only", 1.10),
)


def target_cell(vs: dict, name: str) -> str:
  """The target column of a method's row: each bound it has, and its verdict (`common.verdict`)."""
  return "; ".join(f"<= {bound:.2f}x {b}: {verdict(vs[b][m], bound)}" for m, b, bound in TARGETS if m == name)


def _time(quick: bool = False) -> dict:
  width, depth, k = (128, 4, 16) if quick else (512, 4, 16)
  rounds = MIN_ROUNDS if quick else 15
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  inner = optax.adam(1e-3)
  rows: list[str] = []
  data: dict[str, object] = {}
  notes: list[str] = []
  for micro_batch in (8, 128):
    batches = [
      (
        jax.random.normal(jax.random.PRNGKey(i), (micro_batch, width)),
        jax.random.normal(jax.random.PRNGKey(1000 + i), (micro_batch, width)),
      )
      for i in range(k)
    ]
    ms_run, _, ms_hlo = _transform_runner(optax.MultiSteps(inner, k), params, batches)
    ja_run, _, ja_hlo = _transform_runner(accumulate(inner, k), params, batches)
    runners = {
      "MultiSteps": ms_run,
      "accumulate": ja_run,
      "own jit, apply_gradients": _own_jit_runner(accumulate(inner, k), params, batches),
      "plain-API floor": _plain_floor_runner(inner, params, batches),
      "add-only": _add_only_runner(inner, params, batches),
    }
    t = timed(runners, "MultiSteps", rounds)
    vs = {
      "MultiSteps": t["ratio"],
      "plain-API floor": {n: ratio_between(t, n, "plain-API floor") for n in runners},
      "add-only": {n: ratio_between(t, n, "add-only") for n in runners},
    }
    data[f"B={micro_batch}"] = {
      "k": k,
      "micro_batch": micro_batch,
      "width": width,
      "depth": depth,
      "timing": t,
      "seconds_per_window": t["seconds"],
      "ratio_vs_multisteps": {n: q["median"] for n, q in t["ratio"].items()},
      "ratios": vs,
      "verdicts": {f"{m} vs {b} <= {bound:.2f}x": verdict(vs[b][m], bound) for m, b, bound in TARGETS},
      "big_copies_in_step_hlo": {"MultiSteps": count_big_copies(ms_hlo), "accumulate": count_big_copies(ja_hlo)},
    }
    for name in runners:
      rows.append(
        f"| K={k}, B={micro_batch} | {name} | {t['seconds'][name] * 1e3:.1f} | {ratio_cell(vs['MultiSteps'][name])} | "
        f"{ratio_cell(vs['plain-API floor'][name])} | {ratio_cell(vs['add-only'][name])} | {target_cell(vs, name)} |"
      )
    notes.append(f"B={micro_batch}: {timing_note(t)}")

  time_table = "\n".join(
    [
      f"MLP {depth} x {width}, adam, float32; time per window of K micro-steps, jitted and donated. MultiSteps and "
      "accumulate through the plain optax API (`update`, then `optax.apply_updates` in the same jit); the own-jit "
      "recipe with `tx.update.apply_gradients` (the parameters pass a micro-step untouched); the plain-API floor: one "
      "add per micro-step plus a params-sized zero update made from a run-time 0 and its `apply_updates`; the "
      'add-only floor: one jitted add per micro-step and one jitted update per window. A verdict is "within noise" '
      "when the interquartile range straddles the bound.",
      "",
      "| case | method | ms / window | vs MultiSteps | vs plain-API floor | vs add-only | target |",
      "|---|---|---:|---:|---:|---:|---|",
    ]
    + rows
    + ["", *notes]
  )
  return {
    "title": "accumulate: time per window",
    "markdown": time_table,
    "data": {k_: v for k_, v in data.items() if k_.startswith("B=")},
  }


def run(quick: bool = False) -> list[dict]:
  return [_time(quick), _state_memory(quick)]
