"""An analytic H100 performance model of the Pallas kernels and of a Qwen2 decode step.

A model, not a measurement: nothing here runs on a GPU. For each kernel it counts the bytes a
kernel must move through HBM (each input read once, each output written once; re-reads that
the L2 cache serves are not counted) and its useful FLOPs, and bounds the time from below by
the roofline max(bytes / HBM bandwidth, FLOPs / peak). It then divides by a parallelism
efficiency:

* **SM share.** A kernel whose programs are all equal and memory-bound is modelled as each SM
  drawing 1/132 of the HBM bandwidth while it has work. With P programs spread evenly over the
  132 SMs the busiest SM runs ceil(P / 132) of them, so the efficiency is
  P / (132 * ceil(P / 132)): P / 132 for an under-filled grid (2 programs -> 1.5 %), 1 for a
  multiple of 132, 256 / 264 = 97 % for 256. This is pessimistic for a tiny grid (one SM with
  enough loads in flight can pull more than its 1/132 share) and optimistic for a grid whose
  programs are serial chains of dependent loads (flash attention at q_len 1 is nearly that:
  FlashAttention-2 at batch 1, 64k context on an A100 took 2300 us, flash-decoding 64 us).
* **Occupancy** (resident blocks per SM, from check_compile) does not enter the estimate: it
  says how many of those programs an SM holds at once (waves = ceil(P / (132 * blocks))) and
  whether an SM has warps enough to hide memory latency; fewer than 16 resident warps (25 %)
  is flagged.
* **A floor per kernel**: no kernel takes less than FLOOR_US = 2 us (launch gap, ramp-up and
  drain of a kernel on an H100, the order seen for tiny kernels in a stream or CUDA graph).

Peaks (H100 SXM): HBM3 3.35 TB/s; 989 TFLOP/s dense bfloat16 on the tensor cores (used for the
bfloat16 dots of paged attention and the weight matmuls); 67 TFLOP/s FP32 on the CUDA cores,
used for float32 attention (its dots are IEEE float32 on the FMA units, not TF32, see
attention_common.launch_config) and for every element-wise kernel (rms_norm, rope compute in
float32 whatever the storage type).

Decode step (Qwen2, bfloat16): per layer rms_norm (+residual) x 2, the q/k/v, o, gate/up and
down matmuls (cuBLAS-like GEMMs assumed to fill the machine: efficiency 1), rope, write_kv,
SiLU-and-mul and paged attention; then the final norm and the LM head. Weights are read once per
step. Attention reads the K/V of each sequence's context once per (sequence, KV head).

* before split-K: the kernel as it is, one program per (sequence, KV head): B x KVH programs.
* after split-K (flash-decoding): each (sequence, KV head) is cut into `split_count`
  partitions of the context, whose partial outputs (head_dim floats + max + sum per query head,
  float32) are written and then combined by a second kernel (its own floor). The rule is the
  kernel's (`attention_common.decode_num_splits`, as the runner applies it per decode bucket): the
  smallest power of two giving >= 132 programs, at most 16, no partition under 256 keys of the
  context; and no split at all when the model says it would not be faster, so the split
  estimate never exceeds the unsplit one.

Run: python -m pallas_kernels.checks.perf_model (the decode-step table; check_compile
--model-time adds the per-kernel table with the compiled grids and occupancy).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pallas_kernels.attention_common import decode_num_splits
from pallas_kernels.checks.lowering_cases import (
    DEQUANT_LAYERS,
    LARGE_KV_SUFFIX,
    VERIFY_QUERY_LEN,
    VERIFY_SEQS,
    matmul_shape,
)
from pallas_kernels.checks.shapes import QWEN2_SHAPES, Qwen2Shape

HBM_BYTES_PER_S = 3.35e12
BF16_TENSOR_FLOPS = 989e12
FP32_FLOPS = 67e12
NUM_SMS = 132
FLOOR_US = 2.0
LOW_WARPS = 16  # resident warps per SM below which latency hiding is doubtful


def itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


@dataclass(frozen=True)
class Cost:
    """What one kernel launch moves and computes; `programs` doing real work (None: fills)."""

    bytes: float
    flops: float
    peak: float  # FLOP/s that bound the compute side
    programs: int | None = None

    @property
    def bound_s(self) -> float:
        return max(self.bytes / HBM_BYTES_PER_S, self.flops / self.peak)

    @property
    def efficiency(self) -> float:
        return 1.0 if self.programs is None else sm_share(self.programs)

    def time_s(self, floor_us: float = FLOOR_US) -> float:
        return max(self.bound_s / self.efficiency, floor_us * 1e-6)


def sm_share(programs: int, sms: int = NUM_SMS) -> float:
    """Fraction of the HBM bandwidth P equal memory-bound programs draw: P / (SMs ceil(P/SMs))."""
    if programs <= 0:
        raise ValueError("programs must be >= 1")
    return programs / (sms * math.ceil(programs / sms))


def waves(programs: int, blocks_per_sm: int, sms: int = NUM_SMS) -> int:
    return math.ceil(programs / (sms * max(1, blocks_per_sm)))


# --------------------------------------------------------------------------- per kernel


def rms_norm_cost(tokens: int, hidden: int, dtype: str, residual: bool = False) -> Cost:
    """Reads x (and the residual) and the weight, writes y (and the new residual).
    FLOPs per element: square + sum, scale, times weight (+ the residual add)."""
    n = tokens * hidden
    tensors = 4 if residual else 2
    return Cost(bytes=(tensors * n + hidden) * itemsize(dtype),
                flops=(4 if residual else 3) * n, peak=FP32_FLOPS)


def rope_cost(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: str) -> Cost:
    """Reads and writes q and k, reads the positions (int32) and one cos/sin row of head_dim per
    token. FLOPs: 2 multiplies and an add per element of q and k."""
    n = tokens * (num_heads + num_kv_heads) * head_dim
    size = itemsize(dtype)
    return Cost(bytes=2 * n * size + tokens * (4 + head_dim * size), flops=3 * n,
                peak=FP32_FLOPS)


def write_kv_cost(tokens: int, num_kv_heads: int, head_dim: int, dtype: str) -> Cost:
    """Reads k, v and the slot mapping, writes them into the (aliased) cache: no FLOPs."""
    n = tokens * num_kv_heads * head_dim
    return Cost(bytes=4 * n * itemsize(dtype) + 4 * tokens, flops=0, peak=FP32_FLOPS)


def rope_write_kv_cost(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       dtype: str) -> Cost:
    """Reads q, k, v and the bias, positions, slots and a cos/sin row per token; writes the
    rotated q and, into the cache, k and v. FLOPs: the bias add on every element, the rotation's
    2 multiplies and an add on q and k."""
    qk = tokens * (num_heads + num_kv_heads) * head_dim
    v = tokens * num_kv_heads * head_dim
    width = (num_heads + 2 * num_kv_heads) * head_dim
    size = itemsize(dtype)
    return Cost(bytes=(2 * qk + 2 * v + width) * size + tokens * (8 + head_dim * 4),
                flops=4 * qk + v, peak=FP32_FLOPS)


def attention_peak(dtype: str) -> float:
    return BF16_TENSOR_FLOPS if dtype == "bfloat16" else FP32_FLOPS


def decode_attention_cost(seqs: int, context: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, dtype: str, block_size: int = 16,
                          splits: int = 1) -> Cost:
    """One query token per sequence attending to `context` keys. Reads q, the K and V of the
    context once per (sequence, KV head) and the block table; writes o. FLOPs: QK^T and PV,
    2 x 2 x heads x context x head_dim per sequence (useful ones; the kernel pads the group of
    query heads to a power of two). With splits > 1 the partial outputs (head_dim + 2 float32
    per query head and partition) are written here and read by `combine_cost`."""
    size = itemsize(dtype)
    kv = 2 * seqs * context * num_kv_heads * head_dim * size
    qo = 2 * seqs * num_heads * head_dim * size
    table = seqs * math.ceil(context / block_size) * 4
    partial = seqs * num_heads * splits * (head_dim + 2) * 4 if splits > 1 else 0
    out = partial if splits > 1 else qo // 2
    return Cost(bytes=kv + qo // 2 + out + table,
                flops=4 * seqs * num_heads * context * head_dim,
                peak=attention_peak(dtype), programs=seqs * num_kv_heads * splits)


def combine_cost(seqs: int, num_heads: int, head_dim: int, dtype: str, splits: int) -> Cost:
    """The split-K reduction: reads the partials, writes o; modelled with one program per
    (sequence, head). paged_attention's combine kernel runs one per sequence (all its heads):
    the per-program bandwidth share of this model would price that far too high at batch 1 (it
    moves ~0.2 MB), so the wider grid is the assumption until a GPU measures the kernel."""
    partial = seqs * num_heads * splits * (head_dim + 2) * 4
    return Cost(bytes=partial + seqs * num_heads * head_dim * itemsize(dtype),
                flops=3 * seqs * num_heads * splits * head_dim, peak=FP32_FLOPS,
                programs=seqs * num_heads)


def prefill_attention_cost(seqs: int, q_len: int, num_heads: int, num_kv_heads: int,
                           head_dim: int, dtype: str, block_size: int = 16,
                           programs: int | None = None, context: int = 0) -> Cost:
    """Causal attention of `seqs` sequences of `q_len` new tokens each on top of `context`
    cached keys (0: a fresh prefill; a prefix hit, a later chunk or a speculative-decoding
    verify step otherwise): q and o once, K/V of the sequence (context and new tokens) once per
    (sequence, KV head) (tiles re-read by later query tiles come from L2). FLOPs: query i sees
    context + i + 1 keys, so 4 x heads x head_dim x (q_len x context + q_len(q_len+1)/2)."""
    size = itemsize(dtype)
    tokens = seqs * q_len
    kv = 2 * seqs * (context + q_len) * num_kv_heads * head_dim * size
    qo = 2 * tokens * num_heads * head_dim * size
    table = seqs * math.ceil((context + q_len) / block_size) * 4
    pairs = seqs * (q_len * context + q_len * (q_len + 1) // 2)
    return Cost(bytes=kv + qo + table, flops=4 * num_heads * head_dim * pairs,
                peak=attention_peak(dtype), programs=programs)


def matmul_cost(rows: int, k: int, n: int, dtype: str, bias: bool = False) -> Cost:
    """x[rows, k] @ W[k, n] (+ b): reads W, x (and b) once, writes y. Fills the machine."""
    size = itemsize(dtype)
    return Cost(bytes=(k * n + rows * k + rows * n + (n if bias else 0)) * size,
                flops=2 * rows * k * n, peak=BF16_TENSOR_FLOPS if size == 2 else FP32_FLOPS)


def dequant_matmul_cost(rows: int, n: int, k: int, group: int, offsets: bool,
                        dtype: str) -> Cost:
    """Reads x, the int8 weight and its per-block float32 scales (and offsets), writes y.
    Tensor-core peak for bfloat16 GEMMs; the GEMV (< 16 rows) and float32 run on the FMA units."""
    blocks = n * k // group * 4 * (2 if offsets else 1)
    size = itemsize(dtype)
    peak = BF16_TENSOR_FLOPS if dtype == "bfloat16" and rows >= 16 else FP32_FLOPS
    return Cost(bytes=n * k + blocks + rows * (k + n) * size, flops=2 * rows * n * k, peak=peak)


def silu_mul_cost(tokens: int, intermediate: int, dtype: str) -> Cost:
    """SiLU(gate) * up: reads 2 x intermediate, writes intermediate per token."""
    return Cost(bytes=3 * tokens * intermediate * itemsize(dtype), flops=6 * tokens * intermediate,
                peak=FP32_FLOPS)


# --------------------------------------------------------------------------- split-K


def split_count(seqs: int, num_kv_heads: int, context: int, sms: int = NUM_SMS) -> int:
    """Partitions per (sequence, KV head): the kernel's own rule
    (`attention_common.decode_num_splits`, which the runner applies per decode bucket), with the
    context in the place of max_model_len."""
    return decode_num_splits(context, seqs, num_kv_heads, num_sms=sms)


def decode_attention_time(seqs: int, context: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, dtype: str, split: bool,
                          floor_us: float = FLOOR_US) -> tuple[float, int]:
    """Modelled seconds of one layer's decode attention and the partitions used (1 = no split).
    With `split`, the rule's partition count is used only if it beats no split (kernel plus
    the combine kernel against the single kernel), so it never costs more."""
    plain = decode_attention_cost(seqs, context, num_heads, num_kv_heads, head_dim,
                                  dtype).time_s(floor_us)
    if not split:
        return plain, 1
    splits = split_count(seqs, num_kv_heads, context)
    if splits == 1:
        return plain, 1
    t = (decode_attention_cost(seqs, context, num_heads, num_kv_heads, head_dim, dtype,
                               splits=splits).time_s(floor_us)
         + combine_cost(seqs, num_heads, head_dim, dtype, splits).time_s(floor_us))
    return (t, splits) if t < plain else (plain, 1)


# --------------------------------------------------------------------------- check_compile's cases

# The shapes of check_lowering's cases (see lowering_cases.py): decode is 64 sequences
# of one token, decode1 one, whose context is taken at the cases' maximum (4096 keys, 256
# blocks of 16); prefill is 2048 tokens, 4 sequences of 512 with no cached context. The decode
# phase's verify case (paged_attention_verify) is VERIFY_SEQS sequences of VERIFY_QUERY_LEN
# tokens, at the same maximum context (the new tokens included).
CASE_TOKENS = {"decode": 64, "decode1": 1, "prefill": 2048}
CASE_SEQS = {"decode": 64, "decode1": 1, "prefill": 4}
CASE_DECODE_CONTEXT = 4096
# paged_attention's split-K decode cases: a few sequences (the shape split-K is for), as many
# splits as attention_common.decode_num_splits gives them at that context.
SPLIT_K_CASE_SEQS = {"decode": 8, "decode1": 1}


@dataclass(frozen=True)
class CaseModel:
    cost: Cost
    launched: int  # programs in the grid
    note: str

    @property
    def time_s(self) -> float:
        return self.cost.time_s()


def case_cost(kernel: str, model, dtype: str, phase: str, grid: Sequence[int]) -> Cost:
    """Bytes, FLOPs and working programs of one check_lowering case (`model` a Qwen2Shape).
    Paged attention's prefill grid covers every sequence with max_query_len query rows; the
    programs past a sequence's 512 tokens exit at once and are not counted as working."""
    tokens = CASE_TOKENS[phase]
    launched = math.prod(grid)
    # The large-KV cases cost what the usual ones do: only their addressing differs.
    base = kernel.split("/")[0].removesuffix(LARGE_KV_SUFFIX)
    if base in ("rms_norm", "rms_norm+residual"):
        cost = rms_norm_cost(tokens, model.hidden_size, dtype, residual=base.endswith("residual"))
    elif base == "rope":
        cost = rope_cost(tokens, model.num_heads, model.num_kv_heads, model.head_dim, dtype)
    elif base == "write_kv":
        cost = write_kv_cost(tokens, model.num_kv_heads, model.head_dim, dtype)
    elif base == "rope_write_kv":
        cost = rope_write_kv_cost(tokens, model.num_heads, model.num_kv_heads, model.head_dim,
                                  dtype)
    elif base.startswith("skinny_"):
        layer, rows = base.removeprefix("skinny_").rsplit("_m", 1)
        n, k = ((model.vocab_size, model.hidden_size) if layer == "lm_head"
                else matmul_shape(model, layer))
        cost = matmul_cost(int(rows), k, n, dtype)
    elif base.startswith("dequant_"):
        layer, rows = base.split("_", 2)[2].rsplit("_m", 1)
        group, offsets = {name: (g, o) for name, g, o in DEQUANT_LAYERS}[layer]
        cost = dequant_matmul_cost(int(rows), *matmul_shape(model, layer), group, offsets, dtype)
    elif base.startswith("paged_attention_splitk_bs"):
        seqs = SPLIT_K_CASE_SEQS[phase]
        splits = decode_num_splits(CASE_DECODE_CONTEXT, seqs, model.num_kv_heads)
        if kernel.endswith("/paged_attention_combine"):
            return combine_cost(seqs, model.num_heads, model.head_dim, dtype, splits)
        block_size = int(base.removeprefix("paged_attention_splitk_bs"))
        return decode_attention_cost(seqs, CASE_DECODE_CONTEXT, model.num_heads,
                                     model.num_kv_heads, model.head_dim, dtype, block_size,
                                     splits=splits)
    elif base.startswith("paged_attention_verify_bs"):
        # A few query rows per sequence over a long context: the context's K/V bytes as in
        # decode, FLOPs of q_len rows each seeing the context. Every sequence has
        # max_query_len tokens, so every program of the grid works.
        block_size = int(base.removeprefix("paged_attention_verify_bs"))
        return prefill_attention_cost(VERIFY_SEQS, VERIFY_QUERY_LEN, model.num_heads,
                                      model.num_kv_heads, model.head_dim, dtype, block_size,
                                      programs=launched,
                                      context=CASE_DECODE_CONTEXT - VERIFY_QUERY_LEN)
    elif base.startswith("paged_attention_bs"):
        block_size = int(base.removeprefix("paged_attention_bs"))
        seqs = CASE_SEQS[phase]
        if phase in ("decode", "decode1"):
            return decode_attention_cost(seqs, CASE_DECODE_CONTEXT, model.num_heads,
                                         model.num_kv_heads, model.head_dim, dtype, block_size)
        q_len = tokens // seqs
        block_q = max(1, tokens // grid[1])  # grid (S, cdiv(max_query_len, BQ), KVH)
        working = seqs * math.ceil(q_len / block_q) * model.num_kv_heads
        return prefill_attention_cost(seqs, q_len, model.num_heads, model.num_kv_heads,
                                      model.head_dim, dtype, block_size, programs=working)
    else:
        raise ValueError(f"no cost model for kernel {kernel!r}")
    return Cost(cost.bytes, cost.flops, cost.peak, programs=launched)


def case_model(kernel: str, model, dtype: str, phase: str, grid: Sequence[int],
               num_warps: int, blocks_per_sm: int) -> CaseModel:
    """The case's cost and a note on what its grid and occupancy suggest."""
    cost = case_cost(kernel, model, dtype, phase, grid)
    launched = math.prod(grid)
    programs = cost.programs or launched
    notes = []
    if cost.flops / cost.peak > cost.bytes / HBM_BYTES_PER_S:
        notes.append("compute-bound")
    if programs < NUM_SMS:
        notes.append(f"under-filled: {programs} programs on {NUM_SMS} SMs")
    elif cost.efficiency < 0.95:
        notes.append(f"tail: up to {math.ceil(programs / NUM_SMS)} programs per SM")
    if programs < launched:
        notes.append(f"{launched - programs} programs exit at once")
    if blocks_per_sm:
        resident = min(blocks_per_sm, math.ceil(programs / NUM_SMS)) * num_warps
        if resident < LOW_WARPS:
            notes.append(f"{resident} warps/SM resident: latency-bound?")
        notes.append(f"{waves(programs, blocks_per_sm)} wave(s) at {blocks_per_sm} blocks/SM")
    if cost.time_s() <= FLOOR_US * 1e-6:
        notes.append("at the per-kernel floor")
    return CaseModel(cost, launched, "; ".join(notes))


def format_case_models(rows: Sequence[tuple[str, str, str, str, CaseModel]]) -> str:
    """rows: (kernel, model, dtype, phase, CaseModel); a plain-text table."""
    header = ("kernel", "model", "dtype", "phase", "programs", "MB", "MFLOP", "bound us",
              "SM share", "model us", "note")
    out: list[tuple[str, ...]] = [header]
    for kernel, model, dtype, phase, m in rows:
        c = m.cost
        programs = c.programs or m.launched
        out.append((kernel, model, dtype, phase, f"{programs}/{m.launched}",
                    f"{c.bytes / 1e6:.3f}", f"{c.flops / 1e6:,.1f}", f"{c.bound_s * 1e6:.2f}",
                    f"{c.efficiency:.0%}", f"{m.time_s * 1e6:.2f}", m.note))
    widths = [max(len(r[i]) for r in out) for i in range(len(header))]
    widths[-1] = 0
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in out)


