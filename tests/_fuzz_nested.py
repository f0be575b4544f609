"""Seeded random programs with what the first fuzzer (tests/_fuzz_programs.py) missed (issue 38).

`program_nested(seed, mesh)` builds on `_fuzz_programs._Gen` (its weights: a
leaf and 0-3 transforms reading constants of every kind) with layers of

- linear algebra in the parameters: `jnp.linalg.solve`, `jnp.linalg.cholesky`
  (of `W W^T / 4 + I`, then a triangular solve or `cho_solve`),
  `jnp.linalg.eigh` (of `diag(0..7) + 0.2 sym(W)`: eigenvalues at least ~0.5
  apart; eigenvalues only, or gauge-invariant functions of the eigenvectors:
  `V f(L) V^T`, a spectral projector), `lax.custom_linear_solve`;
- sharding annotations (`annotate`: `with_sharding_constraint` on Auto meshes,
  `jax.sharding.reshard` on Explicit ones, over "data", `P()` or unconstrained)
  inside a `jax.custom_vjp`'s primal and fwd (with and without
  `optimize_remat`), inside `jax.vmap` (over the rows or over stacked
  weights), on a `lax.while_loop`'s carry and a `fori_loop`'s, inside
  `lax.cond`'s branches, on a weight;
- closures over arrays placed on the mesh (`jax.device_put` replicated,
  `P()`, or sharded over "data" on a dimension of 8) where the first fuzzer
  closes over a plain `jnp` array.

Every layer is row-wise (no reduction over the rows: a `cond`'s predicate
reads parameters or constants), so the full-batch loss is the mean of any
split's: the reference is plain `jax.grad` on the whole batch in the user's
own jit on the same mesh. Seeds draw the same program on every mesh (only
the placement of the closures and the annotations' form depend on it).

Not generated, because JAX itself refuses them in the same setting:
- a `lax.while_loop` whose carry depends on the parameters (JAX has no
  reverse mode for it): the carry starts from `stop_gradient(h)`;
- an annotation that changes a loop carry's or a cond branch's type on an
  Explicit mesh (`reshard(h, P())` of rows split over "data": "carry input and
  carry output must have equal types"): there only type-preserving ones;
- `P.UNCONSTRAINED` on an Explicit mesh ("cannot contain P.UNCONSTRAINED when
  no mesh axis_types are Auto"), `reshard` on an Auto one ("cannot contain axis
  names that are of type Auto");
- a closure over an array sharded over "data" on an Explicit mesh, used as is:
  a user's own `jax.shard_map` refuses it ("Closing over inputs to shard_map
  where the input is sharded on `Explicit` axes is not implemented",
  tests/test_fuzz_nested.py shows it), and so does jaxaccum, by name. It is
  used as Explicit-sharding code uses a sharded table: `reshard(t, P())`;
- in a custom_vjp's bwd, an annotation naming "data" or unconstrained: in a
  user's own shard_map JAX traces the bwd per device, where every axis is
  manual, and refuses both; jaxaccum traces a bwd outside its map and localises
  it (tests/test_program.py covers those). The generator's bwd annotates
  replicated, or not at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from _fuzz_programs import DEPTH, D, Program, _Gen, draw_layers
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

HOWS = ("rows", "rep", "free")  # an annotation on rows (rows, D): over "data", replicated, unconstrained


def explicit() -> bool:
  """Whether the context mesh (where the loss is traced) has Explicit axes."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and AxisType.Explicit in mesh.axis_types


