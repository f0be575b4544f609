"""Flax's VAE example, ported to `ja.make_train_step(strategy="fsdp")` and to `ja.grad` + `ja.accumulate`.

  python examples/port_fsdp_grad.py            # float64, 8 simulated CPU devices, prints the differences

Where it comes from. google/flax `examples/vae/models.py` (`Encoder`, `Decoder`,
`VAE`, `reparameterize`) and `examples/vae/train.py` (`kl_divergence`,
`binary_cross_entropy_with_logits`, the `train_step`'s `loss_fn`), Apache-2.0,
re-written here. The original: an MLP encoder to a Gaussian posterior (mean,
log-variance), a reparameterised sample `z = mean + eps * exp(logvar / 2)`,
an MLP decoder to Bernoulli logits; loss = mean BCE + mean KL; adam; one
`jax.jit` step on one device whose `loss_fn(params)` closes over `batch` and
`z_rng`.

What changed in the port (a new user's changes, each one forced):
- sizes: 16 "pixels", hidden 12, 3 latents (784, 500, 20 in the original);
  random binary rows instead of binarized MNIST (nothing downloaded);
  `param_dtype=jnp.float64` on every Dense, since linen creates float32
  parameters otherwise, even under `jax_enable_x64`;
- `loss_fn(params)` closing over the batch became `loss_fn(params, batch)`:
  both entry points split the batch over the devices and refuse a closed-over
  sharded batch;
- the noise `eps`: the original draws `random.normal(z_rng, logvar.shape)`
  over the whole batch. Under both entry points each device gets
  `fold_in(key, device)` (and microbatch), so the draws cannot equal the
  one-device draws. For the exactness check `eps` is drawn on the host from
  the same key and carried in the batch (`batch["eps"]`, a row per example):
  the model is then a deterministic function of (params, batch). The keyed
  form (`key_argnum=` / the step's `key`) is run too, and only checked to be
  finite, since it is exact in distribution only.

The check. Reference: `jax.grad` of the loss on the whole batch of B rows, on
one device, `optax.adam` applied plainly, two updates. Port (a):
`ja.make_train_step(loss_fn, adam, num_microbatches=K, mesh=make_mesh((8,),
("data",)), strategy="fsdp")` with `fsdp_gather` "per_microbatch" and "once",
params and state placed by `ja.shard_train_state`. Port (b): the user's own
`jax.jit` step with `ja.grad(loss_fn, axis_name="data")` and
`ja.accumulate(adam, K, axis_name="data")`, fed K calls of B/K rows per update.
Both must equal the reference to <= 1e-10 (relative, float64).
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum as ja  # noqa: E402

PIXELS, HIDDEN, LATENTS = 16, 12, 3
B, K, UPDATES, LR = 32, 2, 2, 1e-2
DT = jnp.float64


class Encoder(nn.Module):
  latents: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(HIDDEN, name="fc1", param_dtype=DT)(x))
    mean_x = nn.Dense(self.latents, name="fc2_mean", param_dtype=DT)(x)
    logvar_x = nn.Dense(self.latents, name="fc2_logvar", param_dtype=DT)(x)
    return mean_x, logvar_x


class Decoder(nn.Module):
  @nn.compact
  def __call__(self, z):
    z = nn.relu(nn.Dense(HIDDEN, name="fc1", param_dtype=DT)(z))
    return nn.Dense(PIXELS, name="fc2", param_dtype=DT)(z)


class VAE(nn.Module):
  """The original's VAE, with the noise passed in (`eps`) instead of drawn from `z_rng`."""

  latents: int = LATENTS

  def setup(self):
    self.encoder = Encoder(self.latents)
    self.decoder = Decoder()

  def __call__(self, x, eps):
    mean, logvar = self.encoder(x)
    z = mean + eps * jnp.exp(0.5 * logvar)  # the original's reparameterize, eps given
    return self.decoder(z), mean, logvar


model = VAE()


@jax.vmap
def kl_divergence(mean, logvar):
  return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar))


@jax.vmap
def binary_cross_entropy_with_logits(logits, labels):
  logits = nn.log_sigmoid(logits)
  return -jnp.sum(labels * logits + (1.0 - labels) * jnp.log(-jnp.expm1(logits)))


def loss_fn(params, batch):
  recon_x, mean, logvar = model.apply({"params": params}, batch["x"], batch["eps"])
  return binary_cross_entropy_with_logits(recon_x, batch["x"]).mean() + kl_divergence(mean, logvar).mean()


def keyed_loss_fn(params, batch, key):
  """The original's form: the noise drawn from a key, per row of what this device/microbatch holds."""
  eps = jax.random.normal(key, (batch["x"].shape[0], LATENTS), DT)
  return loss_fn(params, {"x": batch["x"], "eps": eps})


