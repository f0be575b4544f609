"""ja.grad / ja.value_and_grad and ja.accumulate in the user's own jit on an Explicit mesh (issue 19)."""

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_init, mse_loss, regression_data, remat_dense
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo, _unreduced

RTOL = 1e-12
N_DEV = 8


def explicit_mesh(shape=(N_DEV,), names=("data",)):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def full_batch_run(opt, params, windows, loss_fn=mse_loss):
  """The reference: one plain optax step per window on the union of its microbatches, on one device."""
  state = opt.init(params)
  for window in windows:
    union = jax.tree.map(lambda *xs: jnp.concatenate(xs), *window)
    updates, state = opt.update(jax.grad(loss_fn)(params, union), state, params)
    params = optax.apply_updates(params, updates)
  return params


def inner_opt():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.05, weight_decay=0.1))


def windows_of(sizes, k, seed=1):
  """Microbatches of the given row counts (multiples of 8), grouped into windows of k."""
  x, y = regression_data(jax.random.PRNGKey(seed), sum(sizes))
  micro, start = [], 0
  for n in sizes:
    micro.append((x[start : start + n], y[start : start + n]))
    start += n
  return [micro[i : i + k] for i in range(0, len(micro), k)]


def adam_window(params, mesh):
  """(tx, replicated params, tx.init, a microbatch of 16 rows over "data") for a window of 4 (inside set_mesh)."""
  tx = ja.accumulate(optax.adam(0.1), 4, axis_name="data")
  p = jax.device_put(params, NamedSharding(mesh, P()))
  return tx, p, tx.init(p), jax.device_put(windows_of([16], 1)[0][0], NamedSharding(mesh, P("data")))


def own_jit_step(tx, weighted):
  @jax.jit
  def step(params, state, batch):
    grads = ja.grad(mse_loss, axis_name="data")(params, batch)
    weight = jnp.float64(batch[0].shape[0]) if weighted else None
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize(
  "k, sizes, weighted",
  [(1, [16, 32], False), (4, [16] * 8, False), (4, [8, 40, 16, 24, 32, 8, 8, 16], True)],
)
def test_own_jit_step_is_exact(k, sizes, weighted):
  """ja.grad + ja.accumulate in a plain jit on an Explicit mesh = the full-batch step, float64."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  windows = windows_of(sizes, k)
  mesh = explicit_mesh()
  tx = ja.accumulate(inner_opt(), k, axis_name="data")
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(p)
    assert all(_unreduced.is_unreduced(a, "data") for a in jax.tree.leaves(state.acc_grads))
    step = own_jit_step(tx, weighted)
    for window in windows:
      for m in window:
        p, state = step(p, state, jax.device_put(m, NamedSharding(mesh, P("data"))))
  assert int(state.update_count) == len(windows)
  chex.assert_trees_all_close(p, full_batch_run(inner_opt(), params, windows), rtol=RTOL, atol=0)


def test_a_closure_over_a_tracer_of_the_users_jit_is_refused_naming_the_argument_way():
  """A value traced by the user's jit, closed over by the loss: refused by name; passed as an argument, exact."""
  mesh = explicit_mesh()
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  batch = windows_of([16], 1)[0][0]
  scaled = lambda p, b, t: t * mse_loss(p, b)
  with jax.set_mesh(mesh):
    p, t = jax.device_put((params, jnp.float64(0.5)), NamedSharding(mesh, P()))
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    closure = jax.jit(lambda p, b, t: ja.grad(lambda p, b: scaled(p, b, t), axis_name="data")(p, b))
    with pytest.raises(ValueError, match="Pass it to the loss as an argument"):
      closure(p, b, t)
    got = jax.jit(lambda p, b, t: ja.grad(scaled, axis_name="data")(p, b, t))(p, b, t)
    got = jax.tree.map(lambda g: jax.reshard(g, P()), got)
  chex.assert_trees_all_close(got, jax.grad(scaled)(params, batch, 0.5), rtol=RTOL, atol=0)


