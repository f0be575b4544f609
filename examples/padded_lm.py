"""A padded character-level causal LM with token-weighted accumulation, on Python's own source code.

  python examples/padded_lm.py --mode all --x64

The corpus is the standard library's .py files (found with sysconfig; nothing
is downloaded): its non-blank lines, shuffled, cut at --seq-len + 1 bytes and
right-padded. Rows hold very different numbers of real
tokens, so the loss is the masked mean over the real tokens of the batch, and
a microbatch's gradient must count in proportion to its tokens:

  accumulate      ja.flax.TrainState(tx=ja.accumulate(adam, K)), apply_gradients(..., weight=tokens)
  microbatch      ja.microbatch(jax.value_and_grad(loss), K, weight_fn=tokens)
  data-parallel   ja.make_train_step(loss, adam, num_microbatches=K, mesh=..., weight_fn=tokens)

Each prints the largest relative difference of its final parameters from a
plain full-batch run. Then, on the same batches at the initial parameters, how
far the gradient that optax.MultiSteps applies (the mean of the K microbatch
means) is from the full-batch gradient, with microbatches cut from the batch as
loaded (shuffled) and after sorting it by length (as bucketing loaders do),
next to ja.accumulate with token weights.
"""

from __future__ import annotations

import functools
import pathlib
import sysconfig

import common
import numpy as np

PAD = 0  # byte b is token b + 1


def own_flags(parser):
  parser.add_argument("--seq-len", type=int, default=64, help="longest sequence in bytes (default 64)")
  parser.add_argument("--width", type=int, default=32, help="model width (default 32)")


def load_corpus(seq_len: int, rows: int) -> np.ndarray:
  """(rows, seq_len + 1) int32 tokens: lines of the stdlib's .py files (shuffled), right-padded with PAD."""
  lines = []
  for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
    for line in path.read_bytes().splitlines():
      line = line.rstrip()[: seq_len + 1]
      if len(line) >= 2:  # at least one target token
        lines.append(line)
  order = np.random.default_rng(0).permutation(len(lines))[:rows]  # the loader's shuffle
  if len(order) < rows:
    raise SystemExit(f"the corpus has {len(order)} lines; --steps x --batch-size asks for {rows}")
  tokens = np.full((rows, seq_len + 1), PAD, np.int32)
  for row, j in enumerate(order):
    tokens[row, : len(lines[j])] = np.frombuffer(lines[j], np.uint8).astype(np.int32) + 1
  return tokens


args = common.parse_args(__doc__, extra=own_flags)
jax = common.setup(args)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import jaxaccum as ja  # noqa: E402


class CausalLM(nn.Module):
  """One pre-LayerNorm transformer block. Right padding: with a causal mask a real position never sees a pad."""

  width: int
  dtype: type

  @nn.compact
  def __call__(self, tokens):
    kw = dict(dtype=self.dtype, param_dtype=self.dtype)
    x = nn.Embed(257, self.width, **kw)(tokens)
    x = x + self.param("position", nn.initializers.normal(0.02), (tokens.shape[1], self.width), self.dtype)
    # No attention biases: the key bias's true gradient is exactly 0 (softmax ignores a shift), and
    # Adam would scale its rounding noise up to full-size steps.
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, use_bias=False, **kw)(
      nn.LayerNorm(**kw)(x), mask=nn.make_causal_mask(tokens)
    )
    x = x + nn.Dense(self.width, **kw)(nn.gelu(nn.Dense(4 * self.width, **kw)(nn.LayerNorm(**kw)(x))))
    return nn.Dense(257, **kw)(nn.LayerNorm(**kw)(x))


tokens = load_corpus(args.seq_len, args.steps * args.batch_size)
batches = [{"tokens": tokens[t * args.batch_size : (t + 1) * args.batch_size]} for t in range(args.steps)]
model = CausalLM(args.width, common.float_dtype(args))
params0 = model.init(jax.random.key(0), tokens[:1, :-1])["params"]
adam = optax.adam(args.lr)
K = args.k


def num_tokens(batch):
  """The weight of a (micro)batch: its real target tokens."""
  return jnp.sum(batch["tokens"][:, 1:] != PAD)


