"""plan_microbatches(): the smallest number of microbatches whose compiled step fits in memory.

XLA reports, for a compiled executable, the bytes of its arguments, outputs,
aliased (donated) buffers and temporaries. A step's footprint on one device is

  total = arguments + outputs - aliases + temp,

which is known after compilation, before anything runs: no out-of-memory crash
is needed to find K. Microbatching trades K sequential steps for activations
(temp) K times smaller, so the smallest K that fits is the fastest that fits.
"""

from __future__ import annotations

import collections.abc
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _tree


class MicrobatchPlan(int):
  """The chosen K, an `int`, carrying the compiled totals that led to it.

  Attributes:
    totals: {K: total bytes} for every candidate compiled, in the order tried
      (ascending K, stopping at the first that fits); with `step_options`,
      keyed by (K, index of the options).
    memory_bytes: the total of the chosen K.
    budget_bytes: the budget it was chosen for.

    step_options: with `step_options`, the keyword arguments of the chosen
      step (e.g. `{"fsdp_gather": "once"}`); None otherwise.
  """

  totals: dict
  memory_bytes: int
  budget_bytes: int
  step_options: dict | None

  def __new__(cls, k: int, totals: dict, budget: int, key: Any = None, step_options: dict | None = None):
    self = super().__new__(cls, k)
    self.totals = dict(totals)
    self.memory_bytes = totals[k if key is None else key]
    self.budget_bytes = budget
    self.step_options = None if step_options is None else dict(step_options)
    return self

  def __repr__(self):
    options = "" if self.step_options is None else f", step_options={self.step_options}"
    return f"MicrobatchPlan({int(self)}{options}, memory_bytes={self.memory_bytes}, totals={self.totals})"


def compiled_memory_bytes(compiled) -> int:
  """arguments + outputs - aliases + temp bytes of a `jax.stages.Compiled` (per device)."""
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError("this backend reports no compiled memory analysis")
  return int(
    stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
  )


