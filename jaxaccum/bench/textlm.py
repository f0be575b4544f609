"""Benchmark section: held-out loss against bytes over the replica axis, on real text (Python's stdlib).

Data: the bytes of the `.py` files of the running interpreter's standard library
(`sysconfig.get_paths()["stdlib"]`, files in sorted path order, test packages
included), concatenated; the last tenth of the files, by that order, is held
out. A small causal transformer (byte vocabulary, pre-LN, learned positions)
trains with AdamW; every row runs the same number of inner steps on the same
sequences (4 replicas x `rows` sequences per step; replica r always reads the
r-th quarter of each step's batch).

Rows: ddp every step (`make_train_step` over 4 devices: one gradient
all-reduce per step), and `ja.diloco_train_step` over a (replica=4, data=1)
mesh: DiLoCo (H = 32, Nesterov outer 0.7 / 0.9 as in the paper), streaming
(F = 4, tau = 1, alpha = 0.5), + int8 + error feedback, + int4 + error
feedback, int4 without it. Held-out loss: the global model (ddp's parameters,
DiLoCo's anchor) on fixed held-out sequences, in nats per byte. Bytes: the ring
bytes one device sends per collective that crosses the replica axis, read from
the compiled HLO, times how often it runs (straight-line: every step; in a sync
branch: once per H steps), per 1000 inner steps; the peak of one sync is the
largest sum over one conditional branch (ddp: one step's).
"""

from __future__ import annotations

import pathlib
import sysconfig
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum import _hlo, slowlink, train_step
from jaxaccum._sparse import TopK

REPLICAS = 4