def test_an_empty_parameter_accumulates_in_the_own_jit_step():
  """An empty (0, 3) leaf beside the MLP: exact, on every jax. From jax 0.11 plain JAX cannot create a zero-size
  array typed unreduced (shown here), so its accumulator is an ordinary empty array with nothing to add."""
  mesh = explicit_mesh()
  params = {"mlp": mlp_init(jax.random.PRNGKey(0), (3, 8, 2)), "empty": jnp.zeros((0, 3))}
  loss = lambda p, b: mse_loss(p["mlp"], b) + jnp.sum(p["empty"])
  windows = windows_of([16] * 4, 2)
  if jax.__version_info__ >= (0, 11):
    with jax.set_mesh(mesh), pytest.raises(Exception, match="unreduced axes mismatch"):
      jnp.zeros((0, 3), out_sharding=NamedSharding(mesh, P(unreduced={"data"}))).block_until_ready()
  tx = ja.accumulate(inner_opt(), 2, axis_name="data")

  @jax.jit
  def step(params, state, batch):
    updates, state = tx.update(ja.grad(loss, axis_name="data")(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(p)
    for window in windows:
      for m in window:
        p, state = step(p, state, jax.device_put(m, NamedSharding(mesh, P("data"))))
  want = full_batch_run(inner_opt(), params, windows, loss_fn=loss)
  chex.assert_trees_all_close(p, want, rtol=RTOL, atol=0)


def test_one_params_sized_all_reduce_per_window_in_the_window_end_branch():
  """Compiled HLO, parsed by called computations: no collective at the top level of a micro-step."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    tx, p, state, batch = adam_window(params, mesh)
    hlo = own_jit_step(tx, True).lower(p, state, batch).compile().as_text()
  found = _hlo.collectives(hlo, N_DEV)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  assert found, "the window end must reduce"
  assert {c.where for c in found} == {"branch"}, found
  assert sum(c.result_bytes for c in found) == 8 * n_params


def test_plain_jax_grad_is_refused_naming_the_leaf_and_ja_grad():
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    tx, p, state, batch = adam_window(params, mesh)

    @jax.jit
    def step(p, s, b):
      return tx.update(jax.grad(mse_loss)(p, b), s, p)

    with pytest.raises(ValueError, match=r"grads\[0\]\['b'\] is not unreduced.*ja\.grad\(loss, axis_name='data'\)"):
      step(p, state, batch)


def test_leaf_sharded_over_the_axis_is_reduce_scattered_into_its_sharding():
  """A parameter sharded P('data') gets its mean in P('data') (one reduce, no gather), exact."""
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (16, 2), jnp.float64), "b": jnp.zeros((2,), jnp.float64)}

  def loss(q, batch):
    x, y = batch
    return jnp.mean((x @ q["w"] + q["b"] - y) ** 2)

  x = jax.random.normal(jax.random.PRNGKey(1), (64, 16), jnp.float64)
  y = jax.random.normal(jax.random.PRNGKey(2), (64, 2), jnp.float64)
  windows = [[(x[:32], y[:32]), (x[32:], y[32:])]]
  mesh = explicit_mesh()
  tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data")
  with jax.set_mesh(mesh):
    p = {"w": jax.device_put(params["w"], NamedSharding(mesh, P("data"))), "b": jax.device_put(params["b"], P())}
    state = tx.init(p)

    @jax.jit
    def step(p, s, b):
      u, s = tx.update(ja.grad(loss, axis_name="data")(p, b), s, p)
      return optax.apply_updates(p, u), s

    for m in windows[0]:
      p, state = step(p, state, jax.device_put(m, NamedSharding(mesh, P("data"))))
    assert p["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    hlo = step.lower(p, state, jax.device_put(windows[0][0], NamedSharding(mesh, P("data")))).compile().as_text()
  found = _hlo.collectives(hlo, N_DEV)
  # The forward gathers the sharded w on every call (the FSDP price); every reduction waits for the window end.
  assert {c.where for c in found if c.opcode in ("all-reduce", "reduce-scatter")} == {"branch"}
  chex.assert_trees_all_close(p, full_batch_run(optax.sgd(0.1), params, windows, loss), rtol=RTOL, atol=0)


def test_value_and_grad_with_aux_and_weight_fn_is_the_global_weighted_mean():
  """A masked mean loss with rows unevenly real across devices: weight_fn = real rows gives the global mean."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 64)
  mask = (jnp.arange(64) % 8 < jnp.arange(64) // 8 % 4 + 1).astype(jnp.float64)  # 1..4 real rows per 8

  def loss(q, batch):
    x, y, m = batch
    err = jnp.sum((mlp_apply(q, x) - y) ** 2, -1)
    value = jnp.sum(m * err) / jnp.maximum(jnp.sum(m), 1)
    return value, {"err": value * 2}

  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    batch = jax.device_put((x, y, mask), NamedSharding(mesh, P("data")))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    (value, aux), grads = jax.jit(
      ja.value_and_grad(loss, axis_name="data", has_aux=True, weight_fn=lambda b: jnp.sum(b[2]))
    )(p, batch)
    assert _unreduced.is_unreduced(grads[0]["w"], "data")
    grads = jax.jit(lambda g: jax.tree.map(lambda a: jax.reshard(a, P()), g))(grads)
  (ref_value, ref_aux), ref = jax.value_and_grad(loss, has_aux=True)(params, (x, y, mask))
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  np.testing.assert_allclose(aux["err"], ref_aux["err"], rtol=RTOL)
  chex.assert_trees_all_close(grads, ref, rtol=RTOL, atol=0)


def test_grad_with_several_argnums_and_has_aux():
  mesh = explicit_mesh()

  def loss(a, b, x):
    return jnp.mean((x * a + b) ** 2), jnp.mean(x)

  x = jnp.arange(16.0, dtype=jnp.float64)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    (ga, gb), aux = jax.jit(
      lambda a, b, x: jax.tree.map(
        lambda t: jax.reshard(t, P()) if _unreduced.is_unreduced(t, "data") else t,
        ja.grad(loss, (0, 1), axis_name="data", has_aux=True)(a, b, x),
      )
    )(jnp.float64(2.0), jnp.float64(1.0), xs)
  (ra, rb), raux = jax.grad(loss, (0, 1), has_aux=True)(2.0, 1.0, x)
  np.testing.assert_allclose([ga, gb, aux], [ra, rb, raux], rtol=RTOL)


def _tp_loss(p, batch):
  """A tensor-parallel MLP written for the global batch on an Explicit (data, model) mesh: w1 split over "model"
  on its outputs, w2 on its inputs; the contraction over "model" is annotated, as JAX asks on Explicit meshes."""
  x, y = batch
  h = jnp.tanh(x @ p["w1"])
  return jnp.mean((jnp.matmul(h, p["w2"], out_sharding=P("data", None)) - y) ** 2)


def test_ja_grad_and_accumulate_beside_a_model_axis():
  """ja.grad + ja.accumulate(axis_name="data") in the user's own jit on a (data 4, model 2) Explicit mesh, the
  parameters split over "model": exact against make_train_step over the same window's rows, one reduction over
  "data" per update (the window end), the model axis's own collectives as the partitioner places them. Where the
  installed JAX cannot type a partly manual map's output unreduced (0.10), the refusal names the version and the
  fix (before, issue 49: refused on every version, with a message that said "In JAX 0.10")."""
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(6, 8)), "w2": rng.normal(size=(8, 3))}
  x, y = rng.normal(size=(32, 6)), rng.normal(size=(32, 3))
  specs = {"w1": P(None, "model"), "w2": P("model", None)}
  mesh = explicit_mesh((4, 2), ("data", "model"))
  opt, k = optax.adam(0.01), 2
  tx = ja.accumulate(opt, k, axis_name="data")
  place = lambda tree: jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)

  @jax.jit
  def step(p, s, batch):
    u, s = tx.update(ja.grad(_tp_loss, axis_name="data")(p, batch), s, p)
    return optax.apply_updates(p, u), s

  with jax.set_mesh(mesh):
    p = place(params)
    rows = [jax.device_put((x[i::k], y[i::k]), NamedSharding(mesh, P("data"))) for i in range(k)]
    if not _unreduced.partial_manual_unreduced():
      with pytest.raises(ValueError, match=f"'model' besides axis_name='data'. In JAX {jax.__version__} .*Upgrade"):
        step(p, tx.init(p), rows[0])
      return
    s = tx.init(p)
    for r in rows:
      p, s = step(p, s, r)
    compiled = step.lower(p, s, rows[0]).compile()
    train = ja.make_train_step(_tp_loss, opt, num_microbatches=k, mesh=mesh, donate=False)
    # The window's update is adam on the mean gradient over its 32 rows: make_train_step's over the same rows.
    want, _, _ = train(place(params), opt.init(place(params)), jax.device_put((x, y), NamedSharding(mesh, P("data"))))
  assert jax.typeof(p["w1"]).sharding.spec == P(None, "model")  # the layout the user gave, kept
  chex.assert_trees_all_close(p, want, rtol=RTOL, atol=1e-15)
  moved = max(float(np.max(np.abs(np.asarray(p[n]) - params[n]))) for n in params)
  assert moved > 1e-3  # the window ended: an update was applied
  by_axis = ja.count_collectives(compiled, by_axis=True, mesh=mesh)
  assert by_axis.get("data", {}) == {"all-reduce": 1}, by_axis  # the window end's one reduction
  assert "all-reduce" in by_axis.get("model", {}), by_axis  # the model's own contraction, as in plain JAX


