"""A Flax linen CNN on the 8x8 digits, trained with jaxaccum three ways.

  python examples/linen_cnn.py --mode all --x64

  accumulate      ja.flax.TrainState(tx=ja.accumulate(adam, K)): one apply_gradients per microbatch
  microbatch      ja.microbatch(jax.value_and_grad(loss), K) inside a plain jitted optax step
  data-parallel   ja.make_train_step(loss, adam, num_microbatches=K, mesh=ja.data_mesh())

Each prints the largest relative difference of its final parameters from a
plain full-batch run (same init, same batches).
"""

from __future__ import annotations

import functools

import common

args = common.parse_args(__doc__)
jax = common.setup(args)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import jaxaccum as ja  # noqa: E402


class CNN(nn.Module):
  dtype: type

  @nn.compact
  def __call__(self, x):
    for features in (8, 16):
      x = nn.Conv(features, (3, 3), dtype=self.dtype, param_dtype=self.dtype)(x)
      x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
    return nn.Dense(10, dtype=self.dtype, param_dtype=self.dtype)(x.reshape(x.shape[0], -1))


images, labels = common.digits(args)
batches = [{"image": images[i], "label": labels[i]} for i in common.batch_indices(len(labels), args)]
model = CNN(common.float_dtype(args))
params0 = model.init(jax.random.key(0), images[:1])["params"]
adam = optax.adam(args.lr)
K = args.k


def loss_fn(params, batch):
  logits = model.apply({"params": params}, batch["image"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def full_batch():
  """The reference: one plain optax step per batch."""
  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state = params0, adam.init(params0)
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
  return params, loss


def accumulate():
  # What a loader that yields microbatches does: K calls per update; state.step counts updates.
  state = ja.flax.TrainState.create(apply_fn=model.apply, params=jax.tree.map(jnp.copy, params0),
                                    tx=ja.accumulate(adam, K))  # copied: the step donates the state

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, micro):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, micro)
    return state.apply_gradients(grads=grads), loss

  for batch in batches:
    losses = []
    for i in range(K):
      state, loss = step(state, jax.tree.map(lambda x: x[i::K], batch))
      losses.append(loss)
  assert int(state.step) == len(batches)
  return state.params, sum(losses) / K


def microbatch():
  grad_fn = ja.microbatch(jax.value_and_grad(loss_fn), K)  # a drop-in for jax.value_and_grad

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state = jax.tree.map(jnp.copy, (params0, adam.init(params0)))
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
  return params, loss


def data_parallel():
  mesh = ja.data_mesh()
  step = ja.make_train_step(loss_fn, adam, num_microbatches=K, mesh=mesh)
  params, opt_state = ja.replicate((params0, adam.init(params0)), mesh)
  for batch in batches:
    params, opt_state, metrics = step(params, opt_state, ja.shard_batch(batch, mesh))
  return params, metrics["loss"]


common.header("linen CNN", args, jax)
reference, _ = full_batch()
for mode in args.modes:
  params, loss = {"accumulate": accumulate, "microbatch": microbatch, "data-parallel": data_parallel}[mode]()
  common.report(mode, common.max_rel_diff(params, reference), float(loss))
