"""GGUF block bytes and tiny Qwen2 GGUF files for the quantization="gguf" tests; GGUF files
converted from tiny HF models of each family, as llama.cpp converts them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# Byte offsets of the f16 fields (d, and dmin for the K formats with mins) in each block.
_F16_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}
# Magnitudes of those fields: keep dequantized weights within 0.01-0.1 for a sane model.
_F16_SCALE = {"Q4_0": 0.01, "Q5_0": 0.005, "Q8_0": 0.001, "Q4_1": 0.01, "Q4_K": 0.0005,
              "Q5_K": 0.0002, "Q6_K": 0.00002}


def random_blocks(rng: np.random.Generator, type_name: str, rows: int, cols: int,
                  signed_zeros: bool = False) -> np.ndarray:
    """[rows, bytes per row] uint8: random block bytes with finite f16 scale fields (random
    signs; with `signed_zeros` also +0.0 and -0.0 scales, whose products are signed zeros)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // per_block
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for at in _F16_FIELDS[type_name]:
        d = rng.standard_normal(n).astype(np.float32) * _F16_SCALE[type_name]
        if signed_zeros:
            d[::7] = 0.0
            d[3::7] = -0.0
        blocks[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def quantized_bytes(rng: np.random.Generator, type_name: str, rows: int,
                    cols: int) -> np.ndarray:
    """gguf's own quantizer where it has one (random normal weights), else random blocks."""
    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05,
                                    qtype)
    except NotImplementedError:
        return random_blocks(rng, type_name, rows, cols)


TINY_CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)

# Every supported format, a float16 matrix, and fused groups mixing block sizes and offsets.
TINY_FORMATS = {
    "token_embd.weight": "Q5_0", "output.weight": "Q8_0",
    "blk.0.attn_q.weight": "Q5_0", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q5_K",
    "blk.0.ffn_up.weight": "Q5_K", "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q6_K", "blk.1.attn_k.weight": "Q4_K", "blk.1.attn_v.weight": "Q5_0",
    "blk.1.attn_output.weight": "F16", "blk.1.ffn_gate.weight": "Q4_0",
    "blk.1.ffn_up.weight": "Q5_0", "blk.1.ffn_down.weight": "Q4_K",
}


def _tiny_shapes() -> dict[str, tuple[int, int] | tuple[int]]:
    c = TINY_CONFIG
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    shapes: dict = {"token_embd.weight": (v, h), "output.weight": (v, h),
                    "output_norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"blk.{i}."
        shapes.update({p + "attn_q.weight": (h, h), p + "attn_k.weight": (kv, h),
                       p + "attn_v.weight": (kv, h), p + "attn_output.weight": (h, h),
                       p + "ffn_gate.weight": (inter, h), p + "ffn_up.weight": (inter, h),
                       p + "ffn_down.weight": (h, inter), p + "attn_q.bias": (h,),
                       p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
                       p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)})
    return shapes


def write_tiny_gguf(path, seed: int = 0, formats: dict[str, str] | None = None,
                    tied: bool = False, arch: str = "qwen2") -> dict:
    """Write a 2-layer Qwen2 GGUF (architecture qwen2, no tokenizer; `tied`: no output.weight)
    and return its tensors as gguf dequantizes them, {GGUF name: float32 array in numpy
    order}: the HF oracle's weights. `arch` "llama": the same tensors but the q/k/v biases,
    which Llama has not (its q and k rows are random, so their order is the file's)."""
    rng = np.random.default_rng(seed)
    formats = {**TINY_FORMATS, **(formats or {})}
    c = TINY_CONFIG
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    for name, shape in _tiny_shapes().items():
        if (tied and name == "output.weight") or (arch == "llama" and name.endswith(".bias")):
            continue
        fmt = formats.get(name, "F32")
        if len(shape) == 1:  # norms near 1, biases that matter
            base = 1.0 if name.endswith("norm.weight") else 0.0
            writer.add_tensor(name, (base + 0.3 * rng.standard_normal(shape)).astype(np.float32))
        elif fmt in ("F32", "F16"):
            writer.add_tensor(name, (0.05 * rng.standard_normal(shape)).astype(
                {"F32": np.float32, "F16": np.float16}[fmt]))
        else:
            writer.add_tensor(name, quantized_bytes(rng, fmt, *shape),
                              raw_dtype=gguf.GGMLQuantizationType[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(reversed([int(d) for d in t.shape]))) for t in reader.tensors}


