"""GGUF block bytes and tiny Qwen2 GGUF files for the quantization="gguf" tests."""

from __future__ import annotations

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
                    tied: bool = False) -> dict:
    """Write a 2-layer Qwen2 GGUF (architecture qwen2, no tokenizer; `tied`: no output.weight)
    and return its tensors as gguf dequantizes them, {GGUF name: float32 array in numpy
    order}: the HF oracle's weights."""
    rng = np.random.default_rng(seed)
    formats = {**TINY_FORMATS, **(formats or {})}
    c = TINY_CONFIG
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    for name, shape in _tiny_shapes().items():
        if tied and name == "output.weight":
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
