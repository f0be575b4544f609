"""The one train step: every option under every strategy, against a plainly written per-microbatch reference.

Each cell of the matrix (option x strategy) builds a step with that option
and compares one update, float64, with a reference written with jax and optax
alone: the microbatches the engine sees (device p's microbatch i holds rows
p B/P + i + K j), their gradients taken one by one, weighted, averaged, and
adam applied once. A cell is either exact (<= 1e-12) or refused for a stated
reason.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_init, regression_data, smoke
from jax.sharding import AxisType

import jaxaccum as ja

RTOL = 1e-12
K = 2
ROWS = 32  # 8 devices x K=2 microbatches x 2 rows
SIZES = (3, 8, 2)  # (3, 8) and (8, 2) and (8,) shard over 8 devices; the (2,) bias stays replicated
STRATEGIES = ("none", "ddp", "zero1", "fsdp", "fsdp_once", "hsdp")
OPTIONS = ("weights", "aux", "state", "grad_norms", "noise_scale", "skip_empty", "key", "comm_dtype")
# A cell that means nothing is refused; the reason is part of the contract.
REFUSED = {("comm_dtype", "none"): "needs a mesh"}


def masked_loss(params, batch, key=None):
  """Masked mean squared error over the microbatch's real rows (0/0 on an all-padding microbatch)."""
  err = jnp.sum((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
  loss = jnp.sum(batch["mask"] * err) / jnp.sum(batch["mask"])
  if key is not None:  # randomness that reaches the gradient
    loss = loss + 0.1 * jax.random.uniform(key) * jnp.sum(params[0]["b"])
  return loss


def aux_loss(params, batch):
  pred = mlp_apply(params, batch["x"])
  err = jnp.sum((pred - batch["y"]) ** 2, axis=-1)
  aux = {"pred": pred, "n": jnp.sum(err > 0.5), "m": jnp.mean(batch["x"]), "first": batch["x"][0, 0]}
  return masked_loss(params, batch), aux


def state_loss(params, state, batch):
  new = {"mean_x": jnp.mean(batch["x"], axis=0), "calls": state["calls"] + 1}
  return masked_loss(params, batch), new


AUX_RED = {"pred": "concat", "n": "sum", "m": "mean", "first": "last"}


def setup(option, strategy):
  """(step kwargs, mesh, data axis, batch, state or None, key or None)."""
  x, y = regression_data(jax.random.PRNGKey(1), ROWS)
  mask = np.ones(ROWS)
  if option in ("weights", "skip_empty"):
    mask[[0, 5, 6, 11, 30]] = 0.0  # unequal microbatch weights
  if option == "skip_empty":
    mask[[r for r in range(ROWS) if r % K == 1 and r < ROWS // 8]] = 0.0  # device 0's microbatch 1: all padding
  batch = {"x": x, "y": y, "mask": jnp.asarray(mask)}
  kwargs = dict(num_microbatches=K, donate=False)
  if strategy != "none":
    kwargs["strategy"] = "fsdp" if strategy == "fsdp_once" else strategy
    if strategy == "fsdp_once":
      kwargs["fsdp_gather"] = "once"
  if option in ("weights", "skip_empty"):
    kwargs["weight_fn"] = lambda b: jnp.sum(b["mask"])
  kwargs.update(
    {
      "aux": dict(has_aux=True, aux_reductions=AUX_RED),
      "state": dict(has_state=True, state_reductions={"mean_x": "mean", "calls": "last"}),
      "grad_norms": dict(grad_norms=True),
      "noise_scale": dict(noise_scale=True),
      "skip_empty": dict(skip_empty=True),
      "comm_dtype": dict(comm_dtype=jnp.float32),
    }.get(option, {})
  )
  mesh, axis = None, "data"
  if strategy == "hsdp":
    mesh, axis = jax.make_mesh((2, 4), ("rep", "shard"), axis_types=(AxisType.Auto,) * 2), ("rep", "shard")
  elif strategy != "none":
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  state = {"mean_x": jnp.zeros(3), "calls": jnp.zeros((), jnp.int32)} if option == "state" else None
  key = jax.random.PRNGKey(7) if option == "key" else None
  return kwargs, mesh, axis, batch, state, key


def microbatches(batch, devices):
  """(device, i, rows) in the engine's order: device p's block of rows, microbatch i = rows i, i + K, ..."""
  per = ROWS // devices
  return [(p, i, np.arange(p * per + i, (p + 1) * per, K)) for p in range(devices) for i in range(K)]


def reference(option, params, batch, state, key, devices):
  """One update and its metrics, written plainly: a loop over microbatches, weights, adam."""
  opt = optax.adam(1e-2)
  take = lambda rows: jax.tree.map(lambda v: v[rows], batch)
  mbs = microbatches(batch, devices)
  ws, grads, losses, norms, extra = [], [], [], [], []
  for p, i, rows in mbs:
    mb = take(rows)
    w = float(jnp.sum(mb["mask"])) if option in ("weights", "skip_empty") else 1.0
    ws.append(w)
    if w == 0:
      grads.append(None), losses.append(0.0), norms.append(0.0), extra.append(None)
      continue
    if option == "key":
      k = jax.random.fold_in(jax.random.fold_in(key, p), i)
      loss, g = jax.value_and_grad(masked_loss)(params, mb, k)
    else:
      loss, g = jax.value_and_grad(masked_loss)(params, mb)
    grads.append(g), losses.append(loss), norms.append(float(optax.tree.norm(g)))
    extra.append(
      aux_loss(params, mb)[1] if option == "aux" else state_loss(params, state, mb)[1] if option == "state" else None
    )
  total = sum(ws)
  real = [j for j, w in enumerate(ws) if w > 0]
  mean = jax.tree.map(
    lambda *gs: sum(ws[j] * g for j, g in zip(real, gs, strict=True)) / total, *[grads[j] for j in real]
  )
  updates, _ = opt.update(mean, opt.init(params), params)
  out = {"params": optax.apply_updates(params, updates), "loss": sum(ws[j] * losses[j] for j in real) / total}
  if option == "aux":
    pred = np.zeros((ROWS, 2))
    for (_, _, rows), e in zip(mbs, extra, strict=True):
      pred[rows] = e["pred"]
    out["aux"] = {
      "pred": pred,
      "n": sum(int(extra[j]["n"]) for j in real),
      "m": sum(ws[j] * extra[j]["m"] for j in real) / total,
      "first": extra[real[-1]]["first"],
    }
  if option == "state":
    out["state"] = {"mean_x": sum(ws[j] * extra[j]["mean_x"] for j in real) / total, "calls": 1}
  if option == "grad_norms":
    out["grad_norms"] = np.asarray(norms)
  if option == "noise_scale":  # McCandlish et al. (2018), unbiased for unequal sizes (b_i = w_i)
    s1 = sum(ws[j] * float(optax.tree.norm(grads[j])) ** 2 for j in real) / total
    s2 = float(optax.tree.norm(mean)) ** 2
    n = len(real)
    trace = (s1 - s2) * total / (n - 1)
    out["noise_scale"] = (s2 - trace / total, trace)
  return out


@pytest.mark.parametrize("strategy", smoke(STRATEGIES, {"none", "ddp", "fsdp"}))
@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_under_every_strategy(option, strategy):
  kwargs, mesh, axis, batch, state, key = setup(option, strategy)
  loss = {"aux": aux_loss, "state": state_loss}.get(option, masked_loss)
  opt = optax.adam(1e-2)
  if (option, strategy) in REFUSED:
    with pytest.raises(ValueError, match=REFUSED[option, strategy]):
      ja.make_train_step(loss, opt, mesh=mesh, data_axis=axis, **kwargs)
    return
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  step = ja.make_train_step(loss, opt, mesh=mesh, data_axis=axis, **kwargs)
  devices = 1
  if mesh is None:
    p, s, b = params, opt.init(params), batch
  else:
    devices = 8
    p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
    b = ja.shard_batch(batch, mesh, axis)
  args = (p, state, s, b) if state is not None else (p, s, b)
  out = step(*args) if key is None else step(*args, key)
  new_p, metrics = out[0], out[-1]
  want = reference(option, params, batch, state, key, devices)
  tol = dict(rtol=1e-5, atol=1e-7) if option == "comm_dtype" else dict(rtol=RTOL, atol=1e-15)
  assert bool(metrics["applied"])
  chex.assert_trees_all_close(jax.device_get(new_p), want["params"], **tol)
  np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=RTOL)
  if option == "aux":
    got = jax.device_get(metrics["aux"])
    assert jnp.issubdtype(got["n"].dtype, jnp.integer) and int(got["n"]) == want["aux"]["n"]
    chex.assert_trees_all_close(
      {n: got[n] for n in ("pred", "m", "first")},
      {n: want["aux"][n] for n in ("pred", "m", "first")},
      rtol=RTOL,
      atol=1e-15,
    )
  if option == "state":
    new_state = jax.device_get(out[1])
    np.testing.assert_allclose(new_state["mean_x"], want["state"]["mean_x"], rtol=RTOL)
    assert new_state["calls"].dtype == jnp.int32 and int(new_state["calls"]) == 1
  if option == "grad_norms":
    np.testing.assert_allclose(metrics["grad_norms"], want["grad_norms"], rtol=RTOL)
  if option == "noise_scale":
    ns = metrics["noise_scale"]
    np.testing.assert_allclose((ns.grad_sq, ns.trace_cov), want["noise_scale"], rtol=1e-10)


# --------------------------------------------------------------------------- layouts, dtypes and errors (issue 18)


def _names(spec) -> set:
  return {n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))}


def _mesh(kind, shape=(8,), names=("data",)):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("strategy", smoke(["ddp", "zero1", "fsdp", "hsdp"], {"ddp", "fsdp"}))
def test_model_sharding_kept_by_every_strategy(strategy, kind):
  """A tensor-parallel leaf placed P(None, "model") comes back with it (and stays exact), Auto and Explicit."""
  if strategy == "hsdp":
    mesh, axis = _mesh(kind, (2, 2, 2), ("rep", "shard", "model")), ("rep", "shard")
  else:
    mesh, axis = _mesh(kind, (4, 2), ("data", "model")), "data"
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  placed = [dict(layer) for layer in params]
  placed[0]["w"] = jax.device_put(params[0]["w"], jax.sharding.NamedSharding(mesh, jax.P(None, "model")))
  opt = optax.adam(1e-2)
  p, s = ja.shard_train_state(placed, opt, mesh, strategy=strategy, data_axis=axis)
  _, _, _, batch, _, _ = setup("weights", "none")
  step = ja.make_train_step(masked_loss, opt, num_microbatches=K, mesh=mesh, data_axis=axis, strategy=strategy)
  new_p, new_s, _ = step(p, s, ja.shard_batch(batch, mesh, axis))
  assert "model" in _names(new_p[0]["w"].sharding.spec)
  assert "model" in _names(new_s[0].mu[0]["w"].sharding.spec)
  want = reference("plain", params, batch, None, None, 4)  # 4 devices over the data axes
  chex.assert_trees_all_close(jax.device_get(new_p), want["params"], rtol=RTOL, atol=1e-15)


def _split_loss(tp):
  """Embedding, a scanned stack of norm scales, a norm scale, two kernels over `tp`: activations split over `tp` on
  their features, so the replicated leaves' gradients come out split there (as a Flax model's on a model axis)."""

  def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

  def loss(params, batch):
    x = params["embed"][batch["tokens"]]
    if not jax.sharding.get_abstract_mesh().empty:  # the reference runs on one device
      x = jax.lax.with_sharding_constraint(x, jax.P(None, None, tp))
    x, _ = jax.lax.scan(lambda x, s: (rms(x) * s + x, None), x, params["scales"])
    h = jnp.tanh((rms(x) * params["norm"]) @ params["w"])
    logits = h @ params["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return loss


@pytest.mark.parametrize(
  "strategy, shape, names",
  smoke(
    [
      ("fsdp", (4, 2), ("data", "model")),
      ("fsdp", (2, 2, 2), ("data", "a", "b")),
      ("hsdp", (2, 2, 2), ("rep", "shard", "model")),
    ],
    {("fsdp", (4, 2), ("data", "model"))},
  ),
)
def test_leaves_the_model_axis_leaves_whole_reduce_scatter_split_over_it(strategy, shape, names):
  """fsdp per microbatch on an Auto mesh with free axes: the leaves they leave whole (an embedding, norm scales,
  stacked and scanned ones) are reduce-scattered split over them and put back once per step, exactly.

  Split on another dimension than the data one (the embedding) and on the data one itself (the norm scales:
  the pieces come back in block order through one collective-permute); one free axis and two.
  """
  data = names[:2] if strategy == "hsdp" else names[0]
  tp = tuple(n for n in names if n not in (data if isinstance(data, tuple) else (data,)))
  tp = tp[0] if len(tp) == 1 else tp
  mesh = _mesh(AxisType.Auto, shape, names)
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {
    "embed": jax.random.normal(ks[0], (32, 16)),
    "scales": 1 + 0.1 * jax.random.normal(ks[1], (2, 16)),
    "norm": 1 + 0.1 * jax.random.normal(ks[2], (16,)),
    "w": 0.3 * jax.random.normal(ks[3], (16, 16)),
    "out": 0.3 * jax.random.normal(ks[4], (16, 32)),
  }
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 32, (16, 5))
  batch = {"tokens": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
  loss_fn = _split_loss(tp)
  opt = optax.sgd(0.5)  # linear in the gradient: a block out of order shows
  with jax.set_mesh(mesh):
    placed = dict(params)
    placed["w"] = jax.device_put(params["w"], jax.sharding.NamedSharding(mesh, jax.P(None, tp)))
    placed["out"] = jax.device_put(params["out"], jax.sharding.NamedSharding(mesh, jax.P(tp, None)))
    p, s = ja.shard_train_state(placed, opt, mesh, strategy=strategy, data_axis=data)
    step = ja.make_train_step(loss_fn, opt, num_microbatches=2, mesh=mesh, data_axis=data, strategy=strategy)
    new_p, _, metrics = step(p, s, ja.shard_batch(batch, mesh, data))
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # equal microbatches: the mean of means
  want = optax.apply_updates(params, opt.update(grads, opt.init(params), params)[0])
  chex.assert_trees_all_close(jax.device_get(new_p), want, rtol=RTOL, atol=1e-14)
  np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=RTOL)
  for name in ("embed", "scales", "norm"):  # back in the plan's layout: replicated over the free axes
    assert not _names(new_p[name].sharding.spec) & set(tp if isinstance(tp, tuple) else (tp,)), name


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_layouts_kept_inside_an_outer_jit_and_a_replicated_state_is_placed(strategy):
  """Called inside the user's jax.jit (no concrete shardings), the state comes back sharded; P() in, sharded out."""
  mesh = _mesh(AxisType.Auto)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  opt = optax.adam(1e-2)
  p, s = ja.shard_train_state(params, opt, mesh, strategy=strategy)
  _, _, _, batch, _, _ = setup("weights", "none")
  step = ja.make_train_step(masked_loss, opt, num_microbatches=K, mesh=mesh, strategy=strategy, donate=False)
  b = ja.shard_batch(batch, mesh)
  outer = jax.jit(lambda p, s, b: step(p, s, b))
  new_p, new_s, _ = outer(p, s, b)
  assert new_s[0].mu[0]["w"].sharding.spec == s[0].mu[0]["w"].sharding.spec != jax.P()
  chex.assert_trees_all_close(
    jax.device_get(new_p), reference("plain", params, batch, None, None, 8)["params"], rtol=RTOL
  )
  if strategy == "zero1":  # a replicated optimizer state (placed by hand) comes back in zero1's layout
    _, s2, _ = step(p, ja.replicate(opt.init(params), mesh), b)
    assert s2[0].mu[0]["w"].sharding.spec == s[0].mu[0]["w"].sharding.spec


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "hsdp"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_a_state_given_replicated_is_updated_and_returned_in_the_strategys_layout(strategy, axis_type):
  """A replicated optimizer state (a checkpoint restored with P()) given to any strategy, on either mesh kind.

  On an Explicit mesh a layout is part of the type: the state must be resharded before the update's
  conditional, or the branch keeping it and the branch updating it differ in type (fsdp, hsdp: TypeError).
  """
  hsdp = strategy == "hsdp"
  mesh = jax.make_mesh(
    (2, 4) if hsdp else (8,), ("replica", "data") if hsdp else ("data",), axis_types=(axis_type,) * (2 if hsdp else 1)
  )
  data = ("replica", "data") if hsdp else "data"
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  opt = optax.adam(1e-2)
  p, s = ja.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=data)
  _, _, _, batch, _, _ = setup("weights", "none")
  step = ja.make_train_step(
    masked_loss, opt, num_microbatches=K, mesh=mesh, data_axis=data, strategy=strategy, donate=False
  )
  with jax.set_mesh(mesh):
    new_p, new_s, _ = step(p, ja.replicate(opt.init(params), mesh), ja.shard_batch(batch, mesh, data))
  chex.assert_trees_all_close(
    jax.device_get(new_p), reference("plain", params, batch, None, None, 8)["params"], rtol=RTOL
  )
  got, want = new_s[0].mu[0]["w"], s[0].mu[0]["w"]
  assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)


