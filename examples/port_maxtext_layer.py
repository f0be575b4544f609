"""A MaxText decoder, reduced to CPU size, with its sharding annotations active on a (data, model) mesh.

  python examples/port_maxtext_layer.py --x64     # 8 simulated CPU devices, prints differences and counts

Where it comes from. google/maxtext `MaxText/layers/linears.py` (`DenseGeneral`,
`MlpBlock`), `MaxText/layers/attentions.py` (`Attention`: query/key/value
projections to (heads, head_dim), dot-product attention, the output projection),
`MaxText/layers/models.py` (`DecoderLayer`: pre-norm attention and MLP with
residuals; `Decoder`: token embedding, layers, final norm, logits),
`MaxText/layers/normalizations.py` (`RMSNorm`) and the `logical_axis_rules` of
`MaxText/configs/base.yml`, Apache-2.0, re-written here in a few lines each.
What is kept, as its authors write it: every parameter created through
`nn.with_logical_partitioning(init, kernel_axes)` with MaxText's logical names
("embed", "mlp", "heads", "kv", "vocab", "norm"); the activation annotations
`nn.with_logical_constraint(x, ("activation_batch", "activation_length",
"activation_embed"))` (and "activation_heads"/"activation_kv" on q, k, v,
"activation_mlp" in the MLP) at the same places; the rules entered with
`nn.logical_axis_rules(...)` around the model; parameters unboxed and placed by
`nn.logical_to_mesh_sharding` as MaxText's `setup_initial_state` does.

What changed (a user's reductions, each one listed):
- sizes: vocab 32, embed 16, 2 heads of 8, mlp 32, 2 layers, sequence 8
  (MaxText's defaults: 32000, 2048, 16 x 128, 7168, 16 layers, 2048);
- the mesh: (data=4, model=2) instead of MaxText's (data, fsdp, tensor, ...)
  axes; the rules map "activation_batch" to "data" and the model dimensions
  ("mlp", "heads", then "embed"; "activation_mlp", "activation_heads",
  "activation_embed") to "model", so every activation is sharded over both axes
  and the kernels are Megatron-style over "model";
- dropped: dropout (deterministic), quantization, rotary embeddings, the
  attention kernels other than plain dot-product ("dot_product" with a causal
  mask kept), decode/KV cache, scan over layers, remat policies, bias-free
  `DenseGeneral` options other than `axis`/`features`, packing/segment ids;
  logits from a separate "logits_dense" (MaxText's `logits_via_embedding=False`);
- dtype: float64 parameters and compute (`--x64`) for an exactness check;
- the loss: mean next-token cross-entropy over all tokens, `loss_fn(params,
  batch)` taking the batch as an argument (MaxText's `loss_fn(model, config,
  data, dropout_rng, params)`), no z-loss, no padding weights.

The check. Reference: `jax.value_and_grad` + `optax.adam` on the whole batch,
plain `jax.jit`, one device, no mesh (the annotations inactive), UPDATES updates.
Then (0) the same plain jit step on the mesh with the annotations active, and
through jaxaccum: (a) `ja.make_train_step(strategy="ddp")`, (b) `"fsdp"` (both
gather modes), K microbatches, on an Auto (data, model) mesh; (c) a user's own
`jax.jit` step with `ja.grad(loss_fn, axis_name="data")` and
`ja.accumulate(adam, K, axis_name="data")` fed K calls of B/K rows per update,
on `jax.make_mesh`'s default Explicit (data, model) mesh. Each must equal the
reference to <= 1e-10 (relative, float64); the script exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum as ja  # noqa: E402

VOCAB, EMBED, HEADS, HEAD_DIM, MLP, LAYERS, SEQ = 32, 16, 2, 8, 32, 2, 8
DATA, MODEL = 4, 2
B, K, UPDATES, LR = 16, 2, 2, 1e-2  # 16 rows = 4 data devices x K=2 microbatches x 2 rows
TOL = 1e-10

# MaxText's base.yml maps each logical name to mesh axes; reduced to a (data, model) mesh. Flax uses the first rule
# whose mesh axis is still free, so a kernel ("embed", "mlp") shards "mlp" and leaves "embed" whole (Megatron style).
RULES = (
  ("activation_batch", "data"),
  ("activation_length", None),
  ("activation_heads", "model"),
  ("activation_kv", None),
  ("activation_mlp", "model"),
  ("activation_embed", "model"),
  ("activation_vocab", "model"),
  ("mlp", "model"),
  ("heads", "model"),
  ("embed", "model"),
  ("kv", None),
  ("vocab", None),
  ("norm", None),
)
BLE = ("activation_batch", "activation_length", "activation_embed")
BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")


class DenseGeneral(nn.Module):
  """MaxText's DenseGeneral: a kernel over the contracted input axes x `features`, logically partitioned."""

  features: tuple[int, ...]
  kernel_axes: tuple[str, ...]
  axis: tuple[int, ...] = (-1,)
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    axis = tuple(a % x.ndim for a in self.axis)
    shape = tuple(x.shape[a] for a in axis) + self.features
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), self.kernel_axes)
    kernel = self.param("kernel", init, shape, self.dtype)
    return jax.lax.dot_general(x, kernel, ((axis, tuple(range(len(axis)))), ((), ())))


