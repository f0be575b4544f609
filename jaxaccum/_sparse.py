"""The sparse wire of `diloco`: SparseLoCo's chunk-wise top-k, b-bit values, error feedback with decay.

Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo"
(arXiv 2508.15706), Algorithm 1. Each replica p, per fragment, on its sync:

    e_p <- beta e_p + Delta_p          (Delta_p = anchor - local_p, the outer gradient)
    c_p  = Q(TopK(e_p))                what replica p sends
    e_p <- e_p - c_p                   (the residual keeps what was not sent)
    Delta = (1/P) sum_p c_p            every replica decodes every payload, sums locally

and the outer optimizer (plain averaging in the paper: `optax.sgd(1.0)`) steps
on Delta. The accumulator e takes the place of DiLoCo's outer momentum.

TopK and Q, per leaf: the raveled leaf is cut into chunks of C consecutive
elements (the last one shorter); in each chunk the k = max(1, round(density C))
largest |e| are kept (ties: the lower index), with their index local to the
chunk. The chunk's scale is s = bfloat16(max |e| over the chunk), 16 bits. A
kept value is sent as its sign and a magnitude m in {1, ..., M}, M = 2^(b - 1)
(b = `bits`: 2, 4 or 8), m = clip(round_half_even(|e| / (s / M)), 1, M), and
decodes to sign * m * s / M (sign(0) = +1; s = 0 decodes to 0). With b = 2
the values are {+-s/2, +-s}.

The payload, one uint8 vector per replica and fragment, bit-packed: for each
leaf its k ceil(log2 C)-bit indices per chunk, its b-bit codes, then its
bfloat16 scales. It crosses the replica axis in one all-gather; nothing else
does. Bytes per chunk: k (ceil(log2 C) + b) / 8 + 2; for C = 64, k = 2, b = 2
that is 4 bytes for 64 values, 1/64 of float32 (before the all-gather's P - 1
copies; an all-reduce of float32 moves 2 (P - 1) / P of 4 bytes a value).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BITS = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class TopK:
  """`compress=ja.TopK(density, chunk, bits, beta)`: `ja.diloco`'s sparse wire (SparseLoCo).

  Args:
    density: the fraction of each chunk sent, in (0, 1]; k = max(1, round(density * chunk)).
    chunk: C, the chunk length (every parameter leaf must hold at least C elements; an empty leaf, size 0,
      sends nothing and its Delta is empty).
    bits: b, the bits of each kept value: 2, 4 or 8 (sign and b - 1 magnitude bits).
    beta: the error-feedback decay in [0, 1]: e <- beta e + Delta before each send.

  Needs `error_feedback=True` (the accumulator is the residual) and no `comm_dtype`.
  """

  density: float = 1 / 32
  chunk: int = 64
  bits: int = 2
  beta: float = 1.0

  def __post_init__(self):
    density, chunk, bits, beta = self.density, self.chunk, self.bits, self.beta
    if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, numbers.Integral) or chunk < 1:
      raise ValueError(f"{chunk=} must be an int >= 1: the length of each chunk top-k selects within")
    if isinstance(density, (bool, np.bool_)) or not isinstance(density, numbers.Real) or not 0 < density <= 1:
      raise ValueError(f"{density=} must be in (0, 1]: the fraction of each chunk that is sent")
    if bits not in BITS or isinstance(bits, bool):
      raise ValueError(f"{bits=} must be one of {BITS}: the bits of each kept value (sign and magnitude)")
    if isinstance(beta, (bool, np.bool_)) or not isinstance(beta, numbers.Real) or not 0 <= beta <= 1:
      raise ValueError(f"{beta=} must be in [0, 1]: the decay of the error-feedback accumulator")
    object.__setattr__(self, "chunk", int(chunk))

  @property
  def k(self) -> int:
    """Values kept per chunk."""
    return max(1, min(self.chunk, int(np.floor(self.density * self.chunk + 0.5))))

  @property
  def index_bits(self) -> int:
    """Bits of one index local to its chunk: ceil(log2 C) (at least 1)."""
    return max(1, math.ceil(math.log2(self.chunk)))

  def check_leaves(self, params) -> None:
    """A ValueError naming the first non-empty leaf smaller than a chunk (an empty one has nothing to send)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      size = int(np.prod(np.shape(leaf), dtype=np.int64))
      if 0 < size < self.chunk:
        raise ValueError(
          f"TopK(chunk={self.chunk}) is larger than the leaf params{jax.tree_util.keystr(path)} of {size} "
          f"elements: every leaf must hold at least one chunk; choose chunk <= {size}"
        )


