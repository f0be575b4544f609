"""Seeded random programs for the layerwise differential fuzzer (tests/test_layerwise.py).

A program is what model code does with its parameters: each layer builds a
weight from parameters and constants, then applies it to the activations. The
weight expression starts from a leaf (sliced, indexed, reshaped, concatenated,
or a leaf already used) and goes through a few transforms, each reading
constants of one kind: NumPy arrays (float64, float32, int, bool), NumPy and
Python scalars, closed-over jnp arrays, `jnp.asarray(np_array)` written inside
the loss; on either side (`w * MASK`, `MASK * w`), and in chains
(`(w.T * MASK).reshape(...)`). Layers are dense, einsum, `where` on the
activations, `lax.cond`, `jax.checkpoint`, `lax.scan` over a stacked leaf (fed
scaled by a constant, constants in the body), a `fori_loop`, a cumsum, a
concatenation, a scan whose carry is a parameter.

Every array is float64 and at most (3, 8, 16): a program builds in
milliseconds. `Program.ops` spells the program out for a failure message.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from zoo.jax_models import linear as _linear  # the zoo's custom_vjp linear (a hand-written bwd)

D = 8  # the activations' width and every weight's side
DEPTH = 3  # stacked layers


class Program(NamedTuple):
  seed: int
  params: dict  # leaf name -> float64 array
  dims: dict  # leaf name -> the dimension sharded over the 8 devices, or None (replicated)
  apply: Callable[[dict, Any], Any]  # apply(params, x (rows, D)) -> (rows, D)
  ops: tuple  # what it does, one string per step


class _Gen:
  def __init__(self, seed: int):
    self.seed = seed
    self.py = random.Random(seed)
    self.rng = np.random.default_rng(seed)
    self.params: dict = {}
    self.dims: dict = {}
    self.ops: list[str] = []
    self.square: list[str] = []  # (D, D) leaves, for reuse

  # ------------------------------------------------------------------ leaves and constants
  def leaf(self, shape, scale=None) -> str:
    name = f"l{len(self.params)}"
    scale = 1.0 / np.sqrt(shape[-1]) if scale is None else scale
    self.params[name] = jnp.asarray(self.rng.normal(size=shape) * scale, jnp.float64)
    shardable = [i for i, n in enumerate(shape) if n % 8 == 0]
    self.dims[name] = self.py.choice(shardable) if shardable and self.py.random() < 0.9 else None
    if tuple(shape) == (D, D):
      self.square.append(name)
    return name

  def const(self, shape, kinds=None) -> tuple[Callable[[], Any], str]:
    """A constant of a random kind: (a getter called while tracing, its label)."""
    kinds = kinds or ["f64", "f64", "f32", "int", "bool", "jnp", "asarray"] + (
      ["npscalar", "py"] if shape == () else []
    )
    kind = self.py.choice(kinds)
    c = self.rng.uniform(-1.0, 1.0, size=shape) + (0.2 if shape == () else 0.0)
    label = f"{kind}{list(shape)}"
    if kind == "f64":
      a = np.asarray(c, np.float64)
      return (lambda: a), label
    if kind == "f32":
      a = np.asarray(c, np.float32)
      return (lambda: a), label
    if kind == "int":
      a = np.asarray(np.round(3 * c), np.int64)
      return (lambda: a), label
    if kind == "bool":
      a = np.asarray(c > -0.3)
      return (lambda: a), label
    if kind == "jnp":  # a closed-over concrete jax Array
      a = jnp.asarray(c, jnp.float64)
      return (lambda: a), label
    if kind == "asarray":  # jnp.asarray(np_array) written inside the loss
      a = np.asarray(c, np.float64)
      return (lambda: jnp.asarray(a)), label
    if kind == "npscalar":
      a = np.float64(c)
      return (lambda: a), label
    v = float(c)
    return (lambda: v), label

  def mask(self, shape):
    a = self.rng.uniform(size=shape) > 0.3
    return a

  def index(self, n, size=D):
    return np.asarray(self.rng.integers(0, n, size=size))

  # ------------------------------------------------------------------ a (D, D) weight from parameters
  def base(self) -> tuple[Callable, str]:
    kind = self.py.choice(["square", "square", "tall", "wide", "flat", "reuse", "stack", "halves"])
    if kind == "reuse" and self.square:
      n = self.py.choice(self.square)
      return (lambda p: p[n]), f"{n}(again)"
    if kind == "tall":
      n = self.leaf((2 * D, D))
      how = self.py.choice(["stride", "index", "reshape"])
      if how == "stride":
        return (lambda p: p[n][::2]), f"{n}[::2]"
      if how == "index":
        idx = self.index(2 * D)
        return (lambda p: p[n][idx]), f"{n}[np_idx]"
      return (lambda p: p[n].reshape(D, 2 * D)[:, :D]), f"{n}.reshape(8,16)[:, :8]"
    if kind == "wide":
      n = self.leaf((D, 2 * D))
      c, lab = self.const((2 * D, D), ["f64", "f32", "jnp", "asarray"])
      if self.py.random() < 0.5:
        return (lambda p: p[n] @ c() / 4), f"{n} @ {lab}"
      return (lambda p: jnp.einsum("ij,jk->ik", p[n], c()) / 4), f"einsum({n}, {lab})"
    if kind == "flat":
      n = self.leaf((D * D,), 0.35)
      return (lambda p: p[n].reshape(D, D)), f"{n}.reshape(8,8)"
    if kind == "stack":
      n = self.leaf((DEPTH, D, D))
      i = self.py.randrange(DEPTH)
      return (lambda p: p[n][i]), f"{n}[{i}]"
    if kind == "halves":
      a, b = self.leaf((D // 2, D)), self.leaf((D // 2, D))
      return (lambda p: jnp.concatenate([p[a], p[b]], 0)), f"concat({a}, {b})"
    n = self.leaf((D, D))
    return (lambda p: p[n]), n

  def transform(self, depth=0) -> tuple[Callable, str]:
    """A random (D, D) -> (D, D) function of a weight, reading constants."""
    t = self.py.choice(
      ["mul", "mul", "add", "matmul", "wide", "T", "chain", "where", "index", "concat", "pad", "cumsum", "nonlin",
       "roll", "tri", "remat", "jit", "dynslice", "einsum", "sort", "norm", "clip", "scatter", "stopgrad", "softmax",
       "relu", "tile", "stack", "outer", "einsum3", "named", "vmap", "cond"]
    )  # fmt: skip
    shape = self.py.choice([(D, D), (D, D), (D,), ()])
    if t == "mul":
      c, lab = self.const(shape)
      if self.py.random() < 0.5:
        return (lambda w: w * c()), f"w * {lab}"
      return (lambda w: c() * w), f"{lab} * w"
    if t == "add":
      c, lab = self.const(shape, ["f64", "f32", "int", "jnp", "asarray"] + (["npscalar", "py"] if shape == () else []))
      if self.py.random() < 0.5:
        return (lambda w: w + c()), f"w + {lab}"
      return (lambda w: c() - w), f"{lab} - w"
    if t == "matmul":
      c, lab = self.const((D, D), ["f64", "f32", "int", "jnp", "asarray"])
      if self.py.random() < 0.5:
        return (lambda w: w @ c() / 4), f"w @ {lab}"
      return (lambda w: c() @ w / 4), f"{lab} @ w"
    if t == "wide":
      c, lab = self.const((D, 4 * D), ["f64", "f32", "jnp"])
      return (lambda w: (w @ c()).reshape(D, 4, D).sum(1) / 8), f"(w @ {lab}).reshape(8,4,8).sum(1)"
    if t == "T":
      return (lambda w: w.T), "w.T"
    if t == "chain":
      c, lab = self.const((D, D))
      r, rlab = self.const((2 * D,), ["f64", "f32", "jnp"])
      return (
        lambda w: ((w.T * c()).reshape(D // 2, 2 * D) * r()).reshape(D, D)
      ), f"((w.T * {lab}).reshape(4,16) * {rlab}).reshape(8,8)"
    if t == "where":
      how = self.py.choice(["wc", "cw", "w0", "self"])
      m = self.mask((D, D))
      if how == "self":
        return (lambda w: jnp.where(w > 0, w, 0.1 * w)), "where(w > 0, w, 0.1 w)"
      if how == "w0":
        return (lambda w: jnp.where(m, w, 0.0)), "where(np_bool, w, 0.0)"
      c, lab = self.const((D, D), ["f64", "f32", "jnp"])
      if how == "wc":
        return (lambda w: jnp.where(m, w, c())), f"where(np_bool, w, {lab})"
      return (lambda w: jnp.where(m, c(), w)), f"where(np_bool, {lab}, w)"
    if t == "index":
      idx = self.index(D)
      how = self.py.choice(["rows", "cols", "take", "gather", "uint"])
      if how == "rows":
        return (lambda w: w[idx]), "w[np_idx]"
      if how == "cols":
        return (lambda w: w[:, idx]), "w[:, np_idx]"
      if how == "uint":
        u = idx.astype(np.uint32)
        return (lambda w: w[u]), "w[np_uint_idx]"
      if how == "gather":  # the NumPy array read as is (jnp indexing normalises it with traced ops first)
        dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
        mode = lax.GatherScatterMode.PROMISE_IN_BOUNDS
        return (lambda w: lax.gather(w, idx[:, None], dn, (1, D), mode=mode)), "lax.gather(w, np_idx)"
      return (lambda w: jnp.take(w, idx, axis=1)), "take(w, np_idx, 1)"
    if t == "concat":
      how = self.py.choice(["const", "self", "stride"])
      if how == "const":
        c, lab = self.const((D, D), ["f64", "f32", "jnp", "asarray"])
        return (lambda w: jnp.concatenate([w[: D // 2], c()[D // 2 :]], 0)), f"concat(w[:4], {lab}[4:])"
      if how == "self":
        return (lambda w: jnp.concatenate([w[:, D // 2 :], w[:, : D // 2]], 1)), "concat(w[:, 4:], w[:, :4])"
      c, lab = self.const((D, D), ["f64", "jnp"])
      return (lambda w: jnp.concatenate([w, c()], 0)[::2]), f"concat(w, {lab})[::2]"
    if t == "pad":
      how = self.py.choice(["rows", "value", "wide", "reflect"])
      if how == "rows":
        return (lambda w: jnp.pad(w, ((1, 1), (0, 0)))[1 : D + 1]), "pad(w, rows 1)[1:9]"
      if how == "value":
        return (lambda w: jnp.pad(w, ((0, 0), (2, 2)), constant_values=0.5)[:, 1 : D + 1]), "pad(w, 0.5)[:, 1:9]"
      if how == "wide":
        return (lambda w: jnp.pad(w, ((0, 0), (0, D)))[:, 4 : D + 4]), "pad(w, (0, 8))[:, 4:12]"
      return (lambda w: jnp.pad(w, ((2, 2), (0, 0)), mode="reflect")[1 : D + 1]), "pad(w, reflect)[1:9]"
    if t == "cumsum":
      axis, rev = self.py.randrange(2), self.py.random() < 0.3
      return (lambda w: lax.cumsum(w, axis, reverse=rev) / 4), f"cumsum(w, {axis}, reverse={rev})"
    if t == "nonlin":
      how = self.py.choice(["tanh", "sq", "sym", "mm", "cube", "abs"])
      fns = {
        "tanh": (lambda w: jnp.tanh(w)),
        "sq": (lambda w: w * w),
        "sym": (lambda w: w + w.T),
        "mm": (lambda w: w @ w / 2),
        "cube": (lambda w: w**3),
        "abs": (lambda w: jnp.abs(w) + 0.1 * w),
      }
      return fns[how], how
    if t == "roll":
      if self.py.random() < 0.5:
        return (lambda w: jnp.roll(w, 1, axis=0)), "roll(w, 1, 0)"
      return (lambda w: w[::-1]), "w[::-1]"
    if t == "tri":
      if self.py.random() < 0.5:
        return (lambda w: jnp.triu(w)), "triu(w)"
      c, lab = self.const((D, D), ["f64", "jnp"])
      return (lambda w: jnp.tril(w, -1) + c()), f"tril(w, -1) + {lab}"
    if t == "remat" and depth < 2:
      inner, lab = self.transform(depth + 1)
      return (lambda w: jax.checkpoint(inner)(w)), f"checkpoint({lab})"
    if t == "jit" and depth < 2:
      c, lab = self.const((D, D), ["f64", "f32", "jnp"])
      if self.py.random() < 0.5:
        return (lambda w: jax.jit(lambda v, k: v * k)(w, c())), f"jit(v * k)(w, {lab})"
      inner, ilab = self.transform(depth + 1)
      return (lambda w: jax.jit(inner)(w)), f"jit({ilab})"
    if t == "dynslice":
      start = np.int64(self.py.randrange(D + 1))
      return (
        lambda w: lax.dynamic_slice(jnp.pad(w, ((0, D), (0, 0))), (start, np.int64(0)), (D, D))
      ), f"dynamic_slice(pad(w), {start})"
    if t == "einsum":
      c, lab = self.const((D, D), ["f64", "f32", "jnp", "asarray"])
      return (lambda w: jnp.einsum("ij,kj->ik", c(), w) / 4), f"einsum('ij,kj', {lab}, w)"
    if t == "sort":
      return (lambda w: jnp.sort(w, axis=0)), "sort(w, 0)"
    if t == "norm":  # weight normalisation
      return (lambda w: w / jnp.linalg.norm(w, axis=0, keepdims=True)), "w / norm(w, 0)"
    if t == "clip":
      lo, hi = self.rng.uniform(-0.6, -0.1, (D, D)), self.rng.uniform(0.1, 0.6, (D,))
      if self.py.random() < 0.5:
        return (lambda w: jnp.clip(w, lo, hi)), "clip(w, np_lo, np_hi)"
      return (lambda w: jnp.maximum(w, lo)), "maximum(w, np_lo)"
    if t == "scatter":
      idx = self.rng.permutation(D)[: D // 2]
      c, lab = self.const((D // 2, D), ["f64", "f32", "jnp", "asarray"])
      if self.py.random() < 0.5:
        return (lambda w: w.at[idx].add(c())), f"w.at[np_idx].add({lab})"
      return (lambda w: w.at[idx].set(c())), f"w.at[np_idx].set({lab})"
    if t == "stopgrad":
      c, lab = self.const((D, D), ["f64", "jnp"])
      return (lambda w: lax.stop_gradient(w) * c() + w), f"stop_gradient(w) * {lab} + w"
    if t == "softmax":
      c, lab = self.const((D, D), ["f64", "f32", "jnp"])
      return (lambda w: jax.nn.softmax(w * c(), axis=-1)), f"softmax(w * {lab})"
    if t == "relu":  # a custom_jvp function of the parameter
      return (lambda w: jax.nn.relu(w) + 0.1 * w), "relu(w) + 0.1 w"
    if t == "tile":
      if self.py.random() < 0.5:
        return (lambda w: jnp.tile(w[: D // 2], (2, 1))), "tile(w[:4], (2, 1))"
      return (lambda w: jnp.repeat(w[:, : D // 2], 2, axis=1)), "repeat(w[:, :4], 2, 1)"
    if t == "stack":
      c, lab = self.const((D, D), ["f64", "f32", "jnp", "asarray"])
      return (lambda w: jnp.stack([w, c()]).mean(0)), f"stack([w, {lab}]).mean(0)"
    if t == "outer":
      c, lab = self.const((D,), ["f64", "jnp"])
      return (lambda w: w + jnp.outer(w.sum(0), c()) / 8), f"w + outer(w.sum(0), {lab}) / 8"
    if t == "einsum3":
      c, lab = self.const((D, D), ["f64", "jnp"])
      return (lambda w: jnp.einsum("ij,jk,kl->il", w, c(), w) / 8), f"einsum(w, {lab}, w)"
    if t == "named" and depth < 2:
      inner, lab = self.transform(depth + 1)
      return (lambda w: jax.named_call(inner, name="block")(w)), f"named_call({lab})"
    if t == "vmap":
      c, lab = self.const((D, D), ["f64", "jnp"])
      return (lambda w: jax.vmap(lambda r, k: r * k + r[::-1])(w, c())), f"vmap(r * k + r[::-1])(w, {lab})"
    if t == "cond":
      c, lab = self.const((D, D), ["f64", "jnp"])
      pred = np.bool_(self.py.random() < 0.5)
      return (lambda w: lax.cond(pred, lambda w: w * c(), lambda w: w.T, w)), f"cond({pred}, w * {lab}, w.T)"
    return (lambda w: w), "w"

  def weight(self) -> tuple[Callable, str]:
    """A (D, D) weight: a base and 0-3 transforms."""
    base, lab = self.base()
    fns = []
    for _ in range(self.py.choice([0, 1, 1, 2, 2, 3])):
      f, t = self.transform()
      fns.append(f)
      lab = f"{lab} | {t}"

    def w(p):
      v = base(p)
      for f in fns:
        v = f(v)
      return v

    return w, lab

  def bias(self) -> tuple[Callable, str]:
    how = self.py.choice(["none", "leaf", "leaf_pe", "row"])
    if how == "none":
      return (lambda p: 0.0), "0"
    n = self.leaf((D,), 0.1)
    if how == "leaf":
      return (lambda p: p[n]), n
    c, lab = self.const((D,))
    if how == "leaf_pe":
      return (lambda p: p[n] + c()), f"{n} + {lab}"
    return (lambda p: c() * p[n]), f"{lab} * {n}"

  # ------------------------------------------------------------------ layers: (p, h) -> h
  def layer(self) -> tuple[Callable, str]:
    kind = self.py.choice(
      ["dense", "dense", "einsum", "scale", "where", "cond", "remat", "scan", "scan", "fori", "cumsum", "concat",
       "carry", "vmap", "map", "custom_vjp", "policy"]
    )  # fmt: skip
    act = self.py.choice([jnp.tanh, jnp.sin])
    if kind == "scan":
      return self.scan_layer(act)
    if kind in ("vmap", "map"):
      n = self.leaf((DEPTH, D, D))
      c, lab = self.const((D, D), ["f64", "f32", "jnp", "asarray"])
      if kind == "vmap":  # a batched dot_general over the stacked weight
        return (
          lambda p, h: jax.vmap(lambda lw: act(h @ (lw * c())))(p[n]).mean(0)
        ), f"vmap(act(h @ (layer * {lab})))({n}).mean(0)"
      return (
        lambda p, h: h + lax.map(lambda lw: act(h @ lw + c()[0]), p[n]).mean(0)
      ), f"h + lax.map(act(h @ layer + {lab}[0]), {n}).mean(0)"
    w, wlab = self.weight()
    if kind == "dense":
      b, blab = self.bias()
      return (lambda p, h: act(h @ w(p) + b(p))), f"act(h @ [{wlab}] + {blab})"
    if kind == "einsum":
      return (lambda p, h: act(jnp.einsum("bi,ij->bj", h, w(p)))), f"act(einsum(h, [{wlab}]))"
    if kind == "scale":
      if self.py.random() < 0.5:
        return (lambda p, h: h * (1.0 + w(p)[0])), f"h * (1 + [{wlab}][0])"
      return (lambda p, h: h * jnp.diagonal(w(p))), f"h * diag([{wlab}])"
    if kind == "where":
      return (lambda p, h: jnp.where(h > 0, act(h @ w(p)), 0.5 * h)), f"where(h > 0, act(h @ [{wlab}]), h / 2)"
    if kind == "cond":
      w2, lab2 = self.weight()
      return (
        lambda p, h: lax.cond(jnp.sum(h) > 0, lambda h: act(h @ w(p)), lambda h: 0.5 * (h @ w2(p)), h)
      ), f"cond(sum(h) > 0, act(h @ [{wlab}]), h @ [{lab2}] / 2)"
    if kind == "remat":
      return (lambda p, h: jax.checkpoint(lambda p, h: act(h @ w(p)))(p, h)), f"checkpoint(act(h @ [{wlab}]))"
    if kind == "policy":
      policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
      return (
        lambda p, h: jax.checkpoint(lambda p, h: act(h @ w(p)), policy=policy)(p, h)
      ), f"checkpoint(act(h @ [{wlab}]), dots saveable)"
    if kind == "custom_vjp":
      return (lambda p, h: act(_linear(h, w(p)))), f"act(custom_vjp linear(h, [{wlab}]))"
    if kind == "fori":
      c, lab = self.const((D,), ["f64", "jnp", "asarray"])
      return (
        lambda p, h: lax.fori_loop(0, 2, lambda i, h: act(h @ w(p) / 2 + c()), h)
      ), f"fori_loop(2, act(h @ [{wlab}] / 2 + {lab}))"
    if kind == "cumsum":
      return (lambda p, h: jnp.cumsum(act(h @ w(p)), axis=1) / 4), f"cumsum(act(h @ [{wlab}]), 1) / 4"
    if kind == "concat":
      return (
        lambda p, h: jnp.concatenate([h[:, : D // 2], act(h @ w(p))[:, D // 2 :]], 1)
      ), f"concat(h[:, :4], act(h @ [{wlab}])[:, 4:])"
    # carry: a parameter-derived weight as a scan's carry
    c, lab = self.const((D, D), ["f64", "jnp"])

    def carry(p, h):
      v, _ = lax.scan(lambda v, _: (0.5 * v + 0.1 * c(), None), w(p), None, length=2)
      return act(h @ v)

    return carry, f"act(h @ scan(carry=[{wlab}], 0.5 v + 0.1 {lab}))"

  def scan_layer(self, act) -> tuple[Callable, str]:
    """Layers stacked (DEPTH, D, D) and applied with lax.scan: the stack scaled by a constant, constants in the body."""
    depth = self.py.choice([DEPTH, DEPTH, 8])  # 8 layers: the layer axis may be the sharded one
    n = self.leaf((depth, D, D))
    bn = self.leaf((depth, D), 0.1) if self.py.random() < 0.5 else None
    reverse, unroll = self.py.random() < 0.2, self.py.choice([1, 1, 2])
    how = self.py.choice(["plain", "scalar", "py", "array", "add", "tanh"])
    if how == "plain":
      xs, xlab = (lambda p: p[n]), n
    elif how == "scalar":
      s = np.float64(self.rng.uniform(0.5, 1.5))
      xs, xlab = (lambda p: p[n] * s), f"{n} * np_scalar"
    elif how == "py":
      xs, xlab = (lambda p: 0.7 * p[n]), f"0.7 * {n}"
    elif how == "array":
      c, lab = self.const((depth, 1, 1), ["f64", "f32", "jnp", "asarray"])
      xs, xlab = (lambda p: p[n] * c()), f"{n} * {lab}"
    elif how == "add":
      c, lab = self.const((depth, D, D), ["f64", "jnp"])
      xs, xlab = (lambda p: p[n] + 0.1 * c()), f"{n} + 0.1 {lab}"
    else:
      xs, xlab = (lambda p: jnp.tanh(p[n])), f"tanh({n})"
    inside = self.py.choice(["none", "mask", "pe", "proj"])
    c, clab = self.const((D, D) if inside != "pe" else (D,), ["f64", "f32", "jnp", "asarray"])
    body_w = {
      "none": (lambda lw: lw),
      "mask": (lambda lw: lw * c()),
      "pe": (lambda lw: lw + c()),
      "proj": (lambda lw: lw @ c() / 4),
    }[inside]

    def apply(p, h):
      stacked = (xs(p), p[bn]) if bn is not None else (xs(p),)

      def body(h, layer):
        out = h @ body_w(layer[0])
        if bn is not None:
          out = out + layer[1]
        return act(out), None

      h, _ = lax.scan(body, h, stacked, reverse=reverse, unroll=unroll)
      return h

    opts = f", reverse={reverse}, unroll={unroll}"
    return apply, f"scan(xs=[{xlab}]{', ' + bn if bn else ''}, body: act(h @ {inside}({clab})){opts})"


def draw_layers(g, layers: int | None = None) -> list:
  """`layers` (default 1-3, drawn) layers from generator `g`, each one's label appended to `g.ops`."""
  fns = []
  for _ in range(layers if layers is not None else g.py.choice([1, 2, 2, 3])):
    f, lab = g.layer()
    fns.append(f)
    g.ops.append(lab)
  return fns