@pytest.mark.parametrize("opt_name", ["adam", "muon"])
def test_ddp_on_a_data_only_auto_mesh_leaves_the_update_unconstrained_and_keeps_the_layout(opt_name):
  """ddp on an Auto mesh of data axes only: every input of the update is replicated, so its outputs are left to the
  partitioner, which has nothing sharded to propagate into them (a sharding constraint per output leaf, three
  per leaf with adam, cost compile time: #39). They come back replicated, as given, under an elementwise
  optimizer and under one that multiplies matrices (muon), the next call takes them without a retrace, and the
  update is the plain one's."""
  mesh = _mesh(AxisType.Auto)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  opt = optax.adam(1e-2) if opt_name == "adam" else optax.contrib.muon(1e-2)
  p, s = ja.shard_train_state(params, opt, mesh, strategy="ddp")
  _, _, _, batch, _, _ = setup("weights", "none")
  b = ja.shard_batch(batch, mesh)
  step = ja.make_train_step(masked_loss, opt, num_microbatches=K, mesh=mesh, strategy="ddp", donate=False)
  constraints = step.lower(p, s, b).as_text().count("sharding_constraint")
  assert constraints <= len(jax.tree.leaves(b)), constraints  # the batch's placement only (before: 3 per leaf more)
  new_p, new_s, metrics = step(p, s, b)
  assert bool(metrics["applied"])
  for got, given in zip(jax.tree.leaves((new_p, new_s)), jax.tree.leaves((p, s)), strict=True):
    assert got.sharding.is_fully_replicated and got.sharding.is_equivalent_to(given.sharding, got.ndim), got.sharding
  step(new_p, new_s, b)
  assert step._cache_size() == 1
  # The plain update on the mean of the microbatches' gradients (no weight_fn: each counts the same).
  grads = [jax.grad(masked_loss)(params, jax.tree.map(lambda v, r=r: v[r], batch)) for *_, r in microbatches(batch, 8)]
  mean = jax.tree.map(lambda *gs: sum(gs) / len(gs), *grads)
  updates, _ = opt.update(mean, opt.init(params), params)
  chex.assert_trees_all_close(jax.device_get(new_p), optax.apply_updates(params, updates), rtol=RTOL)