def test_auto_mesh_and_bound_axis_say_what_to_use_instead():
  params = {"w": jnp.ones((3,), jnp.float64)}
  x = jnp.ones((16, 3), jnp.float64)

  def loss(q, x):
    return jnp.mean(x @ q["w"])

  auto = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(auto), pytest.raises(ValueError, match="Auto.*make_train_step"):
    jax.jit(ja.grad(loss, axis_name="data"))(params, x)
  tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data")
  with jax.set_mesh(auto), pytest.raises(ValueError, match="Auto.*shard_map"):
    jax.jit(lambda g, s: tx.update(g, s))(params, tx.init(params))
  with pytest.raises(ValueError, match="bound by an enclosing pmap/shard_map"):
    jax.shard_map(
      lambda q, x: ja.grad(loss, axis_name="data")(q, x), mesh=auto, in_specs=(P(), P("data")), out_specs=P()
    )(params, x)
  with pytest.raises(TypeError, match="argnums"):
    ja.grad(loss, "w", axis_name="data")
  with pytest.raises(TypeError, match="weight_fn"):
    ja.grad(loss, axis_name="data", weight_fn=3)


def test_options_that_need_reduced_gradients_are_refused_with_unreduced_ones():
  params = {"w": jnp.ones((3,), jnp.float64)}
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((16, 3), jnp.float64), NamedSharding(mesh, P("data")))
    for kwargs, match in [({"skip_nonfinite": True}, "skip_nonfinite"), ({"noise_scale_ema": 0.9}, "noise_scale")]:
      tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data", **kwargs)
      state = tx.init(p)
      with pytest.raises(ValueError, match=match):
        jax.jit(lambda q, s, x: tx.update(ja.grad(lambda q, x: jnp.mean(x @ q["w"]), axis_name="data")(q, x), s, q))(
          p, state, x
        )


def test_state_not_made_on_the_mesh_is_refused():
  params = {"w": jnp.ones((3,), jnp.float64)}
  tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data")
  state = tx.init(params)  # params not placed: a plain (shard_map-style) accumulator
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((16, 3), jnp.float64), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="state.acc_grads is not unreduced"):
      jax.jit(lambda q, s, x: tx.update(ja.grad(lambda q, x: jnp.mean(x @ q["w"]), axis_name="data")(q, x), s, q))(
        p, state, x
      )


def test_float16_wire_with_token_weights_is_normalised_in_the_own_jit_step():
  """sum w g of 512-token microbatches overflows float16; the normalised wire lands within float16 rounding."""
  params = {"w": jnp.full((4,), 1.0, jnp.float64)}

  def loss(q, x):
    return jnp.mean(x @ q["w"]) * 40.0  # gradient 40 * mean(x): about 40

  xs = [1.0 + 0.01 * jax.random.uniform(jax.random.PRNGKey(i), (512, 4), jnp.float64) for i in range(4)]
  mesh = explicit_mesh()
  results = {}
  for comm in (None, jnp.float16):
    tx = ja.accumulate(optax.sgd(1e-3), 4, axis_name="data", comm_dtype=comm)
    with jax.set_mesh(mesh):
      p = jax.device_put(params, NamedSharding(mesh, P()))
      state = tx.init(p)

      @jax.jit
      def step(q, s, x, tx=tx):
        u, s = tx.update(ja.grad(loss, axis_name="data")(q, x), s, q, weight=jnp.float64(512.0))
        return optax.apply_updates(q, u), s

      for x in xs:
        p, state = step(p, state, jax.device_put(x, NamedSharding(mesh, P("data"))))
    results[comm] = p["w"]
  assert np.all(np.isfinite(results[jnp.float16]))
  # float16 rounding of a gradient of ~40 (relative 2^-11), times the learning rate.
  np.testing.assert_allclose(results[jnp.float16], results[None], rtol=0, atol=1e-3 * 40 * 2.0**-10)


