"""The wire of `diloco`'s outer gradient: a float cast, or blockwise absmax int8/int4 codes.

`wire_mean(xs, axis_name, replicas, compress, comm_dtype)` returns, for the
leaves `xs` of one fragment on each replica p,

    Delta = (1/P) sum_p C(x_p)      as the wire computes it, and
    x_p - C(x_p)                    what this replica did not send (error feedback keeps it),

the latter computed leaf by leaf, so that no whole copy of what was sent is held.

Float wires (`comm_dtype`, or `compress="bf16"`): C(x) = x rounded to the wire
dtype; one all-reduce in that dtype (XLA:CPU widens bf16 all-reduces to f32 in
its compiled HLO; GPU and TPU send the lowered dtype). Every all-reduce here
goes through `_lowcomm_util.reduce_over`: in a map manual over the replica
axis only (`diloco_train_step`), those in bf16 or int16 run in a nested map
manual over the other axes too, which XLA compiles without aborting.

Integer wires (`compress="int8"`/`"int4"`, qmax = 127/7). Each leaf is raveled
and cut into blocks of 64 consecutive elements (the last one shorter). Block j
has one scale, shared by every replica,

    s_j = max_p max_{i in j} |x_{p,i}| / qmax        (one small max-all-reduce),
    q_{p,i} = clip(round_half_even(x_{p,i} / s_j), -qmax, qmax),   q = 0 where s_j = 0,

and because the scale is shared the codes add exactly: they are summed as
integers, in the narrowest signed type that holds P * qmax (int8 for int4 codes
up to P = 18, int16 for int8 codes up to P = 258), so nothing can overflow, and
Delta_i = (sum_p q_{p,i}) * s_j / P. Since |x / s_j| <= qmax nothing is
clipped and |x - c| <= s_j / 2. Unlike a scheme that re-quantises the mean
(torchft), the only error is each replica's own rounding, which error feedback
cancels.

`compress=ja.TopK(...)`: SparseLoCo's sparse wire, one all-gather of packed
top-k payloads (see `jaxaccum._sparse`).

Bytes per element on the wire, for P = 4 replicas (ring all-reduce, relative
to float32): int8 codes summed in int16: 2 + 4/64 bytes (0.52x); int4 codes
summed in int8: 1 + 4/64 bytes (0.27x); with float64 scales 8/64 instead of
4/64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum import _lowcomm_util, _sparse

BLOCK = 64
QMAX = {"int8": 127, "int4": 7}
COMPRESS = (None, "bf16", "int8", "int4")


def code_sum_dtype(qmax: int, replicas: int) -> np.dtype:
  """The narrowest signed integer dtype that holds any sum of `replicas` codes in [-qmax, qmax]."""
  for dtype in (np.int8, np.int16, np.int32):
    if replicas * qmax <= np.iinfo(dtype).max:
      return np.dtype(dtype)
  raise ValueError(f"{replicas} replicas of codes up to {qmax} overflow int32")


def block_absmax(x):
  """max |x| over each block of 64 consecutive elements of the raveled `x`: shape (ceil(size / 64),)."""
  flat = jnp.abs(jnp.ravel(x))
  blocks = -(-flat.size // BLOCK)
  return jnp.max(jnp.pad(flat, (0, blocks * BLOCK - flat.size)).reshape(blocks, BLOCK), axis=1)


def per_element(scales, shape):
  """Each element's block scale, in `shape` (the inverse of `block_absmax`'s blocking)."""
  size = int(np.prod(shape, dtype=np.int64))
  return jnp.repeat(scales, BLOCK)[:size].reshape(shape)


def quantize(x, scale, qmax: int):
  """Codes of `x` with per-element `scale`: clip(round_half_even(x / scale), +-qmax), 0 where scale is 0, int8."""
  nonzero = scale > 0
  q = jnp.clip(jnp.round(x / jnp.where(nonzero, scale, 1)), -qmax, qmax)
  return jnp.where(nonzero, q, 0).astype(jnp.int8)


def _explicit_spec(x):
  """`x`'s PartitionSpec when it is sharded over Explicit mesh axes (known in its type), else None."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return spec if spec is not None and any(e is not None for e in spec) else None


