"""ja.diloco's sparse wire (ja.TopK, SparseLoCo arXiv 2508.15706) against a NumPy float64 loop of the paper's update."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxaccum as ja
from jaxaccum import _hlo, _sparse

REPLICAS = 4
SHAPES = {"a": (8, 16), "b": (40,)}  # b: two chunks of 16 and a shorter last one of 8


def _np_topk_wire(e, spec):
  """One leaf of one replica, the paper's Q(TopK(e)) written plainly: the decoded values sent."""
  flat = e.ravel()
  out = np.zeros_like(flat)
  top = 2 ** (spec.bits - 1)
  for lo in range(0, flat.size, spec.chunk):
    chunk = flat[lo : lo + spec.chunk]
    keep = np.argsort(-np.abs(chunk), kind="stable")[: spec.k]  # ties: the lower index
    scale = float(np.float32(np.max(np.abs(chunk))).astype(ml_dtypes.bfloat16))
    step = scale / top
    for i in keep:
      m = 1.0 if step == 0 else min(max(np.round(abs(chunk[i]) / step), 1.0), top)
      out[lo + i] = (-1.0 if chunk[i] < 0 else 1.0) * m * step
  return out.reshape(e.shape)


def _np_sparseloco(params, grads, lr, spec, sync_every, outer_lr):
  """SparseLoCo with inner SGD, in float64: per replica theta, e; on a sync e <- beta e + Delta_p, send, average."""
  theta = [{k: v.copy() for k, v in params.items()} for _ in range(REPLICAS)]
  err = [{k: np.zeros_like(v) for k, v in params.items()} for _ in range(REPLICAS)]
  anchor = {k: v.copy() for k, v in params.items()}
  out = []
  for t, g in enumerate(grads, start=1):
    for p in range(REPLICAS):
      theta[p] = {k: theta[p][k] - lr * g[k][p] for k in params}
    if t % sync_every == 0:
      sent = []
      for p in range(REPLICAS):
        acc = {k: spec.beta * err[p][k] + (anchor[k] - theta[p][k]) for k in params}
        c = {k: _np_topk_wire(acc[k], spec) for k in params}
        err[p] = {k: acc[k] - c[k] for k in params}
        sent.append(c)
      anchor = {k: anchor[k] - outer_lr * (sum(c[k] for c in sent) / REPLICAS) for k in params}
      theta = [{k: v.copy() for k, v in anchor.items()} for _ in range(REPLICAS)]
    out.append(([dict(th) for th in theta], [dict(e) for e in err], dict(anchor)))
  return out


def _setup(steps, seed=0):
  rng = np.random.default_rng(seed)
  params = {k: rng.normal(size=s) for k, s in SHAPES.items()}
  grads = [{k: rng.normal(size=(REPLICAS, *s)) for k, s in SHAPES.items()} for _ in range(steps)]
  return params, grads


def _step(tx):
  mesh = Mesh(np.array(jax.devices()[:REPLICAS]), ("r",))

  def body(params, state, grads):
    params, state, grads = (jax.tree.map(lambda a: a[0], t) for t in (params, state, grads))
    updates, state = tx.update(grads, state, params)
    return jax.tree.map(lambda a: a[None], (optax.apply_updates(params, updates), state))

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))


def _stack(tree):
  return jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (REPLICAS, *np.shape(a))), tree)


@pytest.mark.parametrize("bits,beta", [(2, 0.9), pytest.param(4, 1.0, marks=pytest.mark.slow)])
def test_sparse_wire_equals_the_papers_update_in_float64(bits, beta):
  spec = ja.TopK(density=0.2, chunk=16, bits=bits, beta=beta)  # k = 3 of 16
  params, grads = _setup(steps=6)
  tx = ja.diloco(optax.sgd(0.1), optax.sgd(1.0), 2, axis_name="r", compress=spec, error_feedback=True)
  step = _step(tx)
  p, s = _stack(params), _stack(tx.init(params))
  want = _np_sparseloco(params, grads, 0.1, spec, 2, 1.0)
  for t, g in enumerate(grads):
    p, s = step(p, s, {k: jnp.asarray(v) for k, v in g.items()})
    theta, err, anchor = want[t]
    for k in SHAPES:
      np.testing.assert_allclose(np.asarray(s.anchor[k][0]), anchor[k], rtol=1e-13, atol=1e-13)
      for r in range(REPLICAS):
        np.testing.assert_allclose(np.asarray(p[k][r]), theta[r][k], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(np.asarray(s.residual[k][r]), err[r][k], rtol=1e-13, atol=1e-13)
  assert int(s.sync_count[0]) == 3


def test_pack_round_trips_and_payload_is_one_tight_all_gather():
  values = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=37))
  np.testing.assert_array_equal(_sparse.unpack(_sparse.pack(values, 6), 6, 37), values)
  spec = ja.TopK(density=2 / 64, chunk=64, bits=2)
  params = {"w": np.zeros((64, 64)), "v": np.zeros((640,))}
  tx = ja.diloco(optax.sgd(0.1), optax.sgd(1.0), 4, axis_name="r", compress=spec, error_feedback=True)
  compiled = _step(tx).lower(_stack(params), _stack(tx.init(params)), _stack(params)).compile()
  found = _hlo.collectives(compiled.as_text(), num_devices=REPLICAS)
  assert [(c.opcode, c.where) for c in found] == [("all-gather", "branch")], found
  # Per chunk of 64: 2 indices of 6 bits, 2 codes of 2 bits, a 16-bit scale: 4 bytes.
  chunks = (64 * 64 + 640) // 64
  assert found[0].ring_bytes == (REPLICAS - 1) * 4 * chunks
  assert ja.collective_bytes(compiled) == {"all-gather": (REPLICAS - 1) * 4 * chunks}  # when it runs: per sync
  float32_all_reduce = 2 * (REPLICAS - 1) / REPLICAS * 4 * (64 * 64 + 640)
  assert float32_all_reduce / found[0].ring_bytes == 32.0  # x H = 32 -> 1024x fewer bytes than ddp


