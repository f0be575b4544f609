"""Shared pieces of the benchmark sections: the MLP, its data, sizes, timing and HLO copies.

Nothing here touches a device at import time (`python -m jaxaccum.bench` sets
the number of CPU devices first).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def mlp_params(key, width: int, depth: int):
  """`depth` square float32 layers of `width`: a list of {"w", "b"} dicts."""
  keys = jax.random.split(key, depth)
  return [
    {"w": jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width), "b": jnp.zeros((width,), jnp.float32)}
    for k in keys
  ]


def mlp_apply(params, x):
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def mlp_loss(params, batch):
  """Mean squared error of the MLP on `batch = (x, y)`."""
  x, y = batch
  return jnp.mean((mlp_apply(params, x) - y) ** 2)


def mlp_batch(key, rows: int, width: int):
  """A float32 regression batch `(x, y)` of `rows` rows."""
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (rows, width), jnp.float32), jax.random.normal(ky, (rows, width), jnp.float32)


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def load_average() -> list[float]:
  """The machine's 1, 5 and 15 minute load averages (what else ran while a timing was taken)."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:  # not on every platform
    return [float("nan")] * 3


MIN_ROUNDS = 7  # the fewest rounds any timing takes: below that an interquartile range means little


def _quartiles(values) -> dict:
  q1, median, q3 = np.percentile(np.asarray(values, np.float64), [25, 50, 75])
  return {
    "median": float(median),
    "q1": float(q1),
    "q3": float(q3),
    "min": float(np.min(values)),
    "max": float(np.max(values)),
  }


SPREAD = 0.05  # `timed` adds rounds while an interquartile range is wider than this share of its median


def timed(
  runners: dict, baseline: str, rounds: int = MIN_ROUNDS, warmup: int = 2, max_rounds: int | None = None
) -> dict:
  """The one timing helper of the bench: runners interleaved round by round, ratios against `baseline` per round.

  A runner is a function of no arguments that does the work once and waits
  for it (`jax.block_until_ready` on its outputs: dispatch is asynchronous),
  carrying its own state between calls (a donated step feeds its outputs back
  in through a list it closes over); compile it before it is timed.

  Every runner runs `warmup` times, then rounds in which each runs once, the
  order rotated every round (A B C, B C A, ...) so no runner always follows
  the same one. A ratio is taken within a round (runner / baseline, measured
  seconds apart), so a load change between rounds moves both sides alike; its
  median over the rounds is the figure, and its quartiles and min-max say how
  far to trust it. After `rounds` (at least `MIN_ROUNDS`) it goes on until the
  spread is known: while some ratio's interquartile range is wider than
  `SPREAD` of its median, up to `max_rounds` (default 2 x `rounds`; a loaded
  machine ends there, with its wide range printed). Wall time and this
  process's CPU time (all its threads) are both kept; the load average is read
  before and after.

  Returns {"rounds", "stopped": "spread" | "max_rounds", "wall_rounds": {name: [seconds per round]},
  "cpu_rounds", "baseline", "load_before", "load_after", "seconds": {name: median}, "cpu_seconds",
  "min_seconds": {name: fastest round}, "ratio": {name: quartiles}, "cpu_ratio"},
  quartiles = {"median", "q1", "q3", "min", "max"}.
  """
  if rounds < MIN_ROUNDS:
    raise ValueError(f"{rounds=} must be >= {MIN_ROUNDS}: fewer rounds do not give a spread")
  if baseline not in runners:
    raise ValueError(f"{baseline=} must be one of {list(runners)}")
  max_rounds = 2 * rounds if max_rounds is None else max_rounds
  if max_rounds < rounds:
    raise ValueError(f"{max_rounds=} must be >= {rounds=}")
  names = list(runners)
  load_before = load_average()
  for name in names:
    for _ in range(warmup):
      runners[name]()
  wall: dict[str, list[float]] = {n: [] for n in names}
  cpu: dict[str, list[float]] = {n: [] for n in names}
  ratio = lambda t, n: _quartiles([a / b for a, b in zip(t[n], t[baseline], strict=True)])
  wide = lambda q: q["q3"] - q["q1"] > SPREAD * q["median"]
  r = 0
  while r < rounds or (r < max_rounds and any(wide(ratio(wall, n)) for n in names)):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      w0, c0 = time.perf_counter(), time.process_time()
      runners[name]()
      wall[name].append(time.perf_counter() - w0)
      cpu[name].append(time.process_time() - c0)
    r += 1
  return {
    "rounds": r,
    "stopped": "max_rounds" if any(wide(ratio(wall, n)) for n in names) else "spread",
    "wall_rounds": wall,
    "cpu_rounds": cpu,
    "baseline": baseline,
    "load_before": load_before,
    "load_after": load_average(),
    "seconds": {n: float(np.median(t)) for n, t in wall.items()},
    "cpu_seconds": {n: float(np.median(t)) for n, t in cpu.items()},
    "min_seconds": {n: float(np.min(t)) for n, t in wall.items()},
    "ratio": {n: ratio(wall, n) for n in names},
    "cpu_ratio": {n: ratio(cpu, n) for n in names},
  }


