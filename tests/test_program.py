"""The user's loss traced once and run as written (jaxaccum/_program.py): DESIGN.md guarantee 8, issue 31.

Model code annotated for the global batch (`with_sharding_constraint` naming the data axis, Flax logical
constraints, the cookbook's `out_sharding=`/`reshard`; tests/test_zoo.py and tests/test_grad.py hold the
latter) runs exact on every mesh path, its annotations localised inside the per-device map; the docs'
module-level `@jax.shard_map` tensor-parallel layer runs under every fsdp gather; the loss is traced once.
Every case is one update in float64 against the plain full-batch step written with `jax.grad`.
"""

from __future__ import annotations

import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo.tp_layer as tp_layer
from conftest import regression_data, remat_dense, smoke
from flax import linen as nn
from jax.extend import core as jex_core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from zoo.annotated_models import _tp_init, _tp_loss
from zoo.flax_models import regression

import jaxaccum as ja
from jaxaccum import _program

K, ROWS, LR = 2, 32, 0.3
RUNS = {  # strategy -> (make_train_step kwargs, mesh shape, mesh names, data axis)
  "ddp": ({"strategy": "ddp"}, (4, 2), ("data", "model"), "data"),
  "zero1": ({"strategy": "zero1"}, (4, 2), ("data", "model"), "data"),
  "fsdp": ({"strategy": "fsdp"}, (4, 2), ("data", "model"), "data"),
  "fsdp_once": ({"strategy": "fsdp", "fsdp_gather": "once"}, (4, 2), ("data", "model"), "data"),
  "hsdp": ({"strategy": "hsdp"}, (2, 2, 2), ("replica", "data", "model"), ("replica", "data")),
}


def two_layer(key, d_in=3, hidden=8, d_out=2):
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (d_in, hidden), jnp.float64) / 2,
    "b1": jnp.full((hidden,), 0.1, jnp.float64),
    "w2": jax.random.normal(k2, (hidden, d_out), jnp.float64) / 3,
    "b2": jnp.full((d_out,), 0.1, jnp.float64),
  }


def mse(pred, y):
  return jnp.mean(jnp.sum((pred - y) ** 2, -1))


def wsc_loss(mesh):
  """Activations constrained with a NamedSharding on the user's mesh, the global batch's layout."""

  def loss(params, batch):
    x, y = batch
    h = jax.lax.with_sharding_constraint(x @ params["w1"] + params["b1"], NamedSharding(mesh, P("data", "model")))
    h = jax.lax.with_sharding_constraint(jnp.tanh(h), NamedSharding(mesh, P("data", "model")))
    return mse(h @ params["w2"] + params["b2"], y)

  return loss


class LogicalMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.with_logical_constraint(nn.Dense(8, param_dtype=jnp.float64)(x), ("batch", "mlp"))
    return nn.Dense(2, param_dtype=jnp.float64)(nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp")))


RULES = (("batch", "data"), ("mlp", "model"))


def logical_loss(params, batch):
  with nn.logical_axis_rules(RULES):
    return mse(LogicalMLP().apply({"params": params}, batch[0]), batch[1])


def make_mesh(shape, names, kind=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def one_step(loss, params, batch, mesh, axis, **kwargs):
  """make_train_step's parameters after one SGD update."""
  opt = optax.sgd(LR)
  step = ja.make_train_step(loss, opt, num_microbatches=K, mesh=mesh, data_axis=axis, donate=False, **kwargs)
  with jax.set_mesh(mesh):
    p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
    new_p, _, metrics = step(p, s, ja.shard_batch(batch, mesh, axis))
  assert bool(metrics["applied"])
  return jax.device_get(new_p)


def plain_step(loss, params, batch, mesh):
  """The plain full-batch SGD step, the annotations as written, under the user's own jit on the same mesh."""
  with jax.set_mesh(mesh):
    g = jax.jit(jax.grad(loss))(params, batch)
  return jax.tree.map(lambda p, g: p - LR * g, params, jax.device_get(g))


@pytest.mark.parametrize("strategy", smoke(list(RUNS), {"ddp", "fsdp"}))
def test_with_sharding_constraint_naming_the_data_axis_runs_exact(strategy):
  """Once JAX's raw 'can only refer to Auto axes of the mesh' from inside every strategy."""
  kwargs, shape, names, axis = RUNS[strategy]
  mesh = make_mesh(shape, names)
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  got = one_step(wsc_loss(mesh), params, batch, mesh, axis, **kwargs)
  chex.assert_trees_all_close(got, plain_step(wsc_loss(mesh), params, batch, mesh), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("strategy", smoke(list(RUNS), {"zero1"}))
def test_flax_logical_constraints_under_rules_mapping_to_the_data_axis_run_exact(strategy):
  kwargs, shape, names, axis = RUNS[strategy]
  mesh = make_mesh(shape, names)
  x, y = regression_data(jax.random.PRNGKey(1), ROWS)
  params = LogicalMLP().init(jax.random.PRNGKey(0), x[:2])["params"]
  got = one_step(logical_loss, params, (x, y), mesh, axis, **kwargs)
  chex.assert_trees_all_close(got, plain_step(logical_loss, params, (x, y), mesh), rtol=1e-10, atol=1e-12)


def test_annotations_add_no_collective_and_the_gradient_is_reduced_once_per_update():
  """HLO-counted (with loop trip counts): ddp's one all-reduce per update, whatever K, annotated or not."""
  mesh = make_mesh((8,), ("data",))
  x, y = regression_data(jax.random.PRNGKey(1), 64)
  params = two_layer(jax.random.PRNGKey(0))

  def annotated(params, batch):
    h = jnp.tanh(batch[0] @ params["w1"] + params["b1"])
    h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
    return mse(h @ params["w2"] + params["b2"], batch[1])

  def plain(params, batch):
    return mse(jnp.tanh(batch[0] @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"], batch[1])

  def counts(loss, k):
    opt = optax.sgd(LR)
    step = ja.make_train_step(loss, opt, num_microbatches=k, mesh=mesh, donate=False)
    p, s = ja.shard_train_state(params, opt, mesh)
    return ja.count_collectives(step.lower(p, s, ja.shard_batch((x, y), mesh)).compile(), branches="none")

  assert counts(annotated, 2) == counts(plain, 2) == counts(annotated, 4)
  assert counts(annotated, 4)["all-reduce"] == 1


@pytest.mark.parametrize("gather", ["per_microbatch", "once", None], ids=["fsdp", "fsdp_once", "ddp"])
def test_the_docs_module_level_shard_map_layer_runs_exact_on_an_auto_mesh(gather):
  """The JAX docs' gemm_tp, a module-level @jax.shard_map without mesh= (its wrapper keeps the mesh of its first
  call). Once JAX's 'The context mesh ... should match the mesh passed to shard_map' in every gather mode: the
  step's shard_map refusal traced the loss a second time, under another mesh."""
  importlib.reload(tp_layer)  # a fresh module: the layer not yet bound to any mesh
  mesh = make_mesh((4, 2), ("data", "model"))
  params, batch = _tp_init(jax.random.PRNGKey(0)), regression(jax.random.PRNGKey(1), ROWS, d_in=4)
  kwargs = {"strategy": "ddp"} if gather is None else {"strategy": "fsdp", "fsdp_gather": gather}
  got = one_step(_tp_loss, params, batch, mesh, "data", **kwargs)
  # The layer is now bound to the step's mesh, as after a user's own first call under it: the plain step runs.
  chex.assert_trees_all_close(got, plain_step(_tp_loss, params, batch, mesh), rtol=1e-10, atol=1e-12)


def test_the_docs_module_level_shard_map_layer_on_an_explicit_mesh_is_refused_as_jax_refuses_it():
  """On Explicit axes (jax.make_mesh's default) JAX itself cannot run gemm_tp on a batch split over the data axis
  (its in_specs must equal the input's type): shown without jaxaccum, then jaxaccum's refusal by name."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  params, batch = _tp_init(jax.random.PRNGKey(0)), regression(jax.random.PRNGKey(1), ROWS, d_in=4)
  importlib.reload(tp_layer)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"in_specs passed to shard_map: .* does not match"):
    jax.jit(jax.grad(_tp_loss))(jax.device_put(params, P()), jax.device_put(batch, P("data")))
  importlib.reload(tp_layer)
  with pytest.raises(ValueError, match=r"make_train_step: loss_fn applies a jax.shard_map manual over every mesh axis"):
    one_step(_tp_loss, params, batch, mesh, "data", strategy="fsdp")


@pytest.mark.parametrize("gather", ["per_microbatch", "once"])
def test_the_docs_nested_shard_map_layer_under_fsdp_on_an_explicit_mesh_runs_exact(gather):
  """Issue 49 (item 9): the docs' tensor-parallel MLP (a shard_map over "model" inside the loss, its psum inside)
  under both fsdp gathers on an Explicit (data, model) mesh, its weights placed over "model" as its in_specs
  split them (JAX requires that on Explicit axes). Reported as no longer lowering on jax 0.10.2 ("Cannot lower
  jaxpr with verifier errors"), the 0.10 boundary patch the suspect; it runs in the default set at both ends."""
  from zoo import jax_models

  mesh = make_mesh((4, 2), ("data", "model"), AxisType.Explicit)
  params, batch = jax_models._tp_init(jax.random.PRNGKey(0)), regression(jax.random.PRNGKey(1), ROWS)
  specs = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}
  with jax.set_mesh(mesh):
    placed = jax.tree.map(lambda x, s: jax.device_put(x, s), params, specs)
    g = jax.jit(jax.grad(jax_models._tp_loss))(placed, jax.device_put(batch, P("data")))
  want = jax.tree.map(lambda p, g: p - LR * g, params, jax.device_get(g))
  got = one_step(jax_models._tp_loss, placed, batch, mesh, "data", strategy="fsdp", fsdp_gather=gather)
  chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_docs_shard_mapped_loss_is_refused_by_name():
  """The docs' loss_fsdp style: a module-level @jax.shard_map over the data axis with pmean inside (its in_specs
  inferred from the Explicit mesh); once JAX's raw mesh-mismatch error."""

  @jax.shard_map(out_specs=P())
  def loss_dp(params, local_batch):
    return jax.lax.pmean(mse(jnp.tanh(local_batch[0] @ params["w1"]) @ params["w2"], local_batch[1]), "data")

  mesh = jax.make_mesh((8,), ("data",))
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  with pytest.raises(ValueError, match=r"loss_fn calls jax.shard_map over the data axis 'data' itself"):
    one_step(loss_dp, params, batch, mesh, "data", strategy="fsdp")


def test_the_docs_shard_mapped_loss_called_first_by_the_user_is_refused_by_name():
  """As the docs run it: jax.jit(loss_dp) first (binding the wrapper to the mesh), then make_train_step.
  Once JAX's raw 'The context mesh ... should match the mesh passed to shard_map'."""

  @jax.shard_map(out_specs=P())
  def loss_dp(params, local_batch):
    return jax.lax.pmean(mse(jnp.tanh(local_batch[0] @ params["w1"]) @ params["w2"], local_batch[1]), "data")

  mesh = jax.make_mesh((8,), ("data",))
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  with jax.set_mesh(mesh):
    jax.jit(loss_dp)(jax.device_put(params, P()), jax.device_put(batch, P("data")))
  with pytest.raises(ValueError, match=r"module-level @jax.shard_map .*hand-written data-parallel loss"):
    one_step(loss_dp, params, batch, mesh, "data", strategy="ddp")


@pytest.mark.parametrize("strategy", smoke(["ddp", "fsdp", "fsdp_once"], {"fsdp"}))
def test_the_loss_is_traced_once(strategy):
  """No check traces the user's code a second time (each trace is a Python call of the loss)."""
  kwargs, shape, names, axis = RUNS[strategy]
  mesh = make_mesh(shape, names)
  calls = []

  def loss(params, batch):
    calls.append(1)
    return wsc_loss(mesh)(params, batch)

  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  opt = optax.sgd(LR)
  step = ja.make_train_step(loss, opt, num_microbatches=K, mesh=mesh, data_axis=axis, donate=False, **kwargs)
  p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
  step.lower(p, s, ja.shard_batch(batch, mesh, axis))
  assert len(calls) == 1


def test_jax_refuses_a_manual_axis_in_an_annotation_without_jaxaccum():
  """Why the zoo's annotated models are n/a in a user's own shard_map: JAX's own refusal, no jaxaccum involved."""
  mesh = make_mesh((8,), ("data",))
  body = lambda x: jax.lax.with_sharding_constraint(x * 2, P("data"))
  f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  with pytest.raises(ValueError, match="can only refer to Auto axes"):
    jax.jit(f)(jnp.ones((16,)))


def _annotated(x):
  return jax.lax.with_sharding_constraint(x, P("data", None))


@jax.custom_vjp
def _dense_fwd_annotated(x, w):
  return _annotated(x @ w)


_dense_fwd_annotated.defvjp(lambda x, w: (_annotated(x @ w), (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


@jax.custom_vjp
def _dense_bwd_annotated(x, w):
  return x @ w


_dense_bwd_annotated.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (_annotated(g @ res[1].T), res[0].T @ g))


@pytest.mark.parametrize("strategy", smoke(["ddp", "fsdp"], {"fsdp"}))
def test_annotations_in_a_custom_vjp_forward_rule_and_its_bwd_are_localised(strategy):
  """JAX traces a custom_vjp's fwd only when it differentiates, and its bwd on the cotangents: both are traced
  under the loss's trace mesh and localised. The bwd was once refused by name (it ran inside the per-device map,
  where the data axis is manual); both were JAX's raw 'can only refer to Auto axes of the mesh' before that."""
  mesh = make_mesh((8,), ("data",))
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  for dense in (_dense_fwd_annotated, _dense_bwd_annotated):
    loss = lambda p, b, dense=dense: mse(jnp.tanh(dense(b[0], p["w1"])) @ p["w2"], b[1])
    got = one_step(loss, params, batch, mesh, "data", strategy=strategy)
    chex.assert_trees_all_close(got, plain_step(loss, params, batch, mesh), rtol=1e-10, atol=1e-12)


def global_batch_dense(annotate):
  """A dense layer as a custom_vjp annotated for the global batch: its output in the primal and the fwd, the
  input's cotangent in the bwd (the weight's cotangent contracts the rows: replicated, as on any mesh)."""
  f = jax.custom_vjp(lambda x, w: annotate(x @ w))
  f.defvjp(
    lambda x, w: (annotate(x @ w), (x, w)),
    lambda res, g: (annotate(g @ res[1].T), jnp.einsum("bi,bo->io", res[0], g, out_sharding=P())),
  )
  return f


def _global_batch_vjp_loss(kind):
  """`with_sharding_constraint` on an Auto mesh, `reshard` on an Explicit one, over ("data", None); "assert": on an
  Explicit mesh `with_sharding_constraint`, which asserts the type (the rows split over "data", as in plain jit)."""
  if kind == "explicit":
    annotate = lambda h: jax.sharding.reshard(h, P("data", None))
  else:
    annotate = lambda h: jax.lax.with_sharding_constraint(h, P("data", None))
  dense = global_batch_dense(annotate)
  return lambda p, b: mse(jnp.tanh(dense(b[0], p["w1"]) + p["b1"]) @ p["w2"] + p["b2"], b[1])


VJP_CELLS = [(s, kind, k) for s in RUNS for kind in ("auto", "explicit") for k in (1, 2, 4)]
VJP_CELLS += [("ja.grad", "explicit", 2), ("fsdp", "assert", 2), ("ddp", "assert", 1), ("ja.grad", "assert", 2)]


@pytest.mark.parametrize(
  ("strategy", "kind", "k"),
  smoke(
    VJP_CELLS, keep=[("fsdp", "explicit", 2), ("hsdp", "auto", 1), ("ja.grad", "explicit", 2), ("ddp", "assert", 1)]
  ),
)
def test_a_custom_vjp_annotated_in_its_primal_fwd_and_bwd_runs_exact(strategy, kind, k):
  """Issue 49 (item 9): once JAX's raw "PartitionSpec passed to reshard cannot contain axis names that are of
  type Auto or Manual" from the bwd (jax 0.10.2), or jaxaccum's refusal of an annotation in a bwd, on every path.
  Exact against the plain full-batch step in the user's own jit on a (data, model) mesh of the same kind."""
  loss = _global_batch_vjp_loss(kind)
  axis_type = AxisType.Auto if kind == "auto" else AxisType.Explicit
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  plain = make_mesh((4, 2), ("data", "model"), axis_type)
  with jax.set_mesh(plain):
    placed = jax.device_put(batch, NamedSharding(plain, P("data")))
    g = jax.device_get(jax.jit(jax.grad(loss))(jax.device_put(params, NamedSharding(plain, P())), placed))
  want = jax.tree.map(lambda p, g: p - LR * g, params, g)
  if strategy == "ja.grad":  # jax 0.10 leaves a gradient unreduced only where the map is manual over every axis
    mesh = make_mesh((8,), ("data",), axis_type)
    with jax.set_mesh(mesh):
      placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
      grads = jax.jit(ja.grad(loss, axis_name="data"))(jax.device_put(params, NamedSharding(mesh, P())), placed)
      grads = jax.jit(lambda g: jax.tree.map(lambda v: jax.reshard(v, P()), g))(grads)
    got = jax.tree.map(lambda p, g: p - LR * g, params, jax.device_get(grads))
  else:
    kwargs, shape, names, axis = RUNS[strategy]
    opt = optax.sgd(LR)
    mesh = make_mesh(shape, names, axis_type)
    step = ja.make_train_step(loss, opt, num_microbatches=k, mesh=mesh, data_axis=axis, donate=False, **kwargs)
    with jax.set_mesh(mesh):
      p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
      new_p, _, metrics = step(p, s, ja.shard_batch(batch, mesh, axis))
    assert bool(metrics["applied"])
    got = jax.device_get(new_p)
  chex.assert_trees_all_close(got, want, rtol=1e-12, atol=1e-14)


@jax.custom_vjp
def _dense_bwd_unconstrained(x, w):
  return x @ w


_dense_bwd_unconstrained.defvjp(
  lambda x, w: (x @ w, (x, w)),
  lambda res, g: (jax.lax.with_sharding_constraint(g @ res[1].T, P(P.UNCONSTRAINED, None)), res[0].T @ g),
)


def test_an_unconstrained_annotation_in_a_custom_vjp_bwd_runs_exact():
  """Issue 38 (the nested fuzzer): run per device, where every axis is manual, JAX refuses P.UNCONSTRAINED
  (test_fuzz_nested.py shows it in a user's own shard_map), and the bwd was refused by name. Traced under the
  loss's trace mesh, where the data axis is Auto, and localised (UNCONSTRAINED means None where no axis is left to
  choose), it runs as in the user's own jit."""
  loss = lambda p, b: mse(jnp.tanh(_dense_bwd_unconstrained(b[0], p["w1"])) @ p["w2"], b[1])
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  mesh = make_mesh((8,), ("data",))
  got = one_step(loss, params, batch, mesh, "data", strategy="fsdp")
  chex.assert_trees_all_close(got, plain_step(loss, params, batch, mesh), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_custom_jvp_rule_is_traced_on_the_loss_mesh_and_localised(strategy):
  """jax.nn.relu's jvp (a custom_jvp whose rule makes `full_like(g, 0)`) is traced when JAX differentiates, on
  the avals of the loss's one trace: once 'Context mesh ... should match the mesh of sharding ... passed to
  broadcast_in_dim' from inside the step (the docs' Flax ResNet port, examples/flax_resnet_sharded.py)."""
  mesh = make_mesh((8,), ("data",))
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  loss = lambda p, b: mse(jax.nn.relu(b[0] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], b[1])
  got = one_step(loss, params, batch, mesh, "data", strategy=strategy)
  chex.assert_trees_all_close(got, plain_step(loss, params, batch, mesh), rtol=1e-10, atol=1e-12)


def cookbook_model_axis_loss(params, batch):
  """The cookbook's style on an Explicit (data, model) mesh: out_sharding and reshard naming both axes."""
  x, y = batch
  h = jnp.tanh(jnp.einsum("bf,fh->bh", x, params["w1"], out_sharding=P("data", "model")) + params["b1"])
  h = jax.sharding.reshard(h, P("data", None))
  return mse(jnp.einsum("bh,ho->bo", h, params["w2"], out_sharding=P("data", None)) + params["b2"], y)


@pytest.mark.parametrize("strategy", smoke(list(RUNS), {"fsdp"}))
def test_explicit_annotations_with_a_model_axis_run_exact(strategy):
  """Parameters sharded over an Explicit "model" axis, activations annotated over ("data", "model")."""
  kwargs, shape, names, axis = RUNS[strategy]
  mesh = make_mesh(shape, names, AxisType.Explicit)
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P(), "b2": P()}
  place = lambda: jax.tree.map(lambda x, s: jax.device_put(x, s), params, specs)
  # The reference on a (data, model) mesh: in plain JAX the model's P("data") meets hsdp's batch typed
  # P(("replica", "data")) in a subtraction and fails; the step, per device, holds the rows either way.
  plain = make_mesh((4, 2), ("data", "model"), AxisType.Explicit)
  with jax.set_mesh(plain):
    g = jax.jit(jax.grad(cookbook_model_axis_loss))(place(), jax.device_put(batch, P("data")))
  want = jax.tree.map(lambda p, g: p - LR * g, params, jax.device_get(g))
  with jax.set_mesh(mesh):
    placed = place()
  chex.assert_trees_all_close(
    one_step(cookbook_model_axis_loss, placed, batch, mesh, axis, **kwargs), want, rtol=1e-10, atol=1e-12
  )


def test_a_step_traced_inside_a_callers_shard_map_runs():
  """ja.diloco_train_step runs the step inside its own shard_map over "replica": the loss is traced there, and
  its scalar literals carry that mesh in their types (an embedding lookup's index check). Once 'For primitive
  lt, context mesh ... should match the aval mesh' (the bench's text LM)."""
  from jaxaccum import slowlink

  def loss(params, tokens):
    return jnp.mean((params["embed"][tokens[:, :-1]] @ params["w"] - tokens[:, 1:]) ** 2)

  params = {"embed": jnp.ones((5, 4)), "w": jnp.ones((4,))}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("replica", "data"))
  base = ja.make_train_step(loss, optax.sgd(0.1), mesh=mesh, strategy="ddp")
  step = slowlink.diloco_train_step(base, optax.sgd(0.7), 2)
  p, s = step.init(params)
  p, s, metrics = step(p, s, jnp.zeros((8, 6), jnp.int32))
  assert np.all(np.isfinite(np.asarray(metrics["loss"])))


def wsc_assert_loss(params, batch):
  """On an Explicit mesh `with_sharding_constraint` asserts the type: the rows split over "data", as in plain jit."""
  x, y = batch
  h = jax.lax.with_sharding_constraint(jnp.tanh(x @ params["w1"] + params["b1"]), P("data", None))
  return mse(h @ params["w2"] + params["b2"], y)


@pytest.mark.parametrize("strategy", smoke(["ddp", "fsdp", "zero1"], {"fsdp"}))
def test_an_explicit_mesh_assert_of_the_rows_layout_holds_as_in_plain_jit(strategy):
  """Port31's report: "The array sharding: P(None, None) did not match the sharding provided: P('data', None)".

  The trace typed one device's rows unsharded; they are typed over the (size-1) data axis now, as the step
  lays them out, so the assert the user's own jit passes passes in the trace too.
  """
  kwargs, shape, names, axis = RUNS[strategy]
  mesh = make_mesh(shape, names, AxisType.Explicit)
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  got = one_step(wsc_assert_loss, params, batch, mesh, axis, **kwargs)
  with jax.set_mesh(mesh):
    placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
    g = jax.device_get(jax.jit(jax.grad(wsc_assert_loss))(jax.device_put(params, NamedSharding(mesh, P())), placed))
  want = jax.tree.map(lambda p, g: p - LR * g, params, g)
  chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- collectives inside the loss (issue 38)


class _SyncBNNet(nn.Module):
  """Flax's ImageNet example's normalisation: BatchNorm in training mode synchronised over the data axis."""

  axis: str | None = "batch"

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=jnp.float64, param_dtype=jnp.float64)
    x = nn.Dense(8, **kw)(x)
    x = nn.BatchNorm(use_running_average=False, axis_name=self.axis, momentum=0.9, **kw)(x)
    return nn.Dense(2, **kw)(nn.relu(x))


def _sync_bn_loss(params, stats, batch):
  out, new = _SyncBNNet().apply({"params": params, "batch_stats": stats}, batch[0], mutable=["batch_stats"])
  return jnp.mean((out - batch[1]) ** 2), new["batch_stats"]


def _sync_bn_reference(params, stats, x, y, devices, k, lr):
  """The pmap port (Flax's ImageNet example): device d's microbatch i = rows i, i+K, ... of its block; the
  gradients pmean'd over devices and averaged over microbatches, the new statistics averaged the same way."""
  grad = jax.pmap(jax.value_and_grad(_sync_bn_loss, has_aux=True), axis_name="batch", in_axes=(None, None, 0))
  xs, ys = np.asarray(x).reshape(devices, -1, x.shape[-1]), np.asarray(y).reshape(devices, -1, y.shape[-1])
  outs = [grad(params, stats, (xs[:, i::k], ys[:, i::k])) for i in range(k)]
  (loss, new_stats), grads = jax.tree.map(lambda *v: np.mean([np.asarray(a).mean(0) for a in v], 0), *outs)
  return jax.tree.map(lambda p, g: np.asarray(p) - lr * g, params, grads), new_stats, loss


@pytest.mark.parametrize(
  ("strategy", "kind", "k"),
  smoke(
    [(s, t, k) for s in ("ddp", "zero1", "fsdp", "fsdp-once", "hsdp") for t in ("explicit", "auto") for k in (1, 2)],
    keep=[("ddp", "explicit", 2), ("fsdp", "auto", 2), ("hsdp", "explicit", 1)],
  ),
)
def test_sync_batchnorm_over_the_data_axis_runs_as_in_the_users_shard_map(strategy, kind, k):
  """Issue 38: the loss is traced with the data axes bound at their sizes, so a collective the model runs over
  one (pmean inside nn.BatchNorm(axis_name=...)) means what it means under pmap; before, tracing it failed with
  "unbound axis name". Exact against the pmap port."""
  axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  x, y = regression_data(jax.random.PRNGKey(4), 32, d_out=2)
  variables = _SyncBNNet(axis=None).init(jax.random.PRNGKey(2), x[:4])
  params = variables["params"]
  stats = jax.tree.map(lambda s: s.astype(jnp.float64), variables["batch_stats"])
  devices, lr = 4, 0.1
  want_p, want_s, want_loss = _sync_bn_reference(params, stats, x, y, devices, k, lr)
  if strategy == "hsdp":  # the data axis "batch" is two axes: replicas x shards, 2 x 2
    mesh = jax.make_mesh((2, 2), ("rep", "batch"), axis_types=(axis_type,) * 2, devices=jax.devices()[:4])
    loss = lambda p, s, b: _sync_bn_loss_over(p, s, b, ("rep", "batch"))
    opts = dict(strategy="hsdp", data_axis=("rep", "batch"))
  else:
    mesh = jax.make_mesh((devices,), ("batch",), axis_types=(axis_type,), devices=jax.devices()[:devices])
    loss = _sync_bn_loss
    gather = "once" if strategy == "fsdp-once" else "per_microbatch"
    opts = dict(strategy=strategy.removesuffix("-once"), data_axis="batch", fsdp_gather=gather)
    opts = opts if strategy.startswith("fsdp") else {k_: v for k_, v in opts.items() if k_ != "fsdp_gather"}
  opt = optax.sgd(lr)
  step = ja.make_train_step(loss, opt, num_microbatches=k, mesh=mesh, has_state=True, donate=False, **opts)
  p, o = ja.shard_train_state(params, opt, mesh, strategy=opts["strategy"], data_axis=opts["data_axis"])
  p, s, _, metrics = step(p, stats, o, (x, y))
  chex.assert_trees_all_close(jax.tree.map(np.asarray, p), want_p, rtol=1e-12, atol=1e-14)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, s), want_s, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-12)


def _sync_bn_loss_over(params, stats, batch, axes):
  """The same model normalised over a tuple of axes (hsdp's replicas x shards: every device of the data axes)."""

  class Net(_SyncBNNet):
    axis: str | tuple | None = axes

  out, new = Net().apply({"params": params, "batch_stats": stats}, batch[0], mutable=["batch_stats"])
  return jnp.mean((out - batch[1]) ** 2), new["batch_stats"]


def test_sync_batchnorm_under_ja_grad_on_an_explicit_mesh():
  """The same model through ja.value_and_grad in the user's own jit: the statistics come back as aux."""
  x, y = regression_data(jax.random.PRNGKey(4), 32, d_out=2)
  variables = _SyncBNNet(axis=None).init(jax.random.PRNGKey(2), x[:4])
  params = variables["params"]
  stats = jax.tree.map(lambda s: s.astype(jnp.float64), variables["batch_stats"])
  want_p, want_s, want_loss = _sync_bn_reference(params, stats, x, y, 4, 1, 1.0)
  want_g = jax.tree.map(lambda p, q: np.asarray(p) - q, params, want_p)  # lr 1: the gradient
  mesh = jax.make_mesh((4,), ("batch",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    batch = jax.device_put((x, y), NamedSharding(mesh, P("batch")))
    fn = ja.value_and_grad(lambda p, b, s: _sync_bn_loss(p, s, b), axis_name="batch", has_aux=True)
    (loss, new_stats), grads = jax.jit(fn)(params, batch, stats)
    grads = jax.jit(lambda g: jax.tree.map(lambda v: jax.reshard(v, P()), g))(grads)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, grads), want_g, rtol=1e-10, atol=1e-14)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, new_stats), want_s, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-12)


# --------------------------------------------------------------------------- issue 38: the localiser's reach


def _explicit_reference(loss, params, batch, mesh):
  """The plain full-batch SGD step in the user's own jit on an Explicit mesh, the batch placed over "data"."""
  with jax.set_mesh(mesh):
    placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
    g = jax.device_get(jax.jit(jax.grad(loss))(jax.device_put(params, NamedSharding(mesh, P())), placed))
  return jax.tree.map(lambda p, g: p - LR * g, params, g)


@pytest.mark.parametrize(
  ("strategy", "kind"),
  smoke(
    [(s, k) for s in RUNS for k in ("auto", "explicit") if (s, k) != ("hsdp", "explicit")],
    keep=[("fsdp_once", "explicit"), ("ddp", "auto")],
  ),
)
def test_a_custom_vjp_with_optimize_remat_annotated_in_its_primal_and_fwd_runs_exact(strategy, kind):
  """Issue 38: JAX keeps such a custom_vjp's primal as a thunk in the fwd's `remat_opt` equation and traces it
  when its residuals go unused, inside the per-device map: once
  "with_sharding_constraint can only refer to Auto axes" / "Closing over inputs to shard_map ... `Explicit`
  axes". Now traced under the loss's trace mesh and localised, as a fwd rule is."""
  kwargs, shape, names, axis = RUNS[strategy]
  explicit = kind == "explicit"
  mesh = make_mesh(shape, names, AxisType.Explicit if explicit else AxisType.Auto)
  annotate = (lambda h: jax.sharding.reshard(h, P("data", None))) if explicit else _annotated
  dense = remat_dense(annotate)
  loss = lambda p, b: mse(jnp.tanh(dense(b[0], p["w1"])) @ p["w2"], b[1])
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  want = _explicit_reference(loss, params, batch, make_mesh((8,), ("data",), AxisType.Explicit)) if explicit else None
  want = plain_step(loss, params, batch, mesh) if want is None else want
  chex.assert_trees_all_close(one_step(loss, params, batch, mesh, axis, **kwargs), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("strategy", ["ddp", "hsdp"])
def test_with_sharding_constraint_under_vmap_on_an_auto_mesh_of_data_axes_only_runs_exact(strategy):
  """Issue 38: vmap of a constraint adds P.UNCONSTRAINED for the mapped dimension; inside the map, on a mesh of
  data axes only, no axis is Auto and JAX refuses it ("cannot contain `P.UNCONSTRAINED` when no mesh axis_types
  are `Auto`"). There it means None (nothing is left to choose), and is localised so."""
  shape, names = ((8,), ("data",)) if strategy == "ddp" else ((2, 4), ("replica", "data"))
  axis = "data" if strategy == "ddp" else names
  mesh = make_mesh(shape, names)

  def loss(p, b):
    h = jnp.tanh(b[0] @ p["w1"] + p["b1"])
    h = jax.vmap(lambda r: jax.lax.with_sharding_constraint(r, P(None)))(h)
    return mse(h @ p["w2"] + p["b2"], b[1])

  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  got = one_step(loss, params, batch, mesh, axis, strategy=strategy)
  chex.assert_trees_all_close(got, plain_step(loss, params, batch, mesh), rtol=1e-12, atol=1e-14)


def _closure_loss(table):
  return lambda p, b: mse(jnp.tanh(b[0] @ p["w1"] + p["b1"]) @ table @ p["w2"] + p["b2"], b[1])


@pytest.mark.parametrize("strategy", smoke(list(RUNS), {"fsdp_once"}))
def test_a_loss_closing_over_a_replicated_array_on_an_explicit_mesh_runs_exact(strategy):
  """Issue 38: an array put replicated on the step's Explicit mesh and read from the enclosing scope is typed on
  that mesh; the trace (under the mesh with size-1 data axes) once failed on it with "context mesh ... should
  match the aval mesh". It is typed on the trace's mesh, and taken as a constant inside the map."""
  kwargs, shape, names, axis = RUNS[strategy]
  mesh = make_mesh(shape, names, AxisType.Explicit)
  table = jax.device_put(jnp.linspace(0.5, 1.5, 64).reshape(8, 8), NamedSharding(mesh, P()))
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  got = one_step(_closure_loss(table), params, batch, mesh, axis, **kwargs)
  plain = make_mesh((8,), ("data",), AxisType.Explicit)
  want = _explicit_reference(_closure_loss(jax.device_put(table, NamedSharding(plain, P()))), params, batch, plain)
  chex.assert_trees_all_close(got, want, rtol=1e-12, atol=1e-14)


def _solve_loss(p, b):
  """A linear solve in the parameters: custom_linear_solve keeps its jaxprs in a NamedTuple parameter."""
  v = jnp.linalg.solve(jnp.eye(8) * 3.0 + p["w1"].T @ p["w1"], p["b1"])
  return mse(jnp.tanh(b[0] @ p["w1"] + v) @ p["w2"] + p["b2"], b[1])


@pytest.mark.parametrize(
  ("strategy", "kind"),
  smoke([(s, k) for s in ("ddp", "fsdp", "fsdp_once") for k in ("auto", "explicit")], keep=[("fsdp", "auto")]),
)
def test_a_linear_solve_in_the_parameters_runs_exact(strategy, kind):
  """Issue 38: once "context mesh ... should match the aval mesh": the solve's jaxprs (custom_linear_solve's
  `jaxprs`, a NamedTuple of ClosedJaxprs) kept the trace's mesh. The localiser now reaches into them."""
  kwargs, shape, names, axis = RUNS[strategy]
  mesh = make_mesh(shape, names, AxisType.Explicit if kind == "explicit" else AxisType.Auto)
  params, batch = two_layer(jax.random.PRNGKey(0)), regression_data(jax.random.PRNGKey(1), ROWS)
  got = one_step(_solve_loss, params, batch, mesh, axis, **kwargs)
  chex.assert_trees_all_close(got, plain_step(_solve_loss, params, batch, mesh), rtol=1e-12, atol=1e-14)


def test_jnp_calls_stay_shared_jaxprs_through_the_trace_and_the_localiser():
  """A jnp function called at the same shapes in every layer is one jaxpr, in the trace and once localised.

  That sharing is what lets JAX's linearization cache hit when the per-device map differentiates the
  traced loss, as it hits when the user's own jit differentiates the Python code (trace time of deep
  listed models: the bench's compile-time table). Inlined while tracing, as JAX stages a jnp call by
  default, every layer would be differentiated equation by equation.
  """
  mesh = make_mesh((8,), ("data",))

  def loss(params, batch):
    x = batch["x"]
    for w in params:
      x = jnp.tanh(x @ w)
    return jnp.mean(x**2)

  params = [jnp.ones((3, 3)) for _ in range(4)]
  prog = _program.trace(loss, (params, {"x": jnp.ones((2, 3))}), mesh=mesh, data_axes=("data",), batch_argnums=(1,))
  inside = mesh.abstract_mesh.update_axis_types({"data": AxisType.Manual})
  local = _program.localise(prog.closed, inside, ("data",), prog.at)
  for closed in (prog.closed, local):
    calls = [e.params["jaxpr"] for e in closed.jaxpr.eqns if e.primitive.name == "jit"]
    by_name = {}
    for e in closed.jaxpr.eqns:
      if e.primitive.name == "jit":
        by_name.setdefault(e.params["name"], set()).add(id(e.params["jaxpr"]))
    assert len(calls) >= 8, [e.primitive.name for e in closed.jaxpr.eqns]
    # Layers 2-4 see the same shapes and types: one jaxpr each for matmul and tanh (the first layer reads the
    # batch argument itself, typed as the rows are).
    assert len(by_name["matmul"]) <= 2 and len(by_name["tanh"]) <= 2, by_name
  assert [e.primitive.name for e in local.jaxpr.eqns] == [e.primitive.name for e in prog.closed.jaxpr.eqns]


def test_keeping_jnp_calls_leaves_the_users_own_traces_as_jax_makes_them():
  """Only the trace the loss runs in keeps its jnp calls: what jit's trace cache stores for a jnp function traced
  during it (its body, with its own nested jnp calls) is what JAX stores anywhere, so the user's later traces of
  the same functions at the same shapes inline everything, as JAX does; another thread tracing meanwhile too."""
  import threading

  from jaxaccum import _jax_private

  x = jnp.ones((3, 7))
  seen = {}

  def loss(x):
    other = threading.Thread(target=lambda: seen.update(other=jax.make_jaxpr(lambda y: jnp.mean(jnp.sin(y)))(x)))
    other.start()
    other.join()
    return jnp.mean(jnp.tanh(x) @ x.T)

  kept = jax.make_jaxpr(_jax_private.jnp_calls_kept(loss))(x)
  names = [e.params["name"] for e in kept.jaxpr.eqns if e.primitive.name == "jit"]
  assert "tanh" in names and "_mean" in names, kept
  # Inside `_mean`'s body, its own nested call (`_reduce_sum`) was inlined, as JAX stages it everywhere.
  mean = next(e for e in kept.jaxpr.eqns if e.primitive.name == "jit" and e.params["name"] == "_mean")
  assert "jit" not in _program.primitives(jex_core.ClosedJaxpr(mean.params["jaxpr"].jaxpr, ()))
  after = jax.make_jaxpr(lambda y: jnp.mean(jnp.tanh(y) @ y.T))(x)
  assert "jit" not in _program.primitives(after), after
  assert "jit" not in _program.primitives(seen["other"]), seen["other"]
