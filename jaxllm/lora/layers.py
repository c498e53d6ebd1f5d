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

    def intercept(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name != "__call__" or module.name is None:
            return out
        path = module.path
        layer = weights.get(path[0]) if len(path) >= 2 else None
        w = None if layer is None else layer.get(module.name)
        if w is None:
            return out
        delta = lora_delta(args[0], w["A"], w["B"], select)
        if isinstance(out, tuple):  # LinearDeferredBias: (x W^T, bias)
            return (out[0] + delta.astype(out[0].dtype), *out[1:])
        return out + delta.astype(out.dtype)

    with nn.intercept_methods(intercept):
        yield
