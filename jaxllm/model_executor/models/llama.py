"""Llama (LlamaForCausalLM, and Mistral: Llama with a sliding window on every layer) in Flax
(linen) over one paged KV array for all layers: pre-norm decoder layers of grouped-query
attention and a SwiGLU MLP. Qwen2 and Qwen3 are this architecture with their own switches
(models/qwen2.py, models/qwen3.py).

The forward pass sees a flat, ragged batch of tokens (prefill chunks and decodes mixed) plus the
attention metadata the runner prepared. Params are an argument of the jitted step
(`model.apply({"params": params, "rope": ...}, ...)`), never baked in. With `tp_axis` set the
module runs under `jax.shard_map` on one device's slice of the model (its config is
`TPLayout.local`; jaxllm/distributed/tensor_parallel.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.kv_cache_groups import KVCacheGroups
from jaxllm.model_executor.layers.attention import Attention, AttentionMetadata
from jaxllm.model_executor.layers.layernorm import RMSNorm, ShardedRMSNorm
from jaxllm.model_executor.layers.linear import (
    Linear,
    LinearDeferredBias,
    RowParallelLinear,
    weight_param,
)
from jaxllm.model_executor.layers.logits import compute_logits, embed_tokens
from jaxllm.model_executor.layers.rotary_embedding import rope_variables


class LlamaAttention(nn.Module):
    config: ModelConfig
    layer_idx: int
    dtype: Any
    backend: str
    tp_axis: str | None = None
    gemv_rows: int = 0
    attention_impl: str | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and of k, before RoPE
    # OLMo 2: RMSNorm over the whole q projection and the whole k projection, before RoPE.
    projection_qk_norm: bool = False
    kv_slot: int | None = None  # the layer's index on the KV array (None: layer_idx)

    @nn.compact
    def __call__(self, x, positions, kv_cache, attn_metadata: AttentionMetadata[jax.Array],
                 cos_sin_cache, max_query_len: int | None, num_splits: int = 1):
        cfg = self.config
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # One fused GEMM for q, k and v (vLLM's QKVParallelLinear): fewer, larger matmuls.
        # With a Pallas backend the bias is added by the kernel that applies RoPE and writes
        # the KV; on the reference backend it stays with the GEMM, where XLA fuses it, and
        # q/k norms need it added before them.
        width = (nh + 2 * nkv) * hd
        bias = None
        normed = self.qk_norm or self.projection_qk_norm
        if cfg.attention_bias and self.backend != "reference" and not normed:
            qkv, bias = LinearDeferredBias(width, self.dtype, self.backend, self.gemv_rows,
                                           name="qkv_proj")(x)
        else:
            qkv = Linear(width, cfg.attention_bias, self.dtype, self.backend, self.gemv_rows,
                         name="qkv_proj")(x)
        if self.qk_norm:
            q, k, v = jnp.split(qkv, [nh * hd, (nh + nkv) * hd], axis=-1)
            norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend, name="q_norm")
            q = norm(q.reshape(-1, nh, hd)).reshape(q.shape)
            norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend, name="k_norm")
            k = norm(k.reshape(-1, nkv, hd)).reshape(k.shape)
            qkv = jnp.concatenate([q, k, v], axis=-1)
        if self.projection_qk_norm:
            q, k, v = jnp.split(qkv, [nh * hd, (nh + nkv) * hd], axis=-1)
            q = ShardedRMSNorm(cfg.rms_norm_eps, self.dtype, self.backend, self.tp_axis,
                               name="q_proj_norm")(q)
            k = ShardedRMSNorm(cfg.rms_norm_eps, self.dtype, self.backend, self.tp_axis,
                               name="k_proj_norm")(k)
            qkv = jnp.concatenate([q, k, v], axis=-1)
        kv_slot = self.layer_idx if self.kv_slot is None else self.kv_slot
        out, kv_cache = Attention(nh, nkv, hd, kv_slot, self.backend,
                                  self.attention_impl,
                                  cfg.layer_sliding_window(self.layer_idx),
                                  cfg.attention_scale, cfg.attn_logit_softcapping,
                                  name="attn")(
            qkv, bias, positions, kv_cache, attn_metadata, cos_sin_cache, max_query_len,
            num_splits)
        out = RowParallelLinear(cfg.hidden_size, self.dtype, self.backend, self.gemv_rows,
                                self.tp_axis, cfg.o_proj_bias, name="o_proj")(out)
        return out, kv_cache


class LlamaMLP(nn.Module):
    config: ModelConfig
    dtype: Any
    backend: str = "reference"
    tp_axis: str | None = None
    gemv_rows: int = 0
    intermediate_size: int | None = None  # None: the config's (an MoE's shared expert: its own)

    @nn.compact
    def __call__(self, x):
        inter = self.intermediate_size or self.config.intermediate_size
        # gate and up in one GEMM (vLLM's MergedColumnParallelLinear).
        gate_up = Linear(2 * inter, False, self.dtype, self.backend, self.gemv_rows,
                         name="gate_up_proj")(x)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        # SwiGLU, or Gemma's GeGLU (GELU's tanh approximation, as gelu_pytorch_tanh).
        act = nn.silu if self.config.hidden_act == "silu" else functools.partial(
            nn.gelu, approximate=True)
        return RowParallelLinear(self.config.hidden_size, self.dtype, self.backend,
                                 self.gemv_rows, self.tp_axis, name="down_proj")(act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    config: ModelConfig
    layer_idx: int
    dtype: Any
    backend: str
    tp_axis: str | None = None
    gemv_rows: int = 0
    attention_impl: str | None = None
    qk_norm: bool = False
    # The feed-forward module, built as LlamaMLP is (an MoE family's sparse block; see
    # `LlamaForCausalLM.mlp_class`).
    mlp_cls: Callable[..., nn.Module] = LlamaMLP
    sandwich_norm: bool = False  # see LlamaForCausalLM.SANDWICH_NORM
    post_norm: bool = False  # see LlamaForCausalLM.POST_NORM
    projection_qk_norm: bool = False
    kv_slot: int | None = None  # see LlamaAttention

    @nn.compact
    def __call__(self, h, residual, positions, kv_cache, attn_metadata, cos_sin_cache,
                 max_query_len, num_splits=1):
        cfg = self.config
        if self.post_norm:
            return self._post_norm_layer(h, residual, positions, kv_cache, attn_metadata,
                                         cos_sin_cache, max_query_len, num_splits)
        # vLLM's fused_add_rms_norm: the residual add rides along with the norm.
        if residual is None:
            residual = h
            h = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend, name="input_layernorm")(h)
        else:
            h, residual = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                                  name="input_layernorm")(h, residual)
        h, kv_cache = self._attention()(
            h, positions, kv_cache, attn_metadata, cos_sin_cache, max_query_len, num_splits)
        mlp = self._mlp()
        if not self.sandwich_norm:
            h, residual = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                                  name="post_attention_layernorm")(_residual_scaled(h, cfg),
                                                                   residual)
            return _residual_scaled(mlp(h), cfg), residual, kv_cache
        # Gemma 2/3: the attention's and the MLP's outputs are normed before they join the
        # residual stream; each joins it inside the next pre-norm's fused add (vLLM's way), so
        # the layer returns the MLP's normed output beside the residual, as Llama's does.
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                    name="post_attention_layernorm")(h)
        h, residual = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                              name="pre_feedforward_layernorm")(h, residual)
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                    name="post_feedforward_layernorm")(mlp(h))
        return h, residual, kv_cache

    def _attention(self) -> LlamaAttention:
        return LlamaAttention(self.config, self.layer_idx, self.dtype, self.backend,
                              self.tp_axis, self.gemv_rows, self.attention_impl, self.qk_norm,
                              self.projection_qk_norm, self.kv_slot, name="self_attn")

    def _mlp(self) -> nn.Module:
        return self.mlp_cls(self.config, self.dtype, self.backend, self.tp_axis, self.gemv_rows,
                            name="mlp")

    def _post_norm_layer(self, h, residual, positions, kv_cache, attn_metadata, cos_sin_cache,
                         max_query_len, num_splits):
        """OLMo 2: h = x + norm(attn(x)), then h + norm(mlp(h)); no norm before either. A norm
        here precedes its residual add, so none fuses with one: the layer returns the MLP's
        normed output beside h, and the next layer (or the final norm's fused add) sums them."""
        cfg = self.config
        x = h if residual is None else h + residual
        h, kv_cache = self._attention()(
            x, positions, kv_cache, attn_metadata, cos_sin_cache, max_query_len, num_splits)
        h = x + RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                        name="post_attention_layernorm")(h)
        out = RMSNorm(cfg.rms_norm_eps, self.dtype, self.backend,
                      name="post_feedforward_layernorm")(self._mlp()(h))
        return out, h, kv_cache


