"""quantization="gguf": the param trees the runner runs.

Where a kernel reads GGUF blocks at every row count there is one tree, every GGUF block weight
quantized (the LM head and down_proj included) for every bucket, so no float copy of a quantized
weight exists, not even while loading (its blocks go straight from the file to their layout):
- on CPU our fused dequant matmul (layers/quantization/cpu_dequant_matmul.py), with the blocks
  in its panel layout (`cpu_dequant_matmul.pack`; a weight whose rows no panel width divides
  stays float32);
- with a Pallas kernel backend (`fused_kernel`), pallas_kernels/dequant_matmul.py (GEMV for
  decode, tiled GEMM for prefill), the blocks as rows.

Otherwise (layout "rows" with the reference backend: CPU without our kernel, no compiler or
$JAXLLM_CPU_KERNELS=0, or XLA on a GPU) two trees:
- `gemv_params` (small decode buckets): GGUF block weights are `GGUFWeight`s read by XLA's
  fused GEMVs; rows too wide for one fused GEMV (`single_chunk`: down_proj) stay float32, which
  was faster; float tensors stay float32.
- `params` (every other bucket, and prompt-logprob chunks): float32 copies of the same exact
  values, since multi-row dots are fastest in float32 there; they share their arrays with
  `gemv_params` wherever that tree is float32 too (norms, biases, down_proj), so only the
  quantized weights exist twice. The embedding table is gathered from its quantized form in both
  trees (a gather reads a few rows: nothing to gain from float32), unless the LM head is tied to
  it, where the float32 head needs it.
Every tree holds the same values bit for bit: gguf_repack.py repacks each block format exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, single_chunk
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.gguf_repack import (
    FLOAT_TYPES,
    RepackedBlocks,
    UnsupportedGGUFType,
    concat_rows,
    repack,
)
from jaxllm.model_executor.model_loader.weight_layout import layer_weights

# The layouts (EngineConfig.gguf_layout, named in jaxllm/config.py) of our CPU kernel's panels.
CPU_KERNEL_LAYOUTS = ("panels", "compact", "int8")

def _device(r: RepackedBlocks, packed: bool, compact: bool, int8: bool = False) -> GGUFWeight:
    if int8:
        q, scale, offset = cpu_dequant_matmul.pack_int8(r.qweight, r.scale, r.offset)
    elif packed:
        q, scale, offset = cpu_dequant_matmul.pack(r.qweight, r.scale, r.offset, compact)
    else:
        q, scale, offset = r.qweight, r.scale, r.offset
    return GGUFWeight(jnp.asarray(q), jnp.asarray(scale),
                      None if offset is None else jnp.asarray(offset))


def quantized_param_trees(config: ModelConfig,
                          assemble: Callable[[Callable[[list[str]], GGUFWeight | None]], dict],
                          tensor: Callable[[str], Any], path: Path, fused_kernel: bool = False,
                          layout: str = "rows",
                          row_order: Callable[[str], Any] | None = None
                          ) -> tuple[dict, dict | None]:
    """(params, gemv_params); with `fused_kernel` or a layout of our CPU kernel, (one tree for
    every bucket, every GGUF block weight the kernel can read quantized, None).
    `assemble(quantized)`: the loader's param tree, each weight matrix the `GGUFWeight`
    `quantized(hf_names)` gives for the tensors stacked into it, dequantized to float32 where it
    gives None; so a weight kept quantized is dequantized only where a float32 tree also keeps
    it. `tensor(hf_name)`: the GGUF reader's tensor of that name (None if absent).
    `layout` as resolved in the config: "panels", our CPU kernel's; "compact", its 4- and 5-bit
    values in 5-bit panels; "int8", its integer path's for the matmul weights whose values it
    takes (the embedding, only gathered, keeps the exact one); "rows", the blocks as rows.
    `row_order(hf_name)`: the rows of that tensor in the dense tree's order (None: as stored),
    applied to its blocks as the dense loader applies it to its values."""
    def quantized(hf_names: list[str]) -> GGUFWeight | None:
        tensors = [tensor(name) for name in hf_names]
        if any(t is None or t.tensor_type.name in FLOAT_TYPES for t in tensors):
            return None  # absent (the dense loader names it) or float: the weight stays float32
        # The stacked weight's shape from the headers: the data is read only if it is kept.
        shapes = [tuple(reversed([int(d) for d in t.shape])) for t in tensors]
        if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
            raise ModelLoadError(f"{path}: {', '.join(hf_names)}: shapes {shapes} do not stack "
                                 f"into one weight")
        if cpu_kernel and cpu_dequant_matmul.panel_size(sum(s[0] for s in shapes)) is None:
            return None  # rows the kernel's panels cannot split: the weight stays float32
        parts = []
        for name, t, shape in zip(hf_names, tensors, shapes, strict=True):
            try:
                part = repack(t.data, t.tensor_type.name, shape, t.name)
            except (UnsupportedGGUFType, ValueError) as e:
                raise ModelLoadError(f"{path}: {e}") from e
            rows = None if row_order is None else row_order(name)
            if rows is not None:  # blocks run along a row, so rows move whole
                if len(rows) != shape[0]:
                    raise ModelLoadError(f"{path}: {t.name}: {shape[0]} rows, the config's "
                                         f"heads take {len(rows)}")
                part = RepackedBlocks(part.qweight[rows], part.scale[rows],
                                      None if part.offset is None else part.offset[rows])
            parts.append(part)
        blocks = parts[0] if len(parts) == 1 else concat_rows(parts)
        # The kernels read whole blocks of these sizes along a row.
        if blocks.block_size not in (16, 32) or blocks.qweight.shape[1] % 32:
            raise ModelLoadError(f"{path}: {', '.join(hf_names)}: quantized blocks of shape "
                                 f"{blocks.qweight.shape} (block {blocks.block_size})")
        matmul = hf_names != ["embed_tokens.weight"]  # the embedding is also gathered
        try:
            return _device(blocks, packed=cpu_kernel, compact=compact,
                           int8=int8 and cpu_kernel and matmul)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {', '.join(hf_names)}: {e}") from e

    if layout not in (*CPU_KERNEL_LAYOUTS, "rows"):
        raise ValueError(f"{path}: GGUF layout {layout!r} is not one of "
                         f"{(*CPU_KERNEL_LAYOUTS, 'rows')}")
    cpu_kernel = layout in CPU_KERNEL_LAYOUTS
    compact, int8 = layout == "compact", layout == "int8"
    if cpu_kernel and (fused_kernel or not cpu_dequant_matmul.available()):
        raise ModelLoadError(f"{path}: GGUF layout {layout!r} packs blocks for our CPU kernel, "
                             f"which this load does not run (kernel backend, platform or no "
                             f"compiler)")
    if int8 and not cpu_dequant_matmul.int8_supported():
        raise ModelLoadError(f"{path}: cpu_int8_activations: our CPU kernel has no integer path "
                             f"on this machine (it needs x86 with AVX2)")
    if fused_kernel or cpu_kernel:  # one tree: no float32 copy of a quantized weight exists
        return assemble(quantized), None
    # Two trees: the float32 one keeps every weight dense but an untied embedding (gathered in
    # both trees), which the GEMV tree then shares.
    tied = config.tie_word_embeddings
    params = assemble(lambda hf_names: None if tied or hf_names != ["embed_tokens.weight"]
                      else quantized(hf_names))
    gemv = {k: v for k, v in params.items()}
    for i in range(config.num_hidden_layers):
        layer = {group: dict(mods) for group, mods in params[f"layers_{i}"].items()}
        for group in ("self_attn", "mlp"):
            layer[group] = {name: dict(p) for name, p in layer[group].items()}
        for (group, mod), hf_names in layer_weights(config).items():
            # XLA's fused GEMV lost to float32 on rows as wide as down_proj's.
            if not single_chunk(layer[group][mod]["weight"].shape[1]):
                continue
            weight = quantized([f"layers.{i}.{n}" for n in hf_names])
            if weight is not None:
                layer[group][mod]["weight"] = weight
        gemv[f"layers_{i}"] = layer
    if tied:  # the float32 head needs the float32 table; the GEMV tree gathers the blocks
        embed = quantized(["embed_tokens.weight"])
        if embed is not None:
            gemv["embed_tokens"] = embed
    else:
        head = quantized(["lm_head.weight"])
        if head is not None:
            gemv["lm_head"] = head
    return params, gemv
