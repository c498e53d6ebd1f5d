"""Rotary position embedding tables: the frequencies a checkpoint's RoPE uses (plain, or
stretched by the `linear`, `llama3`, `yarn` and `longrope` scalings Hugging Face configs name, or
by a GGUF's `rope_freqs` factors) turned into the [max_position, head_dim] cos/sin table the
RoPE kernels read (pallas_kernels/rope.py).

Computed once at load in float64 (see `rope_cos_sin_cache`), passed to the step beside the
params in their own "rope" collection.

Partial rotary (RoPE on the first `rotary_dim` dims of each head, the rest passed through, as
Hugging Face's Phi-3 does) runs on the same kernels, which rotate dim i with dim i + head_dim / 2:
the loader reorders each q and k head's dims (`model_loader/weight_layout.py`) so the rotated pairs
are (i, i + head_dim / 2) for i < rotary_dim / 2, and the table holds cos 1, sin 0 on the
passed-through lanes, which the kernels then leave as they are. Attention sees the same
q . k (q and k reordered alike; v is not), and the KV cache holds k in that order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.config import ModelConfig, RopeScaling
from pallas_kernels.rope import rope_cos_sin_cache


def inv_frequencies(config: ModelConfig, long: bool = False) -> tuple[np.ndarray, float]:
    """(inverse frequencies [rotary_dim / 2] float64, the factor cos and sin are scaled by);
    `long`: longrope's long factors (its short ones otherwise)."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if config.rope_freq_factors is not None:
        factors = np.asarray(config.rope_freq_factors, np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs holds {factors.size} factors, head_dim {dim} needs "
                             f"{inv_freq.size}")
        inv_freq = inv_freq / factors
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(inv_freq, scaling, config.rope_theta, dim)
    if scaling.rope_type == "longrope":
        return _longrope(inv_freq, scaling, long)
    raise ValueError(f"rope type {scaling.rope_type!r} is not supported")


def _longrope(inv_freq: np.ndarray, s: RopeScaling, long: bool) -> tuple[np.ndarray, float]:
    """LongRoPE (Phi-3): each frequency divided by its short or long factor; cos and sin scaled
    by the attention factor, by default sqrt(1 + ln(factor) / ln(original length))."""
    original = s.original_max_position_embeddings
    assert original is not None and s.short_factor and s.long_factor  # RopeScaling.from_hf
    factors = np.asarray(s.long_factor if long else s.short_factor, np.float64)
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if s.factor <= 1
                            else math.sqrt(1 + math.log(s.factor) / math.log(original)))
    return inv_freq / factors, float(attention_factor)


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1's scaling: long wavelengths divided by the factor, short ones kept, the band
    between blended smoothly."""
    old_len = s.original_max_position_embeddings
    assert old_len is not None  # RopeScaling.from_hf fills it for llama3
    low_wavelen, high_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(inv_freq: np.ndarray, s: RopeScaling, base: float, dim: int
          ) -> tuple[np.ndarray, float]:
    """YaRN: frequencies that turn often enough within the original length kept, slow ones
    interpolated by the factor, a linear ramp between; cos and sin scaled by the attention
    factor."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
        else:
            attention_factor = mscale(s.factor)
    original = s.original_max_position_embeddings
    assert original is not None  # RopeScaling.from_hf fills it for yarn

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv, float(attention_factor)


def _cos_sin(config: ModelConfig, positions: np.ndarray, long: bool = False) -> np.ndarray:
    """Rows of the table for these positions: [cos | sin], each half rotary_dim / 2 lanes of
    the rotation then cos 1, sin 0 on the lanes passed through (see the module docstring)."""
    inv_freq, attention_factor = inv_frequencies(config, long)
    angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    pad = config.head_dim // 2 - inv_freq.size
    ones = np.ones((positions.size, pad))
    return np.concatenate([np.cos(angle) * attention_factor, ones,
                           np.sin(angle) * attention_factor, 0 * ones], axis=-1)


def rope_variables(config: ModelConfig) -> dict[str, jax.Array]:
    """The model's "rope" collection: {"cos_sin_cache": [max_context_len, head_dim]
    float32}, and "local_cos_sin_cache" of the sliding-window layers' own RoPE where the config
    has one (Gemma 3's `rope_local_theta`)."""
    tables = {"cos_sin_cache": _table(config)}
    if config.rope_local_theta is not None:
        tables["local_cos_sin_cache"] = _table(dataclasses.replace(
            config, rope_theta=config.rope_local_theta, rope_scaling=config.rope_local_scaling))
    return tables


def _table(config: ModelConfig) -> jax.Array:
    """One [max_context_len, head_dim] table. longrope's rows: the short factors' below
    original_max_position_embeddings, the long ones' from there on, so each token's rotation
    depends on its position alone."""
    n = config.max_context_len
    s = config.rope_scaling
    if config.rotary_dim == config.head_dim and (s is None or s.rope_type != "longrope"):
        inv_freq, attention_factor = inv_frequencies(config)
        return rope_cos_sin_cache(config.head_dim, n, config.rope_theta, jnp.float32,
                                  inv_freq=inv_freq, attention_factor=attention_factor)
    table = _cos_sin(config, np.arange(n))
    if s is not None and s.rope_type == "longrope":
        start = s.original_max_position_embeddings
        assert start is not None
        if n > start:
            table[start:] = _cos_sin(config, np.arange(start, n), long=True)
    return jnp.asarray(table.astype(np.float32))
