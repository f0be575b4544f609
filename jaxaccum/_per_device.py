"""What JAX says about model code written for the global batch, run per device, and what it means.

`ja.grad` and `make_train_step` on a mesh run the user's loss on each device's
own rows inside a `jax.shard_map` manual over the data axes. The loss is traced
once outside it and its annotations localised (`_program`, a custom_vjp's bwd
rule too: traced outside the map on the cotangents' types, then localised); what
is left that cannot run there is a bwd rule that does not trace outside the map
either, and a loss that closes over the sharded batch.
JAX's errors about them come from deep inside; both entry points turn them into
one jaxaccum message that names the construct and what works instead.
"""

from __future__ import annotations

# JAX's wording (jax 0.10/0.11) for a sharding annotation that names a manual axis, and for a closure
# over an array sharded on an Explicit axis.
_MANUAL_ANNOTATION = (
  "cannot contain axis names that are of type Auto or Manual",
  "of type: AxisType.Manual",
  "can only refer to Auto axes of the mesh",  # with_sharding_constraint (Flax logical constraints reach it too)
)
# An unconstrained entry (`P.UNCONSTRAINED`, or on an Explicit mesh the type of a value traced per device) where
# every mesh axis is manual: only a bwd rule runs there unlocalised.
_UNCONSTRAINED = "cannot contain `P.UNCONSTRAINED` when no mesh axis_types are `Auto`"
_CLOSURE = "Closing over inputs to shard_map where the input is sharded on `Explicit` axes"
# The same closure met by the loss's one trace (`_program`, under the mesh with size-1 data axes): a value
# typed on the step's mesh that is not an argument.
_CLOSURE_TRACED = "should match the aval mesh"


def explain(e: Exception, axis_name, *, entry: str, instead: str) -> Exception | None:
  """The jaxaccum error for `e` raised by model code run per device, or None when `e` is something else.

  Args:
    e: what JAX raised while tracing the loss inside the per-device shard_map.
    axis_name: the data axis (or axes) that shard_map makes manual.
    entry: the entry point, for the message ("ja.grad", "make_train_step").
    instead: what to use with annotated code as written (a clause ending the message).
  """
  text = str(e)
  name = axis_name if isinstance(axis_name, str) else tuple(axis_name)
  if any(s in text for s in _MANUAL_ANNOTATION):
    return ValueError(
      f"{entry}: the loss annotates a sharding over the data axis {name!r} (with_sharding_constraint, "
      f"jax.sharding.reshard(x, P({name!r}, ...)) or out_sharding=P({name!r}, ...)) in code that JAX traces only "
      f"when it transposes: a custom derivative's backward rule (a jax.custom_vjp's bwd). {entry} localises the "
      f"annotations of the loss it traced (custom_jvp and custom_vjp forward and backward rules included), but this "
      f"bwd rule could not be traced outside the map (on the cotangents' types, or on the types the loss's trace "
      f"gave them), so it ran inside its per-device map (a jax.shard_map manual over {name!r}), where that axis "
      f"cannot be named: drop the {name!r} entries from the annotations in the bwd rule (the rows are already "
      f"split), or {instead}"
    )
  if _UNCONSTRAINED in text:
    return ValueError(
      f"{entry}: the loss annotates a sharding as unconstrained (P.UNCONSTRAINED, or with_sharding_constraint(x, "
      f"jax.typeof(x).sharding.spec), which is unconstrained per device) in code that JAX traces only when it "
      f"transposes: a custom derivative's backward rule (a jax.custom_vjp's bwd). {entry} localises the "
      f"annotations of the loss it traced, bwd rules included, but this bwd rule could not be traced outside the map, "
      f"so it ran inside its per-device map (a jax.shard_map manual over every axis of {name!r}), where JAX "
      f"refuses an unconstrained entry: drop the "
      f"annotation from the bwd rule, or {instead}"
    )
  axes = (name,) if isinstance(name, str) else name
  if _CLOSURE in text or (_CLOSURE_TRACED in text and any(f"@{a}" in text for a in axes)):
    return ValueError(
      f"{entry}: the loss reads an array sharded over {name!r} from the enclosing scope (a closure, e.g. "
      f"def loss(params): ... batch ...). {entry} can give each device its rows only of the loss's arguments: "
      "take the batch as an argument, def loss(params, batch)"
    )
  return None