def test_without_a_weight_fn_the_loop_adds_no_select_per_gradient_leaf():
  """Without a weight_fn every share is the constant 1/W, never 0: the loop scales each gradient leaf by it with
  no weight-0 select (one compare, select and broadcast per leaf for JAX to trace and lower and for XLA to
  partition before folding them away: compile time of deep listed models, #39). The lowered step of a deeper
  model has no more selects than a shallow one's; with a weight_fn the select is still there, per leaf."""
  mesh = _mesh(AxisType.Auto)
  opt = optax.adam(1e-2)
  _, _, _, batch, _, _ = setup("weights", "none")
  b = ja.shard_batch(batch, mesh)

  def selects(depth, weight_fn=None):
    params = mlp_init(jax.random.PRNGKey(0), (3,) + (8,) * depth + (2,))
    p, s = ja.shard_train_state(params, opt, mesh, strategy="ddp")
    step = ja.make_train_step(
      masked_loss, opt, num_microbatches=K, mesh=mesh, strategy="ddp", donate=False, weight_fn=weight_fn
    )
    return step.lower(p, s, b).as_text().count("stablehlo.select")

  assert selects(8) == selects(1), (selects(8), selects(1))
  weighted = lambda mb: jnp.sum(mb["mask"])
  assert selects(8, weighted) - selects(1, weighted) >= 2 * 7, "the weighted path's select per leaf is gone too?"


