"""Compiled memory: `ja.memory_breakdown`, and the per-device peaks the docs promise, held here (issue 48).

Every step is compiled from `jax.ShapeDtypeStruct`s with shardings (nothing allocated): seconds each. The
figures are XLA's `memory_analysis()` totals (argument + output - alias + temp, donated), deterministic on
this machine, so a change that costs memory fails here rather than drifting in the bench.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxaccum as ja
from jaxaccum import _engine
from jaxaccum.bench import fit
from jaxaccum.bench import fsdp as fsdp_bench

# A small decoder (the fit bench's model: scanned remat layers, bf16 compute, float32 state and logits).
SMALL = fit.Shape(layers=2, width=128, heads=4, kv_heads=2, head_dim=32, ffw=256, vocab=2048, seq=64, batch=64)


def _peak(compiled) -> int:
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


# The user's step without jaxaccum (jit + lax.scan over K strided microbatches, GSPMD), written plainly in the
# bench (`jaxaccum.bench.fit.plain_step`): the fit section's reference too, one definition for both.
_plain_step = fit.plain_step


def _inputs(mesh, axes, layout, opt):
  p, s = ja.shard_train_state(fit.abstract_params(SMALL), opt, mesh, strategy=layout, data_axis=axes)
  tokens = jax.ShapeDtypeStruct((SMALL.batch, SMALL.seq), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(axes)))
  return p, s, {"inputs": tokens, "targets": tokens}


# (strategy, fsdp_gather, the plain step's layout, hsdp mesh)
AGAINST_PLAIN = [
  ("ddp", None, "ddp", False),
  ("zero1", None, "ddp", False),
  ("fsdp", "per_microbatch", "fsdp", False),
  ("hsdp", "per_microbatch", "hsdp", True),
]


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize(("strategy", "gather", "layout", "hsdp"), AGAINST_PLAIN, ids=[c[0] for c in AGAINST_PLAIN])
def test_every_strategy_at_or_under_the_plain_step(strategy, gather, layout, hsdp, opt_name):
  """Per-device peak against the plain GSPMD step's in the same layout (ddp and zero1: the replicated one).

  The step carries the skip guarantee (a conditional update, the finite check); the plain step has neither,
  so this also holds "a skipped update costs no memory" against an independent step. At 274ad1a (jax 0.12)
  ddp was 1.14x (adamw) and 1.21x (sgd) the plain step at K=4 here, fsdp 1.12x-1.14x, hsdp 1.13x-1.16x:
  the finite check's `x * 0` shared one broadcast zero with the accumulator's zero init, which XLA then
  kept alive through the loop (a parameter-sized buffer per leaf). Now every cell is <= 1.00x on jax 0.10.2;
  on jax 0.12 fsdp and hsdp at K=4 are up to 1.017x (XLA:CPU packs the per-device logits' buffers of the
  same loss differently from the partitioner's vocabulary-sharded ones): the bound is 1.02x, the target
  1.00x (issue 48). At K=4 the same step without the guarantee (`skip_nonfinite=False`'s program) is
  compiled too: the guarantee costs no memory (<= 1.001x), adam(w) and sgd, every strategy.
  """
  opt = optax.adamw(1e-3) if opt_name == "adamw" else optax.sgd(1e-2)
  axes = ("replica", "data") if hsdp else "data"
  names = axes if hsdp else (axes,)
  mesh = jax.make_mesh((2, 4) if hsdp else (8,), names, axis_types=(AxisType.Auto,) * len(names))
  loss = fit.make_loss(SMALL)
  ratios = {}
  for k in (1, 4):
    plain = _plain_step(loss, opt, k, *_inputs(mesh, axes, layout, opt)[:2])
    plain_peak = _peak(plain.lower(*_inputs(mesh, axes, layout, opt)).compile())
    options = {} if gather is None else {"fsdp_gather": gather}
    step = ja.make_train_step(loss, opt, num_microbatches=k, mesh=mesh, strategy=strategy, data_axis=axes, **options)
    args = _inputs(mesh, axes, strategy, opt)
    with_skip = _peak(step.lower(*args).compile())
    ratios[k] = with_skip / plain_peak
  without = _peak(_engine.always_applied(step).lower(*args).compile())  # K=4: the last step built
  assert ratios[1] <= 1.001 and ratios[4] <= 1.02, ratios  # 1.001: a few scalars (float64 weights under x64)
  assert with_skip <= 1.001 * without, (strategy, with_skip, without)


@pytest.mark.parametrize("kind", ["listed", "scanned"])
def test_layerwise_fsdp_within_5_percent_of_the_hand_written_reference(kind):
  """fsdp per_microbatch's peak <= 1.05x a hand-written layerwise FSDP step (shard_map, one layer gathered).

  12 layers of 512, adam, K in {4, 8}, 8 devices (the bench's fsdp section). At 274ad1a the scanned
  model was 1.19x at 512 (the broadcast zero the finite check shared with the accumulator's init).
  """
  with jax.enable_x64(False):  # the bench's float32 model and reference, as written there
    _layerwise_against_reference(kind)


def _layerwise_against_reference(kind):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  opt = optax.adam(1e-3)
  width, batch = 512, 256  # the bench's fsdp section's model (issue 48)
  params = fsdp_bench._params(kind, width, 12, jax.random.PRNGKey(1))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  p, s = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
  rows = NamedSharding(mesh, PartitionSpec("data"))
  x = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=rows)
  loss, ref_loss = fsdp_bench._loss(kind), fsdp_bench._reference_loss(kind, "data")
  ratios = {}
  for k in (4, 8):
    ref = fsdp_bench._shard_map_step(jax.value_and_grad(ref_loss), p, opt, mesh, k)
    ref_peak = _peak(ref.lower(p, s, x, x).compile())
    step = fsdp_bench._ja_step(loss, opt, mesh, k, "fsdp", "per_microbatch")
    ratios[k] = _peak(step.lower(p, s, (x, x)).compile()) / ref_peak
  assert all(r <= 1.05 for r in ratios.values()), ratios


def test_memory_breakdown_names_the_buffers_at_the_peak():
  """The buffers alive at the peak: the arguments by their path, the rest by the JAX operation that made them."""

  def f(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum(jnp.exp(h @ params["w2"]))

  params = {"w1": jax.ShapeDtypeStruct((256, 512), jnp.float32), "w2": jax.ShapeDtypeStruct((512, 256), jnp.float32)}
  x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
  lowered = jax.jit(jax.grad(f)).lower(params, x)
  got = ja.memory_breakdown(lowered)
  assert got.peak_bytes == sum(b.bytes for b in got.buffers) > 0
  assert [b.bytes for b in got.buffers] == sorted((b.bytes for b in got.buffers), reverse=True)
  kinds = got.by_kind()
  assert set(kinds) <= {"argument", "gathered", "collective", "loop state", "temporary"}
  named = {b.op_name for b in got.buffers if b.kind == "argument"}
  # x (1 MiB) is read by the backward pass: alive at the peak, named by its argument path.
  assert any(n.startswith("x") or n.startswith("args[1]") for n in named), named
  assert not any("\\'" in b.op_name for b in got.buffers)  # paths as JAX names them, not as HLO escapes them
  assert all(b.shape != "?" for b in got.buffers), got.summary()  # loop bodies' parameters too
  # The largest temporary is an activation of 1024 x 512 float32 (2 MiB), named by its operation.
  temps = [b for b in got.buffers if b.kind == "temporary"]
  assert temps and temps[0].bytes >= 1024 * 512 * 4 and temps[0].op_name, temps[:3]
  assert "peak" in got.summary() and "MiB" in got.summary()


def test_memory_breakdown_sees_a_gathered_array():
  """An all-gather's result is its own kind: what fsdp's gathered layers are at the peak."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

  def body(w, x):
    full = lax.all_gather(w, "data", axis=0, tiled=True)  # 8 x the shard: 4 MiB
    return jnp.sum(x @ full)[None]

  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec("data"), PartitionSpec()), out_specs=PartitionSpec("data"))
  )
  w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("data")))
  x = jax.ShapeDtypeStruct((16, 1024), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  got = ja.memory_breakdown(f.lower(w, x))
  assert got.buffers[0].kind == "gathered" and got.buffers[0].bytes == 1024 * 1024 * 4, got.summary()
  assert got.by_kind()["argument"] >= 1024 * 1024 * 4 // 8  # the shard


def test_memory_breakdown_refuses_what_is_not_lowered():
  with pytest.raises(ValueError, match=r"lowered must be a jax.stages.Lowered.*function$"):
    ja.memory_breakdown(lambda x: x)
  step = ja.make_train_step(lambda p, b: jnp.sum(p * b), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"got TrainStep; call its .lower\(...\) .* step.lower\(params, opt_state"):
    ja.memory_breakdown(step)  # the step itself, not its lowering (a user's first try)
