"""The documentation: every public name is in the API reference with a docstring, the pages and
links exist, and every ```python block of README.md and docs/ runs as written (the full site is
built, warnings as errors, by .ci/run: `mkdocs build --strict`).

How the snippets run: every Markdown page with ```python blocks (README.md, docs/*.md,
docs/guides/*.md: a new page or block is picked up by itself) is one test. Its blocks run in page
order in one namespace, as a reader pastes them, after `WORLD`: the names a snippet uses without
defining (`params`, `loss_fn`, `batch`, `loader`, ...) as a small float32 regression problem.
`SETUP[page][i]` runs just before block i when a block needs more or other names (a Flax model, a
loss with aux, a mesh-placed loader); it defines inputs only, never the code under test, and the
page's own asserts and the checks in `AFTER` check what came out. A snippet that needs a name
nobody defined fails with a NameError naming the page and line.
"""

import importlib.util
import pathlib
import re
import textwrap

import pytest

import jaxaccum as ja

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _hooks():
  spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_hooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_api_reference_lists_every_public_name_with_a_docstring():
  groups, modules = _hooks().public_api()
  listed = [name for _, names in groups for name in names] + modules
  assert sorted(listed) == sorted(ja.__all__)
  for module, names in groups:
    for name in names:
      obj = getattr(ja, name)
      assert obj.__module__ == module, (name, obj.__module__, module)
      assert (obj.__doc__ or "").strip(), f"ja.{name} has no docstring"
  for module in ("flax", "checkpoint", "schedules"):
    assert module in modules
    sub = getattr(ja, module)
    public = getattr(sub, "__all__", None)
    if public is None:  # no __all__: what the module itself defines without a leading underscore
      public = [
        n for n, v in vars(sub).items() if not n.startswith("_") and getattr(v, "__module__", "") == sub.__name__
      ]
    for name in public:
      assert (getattr(sub, name).__doc__ or "").strip(), f"ja.{module}.{name} has no docstring"
  markdown = _hooks().api_markdown()
  assert "::: jaxaccum.accumulate.accumulate" in markdown and "::: jaxaccum.schedules" in markdown


def _nav_pages(nav):
  for entry in nav:
    value = next(iter(entry.values())) if isinstance(entry, dict) else entry
    if isinstance(value, list):
      yield from _nav_pages(value)
    else:
      yield value


def test_every_page_in_the_nav_exists_and_every_guide_is_in_the_nav():
  text = (ROOT / "mkdocs.yml").read_text()
  pages = re.findall(r"^\s*- [^:\n]+: (\S+\.(?:md|ipynb))\s*$", text, re.M)
  assert "api.md" in pages and "guides/equinox.md" in pages
  for page in pages:
    assert (DOCS / page).is_file(), page
  for guide in (DOCS / "guides").glob("*.md"):
    assert f"guides/{guide.name}" in pages, guide.name


def test_readme_keeps_the_two_commands_and_its_links_resolve():
  readme = (ROOT / "README.md").read_text()
  assert 'pip install ".[examples]" && python -m jaxaccum.demo' in readme
  assert 'pip install ".[dev]" && python -m pytest -q' in readme
  for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
    if not target.startswith(("http://", "https://")):
      assert (ROOT / target).exists(), target
  for notebook in (
    "01_quickstart",
    "02_data_parallel",
    "03_batch_size_schedules",
    "04_from_keras_and_caffe",
    "05_sync_vs_async",
  ):
    assert f"notebooks/{notebook}.ipynb" in readme, notebook


# ---- every snippet runs as written ------------------------------------------------------------------------------

PAGES = sorted(
  p.relative_to(ROOT).as_posix()
  for p in [ROOT / "README.md", *DOCS.glob("*.md"), *DOCS.glob("guides/*.md")]
  if "```python" in p.read_text()
)

# What a snippet may use without defining it: a float32 regression problem with padded rows (mask 0),
# a batch of 64 rows and a loader of 8 microbatches of 8 rows (in each, the last 2 rows are padding).
WORLD = """
import functools
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jaxaccum as ja

def _batch(key, rows, d_in=4, d_out=3):
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (rows, d_in), jnp.float32)
    y = jnp.tanh(x @ jax.random.normal(ky, (d_in, d_out), jnp.float32))
    mask = jnp.ones((rows,), jnp.float32).at[rows - 2:].set(0.0)
    return {"x": x, "y": y, "mask": mask}

params = {"w": 0.1 * jnp.ones((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}

def loss_fn(params, batch):
    err = jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]) / jnp.maximum(batch["mask"].sum(), 1)

batch = _batch(jax.random.key(0), 64)
loader = [_batch(jax.random.key(1 + i), 8) for i in range(8)]
"""


