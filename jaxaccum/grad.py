"""ja.grad / ja.value_and_grad: gradients left unreduced over the data axis, for the user's own jit step.

On a mesh with Explicit axes, inside the user's `jax.jit`, `jax.grad` of a loss
on a batch sharded over "data" comes back already all-reduced: the partitioner
inserted one all-reduce per call. Accumulated over K calls (`ja.accumulate`,
`optax.MultiSteps`) that is K all-reduces per update. `ja.grad` returns the same
gradient *unreduced* (typed `{U:data}`): each device holds its share

    g_d = (W_d / W) * grad L_d,   W_d = weight_fn(rows of device d) (default 1),  W = sum_d W_d,

where L_d is `fun` on device d's rows. Summed over devices, sum_d g_d is the
gradient of the W-weighted mean loss over the call's global batch: with L a
mean over rows and equal rows per device (or `weight_fn` = the rows or tokens
of each device's share), exactly `jax.grad(fun)` on the whole batch. Nothing
params-sized crosses the wire: only the scalar W (and the value, and aux, all
reduced with scalar collectives). `ja.accumulate(..., axis_name="data")` keeps
the sum unreduced across calls and reduces once per window; `jax.reshard(g, P())`
reduces by hand.

How: a `jax.shard_map` manual over the mesh axis runs `fun` on each device's rows
with the differentiated arguments cast to varying (so autodiff does not psum),
then casts the local gradient to unreduced (`out_specs=P(unreduced={axis})`).
JAX 0.10 limits (see `_unreduced`): the mesh's other axes must have size 1, and
Auto meshes have no unreduced type; both give a ValueError that says what to use
instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxaccum import _unreduced, parallel


def _argnums_tuple(argnums) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums) if isinstance(argnums, Sequence) else None
  if not nums or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nums):
    raise TypeError(f"argnums={argnums!r} must be a non-negative int or a non-empty sequence of them")
  return nums


def _spec_of(x) -> P:
  """The sharding spec `x` has here (P() for a value without one); unreduced/reduced parts dropped."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return P() if spec is None else P(*spec.partitions)  # `*spec` is refused with an unreduced/reduced set


