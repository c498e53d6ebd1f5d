"""Qwen2 in Flax (linen) over one paged KV array for all layers.

The forward pass sees a flat, ragged batch of tokens (prefill chunks and decodes mixed) plus the
attention metadata the runner prepared; RMSNorm, RoPE, KV write and attention go through
`pallas_kernels`, whose `backend` picks Pallas (GPU), Pallas interpret (CPU tests) or plain XLA.
Params are an argument of the jitted step (`model.apply({"params": params, ...})`), never baked in.
With `tp_axis` set the module runs under `jax.shard_map` on one device's slice of the model
(its config is `TPLayout.local`): the row-parallel o_proj and down_proj outputs and the
vocabulary-parallel embedding are all-reduced over that axis, and the logits are the device's
vocabulary slice (jaxllm/distributed/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, NamedTuple, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.distributed.tensor_parallel import all_reduce, vocab_parallel_embed
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers import cpu_attention
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, dequantize, gguf_linear
from pallas_kernels.dequant_matmul import dequant_matmul
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.rope import rope_cos_sin_cache
from pallas_kernels.rope_write_kv import rope_write_kv
from pallas_kernels.skinny_matmul import skinny_matmul

# Arrays when a step runs; their shapes, dtypes and shardings when a step is traced ahead of time.
ArrayOrSpec = TypeVar("ArrayOrSpec", jax.Array, jax.ShapeDtypeStruct)


class AttentionMetadata(NamedTuple, Generic[ArrayOrSpec]):
    """What every layer needs to find its tokens' KV slots (shapes: T tokens, S sequences)."""

    slot_mapping: ArrayOrSpec  # [T] int32, -1 for padding tokens (not written)
    block_tables: ArrayOrSpec  # [S, max_blocks_per_seq] int32
    seq_lens: ArrayOrSpec  # [S] int32, context length including this step's tokens (0 = padding)
    query_start_loc: ArrayOrSpec  # [S + 1] int32, cumulative query lengths
    logits_indices: ArrayOrSpec  # [R] int32, token rows whose logits leave the device


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[layers, K/V, kv_heads, blocks, block_size, head_dim]: a (head, block) tile is contiguous."""
    return (config.num_hidden_layers, 2, config.num_key_value_heads, num_blocks, block_size,
            config.head_dim)


def linear(x: jax.Array, weight: jax.Array | GGUFWeight, backend: str = "reference",
           gemv_rows: int = 0) -> jax.Array:
    """x [T, in] times weight [out, in] transposed, with the weight kept in PyTorch's layout
    (or kept quantized: `gguf_linear` on XLA, the fused dequant matmul kernel with a Pallas
    `backend`). With a Pallas backend and T <= `gemv_rows`, a dense weight goes through the
    weight-streaming GEMV kernel (pallas_kernels/skinny_matmul.py) instead of XLA's dot.

    [out, in] is what checkpoints store, and on CPU XLA streams it faster than [in, out] at
    small T (each output is a dot over a contiguous row; docs/perf/cpu-step.md), which is what
    decode is bound by."""
    if isinstance(weight, GGUFWeight):
        if backend != "reference":
            if weight.packed:
                raise ValueError(f"a GGUF weight packed in panels for the CPU kernel reaches the "
                                 f"{backend!r} kernel backend, which reads blocks as rows: load "
                                 f"the model with that kernel_backend")
            return dequant_matmul(x, weight.qweight, weight.scale, weight.offset,
                                                 backend=backend)
        return gguf_linear(x, weight)
    if backend != "reference" and x.ndim == 2 and 1 <= x.shape[0] <= gemv_rows:
        return skinny_matmul(x, weight, backend=backend)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if weight.dtype == jnp.bfloat16 and x.dtype == jnp.float32:
        # A bfloat16 model on CPU keeps float32 activations (Qwen2ForCausalLM.activation_dtype):
        # only the GEMM's operands are bfloat16, accumulated and returned in float32.
        return jax.lax.dot_general(x.astype(jnp.bfloat16), weight, dims,
                                   preferred_element_type=jnp.float32)
    if weight.dtype != x.dtype:  # e.g. float32 weights under 16-bit (interpret-mode) activations
        return jax.lax.dot_general(x.astype(weight.dtype), weight, dims).astype(x.dtype)
    if x.dtype == jnp.bfloat16:
        # Accumulated and returned in float32: XLA on CPU runs a bf16 x bf16 -> f32 GEMM faster
        # than a float32 one, but converts both operands to float32 for a bf16 result
        # (docs/perf/gguf-cpu.md).
        return jax.lax.dot_general(x, weight, dims,
                                   preferred_element_type=jnp.float32).astype(x.dtype)
    return jax.lax.dot_general(x, weight, dims)


def _weight_param(module: nn.Module, name: str, shape: tuple[int, ...], dtype: Any, init):
    """A weight param, or the GGUFWeight the params hold in its place (quantization="gguf");
    read without `param()`, whose shape check knows only plain arrays."""
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if isinstance(value, GGUFWeight):
            return value
    return module.param(name, init, shape, dtype)


class Linear(nn.Module):
    """vLLM's Linear: params `weight` [out, in] and optional `bias` [out]."""

    features: int
    use_bias: bool
    dtype: Any
    backend: str = "reference"
    gemv_rows: int = 0  # see `linear`

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = _weight_param(self, "weight", (self.features, x.shape[-1]), self.dtype,
                               nn.initializers.normal(0.02))
        y = linear(x, weight, self.backend, self.gemv_rows)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
            # XLA on CPU fuses `dot + bias` into the dot, which then cannot take the
            # dequantization in and materialises the float32 weight; y - (-b) is bit-for-bit
            # y + b and is left alone.
            xla_gemv = isinstance(weight, GGUFWeight) and self.backend == "reference"
            y = y - (-bias) if xla_gemv else y + bias
        return y