def test_unreduced_helpers_for_the_microbatch_loop():
  """The pieces ja.microbatch needs to carry unreduced values: zeros, scale by a weight, reduce, the predicate."""
  mesh = explicit_mesh()
  x = jnp.arange(16.0, dtype=jnp.float64)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))

    @jax.jit
    def loop(xs):
      g = ja.grad(lambda a, x: jnp.mean(a * x), axis_name="data")(jnp.float64(1.0), xs)  # mean(x) = 7.5
      acc = _unreduced.zeros((), jnp.float64, None, "data")
      assert _unreduced.is_unreduced(acc, "data") and _unreduced.is_unreduced(g, "data")
      acc = acc + _unreduced.scale(g, jnp.float64(3.0), "data") + _unreduced.scale(g, jnp.float64(1.0), "data")
      out = _unreduced.reduce(acc, "data")
      assert not _unreduced.is_unreduced(out, "data")
      return out, _unreduced.reduce(acc, "data", comm_dtype=jnp.float32)

    out, out32 = loop(xs)
    shape = jax.eval_shape(ja.grad(lambda a, x: jnp.mean(a * x), axis_name="data"), jnp.float64(1.0), xs)
    assert _unreduced.is_unreduced(shape, "data")  # what eval_shape says, before the loop's init
  np.testing.assert_allclose(out, 4 * 7.5, rtol=RTOL)
  np.testing.assert_allclose(out32, 4 * 7.5, rtol=1e-7)


@pytest.mark.parametrize("k, set_mesh", [(1, True), (4, True), (4, False)])
def test_microbatch_of_ja_grad_reduces_once_per_step(k, set_mesh):
  """ja.microbatch(ja.grad(loss, axis_name='data'), K) inside the user's jit: exact, no collective in the loop
  (set_mesh=False: the mesh is known only from where the arguments are placed)."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 64)
  mesh = explicit_mesh()
  with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
    p = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    fun = ja.microbatch(ja.grad(mse_loss, axis_name="data"), k, axis_name="data")
    replicated = NamedSharding(mesh, P())

    @jax.jit
    def step(q, b):
      g = fun(q, b)
      return jax.tree.map(lambda a: jax.reshard(a, replicated) if _unreduced.is_unreduced(a, "data") else a, g)

    grads = step(p, batch)
    hlo = step.lower(p, batch).compile().as_text()
  chex.assert_trees_all_close(grads, jax.grad(mse_loss)(params, (x, y)), rtol=RTOL, atol=0)
  assert {c.where for c in _hlo.collectives(hlo, N_DEV) if c.result_bytes > 8} == {"top"}
  assert _hlo.count(hlo, "all-reduce") <= 2


MASK = (jnp.arange(64) % 8 < jnp.arange(64) // 8 % 4 + 1).astype(jnp.float64)  # 1..4 real rows per 8


def masked_loss(q, batch):
  x, y, m = batch
  err = jnp.sum((mlp_apply(q, x) - y) ** 2, -1)
  value = jnp.sum(m * err) / jnp.maximum(jnp.sum(m), 1)
  return value, {"err": value * 2}


@pytest.mark.parametrize("skip_empty", [False, True])
def test_microbatch_of_ja_value_and_grad_with_weights_and_aux_is_the_masked_full_batch(skip_empty):
  """Real rows uneven across devices and microbatches (one microbatch all padding): weights at both levels
  (ja.grad's per device, microbatch's per microbatch) give the global masked mean; params-sized reduction once."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 64)
  mask = MASK.at[3::4].set(0.0)  # microbatch 3 (rows 3, 7, ...) is padding
  real = lambda b: jnp.sum(b[2])  # noqa: E731
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put((x, y, mask), NamedSharding(mesh, P("data")))
    vg = ja.value_and_grad(masked_loss, axis_name="data", has_aux=True, weight_fn=real)
    step = jax.jit(ja.microbatch(vg, 4, axis_name="data", weight_fn=real, skip_empty=skip_empty))
    (value, aux), grads = step(p, batch)
    hlo = step.lower(p, batch).compile().as_text()
  (ref_value, ref_aux), ref = jax.value_and_grad(masked_loss, has_aux=True)(params, (x, y, mask))
  np.testing.assert_allclose([value, aux["err"]], [ref_value, ref_aux["err"]], rtol=RTOL)
  chex.assert_trees_all_close(grads, ref, rtol=RTOL, atol=0)
  n_params = sum(a.size for a in jax.tree.leaves(params))
  big = [c for c in _hlo.collectives(hlo, N_DEV) if c.result_bytes >= 8 * n_params]
  assert [c.where for c in big] == ["top"], big  # in the loop: scalars only (ja.grad's weight total, the value)