def value_and_grad(
  fun: Callable,
  argnums: int | Sequence[int] = 0,
  *,
  axis_name: str,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
) -> Callable:
  """`jax.value_and_grad` whose gradient is left unreduced over `axis_name` (see the module docstring).

  Args:
    fun: the loss, `fun(*args) -> scalar` (or `(scalar, aux)` with `has_aux`),
      written for any number of rows: it runs on each device's rows.
    argnums: which positional arguments to differentiate (int or sequence).
      They are replicated inside (a leaf sharded over the axis is gathered).
    axis_name: the Explicit mesh axis the batch is sharded over, e.g. "data".
    has_aux: `fun` returns (loss, aux); aux (floating leaves only) comes back
      as the weighted mean over devices, like the loss.
    weight_fn: None (each device's share weighs 1: right for a mean loss with
      equal rows per device) or `weight_fn(batch) -> scalar`, `batch` the local
      rows of the arguments not in `argnums` (the one argument itself, or a
      tuple of several): e.g. the number of real tokens, so that padding or
      unequal shares weigh what they hold. A weight of 0 everywhere gives a
      zero gradient and a NaN value.

  Returns:
    A function of `fun`'s arguments returning `(value, grads)` (`((value, aux),
    grads)` with `has_aux`): value and aux replicated, grads unreduced over
    `axis_name` (typed `{U:axis}`), in the structure of the argument(s) in `argnums`.

  Raises:
    ValueError: `axis_name` bound by an enclosing pmap/shard_map (use
      `jax.grad` there, on parameters cast to varying), not an Explicit axis of
      the mesh, or a mesh with another axis of size > 1 (JAX 0.10); each says
      what to use instead. TypeError: bad `argnums`, `weight_fn` not callable,
      a non-floating aux leaf, a non-scalar loss.
  """
  if not callable(fun):
    raise TypeError(f"fun={fun!r} must be callable")
  nums = _argnums_tuple(argnums)
  if not isinstance(axis_name, str) or not axis_name:
    raise TypeError(f"{axis_name=} must be a mesh axis name (a non-empty string)")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn={weight_fn!r} must be callable (batch -> scalar weight) or None")
  if not isinstance(has_aux, bool):
    raise TypeError(f"{has_aux=} must be a bool")

  def wrapped(*args):
    if max(nums) >= len(args):
      raise TypeError(f"argnums={argnums!r} names argument {max(nums)}, but the call has {len(args)}")
    if _unreduced.is_bound(axis_name):
      raise ValueError(
        f"ja.grad: {axis_name=} is bound by an enclosing pmap/shard_map: there, use jax.grad on parameters cast "
        f"to varying (jax.lax.pcast(params, {axis_name!r}, to='varying')) and ja.accumulate(..., axis_name=)"
      )
    mesh = _unreduced.explicit_mesh(axis_name, args, what="ja.grad")
    leaves, treedef = jax.tree.flatten(list(args))
    is_array = [isinstance(x, (jax.Array, jnp.ndarray)) or hasattr(x, "__jax_array__") for x in leaves]
    arrays = [x for x, a in zip(leaves, is_array, strict=True) if a]
    # Which flat leaves belong to differentiated arguments: replicated inside.
    owner = jax.tree.flatten([[i] * len(jax.tree.leaves(a)) for i, a in enumerate(args)])[0]
    diff_leaf = [o in nums for o, a in zip(owner, is_array, strict=True) if a]
    specs = [P() if d else _spec_of(x) for x, d in zip(arrays, diff_leaf, strict=True)]

    def rebuild(array_values):
      it = iter(array_values)
      return jax.tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)])

    def body(*local_args):
      local = [lax.pcast(x, axis_name, to="varying") if d else x for x, d in zip(local_args, diff_leaf, strict=True)]
      full = rebuild(local)
      diff = tuple(full[i] for i in nums)

      def loss_of(*d):
        call = list(full)
        for i, v in zip(nums, d, strict=True):
          call[i] = v
        return fun(*call)

      out, grads = jax.value_and_grad(loss_of, argnums=tuple(range(len(nums))), has_aux=has_aux)(*diff)
      loss, aux = out if has_aux else (out, None)
      if jnp.ndim(loss) != 0:
        raise TypeError(f"fun must return a scalar loss, got shape {jnp.shape(loss)}")
      if weight_fn is None:
        # Equal shares: 1/n, known here, so no scalar collective for the total.
        share = lax.pcast(jnp.asarray(1 / lax.axis_size(axis_name), jnp.result_type(loss)), axis_name, to="varying")
      else:
        rest = [full[i] for i in range(len(full)) if i not in nums]
        w_local = jnp.asarray(weight_fn(rest[0] if len(rest) == 1 else tuple(rest)), jnp.result_type(loss))
        w_local = lax.pcast(w_local, axis_name, to="varying") if axis_name not in _vma(w_local) else w_local
        total = lax.psum(w_local, axis_name)  # a scalar: the only collective of a micro-step
        share = w_local / jnp.where(total > 0, total, jnp.ones_like(total))
      value = lax.psum(share * loss, axis_name)
      if has_aux:
        aux = jax.tree.map(lambda x, p: _mean_aux(x, share, p), aux, _paths(aux))
      grads = jax.tree.map(lambda g: lax.pcast(g * share.astype(g.dtype), axis_name, to="unreduced"), grads)
      grads = grads[0] if isinstance(argnums, int) else grads
      return ((value, aux) if has_aux else value), grads

    # A differentiated leaf sharded over the axis (FSDP-style) is gathered once here: each device's loss needs
    # all of it. Its gradient comes back unreduced at full size; ja.accumulate reduce-scatters it at the window end.
    arrays = [
      jax.reshard(x, P()) if d and any(a is not None for a in _spec_of(x)) else x
      for x, d in zip(arrays, diff_leaf, strict=True)
    ]
    out_specs = ((P(), P()) if has_aux else P(), P(unreduced={axis_name}))
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs)(*arrays)

  return wrapped


def grad(
  fun: Callable,
  argnums: int | Sequence[int] = 0,
  *,
  axis_name: str,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
) -> Callable:
  """`jax.grad` whose result is left unreduced over `axis_name`: `ja.value_and_grad` without the value.

  Returns grads (or `(grads, aux)` with `has_aux`). See `value_and_grad`.
  """
  vg = value_and_grad(fun, argnums, axis_name=axis_name, has_aux=has_aux, weight_fn=weight_fn)

  def wrapped(*args):
    out, grads = vg(*args)
    return (grads, out[1]) if has_aux else grads

  return wrapped


def _vma(x) -> frozenset:
  return parallel._varying_axes(x) or frozenset()  # noqa: SLF001 -- the one reader of this JAX's typing


def _paths(tree):
  return jax.tree.unflatten(jax.tree.structure(tree), _tree_paths(tree))


def _tree_paths(tree):
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _mean_aux(x, share, path):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
      f"aux{path} has dtype {x.dtype}: ja.grad returns aux as the weighted mean over devices, which needs "
      "floating leaves (return a count as a float, or sum it yourself)"
    )
  if axis_vary := _vma(share) - _vma(x):
    x = lax.pcast(x, tuple(axis_vary), to="varying")
  return lax.psum(share.astype(x.dtype) * x, tuple(_vma(share)))