class LinearDeferredBias(nn.Module):
    """`Linear` with a bias whose add is left to the kernel that reads the output next: returns
    (x W^T, bias), the params as Linear's."""

    features: int
    dtype: Any
    backend: str = "reference"
    gemv_rows: int = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        weight = _weight_param(self, "weight", (self.features, x.shape[-1]), self.dtype,
                               nn.initializers.normal(0.02))
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return linear(x, weight, self.backend, self.gemv_rows), bias


class Qwen2Attention(nn.Module):
    config: ModelConfig
    layer_idx: int
    dtype: Any
    backend: str
    tp_axis: str | None = None
    gemv_rows: int = 0

    @nn.compact
    def __call__(self, x, positions, kv_cache, attn_metadata: AttentionMetadata[jax.Array],
                 cos_sin_cache, max_query_len: int | None, num_splits: int = 1):
        cfg = self.config
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # One fused GEMM for q, k and v (vLLM's QKVParallelLinear): fewer, larger matmuls.
        # Its epilogue (bias, RoPE, the KV write) is one kernel with a Pallas backend; on the
        # reference backend the bias stays with the GEMM, where XLA fuses it.
        width = (nh + 2 * nkv) * hd
        bias = None
        if self.backend == "reference":
            qkv = Linear(width, True, self.dtype, self.backend, self.gemv_rows,
                         name="qkv_proj")(x)
        else:
            qkv, bias = LinearDeferredBias(width, self.dtype, self.backend, self.gemv_rows,
                                           name="qkv_proj")(x)
        q, kv_cache = rope_write_kv(qkv, bias, positions, cos_sin_cache, kv_cache,
                                    self.layer_idx, attn_metadata.slot_mapping, num_heads=nh,
                                    num_kv_heads=nkv, backend=self.backend)
        if cpu_attention.use_for(q, kv_cache, self.backend, self.tp_axis):
            out = cpu_attention.paged_attention(
                q, kv_cache, self.layer_idx, attn_metadata.block_tables,
                attn_metadata.seq_lens, attn_metadata.query_start_loc, scale=hd ** -0.5)
        else:
            out = paged_attention(
                q, kv_cache, self.layer_idx, attn_metadata.block_tables,
                attn_metadata.seq_lens, attn_metadata.query_start_loc, scale=hd ** -0.5,
                max_query_len=max_query_len, backend=self.backend, num_splits=num_splits)
        out = Linear(cfg.hidden_size, False, self.dtype, self.backend,
                     gemv_rows=self.gemv_rows, name="o_proj")(
            out.reshape(-1, nh * hd))
        return all_reduce(out, self.tp_axis), kv_cache


class Qwen2MLP(nn.Module):
    config: ModelConfig
    dtype: Any
    backend: str = "reference"
    tp_axis: str | None = None
    gemv_rows: int = 0

    @nn.compact
    def __call__(self, x):
        inter = self.config.intermediate_size
        gate_up = Linear(2 * inter, False, self.dtype, self.backend, gemv_rows=self.gemv_rows,
                         name="gate_up_proj")(x)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        down = Linear(self.config.hidden_size, False, self.dtype, self.backend,
                      gemv_rows=self.gemv_rows, name="down_proj")
        return all_reduce(down(nn.silu(gate) * up), self.tp_axis)


class RMSNorm(nn.Module):
    eps: float
    dtype: Any
    backend: str

    @nn.compact
    def __call__(self, x, residual=None):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return rms_norm(x, weight, self.eps, residual, backend=self.backend)


class Qwen2DecoderLayer(nn.Module):
    config: ModelConfig
    layer_idx: int
    dtype: Any
    backend: str
    tp_axis: str | None = None
    gemv_rows: int = 0

    @nn.compact
    def __call__(self, h, residual, positions, kv_cache, attn_metadata, cos_sin_cache,
                 max_query_len, num_splits=1):
        cfg = self.config
        # vLLM's fused_add_rms_norm: the residual add rides along with the norm.
        if residual is None:
            residual = h
            h = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend, name="input_layernorm")(h)
        else:
            h, residual = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                                  name="input_layernorm")(h, residual)
        h, kv_cache = Qwen2Attention(cfg, self.layer_idx, self.dtype, self.backend,
                                     self.tp_axis, self.gemv_rows, name="self_attn")(
            h, positions, kv_cache, attn_metadata, cos_sin_cache, max_query_len, num_splits)
        h, residual = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                              name="post_attention_layernorm")(h, residual)
        h = Qwen2MLP(cfg, self.dtype, self.backend, self.tp_axis, self.gemv_rows, name="mlp")(h)
        return h, residual, kv_cache


