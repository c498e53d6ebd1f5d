"""Lower the tensor-parallel step for CUDA without devices, and read its collectives.

`lower_sharded_step` builds the runner's own step (jaxllm/worker/step.py) on an `AbstractMesh`
with the Pallas kernels, params and KV array as sharded abstract values, and lowers it with
`lowering_platforms=("cuda",)` (`pallas_kernels.common.lower_for_cuda`). The all-reduces are
explicit `psum`s under `shard_map`, so they are in the lowered module (XLA adds none at compile
time): `collectives` counts them and the bytes each moves, which BENCHMARKS.md prices.

    python -m jaxllm.distributed.check_tp_lowering    # the table for the models below
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.distributed.tensor_parallel import KV_SPEC, TP_AXIS, param_specs, tp_layout
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers.attention import AttentionMetadata, kv_cache_shape
from jaxllm.model_executor.layers.rotary_embedding import rope_variables
from jaxllm.model_executor.models.registry import abstract_params, get_model_class
from jaxllm.sample.topk import TOPK
from jaxllm.worker.step import forward_step
from pallas_kernels.attention_common import decode_num_splits
from pallas_kernels.checks.shapes import QWEN2_SHAPES
from pallas_kernels.common import abstract_cuda_mesh, lower_for_cuda

# Real widths, 2 layers to keep the check short.
MODELS = {name: ModelConfig.from_hf_config(shape.hf_config(num_hidden_layers=2, rope_theta=1e6))
          for name, shape in QWEN2_SHAPES.items()}
# (model, TP sizes) checked: KV heads split evenly, and replicated (qwen2.5-1.5b's 2 at TP 4).
CASES = [("qwen2.5-1.5b", (2, 4)), ("qwen2.5-7b", (2, 4)), ("qwen2-72b", (8,))]

_ALL_REDUCE = re.compile(r'"?stablehlo\.all_reduce"?')
_ALL_GATHER = re.compile(r'"?stablehlo\.all_gather"?')
_TYPE = re.compile(r"\) -> \(?tensor<([0-9x]+)x(bf16|f16|f32|i32)>")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4}


@dataclass
class Collectives:
    all_reduces: int
    all_reduce_bytes: int  # summed over the ops: what each device contributes per step
    all_gathers: list[tuple[int, ...]]  # result shapes


def _result(text: str, start: int) -> tuple[tuple[int, ...], str]:
    t = _TYPE.search(text, start)
    if t is None:
        raise ValueError(f"no result tensor type after offset {start} of the lowered module")
    return tuple(int(d) for d in t.group(1).split("x")), t.group(2)


def collectives(text: str) -> Collectives:
    """All-reduce count and bytes, all-gather result shapes of a lowered StableHLO module."""
    count, total = 0, 0
    for m in _ALL_REDUCE.finditer(text):
        shape, dtype = _result(text, m.end())
        count += 1
        total += math.prod(shape) * _BYTES[dtype]
    gathers = [_result(text, m.end())[0] for m in _ALL_GATHER.finditer(text)]
    return Collectives(count, total, gathers)


def lower_sharded_step(config: ModelConfig, tp: int, num_tokens: int, decode: bool, *,
                       dtype: Any = jnp.bfloat16, backend: str = "pallas", block_size: int = 16,
                       num_blocks: int = 256, max_model_len: int = 4096,
                       max_num_seqs: int = 64, top_k: int = TOPK) -> str:
    """StableHLO text of the runner's step for `config` split over `tp` devices, lowered for
    CUDA on an abstract mesh: a decode bucket (`decode`: one token per sequence, split-K
    attention as the runner sizes it) or a prefill bucket of `num_tokens`."""
    layout = tp_layout(config, tp)
    # The device goes on the mesh itself: shard_map's body lowers under this mesh, not the
    # context's.
    mesh = abstract_cuda_mesh((tp,), (TP_AXIS,))
    model_class = get_model_class(config.architecture)
    model = model_class(layout.local, dtype=dtype, kernel_backend=backend, tp_axis=TP_AXIS)
    # The global tree: the model with the KV heads the sharded layout holds (with replicas).
    full = dataclasses.replace(config, num_key_value_heads=layout.num_kv_heads_total)
    params = abstract_params(model_class(full, dtype=dtype))

    def sharded(x, spec=None):
        spec = P() if spec is None else spec
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(sharded, params, param_specs(params))
    rope = jax.tree.map(sharded, jax.eval_shape(lambda: rope_variables(config)))
    kv = sharded(jax.ShapeDtypeStruct(kv_cache_shape(full, num_blocks, block_size), dtype),
                 KV_SPEC)
    seqs = min(num_tokens, max_num_seqs)

    def i32(*shape):
        return sharded(jax.ShapeDtypeStruct(shape, jnp.int32))

    attn_metadata = AttentionMetadata(
        i32(num_tokens), i32(seqs, -(-max_model_len // block_size)), i32(seqs), i32(seqs + 1),
        i32(seqs))
    splits = decode_num_splits(full.max_attended_keys(max_model_len), seqs,
                               layout.local.num_key_value_heads,
                               num_sms=132) if decode else 1
    fn = functools.partial(forward_step, model, top_k, mesh,
                           max_query_len=1 if decode else num_tokens, num_splits=splits)
    return lower_for_cuda(fn, (params, rope, kv, i32(num_tokens), i32(num_tokens), attn_metadata),
                          mesh).as_text()


def main(argv: list[str] | None = None) -> int:
    del argv
    print("| model | TP | step | tokens | all-reduces | per layer | bytes all-reduced / step "
          "(per device) | all-gathers |")
    print("|---|---|---|---|---|---|---|---|")
    for name, sizes in CASES:
        cfg = MODELS[name]
        for tp in sizes:
            for step, tokens, decode in (("decode", 64, True), ("prefill", 512, False)):
                c = collectives(lower_sharded_step(cfg, tp, tokens, decode))
                per_layer = (c.all_reduces - 1) / cfg.num_hidden_layers
                print(f"| {name} | {tp} | {step} | {tokens} | {c.all_reduces} | {per_layer:g} "
                      f"| {c.all_reduce_bytes:,} | {len(c.all_gathers)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
