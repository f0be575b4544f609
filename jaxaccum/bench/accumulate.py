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
from jax import lax

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


def _floor_runner(inner, params, batches, mode: str):
  """A floor: one jitted micro-step per microbatch, and (but for "+ cond") one jitted update per window.

  The micro-step is the gradient and its add into the accumulator, reset lazily
  on the window's first add (`where(first, 0, acc) + g`, run-time `first`), as
  `accumulate` does, so the window end writes no zeros. "add-only" stops there.
  "plain-API" (the floor of the plain optax API) also returns a params-sized
  zero update and applies it (`optax.apply_updates`): its zeros are decided at
  run time, selected from a buffer the step holds anyway,
  `where(window_end, grads, 0)` with a run-time False, so nothing more is
  written. A literal zero update would be folded away by XLA (p + 0 = p), a
  floor no transformation of the plain API can reach; materialised zeros would
  add a params-sized write. "+ cond" is the plain-API floor with `inner` inside
  the micro-step, under a `lax.cond` on the window's end that passes its state
  through otherwise (one jitted function, as `accumulate`): what a cond per
  call costs.
  """
  k = len(batches)
  with_cond = mode == "plain-API + cond"

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def micro(acc, params, state, batch, first, window_end):
    grads = jax.grad(mlp_loss)(params, batch)
    acc = jax.tree.map(lambda a, g: jnp.where(first, jnp.zeros([], a.dtype), a) + g, acc, grads)
    if mode == "add-only":
      return acc, params, state
    if with_cond:
      emit = lambda acc, state: inner.update(jax.tree.map(lambda a: a / k, acc), state, params)
      updates, state = lax.cond(window_end, emit, lambda acc, state: (grads, state), acc, state)
    else:
      # The select waits for the whole backward pass, as an optimizer's update does: a scalar of the first
      # layer's gradient (the last one computed) joins the predicate. Otherwise XLA may update a layer's
      # parameters in place before the backward pass has read them, and copies them first.
      last = jax.tree.leaves(grads)[0].ravel()[0]
      window_end = window_end & (last == last)
      updates = grads
    updates = jax.tree.map(lambda u: jnp.where(window_end, u, jnp.zeros([], u.dtype)), updates)
    return acc, optax.apply_updates(params, updates), state

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def apply(params, state, acc):
    updates, state = inner.update(jax.tree.map(lambda a: a / k, acc), state, params)
    return optax.apply_updates(params, updates), state

  carry = [jax.tree.map(jnp.copy, params), inner.init(params), jax.tree.map(jnp.zeros_like, params)]
  true, false = jnp.ones([], jnp.bool_), jnp.zeros([], jnp.bool_)

  def run():
    for i, batch in enumerate(batches):
      end = true if with_cond and i == k - 1 else false
      # Only "+ cond" passes `inner`'s state through the micro-step (the others leave it to the window's update).
      out = micro(carry[2], carry[0], carry[1] if with_cond else None, batch, true if i == 0 else false, end)
      carry[2], carry[0] = out[:2]
      if with_cond:
        carry[1] = out[2]
    if not with_cond:
      carry[0], carry[1] = apply(carry[0], carry[1], carry[2])
    jax.block_until_ready(carry)

  return run


def _add_only_runner(inner, params, batches):
  """The physical floor: one jitted add per micro-step, one jitted inner update per window."""
  return _floor_runner(inner, params, batches, "add-only")


def _zeros_written_runner(inner, params, batches):
  """`accumulate` through the plain API as before issue 32: its micro-steps write params-sized zero updates.

  A diagnostic row: the step is traced and compiled (its first run) with the
  pass-through of the gradients turned off (`_window._passes_grads`), then
  timed like the others from the compiled executable.
  """
  from jaxaccum import _window  # noqa: PLC0415

  passes = _window._passes_grads  # noqa: SLF001
  _window._passes_grads = lambda *args: False  # noqa: SLF001
  try:
    run = _transform_runner(accumulate(inner, len(batches)), params, batches)[0]
    run()
  finally:
    _window._passes_grads = passes  # noqa: SLF001
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


# (method, against, bound): the targets this section checks at B=8 (DESIGN.md; issue 32 item 4 for the floors).
TARGET_MICRO_BATCH = 8
TARGETS = (
  ("accumulate", "MultiSteps", 0.70),
  ("accumulate", "plain-API floor", 1.05),
  ("own jit, apply_gradients", "add-only", 1.10),
)


def target_cell(vs: dict, name: str, micro_batch: int) -> str:
  """The target column of a method's row: each bound it has, and its verdict (`common.verdict`)."""
  if micro_batch != TARGET_MICRO_BATCH:
    return ""
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
      "accumulate, zeros written (before #32)": _zeros_written_runner(inner, params, batches),
      "own jit, apply_gradients": _own_jit_runner(accumulate(inner, k), params, batches),
      "plain-API floor": _floor_runner(inner, params, batches, "plain-API"),
      "plain-API floor + cond": _floor_runner(inner, params, batches, "plain-API + cond"),
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
      "verdicts": {
        f"{m} vs {b} <= {bound:.2f}x": verdict(vs[b][m], bound)
        for m, b, bound in (TARGETS if micro_batch == TARGET_MICRO_BATCH else ())
      },
      "big_copies_in_step_hlo": {"MultiSteps": count_big_copies(ms_hlo), "accumulate": count_big_copies(ja_hlo)},
    }
    for name in runners:
      rows.append(
        f"| K={k}, B={micro_batch} | {name} | {t['seconds'][name] * 1e3:.1f} | {ratio_cell(vs['MultiSteps'][name])} | "
        f"{ratio_cell(vs['plain-API floor'][name])} | {ratio_cell(vs['add-only'][name])} | "
        f"{target_cell(vs, name, micro_batch)} |"
      )
    notes.append(f"B={micro_batch}: {timing_note(t)}")

  time_table = "\n".join(
    [
      f"MLP {depth} x {width}, adam, float32; time per window of K micro-steps, jitted and donated. MultiSteps and "
      "accumulate through the plain optax API (`update`, then `optax.apply_updates` in the same jit), and "
      "accumulate as it was before issue 32 (its micro-steps wrote params-sized zero updates); the own-jit "
      "recipe with `tx.update.apply_gradients` (the parameters pass a micro-step untouched). Floors, each with the "
      "accumulator reset lazily as accumulate does: add-only, one jitted gradient-and-add per micro-step and one "
      "jitted update per window; the plain-API floor adds a params-sized zero update decided at run time and its "
      "`apply_updates`; '+ cond' runs the update inside the micro-step under a `lax.cond` on the window's end "
      "(one jitted function, as accumulate): what a cond per call costs. Targets (at B=8): accumulate <= 0.70x "
      "MultiSteps and <= 1.05x the plain-API floor, the own-jit recipe <= 1.10x the add-only floor; a verdict is "
      '"within noise" when the min-max range of its rounds straddles the bound.',
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
