"""The roofline: the machine's measured GEMM rate and memory bandwidth (measured by the worker,
jaxllm/worker/machine_rates.py), a workload's useful FLOPs
and the bytes it must move, its ideal time max(FLOPs / GEMM rate, bytes / bandwidth) and the
fraction of it a run reaches."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxllm import LLM


@dataclass
class ModelCost:
    """What one token costs a model, from its config and loaded weights."""

    body_params: int  # decoder layers + final norm (every processed token goes through them)
    head_params: int  # LM head (only rows that sample)
    itemsize: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Bytes of the weights as a decode step stores them (quantized, float32 GEMV copies), when
    # they are not (body + head) x itemsize.
    decode_weight_bytes: int | None = None

    @classmethod
    def from_llm(cls, llm: LLM) -> ModelCost:
        engine = llm.llm_engine
        cfg = engine.model_config
        w = llm.collective_rpc("get_weight_stats")
        return cls(w["body_params"], w["head_params"], w["itemsize"], cfg.num_hidden_layers,
                   cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                   w.get("decode_weight_bytes"))

    @property
    def weight_bytes(self) -> int:
        """Bytes a step must read at least: every weight but the embedding table (a lookup)."""
        if self.decode_weight_bytes is not None:
            return self.decode_weight_bytes
        return (self.body_params + self.head_params) * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


def _tri(a: int, b: int) -> int:
    """sum of (p + 1) for p in [a, b)."""
    return (b * (b + 1) - a * (a + 1)) // 2 if b > a else 0


def workload_cost(cost: ModelCost, prompt_lens: list[int], output_lens: list[int],
                  max_num_seqs: int, max_num_batched_tokens: int) -> dict[str, float]:
    """Useful FLOPs and the bytes any engine with these limits must move."""
    processed = sampled = attn_ctx = kv_read_tokens = 0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        n = p + o - 1  # the last generated token is never fed back
        processed += n
        sampled += o
        attn_ctx += _tri(0, n)  # token at position q attends to q + 1 positions
        kv_read_tokens += _tri(p, n)  # decode steps re-read the cached context
    matmul = 2.0 * cost.body_params * processed + 2.0 * cost.head_params * sampled
    attn = 4.0 * cost.num_layers * cost.num_heads * cost.head_dim * attn_ctx
    # Every request needs o steps (its prefill's last chunk, then o - 1 decodes); a step holds
    # at most max_num_seqs sequences and max_num_batched_tokens tokens.
    steps = max(max(output_lens), math.ceil(sum(output_lens) / max_num_seqs),
                math.ceil(processed / max_num_batched_tokens))
    weight_bytes = float(steps) * cost.weight_bytes
    kv_bytes = float(kv_read_tokens) * cost.kv_bytes_per_token
    return {"processed_tokens": processed, "sampled_tokens": sampled, "matmul_flops": matmul,
            "attention_flops": attn, "flops": matmul + attn, "min_steps": steps,
            "weight_bytes_per_step": cost.weight_bytes, "weight_bytes": weight_bytes,
            "kv_read_bytes": kv_bytes, "bytes": weight_bytes + kv_bytes}


def roofline(machine: dict[str, float], work: dict[str, float],
             measured: dict[str, float]) -> dict[str, Any]:
    """`measured` maps a name ("jaxllm", "hf") to its elapsed seconds for this workload."""
    t_compute = work["flops"] / machine["gemm_flops_per_s"]
    t_memory = work["bytes"] / machine["bandwidth_bytes_per_s"]
    ideal = max(t_compute, t_memory)
    out = {**machine, **work, "ideal_compute_s": t_compute, "ideal_memory_s": t_memory,
           "ideal_time_s": ideal, "bound": "compute" if t_compute >= t_memory else "memory",
           "batch1_decode_bound_tok_per_s":
               machine["bandwidth_bytes_per_s"] / work["weight_bytes_per_step"]}
    for name, elapsed in measured.items():
        out[f"{name}_elapsed_s"] = elapsed
        out[f"{name}_fraction"] = ideal / max(elapsed, 1e-12)
    return out


ROOFLINE_ASSUMPTIONS = (
    "roofline assumes: FLOPs = 2 x (decoder + final-norm params) x processed tokens "
    "(prompt + output - 1 per request) + 2 x LM-head params x output tokens + 4 x layers x heads "
    "x head_dim x attended context, summed over processed tokens; bytes = the fewest steps any "
    "engine with this max_num_seqs / max_num_batched_tokens needs x all weights but the "
    "embedding table, + the K/V context re-read by every decode token; ideal time = max(FLOPs / "
    "best measured GEMM rate, bytes / best measured bandwidth); "
    "fraction = ideal / measured elapsed.")


def fmt_rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.1f} {prefix}{unit}"
    return f"{x:.1f} {unit}"


def fmt_s(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3f} ms"


def print_roofline(r: dict[str, Any]) -> None:
    print(f"Machine: GEMM {fmt_rate(r['gemm_flops_per_s'], 'FLOP/s')} "
          f"(XLA {fmt_rate(r['xla_flops_per_s'], 'FLOP/s')}, "
          f"numpy {fmt_rate(r['numpy_flops_per_s'], 'FLOP/s')}, {r['gemm_size']}^3), "
          f"bandwidth {fmt_rate(r['bandwidth_bytes_per_s'], 'B/s')} "
          f"(XLA in-place scale {fmt_rate(r['xla_bytes_per_s'], 'B/s')}, "
          f"numpy copy {fmt_rate(r['numpy_bytes_per_s'], 'B/s')}, "
          f"XLA GEMV read {fmt_rate(r['gemv_read_bytes_per_s'], 'B/s')}, {r['copy_mib']} MiB)")
    print(f"Workload: {r['flops'] / 1e9:.3f} GFLOP (attention "
          f"{r['attention_flops'] / 1e9:.3f}), {r['bytes'] / 1e9:.3f} GB ({r['min_steps']} steps x "
          f"{r['weight_bytes_per_step'] / 1e6:.1f} MB weights + "
          f"{r['kv_read_bytes'] / 1e9:.3f} GB KV reads); ideal {fmt_s(r['ideal_time_s'])} "
          f"({r['bound']}-bound: compute {fmt_s(r['ideal_compute_s'])}, "
          f"memory {fmt_s(r['ideal_memory_s'])})")
    parts = [f"{name} {r[f'{name}_fraction'] * 100:.1f}% of ideal "
             f"({fmt_s(r[f'{name}_elapsed_s'])})"
             for name in ("jaxllm", "hf") if f"{name}_fraction" in r]
    print("Roofline: " + ", ".join(parts)
          + f"; batch-1 decode bound {r['batch1_decode_bound_tok_per_s']:.1f} tok/s")
    print(textwrap.fill(f"({ROOFLINE_ASSUMPTIONS})", width=100))