def test_microbatch_without_axis_name_keeps_ja_grad_unreduced_for_accumulate():
  """No axis_name: the mean stays unreduced, so ja.accumulate reduces once per window over K2 calls of K1."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 128)
  mesh = explicit_mesh()
  tx = ja.accumulate(inner_opt(), 2, axis_name="data")
  fun = ja.microbatch(ja.grad(mse_loss, axis_name="data"), 4)
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(p)

    @jax.jit
    def step(q, s, b):
      g = fun(q, b)
      assert all(_unreduced.is_unreduced(a, "data") for a in jax.tree.leaves(g))
      u, s = tx.update(g, s, q)
      return optax.apply_updates(q, u), s

    for half in (slice(0, 64), slice(64, 128)):
      b = jax.device_put((x[half], y[half]), NamedSharding(mesh, P("data")))
      p, state = step(p, state, b)
    hlo = step.lower(p, state, b).compile().as_text()
  chex.assert_trees_all_close(p, full_batch_run(inner_opt(), params, [[(x, y)]]), rtol=RTOL, atol=0)
  assert {c.where for c in _hlo.collectives(hlo, N_DEV) if c.result_bytes > 8} == {"branch"}


def test_microbatch_in_own_jit_refuses_reduced_gradients_unreduced_concat_and_auto_meshes():
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), 16)
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    plain = ja.microbatch(jax.grad(mse_loss), 2, axis_name="data")
    with pytest.raises(ValueError, match=r"none of fun's outputs is unreduced over 'data'.*ja\.grad\(loss"):
      jax.jit(plain)(p, batch)
    concat = ja.microbatch(ja.grad(mse_loss, axis_name="data"), 2, reductions="concat")
    with pytest.raises(ValueError, match=r"output\[0\]\['b'\] is unreduced over \('data',\).*'concat'"):
      jax.jit(concat)(p, batch)
  auto = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(auto), pytest.raises(ValueError, match="ja.microbatch: axis 'data'.*Auto.*make_train_step"):
    jax.jit(ja.microbatch(jax.grad(mse_loss), 2, axis_name="data"))(params, (x, y))


def test_shard_map_users_init_is_unchanged_on_unplaced_params():
  """Guard: the unreduced accumulator is made only for params on an Explicit mesh with the axis."""
  params = {"w": jnp.ones((3,), jnp.float64)}
  tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data")
  state = tx.init(params)
  assert not _unreduced.is_unreduced(state.acc_grads["w"], "data")
  auto = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
  state = tx.init(jax.device_put(params, NamedSharding(auto, P())))
  assert not _unreduced.is_unreduced(state.acc_grads["w"], "data")


def test_update_without_params_reduces_into_replicated_updates():
  """tx.update(grads, state) with no params: the window's mean comes back replicated, zeros on micro-steps."""
  params = {"w": jnp.arange(3.0, dtype=jnp.float64)}
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 3), jnp.float64)

  def loss(q, x):
    return jnp.mean((x @ q["w"]) ** 2)

  mesh = explicit_mesh()
  tx = ja.accumulate(optax.sgd(0.5), 2, axis_name="data")
  with jax.set_mesh(mesh):
    state = tx.init(jax.device_put(params, NamedSharding(mesh, P())))
    step = jax.jit(lambda s, x: tx.update(ja.grad(loss, axis_name="data")(params, x), s))
    outs = []
    for i in range(2):
      u, state = step(state, jax.device_put(x[i], NamedSharding(mesh, P("data"))))
      assert not _unreduced.is_unreduced(u["w"], "data")
      outs.append(u["w"])
  np.testing.assert_array_equal(outs[0], np.zeros(3))
  expected = -0.5 * jax.grad(loss)(params, x.reshape(32, 3))["w"]
  np.testing.assert_allclose(outs[1], expected, rtol=RTOL)


# Issue 25: real model code through ja.grad and the own-jit ja.accumulate.


def zero_over_zero_loss(q, batch):
  """The usual masked mean, unguarded: a device holding only padding rows computes 0/0 = NaN."""
  x, y, m = batch
  err = jnp.sum((mlp_apply(q, x) - y) ** 2, -1)
  return jnp.sum(m * err) / jnp.sum(m)


def test_a_device_of_padding_only_contributes_exactly_nothing():
  """weight_fn = real rows, device 0 all padding (its loss 0/0): ja.grad selects it out, and one sgd window of
  two microbatches through ja.accumulate(axis_name=) equals the plain step on the union (was NaN everywhere)."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 64)
  mask = MASK.at[:8].set(0.0).at[32:40].set(0.0)  # device 0's rows of both microbatches: padding only
  halves = [(x[:32], y[:32], mask[:32]), (x[32:], y[32:], mask[32:])]
  real = lambda b: jnp.sum(b[2])  # noqa: E731
  mesh = explicit_mesh()
  tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data")
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(p)
    vg = ja.value_and_grad(zero_over_zero_loss, axis_name="data", weight_fn=real)
    value, g = jax.jit(lambda q, b: jax.tree.map(lambda a: jax.reshard(a, P()), vg(q, b)))(
      p, jax.device_put(halves[0], NamedSharding(mesh, P("data")))
    )

    @jax.jit
    def step(q, s, b):
      u, s = tx.update(ja.grad(zero_over_zero_loss, axis_name="data", weight_fn=real)(q, b), s, q, weight=real(b))
      return optax.apply_updates(q, u), s

    for half in halves:
      p, state = step(p, state, jax.device_put(half, NamedSharding(mesh, P("data"))))
  ref_value, ref_grads = jax.value_and_grad(zero_over_zero_loss)(params, halves[0])
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  chex.assert_trees_all_close(g, ref_grads, rtol=RTOL, atol=0)
  ref = jax.tree.map(lambda a, b: a - 0.1 * b, params, jax.grad(zero_over_zero_loss)(params, (x, y, mask)))
  chex.assert_trees_all_close(p, ref, rtol=RTOL, atol=0)


def test_padding_devices_inside_microbatches_of_ja_value_and_grad():
  """ja.microbatch(ja.value_and_grad(...), 4) with devices of padding only in some microbatches (0/0 losses)."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 64)
  mask = MASK.at[:16].set(0.0)  # rows 0..15: device 0's and 1's rows of every microbatch
  real = lambda b: jnp.sum(b[2])  # noqa: E731
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    batch = jax.device_put((x, y, mask), NamedSharding(mesh, P("data")))
    vg = ja.value_and_grad(zero_over_zero_loss, axis_name="data", weight_fn=real)
    value, grads = jax.jit(ja.microbatch(vg, 4, axis_name="data", weight_fn=real))(
      jax.device_put(params, NamedSharding(mesh, P())), batch
    )
  ref_value, ref = jax.value_and_grad(zero_over_zero_loss)(params, (x, y, mask))
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  chex.assert_trees_all_close(grads, ref, rtol=RTOL, atol=0)


def dropout_loss(q, batch, key):
  """The MLP with dropout on its hidden layer: the mask depends on the key and on the rows it is drawn for."""
  x, y = batch
  h = jnp.tanh(x @ q[0]["w"] + q[0]["b"])
  h = h * jax.random.bernoulli(key, 0.5, h.shape) / 0.5
  return jnp.mean(jnp.sum((h @ q[1]["w"] + q[1]["b"] - y) ** 2, -1))


