"""The documentation: every public name is in the API reference with a docstring, the pages and
links exist, and the Equinox guide's code runs as written (the full site is built, warnings as
errors, by .ci/run: `mkdocs build --strict`)."""

import importlib.util
import pathlib
import re

import jax

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


def test_equinox_guide_runs_as_written():
  text = (DOCS / "guides" / "equinox.md").read_text()
  code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
  assert "filter_value_and_grad" in code and "ja.accumulate" in code and "ja.microbatch" in code
  namespace = {"__name__": "equinox_guide"}
  exec(compile(code, "docs/guides/equinox.md", "exec"), namespace)  # the page's own asserts check the numbers
  assert jax.tree.leaves(namespace["grads_k"]) and namespace["diff"] < 1e-5
