"""local_sgd, diloco, stale: against plain hand-written references, on 8 simulated devices."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_init, mse_loss, regression_data
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo

NDEV = 8


# --------------------------------------------------------------------------- helpers


def _setup(n=120):
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  x, y = regression_data(jax.random.PRNGKey(1), n)
  shards = (x.reshape(NDEV, n // NDEV, -1), y.reshape(NDEV, n // NDEV, -1))
  return params, (x, y), shards


def _rep(tree):
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (NDEV,) + jnp.shape(a)), tree)


def _pmap_step(tx):
  def step(params, state, batch):
    grads = jax.grad(mse_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.pmap(step, axis_name="d")


def _np(tree):
  return jax.tree.map(np.asarray, tree)


def _close(a, b, rtol=1e-12, atol=1e-13):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol), a, b)


_grad = jax.jit(jax.grad(mse_loss))


def _replica_grads(ps, shards):
  return [_np(_grad(p, (shards[0][i], shards[1][i]))) for i, p in enumerate(ps)]


def _mean(trees):
  return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


# --------------------------------------------------------------------------- local_sgd


@pytest.mark.parametrize("sync_every", [1, 3])
def test_local_sgd_equals_plain_parameter_averaging(sync_every):
  params, _, shards = _setup()
  inner = optax.adam(0.05)  # per-replica moments: they must stay local, never averaged
  tx = ja.local_sgd(inner, sync_every, axis_name="d")
  step = _pmap_step(tx)
  p, s = _rep(params), _rep(tx.init(params))

  # Reference: P independent optimizers, parameters replaced by their mean every H steps.
  inner_update = jax.jit(inner.update)
  ps = [_np(params)] * NDEV
  states = [inner.init(params)] * NDEV
  num_steps = 7
  for t in range(num_steps):
    p, s = step(p, s, shards)
    gs = _replica_grads(ps, shards)
    for i in range(NDEV):
      u, states[i] = inner_update(gs[i], states[i], ps[i])
      ps[i] = jax.tree.map(lambda a, b: a + np.asarray(b), ps[i], u)
    if (t + 1) % sync_every == 0:
      ps = [_mean(ps)] * NDEV
    for i in range(NDEV):
      _close(jax.tree.map(lambda a: a[i], p), ps[i])
  assert int(s.sync_count[0]) == num_steps // sync_every
  assert int(s.local_step[0]) == num_steps % sync_every


def test_local_sgd_all_reduces_only_on_sync_path():
  params, _, shards = _setup()
  hlo = {}
  for h in (1, 4):
    tx = ja.local_sgd(optax.adam(0.05), h, axis_name="d")
    hlo[h] = _pmap_step(tx).lower(_rep(params), _rep(tx.init(params)), shards).compile().as_text()
  # H = 1: the parameter all-reduce runs on every step, in straight-line code.
  assert _hlo.locate(hlo[1])["top"] >= 1
  # H = 4: none outside the sync branch of the conditional, so 3 steps in 4 send nothing.
  where = _hlo.locate(hlo[4])
  assert where["top"] == 0 and where["loop"] == 0 and where["branch"] >= 1, where


# --------------------------------------------------------------------------- diloco


def test_diloco_sync_every_1_is_synchronous_sgd():
  params, full, shards = _setup()
  lr = 0.1
  tx = ja.diloco(optax.sgd(lr), optax.sgd(1.0), 1, axis_name="d")
  step = _pmap_step(tx)
  p, s = _rep(params), _rep(tx.init(params))
  ref = _np(params)
  for _ in range(5):
    p, s = step(p, s, shards)
    g = _np(_grad(ref, full))  # equal shards: the mean of shard gradients is the full gradient
    ref = jax.tree.map(lambda a, b: a - lr * b, ref, g)
    for i in range(NDEV):
      _close(jax.tree.map(lambda a: a[i], p), ref)
  assert int(s.sync_count[0]) == 5


def test_diloco_outer_nesterov_matches_hand_written_loop():
  params, _, shards = _setup()
  lr, h, outer_lr, mu = 0.1, 3, 0.7, 0.9
  tx = ja.diloco(optax.sgd(lr), optax.sgd(outer_lr, momentum=mu, nesterov=True), h, axis_name="d")
  step = _pmap_step(tx)
  p, s = _rep(params), _rep(tx.init(params))

  # Algorithm 1 of Douillard et al., with Nesterov momentum written out.
  anchor = _np(params)
  momentum = jax.tree.map(np.zeros_like, anchor)
  ps = [anchor] * NDEV
  num_steps = 8  # two outer steps and two inner steps of a third window
  for t in range(num_steps):
    p, s = step(p, s, shards)
    gs = _replica_grads(ps, shards)
    ps = [jax.tree.map(lambda a, g: a - lr * g, ps[i], gs[i]) for i in range(NDEV)]
    if (t + 1) % h == 0:
      delta = _mean([jax.tree.map(lambda a, b: a - b, anchor, q) for q in ps])
      momentum = jax.tree.map(lambda m, d: mu * m + d, momentum, delta)
      anchor = jax.tree.map(lambda a, d, m: a - outer_lr * (d + mu * m), anchor, delta, momentum)
      ps = [anchor] * NDEV
    for i in range(NDEV):
      _close(jax.tree.map(lambda a: a[i], p), ps[i])
  _close(jax.tree.map(lambda a: a[0], s.anchor), anchor)
  assert int(s.sync_count[0]) == 2


def test_diloco_comm_dtype_reaches_the_wire_in_lowered_hlo():
  params, _, shards = _setup()
  tx = ja.diloco(optax.sgd(0.1), optax.sgd(0.7), 4, axis_name="d", comm_dtype=jnp.bfloat16)
  lowered = _pmap_step(tx).lower(_rep(params), _rep(tx.init(params)), shards)
  text = lowered.as_text(dialect="hlo")
  lines = [line for line in text.splitlines() if " all-reduce(" in line]
  assert lines and all("bf16[" in line and "f64[" not in line.split("all-reduce(")[0] for line in lines), lines
  assert _hlo.locate(lowered.compile().as_text())["top"] == 0


# --------------------------------------------------------------------------- stale


def _random_grads(params, n, seed=2):
  keys = jax.random.split(jax.random.PRNGKey(seed), n)
  return [
    jax.tree.map(lambda a, k=k: jax.random.normal(jax.random.fold_in(k, a.size), a.shape, a.dtype), params)
    for k in keys
  ]


def _run(tx, grads_seq, params):
  """All updates of `tx` over the sequence, one jitted scan."""
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *grads_seq)

  @jax.jit
  def go(stacked):
    def body(state, g):
      u, state = tx.update(g, state, params)
      return state, u

    return lax.scan(body, tx.init(params), stacked)

  state, updates = go(stacked)
  return state, [jax.tree.map(lambda u, t=t: np.asarray(u[t]), updates) for t in range(len(grads_seq))]


def test_stale_delay_0_is_inner():
  params, _, _ = _setup()
  grads = _random_grads(params, 6)
  _, got = _run(ja.stale(optax.adam(0.1), 0), grads, params)
  inner, state = optax.adam(0.1), optax.adam(0.1).init(params)
  for t, g in enumerate(grads):
    u, state = inner.update(g, state, params)
    _close(got[t], u)


def test_stale_applies_the_gradient_of_d_steps_before():
  params, _, _ = _setup()
  d, n = 3, 10
  grads = _random_grads(params, n)
  state, got = _run(ja.stale(optax.sgd(1.0), d), grads, params)
  queue = collections.deque()
  for t, g in enumerate(grads):
    queue.append(g)
    if t < d:
      expected = jax.tree.map(np.zeros_like, g)
    else:
      expected = jax.tree.map(lambda x: -np.asarray(x), queue.popleft())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got[t], expected)
  assert int(state.filled) == d


def test_stale_leaves_inner_untouched_while_filling_and_scales_lr():
  params, _, _ = _setup()
  d, n = 4, 9
  grads = _random_grads(params, n)
  state, got = _run(ja.stale(optax.adam(0.1), d, staleness_lr_scale=True), grads, params)
  for t in range(d):
    assert all(not np.any(leaf) for leaf in jax.tree.leaves(got[t]))
  # Adam fed g_0, g_1, ... from step d on; its count is the number of applied updates.
  inner = optax.adam(0.1)
  ref_state = inner.init(params)
  for t in range(d, n):
    u, ref_state = inner.update(grads[t - d], ref_state, params)
    _close(got[t], jax.tree.map(lambda x: np.asarray(x) / d, u))
  assert int(state.inner_state[0].count) == n - d


def test_stale_inside_make_train_step_is_delayed_full_batch_sgd():
  params, full, _ = _setup()
  mesh = ja.data_mesh("data")
  tx = ja.stale(optax.sgd(0.1), 2)
  step = ja.make_train_step(mse_loss, tx, mesh=mesh, donate=False)
  p, s, batch = ja.replicate(params, mesh), ja.replicate(tx.init(params), mesh), ja.shard_batch(full, mesh)
  ref, history = _np(params), []
  for t in range(6):
    p, s, _ = step(p, s, batch)
    history.append(_np(_grad(ref, full)))  # taken on the parameters of step t, applied at t + 2
    if t >= 2:
      ref = jax.tree.map(lambda a, g: a - 0.1 * g, ref, history[t - 2])
    _close(p, ref)


# --------------------------------------------------------------------------- convergence on 8 devices


def _shard_map_trainer(tx, params, shards):
  """Per-replica params and state stacked on a leading axis sharded over "data"."""
  mesh = Mesh(np.array(jax.devices()[:NDEV]), ("data",))
  squeeze = lambda t: jax.tree.map(lambda a: a[0], t)
  unsqueeze = lambda t: jax.tree.map(lambda a: a[None], t)

  def body(params, state, batch):
    params, state, batch = squeeze(params), squeeze(state), squeeze(batch)
    grads = jax.grad(mse_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return unsqueeze(optax.apply_updates(params, updates)), unsqueeze(state)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  return step, _rep(params), _rep(tx.init(params))


@pytest.mark.parametrize("name", ["local_sgd", "diloco", "stale"])
def test_converges_on_8_devices_under_shard_map(name):
  params, full, shards = _setup()
  tx = {
    "local_sgd": ja.local_sgd(optax.sgd(0.1), 4, axis_name="data"),
    "diloco": ja.diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True), 4, axis_name="data"),
    "stale": optax.chain(ja.pmean("data"), ja.stale(optax.sgd(0.1), 2)),
  }[name]
  step, p, s = _shard_map_trainer(tx, params, shards)
  start = float(mse_loss(params, full))
  for _ in range(40):  # a multiple of sync_every: replicas agree at the end
    p, s = step(p, s, shards)
  leaves = jax.tree.leaves(p)
  for leaf in leaves:
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), rtol=1e-12, atol=1e-14)
  end = float(mse_loss(jax.tree.map(lambda a: a[0], p), full))
  print(f"{name}: loss {start:.4f} -> {end:.4f}")
  assert end < 0.3 * start, (start, end)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
  "make",
  [
    lambda k: ja.local_sgd(optax.sgd(0.1), k, axis_name="d"),
    lambda k: ja.diloco(optax.sgd(0.1), optax.sgd(0.7), k, axis_name="d"),
  ],
)
def test_bad_sync_every(make):
  for bad in (0, -2):
    with pytest.raises(ValueError, match=f"sync_every={bad}"):
      make(bad)
  for bad in (1.5, True, "2", None):
    with pytest.raises(TypeError, match="sync_every="):
      make(bad)


def test_bad_delay_and_options():
  with pytest.raises(ValueError, match="delay=-1"):
    ja.stale(optax.sgd(0.1), -1)
  for bad in (1.0, True, None):
    with pytest.raises(TypeError, match="delay="):
      ja.stale(optax.sgd(0.1), bad)
  with pytest.raises(TypeError, match="staleness_lr_scale="):
    ja.stale(optax.sgd(0.1), 2, staleness_lr_scale=1)
  assert ja.stale(optax.sgd(0.1), np.int64(2)).init({"w": jnp.ones(3)}).buffer["w"].shape == (2, 3)
  with pytest.raises(ValueError, match="comm_dtype="):
    ja.diloco(optax.sgd(0.1), optax.sgd(0.7), 2, axis_name="d", comm_dtype=jnp.int32)
  params, _, _ = _setup()
  tx = ja.stale(optax.sgd(0.1), 2)
  with pytest.raises(ValueError, match="grads does not match"):
    tx.update(params[:1], tx.init(params))


@pytest.mark.parametrize(
  "factory",
  [
    lambda **kw: ja.local_sgd(optax.sgd(0.1), 2, **kw),
    lambda **kw: ja.diloco(optax.sgd(0.1), optax.sgd(0.7), 2, **kw),
  ],
)
def test_missing_or_unbound_axis_name_and_missing_params(factory):
  with pytest.raises(TypeError, match="axis_name"):
    factory()
  with pytest.raises(TypeError, match="axis_name=None"):
    factory(axis_name=None)
  params, _, shards = _setup()
  tx = factory(axis_name="nope")
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(ValueError, match="axis_name='nope' is not bound"):
    tx.update(grads, tx.init(params), params)
  with pytest.raises(ValueError, match="axis_name='nope' is not bound"):
    _pmap_step(tx).lower(_rep(params), _rep(tx.init(params)), shards)
  with pytest.raises(ValueError, match="needs them"):
    tx.update(grads, tx.init(params), None)


def test_gradients_already_summed_by_shard_map_autodiff_raise():
  params, _, shards = _setup()
  tx = ja.local_sgd(optax.sgd(0.1), 2, axis_name="data")
  mesh = Mesh(np.array(jax.devices()[:NDEV]), ("data",))

  def body(params, state, batch):  # params replicated (P()): autodiff psums the gradient
    grads = jax.grad(mse_loss)(params, jax.tree.map(lambda a: a[0], batch))
    return tx.update(grads, state, params)[0]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()))
  with pytest.raises(ValueError, match="pcast"):
    f.lower(params, tx.init(params), shards)


@pytest.mark.parametrize(
  "make",
  [
    lambda inner: ja.local_sgd(inner, 2, axis_name="d"),
    lambda inner: ja.diloco(inner, optax.sgd(0.7), 2, axis_name="d"),
    lambda inner: ja.diloco(optax.sgd(0.1), inner, 2, axis_name="d"),
    lambda inner: ja.stale(inner, 2),
  ],
)
def test_an_optimizer_factory_or_none_is_refused_at_construction(make):
  with pytest.raises(TypeError, match=r"(inner|outer)=optax.adam .*call it: (inner|outer)=optax.adam\(1e-3\)"):
    make(optax.adam)
  with pytest.raises(TypeError, match="(inner|outer)=None"):
    make(None)


def test_stale_takes_python_scalar_leaves():
  """Issue 11 item 13: optax accepts {"w": 1.0}; so does stale, with the d-step delay."""
  tx = ja.stale(optax.sgd(1.0), 2)
  state = tx.init({"w": 1.0})
  got = []
  for g in (0.5, 1.5, 2.5, 3.5):
    updates, state = tx.update({"w": g}, state, {"w": 1.0})
    got.append(float(updates["w"]))
  assert got == [0.0, 0.0, -0.5, -1.5]


@pytest.mark.parametrize(
  "make",
  [
    lambda axis: ja.local_sgd(optax.sgd(0.1), 2, axis_name=axis),
    lambda axis: ja.diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9), 2, axis_name=axis),
  ],
)
def test_model_sharded_parameters_under_explicit_mesh_axes(make):
  """Zeros carry their leaf's sharding, so the cond's branches agree under Explicit mesh axes.

  A 4 x 2 mesh of Explicit axes: replicas over `x` (shard_map), each replica's parameters
  sharded over `m` (the auto axis inside). The result equals the same program under pmap.
  """
  replicas = 4
  mesh = jax.make_mesh((replicas, 2), ("x", "m"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  params = {"w": jnp.linspace(-1, 1, 3 * 8).reshape(3, 8), "b": jnp.full((8,), 0.1)}
  x, y = regression_data(jax.random.PRNGKey(1), 48, d_out=8)
  shards = (x.reshape(replicas, 12, 3), y.reshape(replicas, 12, 8))
  loss = lambda p, b: jnp.mean(jnp.sum((jnp.tanh(b[0] @ p["w"] + p["b"]) - b[1]) ** 2, -1))
  stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (replicas,) + jnp.shape(a)), t)

  def step_for(tx):
    def step(params, state, batch):
      updates, state = tx.update(jax.grad(loss)(params, batch), state, params)
      return optax.apply_updates(params, updates), state

    return step

  tx = make("x")
  squeeze = lambda t: jax.tree.map(lambda a: a[0], t)
  body = lambda p, s, b: jax.tree.map(lambda a: a[None], step_for(tx)(squeeze(p), squeeze(s), squeeze(b)))
  sm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), axis_names={"x"}))
  spec = lambda a: P("x", *[None] * (a.ndim - 2), "m") if a.ndim >= 2 and a.shape[-1] == 8 else P("x")
  put = lambda t: jax.tree.map(lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec(a))), t)
  p_sm, s_sm = put(stack(params)), put(jax.vmap(tx.init)(stack(params)))
  with jax.set_mesh(mesh):
    for _ in range(3):
      p_sm, s_sm = sm(p_sm, s_sm, jax.device_put(shards, jax.sharding.NamedSharding(mesh, P("x"))))
  assert p_sm["b"].sharding.spec == P("x", "m")
  pm = jax.pmap(step_for(make("d")), axis_name="d", devices=jax.devices()[:replicas])
  p_pm, s_pm = stack(params), jax.vmap(make("d").init)(stack(params))
  for _ in range(3):
    p_pm, s_pm = pm(p_pm, s_pm, shards)
  _close(p_sm, p_pm)


@pytest.mark.parametrize("delay", [0, 2])
def test_stale_checks_the_grads_tree_against_its_state_whatever_the_delay(delay):
  """Issue 22: delay=0 took any grads tree (inner's update then failed, or silently broadcast)."""
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  tx = ja.stale(optax.sgd(0.1), delay)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"grads does not match the buffered gradients.*lacks the leaves \['b'\]"):
    tx.update({"w": jnp.ones((3, 2))}, state, params)
  with pytest.raises(
    ValueError, match=r"grads does not match the buffered gradients.* at \['w'\]: shape \(2,\) != \(3, 2\)"
  ):
    tx.update({"w": jnp.ones(2), "b": jnp.zeros(2)}, state, params)
  with pytest.raises(TypeError, match=r"state must be a StaleState.*got tuple"):
    tx.update(params, optax.sgd(0.1).init(params), params)
  updates, _ = tx.update(params, state, params)  # the matching tree still works
  assert jax.tree.structure(updates) == jax.tree.structure(params)