@pytest.mark.parametrize("typed", [False, True])
def test_each_device_draws_its_own_key(typed):
  """Device d's rows get fold_in(key, d): the mean over devices of the plain gradient of each device's rows with
  that key. A raw PRNGKey is named by key_argnum; a typed key is folded without being named."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)
  key = jax.random.key(7) if typed else jax.random.PRNGKey(7)
  mesh = explicit_mesh()
  kwargs = {} if typed else {"key_argnum": 2}
  with jax.set_mesh(mesh):
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    g = jax.jit(
      lambda q, b, k: jax.tree.map(
        lambda a: jax.reshard(a, P()), ja.grad(dropout_loss, axis_name="data", **kwargs)(q, b, k)
      )
    )(jax.device_put(params, NamedSharding(mesh, P())), batch, key)
  rows = [(x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4]) for d in range(N_DEV)]
  per_device = [jax.grad(dropout_loss)(params, r, jax.random.fold_in(key, d)) for d, r in enumerate(rows)]
  same_key = [jax.grad(dropout_loss)(params, r, key) for r in rows]
  mean = lambda gs: jax.tree.map(lambda *a: sum(a) / N_DEV, *gs)  # noqa: E731
  chex.assert_trees_all_close(g, mean(per_device), rtol=RTOL, atol=1e-15)
  assert float(jnp.max(jnp.abs(g[0]["w"] - mean(same_key)[0]["w"]))) > 1e-3  # not the key as it came


def test_key_argnum_folds_every_key_of_a_tree():
  """key_argnum naming a tree of a typed and a raw key and a counter: both keys folded per device, the counter
  kept; a float leaf beside them is refused by its path."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)
  keys = {"typed": jax.random.key(7), "raw": jax.random.PRNGKey(8), "count": jnp.uint32(1)}
  both = lambda q, b, ks: dropout_loss(q, b, ks["typed"]) + dropout_loss(q, b, ks["raw"]) * ks["count"]
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    run = jax.jit(
      lambda q, b, k: jax.tree.map(
        lambda a: jax.reshard(a, P()), ja.grad(both, axis_name="data", key_argnum=2)(q, b, k)
      )
    )
    g = run(jax.device_put(params, NamedSharding(mesh, P())), batch, keys)
    with pytest.raises(TypeError, match=r"key_argnum\['bad'\] is float32\[2\], beside PRNG keys"):
      run(jax.device_put(params, NamedSharding(mesh, P())), batch, {**keys, "bad": jnp.zeros(2, jnp.float32)})
  rows = [(x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4]) for d in range(N_DEV)]
  fold = lambda d: {**keys, "typed": jax.random.fold_in(keys["typed"], d), "raw": jax.random.fold_in(keys["raw"], d)}
  per_device = [jax.grad(both)(params, r, fold(d)) for d, r in enumerate(rows)]
  chex.assert_trees_all_close(g, jax.tree.map(lambda *a: sum(a) / N_DEV, *per_device), rtol=RTOL, atol=1e-15)


def test_per_example_aux_comes_back_in_row_order_and_reductions_are_explicit():
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)

  def loss(q, batch):
    x, y = batch
    out = mlp_apply(q, x)
    per_row = jnp.sum((out - y) ** 2, -1)
    return jnp.mean(per_row), {"per_row": per_row, "logits": out, "mean_out": jnp.mean(out, 0), "n": x.shape[0]}

  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    (value, aux), _ = jax.jit(
      ja.value_and_grad(
        loss,
        axis_name="data",
        has_aux=True,
        aux_reductions={"per_row": "concat", "logits": "concat", "mean_out": "mean", "n": "sum"},
      )
    )(p, batch)
    (value2, aux2), _ = jax.jit(
      ja.value_and_grad(lambda q, b: (loss(q, b)[0], loss(q, b)[1]["per_row"]), axis_name="data", has_aux=True)
    )(p, batch)
    with pytest.raises(ValueError, match="aux_reductions"):
      ja.value_and_grad(loss, axis_name="data", has_aux=True, aux_reductions="max")
  (ref_value, ref_aux) = loss(params, (x, y))
  assert aux["per_row"].shape == (32,) and aux["logits"].shape == (32, 2) and aux2.shape == (32,)
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  for name in ("per_row", "logits", "mean_out"):
    np.testing.assert_allclose(aux[name], ref_aux[name], rtol=RTOL)
  np.testing.assert_allclose(aux2, ref_aux["per_row"], rtol=RTOL)  # the default for a leading dim of rows
  assert int(aux["n"]) == 32