def program(seed: int, layers: int | None = None) -> Program:
  """The seeded random program number `seed`."""
  g = _Gen(seed)
  fns = draw_layers(g, layers)
  decay = g.py.choice(list(g.params)) if g.py.random() < 0.3 else None
  if decay is not None:
    g.ops.append(f"+ 0.01 sum({decay}^2)")

  def apply(p, x):
    h = x
    for f in fns:
      h = f(p, h)
    return h if decay is None else h + 0.01 * jnp.sum(p[decay] ** 2)

  return Program(seed, g.params, g.dims, apply, tuple(g.ops))


# ---------------------------------------------------------------------------------------------- the harness
P = 8  # devices
ROWS = 32  # 4 per device


def combined(programs: list[Program]):
  """(params, dims, loss(params, x, y)): the programs side by side, each on its own parameters, losses summed.

  Each program's parameters get exactly that program's gradient, so one
  compile checks all of them.
  """
  params = {f"p{i}": prog.params for i, prog in enumerate(programs)}
  dims = {f"p{i}": prog.dims for i, prog in enumerate(programs)}

  def loss(params, x, y):
    return sum(jnp.mean((prog.apply(params[f"p{i}"], x) - y) ** 2) for i, prog in enumerate(programs))

  return params, dims, loss


def data(seed: int = 0):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (ROWS, D), jnp.float64)
  return x, jnp.sin(x @ jax.random.normal(ky, (D, D), jnp.float64))