class RMSNorm(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],), self.dtype
    )
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


class Attention(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    proj = {
      n: DenseGeneral((HEADS, HEAD_DIM), ("embed", "heads", "kv"), dtype=self.dtype, name=n)(x)
      for n in ("query", "key", "value")
    }
    q, k, v = (nn.with_logical_constraint(proj[n], BLHD) for n in ("query", "key", "value"))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(HEAD_DIM).astype(self.dtype), k)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(self.dtype).min), axis=-1)
    out = nn.with_logical_constraint(jnp.einsum("bhqk,bkhd->bqhd", weights, v), BLHD)
    out = DenseGeneral((x.shape[-1],), ("heads", "kv", "embed"), axis=(-2, -1), dtype=self.dtype, name="out")(out)
    return nn.with_logical_constraint(out, BLE)


ACTIVATIONS = ("silu", "linear")  # MaxText's default `mlp_activations`; --activation relu gives ("relu",)


class MlpBlock(nn.Module):
  """MaxText's MlpBlock (not fused): one "wi_i" per activation, their product, then "wo"."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    acts = []
    for i, name in enumerate(ACTIVATIONS):
      h = DenseGeneral((MLP,), ("embed", "mlp"), dtype=self.dtype, name="wi" if len(ACTIVATIONS) == 1 else f"wi_{i}")(x)
      acts.append(h if name == "linear" else getattr(nn, name)(h))
    h = acts[0] if len(acts) == 1 else acts[0] * acts[1]
    h = nn.with_logical_constraint(h, ("activation_batch", "activation_length", "activation_mlp"))
    return DenseGeneral((x.shape[-1],), ("mlp", "embed"), dtype=self.dtype, name="wo")(h)


class DecoderLayer(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.with_logical_constraint(x, BLE)
    h = nn.with_logical_constraint(RMSNorm(self.dtype, name="pre_self_attention_norm")(x), BLE)
    x = x + Attention(self.dtype, name="self_attention")(h)
    h = nn.with_logical_constraint(RMSNorm(self.dtype, name="post_self_attention_norm")(x), BLE)
    return nn.with_logical_constraint(x + MlpBlock(self.dtype, name="mlp")(h), BLE)


class Decoder(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
    table = self.param("token_embedder", init, (VOCAB, EMBED), self.dtype)
    x = nn.with_logical_constraint(jnp.take(table, tokens, axis=0), BLE)
    for i in range(LAYERS):
      x = DecoderLayer(self.dtype, name=f"layers_{i}")(x)
    x = nn.with_logical_constraint(RMSNorm(self.dtype, name="decoder_norm")(x), BLE)
    logits = DenseGeneral((VOCAB,), ("embed", "vocab"), dtype=self.dtype, name="logits_dense")(x)
    return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))


def make_loss(model):
  def loss_fn(params, batch):
    """Mean next-token cross-entropy; the rules entered around the model, as MaxText enters them around its step."""
    with nn.logical_axis_rules(RULES):
      logits = model.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return loss_fn


def make_batches(seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(UPDATES):
    seq = rng.integers(0, VOCAB, (B, SEQ + 1))
    out.append({"inputs": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32)})
  return out


def init_params(model, dtype):
  """Unboxed parameters on the host, and their logical partition specs (MaxText: `get_abstract_state`)."""
  boxed = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
  return jax.device_get(nn.meta.unbox(boxed))["params"], nn.get_partition_spec(boxed)["params"]


def place(params, specs, mesh):
  """Parameters sharded over "model" per the logical rules (MaxText: `nn.logical_to_mesh_sharding`)."""
  return jax.device_put(params, nn.logical_to_mesh_sharding(specs, mesh, RULES))


def max_rel(a, b):
  """Largest |a - b| over every leaf, relative to the leaf's largest magnitude."""

  def rel(x, y):
    x, y = np.asarray(x), np.asarray(y)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(x)), np.max(np.abs(y))))

  return max(jax.tree.leaves(jax.tree.map(rel, a, b)))


