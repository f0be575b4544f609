"""plan_microbatches(): the smallest K whose compiled footprint fits, from XLA's memory analysis."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import mlp_init, mse_loss, regression_data
from jax.sharding import PartitionSpec as P

import jaxaccum as ja


def setup():
  """A step whose activations dominate: batch 256, width 64, so temp memory shrinks with K."""
  params = mlp_init(jax.random.PRNGKey(0), (16, 64, 64, 2))
  data = regression_data(jax.random.PRNGKey(1), 256, d_in=16)
  opt = optax.sgd(0.1)
  factory = lambda k: ja.make_train_step(mse_loss, opt, num_microbatches=k)
  return factory, (params, opt.init(params), data)


def total_bytes(jitted, *args):
  m = jitted.lower(*args).compile().memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def test_picks_smallest_k_that_fits():
  factory, args = setup()
  t1, t2, t4 = (total_bytes(factory(k), *args) for k in (1, 2, 4))
  assert t1 > t2 > t4  # microbatching shrinks the footprint (else the test means nothing)
  # A budget between K=2 and K=4: default candidates (divisors of 256) tried in order.
  plan = ja.plan_microbatches(factory, *args, memory_budget_bytes=(t2 + t4) // 2)
  assert plan == 4 and isinstance(plan, int)
  assert plan.totals == {1: t1, 2: t2, 4: t4}  # stopped at the first fit
  assert plan.memory_bytes == t4
  assert ja.plan_microbatches(factory, *args, memory_budget_bytes=t1, candidates=(4, 1)) == 1


def test_nothing_fits_names_smallest_total():
  factory, args = setup()
  t = total_bytes(factory(8), *args)
  with pytest.raises(ValueError, match=f"smallest compiled total is {t} bytes \\(K=8\\)"):
    ja.plan_microbatches(factory, *args, memory_budget_bytes=100, candidates=[2, 8])
  with pytest.raises(ValueError, match="memory_budget_bytes=0"):
    ja.plan_microbatches(factory, *args, memory_budget_bytes=0)
  with pytest.raises(TypeError, match="memory_budget_bytes='100'"):
    ja.plan_microbatches(factory, *args, memory_budget_bytes="100")
  with pytest.raises(TypeError, match="step_fn="):
    ja.plan_microbatches(None, *args, memory_budget_bytes=1)
  with pytest.raises(ValueError, match="candidates=0"):
    ja.plan_microbatches(factory, *args, memory_budget_bytes=1, candidates=[0])


def test_default_candidates_divide_each_devices_rows_on_a_mesh():
  """With the batch split over 8 devices, K must divide the 8 rows a device holds, not the 64 in all."""
  mesh = ja.data_mesh()
  params = mlp_init(jax.random.PRNGKey(0), (3, 4, 2))
  opt = optax.sgd(0.1)
  args = (
    ja.replicate(params, mesh),
    ja.replicate(opt.init(params), mesh),
    ja.shard_batch(regression_data(jax.random.PRNGKey(1), 64), mesh),
  )
  factory = lambda k: ja.make_train_step(mse_loss, opt, num_microbatches=k, mesh=mesh)
  with pytest.raises(ValueError, match=r"no num_microbatches in \[1, 2, 4, 8\] fits"):
    ja.plan_microbatches(factory, *args, memory_budget_bytes=1)


def test_bad_input_names_the_value():
  factory, (params, state, data) = setup()
  empty = jax.tree.map(lambda x: x[:0], data)
  with pytest.raises(ValueError, match=r"example_args\[2\] is an empty batch \(0 rows\)"):
    ja.plan_microbatches(factory, params, state, empty, memory_budget_bytes=1)
  with pytest.raises(TypeError, match="candidates=4 must be a sequence"):
    ja.plan_microbatches(factory, params, state, data, memory_budget_bytes=1, candidates=4)
  with pytest.raises(TypeError, match="candidates=True"):
    ja.plan_microbatches(factory, params, state, data, memory_budget_bytes=1, candidates=[True])
  with pytest.raises(TypeError, match="batch_argnum=True"):
    ja.plan_microbatches(factory, params, state, data, memory_budget_bytes=1, batch_argnum=True)


def test_step_options_choose_fsdp_comm_lean_when_it_fits():
  """fsdp's comm-lean mode ("once") holds a full accumulator: chosen only when the budget allows it."""
  params = mlp_init(jax.random.PRNGKey(0), (16, 64, 64, 8))
  data = regression_data(jax.random.PRNGKey(1), 64, d_in=16, d_out=8)
  mesh = ja.data_mesh()
  opt = optax.adam(1e-3)
  p, s = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
  batch = ja.shard_batch(data, mesh)

  def factory(k, **options):
    return ja.make_train_step(mse_loss, opt, num_microbatches=k, mesh=mesh, strategy="fsdp", **options)

  once, lean = (total_bytes(factory(4, fsdp_gather=g), p, s, batch) for g in ("once", "per_microbatch"))
  assert once > lean  # the full accumulator costs memory (else the test means nothing)
  options = [{"fsdp_gather": "once"}, {"fsdp_gather": "per_microbatch"}]
  plan = ja.plan_microbatches(factory, p, s, batch, memory_budget_bytes=once, candidates=[4], step_options=options)
  assert (int(plan), plan.step_options, plan.memory_bytes) == (4, {"fsdp_gather": "once"}, once)
  plan = ja.plan_microbatches(
    factory, p, s, batch, memory_budget_bytes=(once + lean) // 2, candidates=[4], step_options=options
  )
  assert (int(plan), plan.step_options, plan.memory_bytes) == (4, {"fsdp_gather": "per_microbatch"}, lean)
  assert plan.totals == {(4, 0): once, (4, 1): lean}
  with pytest.raises(TypeError, match="step_options="):
    ja.plan_microbatches(factory, p, s, batch, memory_budget_bytes=once, step_options={"fsdp_gather": "once"})


