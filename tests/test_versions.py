"""The tested JAX range (issue 37): declared once, checked at import, tested at both ends by .ci/run; private JAX
names in one module."""

import pathlib
import re
import subprocess
import sys
import tomllib
import warnings

import jax
import pytest

from jaxaccum import _versions

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pyproject_deps() -> dict[str, str]:
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  out = {}
  for d in deps:
    name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", d).groups()
    out[name.lower()] = spec.replace(" ", "")
  return out


@pytest.mark.parametrize(
  ("version", "spec", "want"),
  [
    ("0.10.2", ">=0.10.2,<0.13", True),
    ("0.11.2", ">=0.10.2,<0.13", True),
    ("0.12.0.1", ">=0.10.2,<0.13", True),
    ("0.10.1", ">=0.10.2,<0.13", False),
    ("0.13.0", ">=0.10.2,<0.13", False),
    ("0.13", ">=0.10.2,<0.13", False),
    ("0.12.9", "<0.12.9", False),
    ("0.4.38", ">=0.10.2", False),  # numerically, not as strings ("0.4" > "0.10" as text)
    ("0.10.2.dev20260101", ">=0.10.2,<0.13", True),
  ],
)
def test_in_range_compares_versions_numerically(version, spec, want):
  assert _versions.in_range(version, spec) is want


def test_the_declared_range_is_pyprojects_and_holds_this_jax():
  deps = _pyproject_deps()
  assert _versions.declared_jax_range() == deps["jax"]
  assert deps["jax"] == deps["jaxlib"]
  assert _versions.in_range(jax.__version__, deps["jax"]), (jax.__version__, deps["jax"])


def test_an_untested_jax_warns_once_naming_both_versions(monkeypatch):
  monkeypatch.setattr(jax, "__version__", "0.13.1")
  with pytest.warns(_versions.UntestedJaxWarning, match=r"jax>=0\.10\.2,<0\.13.*jax 0\.13\.1"):
    assert _versions.warn_if_untested()
  monkeypatch.setattr(jax, "__version__", "0.11.2")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert not _versions.warn_if_untested()


def test_importing_jaxaccum_on_a_tested_jax_warns_nothing():
  proc = subprocess.run(
    [sys.executable, "-W", "error::UserWarning", "-c", "import jaxaccum"], capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr


def test_the_lowest_constraints_are_the_declared_lower_bounds():
  """.ci/run's oldest run installs exactly the floor pyproject.toml declares."""
  deps = _pyproject_deps()
  pins = {}
  for line in (ROOT / ".ci" / "constraints-lowest.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      pins[name.lower()] = version
  floors = {n: re.search(r">=([0-9.]+)", s).group(1) for n, s in deps.items() if ">=" in s}
  as_tuple = lambda v: tuple(int(x) for x in v.split(".")) + (0,) * (3 - len(v.split(".")))
  assert {n: as_tuple(v) for n, v in pins.items()} == {n: as_tuple(v) for n, v in floors.items()}


def test_private_jax_names_live_in_one_module():
  users = sorted(
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "jaxaccum").rglob("*.py")
    if re.search(r"\bjax\._src\b|from jax\._src|import jax\._src", p.read_text())
  )
  assert users == ["jaxaccum/_jax_private.py"], users


def test_untested_jax_warning_is_public_and_filterable_by_category():
  """`jaxaccum.UntestedJaxWarning` (named in the README) is the class the import warns with: a filter can name it."""
  import warnings

  import jaxaccum
  from jaxaccum import _versions

  assert jaxaccum.UntestedJaxWarning is _versions.UntestedJaxWarning
  assert "UntestedJaxWarning" in jaxaccum.__all__
  with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    warnings.filterwarnings("ignore", category=jaxaccum.UntestedJaxWarning)
    warnings.warn("outside the range", jaxaccum.UntestedJaxWarning, stacklevel=1)
  assert got == []
