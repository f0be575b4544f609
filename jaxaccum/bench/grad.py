"""Benchmark section: your own jit step on an Explicit mesh, collectives per window.

The user's own `jax.jit` step on a `jax.make_mesh` mesh with an Explicit "data"
axis, the batch sharded over it, one call per microbatch, K calls per update:

* `ja.grad` + `ja.accumulate(..., axis_name="data")`: gradients stay unreduced
  across calls; the window end reduces once;
* `optax.MultiSteps` with `jax.grad`: the partitioner all-reduces every call;
* plain `jax.grad` + `ja.accumulate` (no axis_name): the same, K per window.

Counted in the compiled HLO of the step with `ja.count_collectives` (executions
per call, loop trip counts included): `branches="none"` is what runs on every
call, the rest sits in the window-end branch. Per window = K x every call + 1 x branch.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _hlo
from jaxaccum.accumulate import accumulate
from jaxaccum.bench.common import mlp_batch, mlp_loss, mlp_params, tree_bytes
from jaxaccum.grad import grad as ja_grad
from jaxaccum.hlo import collective_bytes, count_collectives


def _step(kind: str, inner, k: int):
  if kind == "ja.grad + ja.accumulate":
    tx = accumulate(inner, k, axis_name="data")
    grad_fn = ja_grad(mlp_loss, axis_name="data")
  elif kind == "optax.MultiSteps":
    tx = optax.MultiSteps(inner, k)
    grad_fn = jax.grad(mlp_loss)
  else:
    tx = accumulate(inner, k)
    grad_fn = jax.grad(mlp_loss)

  @jax.jit
  def step(params, state, batch):
    updates, state = tx.update(grad_fn(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  return tx, step


def per_window(hlo: str, k: int, num_devices: int) -> dict:
  """Collective executions and bytes per window of k calls: k x (every call) + 1 x (window-end branch)."""
  every = sum(count_collectives(hlo, branches="none").values())
  end = sum(count_collectives(hlo).values()) - every
  ring_every = sum(collective_bytes(hlo, num_devices=num_devices, branches="none").values())
  ring_end = sum(collective_bytes(hlo, num_devices=num_devices).values()) - ring_every
  found = _hlo.collectives(hlo, num_devices)  # result bytes (what is reduced), by where each one runs
  calls = {"top": k, "branch": 1}
  return {
    "instructions": k * every + end,
    "result_bytes": sum(calls.get(c.where, k) * c.result_bytes for c in found),
    "ring_bytes": k * ring_every + ring_end,
    "per_micro_step": every,
    "at_window_end": end,
  }


def run(quick: bool = False) -> list[dict]:
  width, depth, k, rows = (64, 3, 4, 64) if quick else (512, 4, 8, 256)
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
  inner = optax.adam(1e-3)
  data, lines = {}, []
  with jax.set_mesh(mesh):
    params = jax.device_put(mlp_params(jax.random.PRNGKey(0), width, depth), NamedSharding(mesh, P()))
    batch = jax.device_put(mlp_batch(jax.random.PRNGKey(1), rows, width), NamedSharding(mesh, P("data")))
    for kind in ("ja.grad + ja.accumulate", "optax.MultiSteps", "jax.grad + ja.accumulate"):
      tx, step = _step(kind, inner, k)
      hlo = step.lower(params, tx.init(params), batch).compile().as_text()
      row = per_window(hlo, k, n)
      data[kind] = row
      lines.append(
        f"| {kind} | {row['per_micro_step']} | {row['at_window_end']} | {row['instructions']} | "
        f"{row['result_bytes'] / 2**20:.2f} | {row['ring_bytes'] / 2**20:.2f} |"
      )
  params_mib = tree_bytes(params) / 2**20
  markdown = "\n".join(
    [
      f"Own `jax.jit` step on an Explicit {n}-device mesh, MLP {depth} x {width} ({params_mib:.2f} MiB of float32 "
      f"parameters), adam, K={k} calls per update, batch of {rows} rows sharded over 'data'. Collectives "
      "counted in the compiled HLO by where they run (every call, or the window-end branch); bytes per "
      "window = K x every-call + 1 x window-end (result bytes, and ring bytes sent per device).",
      "",
      "| step | collectives per call | at the window end | per window | MiB per window | ring MiB per window |",
      "|---|---:|---:|---:|---:|---:|",
    ]
    + lines
  )
  return [{"title": "own jit step: collectives per window (ja.grad)", "markdown": markdown, "data": data}]
