"""The LoRA delta inside the step, added to the model's projections without touching the
model: flax's method interception wraps each `qkv_proj`, `o_proj`, `gate_up_proj` and
`down_proj` call while the step traces, so a model built without LoRA traces exactly as
before, and every dense family gets the delta from one place."""

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


@contextmanager
def apply_lora(weights: dict, slots: jax.Array, num_slots: int):
    """While tracing the model inside this block, add each token's adapter (`slots` [T]
    int32, 1..num_slots; 0: none) to the projections `weights` holds (`LoRASlots`' tree)."""
    # Slot 0 is one_hot's out-of-range -1: a row of zeros.
    select = jax.nn.one_hot(slots - 1, num_slots, dtype=jnp.float32)
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
        delta = lora_delta(args[0], w["A"], w["B"], select)
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
