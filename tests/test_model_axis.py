"""Issue 39: a model axis costs what it costs in the plain `jit` + `lax.scan` step, under every strategy.

Per update, collectives over the model axis (count and ring bytes, loop trip counts included) of
`make_train_step` against the plain step on the same (data=4, model=2) mesh and model
(`jaxaccum.bench.model_axis`: a Llama-style decoder written for explicit sharding on an Explicit mesh, JAX's
miniGPT tutorial model (Flax nnx) and the MaxText layer port on Auto ones), allowing the skip's finite check
(one 4-byte all-reduce); no model-sharded leaf gathered whole over the model axis; fsdp "once" beside a model
axis packs its gathers. The default run keeps a few K=1 cells of the Llama-style and Gemma-style models; the
grid is slow.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from conftest import smoke
from zoo import gemma_style

from jaxaccum import _hlo, hlo
from jaxaccum.bench import model_axis as ma

STEPS = ("ddp", "zero1", "fsdp per_microbatch", "fsdp once")

# The one collective the plain step does not run: the skip's finite check (a step whose mean gradient holds a NaN
# or an Inf is not applied; the plain step has no check). Each device counts its own blocks' non-finite entries
# and ONE float32 sum is all-reduced over the axes the gradients are split over (`_engine._finite`): one
# collective, 4 bytes, at most 2 x 4 ring bytes sent per device. Before, one pred per "model"-sharded leaf.
FINITE_CHECK = (1, 2 * 4.0)
# Cells still above the plain step (slow grid only): the miniGPT's fsdp per_microbatch at K=4, 179 collectives over
# "model" against 186 but 126.1 KiB against 122.4 (1.03x). The tutorial's annotations put its attention kernels
# in a layout their einsums do not use (the output kernel split on head_dim, the query/key/value ones relaid
# for the backward einsum), so the partitioner relays each gathered kernel out over "model" (an all-to-all of
# 2 KiB) where it is used. The plain step (and fsdp "once") does that once per step, the parameters being
# loop-invariant; gathered per microbatch, the kernel is relaid per microbatch: 2 layers x 2 x (K - 1) more
# (24 KiB at K=4). Doing it on the shard, before the loop, needs the layout the partitioner picks there.
KNOWN = {("minigpt", 4, "fsdp per_microbatch")}

_CACHE: dict = {}


def _model(name):
  if name not in _CACHE:
    made = {
      "llama": ma.llama_model,
      "minigpt": ma.minigpt_model,
      "maxtext": ma.maxtext_model,
      "gemma": gemma_style.model,
    }[name](jnp.float32)
    if made is None:
      pytest.skip("examples/port_maxtext_layer.py is not beside the package, or Flax is not installed")
    _CACHE[name] = made
  return _CACHE[name]


class _Steps(dict):
  """{step name: compiled}, each compiled on first use (the default run compiles only what its cells read)."""

  def __init__(self, name, k):
    super().__init__()
    self.name, self.k = name, k

  def __missing__(self, step):
    _, loss, params, batch, mesh = _model(self.name)
    self[step] = ma.compiled_steps(loss, params, batch, mesh, self.k, names=(step,))[step]
    return self[step]


def _steps(name, k):
  return _CACHE.setdefault((name, k), _Steps(name, k))


def _whole_model_leaf_gathers(compiled, mesh, params) -> list[str]:
  """All-gathers over the model axis whose result is a whole model-sharded parameter's shape."""
  shapes = set()
  for x in jax.tree.leaves(params):
    if any(e is not None for e in x.sharding.spec):
      shapes.add(tuple(x.shape))
  coords = hlo._mesh_coords(compiled, True, mesh)
  found = []
  for line in compiled.as_text().splitlines():
    m = re.search(r"= \w+\[([0-9,]*)\]\{[^}]*\} all-gather(?:-start)?\(", line)
    if not m:
      continue
    axes = _hlo.spanned_axes("all-gather", line, coords, tuple(mesh.axis_names))
    shape = tuple(int(d) for d in m.group(1).split(",") if d)
    if "model" in ((axes,) if isinstance(axes, str) else axes) and shape in shapes:
      found.append(line.strip()[:160])
  return found


def _finite_checks(compiled, mesh) -> int:
  """Scalar float32 all-reduces over the model axis (alone or with the data axis): the finite check's."""
  coords = hlo._mesh_coords(compiled, True, mesh)
  found = 0
  for line in compiled.as_text().splitlines():
    if re.search(r"= f32\[\] all-reduce(?:-start)?\(", line):
      axes = _hlo.spanned_axes("all-reduce", line, coords, tuple(mesh.axis_names))
      found += "model" in ((axes,) if isinstance(axes, str) else axes)
  return found