def test_ddp_given_a_state_in_another_layout_returns_everything_in_its_own():
  """A state laid out otherwise (zero1's, split over "data": a checkpoint of another strategy) given to ddp on a
  data-only Auto mesh: the update's outputs are laid out as ddp's (replicated), not left to the partitioner,
  which would spread the state's layout into the parameters (the next call would refuse them)."""
  mesh = _mesh(AxisType.Auto)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  opt = optax.adam(1e-2)
  p, _ = ja.shard_train_state(params, opt, mesh, strategy="ddp")
  _, s = ja.shard_train_state(params, opt, mesh, strategy="zero1")
  assert not s[0].mu[0]["w"].sharding.is_fully_replicated
  _, _, _, batch, _, _ = setup("weights", "none")
  b = ja.shard_batch(batch, mesh)
  step = ja.make_train_step(masked_loss, opt, num_microbatches=K, mesh=mesh, strategy="ddp", donate=False)
  new_p, new_s, _ = step(p, s, b)
  for got in jax.tree.leaves((new_p, new_s)):
    assert got.sharding.is_fully_replicated, got.sharding
  step(new_p, new_s, b)  # taken as ddp's own layout
  chex.assert_trees_all_close(
    jax.device_get(new_p), reference("plain", params, batch, None, None, 8)["params"], rtol=RTOL
  )


@pytest.mark.parametrize("strategy", ["none", "ddp", "zero1", "fsdp"])
def test_bf16_params_keep_bf16_state_and_compile_once(strategy):
  mesh = None if strategy == "none" else _mesh(AxisType.Auto)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), mlp_init(jax.random.PRNGKey(0), SIZES))
  opt = optax.adam(1e-2, mu_dtype=jnp.bfloat16)
  _, _, _, batch, _, _ = setup("weights", "none")
  batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), batch)
  kw = {} if mesh is None else {"mesh": mesh, "strategy": strategy}
  step = ja.make_train_step(masked_loss, opt, num_microbatches=K, **kw)
  if mesh is None:
    p, s, b = params, opt.init(params), batch
  else:
    p, s = ja.shard_train_state(params, opt, mesh, strategy=strategy)
    b = ja.shard_batch(batch, mesh)
  dtypes = jax.tree.map(lambda x: x.dtype, s)
  for _ in range(2):
    p, s, metrics = step(p, s, b)
  assert bool(metrics["applied"])
  assert jax.tree.map(lambda x: x.dtype, s) == dtypes and s[0].mu[0]["w"].dtype == jnp.bfloat16
  assert p[0]["w"].dtype == jnp.bfloat16
  assert step._cache_size() == 1  # no retrace on the second call


