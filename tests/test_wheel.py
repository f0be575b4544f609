"""The built wheel installs into a fresh venv and imports, with py.typed and the bench subpackage inside.

`.ci/run` builds the sdist and wheel first (`python -m build`) and points JAXACCUM_DIST at them;
without it the test builds a wheel itself from a copy of the sources (pip's isolated build, as
`python -m build` does: setuptools comes from pip's cache or the index). The fresh venv gets the
wheel with `--no-deps`; jax and the other dependencies come from this interpreter's
site-packages, added after the venv's own, so `import jaxaccum` must find the wheel's copy
(checked) and nothing else is installed.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _version() -> str:
  text = (ROOT / "jaxaccum" / "__init__.py").read_text()
  return re.search(r'^__version__ = "([^"]+)"$', text, re.M).group(1)


def _wheel(tmp_path) -> pathlib.Path:
  dist = os.environ.get("JAXACCUM_DIST")
  if dist:
    wheels = sorted(pathlib.Path(dist).glob(f"jaxaccum-{_version()}-*.whl"))
    assert len(wheels) == 1, (dist, wheels)
    return wheels[0]
  src = tmp_path / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md", "CHANGELOG.md"):
    shutil.copy(ROOT / name, src / name)
  shutil.copytree(ROOT / "jaxaccum", src / "jaxaccum", ignore=shutil.ignore_patterns("__pycache__"))
  proc = subprocess.run(
    [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(src)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  (wheel,) = (tmp_path / "dist").glob("jaxaccum-*.whl")
  return wheel


@pytest.mark.slow  # builds a wheel (pip) and imports it from a fresh venv
def test_wheel_installs_in_a_fresh_venv_and_imports(tmp_path):
  wheel = _wheel(tmp_path)
  names = set(zipfile.ZipFile(wheel).namelist())
  assert "jaxaccum/py.typed" in names
  assert {"jaxaccum/bench/__init__.py", "jaxaccum/bench/__main__.py", "jaxaccum/bench/common.py"} <= names
  assert not [n for n in names if n.startswith(("tests/", "docs/", "notebooks/")) or "/_bench_" in n], names
  assert wheel.name.startswith(f"jaxaccum-{_version()}-")

  env_dir = tmp_path / "venv"
  venv.EnvBuilder(with_pip=False).create(env_dir)
  python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
  purelib = subprocess.run(
    [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  proc = subprocess.run(
    [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "Successfully installed jaxaccum" in proc.stdout, proc.stdout[-2000:]
  # Then this interpreter's packages (jax, optax, ...), after the venv's own (added only now:
  # pip would take a jaxaccum of this environment for the wheel, already installed). A plain
  # path, so no .pth of this environment (an editable jaxaccum's finder) is processed.
  outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  pathlib.Path(purelib, "_outer_site.pth").write_text("\n".join(sorted(outer)) + "\n")

  check = (
    "import importlib.resources, pathlib, jaxaccum as ja\n"
    "print(pathlib.Path(ja.__file__).resolve())\n"
    "print(ja.__version__)\n"
    "print(importlib.resources.files('jaxaccum').joinpath('py.typed').is_file())\n"
    "print(callable(ja.accumulate) and callable(ja.flax.TrainState.create))\n"
  )
  proc = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  location, version, typed, api = proc.stdout.split()
  assert pathlib.Path(location).is_relative_to(pathlib.Path(purelib).resolve()), location
  assert (version, typed, api) == (_version(), "True", "True")
  proc = subprocess.run(
    [str(python), "-m", "jaxaccum.bench", "--help"], capture_output=True, text=True, timeout=300, cwd=tmp_path
  )
  assert proc.returncode == 0 and "--quick" in proc.stdout, proc.stderr[-3000:]