def _linen(dropout: bool = True, train_arg: bool = True) -> str:
  """A linen `model` with BatchNorm (and Dropout) classifying 4 features into 10 classes; labels in "y"."""
  drop = "x = nn.Dropout(0.1, deterministic=not train)(x)" if dropout else ""
  signature = "x, train" if train_arg else "x, train=True"
  return f"""
import flax.linen as nn

class _Net(nn.Module):
    @nn.compact
    def __call__(self, {signature}):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x)))
        {drop}
        return nn.Dense(10)(x)

model = _Net()
loader = [dict(b, y=jnp.arange(len(b["x"])) % 10) for b in loader]
batch = dict(batch, y=jnp.arange(len(batch["x"])) % 10)
"""


# An Explicit data mesh and a loader placed on it (the own-jit snippets' setting).
_EXPLICIT = """
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

_mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
_rows = jax.sharding.NamedSharding(_mesh, P("data"))
batch = jax.device_put(_batch(jax.random.key(0), 64), _rows)
loader = [jax.device_put(_batch(jax.random.key(1 + i), 64), _rows) for i in range(2)]
batch_tokens = lambda b: b["mask"].sum()
"""

SETUP: dict[str, dict[int, str]] = {
  "docs/guides/accumulate.md": {
    2: "loader = [jax.tree.map(lambda a: a.reshape(8, 1, *a.shape[1:]), b) for b in loader[:4]]",  # (devices, rows)
    3: "loader = [_batch(jax.random.key(10 + i), 16) for i in range(4)]",
    4: "mesh = ja.data_mesh()\nparams = ja.replicate(params, mesh)\ntx = ja.accumulate(optax.adam(1e-3), every_k=4)",
  },
  "docs/guides/checkpoint.md": {
    0: "opt_state = optax.adam(1e-3).init(params)",
    2: "main = lambda: None",  # the process's main (block 1 is the real one: it needs jax.distributed)
    3: (
      "tx = ja.accumulate(optax.adam(1e-3), every_k=4)\npath = 'ckpt/old'\n"
      "_s = tx.init(params)\nja.checkpoint.save(path, (params, {f: getattr(_s, f) for f in _s._fields "
      "if f not in ('num_empty_windows', 'noise_stats')}))"  # a checkpoint of the old layout
    ),
  },
  "docs/guides/examples.md": {
    0: _linen(dropout=False, train_arg=False)
    + """
K = 2
variables = model.init(jax.random.key(0), batch["x"], train=False)
params, batch_stats = variables["params"], variables["batch_stats"]
batch = {"image": batch["x"], "label": batch["y"]}
tx = optax.sgd(0.1, momentum=0.9)
cross_entropy_loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
weight_penalty = lambda params: 1e-4 * sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params))
metrics_of = lambda logits, labels: {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}
""",
  },
  "docs/guides/flax.md": {0: _linen()},
  "docs/guides/lowcomm.md": {3: "batches = [jax.device_get(batch)]"},  # host rows: the wrapper lays them out
  "docs/guides/microbatch.md": {
    0: "loss_fn = lambda params, batch: (world_loss(params, batch), {'rows': batch['mask'].sum()})",
    1: "import flax.linen as nn\nbatch = dict(batch, y=jnp.arange(64) % 10)\nmodel = nn.Dense(10)\n"
    + "params = model.init(jax.random.key(0), batch['x'])\n"
    + "batch = {'image': batch['x'], 'label': batch['y']}",
    2: "params = jnp.ones((4,))\nbatch = dict(_batch(jax.random.key(0), 64))\nbatch['y'] = batch['y'][:, 0]\n"
    + "x_tm, y = batch['x'].T, batch['y']",  # a linear model on a vector of 4 weights
    # 3: the nnx block is self-contained
    4: "loss_fn = world_loss\nparams = {'w': 0.1 * jnp.ones((4, 3)), 'b': jnp.zeros((3,))}\n"
    + "batch = _batch(jax.random.key(0), 64)",
    5: _EXPLICIT + "tx = optax.adam(1e-3)",
    6: "batch = _batch(jax.random.key(0), 64)",  # on no mesh again
  },
  "docs/guides/noise.md": {0: "grads = jax.grad(loss_fn)(params, batch)\nnum_examples = batch['mask'].sum()"},
  "docs/guides/own-jit.md": {0: _EXPLICIT, 1: "optimizer = optax.adam(1e-3)"},
  "docs/guides/per-example.md": {
    0: "clip = lambda g: jax.tree.map(lambda x: x / jnp.maximum(1.0, optax.tree.norm(g)), g)",
    1: (
      "import examples_dp_sgd_names as _dp\n"
      "K, A, P, sigma, C, L, lr = 2, 3, 8, 1.5, 1.0, 24, 5e-3\nnoise_key = jax.random.key(3)\n"
      "noisy_normalized_sum = _dp.noisy_normalized_sum"
    ),
  },
  "docs/guides/train-step.md": {
    0: "loader = [_batch(jax.random.key(10 + i), 32) for i in range(2)]",
    1: (
      "state = {'scale': jnp.ones((), jnp.float32)}\n"
      "loss_fn = lambda params, state, batch: (world_loss(params, batch) * state['scale'], "
      "{'scale': state['scale'] * 0.5})"
    ),
    2: _linen(dropout=False),
    3: """
from flax import nnx

class _NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.dense(x))))

model = _NnxNet(nnx.Rngs(0))
""",
    4: """
import equinox as eqx

class Net(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 3, key=key)
        self.norm = eqx.nn.BatchNorm(3, axis_name="batch", mode="ema")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)

batch = _batch(jax.random.key(0), 32)
""",
    5: "microbatches = [_batch(jax.random.key(20 + i), 4) for i in range(3)]\nloss_fn = world_loss\n"
    + "params = {'w': 0.1 * jnp.ones((4, 3)), 'b': jnp.zeros((3,))}\nopt_state = optax.adam(1e-3).init(params)",
    6: "loss_fn = world_loss\nparams = {'w': 0.1 * jnp.ones((4, 3)), 'b': jnp.zeros((3,))}\n"
    + "batch = _batch(jax.random.key(0), 64)",
  },
}