def stdlib_bytes(limit: int) -> tuple[np.ndarray, np.ndarray]:
  """(train, held-out) uint8 arrays: the stdlib's .py files in sorted order, the last tenth held out."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
  cut = len(files) - len(files) // 10

  def read(paths):
    out, n = [], 0
    for p in paths:
      data = p.read_bytes()
      out.append(np.frombuffer(data, np.uint8))
      n += len(data)
      if n >= limit:
        break
    return np.concatenate(out)[:limit]

  return read(files[:cut]), read(files[cut:])


def init_model(key, vocab: int, dim: int, layers: int, seq: int):
  keys = iter(jax.random.split(key, 4 + 4 * layers))
  normal = lambda shape, scale: jax.random.normal(next(keys), shape, jnp.float32) * scale
  blocks = []
  for _ in range(layers):
    blocks.append(
      {
        "ln1": jnp.ones((dim,), jnp.float32),
        "qkv": normal((dim, 3 * dim), dim**-0.5),
        "proj": normal((dim, dim), (2 * dim * layers) ** -0.5),
        "ln2": jnp.ones((dim,), jnp.float32),
        "up": normal((dim, 4 * dim), dim**-0.5),
        "down": normal((4 * dim, dim), (8 * dim * layers) ** -0.5),
      }
    )
  return {"embed": normal((vocab, dim), 0.02), "pos": normal((seq, dim), 0.02), "blocks": blocks, "ln": jnp.ones(dim)}


def balanced_fragments(params, num: int):
  """A `fragments` function: leaves, largest first, each to the fragment holding the fewest elements so far.

  Streaming DiLoCo's peak bandwidth is 1/F of DiLoCo's only if the fragments are about equal in size;
  `fragments=F` splits by leaf count, and a byte-level model's leaves differ a lot in size.
  """
  with_path = jax.tree_util.tree_flatten_with_path(params)[0]
  load, index = [0] * num, {}
  for path, leaf in sorted(with_path, key=lambda pl: -pl[1].size):
    f = int(np.argmin(load))
    index[jax.tree_util.keystr(path)] = f
    load[f] += leaf.size

  def fragment(path, leaf):
    return index[jax.tree_util.keystr(path)]

  return fragment


def _norm(x, g):
  return g * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def logits_fn(params, tokens, heads: int):
  n, t = tokens.shape
  x = params["embed"][tokens] + params["pos"][:t]
  mask = jnp.tril(jnp.ones((t, t), bool))
  for b in params["blocks"]:
    q, k, v = jnp.split(_norm(x, b["ln1"]) @ b["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(n, t, heads, -1).transpose(0, 2, 1, 3)
    q, k, v = split(q), split(k), split(v)
    att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]), -1e9)
    y = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(n, t, -1)
    x = x + y @ b["proj"]
    x = x + jax.nn.gelu(_norm(x, b["ln2"]) @ b["up"]) @ b["down"]
  return _norm(x, params["ln"]) @ params["embed"].T


def make_loss(heads: int):
  def loss(params, batch):
    logits = logits_fn(params, batch[:, :-1], heads)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  return loss


def _ring(base: str, opcode: str, result: str, n: int) -> float:
  """Ring bytes one device sends for a collective of group size n (as `jaxaccum._hlo.collectives` counts them)."""
  arrays = _hlo._ARRAY.findall(result)  # noqa: SLF001
  out = _hlo._array_bytes(result if base == opcode else "{}[{}]".format(*arrays[-1]))  # noqa: SLF001
  if base == "all-reduce":
    return 2 * (n - 1) * out / n
  if base == "reduce-scatter":
    return out * (n - 1)
  if base == "all-gather":
    return out // n * (n - 1)
  return float(out)


def _sync_bytes(text: str, mesh, replica_axis: str) -> tuple[float, list[float]]:
  """(ring bytes of the straight-line crossing collectives, [each conditional's costliest branch's]).

  Crossing: a collective whose device groups hold devices of two replicas or more.
  """
  computations, entry = _hlo._instructions(text)  # noqa: SLF001
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  ids = np.moveaxis(ids, mesh.axis_names.index(replica_axis), 0).reshape(mesh.shape[replica_axis], -1)
  replica = {int(d): r for r, row in enumerate(ids) for d in row}

  def own(name: str, seen: frozenset) -> tuple[float, list[float]]:
    """Ring bytes of the crossing collectives reachable from computation `name`, and its conditionals' peaks."""
    total, peaks = 0.0, []  # type: tuple[float, list[float]]
    if name not in computations or name in seen:
      return total, peaks
    seen = seen | {name}
    for opcode, result, line, called in computations[name]:
      base = opcode.removesuffix("-start")
      if base in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all") and not opcode.endswith("-done"):
        groups = _hlo._groups(line)  # noqa: SLF001
        if groups is None or any(len({replica[d] for d in g}) > 1 for g in groups):
          total += _ring(base, opcode, result, len(next(iter(groups))) if groups else mesh.devices.size)
      if opcode == "conditional":
        branch = [
          own(t, seen) for kind, t in called if kind in ("true_computation", "false_computation", "branch_computations")
        ]
        peaks.append(max((b[0] for b in branch), default=0.0))
        peaks.extend(p for b in branch for p in b[1])
      else:
        for _, t in called:
          sub_total, sub_peaks = own(t, seen)
          total += sub_total
          peaks.extend(sub_peaks)
    return total, peaks

  top, peaks = own(entry, frozenset())
  return top, [p for p in peaks if p > 0]


def _rows(h: int, chunk: int, fragments, quick: bool) -> dict[str, Any]:
  """Every row: ("ddp", its comm dtype), or (sync_every, outer, diloco options). Quick: one DiLoCo H."""
  nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
  plain = optax.sgd(1.0)
  stream: dict[str, Any] = dict(fragments=fragments, delay=1, alpha=0.5)
  rows: dict[str, Any] = {"ddp float32": ("ddp", None), "ddp bf16": ("ddp", jnp.bfloat16)}
  for every in (h,) if quick else (2, 4, 8, h, 2 * h):
    rows[f"DiLoCo H={every}, Nesterov"] = (every, nesterov, {})
  rows[f"DiLoCo H={h}, SGD 1.0 (averaging)"] = (h, plain, {})
  rows[f"streaming H={h} + int4 + EF"] = (h, nesterov, dict(stream, compress="int4", error_feedback=True))
  for kept in (1, 2):  # 1 and 2 values of each chunk: 1.6% and 3.1% at chunk 64
    spec = TopK(density=kept / chunk, chunk=chunk, bits=2, beta=SPARSE_BETA)
    name = f"sparse H={h}, {100 * kept / chunk:.1f}% 2-bit"
    rows[name] = (h, plain, dict(compress=spec, error_feedback=True))
  return rows


SPARSE_BETA = 0.95  # the error-feedback decay of the sparse rows


