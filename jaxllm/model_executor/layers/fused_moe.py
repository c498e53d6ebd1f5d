"""Mixture-of-experts feed-forward (vLLM's FusedMoE): a router, SwiGLU experts held stacked, and
the weighted combine of the experts each token picked; Qwen2-MoE's shared expert beside them.

Params of the block (`FusedMoE`):
  gate.weight                [E, hidden]          the router, replicated under TP
  experts.gate_up_proj       [E, 2 * inter, hidden]  each expert's gate rows then its up rows
  experts.down_proj          [E, hidden, inter]
  shared_expert.{gate_up_proj,down_proj}.weight, shared_expert_gate.weight [1, hidden]
                                                  (Qwen2-MoE only)
Under tensor parallelism each expert's intermediate dimension is split (gate_up
column-parallel, down row-parallel), as is the shared expert's; the routed and the shared
outputs are partial sums on each device, added before one all-reduce.

The expert matmuls are XLA dots on every kernel backend. Which of two ways computes them is
chosen from the step's (static) token count, so that no path does E / k times the work needed:
  - "gather": each (token, expert) pair through its expert's weights alone; the work and the
    weight bytes read grow with tokens x k, which wins for decode-sized steps;
  - "grouped": (token, expert) pairs sorted by expert into tiles of rows that share one expert
    (each expert's group padded to whole tiles), one tile at a time through its expert's
    weights; the rows computed are at most the pairs plus a tile per expert.
`jax.lax.ragged_dot`, the natural grouped matmul, is not used: on XLA:CPU it runs far slower
than the dense work it stands for (docs/perf/moe-cpu.md).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.distributed.tensor_parallel import all_reduce
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers.linear import Linear
from jaxllm.model_executor.models.llama import LlamaMLP

# Steps whose (token, expert) pairs number at most this many per expert take the gather path;
# larger ones the grouped path (docs/perf/moe-cpu.md measures the crossover).
GATHER_PAIRS_PER_EXPERT = 0.5


def route(router_logits: jax.Array, top_k: int, renormalize: bool
          ) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, expert ids [T, k] int32): the softmax over all experts in
    float32, its k largest, divided by their sum when `renormalize`."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def _dot(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """einsum(spec) of activations and weights in the weights' dtype, accumulated in float32
    and returned in the activations' (a bfloat16 model keeps float32 activations on CPU)."""
    out = jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def _swiglu(gate_up: jax.Array) -> jax.Array:
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return nn.silu(gate) * up


def experts_gather(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, weights: jax.Array,
                   ids: jax.Array) -> jax.Array:
    """The routed experts' combined output [T, hidden], one (token, expert) pair at a time
    through that expert's weights alone (a loop, not a gather of every pair's weights into one
    batched matmul, which XLA:CPU runs as slow vector products)."""
    t, k = ids.shape

    def one_pair(carry, pair):
        xt, e = pair
        h = _swiglu(_dot(xt[None], w_gate_up[e], "rh,ih->ri"))
        return carry, _dot(h, w_down[e], "ri,hi->rh")[0]

    _, out = jax.lax.scan(one_pair, None, (jnp.repeat(x, k, axis=0), ids.reshape(-1)))
    return jnp.einsum("tkh,tk->th", out.reshape(t, k, -1), weights.astype(out.dtype))


def _tile_rows(pairs: int, num_experts: int) -> int:
    """Rows per tile of the grouped path: about the pairs each expert gets on average (so that
    padding each active expert's group to whole tiles at most doubles the rows), a power of two
    from 8 to 128."""
    rows = 8
    while rows < 128 and rows * 2 <= pairs // num_experts:
        rows *= 2
    return rows


