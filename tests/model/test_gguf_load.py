"""quantization="gguf" builds the weights it keeps quantized straight from the file's blocks.

Every tree the loader returns is bit for bit the one it built by dequantizing every tensor into
the float32 tree (the quantization="none" load, which the other GGUF tests check against
transformers) and then replacing each weight the kernels read by its blocks: the oracle here,
from gguf_repack and the kernels' packing, Llama's q/k rows put back in Hugging Face's order
independently of the loader. And nothing is dequantized but what a tree keeps dense: no float32
copy of a weight kept quantized is ever formed.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, single_chunk
from jaxllm.model_executor.model_loader import gguf_repack
from jaxllm.model_executor.model_loader.loader import load_model
from tests.gguf_models import TINY_CONFIG, llama_permute, write_tiny_gguf

# Fused weight -> its GGUF tensors, stacked along rows.
_LAYER_WEIGHTS = {("self_attn", "qkv_proj"): ["attn_q", "attn_k", "attn_v"],
                  ("self_attn", "o_proj"): ["attn_output"],
                  ("mlp", "gate_up_proj"): ["ffn_gate", "ffn_up"],
                  ("mlp", "down_proj"): ["ffn_down"]}
_CPU_KERNEL_LAYOUTS = ("panels", "compact", "int8")
# (gguf_layout, kernel_backend, dtype): our CPU kernel's layouts; rows for XLA's GEMVs beside a
# float32 tree; rows for the Pallas kernel (interpreted here), which also takes bfloat16.
_LOADS = {"panels": ("panels", "reference", jnp.float32),
          "compact": ("compact", "reference", jnp.float32),
          "int8": ("int8", "reference", jnp.float32),
          "rows-xla": ("rows", "reference", jnp.float32),
          "rows-pallas-bf16": ("rows", "interpret", jnp.bfloat16)}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Tiny GGUFs of every supported block format (and a float16 weight): Qwen2 with and without
    tied embeddings, and Llama, whose q/k rows the converter permutes."""
    d = tmp_path_factory.mktemp("gguf_load")
    files = {"qwen2": dict(), "qwen2-tied": dict(seed=3, tied=True),
             "llama": dict(seed=5, arch="llama")}
    for name, kw in files.items():
        write_tiny_gguf(d / f"{name}.gguf", **kw)
    return {name: (d / f"{name}.gguf", kw.get("arch", "qwen2")) for name, kw in files.items()}


def _blocks(reader: gguf.GGUFReader, names: list[str], arch: str, layout: str,
            matmul: bool = True) -> GGUFWeight | None:
    """The weight these GGUF tensors stack into, kept quantized as `layout` lays it out; None
    where it stays float32 (a float tensor among them, or rows no panel of our kernel splits)."""
    tensors = [next(t for t in reader.tensors if t.name == name) for name in names]
    if any(t.tensor_type.name in gguf_repack.FLOAT_TYPES for t in tensors):
        return None
    parts = []
    for t in tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        r = gguf_repack.repack(t.data, t.tensor_type.name, shape)
        heads = {"attn_q": TINY_CONFIG["num_attention_heads"],
                 "attn_k": TINY_CONFIG["num_key_value_heads"]}.get(t.name.split(".")[-2])
        if arch == "llama" and heads:  # undo the converter's permutation of the rows
            rows = np.argsort(llama_permute(np.arange(shape[0]), heads))
            r = gguf_repack.RepackedBlocks(r.qweight[rows], r.scale[rows],
                                           None if r.offset is None else r.offset[rows])
        parts.append(r)
    r = parts[0] if len(parts) == 1 else gguf_repack.concat_rows(parts)
    cpu_kernel = layout in _CPU_KERNEL_LAYOUTS
    if cpu_kernel and cpu_dequant_matmul.panel_size(r.qweight.shape[0]) is None:
        return None
    if layout == "int8" and matmul:
        arrays = cpu_dequant_matmul.pack_int8(r.qweight, r.scale, r.offset)
    elif cpu_kernel:
        arrays = cpu_dequant_matmul.pack(r.qweight, r.scale, r.offset, layout == "compact")
    else:
        arrays = (r.qweight, r.scale, r.offset)
    return GGUFWeight(*(None if a is None else jnp.asarray(a) for a in arrays))


