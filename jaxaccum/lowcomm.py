"""local_sgd(), diloco(), stale(): beyond per-step synchronous gradient averaging.

Synchronous data parallelism all-reduces the gradient on every update, and every
device waits for the slowest. Two ways out, both written here as pure optax
gradient transformations:

* Communicate less often. `local_sgd` lets each replica run its own optimizer
  and averages the *parameters* every H updates; `diloco` does the same but
  treats the averaged parameter change as a gradient for an outer optimizer
  (Nesterov momentum in the paper). One all-reduce per H updates.
* Do not wait. `stale` simulates asynchronous SGD with a fixed staleness d: the
  update applied at step t uses the gradient computed at step t - d, i.e. on
  parameters d updates old, as a parameter server does with slow workers.

Parameter averaging as a gradient transformation. optax applies updates as
`params + updates`. At a synchronization step these transforms emit

    updates = target - params,

where `target` is the average over replicas of `params + local update`
(`local_sgd`) or `anchor + outer update` (`diloco`), so that `apply_updates`
lands on `target`. Both therefore need `params` in `update`. In floating point
`params + (target - params)` equals `target` up to one rounding (at most one
ulp of the result, and exact whenever the two are within a factor of two of
each other, by Sterbenz's lemma); replicas with different `params` may thus
land an ulp apart. In float64 that is ~1e-16 relative; `diloco` keeps the exact
`target` as its anchor, so the difference never accumulates there.

Modules: `_local_sgd`, `_diloco` (its options as a Config, the update as module
functions; `_quantize` and `_sparse` its wires) and `_stale`; this module holds
`diloco`'s signature and documentation and re-exports the rest.

Cost. On the H-1 updates between synchronizations the all-reduce sits in the
untaken branch of a `lax.cond` and does not run; the compiled HLO holds no
all-reduce outside that branch (tests/test_lowcomm.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jaxaccum import _diloco
from jaxaccum._diloco import DiLoCoState
from jaxaccum._local_sgd import LocalSGDState, local_sgd
from jaxaccum._sparse import TopK
from jaxaccum._stale import StaleState, stale

__all__ = ["DiLoCoState", "LocalSGDState", "StaleState", "TopK", "diloco", "local_sgd", "stale"]

# Public under this module's name (the API reference groups names by the module that shows them).
for _obj in (DiLoCoState, LocalSGDState, StaleState, TopK, local_sgd, stale):
  _obj.__module__ = __name__


def diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation,
  sync_every: int,
  *,
  axis_name: str | tuple[str, ...],
  comm_dtype: Any = None,
  fragments: int | Callable[[Any, Any], int] = 1,
  delay: int = 0,
  alpha: float = 0.0,
  compress: str | TopK | None = None,
  error_feedback: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """(Streaming) DiLoCo: local `inner` steps; each parameter fragment gets an `outer` step every H updates.

  Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models" (arXiv 2311.08105), and its streaming form, Douillard et
  al., "Streaming DiLoCo with overlapping communication" (arXiv 2501.18512).
  With P replicas, H = `sync_every`, F fragments, s = H / F, tau = `delay`,
  updates counted t = 1, 2, ... and replica parameters theta_p:

      every update:   u_p = inner.update(g_p),  local_p = theta_p + u_p,
      prepare f on t_f - tau:   x_p = anchor_f - local_{p,f} (+ e_{p,f}),  c_p = C(x_p),
                                Delta_f = (1/P) sum_p c_p,  e_{p,f} <- x_p - c_p,
      merge f on t_f = (f + 1) s + k H:
                      (o, S_f) = outer.update(Delta_f, S_f, anchor_f),  anchor_f += o,
                      theta_{p,f} <- alpha local_{p,f} + (1 - alpha) anchor_f,
      every other leaf:  theta_p <- local_p.

  Fragments merge in turn, one every s updates, so each sync moves 1/F of the
  parameters. Fragment f's collectives run on one update of its period: with
  tau = 0 on t_f after the inner update; with tau >= 1 on update
  t_f - tau + 1, from the parameters at its start (they are local_p after
  t_f - tau), so they do not depend on that update's forward/backward and a
  scheduler can overlap them with tau updates of compute. Delta_f waits in
  the state until t_f. Defaults (F = 1, tau = 0, alpha = 0, no compression)
  are the paper's Algorithm 1: Delta = (1/P) sum_p (anchor - theta_p), anchor
  += outer step, theta_p <- anchor. The paper's outer optimizer is Nesterov,
  `optax.sgd(0.7, momentum=0.9, nesterov=True)` with inner AdamW;
  `outer=optax.sgd(1.0)` is local SGD, and `sync_every=1` with inner
  `optax.sgd(lr)` is synchronous data-parallel SGD.

  The wire C (see `jaxaccum._quantize`): `comm_dtype` or `compress="bf16"`
  rounds x to that float dtype and all-reduces in it. `compress="int8"`/`"int4"`
  sends blockwise absmax codes: blocks of 64 consecutive elements of each
  raveled leaf, one scale per block shared by every replica (one small
  max-all-reduce), s_j = max |x| / qmax with qmax = 127/7, codes
  clip(round_half_even(x / s_j), +-qmax) summed exactly as integers in the
  narrowest type that holds P qmax, Delta = (sum_p q_p) s_j / P. With
  `error_feedback=True` each replica keeps what its quantiser dropped,
  e = x - c, and adds it to the fragment's next outer gradient, so the sum of
  what was sent tracks the sum of the true outer gradients within one
  quantisation step (|e| <= s_j / 2).

  The sparse wire, `compress=ja.TopK(density, chunk, bits, beta)` (or
  "topk" for its defaults) with `error_feedback=True`, is SparseLoCo (Sarfi
  et al., arXiv 2508.15706): e_p <- beta e_p + x_p; c_p = Q(TopK(e_p)), the
  k = round(density C) largest |e| of each chunk of C elements, b-bit values
  with a bfloat16 scale per chunk, indices local to the chunk; e_p <- e_p -
  c_p; the replicas all-gather the bit-packed payloads and each sums them,
  Delta = (1/P) sum_p c_p. The accumulator replaces outer momentum: use
  `outer=optax.sgd(1.0)` (plain averaging), as the paper does. See
  `jaxaccum._sparse` for the exact code and the bytes.

  Usage and sharding as for `local_sgd`: inside `jax.shard_map`/`jax.pmap` over
  `axis_name`, params and state per replica. State: the anchor (params-sized),
  one `outer` state per fragment, `inner`'s state, and params-sized buffers for
  the in-flight Delta (tau >= 1) and the residual (error feedback). Updates
  are emitted as target - theta_p (see the module docstring on rounding).

  Args:
    inner: the per-replica optimizer (its state is kept across outer steps, never averaged).
    outer: the optimizer of each fragment's outer gradient; `outer.init` is
      called once per fragment on the params tree with None outside it, so
      adam's count advances only on that fragment's merges.
    sync_every: H, an int >= 1: each fragment gets an outer step every H updates.
    axis_name: the mapped replica axis to average over (required).
    comm_dtype: a float dtype for Delta on the wire (e.g. `jnp.bfloat16`);
      the average comes back in the parameters' dtype.
    fragments: F, an int >= 1 that splits the leaves, in `jax.tree.leaves`
      order, into F contiguous groups as `numpy.array_split` does; or
      `fn(path, leaf) -> index` (called at init and update), F = the largest
      index + 1, every index 0..F-1 used.
    delay: tau, an int in [0, H / F): updates between preparing and merging.
    alpha: the weight of the local parameters in a merge, in [0, 1]: 0
      replaces the fragment by the anchor, 1 keeps the local values.
    compress: None, "bf16", "int8", "int4", or the sparse wire `ja.TopK(...)`
      / "topk" (see above).
    error_feedback: keep each replica's quantisation residual per fragment.

  Returns:
    An `optax.GradientTransformationExtraArgs` with a `DiLoCoState`; extra
    arguments go to `inner`.

  Raises:
    TypeError/ValueError: as `local_sgd`; a `comm_dtype` that is not floating,
      or given with `compress`; `sync_every` not divisible by F; `delay` < 0
      or >= H / F; `alpha` outside [0, 1]; an unknown `compress`; `ja.TopK`
      without `error_feedback=True`, or with a chunk larger than a leaf; a
      `fragments` function returning a negative or non-int index or leaving
      an index unused (at init, before any state is made).
  """
  cfg = _diloco.configure(
    inner, outer, sync_every, axis_name, comm_dtype, fragments, delay, alpha, compress, error_feedback
  )

  def init(params):
    return _diloco.init(cfg, params)

  def update(grads, state, params=None, *, inner_applied=None, **extra_args):
    # inner_applied (private; ja.diloco_train_step's engine passes it): a traced bool, False where this
    # replica's step skips. Only the inner update is gated; the schedule and collectives run regardless.
    return _diloco.update(cfg, grads, state, params, inner_applied, extra_args)

  return optax.GradientTransformationExtraArgs(init, update)
