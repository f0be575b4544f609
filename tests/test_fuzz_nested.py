"""The nested-transform fuzzer (tests/_fuzz_nested.py, issue 38) through every strategy and ja.grad.

Seeded random programs with linear algebra in the parameters (solve, cholesky, eigh, custom_linear_solve),
sharding annotations inside custom_vjp, vmap, while_loop/fori_loop carries and cond branches, and closures
over arrays placed on the mesh, each through `make_train_step` (ddp, zero1, fsdp per microbatch and once,
hsdp on (2, 4)) on Auto and Explicit meshes and through `ja.grad(loss, axis_name="data")` in the user's own
jit on an Explicit mesh: the gradient (read from the optimizer's state) against plain `jax.grad` of the
full-batch loss in the user's own jit on the same mesh, float64, rtol 1e-10. A failure names each failing
program's seed and operations. Then what the generator leaves out because JAX itself refuses it per device.
"""

import functools

import _fuzz_nested as fz
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# (run, mesh kind): every strategy on Auto and Explicit meshes (hsdp on Auto: on Explicit its rows are split
# over ("replica", "data"), and a loop carry annotated over "data" alone changes its type), ja.grad on Explicit.
CELLS = [(run, kind) for run in fz.RUNS for kind in ("auto", "explicit") if (run, kind) != ("hsdp", "explicit")]
CELLS += [("ja.grad", "explicit")]
COMMON = range(6, 26)  # 20 programs through every cell
OWN = 40  # and 40 programs of each cell's own (seeds 1000 + 40 i ...)


def _runner(run):
  return fz.ja_grad if run == "ja.grad" else functools.partial(_step, run=run)


def _step(loss, params, x, y, mesh, run):
  return fz.step_grad(loss, params, x, y, mesh, run)


def _errors(seeds, run, kind):
  mesh = fz.mesh_for(kind, hsdp=run == "hsdp")
  return fz.errors([fz.program_nested(s, mesh) for s in seeds], _runner(run), mesh)


def test_nested_small_set_through_fsdp_on_an_explicit_mesh_exact():
  """5 programs side by side (one compile): an annotated custom_vjp, cholesky, solve, custom_linear_solve, a
  while_loop and conds with annotated carries and branches, vmapped annotations, placed closures."""
  errs = _errors(range(5), "fsdp", "explicit")
  assert not errs, "\n".join(errs)


@pytest.mark.slow
@pytest.mark.parametrize(("run", "kind"), CELLS)
def test_nested_common_set_exact(run, kind):
  errs = _errors(COMMON, run, kind)
  assert not errs, "\n".join(errs)


@pytest.mark.slow
@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize(("run", "kind"), CELLS)
def test_nested_large_set_exact(run, kind, half):
  start = 1000 + OWN * CELLS.index((run, kind)) + half * OWN // 2
  errs = _errors(range(start, start + OWN // 2), run, kind)
  assert not errs, "\n".join(errs)


def test_the_generator_draws_every_kind_in_milliseconds_and_a_seed_means_one_program():
  """Every layer kind appears in the large set; a program builds in milliseconds; a seed draws the same program
  (parameters and operations, the closures' placement aside) with or without a mesh."""
  mesh = fz.mesh_for("explicit")
  seeds = range(1000, 1000 + OWN * len(CELLS))
  ops = " ".join(op for s in seeds for op in fz.program_nested(s).ops)
  for kind in ("solve(", "cholesky(", "solve_triangular", "cho_solve", "eigvalsh", "V tanh", "projector",
               "custom_linear_solve", "custom_vjp(remat=True", "custom_vjp(remat=False", "bwd annotated rep",
               "vmap(annotate", "while(", "fori_loop", "cond(sum", "annotate(w, round)"):  # fmt: skip
    assert kind in ops, kind
  built = [fz.program_nested(s, mesh) for s in range(40)]
  placed = " ".join(op for prog in built for op in prog.ops)
  assert "placed(P())" in placed and "over data)" in placed
  for prog in built:
    plain = fz.program_nested(prog.seed)
    assert len(plain.ops) == len(prog.ops)
    for name, v in prog.params.items():
      np.testing.assert_array_equal(v, plain.params[name])


# --------------------------------------------------------------------------- left out: JAX refuses them per device


def test_jax_refuses_a_closure_over_an_array_sharded_on_an_explicit_axis_in_a_shard_map():
  """A table placed over "data" on an Explicit mesh and read as is: fine in the user's own jit, "not implemented"
  in the user's own shard_map, and refused by name by make_train_step. The generator reshards it to P() first."""
  mesh = fz.mesh_for("explicit")
  table = jax.device_put(jnp.linspace(0.5, 1.5, 64).reshape(8, 8), NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    f = jax.shard_map(lambda x: x @ table, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(NotImplementedError, match="Closing over inputs to shard_map where the input is sharded on"):
      jax.jit(f)(jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data"))))
  loss = lambda p, b: jnp.mean((b[0] @ (p * table) - b[1]) ** 2)
  with pytest.raises(ValueError, match="make_train_step: the loss reads an array sharded over 'data' from the"):
    fz.step_grad(lambda p, x, y: loss(p, (x, y)), jnp.ones((8, 8)), jnp.ones((32, 8)), jnp.ones((32, 8)), mesh, "ddp")


def test_jax_refuses_an_unconstrained_annotation_where_every_axis_is_manual():
  """`with_sharding_constraint(x, P(P.UNCONSTRAINED, ...))` in a user's own shard_map manual over every axis, as a
  custom_vjp's bwd runs per device: JAX refuses it. The loss's own annotations are localised, a bwd rule's too
  where it traces outside the map (tests/test_program.py); the generator's bwd annotates replicated."""
  mesh = fz.mesh_for("auto")
  body = lambda x: jax.lax.with_sharding_constraint(x, P(P.UNCONSTRAINED, P.UNCONSTRAINED))
  f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  with pytest.raises(ValueError, match="cannot contain `P.UNCONSTRAINED` when no mesh axis_types are `Auto`"):
    jax.jit(f)(jnp.ones((16, 8)))


def test_the_harness_reads_back_the_gradient():
  """The harness's optimizer: its state after an update is the gradient it was given, its update zero."""
  opt = fz._keep_grads()
  g = {"a": jnp.arange(3.0)}
  updates, state = opt.update(g, opt.init(g))
  np.testing.assert_array_equal(state["a"], g["a"])
  assert not np.any(updates["a"])