def pack(values, bits: int):
  """Unsigned ints < 2^bits (any shape) -> uint8 bytes, little-endian bit order, the last byte zero-padded."""
  flat = jnp.ravel(values).astype(jnp.uint32)
  stream = ((flat[:, None] >> jnp.arange(bits, dtype=jnp.uint32)) & 1).astype(jnp.uint8).reshape(-1)
  stream = jnp.pad(stream, (0, -stream.size % 8))
  return jnp.sum(stream.reshape(-1, 8) << jnp.arange(8, dtype=jnp.uint8), axis=1, dtype=jnp.uint8)


def unpack(data, bits: int, count: int):
  """The inverse of `pack`: the first `count` values, uint32; `data`'s leading axes are kept."""
  stream = (data[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  stream = stream.reshape(*data.shape[:-1], -1)[..., : count * bits].reshape(*data.shape[:-1], count, bits)
  return jnp.sum(stream.astype(jnp.uint32) << jnp.arange(bits, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def _chunks(x, chunk: int):
  """(n, C) chunks of the raveled `x`, zero-padded, and a mask of the real elements."""
  flat = jnp.ravel(x)
  n = -(-flat.size // chunk)
  pad = n * chunk - flat.size
  real = jnp.arange(n * chunk) < flat.size
  return jnp.pad(flat, (0, pad)).reshape(n, chunk), real.reshape(n, chunk)


def _scales(chunks):
  """Each chunk's bfloat16 scale, max |x| (through float32, so that every backend rounds it the same way)."""
  return jnp.max(jnp.abs(chunks), axis=1).astype(jnp.float32).astype(jnp.bfloat16)


def decode(codes, scales, bits: int, dtype):
  """Codes (sign bit over b - 1 magnitude bits, magnitude m + 1) and bf16 scales (..., n) -> values, exactly."""
  top = 1 << (bits - 1)
  step = scales.astype(dtype)[..., None] / top  # s / M: M a power of two, exact
  mag = ((codes & (top - 1)) + 1).astype(dtype)
  sign = jnp.where((codes >> (bits - 1)) & 1, -1, 1).astype(dtype)
  return sign * (mag * step)


def _column(a, j):
  """a[..., j] keeping the axis, for a traced j."""
  return lax.dynamic_slice_in_dim(a, j, 1, axis=-1)


def _read(chunks, idx):
  """chunks[..., idx] per chunk, (..., n, k): for each j a masked sum with one term, exact (no gather, see `encode`).

  One pass over the chunks per kept column, in a loop: a one-hot (..., n, k, C) mask would be materialised
  (k times the leaf in temporaries)."""
  cols = jnp.arange(chunks.shape[-1], dtype=idx.dtype)
  zero = jnp.zeros((), chunks.dtype)

  def one(j):
    return jnp.sum(jnp.where(_column(idx, j) == cols, chunks, zero), axis=-1, keepdims=True)

  # The loop starts from column 0 (broadcast): a carry typed like the values (varying in a shard_map).
  column = lambda j, kept: lax.dynamic_update_slice_in_dim(kept, one(j), j, axis=-1)
  return lax.fori_loop(1, idx.shape[-1], column, jnp.broadcast_to(one(0), idx.shape))


def _write(values, idx, chunk: int):
  """(..., n, C) zeros plus `values` (..., n, k) at `idx`, exact (no scatter): one masked add per column.

  Where several columns name one position (the replicas' payloads in `wire_mean`) their values add in
  column order; within one payload a chunk's indices differ."""
  cols = jnp.arange(chunk, dtype=idx.dtype)
  zero = jnp.zeros((), values.dtype)

  def one(j):
    return jnp.where(_column(idx, j) == cols, _column(values, j), zero)

  # From column 0: a carry typed like the values (varying in a shard_map).
  return lax.fori_loop(1, idx.shape[-1], lambda j, out: out + one(j), one(0))


def encode(x, spec: TopK):
  """One leaf: (local indices (n, k), codes (n, k), bf16 scales (n,), the decoded values sent, in x's shape).

  The kept values are read, and the sent ones written, through one-hot masks
  rather than a gather and a scatter: inside a map manual over the replica axis
  with the leaf sharded over an automatic data axis (fsdp within each replica),
  XLA's SPMD partitioner aborts the process on such a gather or scatter
  (spmd_partitioner_util.cc "Check failed: partition_group_list...", issue 38);
  the masks are elementwise ops and reductions along the chunk, which it
  partitions like any other. The selected element is the only term of each
  sum, so both are exact.
  """
  chunks, real = _chunks(x, spec.chunk)
  _, idx = lax.top_k(jnp.where(real, jnp.abs(chunks), -1), spec.k)  # padding is never chosen
  kept = _read(chunks, idx)
  scales = _scales(chunks)
  top = 1 << (spec.bits - 1)
  step = scales.astype(x.dtype)[:, None] / top
  mag = jnp.clip(jnp.round(jnp.abs(kept) / jnp.where(step > 0, step, 1)), 1, top).astype(jnp.uint32)
  codes = ((kept < 0).astype(jnp.uint32) << (spec.bits - 1)) | (mag - 1)
  sent = _write(decode(codes, scales, spec.bits, x.dtype), idx, spec.chunk)
  return idx, codes, scales, sent.reshape(-1)[: x.size].reshape(x.shape)


def payload_bytes(size: int, spec: TopK) -> tuple[int, int, int]:
  """(index, code, scale) bytes of one leaf of `size` elements in the payload."""
  n = -(-size // spec.chunk)
  return -(-n * spec.k * spec.index_bits // 8), -(-n * spec.k * spec.bits // 8), 2 * n


def _after(x, done):
  """`x`, available only once `done` is computed: the leaves are coded (and decoded) one after another.

  Each leaf's coding holds temporaries the size of the leaf (its outer gradient, on CPU a sort of its
  magnitudes and their indices); without an order XLA may compute every leaf's at once, several times
  the parameters in all. The barrier orders, it computes nothing."""
  return lax.optimization_barrier((x, done))[0]


def wire_mean(leaves: list, axis_name, replicas: int, spec: TopK):
  """(Delta, left): (1/P) sum_p c_p for each leaf, decoded from one all-gather, and this replica's x - c_p.

  `leaves[i](order)` computes leaf i's x from its inputs passed through `order` (which makes them wait
  for the previous leaf), and returns (x, back): x whole, and how to lay a whole leaf back out as the
  inputs are. So at most one leaf's outer gradient and coding temporaries are live at a time.
  """
  parts, left, backs, shapes, prev = [], [], [], [], None
  for leaf in leaves:
    x, back = leaf(lambda inputs, prev=prev: inputs if prev is None else _after(inputs, prev))
    if x.size == 0:  # an empty leaf: no chunk, nothing in the payload; its Delta and residual are empty too
      left.append(back(x))
      backs.append(back)
      shapes.append((0, x.shape, x.dtype))
      continue
    idx, codes, scales, c = encode(x, spec)
    parts += [pack(idx, spec.index_bits), pack(codes, spec.bits), lax.bitcast_convert_type(scales, jnp.uint8).ravel()]
    left.append(back(x - c))  # x and c die here
    backs.append(back)
    shapes.append((x.size, x.shape, x.dtype))
    prev = (parts[-1], left[-1])
  everyone = lax.all_gather(jnp.concatenate(parts), axis_name)  # (P, payload bytes): the only collective
  delta: list = []
  offset = 0
  for back, (size, shape, dtype) in zip(backs, shapes, strict=True):
    if size == 0:
      delta.append(back(jnp.zeros(shape, dtype)))
      continue
    n, k = -(-size // spec.chunk), spec.k
    cuts = offset + np.cumsum((0, *payload_bytes(size, spec)))
    idx_b, code_b, scale_b = (everyone[:, lo:hi] for lo, hi in zip(cuts[:-1], cuts[1:], strict=True))
    if delta:
      idx_b = _after(idx_b, delta[-1])
    offset = int(cuts[-1])
    idx = unpack(idx_b, spec.index_bits, n * k).reshape(replicas, n, k).astype(jnp.int32)
    codes = unpack(code_b, spec.bits, n * k).reshape(replicas, n, k)
    scales = lax.bitcast_convert_type(scale_b.reshape(replicas, n, 2), jnp.bfloat16)
    # Every replica's values written into one (n, C) buffer: the P k terms of a chunk in one masked sum (at most
    # one term per replica at each position), so no dense (P, n, C) copy per replica is ever held.
    values = jnp.moveaxis(decode(codes, scales, spec.bits, dtype), 0, 1).reshape(n, replicas * k)
    total = _write(values, jnp.moveaxis(idx, 0, 1).reshape(n, replicas * k), spec.chunk)
    delta.append(back(total.reshape(-1)[:size].reshape(shape) / jnp.asarray(replicas, dtype)))
  return delta, left