class Qwen2ForCausalLM(nn.Module):
    """Returns (logits [R, vocab] float32 for the rows in `attn_metadata.logits_indices`,
    final-normed hidden states [T, hidden] of every row, the updated kv_cache)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    kernel_backend: str = "reference"
    tp_axis: str | None = None  # set: runs under shard_map on one device's slice (see above)
    # The hidden states' dtype; None: `dtype`. float32 for a bfloat16 model on CPU (the runner),
    # where XLA runs bfloat16 elementwise ops, norms and attention slower than float32 ones.
    activation_dtype: Any = None
    # Steps of up to this many tokens run their dense weight matmuls (the LM head's rows too)
    # through the Pallas GEMV kernel, with a Pallas backend (`linear`); 0: XLA's dots.
    gemv_kernel_rows: int = 0

    @nn.compact
    def __call__(self, input_ids, positions, kv_cache, attn_metadata: AttentionMetadata[jax.Array],
                 max_query_len: int | None = None, num_splits: int = 1):
        """num_splits > 1: split-K decode attention (needs max_query_len 1, see
        paged_attention)."""
        cfg = self.config
        embed = _weight_param(self, "embed_tokens", (cfg.vocab_size, cfg.hidden_size),
                              self.dtype, nn.initializers.normal(0.02))
        # RoPE tables live in their own collection: computed once at load, passed with params.
        cos_sin_cache = self.variable(
            "rope", "cos_sin_cache", rope_cos_sin_cache, cfg.head_dim,
            cfg.max_position_embeddings, cfg.rope_theta, jnp.float32).value
        act = self.activation_dtype or self.dtype
        if isinstance(embed, GGUFWeight):  # only the step's rows are dequantized
            h = dequantize(embed, input_ids).astype(act)
        elif self.tp_axis is not None:
            h = vocab_parallel_embed(embed, input_ids, self.tp_axis).astype(act)
        else:
            h = jnp.take(embed, input_ids, axis=0).astype(act)
        residual = None
        # Unrolled on purpose: a lax.scan over stacked layers copies weight slices every step
        # on CPU (docs/perf/cpu-step.md).
        for i in range(cfg.num_hidden_layers):
            h, residual, kv_cache = Qwen2DecoderLayer(
                cfg, i, self.dtype, self.kernel_backend, self.tp_axis, self.gemv_kernel_rows,
                name=f"layers_{i}")(
                    h, residual, positions, kv_cache, attn_metadata, cos_sin_cache, max_query_len,
                    num_splits)
        hidden_states, _ = RMSNorm(cfg.rms_norm_eps, self.dtype, self.kernel_backend,
                                   name="norm")(h, residual)
        # Only the sampled rows go through the LM head (the vocabulary GEMM is the costly part);
        # the normed hidden states of all rows stay on device for prompt logprobs.
        rows = jnp.take(hidden_states, attn_metadata.logits_indices, axis=0)
        if not cfg.tie_word_embeddings:
            _weight_param(self, "lm_head", (cfg.vocab_size, cfg.hidden_size), self.dtype,
                          nn.initializers.normal(0.02))
        logits = compute_logits(self.variables["params"], cfg, rows, self.kernel_backend,
                                self.gemv_kernel_rows)
        return logits, hidden_states, kv_cache


def compute_logits(params: Mapping[str, Any], config: ModelConfig, hidden_states: jax.Array,
                   backend: str = "reference", gemv_rows: int = 0) -> jax.Array:
    """LM head on already-normed hidden states: the model's last step, also used alone for
    prompt logprobs. The head is the embedding table when tied; [vocab, hidden] either way."""
    head = params["embed_tokens"] if config.tie_word_embeddings else params["lm_head"]
    return linear(hidden_states, head, backend, gemv_rows).astype(jnp.float32)


def abstract_params(model: Qwen2ForCausalLM) -> dict:
    """The param tree's shapes and dtypes, without allocating anything."""
    cfg = model.config
    t, s = 4, 1
    attn_metadata = AttentionMetadata(
        slot_mapping=jnp.zeros((t,), jnp.int32), block_tables=jnp.zeros((s, 1), jnp.int32),
        seq_lens=jnp.zeros((s,), jnp.int32), query_start_loc=jnp.zeros((s + 1,), jnp.int32),
        logits_indices=jnp.zeros((s,), jnp.int32))
    kv = jax.ShapeDtypeStruct(kv_cache_shape(cfg, 1, 16), model.dtype)
    variables = jax.eval_shape(
        lambda kv: model.init(jax.random.PRNGKey(0), jnp.zeros((t,), jnp.int32),
                              jnp.zeros((t,), jnp.int32), kv, attn_metadata), kv)
    return variables["params"]


def rope_variables(config: ModelConfig) -> dict:
    return {"cos_sin_cache": rope_cos_sin_cache(
        config.head_dim, config.max_position_embeddings, config.rope_theta, jnp.float32)}
