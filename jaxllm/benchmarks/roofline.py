"""The roofline: the machine's measured GEMM rate and memory bandwidth, a workload's useful FLOPs
and the bytes it must move, its ideal time max(FLOPs / GEMM rate, bytes / bandwidth) and the
fraction of it a run reaches."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxllm.worker.matmul_timing import best_seconds

if TYPE_CHECKING:
    from jaxllm import LLM


def measure_gemm(n: int = 2048, reps: int = 3, dtype: str = "float32") -> dict[str, float]:
    """Best-of-`reps` rate of an n x n x n GEMM: XLA (jitted jnp.dot on the default device, in
    `dtype`) and numpy (float32, host)."""
    import jax
    import jax.numpy as jnp

    flops = 2.0 * n ** 3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    dot = jax.jit(jnp.dot)
    xa, xb = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    best_xla = best_seconds(lambda: dot(xa, xb).block_until_ready(), reps)
    best_np = best_seconds(lambda: a @ b, reps)
    xla, numpy_rate = flops / best_xla, flops / best_np
    return {"gemm_size": n, "xla_flops_per_s": xla, "numpy_flops_per_s": numpy_rate,
            "gemm_flops_per_s": max(xla, numpy_rate)}


def measure_bandwidth(mib: int = 256, reps: int = 5) -> dict[str, float]:
    """Best-of-`reps` streaming bandwidth over `mib` MiB: numpy's copyto into a second array
    (host) and a jitted XLA scale of an array donated to it, so it runs in place (default
    device; a fresh output buffer each call would time page faults), both counting read + write
    bytes; and an XLA GEMV reading a `mib` MiB matrix (read bytes only). The bandwidth used for
    bounds is the best of the three."""
    import jax
    import jax.numpy as jnp

    from jaxllm.model_executor.models.qwen2 import linear

    n = max(1, mib * (1 << 20) // 4)
    moved = 2.0 * n * 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    best_np = best_seconds(lambda d=dst, s=src: np.copyto(d, s), reps)
    del dst
    scale = jax.jit(lambda x: x * 0.5, donate_argnums=0)
    held = {"x": jnp.asarray(src)}  # each call donates the previous result
    del src

    def scale_in_place() -> None:
        held["x"] = scale(held["x"]).block_until_ready()

    best_xla = best_seconds(scale_in_place, reps)
    held.clear()
    # Decode streams weights without writing anything back: time that pattern too, as a GEMV
    # over a [rows, 1024] matrix kept [out, in] like the model's weights.
    w = jnp.ones((max(1, n // 1024), 1024), jnp.float32)
    vec = jnp.ones((1, 1024), jnp.float32)
    gemv = jax.jit(linear)
    best_gemv = best_seconds(lambda m=w: gemv(vec, m).block_until_ready(), reps)
    read_rate = w.size * 4 / best_gemv
    del w
    xla, numpy_rate = moved / best_xla, moved / best_np
    return {"copy_mib": mib, "xla_bytes_per_s": xla, "numpy_bytes_per_s": numpy_rate,
            "gemv_read_bytes_per_s": read_rate,
            "bandwidth_bytes_per_s": max(xla, numpy_rate, read_rate)}


def default_gemm_size(platform: str) -> int:
    """n of the timed GEMM: a GPU reaches its peak only on large tiles (a 2048^3 GEMM is a few
    hundred microseconds there, launch-bound); on CPU 2048 already does and 8192 takes minutes."""
    return 8192 if platform == "gpu" else 2048


def measure_machine(gemm_size: int | None = None, copy_mib: int = 256,
                    dtype: str = "float32") -> dict[str, float]:
    """GEMM rate and bandwidth of the default device and the host. Call it where the engine
    core runs (`ModelRunner.measure_machine`): on a GPU the core process holds the memory."""
    import jax

    if gemm_size is None:
        gemm_size = default_gemm_size(jax.default_backend())
    return {**measure_gemm(gemm_size, dtype=dtype), **measure_bandwidth(copy_mib)}


@dataclass
class ModelCost:
    """What one token costs a Qwen2 model, from its config and loaded weights."""

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

