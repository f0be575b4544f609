"""A Flax linen CNN on the 8x8 digits, trained with jaxaccum three ways.

  python examples/linen_cnn.py --mode all --x64

  accumulate      ja.flax.TrainState(tx=ja.accumulate(adam, K)): one apply_gradients per microbatch
  microbatch      ja.microbatch(jax.value_and_grad(loss), K) inside a plain jitted optax step
  data-parallel   ja.make_train_step(loss, adam, num_microbatches=K, mesh=ja.data_mesh())

The loss also returns per-example outputs, as metrics code wants them: the
logits ("concat": back in the batch's row order) and the number of correct
predictions ("sum"). Each mode prints the largest relative difference of its
final parameters and of the last batch's logits from a plain full-batch run
(same init, same batches), and that batch's accuracy.
"""

from __future__ import annotations

import functools

import common
import numpy as np

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
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, {"logits": logits, "correct": jnp.sum(jnp.argmax(logits, -1) == batch["label"])}


# How each aux leaf combines over microbatches (and devices): a mean would be wrong for both.
AUX_REDUCTIONS = {"logits": "concat", "correct": "sum"}


def full_batch():
  """The reference: one plain optax step per batch."""

  @jax.jit
  def step(params, opt_state, batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux

  params, opt_state = params0, adam.init(params0)
  for batch in batches:
    params, opt_state, loss, aux = step(params, opt_state, batch)
  return params, loss, aux


def accumulate():
  # What a loader that yields microbatches does: K calls per update; state.step counts updates.
  state = ja.flax.TrainState.create(
    apply_fn=model.apply, params=jax.tree.map(jnp.copy, params0), tx=ja.accumulate(adam, K)
  )  # copied: the step donates the state

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, micro):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, micro)
    return state.apply_gradients(grads=grads), loss, aux

  for batch in batches:
    logits = np.zeros((args.batch_size, 10), images.dtype)
    losses, correct = [], 0
    for i in range(K):  # the per-example outputs of a window are the caller's to put together
      state, loss, aux = step(state, jax.tree.map(lambda x: x[i::K], batch))
      losses.append(loss)
      logits[i::K], correct = aux["logits"], correct + aux["correct"]
  assert int(state.step) == len(batches)
  return state.params, sum(losses) / K, {"logits": logits, "correct": correct}


def microbatch():
  # A drop-in for jax.value_and_grad(loss_fn, has_aux=True); reductions mirror its output ((loss, aux), grads).
  grad_fn = ja.microbatch(jax.value_and_grad(loss_fn, has_aux=True), K, reductions=(("mean", AUX_REDUCTIONS), "mean"))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    (loss, aux), grads = grad_fn(params, batch)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux

  params, opt_state = jax.tree.map(jnp.copy, (params0, adam.init(params0)))
  for batch in batches:
    params, opt_state, loss, aux = step(params, opt_state, batch)
  return params, loss, aux


def data_parallel():
  mesh = ja.data_mesh()
  step = ja.make_train_step(loss_fn, adam, num_microbatches=K, mesh=mesh, has_aux=True, aux_reductions=AUX_REDUCTIONS)
  params, opt_state = ja.replicate((params0, adam.init(params0)), mesh)
  for batch in batches:
    params, opt_state, metrics = step(params, opt_state, ja.shard_batch(batch, mesh))
  return params, metrics["loss"], metrics["aux"]  # logits in the global batch's row order


common.header("linen CNN", args, jax)
ref_params, _, ref_aux = full_batch()
for mode in args.modes:
  params, loss, aux = {"accumulate": accumulate, "microbatch": microbatch, "data-parallel": data_parallel}[mode]()
  assert int(aux["correct"]) == int(ref_aux["correct"]), (mode, aux["correct"], ref_aux["correct"])
  diff = common.max_rel_diff((params, aux["logits"]), (ref_params, ref_aux["logits"]))
  common.report(mode, diff, float(loss), extra=f", last batch accuracy {int(aux['correct']) / args.batch_size:.3f}")