def test_data_axis_annotations_run_exact_and_closures_are_refused_by_name():
  """The cookbook's explicit-sharding code (reshard / out_sharding over "data"): exact, its annotations localised
  (once refused by name); a loss that reads its batch from the enclosing scope: a jaxaccum error naming it."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)

  def annotated(q, b):
    x, y = b
    h = jax.sharding.reshard(x, P("data", None))
    h = jnp.tanh(jnp.dot(h, q[0]["w"], out_sharding=P("data", None)) + q[0]["b"])
    return jnp.mean(jnp.sum((h @ q[1]["w"] + q[1]["b"] - y) ** 2, -1))

  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    got = jax.jit(lambda q, b: jax.reshard(ja.grad(annotated, axis_name="data")(q, b), P()))(p, batch)
    with pytest.raises(ValueError, match=r"ja\.grad: the loss reads an array sharded over 'data' from the enclosing"):
      jax.jit(lambda q, b: ja.grad(lambda q: mse_loss(q, b), axis_name="data")(q))(p, batch)
  chex.assert_trees_all_close(jax.device_get(got), jax.grad(mse_loss)(params, (x, y)), rtol=RTOL, atol=1e-12)


def test_unreduced_gradients_given_to_a_consumer_that_cannot_reduce_them_are_refused():
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    tx, p, _, batch = adam_window(params, mesh)
    g = jax.jit(ja.grad(mse_loss, axis_name="data"))(p, batch)
    plain = ja.accumulate(optax.sgd(0.1), 2)
    with pytest.raises(ValueError, match=r"ja\.accumulate: grads\[0\]\['b'\] is unreduced.*axis_name='data'.*reshard"):
      jax.jit(lambda g, s: plain.update(g, s, p))(g, plain.init(p))
    state = ja.flax.TrainState.create(apply_fn=None, params=p, tx=optax.adam(0.1))
    with pytest.raises(
      ValueError, match=r"TrainState.apply_gradients.*is unreduced.*jax\.reshard\(g, NamedSharding\(mesh, P\(\)\)\)"
    ):
      jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, g)


@pytest.mark.parametrize("under_jit", [False, True])
def test_accumulate_init_and_step_need_no_set_mesh_with_placed_arguments(under_jit):
  """Params and batches placed on the Explicit mesh are enough: init (eager or jitted) and the step, exact."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  windows = windows_of([16] * 4, 2)
  mesh = explicit_mesh()
  tx = ja.accumulate(optax.sgd(0.1), 2, axis_name="data")
  p = jax.device_put(params, NamedSharding(mesh, P()))
  state = jax.jit(tx.init)(p) if under_jit else tx.init(p)
  assert all(_unreduced.is_unreduced(a, "data") for a in jax.tree.leaves(state.acc_grads))
  step = own_jit_step(tx, False)
  for window in windows:
    for m in window:
      p, state = step(p, state, jax.device_put(m, NamedSharding(mesh, P("data"))))
  chex.assert_trees_all_close(p, full_batch_run(optax.sgd(0.1), params, windows), rtol=RTOL, atol=0)


@pytest.mark.parametrize("saved_after", [1, 3])
def test_checkpoint_of_an_own_jit_run_continues_bit_for_bit(saved_after, tmp_path):
  """Saved mid-window (1 of 3 microbatches) or at a window end (3), restored into the live state and into
  jax.eval_shape's: the continued run equals the uninterrupted one exactly, accumulator unreduced again."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  mesh = explicit_mesh()
  tx = ja.accumulate(optax.adam(0.1), 3, axis_name="data")
  micro = [m for w in windows_of([16] * 5, 1) for m in w]
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(p)
    step = own_jit_step(tx, True)
    batches = [jax.device_put(m, NamedSharding(mesh, P("data"))) for m in micro]
    for b in batches[:saved_after]:
      p, state = step(p, state, b)
    ja.checkpoint.save(tmp_path / "ckpt", (p, state))
    restored = [
      ja.checkpoint.restore(tmp_path / "ckpt", like=(p, state)),
      ja.checkpoint.restore(tmp_path / "ckpt", like=jax.eval_shape(lambda: (p, state))),
    ]
    for b in batches[saved_after:]:
      p, state = step(p, state, b)
    for rp, rs in restored:
      assert all(_unreduced.is_unreduced(a, "data") for a in jax.tree.leaves(rs.acc_grads))
      for b in batches[saved_after:]:
        rp, rs = step(rp, rs, b)
      chex.assert_trees_all_equal(rp, p)
      chex.assert_trees_all_equal(rs.inner_state, state.inner_state)


def rnn_loss(q, batch):
  """A recurrence whose lax.scan starts from zeros (a constant carry)."""
  x, y = batch
  h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ q[0]["w"][:, :3] + x), None), jnp.zeros(x.shape), None, length=3)
  return jnp.mean(jnp.sum((h @ q[0]["w"] @ q[1]["w"] + q[1]["b"] - y) ** 2, -1))


def penalised_loss(q, batch):
  """A penalty summed from 0.0 in a fori_loop, and a power iteration from a constant vector."""
  w = q[0]["w"]
  pen = jax.lax.fori_loop(0, 3, lambda i, acc: acc + jnp.sum(w**2) / (i + 1), 0.0)
  v = jax.lax.fori_loop(0, 4, lambda i, v: (w.T @ (w @ v)) / jnp.linalg.norm(w.T @ (w @ v)), jnp.ones(w.shape[1]))
  return mse_loss(q, batch) + 0.01 * pen + 0.1 * jnp.linalg.norm(w @ v)


@pytest.mark.parametrize("loss", [rnn_loss, penalised_loss])
def test_loops_whose_carry_starts_as_a_constant(loss):
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)
  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    g = jax.jit(lambda q, b: jax.tree.map(lambda a: jax.reshard(a, P()), ja.grad(loss, axis_name="data")(q, b)))(
      jax.device_put(params, NamedSharding(mesh, P())), batch
    )
  chex.assert_trees_all_close(g, jax.grad(loss)(params, (x, y)), rtol=RTOL, atol=1e-15)


def test_per_row_keys_and_a_sharded_parameter_without_set_mesh():
  """Typed keys sharded with the rows are per-row data (not folded); a parameter sharded over the axis is
  gathered; no jax.set_mesh: value, per-row aux and gradient equal the plain step's."""
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (16, 2), jnp.float64), "b": jnp.zeros((2,), jnp.float64)}
  x = jax.random.normal(jax.random.PRNGKey(1), (32, 16), jnp.float64)
  y = jax.random.normal(jax.random.PRNGKey(2), (32, 2), jnp.float64)
  keys = jax.random.split(jax.random.key(3), 32)

  def loss(q, batch):
    x, y, k = batch
    out = (x * jax.vmap(lambda kk: jax.random.bernoulli(kk, 0.5, (16,)))(k)) @ q["w"] + q["b"]
    return jnp.mean((out - y) ** 2), jnp.sum((out - y) ** 2, -1)

  mesh = explicit_mesh()
  replicated = NamedSharding(mesh, P())
  p = {"w": jax.device_put(params["w"], NamedSharding(mesh, P("data"))), "b": jax.device_put(params["b"], replicated)}
  batch = jax.device_put((x, y, keys), NamedSharding(mesh, P("data")))
  (value, aux), g = jax.jit(
    lambda q, b: jax.tree.map(
      lambda a: jax.reshard(a, replicated) if _unreduced.axes_of(a) else a,
      ja.value_and_grad(loss, axis_name="data", has_aux=True)(q, b),
    )
  )(p, batch)
  (ref_value, ref_aux), ref = jax.value_and_grad(loss, has_aux=True)(params, (x, y, keys))
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  np.testing.assert_allclose(aux, ref_aux, rtol=RTOL)
  chex.assert_trees_all_close(g, ref, rtol=RTOL, atol=0)