def layerwise_value_and_grad(loss, params, dims, x, y, check_vma=False):
  """Through jaxaccum._layerwise inside a shard_map over 8 devices: (mean loss, mean gradient), full-size.

  `check_vma=False` is how the train step's shard_map runs: the loss's constants
  then reach the interpreter as constants (with True, JAX `pvary`s each one
  into a traced value first).
  """
  from jax.sharding import PartitionSpec

  from jaxaccum._layerwise import layerwise

  is_none = lambda d: d is None
  specs = jax.tree.map(
    lambda d: PartitionSpec() if d is None else PartitionSpec(*[None] * d, "data"), dims, is_leaf=is_none
  )
  flat_dims = jax.tree.leaves(dims, is_leaf=is_none)
  f = layerwise(loss, dims, "data", P)

  def body(shards, x, y):
    flat, treedef = jax.tree.flatten(shards)
    # Replicated leaves enter varying (their gradient stays local); sharded ones are blocks.
    if check_vma:
      flat = [lax.pcast(v, "data", to="varying") if d is None else v for v, d in zip(flat, flat_dims, strict=True)]
    keep = lax.axis_index("data") >= 0  # a traced True: the keep path runs
    scale = jnp.asarray(1.0 / P, jnp.float64)  # sharded gradients scaled before their reduce-scatter
    value, g = jax.value_and_grad(lambda s: f(s, x, y, keep=keep, scale=scale))(jax.tree.unflatten(treedef, flat))
    g = [lax.psum(v, "data") / P if d is None else v for v, d in zip(jax.tree.leaves(g), flat_dims, strict=True)]
    return lax.psum(value, "data") / P, jax.tree.unflatten(treedef, g)

  mesh = jax.make_mesh((P,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:P])
  fn = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(specs, PartitionSpec("data"), PartitionSpec("data")),
      out_specs=(PartitionSpec(), specs),
      axis_names={"data"},
      check_vma=check_vma,
    )
  )
  return fn(params, x, y)