def _reference_trees(path: Path, arch: str, layout: str, kernel_backend: str,
                     dtype) -> tuple[dict, dict | None]:
    """(params, gemv_params) as built from the whole float32 tree: with a fused kernel (ours or
    Pallas) one tree, every block weight replaced by its blocks; else a float32 tree (its untied
    embedding gathered from the blocks) and beside it a GEMV tree, the weights narrow enough for
    one fused GEMV, the embedding and the LM head replaced."""
    dense = load_model(path, dtype=dtype, progress=False).params
    reader = gguf.GGUFReader(str(path))
    one_tree = kernel_backend != "reference" or layout in _CPU_KERNEL_LAYOUTS
    tied = "lm_head" not in dense
    embed = _blocks(reader, ["token_embd.weight"], arch, layout, matmul=False)
    params = dense if tied or embed is None else {**dense, "embed_tokens": embed}
    gemv = dict(params)
    for i in range(TINY_CONFIG["num_hidden_layers"]):
        layer = {group: {mod: dict(p) for mod, p in mods.items()} if group in ("self_attn", "mlp")
                 else mods for group, mods in params[f"layers_{i}"].items()}
        for (group, mod), names in _LAYER_WEIGHTS.items():
            if not one_tree and not single_chunk(layer[group][mod]["weight"].shape[1]):
                continue
            weight = _blocks(reader, [f"blk.{i}.{n}.weight" for n in names], arch, layout)
            if weight is not None:
                layer[group][mod]["weight"] = weight
        gemv[f"layers_{i}"] = layer
    if embed is not None:
        gemv["embed_tokens"] = embed
    head = None if tied else _blocks(reader, ["output.weight"], arch, layout)
    if head is not None:
        gemv["lm_head"] = head
    return (gemv, None) if one_tree else (params, gemv)


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_same_bits(got, want) -> None:
    got, want = _leaves(got), _leaves(want)
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        assert g.tobytes() == w.tobytes(), key


def _dense_values(*trees) -> int:
    """Values in the trees' float arrays (each array once: the trees share theirs)."""
    leaves = jax.tree.leaves(trees, is_leaf=lambda x: isinstance(x, GGUFWeight))
    dense = {id(x): x for x in leaves if not isinstance(x, GGUFWeight)}
    return sum(x.size for x in dense.values())


def _check_load(path: Path, arch: str, load: str, monkeypatch) -> None:
    layout, backend, dtype = _LOADS[load]
    if layout in _CPU_KERNEL_LAYOUTS and not cpu_dequant_matmul.available():
        pytest.skip("no C++ compiler to build the CPU kernel")
    if layout == "int8" and not cpu_dequant_matmul.int8_supported():
        pytest.skip("our CPU kernel has no integer path on this machine")
    want = _reference_trees(path, arch, layout, backend, dtype)
    dequantized = []
    real_dequantize = gguf.quants.dequantize

    def dequantize(data, qtype):
        values = real_dequantize(data, qtype)
        dequantized.append(values.size)
        return values

    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)
    loaded = load_model(path, dtype=dtype, progress=False, quantization="gguf",
                        kernel_backend=backend, gguf_layout=layout)
    got = (loaded.params, loaded.gemv_params)
    assert (got[1] is None) == (want[1] is None)
    for tree, reference in zip(got, want, strict=True):
        if reference is not None:
            _assert_same_bits(tree, reference)
    # Each tensor a tree keeps dense dequantized once; no other one at all.
    assert sum(dequantized) == _dense_values(*got)


@pytest.mark.parametrize("load", list(_LOADS))
@pytest.mark.parametrize("model", ["qwen2", "qwen2-tied", "llama"])
def test_trees_are_the_dequantize_then_replace_trees(ggufs, model, load, monkeypatch):
    _check_load(*ggufs[model], load, monkeypatch)


def test_rows_no_panel_splits_are_the_only_dequantized_matrices(ggufs, monkeypatch):
    """With our kernel's panels, the vocabulary's rows made unsplittable: the embedding table and
    the LM head stay float32 (dequantized), every other block weight is still read as blocks."""
    path, arch = ggufs["qwen2"]
    vocab, panel_size = TINY_CONFIG["vocab_size"], cpu_dequant_matmul.panel_size
    monkeypatch.setattr(cpu_dequant_matmul, "panel_size",
                        lambda rows: None if rows == vocab else panel_size(rows))
    _check_load(path, arch, "panels", monkeypatch)