def annotate(x, how: str, keep_type: bool = False, in_rows: bool = False):
  """A sharding annotation of `x` as model code writes it for the global batch, on the context mesh.

  how: "rows" (its leading dimension over "data"), "rep" (replicated), "free" (unconstrained), "feat" (its last
  dimension over "data"), "round" (its leading dimension over "data"). On an Auto mesh a
  `with_sharding_constraint`. On an Explicit one (where it is an assert) `reshard`: "free" asserts the type
  `x` has; "feat" and "round" shard and gather again (a weight sharded by hand; "feat" of a row inside a
  vmap over the rows, which are over "data" already, replicates it); with `keep_type` (a loop's carry, a
  cond's branch) every one keeps the type `x` has.
  """
  nd = jnp.ndim(x)
  if not explicit():
    spec = {
      "rows": P("data", *[None] * (nd - 1)),
      "rep": P(),
      "free": P(*[P.UNCONSTRAINED] * nd),
      "feat": P(*[None] * (nd - 1), "data"),
      "round": P("data", *[None] * (nd - 1)),
    }[how]
    return lax.with_sharding_constraint(x, spec)
  typed = jax.typeof(x).sharding.spec
  if how == "free":
    return lax.with_sharding_constraint(x, typed)  # an assert of its own type
  if keep_type:
    return jax.sharding.reshard(x, typed)
  if how == "feat" and in_rows:
    how = "rep"
  if how in ("feat", "round"):
    split = P(*[None] * (nd - 1), "data") if how == "feat" else P("data", *[None] * (nd - 1))
    return jax.sharding.reshard(jax.sharding.reshard(x, split), P())
  if how == "rows":
    return jax.sharding.reshard(x, P("data", *[None] * (nd - 1)))
  return jax.sharding.reshard(x, P())


def gathered(t):
  """A closed-over table placed sharded over "data": used as is on an Auto mesh, `reshard(t, P())` on an Explicit
  one (where a shard_map refuses the closure, see the module docstring)."""
  return jax.sharding.reshard(t, P()) if explicit() else t


def _dense_vjp(how: str, remat: bool, bhow: str | None):
  """A dense layer as a custom_vjp whose primal and fwd annotate their output (rows); its bwd annotates the
  cotangents with `bhow` (one naming no axis: see the module docstring)."""
  ann = lambda v: annotate(v, how)

  def bwd(res, g):
    x, w = res
    gx = g @ w.T
    if explicit():  # JAX checks the cotangent's type against the primal's (the fwd may have resharded the rows)
      gx = jax.sharding.reshard(gx, jax.typeof(x).sharding.spec)
    # The weight's cotangent contracts the rows (over "data" on an Explicit mesh): replicated, as conftest's
    # remat_dense writes it.
    gw = jnp.einsum("bi,bo->io", x, g, out_sharding=P())
    if bhow is not None:
      gx, gw = annotate(gx, bhow, keep_type=True), annotate(gw, bhow)
    return gx, gw

  f = jax.custom_vjp(lambda x, w: ann(x @ w))
  f.defvjp(lambda x, w: (ann(x @ w), (x, w)), bwd, optimize_remat=remat)
  return f