@pytest.mark.parametrize("strategy", ["none", "ddp", "zero1", "fsdp_once", "hsdp"])
def test_the_same_errors_under_every_strategy(strategy):
  kwargs, mesh, axis, batch, _, _ = setup("weights", strategy)
  opt = optax.adam(1e-2)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  if mesh is None:
    p, s, place = params, opt.init(params), lambda b: b
  else:
    p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
    place = lambda b: ja.shard_batch(b, mesh, axis)
  step = lambda loss, **kw: ja.make_train_step(loss, opt, mesh=mesh, data_axis=axis, **{**kwargs, **kw})
  ragged = dict(batch, mask=jnp.ones(ROWS * 2))
  with pytest.raises(ValueError, match=rf"batch\['mask'\] has {2 * ROWS} rows, batch\['x'\] has {ROWS} rows"):
    step(masked_loss)(p, s, ragged)
  with pytest.raises(TypeError, match=r"loss_fn must take the batch as its second argument"):
    step(lambda params: masked_loss(params, batch))
  with pytest.raises(ValueError, match=r"empty.*0 rows"):
    step(masked_loss)(p, s, jax.tree.map(lambda x: x[:0], batch))
  with pytest.raises(TypeError, match=r"comm_dtype='bogus' is not a dtype"):
    step(masked_loss, comm_dtype="bogus")
  with pytest.raises(TypeError, match=r"has_aux=True"):
    step(lambda p, b: (masked_loss(p, b), 1.0))(p, s, place(batch))
  with pytest.raises(TypeError, match=r"aux\['n'\] has dtype int.*aux_reductions=.*\"sum\" \(a count\)"):
    step(lambda p, b: (masked_loss(p, b), {"n": jnp.sum(b["mask"] > 0)}), has_aux=True)(p, s, place(batch))
  with pytest.raises(ValueError, match=r"aux_reductions=\{'count': 'sum'\} does not match.*'count'.*\['n'\]"):
    aux = lambda p, b: (masked_loss(p, b), {"n": jnp.sum(b["x"])})
    step(aux, has_aux=True, aux_reductions={"count": "sum"})(p, s, place(batch))
  with pytest.raises(ValueError, match=r"opt_state does not match optimizer="):
    step(masked_loss)(p, optax.sgd(0.1).init(params), place(batch))
  if mesh is not None:
    other = jax.sharding.Mesh(np.asarray(jax.devices()[::-1]).reshape(mesh.devices.shape), mesh.axis_names)
    elsewhere = jax.device_put(params, jax.sharding.NamedSharding(other, jax.P()))
    with pytest.raises(ValueError, match=r"placed on another mesh.*ja.shard_train_state"):
      step(masked_loss)(elsewhere, s, place(batch))


def test_hsdp_batch_sharded_over_one_axis_is_resharded():
  """A batch placed over the replica axis only (not both data axes) is laid out by the step."""
  kwargs, mesh, axis, batch, _, _ = setup("weights", "hsdp")
  opt = optax.adam(1e-2)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  p, s = ja.shard_train_state(params, opt, mesh, strategy="hsdp", data_axis=axis)
  step = ja.make_train_step(masked_loss, opt, mesh=mesh, data_axis=axis, **kwargs)
  new_p, _, _ = step(p, s, jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.P("rep"))))
  chex.assert_trees_all_close(
    jax.device_get(new_p), reference("weights", params, batch, None, None, 8)["params"], rtol=RTOL
  )


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_float16_wire_with_token_weights_applies(strategy):
  """512-row microbatches weighted by their rows: sum w g overflows float16; the normalised wire does not."""
  mesh = _mesh(AxisType.Auto)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  x, y = regression_data(jax.random.PRNGKey(1), 8 * 2 * 512)
  batch = {"x": x, "y": 30.0 * y, "mask": jnp.ones(x.shape[0])}  # large errors: gradients of tens
  opt = optax.sgd(1e-3)
  p, s = ja.shard_train_state(params, opt, mesh, strategy=strategy)
  step = ja.make_train_step(
    masked_loss,
    opt,
    num_microbatches=2,
    mesh=mesh,
    strategy=strategy,
    weight_fn=lambda b: jnp.sum(b["mask"]),
    comm_dtype=jnp.float16,
  )
  new_p, _, metrics = step(p, s, ja.shard_batch(batch, mesh))
  assert bool(metrics["applied"])
  want = jax.tree.map(lambda a, g: a - 1e-3 * g, params, jax.grad(masked_loss)(params, batch))
  grads = jax.grad(masked_loss)(params, batch)
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 10  # 512 x that overflows float16
  # Within float16 rounding of the float64 step: |error in g| <= 2^-10 |g| per device's share summed.
  for got, w, g in zip(
    jax.tree.leaves(jax.device_get(new_p)), jax.tree.leaves(want), jax.tree.leaves(grads), strict=True
  ):
    np.testing.assert_allclose(got, w, atol=1e-3 * 8 * 2**-10 * float(jnp.max(jnp.abs(g))) + 1e-12)


@pytest.mark.parametrize(
  "name, opt",
  [
    ("masked", optax.masked(optax.adam(1e-2), lambda p: [{"w": True, "b": False} for _ in p])),
    (
      "set_to_zero",
      optax.multi_transform(
        {"a": optax.adam(1e-2), "z": optax.set_to_zero()}, lambda p: [{"w": "a", "b": "z"} for _ in p]
      ),
    ),
    (
      "chain_clip_masked",
      optax.chain(
        optax.clip_by_global_norm(1.0), optax.masked(optax.adamw(1e-2), lambda p: [{"w": True, "b": False} for _ in p])
      ),
    ),
    ("adafactor", optax.adafactor(1e-2, min_dim_size_to_factor=4)),
    ("inject", optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)),
    ("muon", optax.contrib.muon(1e-2)),
    ("noise_key", optax.chain(optax.add_noise(0.01, 0.5, 0), optax.adam(1e-2))),  # a PRNG key in the state
  ],
)
def test_shard_train_state_places_any_optax_state(name, opt):
  """Masked, set_to_zero, chained, factored, muon and injected states are placed and the zero1/fsdp steps exact."""
  mesh = _mesh(AxisType.Auto)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  _, _, _, batch, _, _ = setup("weights", "none")
  updates, _ = opt.update(jax.grad(masked_loss)(params, batch), opt.init(params), params)
  want = optax.apply_updates(params, updates)
  for strategy in ("zero1", "fsdp"):
    p, s = ja.shard_train_state(params, opt, mesh, strategy=strategy)
    chex.assert_trees_all_equal_structs(s, opt.init(params))
    step = ja.make_train_step(
      masked_loss, opt, num_microbatches=K, mesh=mesh, strategy=strategy, weight_fn=lambda b: jnp.sum(b["mask"])
    )
    new_p, _, _ = step(p, s, ja.shard_batch(batch, mesh))
    chex.assert_trees_all_close(jax.device_get(new_p), want, rtol=1e-10, atol=1e-12)