def _rows_per_device(x) -> int | None:
  """Leading size of one device's shard of `x` (all of it when unsharded); None for a scalar.

  With the batch split over a mesh, K must divide each device's rows, not the
  global batch (`make_train_step` refuses the rest).
  """
  shape = tuple(getattr(x, "shape", None) or jnp.shape(x))  # ShapeDtypeStructs included
  if not shape:
    return None
  sharding = getattr(x, "sharding", None)
  if sharding is not None:
    shape = sharding.shard_shape(shape)
  return shape[0]


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def plan_microbatches(
  step_fn: Callable[[int], Any],
  *example_args: Any,
  memory_budget_bytes: int,
  candidates: Sequence[int] | None = None,
  batch_argnum: int | None = None,
  step_options: Sequence[dict] | None = None,
) -> MicrobatchPlan:
  """Compiles the step for candidate K and returns the smallest K whose footprint fits the budget.

  With $A$, $O$, $D$ and $T(K)$ the argument, output, aliased (donated) and
  temporary bytes of one device in the step compiled for $K$ microbatches
  (`compiled.memory_analysis()`), the plan is

  $$ K^\\star = \\min \\{ K \\in \\text{candidates} : A + O - D + T(K) \\le
     \\text{memory\\_budget\\_bytes} \\}. $$

  Contract: `step_fn` is a factory, `step_fn(K)` returning the step for K
  microbatches, a `jax.jit`-wrapped function (donating what it means to
  donate; a plain function is wrapped in `jax.jit`), e.g.
  `lambda k: ja.make_train_step(loss_fn, opt, num_microbatches=k, mesh=mesh)`.
  It is lowered with `example_args` (arrays or `jax.ShapeDtypeStruct`s, with
  the shardings the real call will have) and compiled; nothing runs.

  From shapes alone, for a model no host could hold: `jax.ShapeDtypeStruct`
  parameters through `ja.shard_train_state` give the strategy's parameters
  and optimizer state as `jax.ShapeDtypeStruct`s with their shardings, and a
  batch of `jax.ShapeDtypeStruct`s with its sharding completes the
  arguments; nothing is allocated (docs/guides/will-it-fit.md)::

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    p, s = ja.shard_train_state(abstract, opt, mesh, strategy="fsdp")
    rows = NamedSharding(mesh, P("data"))
    batch = jax.ShapeDtypeStruct((256, 4096), jnp.int32, sharding=rows)
    k = ja.plan_microbatches(make, p, s, batch, memory_budget_bytes=80 * 2**30)

  Args:
    step_fn: the factory `K -> jitted step`.
    *example_args: the step's positional arguments.
    memory_budget_bytes: bytes available per device (e.g. a fraction of
      `jax.devices()[0].memory_stats()["bytes_limit"]` on GPU/TPU).
    candidates: Ks to try, default the divisors of the number of rows of the
      batch, `example_args[batch_argnum]`, that each device holds (the global
      batch size without a sharding: pass the batch with the sharding the real
      call will have, e.g. through `ja.shard_batch`, or `make_train_step` with
      a mesh refuses the K that do not divide a device's rows). Tried in
      ascending order; compiling stops at the first that fits.
    batch_argnum: which example argument is the batch; only used to derive
      the default candidates. Default: the step's own `batch_argnum` (steps
      from `make_train_step` carry it: 2 for `step(params, opt_state, batch)`,
      3 with `has_state`), else 2.
    step_options: variants of the step to try for each K, in order of
      preference: `step_fn(K, **options)` is compiled for each, and the first
      that fits wins (smallest K first, then the earlier option). E.g. fsdp's
      comm-lean mode where it fits, else the memory-lean one::

        plan = ja.plan_microbatches(
            lambda k, **o: ja.make_train_step(loss, opt, num_microbatches=k, mesh=mesh,
                                              strategy="fsdp", **o),
            params, opt_state, batch, memory_budget_bytes=budget,
            step_options=[{"fsdp_gather": "once"}, {"fsdp_gather": "per_microbatch"}])
        step = ja.make_train_step(..., num_microbatches=plan, **plan.step_options)

  Returns:
    A `MicrobatchPlan`: an int K, with `.totals` ({K: bytes} of every
    candidate compiled), `.memory_bytes` and `.step_options`.

  Raises:
    ValueError: when no candidate fits, naming the smallest total found.
  """
  if isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, numbers.Real):
    raise TypeError(f"{memory_budget_bytes=} must be a positive number of bytes")
  if not memory_budget_bytes > 0:
    raise ValueError(f"{memory_budget_bytes=} must be a positive number of bytes")
  if not callable(step_fn):
    raise TypeError(f"step_fn={step_fn!r} must be callable: K -> the jitted step for K microbatches")
  if step_options is not None:
    if (
      isinstance(step_options, dict)
      or not isinstance(step_options, collections.abc.Sequence)
      or not all(isinstance(o, dict) for o in step_options)
      or not step_options
    ):
      raise TypeError(
        f"{step_options=} must be a non-empty sequence of keyword dicts, e.g. "
        "[{'fsdp_gather': 'once'}, {'fsdp_gather': 'per_microbatch'}]"
      )
  variants: list = [None] if step_options is None else list(step_options)

  def build(k, index):
    options = variants[index]
    return step_fn(k) if options is None else step_fn(k, **options)

  steps: dict[Any, Any] = {}
  if batch_argnum is None and candidates is None:
    # Steps from make_train_step say where their batch is (3 with has_state); K = 1 is
    # always a default candidate, so building its step first costs nothing extra.
    steps[1, 0] = build(1, 0)
    batch_argnum = getattr(steps[1, 0], "batch_argnum", 2)
  if batch_argnum is not None and (isinstance(batch_argnum, bool) or not isinstance(batch_argnum, numbers.Integral)):
    raise TypeError(f"{batch_argnum=} must be an int (which example argument is the batch)")
  if candidates is None:
    if not -len(example_args) <= batch_argnum < len(example_args):
      raise ValueError(f"{batch_argnum=} is out of range for {len(example_args)} example arguments")
    rows = [_rows_per_device(x) for x in jax.tree.leaves(example_args[batch_argnum])]
    rows = [r for r in rows if r is not None]
    if not rows:
      raise ValueError(f"example_args[{batch_argnum}] holds no array with a batch axis")
    if rows[0] == 0:
      raise ValueError(f"example_args[{batch_argnum}] is an empty batch (0 rows): no K can be planned for it")
    candidates = _divisors(rows[0])
  else:
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, collections.abc.Iterable):
      raise TypeError(f"{candidates=} must be a sequence of ints (e.g. [1, 2, 4, 8]) or None")
    candidates = sorted({_tree.check_positive_int(k, "candidates") for k in candidates})
    if not candidates:
      raise ValueError(f"{candidates=} must name at least one K")

  totals: dict[Any, int] = {}
  for k in candidates:
    for index in range(len(variants)):
      step = steps[k, index] if (k, index) in steps else build(k, index)
      if not hasattr(step, "lower"):
        step = jax.jit(step)
      key = k if step_options is None else (k, index)
      totals[key] = compiled_memory_bytes(step.lower(*example_args).compile())
      if totals[key] <= memory_budget_bytes:
        return MicrobatchPlan(k, totals, memory_budget_bytes, key=key, step_options=variants[index])
  best = min(totals, key=totals.__getitem__)
  raise ValueError(
    f"no num_microbatches in {list(candidates)} fits {memory_budget_bytes=}: the smallest "
    f"compiled total is {totals[best]} bytes (K={best}); totals by K: {totals}"
  )