def ratio_between(t: dict, name: str, base: str, cpu: bool = False) -> dict:
  """Quartiles of `name` / `base` taken round by round from a `timed` result (a second baseline)."""
  rounds = t["cpu_rounds" if cpu else "wall_rounds"]
  return _quartiles([a / b for a, b in zip(rounds[name], rounds[base], strict=True)])


def _printed(q: dict, percent: bool) -> dict:
  """The quartiles rounded as `ratio_cell` prints them (a ratio to 2 decimals, a percentage to 1)."""
  if percent:
    return {k: 1 + round(100 * (v - 1), 1) / 100 for k, v in q.items()}
  return {k: round(v, 2) for k, v in q.items()}


def ratio_cell(q: dict, percent: bool = False) -> str:
  """A ratio as printed: the median and the range of its rounds, "0.55x [0.51, 0.60]" or "+1.2% [-0.3, +2.5]".

  The range printed is min-max, not the interquartile range: a second full
  run's median lands inside the first run's min-max (checked with
  `python -m jaxaccum.bench.reproduce`), where 12 of 86 fell outside its
  interquartile range: the machine's state moves between runs more than
  between rounds. The quartiles stay in the JSON.
  """
  if percent:
    p = lambda x: f"{100 * (x - 1):+.1f}"
    return f"{p(q['median'])}% [{p(q['min'])}, {p(q['max'])}]"
  return f"{q['median']:.2f}x [{q['min']:.2f}, {q['max']:.2f}]"


def verdict(q: dict, target: float, percent: bool = False) -> str:
  """A ratio against an upper bound `target`, read from the range `ratio_cell` prints (min-max over the rounds).

  "met" when the whole range is within the bound, "not met" when the whole
  range is beyond it, and "within noise" when the range straddles it, with the
  side of the median: "within noise, median over" (or "under"), so that a wide
  range never hides a median far from its target. The bounds are compared as
  printed (`percent` as in `ratio_cell`): a cell "[0.70, 1.21]" against
  <= 0.70x reads "within noise" even when the fastest round was 0.7012x, so a
  verdict never contradicts the cell beside it.
  """
  q = _printed(q, percent)
  if q["max"] <= target:
    return "met"
  if q["min"] > target:
    return "not met"
  return f"within noise, median {'over' if q['median'] > target else 'under'}"


_STOPPED = {
  "spread": "",
  "max_rounds": f" (stopped at the most rounds, an interquartile range still wider than {SPREAD:.0%} of its median)",
}


def timing_note(t: dict) -> str:
  """The sentence under a timing table: rounds, what the spread is, the load average before and after."""
  fmt = lambda la: "/".join(f"{x:.2f}" for x in la)
  return (
    f"Median of {t['rounds']} interleaved rounds (order rotated each round), each ratio taken within its round, "
    f"[min, max over the rounds]{_STOPPED[t.get('stopped', 'spread')]}; load average (1/5/15 min) "
    f"{fmt(t['load_before'])} before, {fmt(t['load_after'])} after."
  )


def count_big_copies(hlo_text: str) -> int:
  """Copy instructions of non-scalar arrays in compiled HLO: what a pass-through costs."""
  count = 0
  for line in hlo_text.splitlines():
    if " copy(" in line:
      shape = line.split("=", 1)[1].split(" copy(")[0]
      count += "[]" not in shape
  return count