def loss_fn(params, batch):
  """Mean cross-entropy over the real tokens of `batch` (a masked mean)."""
  inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
  ce = optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, inputs), targets)
  mask = targets != PAD
  return jnp.sum(jnp.where(mask, ce, 0)) / jnp.sum(mask)


def full_batch():
  """The reference: one plain optax step on the masked mean over the whole batch."""

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state = params0, adam.init(params0)
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
  return params, loss


def chunks(batch):
  """K consecutive slices, as a loader yielding microbatches gives them; token counts differ."""
  m = args.batch_size // K
  return [jax.tree.map(lambda x: x[i * m : (i + 1) * m], batch) for i in range(K)]


def accumulate():
  state = ja.flax.TrainState.create(
    apply_fn=model.apply, params=jax.tree.map(jnp.copy, params0), tx=ja.accumulate(adam, K)
  )

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, micro):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, micro)
    return state.apply_gradients(grads=grads, weight=num_tokens(micro)), loss

  for batch in batches:
    window = []
    for micro in chunks(batch):
      state, micro_loss = step(state, micro)
      window.append((micro_loss, num_tokens(micro)))
  return state.params, sum(loss * w for loss, w in window) / sum(w for _, w in window)


def microbatch():
  grad_fn = ja.microbatch(jax.value_and_grad(loss_fn), K, weight_fn=num_tokens)

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
  step = ja.make_train_step(loss_fn, adam, num_microbatches=K, mesh=mesh, weight_fn=num_tokens)
  params, opt_state = ja.replicate((params0, adam.init(params0)), mesh)
  for batch in batches:
    params, opt_state, metrics = step(params, opt_state, ja.shard_batch(batch, mesh))
  return params, metrics["loss"]


def gradient_errors(sort_by_length: bool):
  """Relative error |g - g_full| / |g_full| of the gradient applied after K microbatches, mean over batches.

  An SGD step of rate 1 applies minus the gradient it was given: with
  optax.MultiSteps that is the plain mean of the K microbatch means, with
  ja.accumulate(weight=tokens) the token-weighted mean.
  """
  grad_fn = jax.jit(jax.grad(loss_fn))
  norm = lambda tree: float(
    jnp.sqrt(sum(jnp.sum(x.astype(jnp.float64 if args.x64 else jnp.float32) ** 2) for x in jax.tree.leaves(tree)))
  )
  txs = {"optax.MultiSteps": optax.MultiSteps(optax.sgd(1.0), K), "ja.accumulate": ja.accumulate(optax.sgd(1.0), K)}
  updaters = {name: jax.jit(tx.update) for name, tx in txs.items()}
  errors = {name: [] for name in txs}
  for batch in batches:
    if sort_by_length:
      batch = {"tokens": batch["tokens"][np.argsort((batch["tokens"] != PAD).sum(1), kind="stable")]}
    full = grad_fn(params0, batch)
    for name, tx in txs.items():
      state, update = tx.init(params0), updaters[name]
      for micro in chunks(batch):
        weight = {} if name == "optax.MultiSteps" else {"weight": num_tokens(micro)}
        updates, state = update(grad_fn(params0, micro), state, params0, **weight)
      errors[name].append(norm(jax.tree.map(jnp.add, updates, full)) / norm(full))
  return {name: float(np.mean(e)) for name, e in errors.items()}


common.header("padded char LM", args, jax)
per_row = (tokens[:, 1:] != PAD).sum(1)
print(
  f"corpus: {len(tokens)} lines of the stdlib's source, {per_row.min()}-{per_row.max()} real tokens per row "
  f"(mean {per_row.mean():.1f} of {args.seq_len})",
  flush=True,
)
reference, _ = full_batch()
for mode in args.modes:
  params, loss = {"accumulate": accumulate, "microbatch": microbatch, "data-parallel": data_parallel}[mode]()
  common.report(mode, common.max_rel_diff(params, reference), float(loss))
for sort_by_length, label in [(False, "loaded order"), (True, "sorted by length")]:
  errors = gradient_errors(sort_by_length)
  print(
    f"gradient after K={K} microbatches vs the full batch ({label}): optax.MultiSteps (mean of means) "
    f"{100 * errors['optax.MultiSteps']:.2f}% off, ja.accumulate (token-weighted) "
    f"{errors['ja.accumulate']:.1e}",
    flush=True,
  )