def hf_model_from(tensors: dict):
    """transformers' Qwen2ForCausalLM holding exactly `tensors` (the oracle)."""
    import torch
    import transformers

    from jaxllm.model_executor.model_loader.loader import _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES

    to_hf = {v: "model." + k if k != "lm_head.weight" else k
             for k, v in _GGUF_GLOBAL_NAMES.items()}
    for i in range(TINY_CONFIG["num_hidden_layers"]):
        to_hf.update({f"blk.{i}.{v}": f"model.layers.{i}.{k}" for k, v in
                      _GGUF_LAYER_NAMES.items()})
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_CONFIG)).eval()
    state = {to_hf[name]: torch.from_numpy(np.array(arr, np.float32))
             for name, arr in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


# --- GGUF files converted from tiny HF models, as llama.cpp's convert_hf_to_gguf.py writes them --

# Hugging Face model_type -> GGUF general.architecture (llama.cpp writes Mistral as "llama").
GGUF_ARCH_OF_MODEL_TYPE = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama",
                           "mistral": "llama", "phi3": "phi3", "granite": "granite",
                           "olmo2": "olmo2"}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q / k rows reordered from Hugging Face's
    rotate-half RoPE layout to llama.cpp's interleaved pairs (n_head: the heads of this
    projection, the KV heads for k)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for Llama 3's RoPE scaling: each frequency is divided by
    its factor. convert_hf_to_gguf.py reads original_max_position_embeddings at the config's
    top level (absent in Llama 3.x configs: its default 8192 is their rope_scaling's value);
    here it is the RoPE parameters' own, the length the HF model scales with."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def write_gguf_from_hf(path, hf_model, ftype: str = "F32") -> None:
    """Convert a tiny HF Qwen2 / Qwen3 / Llama / Mistral / Phi-3 / Granite / OLMo 2 model to a
    GGUF as llama.cpp does: tensors renamed by gguf's own name map (Phi-3's fused `attn_qkv`
    and `ffn_up`, gate and up; OLMo 2's post-sublayer norms as `post_attention_norm` and
    `post_ffw_norm`); Llama's and Granite's q and k rows (weights and biases) permuted for its
    interleaved RoPE; Qwen3's per-head q/k norms (OLMo 2's whole-projection ones) as
    attn_q_norm / attn_k_norm; no output.weight when the embeddings are tied; RoPE scaling as
    metadata (linear, yarn) or, for Llama 3's, the `rope_freqs` tensor; Phi-3's rotary dims,
    window and longrope (its factors as `rope_factors_short` / `rope_factors_long` tensors);
    Granite's multipliers. `ftype`: the matrices' type, F32, F16 or Q8_0 (gguf's own
    quantizer); vectors stay F32. No tokenizer: prompts go in as token ids."""
    import gguf as g

    cfg = hf_model.config
    arch = GGUF_ARCH_OF_MODEL_TYPE[cfg.model_type]
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", "default")

    writer = g.GGUFWriter(str(path), arch)
    writer.add_name("tiny")  # not "mistral": transformers would then read the file as Mistral
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "sliding_window", None) is not None:
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "granite":
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if rope_type == "longrope":
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)))
        for kind in ("short", "long"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(rope[f"{kind}_factor"], np.float32))
    elif rope_type == "linear":
        writer.add_rope_scaling_type(g.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(g.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type == "llama3":
        writer.add_tensor(g.TENSOR_NAMES[g.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                          llama3_rope_factors(head_dim, theta, rope))
    elif rope_type != "default":
        raise ValueError(f"no GGUF form written here for rope type {rope_type!r}")

    names = g.get_tensor_name_map(g.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, tensor in hf_model.state_dict().items():
        if "rotary_emb" in hf_name:
            continue
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.detach().float().numpy().copy()
        if arch in ("llama", "granite") and hf_name.endswith(("self_attn.q_proj.weight",
                                                              "self_attn.q_proj.bias")):
            data = llama_permute(data, n_head)
        elif arch in ("llama", "granite") and hf_name.endswith(("self_attn.k_proj.weight",
                                                                "self_attn.k_proj.bias")):
            data = llama_permute(data, n_kv)
        if data.ndim == 1 or ftype == "F32":
            writer.add_tensor(name, data.astype(np.float32))
        elif ftype == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            qtype = g.GGMLQuantizationType[ftype]
            writer.add_tensor(name, g.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_from_gguf(path, config=None):
    """transformers' own loading of a GGUF file (float32, dequantized by gguf): with `config`
    (the original model's), its tensors in that model, RoPE scaling included, which
    transformers' GGUF reader does not take from Llama or Qwen3 metadata; without, config and
    tensors both as transformers reads the file."""
    import torch
    import transformers

    path = Path(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, config=config).eval()


def write_skeleton_gguf(path, arch: str, uint32s: dict[str, int] | None = None) -> None:
    """A one-layer GGUF of `arch` with only an embedding and a final norm (for the loader's
    refusals, which look at the header), plus these uint32 metadata items."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    for key, value in (uint32s or {}).items():
        writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
