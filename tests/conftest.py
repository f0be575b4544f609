"""Shared test setup: 8 simulated CPU devices and float64, before any device use."""

import os
import subprocess
import sys

# XLA:CPU aborts the process when the 8 device threads of a collective do not all
# arrive within 40 s; on an overloaded 2-core machine that can happen to a correct
# program. Wait longer (read at backend start; inherited by the demo, bench and
# notebook subprocesses). The flag exists in jaxlib >= 0.10.
#
# The suite is mostly compilation, and most of XLA:CPU's compile time is LLVM's
# optimisation of the emitted kernels. The tests' models are tiny, so their run
# time does not need it: LLVM at -O0 takes about a quarter off the default run on
# jax 0.10 and a tenth on jax 0.12. Subprocesses inherit it (the demo, examples,
# notebooks, quick bench), except the multi-process and fresh-process workers,
# which start from a clean XLA_FLAGS, and the figures check (xla_default_level_env). HLO
# passes (fusion, the all-reduce combiner, buffer assignment) are untouched, so
# collective counts and memory_analysis() are what users get. The level does not
# turn fast-math on (XLA:CPU's default is off; the NaN and Inf tests would see it).
for _FLAG in ("--xla_cpu_collective_call_terminate_timeout_seconds=600", "--xla_backend_optimization_level=0"):
  if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()


def xla_default_level_env() -> dict:
  """os.environ for a subprocess that reproduces the bench: LLVM at XLA's default level, not the suite's -O0.

  A float32 training run of hundreds of steps (the bench's held-out losses) ends a few 1e-3 apart at two
  LLVM levels, as the last bits of each step differ; the bench's figures are computed at the default level.
  """
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
  return dict(os.environ, XLA_FLAGS=" ".join(flags))


def run_module(module: str, *args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
  """`python -m module args...` in this interpreter, its output captured as text (the CLIs' tests)."""
  return subprocess.run(
    [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, **kwargs
  )


import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)


import jax.numpy as jnp
import numpy as np
import pytest


def mlp_init(key, sizes, dtype=jnp.float64):
  """Parameters of a small tanh MLP: a list of {"w", "b"} dicts."""
  params = []
  for k, (m, n) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:], strict=False), strict=False):
    params.append({"w": (jax.random.normal(k, (m, n)) / np.sqrt(m)).astype(dtype), "b": jnp.full((n,), 0.1, dtype)})
  return params


def mlp_apply(params, x):
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def mse_loss(params, batch):
  """Mean over the batch's rows of the squared error: the gradient of a union is the size-weighted mean."""
  x, y = batch
  return jnp.mean(jnp.sum((mlp_apply(params, x) - y) ** 2, axis=-1))


def regression_data(key, n, d_in=3, d_out=2, dtype=jnp.float64):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (n, d_in), dtype)
  y = jnp.sin(x @ jax.random.normal(ky, (d_in, d_out), dtype))
  return x, y


@pytest.fixture
def problem():
  """A float64 regression problem: (params, loss_fn, data of 120 rows)."""
  params = mlp_init(jax.random.PRNGKey(0), (3, 8, 2))
  return params, mse_loss, regression_data(jax.random.PRNGKey(1), 120)


def numbers_in(tree, path=""):
  """(path, number) for every int/float leaf of a JSON-like tree (a bench report): what its checks read."""
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from numbers_in(v, f"{path}.{k}")
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      yield from numbers_in(v, f"{path}[{i}]")
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    yield path, tree


def smoke(values, keep):
  """`values` as pytest params, all but those in `keep` marked slow: the default run keeps a smoke subset
  of a grid (each cell one compile), `.ci/run`'s slow step runs the rest. A tuple is one value per
  argname."""
  slow = lambda v: pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
  return [v if v in keep else slow(v) for v in values]


def remat_dense(annotate):
  """A dense layer as a custom_vjp(optimize_remat=True) whose primal and fwd annotate their output (issue 38)."""
  from jax.sharding import PartitionSpec as P

  f = jax.custom_vjp(lambda x, w: annotate(x @ w))
  f.defvjp(
    lambda x, w: (annotate(x @ w), (x, w)),
    lambda res, g: (g @ res[1].T, jnp.einsum("bi,bo->io", res[0], g, out_sharding=P())),
    optimize_remat=True,
  )
  return f


def pytest_collection_modifyitems(config, items):
  """`JAXACCUM_SLOW_SAMPLE="i/n"`: of each test file's slow tests (grid cells and single tests alike) keep every
  n-th, from the i-th.

  `.ci/run` runs the slow set sampled so that CI stays within its time (issue 49): every test file with slow
  tests still runs at least one of them (every kind of check: the examples, the notebooks, the multi-process
  jobs, the zoo, the fuzzers, the quick bench, the figures), and the offset i moves with the date, so n
  consecutive daily runs cover every slow test. `python -m pytest -m slow` (no variable) runs them all.
  """
  spec = os.environ.get("JAXACCUM_SLOW_SAMPLE", "")
  if not spec:
    return
  try:
    offset, every = (int(v) for v in spec.split("/"))
    if every < 1 or not 0 <= offset < every:
      raise ValueError
  except ValueError:
    raise pytest.UsageError(f"JAXACCUM_SLOW_SAMPLE={spec!r} must be 'i/n' with 0 <= i < n") from None
  groups: dict = {}
  for item in items:
    if item.get_closest_marker("slow") is not None:
      groups.setdefault(item.path, []).append(item)
  dropped = set()
  for tests in groups.values():
    keep = offset % len(tests)  # at least one per file
    dropped.update(id(t) for j, t in enumerate(tests) if (j - keep) % every != 0)
  if dropped:
    config.hook.pytest_deselected(items=[i for i in items if id(i) in dropped])
    items[:] = [i for i in items if id(i) not in dropped]