def _train(name, row, loss, inner, params, batches, devices):
  """(final global parameters, ring bytes per 1000 steps, peak bytes of one sync) of one row."""
  steps = len(batches)
  if row[0] == "ddp":
    mesh = jax.sharding.Mesh(devices, ("data",))
    step = train_step.make_train_step(loss, inner, mesh=mesh, strategy="ddp", donate=False, comm_dtype=row[1])
    p, s = params, inner.init(params)
    lowered = step.lower(p, s, batches[0])
    # The wire the program asks for (XLA:CPU widens a bf16 all-reduce to f32 when it compiles; GPU/TPU do not).
    text = lowered.as_text(dialect="hlo") if row[1] is not None else lowered.compile().as_text()
    top, _ = _sync_bytes(text, jax.sharding.Mesh(devices, ("replica",)), "replica")
    for t in range(steps):
      p, s, _ = step(p, s, batches[t])
    return p, 1000 * top, top
  every, outer, opts = row
  mesh = jax.sharding.Mesh(devices.reshape(REPLICAS, 1), ("replica", "data"))
  base = train_step.make_train_step(loss, inner, mesh=mesh, strategy="ddp")
  step = slowlink.diloco_train_step(base, outer, every, **opts)
  p, s = step.init(params)
  top, peaks = _sync_bytes(step.lower(p, s, batches[0]).compile().as_text(), mesh, "replica")
  for t in range(steps):
    p, s, _ = step(p, s, batches[t])
  final = jax.tree.map(lambda a: np.asarray(a)[0], s.anchor)
  return final, 1000 * top + 1000 / every * sum(peaks), max(peaks, default=0.0)


def run(quick: bool = False, **sizes) -> dict:
  """The bytes-vs-loss section; `sizes` overrides the quick/full sizes (dim, layers, heads, seq, rows, steps, ...)."""
  cfg: dict[str, Any] = (
    dict(dim=16, layers=1, heads=2, seq=16, rows=2, steps=16, sync_every=8, limit=100_000, eval_rows=16, chunk=16)
    if quick
    else dict(
      dim=64, layers=2, heads=4, seq=64, rows=4, steps=512, sync_every=32, limit=2_000_000, eval_rows=256, chunk=64
    )
  )
  unknown = set(sizes) - set(cfg)
  if unknown:
    raise ValueError(f"unknown sizes {sorted(unknown)}: known are {sorted(cfg)}")
  cfg.update(sizes)
  train, held = stdlib_bytes(cfg["limit"])
  seq, steps, h = cfg["seq"], cfg["steps"], cfg["sync_every"]
  starts = np.random.default_rng(0).integers(0, len(train) - seq - 1, size=(steps, REPLICAS * cfg["rows"]))
  held_starts = np.random.default_rng(1).integers(0, len(held) - seq - 1, size=cfg["eval_rows"])
  take = lambda data, s: np.stack([data[i : i + seq + 1] for i in s]).astype(np.int32)
  batches = [take(train, starts[t]) for t in range(steps)]
  params = init_model(jax.random.PRNGKey(0), 256, cfg["dim"], cfg["layers"], seq)
  loss = make_loss(cfg["heads"])
  eval_loss = jax.jit(loss)
  inner = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.1)
  devices = np.array(jax.devices()[:REPLICAS])
  data: dict[str, Any] = {"config": dict(cfg, replicas=REPLICAS, train_bytes=len(train), held_bytes=len(held))}
  data["cases"] = {}
  for name, row in _rows(h, cfg["chunk"], balanced_fragments(params, 4), quick).items():
    final, per_1000, peak = _train(name, row, loss, inner, params, batches, devices)
    data["cases"][name] = {
      "held_out_loss": float(eval_loss(final, take(held, held_starts))),
      "bytes_per_1000_steps": per_1000,
      "peak_bytes_per_sync": peak,
    }
  return _section(data, cfg, sum(x.size for x in jax.tree.leaves(params)))