# Checks after a page's last block, on the namespace it left (its own asserts run inside it).
AFTER: dict[str, str] = {
  "README.md": "assert int(state.update_count) == len(loader) // 4 and bool(jnp.all(jnp.isfinite(params['w'])))",
  "docs/guides/equinox.md": "assert jax.tree.leaves(grads_k) and diff < 1e-5",
}


def _python_blocks(page: str) -> list[tuple[int, str]]:
  """(first line number, code) of every fenced ```python block of `page`, indented ones (lists, admonitions) too."""
  text = (ROOT / page).read_text()
  blocks = []
  for match in re.finditer(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", text, re.M | re.S):
    line = text.count("\n", 0, match.start()) + 2
    blocks.append((line, textwrap.dedent(match.group(2))))
  return blocks


def test_every_page_with_python_blocks_is_found():
  assert {"README.md", "docs/getting-started.md", "docs/guides/accumulate.md", "docs/guides/flax.md"} <= set(PAGES)
  assert len(_python_blocks("docs/guides/accumulate.md")) >= 4  # the indented one inside an admonition too
  for page, setups in SETUP.items():  # a setup for a block that moved or went away is stale
    assert page in PAGES and max(setups) < len(_python_blocks(page)), page


@pytest.mark.parametrize("page", PAGES)
def test_snippets_run_as_written(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # what a snippet writes (a checkpoint) lands in a temporary folder
  monkeypatch.syspath_prepend(str(tmp_path))
  (tmp_path / "examples_dp_sgd_names.py").write_text(_dp_sgd_names())
  namespace = {"__name__": "docs_snippet"}
  exec(compile(WORLD, "WORLD", "exec"), namespace)
  namespace["world_loss"] = namespace["loss_fn"]
  setups = SETUP.get(page, {})
  for i, (line, code) in enumerate(_python_blocks(page)):
    if i in setups:
      exec(compile(textwrap.dedent(setups[i]), f"SETUP[{page!r}][{i}]", "exec"), namespace)
    # "\n" * (line - 1): a traceback names the page and the line of the Markdown file
    exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)
  if page in AFTER:
    exec(compile(AFTER[page], f"AFTER[{page!r}]", "exec"), namespace)


def _dp_sgd_names() -> str:
  """examples/dp_sgd.py's `noisy_normalized_sum`, the only piece the per-example guide leaves to the example,
  taken from the example's source (running the example itself parses argv and trains)."""
  source = (ROOT / "examples" / "dp_sgd.py").read_text()
  start = source.index("def gaussian_noise(")
  end = source.index("\n\n\n", source.index("def noisy_normalized_sum("))
  return (
    "from typing import NamedTuple\n\nimport jax\nimport jax.numpy as jnp\nimport optax\n\n" + source[start:end] + "\n"
  )