def _whole(x):
  """(x gathered whole over the Explicit axes that shard it, the way back to its layout)."""
  spec = _explicit_spec(x)
  if spec is None:
    return x, lambda y: y
  return jax.sharding.reshard(x, PartitionSpec()), lambda y: jax.sharding.reshard(y, spec)


def wire_mean(leaves: list, axis_name, replicas: int, compress, comm_dtype):
  """(Delta, left): the mean over `axis_name` of C(x) for each leaf, and this replica's x - C(x).

  `leaves[i](order)` computes leaf i's x from its inputs passed through `order` (see `_sparse.wire_mean`,
  which codes one leaf at a time; the other wires take every leaf at once)."""
  if isinstance(compress, _sparse.TopK):
    # Blocks run across the raveled leaf, so across its shards over Explicit axes (e.g. fsdp's "data" within
    # a replica): each leaf is gathered over those (fast) axes, coded whole and laid back out, one at a time.
    return _sparse.wire_mean([lambda order, f=f: _whole(f(order)) for f in leaves], axis_name, replicas, compress)
  return _dense_mean([f(lambda inputs: inputs) for f in leaves], axis_name, replicas, compress, comm_dtype)


def _dense_mean(xs: list, axis_name, replicas: int, compress, comm_dtype):
  specs = [_explicit_spec(x) for x in xs] if compress in QMAX else []
  if any(s is not None for s in specs):
    # Blocks of 64 run across the raveled leaf, so across its shards over Explicit axes (e.g. fsdp's
    # "data" within a replica): gather the leaf over those (fast) axes, code it whole, lay the results
    # back out as the leaf was. The replica-axis collectives are unchanged.
    whole = [x if s is None else jax.sharding.reshard(x, PartitionSpec()) for x, s in zip(xs, specs, strict=True)]
    delta, left = _dense_mean(whole, axis_name, replicas, compress, comm_dtype)
    back = lambda ys: [y if s is None else jax.sharding.reshard(y, s) for y, s in zip(ys, specs, strict=True)]
    return back(delta), back(left)
  if compress in QMAX:
    qmax = QMAX[compress]
    absmax = [block_absmax(x) for x in xs]
    # One max-all-reduce for all the fragment's scales (a 64th of its elements).
    (shared,) = _lowcomm_util.reduce_over(lax.pmax, [jnp.concatenate(absmax)], axis_name)
    bounds = np.cumsum([0] + [a.shape[0] for a in absmax])
    scales = [
      per_element(shared[lo:hi].astype(x.dtype) / qmax, x.shape)
      for x, lo, hi in zip(xs, bounds[:-1], bounds[1:], strict=True)
    ]
    codes = [quantize(x, s, qmax) for x, s in zip(xs, scales, strict=True)]
    wide = code_sum_dtype(qmax, replicas)
    sums = _lowcomm_util.reduce_over(lax.psum, [q.astype(wide) for q in codes], axis_name)
    delta = [(t.astype(x.dtype) * s) / jnp.asarray(replicas, x.dtype) for t, s, x in zip(sums, scales, xs, strict=True)]
    return delta, [x - q.astype(x.dtype) * s for q, s, x in zip(codes, scales, xs, strict=True)]
  dtype = jnp.dtype(jnp.bfloat16) if compress == "bf16" else comm_dtype
  sent = xs if dtype is None else [x.astype(dtype) for x in xs]
  sums = _lowcomm_util.reduce_over(lax.psum, list(sent), axis_name)
  delta = [t.astype(x.dtype) / jnp.asarray(replicas, x.dtype) for t, x in zip(sums, xs, strict=True)]
  return delta, [x - c.astype(x.dtype) for c, x in zip(sent, xs, strict=True)]