class _Nested(_Gen):
  def __init__(self, seed: int, mesh=None):
    super().__init__(seed)
    self.mesh = mesh

  # ------------------------------------------------------------------ constants: some placed on the mesh
  def const(self, shape, kinds=None) -> tuple[Callable[[], Any], str]:
    get, label = super().const(shape, kinds)
    if not label.startswith("jnp"):
      return get, label
    # A closed-over jax Array: placed on the mesh, replicated or sharded over "data" on a dimension of 8.
    place = self.py.choice(["plain", "rep", "rep", "shard", "shard"])
    dims = [i for i, n in enumerate(shape) if n % 8 == 0]
    if place == "plain" or self.mesh is None or (place == "shard" and not dims):
      return get, label
    value = get()
    if place == "rep":
      t = jax.device_put(value, NamedSharding(self.mesh, P()))
      return (lambda: t), f"placed(P()){label[3:]}"
    d = dims[-1]
    t = jax.device_put(value, NamedSharding(self.mesh, P(*[None] * d, "data")))
    return (lambda: gathered(t)), f"placed(dim {d} over data){label[3:]}"

  def placed(self, shape) -> tuple[Callable[[], Any], str]:
    """A closed-over constant placed on the mesh (when there is one)."""
    return self.const(shape, ["jnp"])

  # ------------------------------------------------------------------ weights: annotated transforms too
  def transform(self, depth=0) -> tuple[Callable, str]:
    t = self.py.choice(["old", "old", "old", "ann", "vmap_ann", "cond_ann"])
    if t == "old":
      return super().transform(depth)
    how = self.py.choice(["feat", "rep", "free", "round"])
    if t == "ann":
      return (lambda w: annotate(w, how)), f"annotate(w, {how})"
    if t == "vmap_ann":  # each row of the weight annotated inside a vmap
      c, lab = self.placed((D,))
      return (
        lambda w: jax.vmap(lambda r: annotate(r * c(), "rep" if how == "round" else how))(w)
      ), f"vmap(annotate(r * {lab}, {how}))(w)"
    pred = np.bool_(self.py.random() < 0.5)
    return (
      lambda w: lax.cond(pred, lambda w: annotate(w * 0.5, how), lambda w: annotate(w.T, how), w)
    ), f"cond({pred}, annotate(w / 2, {how}), annotate(w.T, {how}))"

  # ------------------------------------------------------------------ linear algebra of a weight
  def spd(self) -> tuple[Callable, str]:
    """A well-conditioned SPD matrix from a weight: W W^T / 4 + I."""
    w, lab = self.weight()
    return (lambda p: w(p) @ w(p).T / 4 + jnp.eye(D)), f"[{lab}][{lab}]^T / 4 + I"

  def linalg_layer(self, kind, act) -> tuple[Callable, str]:
    if kind == "solve":
      a, lab = self.spd()
      if self.py.random() < 0.5:
        return (lambda p, h: act(jnp.linalg.solve(a(p), h.T).T)), f"act(solve({lab}, h^T)^T)"
      b, blab = self.bias()
      return (lambda p, h: act(h + jnp.linalg.solve(a(p), jnp.ones(D) + b(p)))), f"act(h + solve({lab}, 1 + {blab}))"
    if kind == "cholesky":
      a, lab = self.spd()
      how = self.py.choice(["mul", "tri", "cho"])
      if how == "mul":
        return (lambda p, h: act(h @ jnp.linalg.cholesky(a(p)) / 2)), f"act(h @ cholesky({lab}) / 2)"
      if how == "tri":
        return (
          lambda p, h: act(jsl.solve_triangular(jnp.linalg.cholesky(a(p)), h.T, lower=True).T)
        ), f"act(solve_triangular(cholesky({lab}), h^T)^T)"
      return (
        lambda p, h: act(jsl.cho_solve((jnp.linalg.cholesky(a(p)), True), h.T).T)
      ), f"act(cho_solve(cholesky({lab}), h^T)^T)"
    if kind == "eigh":
      w, lab = self.weight()
      sym = lambda p: jnp.diag(jnp.arange(D, dtype=jnp.float64)) + 0.1 * (w(p) + w(p).T)
      how = self.py.choice(["values", "fun", "proj"])
      if how == "values":
        return (lambda p, h: act(h * jnp.linalg.eigh(sym(p))[0] / D)), f"act(h * eigvalsh(sym[{lab}]) / 8)"
      if how == "fun":

        def fun(p, h):
          lam, v = jnp.linalg.eigh(sym(p))
          return act(h @ (v * jnp.tanh(lam / D)) @ v.T)

        return fun, f"act(h @ V tanh(L / 8) V^T of sym[{lab}])"
      k = self.py.randrange(1, D)

      def proj(p, h):
        v = jnp.linalg.eigh(sym(p))[1][:, :k]
        return act(h + h @ v @ v.T)

      return proj, f"act(h + h @ projector onto {k} eigenvectors of sym[{lab}])"
    # custom_linear_solve: A x = h (each row), A SPD, the matvec annotated or not
    a, lab = self.spd()
    how = self.py.choice(["none", "rows", "free"])
    symmetric = self.py.random() < 0.5

    def solved(p, h):
      m = a(p)
      mv = lambda v: v @ m.T if how == "none" else annotate(v @ m.T, how)
      sol = lambda _, b: jnp.linalg.solve(m, b.T).T
      return act(lax.custom_linear_solve(mv, h, sol, sol, symmetric=symmetric))

    return solved, f"act(custom_linear_solve(x @ ({lab})^T annotated {how}, h, symmetric={symmetric}))"

  # ------------------------------------------------------------------ layers: (p, h) -> h
  def layer(self) -> tuple[Callable, str]:
    kind = self.py.choice(
      ["dense", "solve", "cholesky", "eigh", "linsolve", "cvjp", "cvjp", "vmap_rows", "vmap_stack", "while",
       "fori", "cond", "cond"]
    )  # fmt: skip
    act = self.py.choice([jnp.tanh, jnp.sin])
    if kind in ("solve", "cholesky", "eigh", "linsolve"):
      return self.linalg_layer(kind, act)
    how = self.py.choice(HOWS)
    if kind == "vmap_stack":  # vmap over stacked weights, each annotated
      n = self.leaf((DEPTH, D, D))
      c, lab = self.placed((D, D))
      whow = self.py.choice(["feat", "rep", "free"])
      return (
        lambda p, h: jax.vmap(lambda lw: annotate(act(h @ annotate(lw * c(), whow)), how))(p[n]).mean(0)
      ), f"vmap(annotate(act(h @ annotate(layer * {lab}, {whow})), {how}))({n}).mean(0)"
    w, wlab = self.weight()
    if kind == "dense":
      b, blab = self.bias()
      return (lambda p, h: annotate(act(h @ w(p) + b(p)), how)), f"annotate(act(h @ [{wlab}] + {blab}), {how})"
    if kind == "cvjp":
      remat = self.py.random() < 0.5
      bhow = self.py.choice([None, "rep"])  # not "free": see the module docstring
      dense = _dense_vjp(how, remat, bhow)
      return (
        lambda p, h: act(dense(h, w(p)))
      ), f"act(custom_vjp(remat={remat}) annotate(h @ [{wlab}], {how}), bwd annotated {bhow})"
    if kind == "vmap_rows":  # each row annotated inside a vmap over the rows
      rhow = self.py.choice(["feat", "rep", "free"])
      return (
        lambda p, h: jax.vmap(lambda r: annotate(act(r @ w(p)), rhow, in_rows=True))(h)
      ), f"vmap(annotate(act(row @ [{wlab}]), {rhow}))(h)"
    if kind == "while":  # the carry: rows from stop_gradient(h) (no reverse mode through a while_loop otherwise)
      c, lab = self.placed((D, D))
      n = self.py.randrange(1, 4)

      def body(carry):
        i, v = carry
        return i + 1, annotate(0.5 * v + 0.1 * jnp.sin(v @ c()), how, keep_type=True)

      def looped(p, h):
        v = lax.while_loop(lambda carry: carry[0] < n, body, (0, lax.stop_gradient(h)))[1]
        return act(h @ w(p)) + 0.1 * v

      body_lab = f"annotate(v/2 + sin(v @ {lab}), {how})"
      return looped, f"act(h @ [{wlab}]) + 0.1 while({n}, carry=stop_gradient(h): {body_lab})"
    if kind == "fori":  # a static trip count (a scan): the carry (from the parameters) annotated
      c, lab = self.placed((D,))
      return (
        lambda p, h: lax.fori_loop(0, 2, lambda i, h: annotate(act(h @ w(p) / 2 + c()), how, keep_type=True), h)
      ), f"fori_loop(2, annotate(act(h @ [{wlab}] / 2 + {lab}), {how}))"
    # cond: a predicate of the parameters (the same on every device and microbatch), each branch annotated
    w2, lab2 = self.weight()
    how2 = self.py.choice(HOWS)
    leaf = self.py.choice(list(self.params))
    return (
      lambda p, h: lax.cond(
        jnp.sum(p[leaf]) > 0,
        lambda h: annotate(act(h @ w(p)), how, keep_type=True),
        lambda h: annotate(0.5 * (h @ w2(p)), how2, keep_type=True),
        h,
      )
    ), f"cond(sum({leaf}) > 0, annotate(act(h @ [{wlab}]), {how}), annotate(h @ [{lab2}] / 2, {how2}))"