def loss_diff(losses, ref):
  return max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))


def constraints(lowered):
  """Sharding constraints left in a lowered step that name the model axis: the annotations are active."""
  text = lowered.as_text()
  return sum(1 for line in text.splitlines() if "sharding_constraint" in line and '"model"' in line)


def plain_step(loss_fn, opt):
  """The plain full-batch step, written as the user would: jax.value_and_grad + optax under jax.jit."""

  @jax.jit
  def step(params, opt_state, batch):
    loss, g = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def reference(loss_fn, params, batches, opt):
  """The plain step on the whole batch, plain jit, one device, no mesh."""
  opt_state, step = opt.init(params), plain_step(loss_fn, opt)
  losses = []
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  return jax.device_get(params), losses


def plain_on_mesh(loss_fn, params, specs, batches, opt, mesh):
  """(0) The same plain jit step on the mesh, under `jax.set_mesh`: here the annotations are active."""
  with jax.set_mesh(mesh):
    params = place(params, specs, mesh)
    opt_state, step = opt.init(params), plain_step(loss_fn, opt)
    rows = NamedSharding(mesh, P("data"))
    first = jax.device_put(batches[0], rows)
    n = constraints(step.lower(params, opt_state, first))
    losses = []
    for batch in batches:
      params, opt_state, loss = step(params, opt_state, jax.device_put(batch, rows))
      losses.append(float(loss))
  return jax.device_get(params), losses, n


def via_train_step(loss_fn, params, specs, batches, opt, mesh, strategy, fsdp_gather=None, k=K):
  """(a), (b): ja.make_train_step on the (data, model) mesh; the parameters keep their "model" sharding."""
  params, opt_state = ja.shard_train_state(place(params, specs, mesh), opt, mesh, strategy=strategy)
  step = ja.make_train_step(loss_fn, opt, num_microbatches=k, mesh=mesh, strategy=strategy, fsdp_gather=fsdp_gather)
  lowered = step.lower(params, opt_state, ja.shard_batch(batches[0], mesh))
  n, compiled = constraints(lowered), lowered.compile()
  losses = []
  for batch in batches:
    params, opt_state, metrics = step(params, opt_state, ja.shard_batch(batch, mesh))
    losses.append(float(metrics["loss"]))
  return jax.device_get(params), losses, n, compiled


# Inside a shard_map manual over "data" the data axis is split already: JAX refuses a constraint that names it, so the
# user's rules there map "activation_batch" to None (what ja.grad and make_train_step do for the user by rewriting).
RULES_PER_DEVICE = tuple((name, None if axis == "data" else axis) for name, axis in RULES)


