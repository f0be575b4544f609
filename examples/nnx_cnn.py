"""A Flax nnx CNN with BatchNorm and Dropout on the 8x8 digits, trained with jaxaccum three ways.

  python examples/nnx_cnn.py --mode all --x64

  accumulate      ja.flax.AccumulatingOptimizer(model, ja.accumulate(adam, K)): one update per microbatch
  microbatch      the functional API (nnx.split/merge) and ja.microbatch, BatchNorm statistics as aux
  data-parallel   ja.make_train_step(..., has_state=True) over ja.data_mesh(): the statistics as model state

BatchNorm in training mode normalises each microbatch with its own statistics
(ghost batch norm), so none of the three is the full-batch-normalised step.
The reference is the plain step they all should equal: for each update, the
loss and gradient of every microbatch (same rows, same dropout key) computed
one by one with jax.value_and_grad and averaged, adam applied once, and the
running statistics set to the mean of the microbatches' new statistics. Each
mode prints the largest relative difference of its final parameters and
statistics from it.
"""

from __future__ import annotations

import functools

import common

args = common.parse_args(__doc__)
jax = common.setup(args)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxaccum as ja  # noqa: E402


class CNN(nnx.Module):
  def __init__(self, *, dtype, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
    # No bias before BatchNorm: its true gradient is exactly 0, and Adam would blow its rounding noise up.
    self.conv1 = nnx.Conv(1, 8, (3, 3), use_bias=False, **kw)
    self.norm = nnx.BatchNorm(8, momentum=0.9, **kw)
    # nnx keeps running statistics in float32 whatever param_dtype is; keep them in `dtype` too.
    self.norm.mean, self.norm.var = (nnx.BatchStat(s[...].astype(dtype)) for s in (self.norm.mean, self.norm.var))
    self.conv2 = nnx.Conv(8, 16, (3, 3), **kw)
    self.dropout = nnx.Dropout(0.25)
    self.out = nnx.Linear(16 * 2 * 2, 10, **kw)

  def __call__(self, x, dropout_key=None):
    """Training mode (batch statistics, dropout) when given a dropout key; inference mode without."""
    train = dropout_key is not None
    x = nnx.relu(self.norm(self.conv1(x), use_running_average=not train))
    x = nnx.avg_pool(x, (2, 2), (2, 2))
    x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
    x = self.dropout(x.reshape(x.shape[0], -1), deterministic=not train, rngs=dropout_key)
    return self.out(x)


images, labels = common.digits(args)
batches = [{"image": images[i], "label": labels[i]} for i in common.batch_indices(len(labels), args)]
adam = optax.adam(args.lr)
K = args.k
base_key = jax.random.key(1)


def new_model():
  return CNN(dtype=common.float_dtype(args), rngs=nnx.Rngs(0))


def step_key(t):
  """The dropout key of update t; microbatch i uses fold_in(step_key(t), i), as ja.microbatch hands it out."""
  return jax.random.fold_in(base_key, t)


# The functional view: parameters and statistics as plain pytrees (what microbatch and make_train_step take).
graphdef, params0, stats0 = nnx.split(new_model(), nnx.Param, nnx.BatchStat)


def pure_loss(params, stats, batch, key):
  """(mean cross-entropy, the new BatchNorm statistics) of one training-mode forward pass."""
  model = nnx.merge(graphdef, params, stats, copy=True)
  logits = model(batch["image"], key)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, nnx.state(model, nnx.BatchStat)


def reference(groups):
  """The plain step, microbatch by microbatch: groups(t, batch) -> [(rows of the batch, dropout key)]."""
  grad_fn = jax.jit(jax.value_and_grad(pure_loss, has_aux=True))

  @jax.jit
  def apply(params, opt_state, grads):
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, stats, opt_state = params0, stats0, adam.init(params0)
  for t, batch in enumerate(batches):
    outs = [grad_fn(params, stats, jax.tree.map(lambda x: x[rows], batch), key) for rows, key in groups(t, batch)]
    mean = lambda *xs: sum(xs) / len(xs)
    (loss, new_stats), grads = jax.tree.map(mean, *outs)
    params, opt_state = apply(params, opt_state, grads)
    stats = new_stats
  return (params, stats), loss


def strided_groups(t, batch):
  """Microbatch i holds rows i, i+K, ... (ja.microbatch's split) and uses key fold_in(step_key(t), i)."""
  n = len(batch["label"])
  return [(jnp.arange(i, n, K), jax.random.fold_in(step_key(t), i)) for i in range(K)]


def counted_groups(t, batch):
  """Microbatch i holds rows i, i+K, ... and uses key fold_in(base_key, microbatches fed before it)."""
  n = len(batch["label"])
  return [(jnp.arange(i, n, K), jax.random.fold_in(base_key, t * K + i)) for i in range(K)]


def accumulate():
  model = new_model()
  optimizer = ja.flax.AccumulatingOptimizer(model, ja.accumulate(adam, K), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, micro):
    key = jax.random.fold_in(base_key, optimizer.microbatches_seen[...])  # a new dropout key per microbatch

    def loss_fn(model):
      logits = model(micro["image"], key)
      return optax.softmax_cross_entropy_with_integer_labels(logits, micro["label"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # a micro-step puts the window-start statistics back
    return loss

  for batch in batches:
    losses = [step(model, optimizer, jax.tree.map(lambda x: x[i::K], batch)) for i in range(K)]
  assert int(optimizer.step[...]) == len(batches)
  _, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  return (params, stats), sum(losses) / K


def microbatch():
  grad_fn = ja.microbatch(jax.value_and_grad(pure_loss, has_aux=True), K, batch_argnums=2, key_argnum=3)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, stats, batch, key):
    (loss, stats), grads = grad_fn(params, stats, batch, key)  # stats: the mean over microbatches
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, stats, loss

  params, opt_state, stats = jax.tree.map(jnp.copy, (params0, adam.init(params0), stats0))
  for t, batch in enumerate(batches):
    params, opt_state, stats, loss = step(params, opt_state, stats, batch, step_key(t))
  return (params, stats), loss


def device_groups(t, batch):
  """Device p holds the p-th block of rows; its microbatch i rows i, i+K, ... of it, key fold_in(fold_in(., p), i)."""
  n, p_count = len(batch["label"]), jax.device_count()
  block = n // p_count
  return [
    (p * block + jnp.arange(i, block, K), jax.random.fold_in(jax.random.fold_in(step_key(t), p), i))
    for p in range(p_count)
    for i in range(K)
  ]


def data_parallel():
  # has_state: loss_fn(params, state, batch, key) -> (loss, new state); every microbatch sees the state
  # passed in, and the new states of all P K microbatches come back averaged.
  mesh = ja.data_mesh()
  step = ja.make_train_step(pure_loss, adam, num_microbatches=K, mesh=mesh, has_state=True)
  params, stats, opt_state = ja.replicate((params0, stats0, adam.init(params0)), mesh)
  for t, batch in enumerate(batches):
    params, stats, opt_state, metrics = step(params, stats, opt_state, ja.shard_batch(batch, mesh), step_key(t))
  return (params, stats), metrics["loss"]


MODES = {
  "accumulate": (accumulate, counted_groups),
  "microbatch": (microbatch, strided_groups),
  "data-parallel": (data_parallel, device_groups),
}

common.header("nnx CNN (BatchNorm, Dropout)", args, jax)
for mode in args.modes:
  run, groups = MODES[mode]
  ref, _ = reference(groups)
  result, loss = run()
  common.report(mode, common.max_rel_diff(result, ref), float(loss), against="the plain step")