# "gemma": a Gemma-style decoder in the layout of Flax's Gemma example's fsdp + tensor-parallel config
# (tests/zoo/gemma_style.py). Issue 49 reported ddp and zero1 at 512 bytes over "model" above the plain step on
# Flax's own example; on this config (and on that example, rebuilt from its files: 8 configurations) both
# send fewer bytes over "model" than the plain step. Held here, in the default run, for ddp and zero1.
MODELS = ("llama", "minigpt", "maxtext", "gemma")
CELLS = [(m, k, s) for m in MODELS for k in (1, 4) for s in STEPS]
DEFAULT_RUN = {("llama", 1, "ddp"), ("llama", 1, "fsdp once"), ("gemma", 1, "ddp"), ("gemma", 1, "zero1")}


@pytest.mark.parametrize(("model", "k", "step"), smoke(CELLS, keep=DEFAULT_RUN))
def test_model_axis_no_more_than_plain(model, k, step, request):
  """Against the plain step, allowing the finite check; against the plain step with the same guarantee (its
  update in a `lax.cond` on finite gradients, whose check the partitioner reduces over "model" too), none."""
  if (model, k, step) in KNOWN:
    request.applymarker(pytest.mark.xfail(reason="above the plain step still (see KNOWN)", strict=False))
  _, _, params, _, mesh = _model(model)
  steps = _steps(model, k)
  base_n, base_b = ma.by_axis(steps["plain"], mesh, "model")
  n, b = ma.by_axis(steps[step], mesh, "model")
  check_n, check_b = FINITE_CHECK
  assert n <= base_n + check_n, f"{step}: {n} collectives over 'model' per update, the plain step {base_n} (+1 check)"
  assert b <= base_b + check_b, f"{step}: {b:.0f} bytes over 'model' per update, the plain step {base_b:.0f} (+ check)"
  checks = _finite_checks(steps[step], mesh) - _finite_checks(steps["plain"], mesh)
  assert checks == 1, f"{step}: the finite check, {checks} scalar all-reduces over 'model' (one)"
  skip_n, skip_b = ma.by_axis(steps["plain + skip"], mesh, "model")
  assert n <= skip_n, f"{step}: {n} collectives over 'model' per update, the plain step with the skip {skip_n}"
  assert b <= skip_b, f"{step}: {b:.0f} bytes over 'model' per update, the plain step with the skip {skip_b:.0f}"


def test_the_plain_step_with_the_skip_keeps_everything_on_a_non_finite_gradient():
  """The reference: applied on finite gradients, and nothing changes on a non-finite one (the model axis's
  Llama-style model, sharded over "data" and "model")."""
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  _, loss, params, batch, mesh = _model("llama")
  opt = optax.adam(1e-2)
  with jax.set_mesh(mesh):
    rows = jax.device_put(batch, NamedSharding(mesh, P("data")))
    state = opt.init(params)
    step = ma.plain_step(loss, opt, 1, params, state, skip=True)
    new, new_state, value = step(params, state, rows)
    assert np.isfinite(float(value))
    assert not np.allclose(new["unembed"], params["unembed"])  # finite: applied
    # A NaN in the final norm's scale: every logit, so the loss and every gradient, is NaN.
    bad = {**params, "norm": params["norm"].at[0].set(jnp.nan)}
    new, new_state, value = step(bad, state, rows)
  assert np.isnan(float(value))
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(bad), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(new_state[0].count) == 0  # adam's step count: not advanced


@pytest.mark.parametrize(("model", "k", "step"), smoke(CELLS, keep={("llama", 1, "ddp")}))
def test_no_model_sharded_leaf_gathered_whole(model, k, step):
  _, _, params, _, mesh = _model(model)
  found = _whole_model_leaf_gathers(_steps(model, k)[step], mesh, params)
  # None where the plain step has none (the Llama-style model, the MaxText port). The miniGPT tutorial's own
  # annotations make the plain step gather some (linear2's kernel, (None, "model"), and its gradient: three
  # f32[64,32] all-gathers at K=1), and its activations share leaf shapes ([4,8,32], the attention output's
  # kernel): there, no more than the plain step.
  assert len(found) <= len(_whole_model_leaf_gathers(_steps(model, k)["plain"], mesh, params)), found


@pytest.mark.parametrize(("model", "k"), smoke([(m, k) for m in MODELS for k in (1, 4)], keep={("llama", 1)}))
def test_fsdp_once_packs_its_gathers_beside_a_model_axis(model, k):
  """One all-gather and one reduce-scatter over the data axis per update, as with no model axis (17 of each
  before, one per leaf, for the MaxText port)."""
  _, _, _, _, mesh = _model(model)
  counts = hlo.count_collectives(_steps(model, k)["fsdp once"], by_axis=True, mesh=mesh)
  data = counts.get("data", {})
  assert data.get("all-gather", 0) == 1, counts
  assert data.get("reduce-scatter", 0) == 1, counts