def test_scanned_layers_under_fsdp_gathered_layer_by_layer():
  """Stacked layers applied with lax.scan (MaxText/Levanter style): fsdp's layerwise gather inside the scan, exact."""
  from jax import lax

  def loss(p, b):
    h, _ = lax.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None), b["x"], p)
    return jnp.sum(b["mask"] * jnp.mean((h - b["y"]) ** 2, axis=-1)) / jnp.sum(b["mask"])

  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w": 0.3 * jax.random.normal(keys[0], (2, 16, 16)), "b": 0.1 * jax.random.normal(keys[1], (2, 16))}
  mask = jnp.ones(ROWS).at[jnp.arange(0, ROWS, 2)[:8]].set(0.0)  # device 0's first microbatch: padding
  batch = {"x": jax.random.normal(keys[2], (ROWS, 16)), "y": jax.random.normal(keys[3], (ROWS, 16)), "mask": mask}
  opt = optax.adam(1e-2)
  updates, _ = opt.update(jax.grad(loss)(params, batch), opt.init(params), params)
  want = optax.apply_updates(params, updates)
  mesh = _mesh(AxisType.Auto)
  p, s = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
  step = ja.make_train_step(
    loss, opt, num_microbatches=K, mesh=mesh, strategy="fsdp", weight_fn=lambda b: jnp.sum(b["mask"])
  )
  new_p, _, metrics = step(p, s, ja.shard_batch(batch, mesh))
  assert bool(metrics["applied"])
  chex.assert_trees_all_close(jax.device_get(new_p), want, rtol=RTOL, atol=1e-15)


# --------------------------------------------------------------------------- a skipped update costs no memory

SKIP_OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2)),
}


@pytest.mark.parametrize("opt_name", sorted(SKIP_OPTIMIZERS))
@pytest.mark.parametrize("strategy", smoke(("ddp", "zero1", "fsdp", "fsdp_once", "hsdp", "hsdp_once"), {"fsdp"}))
def test_skipped_update_costs_no_memory_and_moves_nothing(strategy, opt_name):
  """The step's compiled per-device peak equals its always-applied twin's (1%); a skipped step changes no bit.

  The skip (zero total weight, a non-finite gradient) is a conditional around
  the update: computing the update and selecting new or old would keep both
  copies of the parameters and the optimizer state alive (up to 1.3x the peak).
  """
  from jaxaccum import _engine

  opt = SKIP_OPTIMIZERS[opt_name]()
  params = mlp_init(jax.random.PRNGKey(0), (3, 64, 64, 2))  # 34 KiB of float64: per-step constants stay small
  _, _, _, batch, _, _ = setup("weights", "none")
  gather = {"fsdp_gather": "once"} if strategy.endswith("_once") else {}
  name = strategy.removesuffix("_once")
  mesh, axis = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)), "data"
  if name == "hsdp":
    mesh, axis = jax.make_mesh((2, 4), ("rep", "shard"), axis_types=(AxisType.Auto,) * 2), ("rep", "shard")
  step = ja.make_train_step(
    masked_loss,
    opt,
    num_microbatches=K,
    mesh=mesh,
    strategy=name,
    data_axis=axis,
    weight_fn=lambda b: jnp.sum(b["mask"]),
    **gather,
  )
  fresh = lambda: ja.shard_train_state(params, opt, mesh, strategy=name, data_axis=axis)  # donated by each call
  placed = ja.shard_batch(batch, mesh, axis)
  compiled = step.lower(*fresh(), placed).compile()
  twin = _engine.always_applied(step).lower(*fresh(), placed).compile()

  def peak(c):
    m = c.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes

  assert peak(compiled) <= 1.01 * peak(twin), (peak(compiled), peak(twin))

  # An applied step: the plain full-batch adam/adamw step (the weights are the mask's row counts).
  updates, _ = opt.update(jax.grad(masked_loss)(params, batch), opt.init(params), params)
  new_p, _, metrics = compiled(*fresh(), placed, None)
  assert bool(metrics["applied"])
  chex.assert_trees_all_close(jax.device_get(new_p), optax.apply_updates(params, updates), rtol=RTOL, atol=1e-15)
  # Skipped steps: zero total weight, and a NaN in one real row (a NaN mean gradient).
  empty = dict(batch, mask=jnp.zeros(ROWS))
  poisoned = dict(batch, x=batch["x"].at[3, 1].set(jnp.nan))
  for bad in (empty, poisoned):
    p, s = fresh()
    want_p, want_s = jax.device_get((p, s))
    new_p, new_s, metrics = compiled(p, s, ja.shard_batch(bad, mesh, axis), None)
    assert not bool(metrics["applied"])
    chex.assert_trees_all_equal(jax.device_get(new_p), want_p)
    chex.assert_trees_all_equal(jax.device_get(new_s), want_s)


# --------------------------------------------------------------------------- real model code (issue 25)


def _strategy_runs(strategies=STRATEGIES):
  """(name, make_train_step kwargs, mesh, data axis, devices over the data axes) per strategy."""
  for strategy in strategies:
    kwargs, mesh, axis, _, _, _ = setup("plain", strategy)
    yield strategy, kwargs, mesh, axis, 1 if mesh is None else 8


def _per_microbatch_step(loss, params, batch, devices, opt):
  """The plain step: each of the engine's microbatches differentiated alone with jax.grad, averaged, `opt` once."""
  take = lambda rows: jax.tree.map(lambda v: v[rows], batch)
  grads = [jax.grad(loss)(params, take(rows)) for _, _, rows in microbatches(batch, devices)]
  mean = jax.tree.map(lambda *gs: sum(gs) / len(gs), *grads)
  updates, _ = opt.update(mean, opt.init(params), params)
  return optax.apply_updates(params, updates)


def _assert_exact_under(strategy, kwargs, mesh, axis, devices, loss, params, batch, opt):
  step = ja.make_train_step(loss, opt, mesh=mesh, data_axis=axis, **kwargs)
  if mesh is None:
    p, s, b = params, opt.init(params), batch
  else:
    p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
    b = ja.shard_batch(batch, mesh, axis)
  new_p, _, metrics = step(p, s, b)
  assert bool(metrics["applied"]), strategy
  want = _per_microbatch_step(loss, params, batch, devices, opt)
  chex.assert_trees_all_close(jax.device_get(new_p), want, rtol=1e-10, atol=1e-12)