def program_nested(seed: int, mesh=None, layers: int | None = None) -> Program:
  """The seeded random program number `seed` of this generator, its closures placed on `mesh`."""
  g = _Nested(seed, mesh)
  fns = draw_layers(g, layers)

  def apply(p, x):
    h = x
    for f in fns:
      h = f(p, h)
    return h

  return Program(seed, g.params, g.dims, apply, tuple(g.ops))


# ---------------------------------------------------------------------------------------------- the harness
K = 2  # microbatches per device: 32 rows, 2 per microbatch
RUNS = {  # name -> (make_train_step kwargs, hsdp's (2, 4) mesh)
  "ddp": ({"strategy": "ddp"}, False),
  "zero1": ({"strategy": "zero1"}, False),
  "fsdp": ({"strategy": "fsdp", "fsdp_gather": "per_microbatch"}, False),
  "fsdp_once": ({"strategy": "fsdp", "fsdp_gather": "once"}, False),
  "hsdp": ({"strategy": "hsdp"}, True),
}


def mesh_for(kind: str, hsdp: bool = False):
  """The 8 devices as ("data",), or (2, 4) ("replica", "data") for hsdp; `kind`: "auto" or "explicit"."""
  shape, names = ((2, 4), ("replica", "data")) if hsdp else ((8,), ("data",))
  types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types, devices=jax.devices()[:8])


