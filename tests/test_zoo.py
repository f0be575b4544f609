"""Every entry point against every model of the zoo (tests/zoo/): DESIGN.md's guarantee 8.

A cell runs one model through one entry point for one update (K=2 microbatches of a 32-row batch, 8
devices; hsdp on (2, 4)) and is either exact against the plain full-batch step written here with
`jax.grad` + optax (1e-10 in float64, scaled for bf16), or refused up front by a jaxaccum error whose
message names the construct and the alternative (the cell's regex). A JAX error from inside, a hang
or a wrong number fails the cell. Cells that fail today are written as they should behave and marked
`xfail(strict=True)` with the reason, so a fix turns them into an XPASS failure until the mark goes.

The matrix is slow (one compile per cell): it is marked `slow` except `SMOKE`. The docs page
docs/guides/zoo.md is generated from `CELLS` by `python tests/test_zoo.py --markdown`, and
`test_docs_page_is_in_sync` (default run) fails when it differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import sys

import chex
import conftest  # noqa: F401  (8 CPU devices and float64 before any jax use, also as a script)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum as ja

N, K = 32, 2  # rows per step, microbatches per device
MODELS = {m.name: m for m in zoo.models()}


def optimizer():
  return optax.sgd(0.3, momentum=0.9)  # the first step is -lr * g: any error in g shows


# --- splitting the batch as each entry point does -------------------------------------------------------------------
def strided(rows, k=K):
  """Microbatch i holds rows i, i+k, ... (ja.microbatch's split, used for every entry point here)."""
  return [rows[i::k] for i in range(k)]


def device_groups(n_dev):
  """Device p holds the p-th contiguous block of rows (a batch sharded on its leading axis), split strided."""
  return [g for block in np.split(np.arange(N), n_dev) for g in strided(block)]


def take(batch, rows):
  return jax.tree.map(lambda x: x[np.asarray(rows)], batch)


def weight(model, rows):
  return None if model.weight_fn is None else model.weight_fn(rows)


def grad_and_state(model, params, state, rows):
  """The plain gradient of the model's loss on `rows` (and its new state)."""
  if model.has_state:
    return jax.grad(model.loss, has_aux=True)(params, state, rows)
  return jax.grad(model.loss)(params, rows), None


def bound(model, fn):
  """`fn` with the model's own data axis bound (size 1), as a plain single-device reference needs it."""
  if model.syncs is None:
    return fn
  return lambda *a: jax.tree.map(lambda x: x[0], jax.vmap(lambda _: fn(*a), axis_name=model.syncs)(jnp.zeros(1)))


def synced(model, entry, groups):
  """The row groups a loss reducing over its data axis sees: each microbatch across the devices sharing it.

  The entry points return one group per (device, microbatch), device-major; `accumulate own jit` returns them
  microbatch-major (each of its microbatches is a global batch). hsdp's loss reduces over "data" only, the
  4 devices of one replica."""
  n_dev = n_data_devices(model)
  if entry == "accumulate own jit":
    return [np.concatenate(groups[i * n_dev : (i + 1) * n_dev]) for i in range(K)]
  span = 4 if entry == "step hsdp" else n_dev
  blocks = range(n_dev // span)
  return [np.concatenate([groups[(b * span + d) * K + i] for d in range(span)]) for b in blocks for i in range(K)]


def loss_of(model, state):
  """loss(params, batch) -> scalar, or (scalar, new_state) with the model state bound."""
  return (lambda p, b: model.loss(p, state, b)) if model.has_state else model.loss


def n_data_devices(model):
  return 8 // int(np.prod([s for _, s in model.mesh_axes]))


def mesh_for(model, data_shape, data_names, explicit=False):
  """All 8 devices: the data axes, then the model's own axes (e.g. "model": 2) taking their share."""
  shape = list(data_shape)
  shape[-1] //= 8 // n_data_devices(model)
  shape += [s for _, s in model.mesh_axes]
  names = (*data_names, *(a for a, _ in model.mesh_axes))
  kind = AxisType.Explicit if (explicit or model.explicit) else AxisType.Auto
  return jax.make_mesh(tuple(shape), names, axis_types=(kind,) * len(shape))


def local_context(model):
  """One device's context: the mesh axes the loss names (the TP layer's "model", the annotations' "data": size 1)."""
  axes = ((("data", 1),) if (model.explicit or model.annotates_data) else ()) + model.mesh_axes
  if not axes:
    return contextlib.nullcontext()
  kind = AxisType.Explicit if model.explicit else AxisType.Auto
  sizes, names = tuple(s for _, s in axes), tuple(a for a, _ in axes)
  devices = jax.devices()[: int(np.prod(sizes))]
  return jax.set_mesh(jax.make_mesh(sizes, names, axis_types=(kind,) * len(axes), devices=devices))


def mesh_context(model, mesh):
  return jax.set_mesh(mesh) if (model.mesh_axes or model.explicit or model.annotates_data) else contextlib.nullcontext()


# --- the entry points: each returns (params, state or None, the row groups it averaged over) ------------------------
def run_accumulate(model, params, state, batch):
  tx = ja.accumulate(optimizer(), K)

  @jax.jit
  def micro_step(p, s, rows):
    g, _ = grad_and_state(model, p, state, rows)
    updates, s = tx.update(g, s, p, weight=weight(model, rows))
    return optax.apply_updates(p, updates), s

  groups = strided(np.arange(N))
  with local_context(model):
    s = tx.init(params)
    for rows in groups:
      params, s = micro_step(params, s, take(batch, rows))
  return params, None, groups


def _window(model, state, tx, varying):
  """One whole window inside pmap/shard_map: K micro-steps over this device's rows, then the update."""

  def body(p, rows):
    s = tx.init(p)
    for i in range(K):
      piece = jax.tree.map(lambda x: x[i::K], rows)
      g, _ = grad_and_state(model, lax.pcast(p, "data", to="varying") if varying else p, state, piece)
      updates, s = tx.update(g, s, p, weight=weight(model, piece))
      p = optax.apply_updates(p, updates)
    return p

  return body


def run_accumulate_pmap(model, params, state, batch):
  n_dev = n_data_devices(model)
  tx = ja.accumulate(optimizer(), K, axis_name="data")
  per_device = jax.tree.map(lambda x: x.reshape(n_dev, N // n_dev, *x.shape[1:]), batch)
  out = jax.pmap(_window(model, state, tx, False), axis_name="data", in_axes=(None, 0))(params, per_device)
  return jax.tree.map(lambda x: x[0], out), None, device_groups(n_dev)


def run_accumulate_shard_map(model, params, state, batch):
  mesh = mesh_for(model, (8,), ("data",))
  tx = ja.accumulate(optimizer(), K, axis_name="data")
  body = _window(model, state, tx, True)
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"}))
  with mesh_context(model, mesh):
    return step(params, batch), None, device_groups(n_data_devices(model))


def run_accumulate_own_jit(model, params, state, batch):
  mesh = mesh_for(model, (8,), ("data",), explicit=True)
  tx = ja.accumulate(optimizer(), K, axis_name="data")
  grad = ja.grad(loss_of(model, state), axis_name="data", has_aux=model.has_state, weight_fn=model.weight_fn)

  @jax.jit
  def micro_step(p, s, rows):
    g = grad(p, rows)
    updates, s = tx.update(g[0] if model.has_state else g, s, p, weight=weight(model, rows))
    return optax.apply_updates(p, updates), s

  n_dev, micro = n_data_devices(model), strided(np.arange(N))
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    s = tx.init(p)
    for rows in micro:
      p, s = micro_step(p, s, jax.device_put(take(batch, rows), NamedSharding(mesh, P("data"))))
  return p, None, [rows[block] for rows in micro for block in np.split(np.arange(N // K), n_dev)]


def run_microbatch(model, params, state, batch):
  opt = optimizer()
  # Model state: floating leaves averaged, the others (a key, a counter) the last microbatch's, as make_train_step.
  last = lambda x: "mean" if jnp.issubdtype(x.dtype, jnp.inexact) else "last"
  fun = ja.microbatch(
    jax.grad(model.loss, has_aux=model.has_state),
    K,
    batch_argnums=2 if model.has_state else 1,
    weight_fn=model.weight_fn,
    reductions=("mean", jax.tree.map(last, state)) if model.has_state else None,
  )

  @jax.jit
  def step(p, b):
    g, new_state = fun(p, state, b) if model.has_state else (fun(p, b), None)
    updates, _ = opt.update(g, opt.init(p), p)
    return optax.apply_updates(p, updates), new_state

  with local_context(model):
    return *step(params, batch), strided(np.arange(N))


def run_train_step(model, params, state, batch, strategy=None, fsdp_gather=None):
  opt = optimizer()
  mesh, data_axis, n_dev = None, "data", 1
  if strategy == "hsdp":
    mesh, data_axis, n_dev = mesh_for(model, (2, 4), ("replica", "data")), ("replica", "data"), n_data_devices(model)
  elif strategy is not None:
    mesh, n_dev = mesh_for(model, (8,), ("data",)), n_data_devices(model)
  step = ja.make_train_step(
    model.loss,
    opt,
    num_microbatches=K,
    mesh=mesh,
    data_axis=data_axis,
    strategy=strategy or "ddp",
    fsdp_gather=fsdp_gather,
    has_state=model.has_state,
    weight_fn=model.weight_fn,
    donate=False,
  )
  with local_context(model) if mesh is None else mesh_context(model, mesh):
    if mesh is None:
      p, s, opt_state, b = params, state, opt.init(params), batch
    else:
      p, opt_state = ja.shard_train_state(params, opt, mesh, strategy=strategy, data_axis=data_axis)
      s, b = ja.replicate(state, mesh), ja.shard_batch(batch, mesh, data_axis)
    if model.has_state:
      p, s, _, metrics = step(p, s, opt_state, b)
    else:
      (p, _, metrics), s = step(p, opt_state, b), None
  assert bool(metrics["applied"])
  return p, s, device_groups(n_dev)


def run_micro_grad(model, params, state, batch):
  opt = optimizer()
  fun = ja.micro_grad(loss_of(model, state), has_aux=model.has_state, num_microbatches=K, weight_fn=model.weight_fn)

  @jax.jit
  def step(p, b):
    g, _ = fun(p, b)  # the (weighted) sum of per-example gradients
    total = jnp.asarray(N if model.weight_fn is None else model.weight_fn(b))
    updates, _ = opt.update(jax.tree.map(lambda x: x / total.astype(x.dtype), g), opt.init(p), p)
    return optax.apply_updates(p, updates)

  with local_context(model):
    return step(params, batch), None, [[r] for r in range(N)]


def run_flax(model, params, state, batch):
  tx = ja.accumulate(optimizer(), K)
  groups = strided(np.arange(N))
  if model.linen is not None:
    module, _ = model.linen
    ts = ja.flax.TrainState.create(apply_fn=module.apply, params=params, tx=tx, batch_stats=state)

    @jax.jit
    def micro_step(ts, rows):
      g, new_state = grad_and_state(model, ts.params, ts.batch_stats, rows)
      return ts.apply_gradients(grads=g, weight=weight(model, rows), batch_stats=new_state)

    for rows in groups:
      ts = micro_step(ts, take(batch, rows))
    return ts.params, ts.batch_stats, groups
  merge, module_loss = model.nnx
  net = merge(jax.tree.map(jnp.copy, params))
  opt = ja.flax.AccumulatingOptimizer(net, tx, wrt=nnx.Param)

  @nnx.jit
  def nnx_step(net, opt, rows):
    opt.update(net, nnx.grad(module_loss)(net, rows), weight=weight(model, rows))

  with local_context(model):
    for rows in groups:
      nnx_step(net, opt, take(batch, rows))
  return nnx.state(net, nnx.Param), None, groups


ENTRIES = {
  "accumulate": run_accumulate,
  "accumulate pmap": run_accumulate_pmap,
  "accumulate shard_map": run_accumulate_shard_map,
  "accumulate own jit": run_accumulate_own_jit,
  "microbatch": run_microbatch,
  "step none": run_train_step,
  "step ddp": lambda *a: run_train_step(*a, strategy="ddp"),
  "step zero1": lambda *a: run_train_step(*a, strategy="zero1"),
  "step fsdp": lambda *a: run_train_step(*a, strategy="fsdp"),
  "step fsdp once": lambda *a: run_train_step(*a, strategy="fsdp", fsdp_gather="once"),
  "step hsdp": lambda *a: run_train_step(*a, strategy="hsdp"),
  "micro_grad": run_micro_grad,
  "ja.flax": run_flax,
}


# --- the reference: the plain full-batch step (per group where the loss is not separable) --------------------------
@functools.partial(jax.jit, static_argnums=(0, 4))
def reference(model, params, state, batch, groups):
  """One optax step on the full batch's gradient; for a `grouped` model, the mean of each group's gradient."""
  if model.grouped:
    outs = [bound(model, grad_and_state)(model, params, state, take(batch, rows)) for rows in groups]
    g = jax.tree.map(lambda *xs: sum(xs) / len(xs), *[o[0] for o in outs])
    new_state = None if state is None else jax.tree.map(lambda *xs: sum(xs) / len(xs), *[o[1] for o in outs])
    new_state = None if state is None else jax.tree.map(lambda a, s: a.astype(s.dtype), new_state, state)
  else:
    g, new_state = grad_and_state(model, params, state, batch)
  opt = optimizer()
  updates, _ = opt.update(g, opt.init(params), params)
  return optax.apply_updates(params, updates), new_state


# --- the declared outcome of every cell -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Cell:
  """What a cell should do: "exact", "refused" (by a jaxaccum error matching `match`) or "n/a" (`why`).

  `xfail`: why it fails on main today ("issue 25: ..."), until the fix lands; the docs show it as such.
  """

  outcome: str = "exact"
  name: str = ""  # the refusal's short name in the docs
  match: str = ""
  why: str = ""
  xfail: str = ""


EXACT = Cell()
MESH_STEPS = ("step ddp", "step zero1", "step fsdp", "step fsdp once", "step hsdp")
_NO_MESH_IN_PMAP = Cell(
  "n/a", why="pmap maps one device per replica: a loss naming mesh axes (nested shard_map, annotations) needs a mesh"
)
# On JAX 0.10 ja.grad refuses any axis of size > 1 besides the data axis; where JAX types a partly manual map's
# output unreduced (0.12) it runs beside a model axis (tests/test_grad.py), and these models' own shard_map,
# manual over every mesh axis (the docs' gemm_tp, no axis_names=), is what is refused, by name.
_MODEL_AXIS_OWN_JIT = Cell(
  "refused",
  name="mesh axis besides the data axis",
  match="has the axis 'model' besides axis_name='data'|applies a jax.shard_map manual over every mesh axis",
)
_ANNOTATION_IN_OWN_SHARD_MAP = Cell(
  "n/a",
  why="a user's shard_map over the data axis makes that axis manual, which JAX refuses in an annotation, "
  "jaxaccum aside (tests/test_program.py shows JAX's own error); make_train_step and ja.grad localise them",
)
_AUTO_ANNOTATIONS_OWN_JIT = Cell(
  "n/a",
  why="ja.grad needs Explicit mesh axes (it holds gradients unreduced), where JAX makes a "
  "with_sharding_constraint an assert on the array's sharding; a model annotating for an Auto mesh fails that "
  "assert in plain JAX too (make_train_step runs it on its Auto mesh)",
)
CELLS: dict[tuple[str, str], Cell] = {
  # The docs' tensor-parallel layer: a nested shard_map over "model".
  ("shard_map_tp", "accumulate pmap"): _NO_MESH_IN_PMAP,
  ("shard_map_tp", "accumulate shard_map"): Cell(
    "n/a",
    why="JAX cannot lower the layer's shard_map over 'model' nested in a user's shard_map over 'data' "
    "('Cannot lower jaxpr with verifier errors', with or without jaxaccum); make_train_step runs it",
  ),
  ("shard_map_tp", "accumulate own jit"): _MODEL_AXIS_OWN_JIT,
  # The docs' module-level @jax.shard_map layer (gemm_tp).
  ("shard_map_tp_module", "accumulate pmap"): _NO_MESH_IN_PMAP,
  ("shard_map_tp_module", "accumulate own jit"): _MODEL_AXIS_OWN_JIT,
  # The cookbook's explicit-sharding model: activations annotated with P("data").
  ("cookbook_explicit", "accumulate pmap"): _NO_MESH_IN_PMAP,
  ("cookbook_explicit", "accumulate shard_map"): _ANNOTATION_IN_OWN_SHARD_MAP,
  # with_sharding_constraint and Flax logical constraints naming "data" on an Auto (data, model) mesh.
  **{(m, "accumulate pmap"): _NO_MESH_IN_PMAP for m in ("wsc_auto", "linen_logical")},
  **{(m, "accumulate shard_map"): _ANNOTATION_IN_OWN_SHARD_MAP for m in ("wsc_auto", "linen_logical")},
  **{(m, "accumulate own jit"): _AUTO_ANNOTATIONS_OWN_JIT for m in ("wsc_auto", "linen_logical")},
  # A typed key in the model state: ja.grad folds argument keys per device, so the state's key is per device.
  ("key_in_state", "accumulate own jit"): Cell(
    "refused", name="key in aux", match=r"aux\['rng'\] is a PRNG key: ja.grad folds the typed keys"
  ),
  # An RNN from h0 = zeros: the constant carry meets varying parameters on a mesh.
  ("rnn_zeros_carry", "accumulate shard_map"): Cell(
    "n/a", why="in a user's own shard_map JAX requires the model to pcast a constant scan carry (before jaxaccum runs)"
  ),
}


# A loss that reduces over its data axis runs where that axis is bound; elsewhere plain JAX fails the same way.
_UNBOUND = ("accumulate", "microbatch", "step none", "micro_grad", "ja.flax")
_NEEDS_ITS_AXIS = Cell(
  "n/a",
  why="the loss reduces over its data axis itself (lax.pmean/psum in the model): outside a map over that axis "
  "plain JAX fails too, 'unbound axis name' (tests/test_zoo.py::test_syncing_models_need_their_axis_bound)",
)


def cell(model: str, entry: str) -> Cell:
  if MODELS[model].syncs is not None and entry in _UNBOUND:
    return _NEEDS_ITS_AXIS
  if entry == "ja.flax" and MODELS[model].linen is None and MODELS[model].nnx is None:
    return Cell("n/a", why="ja.flax wraps linen TrainState and nnx.Optimizer: Flax models only")
  return CELLS.get((model, entry), EXACT)


def _key_data(tree):
  """Typed PRNG keys as their raw data (allclose compares numbers)."""
  is_key = lambda x: hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def run_cell(model_name, entry):
  model = MODELS[model_name]
  init = model.init(jax.random.PRNGKey(0))
  params, state = init if model.has_state else (init, None)
  batch = model.batch(jax.random.PRNGKey(1), N)
  if model.fresh is not None:
    model.fresh()
  got_params, got_state, groups = ENTRIES[entry](model, params, state, batch)
  if model.syncs is not None:
    groups = synced(model, entry, groups)
  if model.fresh is not None:
    model.fresh()
  with local_context(model):
    want_params, want_state = reference(model, params, state, batch, tuple(tuple(int(r) for r in g) for g in groups))
  tol = {"rtol": model.rtol, "atol": model.atol}
  chex.assert_trees_all_close(jax.tree.leaves(got_params), jax.tree.leaves(want_params), **tol)
  if got_state is not None:  # linen keeps BatchNorm statistics in float32 whatever the parameters
    got_state, want_state = _key_data(got_state), _key_data(want_state)
    chex.assert_trees_all_close(got_state, want_state, rtol=max(model.rtol, 1e-6), atol=max(model.atol, 1e-7))


def check_cell(model_name, entry):
  expected = cell(model_name, entry)
  if expected.outcome == "refused":
    with pytest.raises((ValueError, TypeError), match=expected.match):
      run_cell(model_name, entry)
  else:
    run_cell(model_name, entry)


SMOKE = {
  ("linen_mlp", "step ddp"),
  ("masked_padding", "microbatch"),
  ("eqx_mlp", "accumulate"),
  ("cookbook_explicit", "step fsdp"),  # annotations localised: Explicit out_sharding/reshard, layerwise fsdp
  ("wsc_auto", "step hsdp"),  # with_sharding_constraint on (replica, data, model), Auto
  ("shard_map_tp_module", "step fsdp once"),  # the module-level @jax.shard_map layer
  ("custom_vjp_layer", "accumulate own jit"),  # a custom_vjp's bwd checked on the localised avals (Explicit)
  ("numpy_pos_table", "step hsdp"),  # a NumPy constant beside a parameter, layerwise replay (was pos + pos)
  ("sync_bn", "step fsdp"),  # Flax's synchronized BatchNorm: a pmean over the data axis inside the model
  ("psum_tokens", "accumulate own jit"),  # a psum of the token count inside the loss, under ja.grad
}


def _params():
  for model in MODELS:
    for entry in ENTRIES:
      expected = cell(model, entry)
      if expected.outcome == "n/a":
        continue
      marks = [] if (model, entry) in SMOKE else [pytest.mark.slow]
      if expected.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=expected.xfail))
      yield pytest.param(model, entry, marks=marks, id=f"{model}-{entry.replace(' ', '_')}")


@pytest.mark.parametrize("model_name, entry", list(_params()))
def test_zoo_cell(model_name, entry):
  check_cell(model_name, entry)


@pytest.mark.slow  # checks the references (JAX's own error), not jaxaccum: the zoo cells above run in the default set
def test_syncing_models_need_their_axis_bound():
  """The not-applicable cells of the models that reduce over their data axis: JAX's own error, jaxaccum aside."""
  for model in (m for m in MODELS.values() if m.syncs is not None):
    init = model.init(jax.random.PRNGKey(0))
    params, state = init if model.has_state else (init, None)
    batch = model.batch(jax.random.PRNGKey(1), N)
    with pytest.raises(NameError, match=f"unbound axis name: {model.syncs}"):
      grad_and_state(model, params, state, batch)
    bound(model, grad_and_state)(model, params, state, batch)  # and with the axis bound, the reference runs


# --- the docs page: generated from CELLS (which the tests above hold), never typed ---------------------------------
PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "zoo.md"
SHORT = {
  "accumulate": "accumulate",
  "accumulate pmap": "accumulate<br>pmap",
  "accumulate shard_map": "accumulate<br>shard_map",
  "accumulate own jit": "accumulate<br>own jit<br>(ja.grad)",
  "microbatch": "microbatch",
  "step none": "step<br>no mesh",
  "step ddp": "step<br>ddp",
  "step zero1": "step<br>zero1",
  "step fsdp": "step<br>fsdp",
  "step fsdp once": "step<br>fsdp once",
  "step hsdp": "step<br>hsdp",
  "micro_grad": "micro_grad",
  "ja.flax": "ja.flax",
}


def markdown() -> str:
  """The zoo page: one table, rows models, columns entry points, from the declared cells."""
  notes: list[str] = []

  def mark(model, entry):
    c = cell(model, entry)
    if c.outcome == "n/a":
      return "—"
    text = "✔" if c.outcome == "exact" else f"refused: {c.name}"
    if c.xfail:
      notes.append(f"{len(notes) + 1}. `{model}` × {entry}: should be {text.replace('✔', 'exact')}; today: {c.xfail}")
      return f"✘ [{len(notes)}](#today)"
    return text

  head = "| model | " + " | ".join(SHORT[e] for e in ENTRIES) + " |"
  rule = "|---|" + "---|" * len(ENTRIES)
  rows = [f"| `{m}` | " + " | ".join(mark(m, e) for e in ENTRIES) + " |" for m in MODELS]
  models = [f"- `{m.name}` ({m.framework}): {m.what}." for m in MODELS.values()]
  na: dict[str, list[str]] = {}
  for m in MODELS:
    for e in ENTRIES:
      if (c := cell(m, e)).outcome == "n/a":
        na.setdefault(c.why, []).append(f"`{m}` × {e}")
  return "\n".join(
    [
      "<!-- Generated by `python tests/test_zoo.py --markdown` from the cells declared in tests/test_zoo.py;",
      "     tests/test_zoo.py::test_docs_page_is_in_sync fails when this page differs. Do not edit by hand. -->",
      "# Model zoo: what runs where",
      "",
      "Every entry point of jaxaccum against every model of the tests' zoo (`tests/zoo/`): small models",
      "written as their authors write them (Flax linen and nnx, Equinox, plain JAX), each bringing one",
      "construct the JAX docs teach. A cell runs one update (K=2 microbatches per device of a 32-row batch;",
      '8 devices, hsdp on (2, 4); a model with a "model" axis keeps 2 of them for it) and is either',
      "**exact** against the plain full-batch step written with `jax.grad` + optax (float64, 1e-10;",
      "bf16 within a bf16 tolerance), or **refused** up front by a jaxaccum error that names the construct",
      "and what to use instead. A JAX error from inside jaxaccum, a hang or a wrong number fails the cell.",
      "",
      "Where the loss of a batch is not the mean of its pieces' losses (BatchNorm's batch statistics, a",
      "clip on the cotangent) the reference is the mean over the entry point's microbatches (and devices)",
      "of each piece's plain gradient: what microbatching means for such a model (see",
      "[make_train_step](train-step.md) on BatchNorm).",
      "",
      "✔ exact · refused: *what* (a jaxaccum `ValueError`/`TypeError`) · ✘ fails today, being fixed",
      "(see [today](#today)) · — not applicable",
      "",
      head,
      rule,
      *rows,
      "",
      "## Models",
      "",
      *models,
      "",
      "## Today",
      "",
      *(notes or ["Every cell behaves as declared."]),
      "",
      "## Not applicable",
      "",
      *[f"- {w}: {', '.join(where) if len(where) < 5 else f'{len(where)} cells'}." for w, where in sorted(na.items())],
      "",
    ]
  )


def test_docs_page_is_in_sync():
  """docs/guides/zoo.md is what `python tests/test_zoo.py --markdown` writes from CELLS."""
  assert PAGE.read_text() == markdown(), "regenerate: python tests/test_zoo.py --markdown"


if __name__ == "__main__" and "--markdown" in sys.argv:
  PAGE.write_text(markdown())
  print(f"wrote {PAGE}")

if __name__ == "__main__" and "--probe" in sys.argv:
  # Each cell's outcome today, one line each, without pytest: `python tests/test_zoo.py --probe [model[:entry] ...]`.
  import traceback

  todo = []
  for arg in [a for a in sys.argv[1:] if not a.startswith("--")] or list(MODELS):
    model, _, entry = arg.partition(":")
    todo += [(model, e) for e in ([entry] if entry else ENTRIES) if cell(model, e).outcome != "n/a"]
  for model, entry in todo:
    try:
      run_cell(model, entry)
      print(f"OK   {model} | {entry}", flush=True)
    except Exception as e:
      frames = traceback.extract_tb(e.__traceback__)
      where = next(
        (f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(frames) if "jaxaccum/" in f.filename), "-"
      )
      first = (str(e).strip().splitlines() or [""])[0][:200]
      print(f"FAIL {model} | {entry} | {type(e).__name__} @ {where} | {first}", flush=True)
