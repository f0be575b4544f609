"""An Equinox CNN on the 8x8 digits, trained with jaxaccum three ways.

  python examples/equinox_cnn.py --mode all --x64

  accumulate      ja.accumulate(adam, K) as the optimizer of an eqx.filter_jit step, one call per microbatch
  microbatch      ja.microbatch(eqx.filter_value_and_grad(loss), K): the model itself is the first argument
  data-parallel   ja.make_train_step on the model's arrays (eqx.partition), over ja.data_mesh()

Each prints the largest relative difference of its final parameters from a
plain full-batch run (same init, same batches).
"""

from __future__ import annotations

import common

args = common.parse_args(__doc__)
jax = common.setup(args)

import equinox as eqx  # noqa: E402
import optax  # noqa: E402

import jaxaccum as ja  # noqa: E402


def avg_pool(x):
  """2x2 average pooling of one (channels, height, width) image."""
  c, h, w = x.shape
  return x.reshape(c, h // 2, 2, w // 2, 2).mean(axis=(2, 4))


class CNN(eqx.Module):
  conv1: eqx.nn.Conv2d
  conv2: eqx.nn.Conv2d
  out: eqx.nn.Linear

  def __init__(self, key, dtype):
    k1, k2, k3 = jax.random.split(key, 3)
    self.conv1 = eqx.nn.Conv2d(1, 8, 3, padding=1, dtype=dtype, key=k1)
    self.conv2 = eqx.nn.Conv2d(8, 16, 3, padding=1, dtype=dtype, key=k2)
    self.out = eqx.nn.Linear(16 * 2 * 2, 10, dtype=dtype, key=k3)

  def __call__(self, x):
    """Logits of one (1, 8, 8) image; vmap it over a batch."""
    x = avg_pool(jax.nn.relu(self.conv1(x)))
    x = avg_pool(jax.nn.relu(self.conv2(x)))
    return self.out(x.reshape(-1))


images, labels = common.digits(args)
images = images.transpose(0, 3, 1, 2)  # channels first, as Equinox's convolutions take them
batches = [{"image": images[i], "label": labels[i]} for i in common.batch_indices(len(labels), args)]
model0 = CNN(jax.random.key(0), common.float_dtype(args))
adam = optax.adam(args.lr)
K = args.k


def loss_fn(model, batch):
  logits = jax.vmap(model)(batch["image"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def arrays(model):
  return eqx.filter(model, eqx.is_array)


def full_batch():
  """The reference: one plain optax step per batch."""

  @eqx.filter_jit
  def step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = adam.update(grads, opt_state, arrays(model))
    return eqx.apply_updates(model, updates), opt_state, loss

  model, opt_state = model0, adam.init(arrays(model0))
  for batch in batches:
    model, opt_state, loss = step(model, opt_state, batch)
  return arrays(model), loss


def accumulate():
  tx = ja.accumulate(adam, K)  # any optax optimizer slot takes it

  @eqx.filter_jit
  def step(model, opt_state, micro):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, micro)
    updates, opt_state = tx.update(grads, opt_state, arrays(model))  # zeros until the K-th call
    return eqx.apply_updates(model, updates), opt_state, loss

  model, opt_state = model0, tx.init(arrays(model0))
  for batch in batches:
    losses = []
    for i in range(K):
      model, opt_state, loss = step(model, opt_state, jax.tree.map(lambda x: x[i::K], batch))
      losses.append(loss)
  assert int(opt_state.update_count) == len(batches)
  return arrays(model), sum(losses) / K


def microbatch():
  grad_fn = ja.microbatch(eqx.filter_value_and_grad(loss_fn), K)  # a drop-in for it

  @eqx.filter_jit
  def step(model, opt_state, batch):
    loss, grads = grad_fn(model, batch)
    updates, opt_state = adam.update(grads, opt_state, arrays(model))
    return eqx.apply_updates(model, updates), opt_state, loss

  model, opt_state = model0, adam.init(arrays(model0))
  for batch in batches:
    model, opt_state, loss = step(model, opt_state, batch)
  return arrays(model), loss


def data_parallel():
  # make_train_step differentiates its first argument: give it the arrays, keep the rest static.
  params, static = eqx.partition(model0, eqx.is_array)
  mesh = ja.data_mesh()
  step = ja.make_train_step(
    lambda params, batch: loss_fn(eqx.combine(params, static), batch), adam, num_microbatches=K, mesh=mesh
  )
  params, opt_state = ja.replicate((params, adam.init(params)), mesh)
  for batch in batches:
    params, opt_state, metrics = step(params, opt_state, ja.shard_batch(batch, mesh))
  return params, metrics["loss"]


common.header("Equinox CNN", args, jax)
reference, _ = full_batch()
for mode in args.modes:
  params, loss = {"accumulate": accumulate, "microbatch": microbatch, "data-parallel": data_parallel}[mode]()
  common.report(mode, common.max_rel_diff(params, reference), float(loss))