def reference_grad(loss, params, x, y, mesh):
  """Plain jax.grad of the full-batch loss in the user's own jit on `mesh`, the rows over its axes."""
  with jax.set_mesh(mesh):
    rows = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    return jax.device_get(jax.jit(jax.grad(loss))(p, jax.device_put(x, rows), jax.device_put(y, rows)))


def _keep_grads():
  """An optimizer whose state after one update is the gradient it was given (no update)."""
  import optax

  zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
  return optax.GradientTransformation(zeros, lambda g, s, p=None: (zeros(g), g))


def step_grad(loss, params, x, y, mesh, run: str):
  """The gradient make_train_step (strategy `run`, K microbatches) reduces, read from its optimizer's state."""
  import jaxaccum as ja

  kwargs, _ = RUNS[run]
  axis = tuple(mesh.axis_names) if run == "hsdp" else "data"
  opt = _keep_grads()
  step = ja.make_train_step(
    lambda p, b: loss(p, *b), opt, num_microbatches=K, mesh=mesh, data_axis=axis, donate=False, **kwargs
  )
  with jax.set_mesh(mesh):
    p, s = ja.shard_train_state(params, opt, mesh, strategy=kwargs["strategy"], data_axis=axis)
    _, s, metrics = step(p, s, ja.shard_batch((x, y), mesh, axis))
  assert bool(metrics["applied"])
  return jax.device_get(s)


def ja_grad(loss, params, x, y, mesh):
  """ja.grad(loss, axis_name="data") in the user's own jit on an Explicit mesh, reduced by hand."""
  import jaxaccum as ja

  with jax.set_mesh(mesh):
    rows = NamedSharding(mesh, P("data"))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    fn = jax.jit(lambda q, x, y: jax.reshard(ja.grad(loss, axis_name="data")(q, x, y), P()))
    return jax.device_get(fn(p, jax.device_put(x, rows), jax.device_put(y, rows)))


def errors(programs: list[Program], run: Callable, mesh, seed: int = 0, tol: float = 1e-10) -> list[str]:
  """`run(loss, params, x, y, mesh)` against `reference_grad` for the programs together; on an exception or a
  mismatch, one by one. A line per failing program."""
  from _fuzz_programs import combined, data, leaf_errors, one_by_one

  x, y = data(seed)

  def check(progs) -> list[str]:
    params, _, loss = combined(progs)
    try:
      want = reference_grad(loss, params, x, y, mesh)
    except Exception as e:  # noqa: BLE001  (a program plain JAX refuses: the generator's own bug)
      return [f"the reference raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"]
    try:
      got = run(loss, params, x, y, mesh)
    except Exception as e:  # noqa: BLE001  (reported with the program that raised it)
      return [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"]
    return leaf_errors(progs, got, want, tol)

  return one_by_one(check, programs)