def test_resume_mid_window_is_bit_identical(tmp_path):
  spec = ja.TopK(density=0.2, chunk=16, bits=2, beta=0.8)
  params, grads = _setup(steps=7, seed=2)
  tx = ja.diloco(optax.adam(0.05), optax.sgd(1.0), 3, axis_name="r", compress=spec, error_feedback=True)
  step = _step(tx)
  grads = [{k: jnp.asarray(v) for k, v in g.items()} for g in grads]
  p, s = _stack(params), _stack(tx.init(params))
  straight = []
  for g in grads:
    p, s = step(p, s, g)
    straight.append((p, s))
  p, s = straight[3]  # update 4: one into the second window, the residual non-zero
  assert int(s.local_step[0]) == 1 and np.any(np.asarray(s.residual["a"]))
  ja.checkpoint.save(tmp_path / "mid", (p, s))
  p, s = ja.checkpoint.restore(tmp_path / "mid", like=(p, s))
  for t in range(4, 7):
    p, s = step(p, s, grads[t])
    jax.tree.map(np.testing.assert_array_equal, (p, s), straight[t])


def test_an_empty_leaf_sends_nothing_and_changes_nothing_else():
  # A size-0 leaf (a bias of an empty layer, a placeholder) holds no chunk: before, init refused it with
  # "choose chunk <= 0". It must send nothing and leave every other leaf's result as it was without it.
  spec = ja.TopK(density=0.2, chunk=16, bits=2, beta=0.9)
  rng = np.random.default_rng(3)
  params = {"a": rng.normal(size=(4, 16))}
  grads = [{"a": jnp.asarray(rng.normal(size=(REPLICAS, 4, 16)))} for _ in range(4)]
  tx = ja.diloco(optax.sgd(0.1), optax.sgd(1.0), 2, axis_name="r", compress=spec, error_feedback=True)
  runs = []
  for extra in ({}, {"z": np.zeros((0, 3))}):
    p = _stack({**params, **extra})
    s = _stack(tx.init({**params, **extra}))
    step = _step(tx)
    wire = ja.collective_bytes(step.lower(p, s, {**grads[0], **_stack(extra)}).compile())
    for g in grads:
      p, s = step(p, s, {**g, **_stack(extra)})
    runs.append((p, s, wire))
  (p0, s0, wire0), (p1, s1, wire1) = runs
  assert wire1 == wire0 and wire0  # the same payload: the empty leaf adds no byte
  np.testing.assert_array_equal(p1["a"], p0["a"])
  np.testing.assert_array_equal(s1.residual["a"], s0.residual["a"])
  assert p1["z"].shape == (REPLICAS, 0, 3) and s1.residual["z"].shape == (REPLICAS, 0, 3)


def test_bad_input_names_the_argument():
  for kw, match in [
    (dict(density=0.0), "density=0.0 must be in \\(0, 1\\]"),
    (dict(density=1.5), "density=1.5 must be in \\(0, 1\\]"),
    (dict(chunk=0), "chunk=0 must be an int >= 1"),
    (dict(bits=3), "bits=3 must be one of \\(2, 4, 8\\)"),
    (dict(beta=1.5), "beta=1.5 must be in \\[0, 1\\]"),
  ]:
    with pytest.raises(ValueError, match=match):
      ja.TopK(**kw)
  make = lambda **kw: ja.diloco(optax.sgd(0.1), optax.sgd(1.0), 4, axis_name="r", **kw)
  with pytest.raises(ValueError, match="error_feedback=False with compress=TopK"):
    make(compress=ja.TopK())
  with pytest.raises(ValueError, match="comm_dtype=dtype\\('float16'\\) and compress="):
    make(compress="topk", error_feedback=True, comm_dtype=jnp.float16)
  tx = make(compress=ja.TopK(chunk=64), error_feedback=True)
  with pytest.raises(ValueError, match="TopK\\(chunk=64\\) is larger than the leaf params\\['b'\\] of 40 elements"):
    tx.init({"a": jnp.zeros((8, 16)), "b": jnp.zeros(40)})
  assert ja.TopK(density=0.01, chunk=64).k == 1 and ja.TopK(density=0.03, chunk=64).k == 2