def reference_value_and_grad(loss, params, x, y):
  """Plain jax.grad: the mean over the 8 devices' blocks of rows of each block's loss."""

  def total(p):
    per = jax.vmap(lambda xb, yb: loss(p, xb, yb))(x.reshape(P, -1, D), y.reshape(P, -1, D))
    return jnp.mean(per)

  return jax.jit(jax.value_and_grad(total))(params)


def errors(programs: list[Program], seed: int = 0, tol: float = 1e-10, check_vma: bool = False) -> list[str]:
  """Runs the programs together; on an exception or a mismatch, one by one. A line per failing program."""
  x, y = data(seed)

  def check(progs) -> list[str]:
    params, dims, loss = combined(progs)
    want_value, want = reference_value_and_grad(loss, params, x, y)
    try:
      value, got = layerwise_value_and_grad(loss, params, dims, x, y, check_vma)
    except Exception as e:  # noqa: BLE001  (reported with the program that raised it)
      return [f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"]
    bad = []
    if abs(float(value) - float(want_value)) > tol * max(1.0, abs(float(want_value))):
      bad.append(f"loss {float(value)!r} != {float(want_value)!r}")
    return bad + leaf_errors(progs, got, want, tol, lambda prog, name: f" (dim {prog.dims[name]})")

  return one_by_one(check, programs, lambda prog: f"\n    dims: {prog.dims}")


def leaf_errors(progs, got, want, tol: float, where=lambda prog, name: "") -> list[str]:
  """A line per leaf of the side-by-side programs whose gradient is off by more than `tol` (relative)."""
  bad = []
  for i, prog in enumerate(progs):
    for name in prog.params:
      g, w = np.asarray(got[f"p{i}"][name]), np.asarray(want[f"p{i}"][name])
      err = np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)
      if not err <= tol:
        bad.append(f"program {prog.seed} leaf {name}{where(prog, name)}: relative error {err:.3g}")
  return bad


def one_by_one(check, programs, more=lambda prog: "") -> list[str]:
  """`check(programs)` together; on a failure, each program alone, to name the failing ones."""
  found = check(programs)
  if not found or len(programs) == 1:
    return [f"{found} in seed {programs[0].seed}: {list(programs[0].ops)}"] if found else []
  out = []
  for prog in programs:
    for line in check([prog]):
      out.append(f"seed {prog.seed}: {line}\n    ops: {list(prog.ops)}{more(prog)}")
  return out or found