def experts_grouped(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                    weights: jax.Array, ids: jax.Array) -> jax.Array:
    """The routed experts' combined output [T, hidden]: (token, expert) pairs sorted by expert,
    each expert's group padded to whole tiles of `_tile_rows` rows, and each tile through its
    one expert's weights; tiles past the last group are skipped."""
    t, hidden = x.shape
    num_experts, k = w_gate_up.shape[0], ids.shape[1]
    pairs = t * k
    rows = _tile_rows(pairs, num_experts)
    # At most min(E, pairs) groups are non-empty, each padded by fewer than `rows` rows.
    num_tiles = -(-(pairs + min(num_experts, pairs) * (rows - 1)) // rows)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert_of = flat[order]
    counts = jnp.bincount(flat, length=num_experts)
    padded = (counts + rows - 1) // rows * rows
    padded_end = jnp.cumsum(padded)
    rank = jnp.arange(pairs) - (jnp.cumsum(counts) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    # Padding rows read token 0 with weight 0: computed, then added as nothing.
    row_token = jnp.zeros(num_tiles * rows, jnp.int32).at[dest].set(order // k)
    row_weight = jnp.zeros(num_tiles * rows, jnp.float32).at[dest].set(
        weights.reshape(-1)[order])
    tile_expert = jnp.minimum(
        jnp.searchsorted(padded_end, jnp.arange(num_tiles) * rows, side="right"),
        num_experts - 1)
    used_tiles = padded_end[-1] // rows
    tiles = jnp.take(x, row_token, axis=0).reshape(num_tiles, rows, hidden)

    def one_tile(carry, tile):
        xs, e, j = tile

        def compute(xs):
            h = _swiglu(_dot(xs, w_gate_up[e], "rh,ih->ri"))
            return _dot(h, w_down[e], "ri,hi->rh")

        out = jax.lax.cond(j < used_tiles, compute, jnp.zeros_like, xs)
        return carry, out

    _, out = jax.lax.scan(one_tile, None, (tiles, tile_expert, jnp.arange(num_tiles)))
    out = out.reshape(num_tiles * rows, hidden) * row_weight[:, None].astype(out.dtype)
    return jnp.zeros_like(x).at[row_token].add(out)


def expert_method(num_tokens: int, top_k: int, num_experts: int) -> str:
    """"gather" or "grouped" for a step of `num_tokens` tokens (static: one per bucket)."""
    pairs = num_tokens * top_k
    return "gather" if num_tokens == 1 or pairs <= GATHER_PAIRS_PER_EXPERT * num_experts \
        else "grouped"


def fused_experts(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, weights: jax.Array,
                  ids: jax.Array, method: str | None = None) -> jax.Array:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for each token, by `method` ("gather",
    "grouped"; None: by the token count, `expert_method`)."""
    if method is None:
        method = expert_method(x.shape[0], ids.shape[1], w_gate_up.shape[0])
    if method == "gather":
        return experts_gather(x, w_gate_up, w_down, weights, ids)
    if method == "grouped":
        return experts_grouped(x, w_gate_up, w_down, weights, ids)
    raise ValueError(f"fused_experts: method {method!r} is not 'gather' or 'grouped'")


class FusedExperts(nn.Module):
    """The routed experts, stacked: params `gate_up_proj` [E, 2 * inter, hidden] and
    `down_proj` [E, hidden, inter]."""

    num_experts: int
    intermediate_size: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        e, inter, hidden = self.num_experts, self.intermediate_size, x.shape[-1]
        init = nn.initializers.normal(0.02)
        w_gate_up = self.param("gate_up_proj", init, (e, 2 * inter, hidden), self.dtype)
        w_down = self.param("down_proj", init, (e, hidden, inter), self.dtype)
        return fused_experts(x, w_gate_up, w_down, weights, ids)


class FusedMoE(nn.Module):
    """The MoE feed-forward of one decoder layer (params above); called as LlamaMLP is."""

    config: ModelConfig
    dtype: Any
    backend: str = "reference"
    tp_axis: str | None = None
    gemv_rows: int = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        moe = cfg.moe
        assert moe is not None
        logits = Linear(moe.num_experts, False, self.dtype, self.backend, self.gemv_rows,
                        name="gate")(x)
        weights, ids = route(logits, moe.top_k, moe.renormalize)
        out = FusedExperts(moe.num_experts, moe.intermediate_size, self.dtype,
                           name="experts")(x, weights, ids)
        if moe.shared_expert_intermediate_size:
            # Without its own all-reduce: the sigmoid gate scales each device's partial sum
            # alike, so one all-reduce serves both outputs.
            shared = LlamaMLP(cfg, self.dtype, self.backend, None, self.gemv_rows,
                              intermediate_size=moe.shared_expert_intermediate_size,
                              name="shared_expert")(x)
            gate = Linear(1, False, self.dtype, self.backend, name="shared_expert_gate")(x)
            out = out + jax.nn.sigmoid(gate) * shared
        return all_reduce(out, self.tp_axis)


def moe_or_dense(config: ModelConfig, layer_idx: int, dense: type[nn.Module]) -> type[nn.Module]:
    """The feed-forward of decoder layer `layer_idx`: FusedMoE where the config makes it sparse,
    else `dense`."""
    moe = config.moe
    return FusedMoE if moe is not None and layer_idx in moe.sparse_layers else dense