# --------------------------------------------------------------------------- a decode step


@dataclass(frozen=True)
class StepEstimate:
    model: str
    batch: int
    context: int
    weight_bytes: int
    kv_bytes: int
    matmul_s: float
    attention_s: float  # all layers, before split-K
    attention_split_s: float  # all layers, after split-K
    splits: int
    other_s: float  # norms, rope, write_kv, SiLU, embedding, sampling not included
    kernels: int  # launches per step before split-K

    @property
    def step_s(self) -> float:
        return self.matmul_s + self.attention_s + self.other_s

    @property
    def step_split_s(self) -> float:
        return self.matmul_s + self.attention_split_s + self.other_s

    @property
    def bound_s(self) -> float:
        """Weights + K/V at full bandwidth: what no kernel split can beat."""
        return (self.weight_bytes + self.kv_bytes) / HBM_BYTES_PER_S


def decode_step(cfg: Qwen2Shape, batch: int, context: int, dtype: str = "bfloat16",
                floor_us: float = FLOOR_US) -> StepEstimate:
    """One decode step of `batch` sequences, each attending to `context` keys."""
    t = lambda cost: cost.time_s(floor_us)  # noqa: E731
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_mm = (t(matmul_cost(batch, cfg.hidden_size, q + 2 * kv, dtype, bias=True))
                + t(matmul_cost(batch, q, cfg.hidden_size, dtype))
                + t(matmul_cost(batch, cfg.hidden_size, 2 * cfg.intermediate_size, dtype))
                + t(matmul_cost(batch, cfg.intermediate_size, cfg.hidden_size, dtype)))
    layer_other = (2 * t(rms_norm_cost(batch, cfg.hidden_size, dtype, residual=True))
                   + t(rope_cost(batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype))
                   + t(write_kv_cost(batch, cfg.num_kv_heads, cfg.head_dim, dtype))
                   + t(silu_mul_cost(batch, cfg.intermediate_size, dtype)))
    args = (batch, context, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype)
    attn, _ = decode_attention_time(*args, split=False, floor_us=floor_us)
    attn_split, splits = decode_attention_time(*args, split=True, floor_us=floor_us)
    lm_head = t(matmul_cost(batch, cfg.hidden_size, cfg.vocab_size, dtype))
    # embedding gather: a row per token read and written
    embed = t(Cost(2 * batch * cfg.hidden_size * itemsize(dtype), 0, FP32_FLOPS))
    final_norm = t(rms_norm_cost(batch, cfg.hidden_size, dtype, residual=True))
    kv_bytes = cfg.num_layers * 2 * batch * context * kv * itemsize(dtype)
    return StepEstimate(
        cfg.name, batch, context, cfg.weight_bytes_per_step(itemsize(dtype)), kv_bytes,
        matmul_s=cfg.num_layers * layer_mm + lm_head,
        attention_s=cfg.num_layers * attn, attention_split_s=cfg.num_layers * attn_split,
        splits=splits, other_s=cfg.num_layers * layer_other + embed + final_norm,
        kernels=cfg.num_layers * 10 + 3)


