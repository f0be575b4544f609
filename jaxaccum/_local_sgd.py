"""local_sgd(): each replica runs its own optimizer; parameters are averaged every H updates.

See `jaxaccum.lowcomm` for the family, and for the one rounding that emitting
parameter averages as updates costs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxaccum import _lowcomm_util as util
from jaxaccum import _tree, parallel


class LocalSGDState(NamedTuple):
  """State of `local_sgd`; per replica (replicas' inner states differ)."""

  local_step: jax.Array  # int32 scalar: updates since the last synchronization, in [0, sync_every).
  sync_count: jax.Array  # int32 scalar: synchronizations (parameter all-reduces) done so far.
  inner_state: Any  # `inner`'s state, local to the replica and never averaged.


def local_sgd(
  inner: optax.GradientTransformation,
  sync_every: int,
  *,
  axis_name: str | tuple[str, ...],
) -> optax.GradientTransformationExtraArgs:
  """Local SGD: each replica runs `inner` alone; parameters are averaged every `sync_every` updates.

  With replicas p = 1..P, local parameters theta_p and H = `sync_every`:

      theta_p <- theta_p + u_p,   u_p = inner.update(g_p, ...)     on each update,
      theta_p <- (1/P) sum_q (theta_q + u_q)                       on every H-th update,

  the latter emitted as `updates = mean_q(theta_q + u_q) - theta_p` (see the
  module docstring for the one rounding this costs). H = 1 is synchronous
  parameter averaging, which for plain SGD is synchronous gradient averaging.
  One all-reduce of a params-sized tree per H updates; in between, nothing is
  communicated. References: Stich, "Local SGD converges fast and communicates
  little" (ICLR 2019); Lin et al., "Don't use large mini-batches, use local SGD"
  (arXiv 1808.07217), whose *post-local SGD* is `sync_every=1` for a warm-up
  then H > 1 (two transforms, switched by the training loop).

  Use inside `jax.pmap` or `jax.shard_map` over `axis_name`, feeding each
  replica's own (not averaged) gradients. Between synchronizations the replicas'
  parameters differ, so parameters and state are per replica: under pmap that
  is automatic; under shard_map keep them sharded with a leading replica axis
  (in/out specs `P(axis_name)`), and take gradients of varying parameters
  (gradients already summed by autodiff over replicated parameters raise).
  `inner`'s state is never averaged (Adam moments stay local). To send bf16
  on the wire, send parameter *changes* instead: `diloco(inner,
  optax.sgd(1.0), H, axis_name=..., comm_dtype=jnp.bfloat16)` is local SGD.

  Args:
    inner: the per-replica optimizer.
    sync_every: H, an int >= 1: average parameters on every H-th update.
    axis_name: the mapped data axis to average over (required).

  Returns:
    An `optax.GradientTransformationExtraArgs` with a `LocalSGDState`; extra
    arguments go to `inner`.

  Raises:
    TypeError/ValueError: `sync_every` not an int >= 1, `axis_name` not a
      string; at update time, `params` missing or `axis_name` unbound.
  """
  inner = _tree.check_optimizer(inner, "inner")
  sync_every = _tree.check_positive_int(sync_every, "sync_every")
  axis_name = util.check_axis_name_arg(axis_name)
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return LocalSGDState(
      local_step=jnp.zeros([], jnp.int32), sync_count=jnp.zeros([], jnp.int32), inner_state=inner.init(params)
    )

  def update(grads, state, params=None, **extra_args):
    size, local, inner_state = util.local_inner_update("local_sgd", inner, axis_name, grads, state, params, extra_args)

    def average(operands):
      params, local = operands
      moved = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, local)
      total = lax.psum(moved, axis_name)
      return jax.tree.map(lambda t, p, u: (t / jnp.asarray(size, t.dtype) - p).astype(u.dtype), total, params, local)

    if sync_every == 1:
      return average((params, local)), LocalSGDState(state.local_step, state.sync_count + 1, inner_state)
    is_sync, local_step, sync_count = util.advance(state.local_step, state.sync_count, sync_every)
    averaged = parallel.cond(is_sync, average, lambda ops: util.zeros_like(ops[1]), (params, local))
    return util.select(is_sync, averaged, local), LocalSGDState(local_step, sync_count, inner_state)

  return optax.GradientTransformationExtraArgs(init, update)
