"""Paper estimate of a tensor-parallel decode step on H100s (a model, not a measurement).

    t_step(N) = (W / N + KV / N) / HBM  +  A * (alpha + 2 (N - 1) / N * B / LINK)

W: weight bytes read per step (every layer's weights and the LM head; the embedding only for
the batch's rows), KV: the batch's K/V bytes read by attention (kv heads split over N, or
replicated when N exceeds them: each device then reads one head), A = 2 L + 1 all-reduces per
step (o_proj and down_proj per layer, the embedding; counted in the lowered module,
tests/distributed/test_tp_lowering.py), B = T x hidden x 2 bytes each (bf16 [T, hidden]), a ring
all-reduce moving 2 (N - 1) / N of them over NVLink at LINK per direction, plus a fixed latency
alpha per all-reduce, which dominates small decode steps. Matmuls are taken as HBM-bound (decode)
and kernel launch floors are left out (docs/perf/gpu-kernel-model.md's single-GPU table has them).

    python -m jaxllm.distributed.tp_estimate
"""

from __future__ import annotations

from pallas_kernels.checks.shapes import QWEN2_SHAPES, Qwen2Shape

HBM = 3.35e12  # B/s, H100 SXM
LINK = 450e9  # B/s per direction, NVLink 4
ALPHAS = (5e-6, 10e-6)  # s per all-reduce


def kv_bytes(m: Qwen2Shape, batch: int, context: int, tp: int) -> int:
    """bf16 K/V of the batch over all devices (a replicated KV head counted on each device)."""
    heads_per_device = max(m.num_kv_heads // tp, 1)
    return 2 * 2 * m.num_layers * heads_per_device * tp * m.head_dim * batch * context


CASES = [("qwen2.5-7b", (1, 2, 4)), ("qwen2-72b", (8,))]


def estimate(m: Qwen2Shape, tp: int, batch: int, context: int, alpha: float) -> dict[str, float]:
    memory = (m.weight_bytes_per_step(2) + kv_bytes(m, batch, context, tp)) / tp / HBM
    reduces = 2 * m.num_layers + 1 if tp > 1 else 0
    per_reduce = batch * m.hidden_size * 2
    link = reduces * 2 * (tp - 1) / tp * per_reduce / LINK
    latency = reduces * alpha
    return {"memory": memory, "link": link, "latency": latency,
            "step": memory + link + latency, "reduces": reduces,
            "bytes_per_layer": 2 * per_reduce if tp > 1 else 0,
            "bytes_per_step": reduces * per_reduce}


def main() -> None:
    print("| model | TP | batch | context | weights+KV per GPU / HBM us | all-reduces | "
          "bytes all-reduced per layer / step | NVLink us | latency us (5 / 10 us each) | "
          "step us (alpha 5 / 10) | tok/s (alpha 5 / 10) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, sizes in CASES:
        m = QWEN2_SHAPES[name]
        for tp in sizes:
            for batch in (1, 64):
                lo, hi = (estimate(m, tp, batch, 1024, a) for a in ALPHAS)
                print(f"| {name} | {tp} | {batch} | 1024 | {lo['memory'] * 1e6:,.0f} | "
                      f"{lo['reduces']} | {lo['bytes_per_layer']:,} / {lo['bytes_per_step']:,} | "
                      f"{lo['link'] * 1e6:,.0f} | {lo['latency'] * 1e6:,.0f} / "
                      f"{hi['latency'] * 1e6:,.0f} | {lo['step'] * 1e6:,.0f} / "
                      f"{hi['step'] * 1e6:,.0f} | {batch / lo['step']:,.0f} / "
                      f"{batch / hi['step']:,.0f} |")


if __name__ == "__main__":
    main()