# The first run on an H100 (BENCHMARKS.md, GPU section) measured what the roofline above leaves
# out: XLA's weight GEMMs at 1-128 rows read at ~625 GB/s (1.58 ms a 0.5B decode step for 0.99
# GB of weights), not at HBM speed (measured at 0.5B's shapes only); the host's call of the
# compiled step took 1.69-1.82 ms, its kernels launched one at a time from the host (XLA's
# thunks, no effective CUDA graph).
MEASURED_MATMUL_BYTES_PER_S = 625e9
# Host cost per kernel launch and per executable argument (jit's C++ path, ~0.5 us each:
# benchmarks/dispatch.py); device time of a tiny kernel with its launch gap.
LAUNCH_US = 4.5
ARG_US = 0.5
TINY_KERNEL_US = 3.0
# Kernels a decode step launches besides the weight GEMMs (benchmarks/step_ops.py counts the
# lowered step): per layer the Pallas RMSNorm x 2, the QKV epilogue (bias, RoPE, KV write),
# split-K attention and its combine, plus the element-wise ops XLA fuses into about three
# kernels (SiLU-and-mul, casts); outside the layers the embedding gather, final norm, top-K and
# a few casts. The first GPU run had RoPE and the KV write apart and the bias add in a fusion
# of its own: 6 and 4 (MEASURED_RUN_KERNELS).
PALLAS_PER_LAYER = 5
FUSIONS_PER_LAYER = 3
MEASURED_RUN_KERNELS = (6, 4)
MEASURED_RUN_ARGUMENTS = 180  # the weight tree and RoPE table, KV, logits buffer, 7 inputs
KERNELS_OUTSIDE = 8
ARRAYS_PER_LAYER = 7  # weight arrays: QKV weight and bias, O, gate-up, down, two norms


