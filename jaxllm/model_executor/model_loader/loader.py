"""Loading weights offline: Hugging Face checkpoint directories (safetensors) and GGUF files.

Both paths produce the param tree of the checkpoint's model class (models/registry.py: q/k/v
and gate/up fused, linear weights kept [out, in] as checkpoints store them, rows in Hugging
Face's order); the tree is checked against the model's abstract shapes so a foreign or
damaged file fails with its path and what is wrong, never deep inside jit. With
quantization="gguf" a GGUF's block weights are also kept quantized (gguf_params.py), built from
the file's blocks: such a weight is dequantized only for a float32 tree that keeps it too (the
larger buckets' where XLA's GEMVs run the small decode buckets).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.gguf_file import read_gguf
from jaxllm.model_executor.model_loader.gguf_params import quantized_param_trees
from jaxllm.model_executor.model_loader.gguf_repack import FLOAT_TYPES, SUPPORTED_TYPES
from jaxllm.model_executor.model_loader.weight_layout import layer_weights, rotary_row_order
from jaxllm.model_executor.models.registry import (
    abstract_params,
    check_supported,
    get_model_class,
)


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    path: Path  # the checkpoint directory or the GGUF file
    kind: str  # "hf" or "gguf"
    # quantization="gguf" where only XLA's fused GEMVs read the blocks: the params of the small
    # decode buckets, GGUF blocks kept quantized, beside float32 copies in `params` for the
    # larger buckets (gguf_params.py). None with one tree for every bucket.
    gemv_params: dict | None = None


def load_model(path: str | Path, dtype: Any = jnp.float32, progress: bool = True,
               quantization: str | None = None,
               kernel_backend: str = "reference", gguf_layout: str = "rows") -> LoadedModel:
    """Load a checkpoint of a supported architecture (models/registry.py): a directory with
    config.json + *.safetensors, or a .gguf file.
    quantization="gguf" (GGUF only) also keeps the GGUF's block weights quantized, laid out as
    `gguf_layout` says (EngineConfig.gguf_layout; gguf_params.py): our CPU kernel's panels for
    every bucket; else rows, for every bucket with a Pallas backend (the fused dequant matmul
    kernel, which also takes bfloat16 activations), for the small decode buckets with the
    "reference" backend (XLA). A caller without an engine config passes what
    `jaxllm.config.resolve_gguf_layout` gives for its platform (our CPU kernel's panels on CPU).
    """
    fused = kernel_backend != "reference"
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if quantization not in (None, "none", "gguf"):
        raise ModelLoadError(f"quantization {quantization!r} is not supported (None, 'none' or "
                             f"'gguf')")
    if quantization == "none":
        quantization = None
    gguf_file = _gguf_file(path)
    if gguf_file is not None:
        return _load_gguf(gguf_file, dtype, progress, quantization, fused, gguf_layout)
    if quantization == "gguf":
        raise ModelLoadError(f"{path}: quantization='gguf' needs a .gguf model, this is a "
                             f"Hugging Face checkpoint directory")
    return _load_hf_dir(path, dtype, progress)


def _gguf_file(path: Path) -> Path | None:
    """The GGUF load_model reads for `path`: the file itself, or a directory's only .gguf when
    it has no config.json; None for a Hugging Face checkpoint directory."""
    if not path.is_dir():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    return ggufs[0] if not (path / "config.json").is_file() and len(ggufs) == 1 else None


def is_gguf_model(path: str | Path) -> bool:
    """Whether load_model reads `path` as a GGUF (an existing file or such a directory)."""
    path = Path(path).expanduser()
    return path.exists() and _gguf_file(path) is not None


def gguf_keeps_quantized(path: str | Path) -> bool:
    """Whether quantization="gguf" can load this GGUF: some block-format tensor, and every one
    a format gguf_repack keeps exactly (reads the header only; the data is memory-mapped)."""
    file = _gguf_file(Path(path).expanduser())
    if file is None:
        return False
    try:
        tensors = read_gguf(file).tensors
    except (ModelLoadError, OSError, ValueError):  # load_model names what is wrong
        return False
    types = {t.tensor_type.name for t in tensors} - set(FLOAT_TYPES)
    return bool(types) and types <= set(SUPPORTED_TYPES)


# --- Hugging Face checkpoints -------------------------------------------------------------------


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index "
                                 f"({type(e).__name__}: {e})") from e
        # Shard names are file names in this directory: nothing else is read.
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()):
            raise ModelLoadError(f"{index}: weight_map must map tensor names to shard file "
                                 f"names in {path}")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard named in {index.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files (and no .gguf) in the directory")
    # Mistral's repos ship the same weights twice: in the Hugging Face layout, and in its own
    # (`consolidated.safetensors`, other tensor names), which only its own code reads.
    own = [f for f in files if not f.name.startswith("consolidated")]
    return own or files


def _iter_safetensors(files: list[Path], progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import SafetensorError, safe_open

    names_per_file = []
    for f in files:
        try:
            with safe_open(f, framework="numpy") as st:
                names_per_file.append((f, list(st.keys())))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from e
    total = sum(len(names) for _, names in names_per_file)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress) as bar:
        for f, names in names_per_file:
            try:
                with safe_open(f, framework="numpy") as st:
                    for name in names:
                        yield name, st.get_tensor(name)
                        bar.update(1)
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelLoadError(f"{f}: truncated or damaged safetensors file ({e})") from e


# Buffers of Hugging Face's rotary embedding that older checkpoints saved.
_ROPE_BUFFERS = ("inv_freq", "cos_cached", "sin_cached")


def _load_hf_dir(path: Path, dtype: Any, progress: bool) -> LoadedModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        config = ModelConfig.from_json_file(config_file).with_generation_config(
            path / "generation_config.json")
        check_supported(config)
    except ValueError as e:
        message = str(e) if str(config_file) in str(e) else f"{config_file}: {e}"
        raise ModelLoadError(message) from e
    tensors = {}
    for name, arr in _iter_safetensors(_safetensors_files(path), progress):
        tensors[name.removeprefix("model.")] = arr
    if config.o_proj_bias and "layers.0.self_attn.o_proj.bias" not in tensors:
        # A checkpoint converted to Llama's layout with q/k/v biases only: transformers fills
        # the absent o_proj bias with zeros, which is no bias.
        config = dataclasses.replace(config, o_proj_bias=False)
    def take(name: str) -> np.ndarray | None:
        arr = tensors.pop(name, None)
        rows = rotary_row_order(config, name)
        return arr if arr is None or rows is None else arr[rows]

    params = _assemble_params(config, take, dtype, path, hf_names=True)
    # A weight left over has no place in the model: running without it would be silently wrong
    # (RoPE's precomputed buffers, which some checkpoints carry, are recomputed instead).
    unused = sorted(n for n in tensors if not n.rsplit(".", 1)[-1].endswith(_ROPE_BUFFERS))
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise ModelLoadError(f"{path}: weights that a {config.architecture} as configured has "
                             f"no place for: {shown}")
    return LoadedModel(config, params, path, "hf")


# --- GGUF ---------------------------------------------------------------------------------------


def _load_gguf(path: Path, dtype: Any, progress: bool, quantization: str | None = None,
               fused_kernel: bool = False, layout: str = "rows") -> LoadedModel:
    import gguf

    if quantization == "gguf" and not fused_kernel and jnp.dtype(dtype) != jnp.float32:
        raise ModelLoadError(f"{path}: quantization='gguf' with the reference backend computes "
                             f"in float32 (the exact dequantized values); got dtype "
                             f"{jnp.dtype(dtype).name} (a Pallas kernel_backend takes bfloat16)")
    try:
        reader = read_gguf(path)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e})") from e
    if reader.byte_order != "<":
        # gguf's dequantization reads every block as little-endian.
        raise ModelLoadError(f"{path}: a big-endian GGUF file is not supported (convert it to "
                             f"little-endian, llama.cpp's order)")
    meta = reader.metadata
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor")
    vocab_size = int(by_name["token_embd.weight"].shape[-1])
    freqs = by_name.get("rope_freqs.weight")
    short, long = (by_name.get(f"rope_factors_{kind}.weight") for kind in ("short", "long"))
    try:
        factors = None if freqs is None else _rope_freq_factors(freqs.data)
        if (short is None) != (long is None):
            raise ValueError("one of rope_factors_short.weight and rope_factors_long.weight "
                             "without the other")
        longrope_factors = None if short is None or long is None else (
            np.asarray(short.data, np.float64).reshape(-1).tolist(),
            np.asarray(long.data, np.float64).reshape(-1).tolist())
        config = ModelConfig.from_gguf_metadata(meta, vocab_size,
                                                tied="output.weight" not in by_name,
                                                attention_bias="blk.0.attn_q.bias" in by_name,
                                                o_proj_bias="blk.0.attn_output.bias" in by_name,
                                                rope_freq_factors=factors,
                                                longrope_factors=longrope_factors)
        check_supported(config)
        if factors is not None and len(factors) != config.head_dim // 2:
            raise ValueError(f"rope_freqs.weight holds {len(factors)} factors, head_dim "
                             f"{config.head_dim} needs {config.head_dim // 2}")
    except (ValueError, TypeError, OverflowError) as e:  # metadata of the wrong type or size
        raise ModelLoadError(f"{path}: {e}") from e

    bar = tqdm(total=len(by_name), desc="loading GGUF", unit="tensor", disable=not progress)
    counted: set[str] = set()

    def tensor(hf_name: str) -> Any:
        """The reader's tensor (None if absent), counted on the bar when first read."""
        t = by_name.get(_gguf_name(hf_name, config))
        if t is not None and t.name not in counted:
            counted.add(t.name)
            bar.update(1)
        return t

    def get(hf_name: str) -> np.ndarray | None:
        t = tensor(hf_name)
        if t is None:
            return None
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"{path}: cannot dequantize {t.name}: {e}") from e
        # GGUF lists dims fastest-first; numpy wants them reversed ([out, in] for a weight).
        arr = np.asarray(arr).reshape(tuple(reversed([int(d) for d in t.shape])))
        rows = gguf_row_order(config, hf_name)
        return arr if rows is None else arr[rows]

    def assemble(quantized: Callable[[list[str]], GGUFWeight | None] | None = None) -> dict:
        return _assemble_params(config, get, dtype, path, hf_names=False, quantized=quantized)

    try:
        if quantization != "gguf":
            return LoadedModel(config, assemble(), path, "gguf")
        # The weights kept quantized are built from the file's blocks, never dequantized.
        params, gemv_params = quantized_param_trees(
            config, assemble, tensor, path, fused_kernel, layout,
            row_order=lambda hf_name: gguf_row_order(config, hf_name))
    finally:
        bar.close()
    _release_freed_memory()
    return LoadedModel(config, params, path, "gguf", gemv_params)