@jax.custom_vjp
def clip_gradient(lo, hi, x):
  """The JAX tutorial's custom_vjp: the identity forwards, its cotangent clipped to [lo, hi] backwards."""
  return x


clip_gradient.defvjp(lambda lo, hi, x: (x, (lo, hi)), lambda res, g: (None, None, jnp.clip(g, *res)))


def clipped_loss(params, batch):
  w = clip_gradient(-0.01, 0.01, params[0]["w"])
  h = jnp.tanh(batch["x"] @ w + params[0]["b"])
  return jnp.mean(jnp.sum((h @ params[1]["w"] + params[1]["b"] - batch["y"]) ** 2, axis=-1))


@pytest.mark.parametrize("strategy", smoke(STRATEGIES, {"ddp", "fsdp"}))
def test_a_backward_rule_nonlinear_in_its_cotangent_sees_the_plain_cotangent(strategy):
  """clip_gradient on a weight: each microbatch's gradient is clipped as plain jax.grad clips it, then weighted.

  fsdp's layerwise path once scaled the loss by the microbatch's share (1/16) before the backward pass,
  so the clip acted on a 16x smaller cotangent (effectively a 16x larger threshold).
  """
  _, _, _, batch, _, _ = setup("plain", "none")
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  g = jax.grad(clipped_loss)(params, jax.tree.map(lambda v: v[:2], batch))
  assert float(jnp.max(jnp.abs(g[0]["w"]))) == 0.01  # the clip binds: the test can tell the two cotangents apart
  ((name, kwargs, mesh, axis, devices),) = _strategy_runs((strategy,))
  _assert_exact_under(name, kwargs, mesh, axis, devices, clipped_loss, params, batch, optax.sgd(1.0))


def constant_carry_loss(params, batch):
  """Loops whose carry starts as a constant: an RNN from zeros, a penalty from 0.0, a power iteration from ones."""
  w, b = params[0]["w"], params[0]["b"]  # (3, 8), (8,)

  def cell(h, xt):  # one input feature per time step
    return jnp.tanh(h @ (w.T @ w) / 3 + xt[:, None] * w[0] + b), None

  h, _ = jax.lax.scan(cell, jnp.zeros((batch["x"].shape[0], 8)), batch["x"].T)
  out = h @ params[1]["w"] + params[1]["b"]
  penalty = jax.lax.fori_loop(0, 3, lambda i, acc: acc + jnp.sum(b**2) / (i + 1), 0.0)
  v = jax.lax.fori_loop(0, 4, lambda i, v: (w.T @ w) @ v / jnp.linalg.norm((w.T @ w) @ v), jnp.ones(8))
  return jnp.mean(jnp.sum((out - batch["y"]) ** 2, axis=-1)) + 0.01 * penalty + 0.01 * jnp.sum(v)


@pytest.mark.parametrize("strategy", smoke(STRATEGIES, {"fsdp"}))
def test_loops_whose_carry_starts_as_a_constant_run_on_every_strategy(strategy):
  """On a mesh these once failed with JAX's scan carry type error (its hint: a pcast in code with no shard_map)."""
  _, _, _, batch, _, _ = setup("plain", "none")
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  ((name, kwargs, mesh, axis, devices),) = _strategy_runs((strategy,))
  _assert_exact_under(name, kwargs, mesh, axis, devices, constant_carry_loss, params, batch, optax.adam(1e-2))


def _data_parallel_loss(mesh, axis):
  """The docs' hand-written data-parallel loss: its own shard_map over the data axis, pmean inside."""

  def loss(params, batch):
    local = lambda p, b: jax.lax.pmean(masked_loss(p, b), axis)
    return jax.shard_map(local, mesh=mesh, in_specs=(jax.P(), jax.P(axis)), out_specs=jax.P())(params, batch)

  return loss


@pytest.mark.parametrize("strategy", smoke([s for s in STRATEGIES if s != "none"], {"fsdp"}))
def test_a_loss_that_shard_maps_over_the_data_axis_itself_is_refused_by_name(strategy):
  kwargs, mesh, axis, batch, _, _ = setup("plain", strategy)
  opt = optax.sgd(0.1)
  p, s = ja.shard_train_state(
    mlp_init(jax.random.PRNGKey(0), SIZES), opt, mesh, strategy=kwargs["strategy"], data_axis=axis
  )
  step = ja.make_train_step(_data_parallel_loss(mesh, axis), opt, mesh=mesh, data_axis=axis, **kwargs)
  with pytest.raises(
    ValueError, match=r"loss_fn calls jax.shard_map over the data axis.*Pass the plain per-batch loss"
  ):
    step.lower(p, s, ja.shard_batch(batch, mesh, axis))


def _annotated_loss(params, batch):
  """The training cookbook's style: activations annotated with the data axis (an Explicit mesh)."""
  x, y = batch
  h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
  h = jax.sharding.reshard(h, jax.P("data", None))
  out = h @ params[1]["w"] + params[1]["b"]
  return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


