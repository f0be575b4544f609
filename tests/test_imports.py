"""`import jaxaccum` stays light: orbax-checkpoint and flax.nnx load only when `ja.checkpoint` or
`ja.flax` is first used (each costs more to import than jax and optax together)."""

import subprocess
import sys

HEAVY = ("orbax.checkpoint", "flax.nnx", "jaxaccum.checkpoint", "jaxaccum.flax")


def _loaded_after(code: str) -> dict[str, bool]:
  """Which HEAVY modules are in sys.modules after running `code` in a fresh interpreter."""
  probe = f"import sys\n{code}\nprint(*[m in sys.modules for m in {HEAVY!r}])"
  proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  return dict(zip(HEAVY, [word == "True" for word in proc.stdout.split()], strict=True))


def test_import_jaxaccum_loads_neither_orbax_nor_flax_nnx():
  assert _loaded_after("import jaxaccum as ja; ja.accumulate, ja.make_train_step, ja.schedules") == dict.fromkeys(
    HEAVY, False
  )


def test_lazy_submodules_load_on_first_use_and_are_the_modules():
  loaded = _loaded_after(
    "import jaxaccum as ja, jaxaccum.checkpoint, jaxaccum.flax\n"
    "assert ja.checkpoint is jaxaccum.checkpoint and ja.flax is jaxaccum.flax\n"
    "assert callable(ja.checkpoint.save) and ja.flax.AccumulatingOptimizer.__module__ == 'jaxaccum.flax'\n"
    "assert {'checkpoint', 'flax'} <= set(dir(ja))"
  )
  assert loaded == dict.fromkeys(HEAVY, True)
  loaded = _loaded_after("import jaxaccum as ja; ja.checkpoint.restore")  # attribute access alone imports it
  assert loaded["orbax.checkpoint"] and loaded["jaxaccum.checkpoint"] and not loaded["jaxaccum.flax"]