def _rope_freq_factors(data: Any) -> tuple[float, ...]:
    """A `rope_freqs` tensor's factors; a ValueError unless each is a finite number > 0 (the
    frequencies are divided by them)."""
    factors = np.asarray(data, np.float32).reshape(-1)
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ValueError("rope_freqs.weight holds a factor that is not a finite number > 0")
    return tuple(float(f) for f in factors)


def _release_freed_memory() -> None:
    """Hand the buffers a load freed (blocks unpacked before their layout, float32 weights a
    GEMV tree replaced) back to the OS: glibc keeps freed heap memory mapped (the process's
    resident memory stays as if they were alive). A no-op where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# The norms of a layer with four (Gemma 2 and 3, `SANDWICH_NORM`), or with its two norms after
# its sublayers (OLMo 2, `POST_NORM`): llama.cpp names the one before the MLP as other
# families' post-attention norm.
_GGUF_SANDWICH_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Phi-3's fused tensors (gate and up: gate first).
_GGUF_FUSED_NAMES = {"self_attn.qkv_proj.weight": "attn_qkv.weight",
                     "mlp.gate_up_proj.weight": "ffn_up.weight"}
_GGUF_GLOBAL_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_row_order(config: ModelConfig, hf_name: str) -> np.ndarray | None:
    """Rows of a GGUF tensor in our order, where they differ from the file's: llama.cpp's
    converter interleaves the two halves of each Llama (and Granite) q and k head (its RoPE
    rotates adjacent pairs, Hugging Face's and ours rotate halves); partial rotary reorders q
    and k as from a Hugging Face checkpoint (`rotary_row_order`); None where the rows are as
    stored."""
    if config.architecture not in ("LlamaForCausalLM", "GraniteForCausalLM") \
            or not hf_name.startswith("layers."):
        return rotary_row_order(config, hf_name)
    part = hf_name.split(".", 2)[2]
    if part.startswith("self_attn.q_proj."):
        heads = config.num_attention_heads
    elif part.startswith("self_attn.k_proj."):
        heads = config.num_key_value_heads
    else:
        return None
    half = config.head_dim // 2
    return np.arange(heads * 2 * half).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def _gguf_name(hf_name: str, config: ModelConfig) -> str:
    if hf_name.startswith("layers."):
        _, idx, rest = hf_name.split(".", 2)
        model_cls = get_model_class(config.architecture)
        if (model_cls.SANDWICH_NORM or model_cls.POST_NORM) and rest in _GGUF_SANDWICH_NAMES:
            return f"blk.{idx}.{_GGUF_SANDWICH_NAMES[rest]}"
        return f"blk.{idx}.{_GGUF_LAYER_NAMES.get(rest) or _GGUF_FUSED_NAMES[rest]}"
    return _GGUF_GLOBAL_NAMES[hf_name]


# --- shared: HF-named tensors -> our param tree --------------------------------------------------


def _assemble_params(config: ModelConfig, take: Callable[[str], np.ndarray | None], dtype: Any,
                     path: Path, hf_names: bool,
                     quantized: Callable[[list[str]], GGUFWeight | None] | None = None
                     ) -> dict:
    """Build the param tree from tensors fetched by their HF name (minus the `model.` prefix).
    `quantized(names)`: a weight matrix kept quantized (a `GGUFWeight`, gguf_params.py) from the
    tensors stacked into it, or None to take them dense; never asked for norms and biases."""

    def need(name: str) -> np.ndarray:
        arr = take(name)
        if arr is None:
            shown = name if hf_names else f"{name} (GGUF {_gguf_name(name, config)})"
            if name == "lm_head.weight":
                shown += " (the config does not tie word embeddings)"
            raise ModelLoadError(f"{path}: missing tensor {shown}")
        return arr

    def dev(arr: np.ndarray) -> jax.Array:
        return jnp.asarray(arr, dtype=dtype)

    def matrix(names: list[str]) -> Any:
        """The weight of these tensors stacked along rows (q/k/v, gate/up fused)."""
        kept = None if quantized is None else quantized(names)
        if kept is not None:
            return kept  # its tensors are not taken: nothing is dequantized for it
        parts = [need(name) for name in names]
        return dev(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0))

    model_cls = get_model_class(config.architecture)
    qk_norm = model_cls.QK_NORM
    names = layer_weights(config)

    def norm(name: str) -> dict[str, jax.Array]:
        if not model_cls.NORM_WEIGHT_OFFSET:
            return {"weight": dev(need(name))}
        # Gemma's norms scale by (1 + weight) computed in float32: the one is added here, in
        # float32, and the sum kept in float32 whatever the model's dtype, so the norm kernels
        # (which scale by a float32 copy of their weight) compute exactly Hugging Face's
        # x * rsqrt(...) * (1.0 + w.float()); a bfloat16 sum would round it once more.
        # llama.cpp's converter has added the one already: a GGUF holds the sum.
        w = np.asarray(need(name), np.float32)
        if hf_names:
            w = w + np.float32(model_cls.NORM_WEIGHT_OFFSET)
        return {"weight": jnp.asarray(w, jnp.float32)}

    params: dict[str, Any] = {"embed_tokens": matrix(["embed_tokens.weight"])}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        qkv = {"weight": matrix([p + n for n in names["self_attn", "qkv_proj"]])}
        if config.attention_bias:
            qkv["bias"] = dev(np.concatenate([need(p + f"self_attn.{x}_proj.bias")
                                              for x in "qkv"], axis=0))
        attn: dict[str, Any] = {
            "qkv_proj": qkv, "o_proj": {"weight": matrix([p + "self_attn.o_proj.weight"])}}
        if config.o_proj_bias:
            attn["o_proj"]["bias"] = dev(need(p + "self_attn.o_proj.bias"))
        if qk_norm:
            for name in ("q_norm", "k_norm"):
                attn[name] = norm(p + f"self_attn.{name}.weight")
        if model_cls.PROJECTION_QK_NORM:
            # Apart from per-head norms in the tree: tensor parallelism splits these by head.
            for x in "qk":
                attn[f"{x}_proj_norm"] = norm(p + f"self_attn.{x}_norm.weight")
        norms = ["input_layernorm", "post_attention_layernorm"]
        if model_cls.SANDWICH_NORM:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if model_cls.POST_NORM:
            norms = ["post_attention_layernorm", "post_feedforward_layernorm"]
        params[f"layers_{i}"] = {
            **{name: norm(p + f"{name}.weight") for name in norms},
            "self_attn": attn,
            "mlp": (_moe_params(config, p, take, need, dev, matrix)
                    if config.moe is not None and i in config.moe.sparse_layers
                    else _mlp_params(p + "mlp.", matrix, names)),
        }
    params["norm"] = norm("norm.weight")
    if not config.tie_word_embeddings:
        params["lm_head"] = matrix(["lm_head.weight"])
    else:
        lm_head = take("lm_head.weight")
        if lm_head is not None and not np.array_equal(
                np.asarray(lm_head, np.float32), np.asarray(params["embed_tokens"], np.float32)):
            raise ModelLoadError(f"{path}: config ties word embeddings but lm_head.weight differs")
    _check_against_model(config, params, dtype, path)
    return params


def _mlp_params(prefix: str, matrix: Callable[[list[str]], Any],
                names: dict[tuple[str, str], list[str]] | None = None) -> dict:
    """A SwiGLU MLP's params (gate and up fused) from `{prefix}{gate,up,down}_proj.weight`, or
    from the tensors `names` (`layer_weights`) gives."""
    gate_up = ["gate_proj.weight", "up_proj.weight"]
    if names is not None:
        gate_up = [n.removeprefix("mlp.") for n in names["mlp", "gate_up_proj"]]
    return {"gate_up_proj": {"weight": matrix([prefix + n for n in gate_up])},
            "down_proj": {"weight": matrix([prefix + "down_proj.weight"])}}


# Per-expert weight names: Qwen's (gate_proj, up_proj, down_proj) and Mixtral's (w1, w3, w2).
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _moe_params(config: ModelConfig, p: str, take: Callable[[str], np.ndarray | None],
                need: Callable[[str], np.ndarray], dev: Callable[[np.ndarray], jax.Array],
                matrix: Callable[[list[str]], Any]) -> dict:
    """An MoE block's params (layers/fused_moe.py) from layer prefix `p`'s tensors: the block
    under `mlp.` (Mixtral's checkpoints: `block_sparse_moe.`), its experts stored per expert, as
    the Hub's checkpoints have them (`experts.{e}.gate_proj.weight`, Mixtral's
    `experts.{e}.w1.weight`), or stacked as transformers 5 holds them (`experts.gate_up_proj`
    [E, 2 * inter, hidden], `experts.down_proj` [E, hidden, inter]); per-expert tensors are
    stacked here. A tensor of another layout left over is refused by the caller as unplaced."""
    moe = config.moe
    assert moe is not None
    blocks = [p + "mlp.", p + "block_sparse_moe."]
    router = None
    block = blocks[0]
    for block in blocks:
        router = take(block + "gate.weight")
        if router is not None:
            break
    if router is None:
        need(blocks[0] + "gate.weight")  # raises, naming it
    params: dict[str, Any] = {"gate": {"weight": dev(np.asarray(router))}}
    gate_up = take(block + "experts.gate_up_proj")
    if gate_up is not None:
        down = need(block + "experts.down_proj")
    else:
        e = block + "experts.{}.{}.weight"
        probed: dict[str, np.ndarray] = {}
        names = _EXPERT_NAMES[0]
        for spelling in _EXPERT_NAMES:
            first = take(e.format(0, spelling[0]))
            if first is not None:
                names, probed[e.format(0, spelling[0])] = spelling, first
                break

        def get(name: str) -> np.ndarray:
            return probed.pop(name) if name in probed else need(name)

        gate_up = np.stack([np.concatenate([get(e.format(i, names[0])),
                                            get(e.format(i, names[1]))], axis=0)
                            for i in range(moe.num_experts)])
        down = np.stack([get(e.format(i, names[2])) for i in range(moe.num_experts)])
    params["experts"] = {"gate_up_proj": dev(gate_up), "down_proj": dev(down)}
    if moe.shared_expert_intermediate_size:
        params["shared_expert"] = _mlp_params(block + "shared_expert.", matrix)
        params["shared_expert_gate"] = {"weight": dev(need(block + "shared_expert_gate.weight"))}
    return params


def _check_against_model(config: ModelConfig, params: dict, dtype: Any, path: Path) -> None:
    expected = abstract_params(get_model_class(config.architecture)(config, dtype=dtype))
    want = {jax.tree_util.keystr(k): v.shape
            for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    # A weight kept quantized has the shape of the matrix it holds, whatever its layout.
    got = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(
        params, is_leaf=lambda x: isinstance(x, GGUFWeight))}
    for key in sorted(set(want) | set(got)):
        if key not in got:
            raise ModelLoadError(f"{path}: missing weight {key}")
        if key not in want:
            raise ModelLoadError(f"{path}: unexpected weight {key}")
        if tuple(want[key]) != tuple(got[key]):
            raise ModelLoadError(
                f"{path}: weight {key} has shape {tuple(got[key])}, the config implies "
                f"{tuple(want[key])}")