@pytest.mark.parametrize(
  ("aux_reductions", "per_row", "traces"),
  [(None, False, 1), ({"out": "concat"}, True, 1), (None, True, 2)],
  ids=["no-rows-sized-aux", "named", "rows-sized-aux-default"],
)
def test_fun_is_traced_once_aux_included(aux_reductions, per_row, traces):
  """ja.grad reads aux's per-device shapes and runs fun from one trace: fun's Python runs once per jit trace. The
  one exception is the per-example default's look at a leaf as long as the rows (`_sums.per_row`): one more
  abstract trace at twice the rows, only for such a leaf with no reduction named."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)
  calls = []

  def loss(q, b):
    calls.append(1)
    out = jnp.sum(mlp_apply(q, b[0]), -1)
    return mse_loss(q, b), {"out": out if per_row else jnp.mean(out)}

  mesh = explicit_mesh()
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    jax.jit(ja.value_and_grad(loss, axis_name="data", has_aux=True, aux_reductions=aux_reductions)).lower(p, batch)
  assert len(calls) == traces


# --------------------------------------------------------------------------- issue 38: ja.grad's one trace


def _own_jit_grad(loss, params, x, y, mesh):
  """ja.grad's gradient, reduced by hand in the user's own jit, and plain jax.grad's in the same jit."""
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    got = jax.jit(lambda q, b: jax.reshard(ja.grad(loss, axis_name="data")(q, b), P()))(p, batch)
    want = jax.jit(jax.grad(loss))(p, batch)
  return jax.device_get(got), jax.device_get(want)


def _assert_loss(q, b):
  """On an Explicit mesh `with_sharding_constraint` asserts the type: the rows split over "data"."""
  h = jax.lax.with_sharding_constraint(jnp.tanh(b[0] @ q[0]["w"] + q[0]["b"]), P("data", None))
  return jnp.mean(jnp.sum((h @ q[1]["w"] + q[1]["b"] - b[1]) ** 2, -1))


def _while_loss(q, b):
  """A while_loop whose carry (from the batch) is resharded over "data" in its body."""
  body = lambda c: (c[0] + 1, jax.sharding.reshard(c[1] * 0.5 + 1.0, P("data", None)))
  x = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, b[0]))[1]
  return mse_loss(q, (x, b[1]))


@pytest.mark.parametrize("loss", [_assert_loss, _while_loss], ids=["assert", "while"])
def test_annotations_asserting_the_rows_layout_hold_as_in_plain_jit(loss):
  """Issue 38: ja.grad traced one device's rows typed unsharded, so an assert of their layout failed ("The
  array sharding: P(None, None) did not match ... P('data', None)") and a while_loop whose body reshards its
  carry over "data" changed the carry's type ("carry input and carry output must have equal types"). The rows
  are typed over the (size-1) axis now, as the user's own jit types them."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)
  got, want = _own_jit_grad(loss, params, x, y, explicit_mesh())
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=1e-14)


_TABLE = np.linspace(0.5, 1.5, 64).reshape(8, 8)


def test_a_loss_closing_over_a_replicated_array_runs_exact():
  """Issue 38: a table put replicated on the Explicit mesh, read from the enclosing scope: once "context mesh
  AbstractMesh('data': 1 ...) should match the aval mesh ('data': 8 ...)"."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)
  mesh = explicit_mesh()
  table = jax.device_put(jnp.asarray(_TABLE), NamedSharding(mesh, P()))

  def loss(q, b):
    h = jnp.tanh(b[0] @ q[0]["w"] + q[0]["b"]) @ table
    return jnp.mean(jnp.sum((h @ q[1]["w"] + q[1]["b"] - b[1]) ** 2, -1))

  got, want = _own_jit_grad(loss, params, x, y, mesh)
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=1e-14)


def _remat_dense_reshard():
  """A dense layer as a custom_vjp(optimize_remat=True), its primal and fwd resharding their output over "data"."""
  return remat_dense(lambda h: jax.sharding.reshard(h, P("data", None)))


def test_a_custom_vjp_with_optimize_remat_and_a_linear_solve_run_exact():
  """Issue 38: a custom_vjp(optimize_remat=True)'s primal, a thunk JAX traces inside the map (once "Closing over
  inputs to shard_map where the input is sharded on `Explicit` axes"), and jnp.linalg.solve, whose jaxprs sit
  in a NamedTuple parameter the localiser did not reach (once "context mesh ... should match the aval mesh")."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(3), 32)
  dense = _remat_dense_reshard()

  def loss(q, b):
    v = jnp.linalg.solve(jnp.eye(8) * 3.0 + q[0]["w"].T @ q[0]["w"], q[0]["b"])
    h = jnp.tanh(dense(b[0], q[0]["w"]) + v)
    return jnp.mean(jnp.sum((h @ q[1]["w"] + q[1]["b"] - b[1]) ** 2, -1))

  got, want = _own_jit_grad(loss, params, x, y, explicit_mesh())
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=1e-14)