@pytest.mark.parametrize("strategy", smoke(["ddp", "zero1", "fsdp", "fsdp_once"], {"fsdp"}))
def test_data_axis_annotations_in_the_loss_run_exact(strategy):
  """The cookbook's reshard on an Explicit mesh. Once JAX's 'PartitionSpec passed to einsum cannot contain axis
  names ... Manual' from inside the step, then a refusal by name: now localised inside the per-device map."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  x, y = regression_data(jax.random.PRNGKey(1), 32, SIZES[0], SIZES[-1])
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  kwargs = {"strategy": "fsdp", "fsdp_gather": "once"} if strategy == "fsdp_once" else {"strategy": strategy}
  opt = optax.adam(1e-2)
  step = ja.make_train_step(_annotated_loss, opt, num_microbatches=K, mesh=mesh, donate=False, **kwargs)
  p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"])
  with jax.set_mesh(mesh):
    new_p, _, metrics = step(p, s, ja.shard_batch((x, y), mesh))
  assert bool(metrics["applied"])
  # The reference: each microbatch alone with plain jax.grad, its annotation as written, on a one-device mesh.
  one = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
  with jax.set_mesh(one):
    want = _per_microbatch_step(_annotated_loss, params, (x, y), 8, opt)
  chex.assert_trees_all_close(jax.device_get(new_p), want, rtol=1e-10, atol=1e-12)


@jax.custom_jvp
def _softplus(x):
  return jnp.logaddexp(x, 0.0)


_softplus.defjvp(lambda primals, tangents: (_softplus(primals[0]), tangents[0] * jax.nn.sigmoid(primals[0])))


@jax.custom_vjp
def _dense(x, w):
  return x @ w


_dense.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


def model_code_loss(params, batch):
  """A custom_jvp activation, a custom_vjp layer, a lax.cond on a parameter, jax.checkpoint with a policy,
  a fori_loop over a layer, a tied (reused, transposed) weight."""
  w1, b1, w2, b2 = params[0]["w"], params[0]["b"], params[1]["w"], params[1]["b"]
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  h = jax.checkpoint(lambda x, w: _softplus(_dense(x, w) + b1), policy=policy)(batch["x"], w1)
  h = jax.lax.cond(jnp.sum(w1) > 0, lambda h: jnp.tanh(h), lambda h: jnp.sin(h), h)
  h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ (w1.T @ w1) / 3), h)
  return jnp.mean(jnp.sum((h @ w2 + b2 - batch["y"]) ** 2, axis=-1))


def tensor_parallel_loss(params, batch):
  """The docs' tensor-parallel layer: a shard_map over "model" inside the loss, its psum inside."""

  def layer(w1, w2, x):
    return jax.lax.psum(jnp.tanh(x @ w1) @ w2, "model")

  specs = (jax.P(None, "model"), jax.P("model", None), jax.P())
  out = jax.shard_map(layer, in_specs=specs, out_specs=jax.P(), axis_names={"model"})(
    params[0]["w"], params[1]["w"], batch["x"]
  )
  return jnp.mean(jnp.sum((out + params[1]["b"] - batch["y"]) ** 2, axis=-1))


@pytest.mark.parametrize(
  "loss",
  [model_code_loss, pytest.param(tensor_parallel_loss, marks=pytest.mark.slow)],
  ids=["model_code", "tensor_parallel"],
)
def test_layerwise_fsdp_runs_model_code_exactly_or_falls_back_and_says_so(loss):
  """fsdp's per-microbatch gather on what the JAX docs teach: exact, and the whole-leaf fallback reported.

  The nested shard_map once failed inside the layerwise backward ("Expected cotangent type ... got ...@model").
  """
  from jaxaccum import _layerwise

  _, _, _, batch, _, _ = setup("plain", "none")
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  opt = optax.adam(1e-2)
  # "model" first: Shardy wants a nested shard_map's manual axes before the outer one's in the mesh.
  mesh = jax.make_mesh((2, 4), ("model", "data"), axis_types=(AxisType.Auto,) * 2)
  _layerwise.clear_fallbacks()
  with jax.set_mesh(mesh):
    _assert_exact_under(
      "fsdp", dict(num_microbatches=K, donate=False, strategy="fsdp"), mesh, "data", 4, loss, params, batch, opt
    )
  assert set(_layerwise.fallbacks()) == ({"shard_map"} if loss is tensor_parallel_loss else set())


def _plain_mse(params, batch):
  return jnp.mean(jnp.sum((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1))


@pytest.mark.parametrize("strategy", smoke(STRATEGIES, {"none", "fsdp"}))
def test_skip_nonfinite_false_applies_what_plain_optax_applies(strategy):
  """With the guarantee off the step is the plain step: exact on a finite batch, and a NaN reaches the parameters.

  It is then held to the plain step with no allowance: no conditional around the update (no weight_fn), and
  under fsdp one all-reduce fewer (the 4-byte finite check's).
  """
  kwargs, mesh, axis, batch, _, _ = setup("plain", strategy)
  batch = {"x": batch["x"], "y": batch["y"]}
  opt = optax.adam(1e-2)
  params = mlp_init(jax.random.PRNGKey(0), SIZES)
  place = (lambda t: t) if mesh is None else (lambda t: ja.shard_batch(t, mesh, axis))
  fresh = lambda: (
    (params, opt.init(params))
    if mesh is None
    else ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
  )
  on = ja.make_train_step(_plain_mse, opt, mesh=mesh, data_axis=axis, **kwargs)
  off = ja.make_train_step(_plain_mse, opt, mesh=mesh, data_axis=axis, skip_nonfinite=False, **kwargs)

  def plain(batch):
    updates, _ = opt.update(jax.grad(_plain_mse)(params, batch), opt.init(params), params)
    return optax.apply_updates(params, updates)

  new, _, metrics = off(*fresh(), place(batch))
  chex.assert_trees_all_close(jax.device_get(new), plain(batch), rtol=RTOL, atol=1e-15)
  assert bool(metrics["applied"])
  poisoned = dict(batch, x=batch["x"].at[3, 1].set(jnp.nan))
  new, _, metrics = off(*fresh(), place(poisoned))
  want = plain(poisoned)
  got = jax.device_get(new)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))  # NaN where plain optax puts NaN
  assert any(np.isnan(g).any() for g in jax.tree.leaves(got))
  new, _, metrics = on(*fresh(), place(poisoned))  # the default still keeps it out
  assert not bool(metrics["applied"])
  chex.assert_trees_all_close(jax.device_get(new), params, rtol=0, atol=0)

  compiled_off = off.lower(*fresh(), place(batch)).compile()
  assert "conditional(" not in compiled_off.as_text()
  if strategy == "fsdp":
    count = lambda c: ja.count_collectives(c).get("all-reduce", 0)
    assert count(compiled_off) == count(on.lower(*fresh(), place(batch)).compile()) - 1


def test_skip_nonfinite_must_be_a_bool():
  with pytest.raises(TypeError, match=r"skip_nonfinite='yes' must be a bool"):
    ja.make_train_step(_plain_mse, optax.sgd(0.1), skip_nonfinite="yes")