@dataclass(frozen=True)
class LaunchBoundStep:
    """A decode step as the first GPU run behaved: the device runs the step's kernels (GEMMs at
    the measured rate, each other kernel at least TINY_KERNEL_US) while the host launches them
    one by one; the step takes the longer of the two."""

    model: str
    batch: int
    kernels: int
    arguments: int
    device_s: float
    host_s: float

    @property
    def step_s(self) -> float:
        return max(self.device_s, self.host_s)


def launch_bound_step(cfg: Qwen2Shape, batch: int, context: int, dtype: str = "bfloat16",
                      launch_us: float = LAUNCH_US, arg_us: float = ARG_US,
                      arguments: int | None = None, pallas_per_layer: int = PALLAS_PER_LAYER,
                      fusions_per_layer: int = FUSIONS_PER_LAYER) -> LaunchBoundStep:
    """`decode_step`'s step with the launch and dispatch terms: `arguments` arrays passed to
    the executable (None: the weight tree's, as `Compiled.__call__` takes them), and the
    non-GEMM kernels a layer launches."""
    est = decode_step(cfg, batch, context, dtype, floor_us=TINY_KERNEL_US)
    gemms = 4 * cfg.num_layers + 1
    others = (pallas_per_layer + fusions_per_layer) * cfg.num_layers + KERNELS_OUTSIDE
    matmul_s = max(est.weight_bytes / MEASURED_MATMUL_BYTES_PER_S, est.matmul_s)
    # Each non-GEMM kernel at its roofline time or the tiny-kernel floor; attention as modelled.
    device_s = (matmul_s + est.attention_split_s
                + max(est.other_s, (others - 2 * cfg.num_layers) * TINY_KERNEL_US * 1e-6))
    if arguments is None:
        arguments = ARRAYS_PER_LAYER * cfg.num_layers + (2 if cfg.tied_embeddings else 3) + 4
    kernels = gemms + others
    host_s = (kernels * launch_us + arguments * arg_us) * 1e-6
    return LaunchBoundStep(cfg.name, batch, kernels, arguments, device_s, host_s)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def format_steps(estimates: Sequence[StepEstimate]) -> str:
    """A markdown table of decode-step estimates (microseconds)."""
    lines = [
        "| model | batch | context | weights MB | K/V MB | bound us | matmuls us | other us | "
        "attention us unsplit / split-K (partitions) | step us unsplit | step us split-K | "
        "tok/s unsplit | tok/s split-K |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in estimates:
        lines.append(
            f"| {e.model} | {e.batch} | {e.context} | {e.weight_bytes / 1e6:,.0f} | "
            f"{e.kv_bytes / 1e6:,.0f} | {_us(e.bound_s)} | {_us(e.matmul_s)} | "
            f"{_us(e.other_s)} | {_us(e.attention_s)} / {_us(e.attention_split_s)} "
            f"({e.splits}) | {_us(e.step_s)} | {_us(e.step_split_s)} | "
            f"{e.batch / e.step_s:,.0f} | {e.batch / e.step_split_s:,.0f} |")
    return "\n".join(lines)


def default_steps(floor_us: float = FLOOR_US) -> list[StepEstimate]:
    return [decode_step(QWEN2_SHAPES[m], b, c, floor_us=floor_us)
            for m in ("qwen2.5-0.5b", "qwen2.5-7b") for b in (1, 64) for c in (1024, 8192)]


def main(argv: Sequence[str] | None = None) -> int:
    # python -OO strips docstrings.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--floor-us", type=float, default=FLOOR_US,
                        help="minimum time of any kernel (default %(default)s us)")
    ns = parser.parse_args(argv)
    print("Decode step, bfloat16, H100 SXM: MODEL, NOT MEASUREMENT "
          f"(HBM {HBM_BYTES_PER_S / 1e12:.2f} TB/s, {BF16_TENSOR_FLOPS / 1e12:.0f} TFLOP/s bf16, "
          f"{NUM_SMS} SMs, {ns.floor_us:g} us per kernel at least)")
    print(format_steps(default_steps(ns.floor_us)))
    print("\nLaunch-bound, calibrated to the first H100 run (GEMMs at "
          f"{MEASURED_MATMUL_BYTES_PER_S / 1e9:.0f} GB/s, {LAUNCH_US:g} us a kernel launched "
          f"from the host, {ARG_US:g} us an argument):")
    print("| model | batch | kernels | arguments | device us | host us | step us |")
    print("|---|---|---|---|---|---|---|")
    # The GEMM rate was measured at 0.5B's shapes only; larger models need their own.
    for b in (1, 64):
        for label, pallas, fusions, args in (
                ("first run", *MEASURED_RUN_KERNELS, MEASURED_RUN_ARGUMENTS),
                ("now", PALLAS_PER_LAYER, FUSIONS_PER_LAYER, None)):
            e = launch_bound_step(QWEN2_SHAPES["qwen2.5-0.5b"], b, 256, arguments=args,
                                  pallas_per_layer=pallas, fusions_per_layer=fusions)
            print(f"| {e.model} ({label}) | {b} | {e.kernels} | {e.arguments} | "
                  f"{_us(e.device_s)} | {_us(e.host_s)} | {_us(e.step_s)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