def via_own_shard_map(model, params, specs, batches, opt, mesh):
  """(c) The user's own jax.jit step: jax.shard_map manual over "data" only ("model" stays Auto, the tensor-parallel
  annotations active), jax.grad on each device's rows, ja.accumulate(adam, K, axis_name="data") inside, K calls of
  B/K rows per update. The recipe of docs/guides/accumulate.md ("The shard_map pitfall"): ja.grad refuses this mesh.
  """
  tx = ja.accumulate(opt, K, axis_name="data")
  n = mesh.shape["data"]

  def loss_per_device(params, batch):
    with nn.logical_axis_rules(RULES_PER_DEVICE):
      logits = model.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  def per_device(state, f):
    return state._replace(
      acc_grads=jax.tree.map(f, state.acc_grads), acc_weight=f(state.acc_weight), num_skipped=f(state.num_skipped)
    )

  def body(params, state, batch):
    state = per_device(state, lambda a: a[0])
    loss, grads = jax.value_and_grad(loss_per_device)(jax.lax.pcast(params, "data", to="varying"), batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), per_device(state, lambda a: a[None]), jax.lax.pmean(loss, "data")

  with jax.set_mesh(mesh):
    params = place(params, specs, mesh)
    state = per_device(tx.init(params), lambda a: jnp.stack([a] * n))
    spec = per_device(jax.tree.map(lambda _: P(), state), lambda _: P("data"))
    step = jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec, P()), axis_names={"data"})
    )
    rows = NamedSharding(mesh, P("data"))
    part0 = jax.tree.map(lambda a: jax.device_put(a[: B // K], rows), batches[0])
    lowered = step.lower(params, state, part0)
    n_constraints, compiled = constraints(lowered), lowered.compile()
    losses = []
    for batch in batches:
      window = []
      for i in range(K):
        part = jax.tree.map(lambda a, i=i: jax.device_put(a[i * B // K : (i + 1) * B // K], rows), batch)
        params, state, loss = step(params, state, part)
        window.append(float(loss))
      losses.append(float(np.mean(window)))
  return jax.device_get(params), losses, n_constraints, compiled


def own_jit_ja_grad(loss_fn, params, specs, batch, opt, mesh):
  """The own-jit path the brief asks for, ja.grad + ja.accumulate(axis_name="data"): its error on this mesh, or None."""
  tx = ja.accumulate(opt, K, axis_name="data")
  try:
    with jax.set_mesh(mesh):
      params = place(params, specs, mesh)
      state = tx.init(params)

      @jax.jit
      def step(params, state, batch):
        grads = ja.grad(loss_fn, axis_name="data")(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

      step(params, state, jax.device_put(batch, NamedSharding(mesh, P("data"))))
  except Exception as e:  # noqa: BLE001 -- shown to the user, as they would see it
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  return None


def collectives_by_axis(compiled, mesh, branches="all"):
  """Collectives per step by the mesh axes each one's replica groups span: `ja.count_collectives(by_axis=True)`."""
  return ja.count_collectives(compiled, branches=branches, by_axis=True, mesh=mesh)


def count_only(loss_fn, params, specs, batch, opt, mesh, k):
  """ddp's collectives per step by mesh axis at K microbatches (compiled, not run)."""
  params, opt_state = ja.shard_train_state(place(params, specs, mesh), opt, mesh, strategy="ddp")
  step = ja.make_train_step(loss_fn, opt, num_microbatches=k, mesh=mesh, strategy="ddp")
  return collectives_by_axis(step.lower(params, opt_state, ja.shard_batch(batch, mesh)).compile(), mesh)


def explicit_attempts(loss_fn, params, specs, batches, opt):
  """jax.make_mesh's default Explicit axes: what happens to the plain step and to make_train_step (first lines)."""
  mesh = jax.make_mesh((DATA, MODEL), ("data", "model"))
  out = {}
  for name, run in (
    ("plain jit (no jaxaccum)", lambda: plain_on_mesh(loss_fn, params, specs, batches[:1], opt, mesh)),
    ("make_train_step ddp", lambda: via_train_step(loss_fn, params, specs, batches[:1], opt, mesh, "ddp")),
  ):
    try:
      run()
      out[name] = "ran"
    except Exception as e:  # noqa: BLE001 -- shown as the user sees it
      out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
  out["ja.grad + ja.accumulate"] = own_jit_ja_grad(loss_fn, params, specs, batches[0], opt, mesh) or "ran"
  return out


def main():
  global ACTIVATIONS
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--x64", action="store_true", help="float64 (the exactness check needs it)")
  parser.add_argument("--activation", default="silu", choices=("silu", "relu"), help="relu: jax.nn.relu (see README)")
  parser.add_argument("--no-explicit", action="store_true", help="skip the Explicit-mesh attempts")
  args = parser.parse_args()
  if args.activation == "relu":
    ACTIVATIONS = ("relu",)
  jax.config.update("jax_enable_x64", args.x64)
  dtype, tol = (jnp.float64, TOL) if args.x64 else (jnp.float32, 1e-4)

  model = Decoder(dtype)
  loss_fn, opt, batches = make_loss(model), optax.adam(LR), make_batches(0)
  params, specs = init_params(model, dtype)
  mesh = jax.make_mesh((DATA, MODEL), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
  ref, ref_losses = reference(loss_fn, params, batches, opt)
  print(f"reference (plain jit, one device): losses {[round(x, 6) for x in ref_losses]}")
  worst, failed = 0.0, []

  def report(name, run):
    nonlocal worst
    try:
      p, losses, n, *rest = run()
    except Exception as e:  # noqa: BLE001 -- every path is tried; the exit status says if one failed
      print(f"{name:<34}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
      failed.append(name)
      return None
    d, dl = max_rel(p, ref), loss_diff(losses, ref_losses)
    worst = max(worst, d, dl)
    print(f"{name:<34}: params rel diff {d:.2e}, loss rel diff {dl:.2e}, {n} constraints naming 'model'")
    return rest[0] if rest else None

  report("(0) plain jit on the mesh", lambda: plain_on_mesh(loss_fn, params, specs, batches, opt, mesh))
  for strategy, gather in (("ddp", None), ("fsdp", "per_microbatch"), ("fsdp", "once")):
    name = f"(a/b) make_train_step {strategy} {gather or ''}".rstrip()
    compiled = report(
      name, lambda s=strategy, g=gather: via_train_step(loss_fn, params, specs, batches, opt, mesh, s, g)
    )
    if compiled is not None:
      print(f"    collectives per step by axis (K={K}): {collectives_by_axis(compiled, mesh)}")
  grad_reductions = {}
  for k in (1, 2, 4):
    try:
      by_axis = count_only(loss_fn, params, specs, batches[0], opt, mesh, k)
    except Exception as e:  # noqa: BLE001
      print(f"ddp K={k}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
      failed.append(f"ddp K={k} count")
      continue
    grad_reductions[k] = by_axis.get("data", {})
    print(f"ddp K={k}: over 'data' {grad_reductions[k]}, over 'model' {by_axis.get('model', {})}")
  if any(v != {"all-reduce": 1} for v in grad_reductions.values()):
    failed.append("one gradient reduction per update")
  compiled = report(
    "(c) own jit: shard_map + accumulate", lambda: via_own_shard_map(model, params, specs, batches, opt, mesh)
  )
  if compiled is not None:
    every, window = collectives_by_axis(compiled, mesh, "none"), collectives_by_axis(compiled, mesh)
    print(f"    per call by axis {every}; with the window-end branch {window}")
  print(f"ja.grad + ja.accumulate on the Auto mesh: {own_jit_ja_grad(loss_fn, params, specs, batches[0], opt, mesh)}")
  if not args.no_explicit:
    for name, what in explicit_attempts(loss_fn, params, specs, batches, opt).items():
      print(f"Explicit (data, model) mesh, {name}: {what}")
  moved = max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), ref, params)))
  print(f"(the updates moved a parameter by up to {moved:.2e})")
  if failed or worst > tol:
    print(f"FAILED: worst rel diff {worst:.2e} (tolerance {tol:.0e}); failed: {failed}")
    sys.exit(1)
  print(f"OK: worst rel diff {worst:.2e} <= {tol:.0e}")


if __name__ == "__main__":
  main()
