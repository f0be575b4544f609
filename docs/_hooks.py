"""MkDocs hook: the API reference lists every public name, read from the package itself.

`docs/api.md` holds the marker `<!-- public-api -->`; this hook replaces it with one
mkdocstrings block per name in `jaxaccum.__all__`, grouped by the module that defines it,
and one block per public submodule (`ja.flax`, `ja.checkpoint`, `ja.schedules`) with its
members. A name added to `__all__` appears in the reference without editing the docs, and
with `mkdocs build --strict` a name whose docstring or reference does not resolve fails the
build. The package is read with `ast` (nothing imported, no device touched).
"""

from __future__ import annotations

import ast
import pathlib

MARKER = "<!-- public-api -->"
ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxaccum" / "__init__.py"


def public_api(init: pathlib.Path = PACKAGE) -> tuple[list[tuple[str, list[str]]], list[str]]:
  """Returns ([(defining module, [names])] in `__all__` order, [public submodules])."""
  tree = ast.parse(init.read_text())
  origin: dict[str, str] = {}
  submodules: set[str] = set()
  names: list[str] = []
  # Top-level statements and those under a top-level `if` (`if TYPE_CHECKING:` names the lazy submodules).
  body = [n for top in tree.body for n in (top.body if isinstance(top, ast.If) else [top])]
  for node in body:
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxaccum"):
      for alias in node.names:
        if node.module == "jaxaccum":
          submodules.add(alias.asname or alias.name)
        else:
          origin[alias.asname or alias.name] = node.module
    elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
      names = list(ast.literal_eval(node.value))
  groups: dict[str, list[str]] = {}
  modules = []
  for name in names:
    if name in submodules:
      modules.append(name)
    else:
      groups.setdefault(origin.get(name, "jaxaccum"), []).append(name)
  return list(groups.items()), modules


def api_markdown() -> str:
  groups, modules = public_api()
  out = []
  for module, names in groups:
    out.append(f"## `{module}`\n")
    # The defining path, not `jaxaccum.<name>`: `accumulate` and `microbatch` are both a
    # submodule and the function it defines, and the submodule would win.
    out += [
      f'::: {module}.{name}\n    options:\n      heading: "ja.{name}"\n      toc_label: "ja.{name}"\n' for name in names
    ]
  for module in modules:
    out.append(f"## `ja.{module}`\n")
    out.append(f"::: jaxaccum.{module}\n    options:\n      show_root_heading: false\n      heading_level: 3\n")
  return "\n".join(out)


def on_page_markdown(markdown, page, **kwargs):
  if MARKER in markdown:
    return markdown.replace(MARKER, api_markdown())
  return markdown