def _section(data: dict, cfg: dict, n_params: int) -> dict:
  cases, h = data["cases"], cfg["sync_every"]
  ddp = cases["ddp float32"]
  for c in cases.values():
    c["bytes_ratio_vs_ddp"] = ddp["bytes_per_1000_steps"] / c["bytes_per_1000_steps"]
    c["loss_vs_ddp"] = c["held_out_loss"] / ddp["held_out_loss"] - 1
  diloco = cases[f"DiLoCo H={h}, Nesterov"]["held_out_loss"]
  best = [n for n, c in cases.items() if c["bytes_ratio_vs_ddp"] >= 1000 and c["held_out_loss"] <= diloco]
  data["rows_1000x_no_worse_than_diloco"] = best
  table_rows = [
    f"| {n} | {c['held_out_loss']:.4f} | {100 * c['loss_vs_ddp']:+.2f}% | {c['bytes_per_1000_steps'] / 2**20:.4f} "
    f"| {c['bytes_ratio_vs_ddp']:.1f}x | {c['peak_bytes_per_sync'] / 2**10:.1f} |"
    for n, c in cases.items()
  ]
  table = "\n".join(
    [
      f"Byte-level causal transformer ({cfg['layers']} layers, width {cfg['dim']}, {n_params} float32 params) on "
      f"the .py files of Python's stdlib ({data['config']['train_bytes']} train / {data['config']['held_bytes']} "
      f"held-out bytes), {REPLICAS} replicas x {cfg['rows']} sequences of {cfg['seq']} bytes, {cfg['steps']} inner "
      "AdamW steps for every row (the same sequences). Loss: held-out nats per byte of the global model (ddp's "
      "parameters, DiLoCo's anchor). Bytes: ring bytes per device over the replica axis, from HLO x runs (ddp bf16: "
      "as lowered, the wire GPU/TPU send; XLA:CPU widens it to f32). Streaming: F=4, tau=1, alpha=0.5. Sparse: "
      f"ja.TopK chunk {cfg['chunk']}, 2-bit values, beta {SPARSE_BETA}, outer SGD 1.0. Rows with >= 1000x fewer "
      f"bytes than ddp and a held-out loss no worse than DiLoCo H={h} Nesterov: {', '.join(best) or 'none'}.",
      "",
      "| row | held-out loss | vs ddp | MiB per 1000 steps | fewer bytes than ddp | peak KiB per sync |",
      "|---|---|---|---|---|---|",
      *table_rows,
    ]
  )
  return {
    "title": "lowcomm: held-out loss vs bytes over the replica axis (stdlib text)",
    "markdown": table,
    "data": data,
  }


RESULT_ID = "lowcomm/held-out-loss-vs-bytes-over-the-replica-axis-stdlib-text"


def plot(data: dict, ax=None):
  """Held-out loss against bytes per 1000 inner steps (log axis), one labelled point per row of `data["cases"]`."""
  import matplotlib.pyplot as plt  # noqa: PLC0415  (only for the figure)

  if ax is None:
    _, ax = plt.subplots(figsize=(7, 4.5))
  for name, c in data["cases"].items():
    x, y = c["bytes_per_1000_steps"] / 2**20, c["held_out_loss"]
    marker = "s" if name.startswith("ddp") else "^" if name.startswith("sparse") else "o"
    ax.scatter(x, y, s=36, marker=marker)
    ax.annotate(name, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
  ax.set_xscale("log")
  ax.set_xlabel("MiB over the replica axis per 1000 inner steps (per device, ring bytes from HLO)")
  ax.set_ylabel("held-out loss (nats per byte)")
  cfg = data["config"]
  ax.set_title(f"{cfg['replicas']} replicas, {cfg['steps']} inner steps, the same tokens for every row", fontsize=9)
  return ax


def main(argv=None) -> int:
  """`python -m jaxaccum.bench.textlm`: docs/lowcomm_loss_vs_bytes.svg from the store (docs/bench_results.json)."""
  import argparse  # noqa: PLC0415

  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  matplotlib.rcParams["svg.hashsalt"] = "jaxaccum"  # the same file for the same figures
  from jaxaccum.bench import figures  # noqa: PLC0415

  parser = argparse.ArgumentParser(prog="python -m jaxaccum.bench.textlm", description=main.__doc__)
  parser.add_argument("--store", default=str(figures.ROOT / figures.STORE))
  parser.add_argument("--out", default=str(figures.ROOT / "docs" / "lowcomm_loss_vs_bytes.svg"))
  args = parser.parse_args(argv)
  ax = plot(figures.load(args.store)[RESULT_ID]["data"])
  ax.figure.tight_layout()
  ax.figure.savefig(args.out, metadata={"Date": None})
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