def make_batches(seed):
  rng = np.random.default_rng(seed)
  batches = []
  for step in range(UPDATES):
    x = (rng.random((B, PIXELS)) < 0.3).astype(np.float64)
    eps = np.asarray(jax.random.normal(jax.random.key(100 + step), (B, LATENTS), DT))  # the original's draw
    batches.append({"x": x, "eps": eps})
  return batches


def max_rel(a, b):
  """Largest |a - b| over every leaf, relative to the leaf's largest magnitude (zero-initialised biases too)."""

  def rel(x, y):
    x, y = jnp.asarray(x), jnp.asarray(y)
    return float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(x)), jnp.max(jnp.abs(y))))

  diffs = jax.tree.map(rel, a, b)
  return max(jax.tree.leaves(diffs))


def reference(params, batches, opt):
  """The plain step: jax.grad + optax on the whole batch, one device."""
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, g = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  return params, losses


def via_train_step(params, batches, opt, mesh, fsdp_gather):
  params, opt_state = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
  step = ja.make_train_step(loss_fn, opt, num_microbatches=K, mesh=mesh, strategy="fsdp", fsdp_gather=fsdp_gather)
  counts = ja.count_collectives(step.lower(params, opt_state, ja.shard_batch(batches[0], mesh)).compile())
  losses = []
  for batch in batches:
    params, opt_state, metrics = step(params, opt_state, ja.shard_batch(batch, mesh))
    losses.append(float(metrics["loss"]))
  return params, losses, counts


def via_own_jit(params, batches, opt, mesh):
  tx = ja.accumulate(opt, K, axis_name="data")
  rows = NamedSharding(mesh, P("data"))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = ja.value_and_grad(loss_fn, axis_name="data")(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  half = jax.tree.map(lambda a: jax.device_put(a[: B // K], rows), batches[0])
  compiled = step.lower(params, opt_state, half).compile()
  counts = {w: ja.count_collectives(compiled, branches=w) for w in ("none", "all")}
  losses = []
  for batch in batches:
    window = []
    for i in range(K):  # K calls of B/K rows make one update; microbatch i = rows i*B/K ... (contiguous)
      part = jax.tree.map(lambda a, i=i: jax.device_put(a[i * B // K : (i + 1) * B // K], rows), batch)
      params, opt_state, loss = step(params, opt_state, part)
      window.append(float(loss))
    losses.append(float(np.mean(window)))
  return params, losses, counts


def keyed_runs(params, batches, opt, mesh):
  """The original's keyed form through both entry points: exact in distribution only, so checked finite."""
  p, s = ja.shard_train_state(params, opt, mesh, strategy="fsdp")
  step = ja.make_train_step(keyed_loss_fn, opt, num_microbatches=K, mesh=mesh, strategy="fsdp")
  p, s, m = step(p, s, ja.shard_batch({"x": batches[0]["x"]}, mesh), jax.random.key(0))
  tx = ja.accumulate(opt, K, axis_name="data")
  q = jax.device_put(params, NamedSharding(mesh, P()))
  t = tx.init(q)

  @jax.jit
  def own(params, opt_state, batch, key):
    grads = ja.grad(keyed_loss_fn, axis_name="data")(params, batch, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for i in range(K):
    x = jax.device_put(batches[0]["x"][i * B // K : (i + 1) * B // K], NamedSharding(mesh, P("data")))
    q, t = own(q, t, {"x": x}, jax.random.fold_in(jax.random.key(0), i))
  finite = all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves((p, q)))
  return float(m["loss"]), finite


def main():
  mesh = jax.make_mesh((8,), ("data",))
  opt = optax.adam(LR)
  params = model.init(jax.random.key(0), jnp.zeros((1, PIXELS), DT), jnp.zeros((1, LATENTS), DT))["params"]
  batches = make_batches(0)
  ref_params, ref_losses = reference(params, batches, opt)
  worst = 0.0
  for gather in ("per_microbatch", "once"):
    out, losses, counts = via_train_step(params, batches, opt, mesh, gather)
    d, dl = max_rel(out, ref_params), max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    print(f"make_train_step fsdp {gather:>14}: params rel diff {d:.2e}, loss rel diff {dl:.2e}; per step {counts}")
    worst = max(worst, d, dl)
  out, losses, counts = via_own_jit(params, batches, opt, mesh)
  d, dl = max_rel(out, ref_params), max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
  print(f"ja.grad + ja.accumulate        : params rel diff {d:.2e}, loss rel diff {dl:.2e}")
  print(f"  collectives per call {counts['none']}, with the window-end branch {counts['all']}")
  worst = max(worst, d, dl)
  moved = max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), ref_params, params)))
  print(f"(the updates moved a parameter by up to {moved:.2e}; reference losses {ref_losses})")
  loss, finite = keyed_runs(params, batches, opt, mesh)
  print(f"keyed form (key folded per device): loss {loss:.4f}, parameters finite: {finite}")
  assert worst <= 1e-10 and finite, worst
  print("OK")


if __name__ == "__main__":
  main()
