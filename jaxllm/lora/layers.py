"""The LoRA delta inside the step, added to the model's projections without touching the
model: flax's method interception wraps each `qkv_proj`, `o_proj`, `gate_up_proj` and
`down_proj` call while the step traces, so a model built without LoRA traces exactly as
before, and every dense family gets the delta from one place.

Two ways to compute it, one result up to float32 rounding: `lora_delta` computes every slot
for every token (no control flow: the step stays one graph on a GPU), `lora_delta_used_slots`
puts each slot behind a conditional on whether any token of the step uses it, so an unused
slot's A and B are not read (XLA:CPU runs a conditional in place; on a GPU its predicate would
be copied to the host). EngineConfig.lora_skip_unused_slots picks one per platform."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# The decoder module holding each fused projection LoRA adds to.
PARENT_MODULE = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
                 "down_proj": "mlp"}


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, select: jax.Array) -> jax.Array:
    """x [T, in] through every slot's A [S, in, w], each token keeping only its own slot's
    product (`select` [T, S], one-hot), then B [S, w, out]: [T, out] in float32. Every slot is
    computed for every token: with a few slots and small ranks this is a handful of thin
    matmuls, with no gather of per-token weights."""
    xa = jnp.einsum("ti,siw->tsw", x.astype(a.dtype), a, preferred_element_type=jnp.float32)
    xa = xa * select[:, :, None]
    return jnp.einsum("tsw,swo->to", xa.astype(b.dtype), b, preferred_element_type=jnp.float32)


def lora_delta_used_slots(x: jax.Array, a: jax.Array, b: jax.Array, select: jax.Array,
                          used: jax.Array) -> jax.Array:
    """`lora_delta`, each slot s computed only where `used[s]` ([S] bool: some token of the
    step reads slot s), its A and B otherwise not read."""
    def add_slot(s: int, out: jax.Array) -> jax.Array:
        # A and B go in whole and are sliced inside the branch: a slice taken outside would
        # be read whether the slot is used or not. The sum goes through the branches, so an
        # unused slot costs no array of its own.
        def compute(out: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array,
                    keep: jax.Array) -> jax.Array:
            xa = jnp.dot(x.astype(a.dtype), a[s], preferred_element_type=jnp.float32)
            xa = xa * keep[:, None]
            return out + jnp.dot(xa.astype(b.dtype), b[s], preferred_element_type=jnp.float32)

        def skip(out: jax.Array, *_: jax.Array) -> jax.Array:
            return out

        return jax.lax.cond(used[s], compute, skip, out, x, a, b, select[:, s])

    out = jnp.zeros((x.shape[0], b.shape[2]), jnp.float32)
    for s in range(a.shape[0]):
        out = add_slot(s, out)
    return out


@contextmanager
def apply_lora(weights: dict, slots: jax.Array, num_slots: int, *, skip_unused_slots: bool):
    """While tracing the model inside this block, add each token's adapter (`slots` [T]
    int32, 1..num_slots; 0: none) to the projections `weights` holds (`LoRASlots`' tree).
    `skip_unused_slots`: through `lora_delta_used_slots` (else `lora_delta`)."""
    # Slot 0 is one_hot's out-of-range -1: a row of zeros.
    select = jax.nn.one_hot(slots - 1, num_slots, dtype=jnp.float32)
    used = jnp.any(select > 0, axis=0)
    # The decoder's path to each projection the slots hold; each must be met exactly once,
    # so a model whose modules are named or nested otherwise fails the trace, not the tokens.
    want = {(layer, PARENT_MODULE[name], name) for layer, mods in weights.items()
            for name in mods}
    met: list[tuple[str, ...]] = []

    def intercept(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module = context.module
        path = tuple(module.path)
        if context.method_name != "__call__" or path not in want:
            return out
        met.append(path)
        w = weights[path[0]][path[2]]
        delta = (lora_delta_used_slots(args[0], w["A"], w["B"], select, used)
                 if skip_unused_slots else lora_delta(args[0], w["A"], w["B"], select))
        if isinstance(out, tuple):  # LinearDeferredBias: (x W^T, bias)
            return (out[0] + delta.astype(out[0].dtype), *out[1:])
        return out + delta.astype(out.dtype)

    with nn.intercept_methods(intercept):
        yield
    if sorted(met) != sorted(want):
        missed = sorted(want - set(met))[:3]
        raise RuntimeError(f"LoRA: the model's projections were not each met once while "
                           f"tracing the step (missed, e.g. {missed}; met {len(met)} of "
                           f"{len(want)})")