def _residual_scaled(h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """An attention or MLP output as it joins the residual (Granite scales it)."""
    m = cfg.residual_multiplier
    return h if m == 1 else h * jnp.asarray(m, h.dtype)


class LlamaForCausalLM(nn.Module):
    """Returns (logits [R, vocab] float32 for the rows in `attn_metadata.logits_indices`,
    final-normed hidden states [T, hidden] of every row, the updated kv_cache)."""

    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    QK_NORM: ClassVar[bool] = False
    # Added to every RMSNorm weight at load (model_loader/loader.py): Gemma's norms scale by
    # (1 + weight).
    NORM_WEIGHT_OFFSET: ClassVar[float] = 0.0
    # The embeddings scaled by sqrt(hidden_size) (Gemma).
    EMBED_SCALE: ClassVar[bool] = False
    # Four norms per layer (Gemma 2/3): the attention's and the MLP's outputs normed too
    # (params post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm).
    SANDWICH_NORM: ClassVar[bool] = False
    # No pre-norms (OLMo 2): each sublayer's output is normed, then added to the residual
    # (params post_attention_layernorm, post_feedforward_layernorm).
    POST_NORM: ClassVar[bool] = False
    # RMSNorm over the whole q projection and the whole k projection (all heads at once)
    # before RoPE (OLMo 2; params q_proj_norm [heads * head_dim], k_proj_norm
    # [kv heads * head_dim]); with tensor parallelism its statistics span the devices' heads.
    PROJECTION_QK_NORM: ClassVar[bool] = False

    config: ModelConfig
    dtype: Any = jnp.float32
    kernel_backend: str = "reference"
    tp_axis: str | None = None  # set: runs under shard_map on one device's slice (see above)
    # The hidden states' dtype; None: `dtype`. float32 for a bfloat16 model on CPU (the runner),
    # where XLA runs bfloat16 elementwise ops, norms and attention slower than float32 ones.
    activation_dtype: Any = None
    # Steps of up to this many tokens run their dense weight matmuls (the LM head's rows too)
    # through the Pallas GEMV kernel, with a Pallas backend (`layers/linear.py`); 0: XLA's dots.
    gemv_kernel_rows: int = 0
    # layers/attention.py's `attention_impl`, chosen once by the runner; None: the kernel
    # backend's paged attention.
    attention_impl: str | None = None
    # Where each layer's KV lives and which block tables it reads; None: one group, layer i
    # at index i (model_executor/kv_cache_groups.py).
    kv_groups: KVCacheGroups | None = None

    def mlp_class(self, layer_idx: int) -> Callable[..., nn.Module]:
        """The feed-forward module of decoder layer `layer_idx` (MoE families swap in their
        sparse block, layers/fused_moe.py), built with LlamaMLP's fields."""
        return LlamaMLP

    @nn.compact
    def __call__(self, input_ids, positions, kv_cache, attn_metadata: AttentionMetadata[jax.Array],
                 max_query_len: int | None = None, num_splits: int = 1):
        """num_splits > 1: split-K decode attention (needs max_query_len 1, see
        paged_attention)."""
        cfg = self.config
        embed = weight_param(self, "embed_tokens", (cfg.vocab_size, cfg.hidden_size),
                             self.dtype, nn.initializers.normal(0.02))
        # RoPE tables live in their own collection: computed once at load
        # (layers/rotary_embedding.py `rope_variables`), passed with the params.
        cos_sin_cache = self.variable(
            "rope", "cos_sin_cache", lambda: rope_variables(cfg)["cos_sin_cache"]).value
        # Gemma 3: the sliding-window layers' own RoPE.
        local_cos_sin_cache = None if cfg.rope_local_theta is None else self.variable(
            "rope", "local_cos_sin_cache",
            lambda: rope_variables(cfg)["local_cos_sin_cache"]).value
        h = embed_tokens(embed, input_ids, self.activation_dtype or self.dtype, self.tp_axis)
        if cfg.embedding_multiplier != 1:  # Granite
            h = h * jnp.asarray(cfg.embedding_multiplier, h.dtype)
        if self.EMBED_SCALE:
            # Rounded to the weights' dtype first, as Hugging Face does (sqrt(3072) is 55.5 in
            # bfloat16), so a bfloat16 checkpoint computed in float32 scales as it does there.
            h = h * jnp.asarray(cfg.hidden_size ** 0.5, self.dtype).astype(h.dtype)
        residual = None
        # Unrolled on purpose: a lax.scan over stacked layers copies weight slices every step
        # on CPU (docs/perf/cpu-step.md).
        groups = self.kv_groups or KVCacheGroups.single(cfg.num_hidden_layers)
        for i in range(cfg.num_hidden_layers):
            local = local_cos_sin_cache is not None and cfg.layer_sliding_window(i) is not None
            h, residual, kv_cache = LlamaDecoderLayer(
                cfg, i, self.dtype, self.kernel_backend, self.tp_axis, self.gemv_kernel_rows,
                self.attention_impl, self.QK_NORM, self.mlp_class(i), self.SANDWICH_NORM,
                self.POST_NORM, self.PROJECTION_QK_NORM, groups.layer_slot[i],
                name=f"layers_{i}")(
                    h, residual, positions, kv_cache,
                    attn_metadata.for_group(groups.layer_group[i], groups.num_groups),
                    local_cos_sin_cache if local else cos_sin_cache, max_query_len, num_splits)
        hidden_states, _ = RMSNorm(cfg.rms_norm_eps, self.dtype, self.kernel_backend,
                                   name="norm")(h, residual)
        # Only the sampled rows go through the LM head (the vocabulary GEMM is the costly part);
        # the normed hidden states of all rows stay on device for prompt logprobs.
        rows = jnp.take(hidden_states, attn_metadata.logits_indices, axis=0)
        if not cfg.tie_word_embeddings:
            weight_param(self, "lm_head", (cfg.vocab_size, cfg.hidden_size), self.dtype,
                         nn.initializers.normal(0.02))
        logits = compute_logits(self.variables["params"], cfg, rows, self.kernel_backend,
                                self.gemv_kernel_rows)
        return logits, hidden_states, kv_cache
