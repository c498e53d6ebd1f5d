"""The matmul floor: every step shape a run used, timed again through nothing but the model's own
weight matmuls on XLA, times the steps of that shape. It is what the run would take if attention,
norms, RoPE, KV writes, sampling and host work were free, so it splits the gap to the roofline
into "XLA's matmul rate" and "everything else"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxllm.benchmarks.roofline import fmt_s

if TYPE_CHECKING:
    from jaxllm import LLM


def step_shape_counts(llm: LLM) -> dict[tuple[int, int], int]:
    """Steps run per (num_tokens, max_query_len) since the model runner's last
    `reset_step_shape_counts`."""
    rows = llm.collective_rpc("get_step_shape_counts")
    return {(num_tokens, max_query_len): steps for num_tokens, max_query_len, steps in rows}


def matmul_floor(llm: LLM, step_shape_counts: dict[tuple[int, int], int],
                 reps: int = 3) -> dict[str, Any]:
    """Seconds the steps in `step_shape_counts` ((num_tokens, max_query_len) -> steps, as
    the engine counts them) take through `weight_matmuls` alone: best of `reps` per shape."""
    token_counts = sorted({num_tokens for num_tokens, _ in step_shape_counts})
    step_s = llm.collective_rpc("time_weight_matmuls", (token_counts, reps))
    shapes = []
    total = 0.0
    for (num_tokens, max_query_len), steps in sorted(step_shape_counts.items()):
        shapes.append({"num_tokens": num_tokens, "max_query_len": max_query_len,
                       "steps": steps, "matmul_s_per_step": step_s[num_tokens]})
        total += steps * step_s[num_tokens]
    return {"matmul_floor_s": total, "steps": sum(step_shape_counts.values()),
            "shapes": shapes}


def print_matmul_floor(floor: dict[str, Any], elapsed: float, what: str) -> None:
    shapes = ", ".join(f"{s['steps']} x {s['num_tokens']}"
                       + ("" if s["max_query_len"] == 1 else " mixed")
                       + f" at {fmt_s(s['matmul_s_per_step'])}" for s in floor["shapes"])
    rest = elapsed - floor["matmul_floor_s"]
    tail = (f"attention, norms, RoPE, KV writes, sampling and host took the other {fmt_s(rest)}"
            if rest > 0 else "above the run itself: the machine was slower while the floor was "
            "timed (after the run) than during it; it drifts, rerun to split the time")
    print(f"Matmul floor: {what}, {floor['steps']} steps ({shapes}), through nothing but the "
          f"weight matmuls on XLA: {fmt_s(floor['matmul_floor_s'])} = "
          f"{floor['matmul_floor_s'] / max(elapsed, 1e-12) * 100:.1f}% of {fmt_s(elapsed)}; "
          + tail)


def decode_vs_bound(floor: dict[str, Any], roof: dict[str, Any], tpot: float | None,
                    hf_tpot: float | None) -> dict[str, Any]:
    """A decode step against the memory bound (all weights read once at the measured
    bandwidth): the measured TPOT, and the decode shape's matmul floor, i.e. the best any XLA
    step of weight matmuls could do at this moment."""
    bound_s = roof["weight_bytes_per_step"] / roof["bandwidth_bytes_per_s"]
    decode = [s for s in floor["shapes"] if s["max_query_len"] == 1]
    out: dict[str, Any] = {"bound_s_per_token": bound_s}
    if decode:
        step = max(decode, key=lambda s: s["steps"])
        out["matmul_floor_s_per_step"] = step["matmul_s_per_step"]
        out["matmul_floor_fraction"] = bound_s / step["matmul_s_per_step"]
    for name, value in (("jaxllm", tpot), ("hf", hf_tpot)):
        if value:
            out[f"{name}_tpot_s"] = value
            out[f"{name}_fraction"] = bound_s / value
    return out


def print_decode_vs_bound(d: dict[str, Any]) -> None:
    parts = [f"{name} TPOT {d[f'{name}_tpot_s'] * 1e3:.1f} ms = {d[f'{name}_fraction'] * 100:.1f}%"
             for name in ("jaxllm", "hf") if f"{name}_tpot_s" in d]
    if "matmul_floor_s_per_step" in d:
        parts.append(f"the decode step's weight matmuls alone "
                     f"{d['matmul_floor_s_per_step'] * 1e3:.1f} ms = "
                     f"{d['matmul_floor_fraction'] * 100:.1f}%")
    print(f"Decode vs the memory bound ({d['bound_s_per_token'] * 1e3:.1f} ms per step: weights / "
          f"bandwidth): " + "; ".join(parts))

