"""Benchmark section: what measuring the gradient noise scale costs, and how well each estimator measures it.

`ja.accumulate(..., noise_scale_ema=beta)` against the same accumulate without
it: time per window of K=8 micro-steps (target <= 2% more), and the window
end's all-reduces on 8 devices, counted as instructions in compiled HLO with
their result sizes (target: the same count, two scalars more).

Three ways to estimate, side by side (issue 26, item 3):

- "every microbatch" (today's default): |g_i|^2 of each of the K microbatches;
- `noise_scale_sample=m`: |g_i|^2 of the window's first m microbatches only
  (under a `lax.cond`), with the sampled estimator of `jaxaccum.noise`;
- "even/odd" (McCandlish et al. 2018, appendix A): a second accumulator of the
  even microbatches; tr(Sigma)^ = |g_E - g_O|^2 / (1/B_E + 1/B_O) and
  |G|^2^ = |g|^2 - tr(Sigma)^ / B, unbiased for unequal weights (g_E - g_O has
  mean 0 and covariance Sigma (1/B_E + 1/B_O)). Not in the library: its cost is
  timed on a prototype (the second accumulator added under a `lax.cond` on even
  micro-steps, the difference's squared norm at the window end) and its error
  computed from the same microbatch gradients in NumPy.

The error is measured on a linear regression whose noise scale is known: with
x ~ N(0, I_d), y = x.w* + s eps and the parameters at w = w* + delta, one
example's gradient x (x.delta - s eps) has mean G = delta and covariance
(|delta|^2 + s^2) I + delta delta^T, so tr(Sigma) = d (|delta|^2 + s^2) + |delta|^2
and B_simple = tr(Sigma) / |G|^2 exactly. The parameters stay put (the inner
optimizer is `optax.set_to_zero()`), every window draws fresh examples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxaccum import _hlo, noise
from jaxaccum.accumulate import accumulate
from jaxaccum.bench.accumulate import _transform_runner
from jaxaccum.bench.common import MIN_ROUNDS, mlp_params, ratio_cell, timed, timing_note, verdict

SAMPLES = (1, 2)  # noise_scale_sample values timed and measured


def _collectives(params, k: int, noise_scale_ema, sample=None):
  tx = accumulate(optax.adam(1e-3), k, axis_name="data", noise_scale_ema=noise_scale_ema, noise_scale_sample=sample)
  n = jax.device_count()
  step = jax.pmap(lambda g, s: tx.update(g, s, params, weight=8.0), axis_name="data", in_axes=(0, None))
  grads = jax.tree.map(lambda p: jnp.ones((n, *p.shape), p.dtype), params)
  return _hlo.all_reduce_sizes(step.lower(grads, tx.init(params)).compile().as_text())


def _even_odd_prototype(inner, k: int):
  """`accumulate(inner, k)` plus (b)'s second accumulator of the even microbatches: for its cost only.

  Weights are 1 (the runner passes none). On even micro-steps the gradient is
  added to the second accumulator under a `lax.cond`; on the window's last one
  tr(Sigma)^ = |g_E - g_O|^2 / (1/B_E + 1/B_O) is formed from it and the
  window's sum (one more pass over the parameters).
  """
  tx = accumulate(inner, k)
  b_even, b_odd = (k + 1) // 2, k // 2

  def init(params):
    return tx.init(params), jax.tree.map(jnp.zeros_like, params), jnp.zeros([], jnp.float32)

  def update(grads, state, params=None):
    acc_state, even_sum, trace_cov = state
    step = acc_state.micro_step
    # Reset lazily at the window's first micro-step (as acc_weight is): no params-sized zeros at the window end.
    add = lambda e: jax.tree.map(lambda e, g: jnp.where(step == 0, g, e + g), e, grads)
    even_sum = lax.cond(step % 2 == 0, add, lambda e: e, even_sum)

    def window_end():
      total = jax.tree.map(jnp.add, acc_state.acc_grads, grads)
      diff = jax.tree.map(lambda e, t: e / b_even - (t - e) / b_odd, even_sum, total)
      return noise.sq_norm(diff, jnp.float32) / (1 / b_even + 1 / b_odd)

    trace_cov = lax.cond(step == k - 1, window_end, lambda: trace_cov)
    updates, acc_state = tx.update(grads, acc_state, params)
    return updates, (acc_state, even_sum, trace_cov)

  return optax.GradientTransformation(init, update)


BOUND = 1.02  # the target: <= 2% more time per window with the noise scale measured


def _overhead(quick: bool):
  width, depth, k = (128, 4, 8) if quick else (512, 4, 8)
  rounds = MIN_ROUNDS if quick else 21
  params = mlp_params(jax.random.PRNGKey(0), width, depth)
  inner = optax.adam(1e-3)
  # JSON keys: "accumulate + noise_scale_ema" and "ratio" (its overhead) as before this table grew.
  variants = {
    "accumulate": accumulate(inner, k),
    "accumulate + noise_scale_ema": accumulate(inner, k, noise_scale_ema=0.99),
    **{f"+ noise_scale_sample={m}": accumulate(inner, k, noise_scale_ema=0.99, noise_scale_sample=m) for m in SAMPLES},
    "+ even/odd accumulator (prototype)": _even_odd_prototype(inner, k),
  }
  rows, data, notes = [], {}, []
  for micro_batch in (8, 128):
    batches = [
      (
        jax.random.normal(jax.random.PRNGKey(i), (micro_batch, width)),
        jax.random.normal(jax.random.PRNGKey(1000 + i), (micro_batch, width)),
      )
      for i in range(k)
    ]
    runners = {name: _transform_runner(tx, params, batches)[0] for name, tx in variants.items()}
    t = timed(runners, "accumulate", rounds)
    data[f"B={micro_batch}"] = {
      "k": k,
      "micro_batch": micro_batch,
      "timing": t,
      "seconds_per_window": t["seconds"],
      "ratio": t["ratio"]["accumulate + noise_scale_ema"]["median"],
      "ratios": {n: q["median"] for n, q in t["ratio"].items()},
      "cpu_seconds_per_window": t["cpu_seconds"],
      "cpu_ratios": {n: q["median"] for n, q in t["cpu_ratio"].items()},
      "verdicts": {n: verdict(t["ratio"][n], BOUND, percent=True) for n in list(variants)[1:]},
    }
    for n in list(variants)[1:]:
      rows.append(
        f"| K={k}, B={micro_batch} | {n} | {t['seconds'][n] * 1e3:.2f} | {ratio_cell(t['ratio'][n], percent=True)} | "
        f"{ratio_cell(t['cpu_ratio'][n], percent=True)} | {verdict(t['ratio'][n], BOUND, percent=True)} |"
      )
    notes.append(f"B={micro_batch}: accumulate alone {t['seconds']['accumulate'] * 1e3:.2f} ms; {timing_note(t)}")
  markdown = [
    f"MLP {depth} x {width} ({sum(x.size for x in jax.tree.leaves(params)):,} parameters), adam, float32; time per "
    "window of K micro-steps through the plain update API, jitted and donated, against accumulate alone: wall time, "
    "and this process's CPU time (all its threads). Target: <= 2% more wall time with the noise scale measured "
    '(a verdict is "within noise" when the min-max range of its rounds straddles it).',
    "",
    "| case | variant | ms / window | wall overhead | CPU overhead | <= 2% |",
    "|---|---|---:|---:|---:|---|",
    *rows,
    "",
    *notes,
  ]
  return markdown, data, params, k


def _regression_grads(key, windows: int, k: int, b: int, d: int, delta, s: float):
  """Per-microbatch mean gradients (windows, K, d) of 0.5 (x.w - y)^2 at w = w* + delta, fresh examples each."""
  kx, ke = jax.random.split(key)
  x = jax.random.normal(kx, (windows, k, b, d))
  eps = jax.random.normal(ke, (windows, k, b))
  residual = jnp.einsum("wkbd,d->wkb", x, delta) - s * eps  # x.w - y
  return jnp.einsum("wkbd,wkb->wkd", x, residual) / b


def _through_accumulate(grads, b: float, sample):
  """Per-window (|G|^2, tr(Sigma)) estimates of `ja.accumulate` (EMA decay 0: the last window's own)."""
  windows, k, d = grads.shape
  tx = accumulate(optax.set_to_zero(), k, noise_scale_ema=0.0, noise_scale_sample=sample)
  params = {"w": jnp.zeros(d, grads.dtype)}

  @jax.jit
  def run(grads):
    def window(state, g):
      def micro(state, gi):
        return tx.update({"w": gi}, state, params, weight=b)[1], None

      state = lax.scan(micro, state, g)[0]
      ns = noise.noise_scale(state)
      return state, (ns.grad_sq, ns.trace_cov)

    return lax.scan(window, tx.init(params), grads)[1]

  g2, tr = run(grads)
  return np.asarray(g2, np.float64), np.asarray(tr, np.float64)


def _even_odd(grads, b: float):
  """(b)'s per-window estimates in NumPy: even microbatches against odd ones, equal weights b."""
  g = np.asarray(grads, np.float64)
  k = g.shape[1]
  b_e, b_o = b * len(range(0, k, 2)), b * len(range(1, k, 2))
  g_e, g_o = g[:, 0::2].sum(1) * b / b_e, g[:, 1::2].sum(1) * b / b_o
  mean = g.mean(1)
  tr = np.sum((g_e - g_o) ** 2, -1) / (1 / b_e + 1 / b_o)
  return np.sum(mean**2, -1) - tr / (b * k), tr


def _ema_ratio(g2, tr, decay: float):
  """B_simple as `ja.noise_scale` reads it after each window: the ratio of the two bias-corrected EMAs."""
  out, a_g, a_t = [], 0.0, 0.0
  for t, (x, y) in enumerate(zip(g2, tr, strict=True)):
    a_g, a_t = decay * a_g + (1 - decay) * x, decay * a_t + (1 - decay) * y
    norm = 1 - decay ** (t + 1)
    out.append((a_t / norm) / (a_g / norm))
  return np.asarray(out)


def _error(quick: bool):
  d, b, k, s, decay = 16, 8, 8, 1.0, 0.95
  windows = 400 if quick else 4000
  delta = jnp.zeros(d).at[0].set(1.0)  # |G|^2 = 1
  grad_sq = 1.0
  trace_cov = d * (grad_sq + s**2) + grad_sq
  b_simple = trace_cov / grad_sq
  grads = _regression_grads(jax.random.PRNGKey(0), windows, k, b, d, delta, s)
  estimates = {"every microbatch": _through_accumulate(grads, b, None)}
  estimates.update({f"sample={m}": _through_accumulate(grads, b, m) for m in (*SAMPLES, 4)})
  estimates["even/odd"] = _even_odd(grads, b)
  burn = windows // 10
  rows, data = [], {}
  for name, (g2, tr) in estimates.items():
    ratio = _ema_ratio(g2, tr, decay)[burn:] / b_simple - 1
    row = {
      "trace_cov_bias": float(np.mean(tr) / trace_cov - 1),
      "trace_cov_bias_stderr": float(np.std(tr) / np.sqrt(windows) / trace_cov),
      "trace_cov_spread": float(np.std(tr) / trace_cov),
      "grad_sq_bias": float(np.mean(g2) / grad_sq - 1),
      "grad_sq_spread": float(np.std(g2) / grad_sq),
      "b_simple_ema_bias": float(np.mean(ratio)),
      "b_simple_ema_spread": float(np.std(ratio)),
    }
    data[name] = row
    rows.append(
      f"| {name} | {100 * row['trace_cov_bias']:+.1f}% ± {100 * row['trace_cov_bias_stderr']:.1f} | "
      f"{100 * row['trace_cov_spread']:.0f}% | {100 * row['grad_sq_bias']:+.1f}% | "
      f"{100 * row['grad_sq_spread']:.0f}% | "
      f"{100 * row['b_simple_ema_bias']:+.1f}% | {100 * row['b_simple_ema_spread']:.0f}% |"
    )
  markdown = [
    f"Estimator error on a linear regression with known noise (d={d}, |G|^2={grad_sq:g}, noise s={s:g}: "
    f"tr(Sigma)={trace_cov:g}, B_simple={b_simple:g} examples), K={k} microbatches of {b} examples, {windows} "
    f"windows of fresh examples. Bias of the mean per-window estimate (± its standard error) and spread (std) of one "
    f"window's estimate, relative to the truth; B_simple as `ja.noise_scale` reads it (EMA decay {decay}) after "
    f"window {burn}.",
    "",
    "| estimator | tr(Sigma) bias | tr(Sigma) spread | abs(G)^2 bias | abs(G)^2 spread | B_simple bias (EMA) | "
    "B_simple spread (EMA) |",
    "|---|---:|---:|---:|---:|---:|---:|",
    *rows,
  ]
  data["truth"] = {"grad_sq": grad_sq, "trace_cov": trace_cov, "b_simple": b_simple, "k": k, "b": b, "d": d}
  return markdown, data


def run(quick: bool = False) -> list[dict]:
  overhead_md, overhead, params, k = _overhead(quick)
  error_md, error = _error(quick)
  comm = {
    name: _collectives(params, k, ema, sample)
    for name, ema, sample in (("off", None, None), ("on", 0.99, None), ("sample=1", 0.99, 1))
  }
  data = {
    **overhead,
    "estimators": error,
    "all_reduces": {name: {"instructions": c, "elements": e} for name, (c, e) in comm.items()},
  }
  markdown = "\n".join(
    [
      *overhead_md,
      "",
      *error_md,
      "",
      f"All-reduces of one step on {jax.device_count()} devices (compiled HLO, pmap): "
      f"{comm['off'][0]} instruction(s) of {comm['off'][1]:,} elements without tracking, "
      f"{comm['on'][0]} of {comm['on'][1]:,} with it (the two scalars sum w|g|^2 and K join the "
      f"window end's all-reduce), {comm['sample=1'][0]} of {comm['sample=1'][1]:,} with noise_scale_sample "
      "(B_S, the sampled weight, joins too); no parameter-sized collective is added.",
    ]
  )
  return [
    {"title": "noise scale: cost of measuring it, and each estimator's error", "markdown": markdown, "data": data}
  ]