@pytest.mark.slow  # 30 s: several layerwise fsdp compiles
def test_step_options_layerwise_fsdp_smallest_k_first_then_comm_lean():
  """fsdp per_microbatch gathers layer by layer: it saves more than the full parameter copy "once" holds.

  Budgets from the compiled totals (nothing hard-coded): K is tried ascending, and for each K the
  comm-lean "once" before "per_microbatch"; the first (K, mode) that fits wins.
  """
  params = mlp_init(jax.random.PRNGKey(0), (16, 128, 128, 128, 8))  # parameters dominate: 8 rows per device
  data = regression_data(jax.random.PRNGKey(1), 64, d_in=16, d_out=8)
  mesh = ja.data_mesh()
  opt = optax.adam(1e-3)
  p, s = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
  batch = ja.shard_batch(data, mesh)
  full = sum(x.nbytes for x in jax.tree.leaves(params))

  def factory(k, **options):
    return ja.make_train_step(mse_loss, opt, num_microbatches=k, mesh=mesh, strategy="fsdp", **options)

  t = {(k, g): total_bytes(factory(k, fsdp_gather=g), p, s, batch) for k in (1, 2) for g in ("once", "per_microbatch")}
  # "once" holds the gathered tree, a full-size accumulator and a microbatch's gradient; layer by layer
  # holds 1/P of each and one layer at a time (gathering the whole tree per microbatch, as before the
  # layerwise engine, held the gathered tree and the gradient: about as much as "once" at K=1).
  for k in (1, 2):
    assert t[k, "once"] > 2 * t[k, "per_microbatch"], (k, t, full)
  assert t[1, "per_microbatch"] < 1.2 * full  # below one replicated copy of params + adam (3N) by far
  options = [{"fsdp_gather": "once"}, {"fsdp_gather": "per_microbatch"}]
  plan = lambda budget: ja.plan_microbatches(
    factory, p, s, batch, memory_budget_bytes=budget, candidates=[1, 2], step_options=options
  )
  # Room for "once" at K=1: comm-lean first.
  got = plan(t[1, "once"])
  assert (int(got), got.step_options, got.memory_bytes) == (1, options[0], t[1, "once"])
  assert got.totals == {(1, 0): t[1, "once"]}
  # Only the layerwise step fits (at every K): K=1, after "once" was tried there; K=2 is never compiled.
  budget = t[1, "per_microbatch"]
  assert budget < min(t[1, "once"], t[2, "once"])
  got = plan(budget)
  assert (int(got), got.step_options, got.memory_bytes) == (1, options[1], budget)
  assert got.totals == {(1, 0): t[1, "once"], (1, 1): budget}


# --------------------------------------------------------------------------- from abstract shapes (issue 39)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def test_plan_from_shape_dtype_structs_equals_plan_from_arrays():
  """ShapeDtypeStructs -> ja.shard_train_state -> ja.plan_microbatches: the same K and totals as the arrays give."""
  params = mlp_init(jax.random.PRNGKey(0), (16, 128, 8))  # one hidden layer: quick compiles
  data = regression_data(jax.random.PRNGKey(1), 256, d_in=16, d_out=8)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  opt = optax.adam(1e-3)
  factory = lambda k: ja.make_train_step(mse_loss, opt, num_microbatches=k, mesh=mesh, strategy="fsdp")
  ap, as_ = ja.shard_train_state(_abstract(params), opt, mesh, strategy="fsdp")
  abatch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, P("data"))), data
  )
  t2 = total_bytes(factory(2), ap, as_, abatch)
  abstract = ja.plan_microbatches(factory, ap, as_, abatch, memory_budget_bytes=t2)
  p, s = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
  concrete = ja.plan_microbatches(factory, p, s, ja.shard_batch(data, mesh), memory_budget_bytes=t2)
  assert int(abstract) == int(concrete) == 2  # K = 1 needs more (else the choice means nothing)
  assert abstract.totals == concrete.totals and list(abstract.totals) == [1, 2]


def test_plan_a_model_no_host_could_hold():
  """2 GiB of float64 weights, ddp: 5 copies (params, adam's two moments, the gradient and its update) per device,
  80 GiB over 8 devices. Planned from ShapeDtypeStructs: compiled in seconds, nothing allocated."""
  import resource

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  params = {"w": jax.ShapeDtypeStruct((4, 8192, 8192), jnp.float64)}  # 2 GiB
  batch = tuple(jax.ShapeDtypeStruct((64, 8192), jnp.float64, sharding=rows) for _ in range(2))

  def loss(params, batch):
    x, y = batch
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["w"])
    return jnp.mean((h - y) ** 2)

  opt = optax.adam(1e-3)
  live = sum(x.nbytes for x in jax.live_arrays())
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
  plans = {}
  for strategy in ("ddp", "fsdp"):
    p, s = ja.shard_train_state(params, opt, mesh, strategy=strategy)
    plans[strategy] = ja.plan_microbatches(
      lambda k, strategy=strategy: ja.make_train_step(loss, opt, num_microbatches=k, mesh=mesh, strategy=strategy),
      p, s, batch, memory_budget_bytes=64 * 2**30, candidates=[1, 2],
    )  # fmt: skip
  full = 2 * 2**30
  assert plans["ddp"].memory_bytes > 4 * full  # the replicated state, per device
  assert plans["fsdp"].memory_bytes < plans["ddp"].memory_bytes / 4
  assert sum(x.nbytes for x in jax.live_arrays()) - live < 2**20
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < full // 2**10 // 4  # < 0.5 GiB grown
