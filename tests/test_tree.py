"""jaxaccum._tree: the finite check every step's skip reads (`all_finite`, `nonfinite_probe`).

Against NumPy's `isfinite` over every dtype a gradient leaf can have, a Python
scalar leaf, an empty one, and values whose sum overflows (the probe must not).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccum import _tree

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.complex64, jnp.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_all_finite_matches_numpy_and_never_overflows(dtype, bad):
  big = float(jnp.finfo(dtype).max)  # the sum of these overflows: the check must still say finite
  x = np.full((5, 3), big / 2, np.float64)
  if bad is not None:
    x[3, 1] = bad
  leaf = jnp.asarray(x, dtype)
  want = bool(
    np.all(np.isfinite(np.asarray(leaf.astype(jnp.complex128 if "complex" in str(leaf.dtype) else jnp.float64))))
  )
  assert bool(_tree.all_finite({"a": leaf, "b": jnp.ones(2, dtype)})) == want
  assert bool(jax.jit(_tree.all_finite)({"a": leaf})) == want


def test_all_finite_on_integers_bools_python_scalars_and_empty_leaves():
  assert bool(_tree.all_finite({"i": jnp.arange(3), "b": jnp.ones(2, bool), "e": jnp.zeros((0, 4))}))
  assert bool(_tree.all_finite({"w": 1.0, "n": 3}))
  assert not bool(_tree.all_finite({"w": 1.0, "x": float("nan")}))
  assert bool(_tree.all_finite({}))
  c = jnp.asarray([1 + 1j, complex(0, np.inf)], jnp.complex64)  # an infinite imaginary part alone
  assert not bool(_tree.all_finite([c]))
