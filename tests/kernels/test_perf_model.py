"""perf_model's byte/FLOP formulas on hand-computed cases, its parallelism and split-K rules, and
check_compile --model-time on stand-in results (nothing here compiles a kernel)."""

from __future__ import annotations

import itertools
import json

import jax.numpy as jnp
import pytest

from pallas_kernels.checks import check_compile as cc
from pallas_kernels.checks import perf_model as pm
from pallas_kernels.checks.check_lowering import MODEL_SHAPES, iter_cases
from pallas_kernels.checks.shapes import QWEN2_SHAPES


def test_elementwise_kernel_bytes_and_flops() -> None:
    # 2 tokens x hidden 4, float32: x read + y written (16 elements) + the weight (4).
    c = pm.rms_norm_cost(2, 4, "float32")
    assert (c.bytes, c.flops) == ((16 + 4) * 4, 3 * 8)
    c = pm.rms_norm_cost(2, 4, "float32", residual=True)  # + residual read and written
    assert (c.bytes, c.flops) == ((32 + 4) * 4, 4 * 8)
    # rope: q (2 heads) and k (1 head) of 2 tokens x head_dim 4 = 24 elements, bf16, read and
    # written; per token an int32 position and a cos/sin row of 4.
    c = pm.rope_cost(2, 2, 1, 4, "bfloat16")
    assert (c.bytes, c.flops) == (2 * 24 * 2 + 2 * (4 + 4 * 2), 3 * 24)
    # write_kv: k and v (3 tokens x 2 heads x 4) read and written, plus 3 int32 slots.
    c = pm.write_kv_cost(3, 2, 4, "float32")
    assert (c.bytes, c.flops) == (4 * 24 * 4 + 3 * 4, 0)
    c = pm.matmul_cost(2, 3, 5, "bfloat16", bias=True)
    assert (c.bytes, c.flops, c.peak) == ((15 + 6 + 10 + 5) * 2, 2 * 2 * 3 * 5,
                                          pm.BF16_TENSOR_FLOPS)


def test_attention_bytes_and_flops() -> None:
    # 2 sequences x 10 keys, 4 query heads on 2 KV heads, head_dim 8, bf16, blocks of 4.
    c = pm.decode_attention_cost(2, 10, 4, 2, 8, "bfloat16", block_size=4)
    kv = 2 * 2 * 10 * 2 * 8 * 2  # K and V, per sequence and KV head, once
    q = o = 2 * 4 * 8 * 2
    table = 2 * 3 * 4  # ceil(10 / 4) int32 entries per sequence
    assert (c.bytes, c.flops, c.programs) == (kv + q + o + table, 4 * 2 * 4 * 10 * 8, 4)
    assert c.peak == pm.BF16_TENSOR_FLOPS
    # 3 partitions: o is replaced by float32 partials of head_dim + 2 per head and partition.
    c = pm.decode_attention_cost(2, 10, 4, 2, 8, "bfloat16", block_size=4, splits=3)
    partial = 2 * 4 * 3 * (8 + 2) * 4
    assert (c.bytes, c.programs) == (kv + q + partial + table, 12)
    comb = pm.combine_cost(2, 4, 8, "bfloat16", 3)
    assert (comb.bytes, comb.programs) == (partial + o, 8)
    # Causal prefill of one sequence of 3 tokens, 2 heads on 1 KV head, head_dim 4, float32:
    # query i sees i + 1 keys -> 6 (query, key) pairs.
    c = pm.prefill_attention_cost(1, 3, 2, 1, 4, "float32", block_size=2)
    assert c.bytes == 2 * 3 * 1 * 4 * 4 + 2 * 3 * 2 * 4 * 4 + 2 * 4
    assert (c.flops, c.peak) == (4 * 2 * 4 * 6, pm.FP32_FLOPS)
    # The same 3 tokens of each of 2 sequences on top of 5 cached keys (a verify step): K/V of
    # 8 keys per sequence, 2 table entries of 4; query i sees 5 + i + 1 keys -> 6 + 7 + 8 pairs.
    c = pm.prefill_attention_cost(2, 3, 2, 1, 4, "float32", block_size=4, context=5)
    assert c.bytes == 2 * 2 * 8 * 1 * 4 * 4 + 2 * 6 * 2 * 4 * 4 + 2 * 2 * 4
    assert c.flops == 4 * 2 * 4 * 2 * (6 + 7 + 8)


def test_roofline_and_sm_share() -> None:
    c = pm.Cost(bytes=3.35e6, flops=0, peak=pm.FP32_FLOPS)
    assert c.bound_s == pytest.approx(1e-6)
    c = pm.Cost(bytes=0, flops=989e6, peak=pm.BF16_TENSOR_FLOPS, programs=2)
    assert c.bound_s == pytest.approx(1e-6)
    assert c.time_s(0) == pytest.approx(66e-6)  # 2 programs draw 2/132 of the machine
    assert c.time_s(100) == pytest.approx(100e-6)  # the per-kernel floor
    assert pm.sm_share(2) == pytest.approx(2 / 132)
    assert pm.sm_share(132) == pm.sm_share(264) == 1.0
    assert pm.sm_share(133) == pytest.approx(133 / 264)
    assert pm.waves(264, 1) == 2 and pm.waves(264, 2) == 1 and pm.waves(1, 0) == 1
    with pytest.raises(ValueError):
        pm.sm_share(0)


def test_qwen2_parameter_counts() -> None:
    # The published counts (tied embeddings for 0.5B and 1.5B, a separate LM head for 7B, 72B).
    assert QWEN2_SHAPES["qwen2.5-0.5b"].params() == 494_032_768
    assert QWEN2_SHAPES["qwen2.5-7b"].params() == 7_615_616_512
    assert QWEN2_SHAPES["qwen2.5-1.5b"].params() == 1_543_714_304
    assert QWEN2_SHAPES["qwen2-72b"].params() == 72_706_203_648
    # A decode step reads the tied table once (as the LM head): every parameter, 2 bytes.
    assert QWEN2_SHAPES["qwen2.5-0.5b"].weight_bytes_per_step() == 2 * 494_032_768


def test_split_count_rule() -> None:
    # The kernel's rule (attention_common.decode_num_splits): powers of two up to 16.
    assert pm.split_count(1, 2, 8192) == 16  # 32 programs, capped at 16 splits
    assert pm.split_count(1, 4, 8192) == 16
    assert pm.split_count(1, 2, 1024) == 4  # 256 keys per partition at least
    assert pm.split_count(1, 2, 100) == 1  # too short to split
    assert pm.split_count(64, 4, 8192) == 1  # 256 programs already
    assert pm.split_count(64, 2, 8192) == 2  # 128 < 132


def test_split_k_never_costs_more() -> None:
    for (name, cfg), batch, context, floor in itertools.product(
            QWEN2_SHAPES.items(), (1, 2, 3, 8, 16, 33, 64, 128), (16, 100, 1024, 8192, 65536),
            (0.0, pm.FLOOR_US)):
        args = (batch, context, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, "bfloat16")
        plain, one = pm.decode_attention_time(*args, split=False, floor_us=floor)
        split, parts = pm.decode_attention_time(*args, split=True, floor_us=floor)
        assert one == 1 and split <= plain, (name, batch, context, floor)
        step = pm.decode_step(cfg, batch, context, floor_us=floor)
        assert step.step_split_s <= step.step_s
        assert step.step_split_s >= step.bound_s * 0.999  # nothing beats the bandwidth bound
    # Scale: at batch 1 and a 64k context the unsplit kernel runs 2 of 132 SMs, so split-K
    # gains more than ten times on attention even at the kernel's 16 splits (flash-decoding
    # on an A100: 2300 -> 64 us).
    cfg = QWEN2_SHAPES["qwen2.5-0.5b"]
    args = (1, 65536, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, "bfloat16")
    plain, _ = pm.decode_attention_time(*args, split=False)
    split, parts = pm.decode_attention_time(*args, split=True)
    assert parts == 16 and plain / split > 10


def test_case_shapes_match_the_lowering_cases() -> None:
    """perf_model's idea of each case (tokens, sequences, context) is check_lowering's."""
    for case in iter_cases(models=MODEL_SHAPES[:1], dtypes=(jnp.bfloat16,)):
        if case.module in ("rms_norm", "rope", "kv_write", "rope_write_kv"):
            q = case.args[1] if case.module == "kv_write" else case.args[0]
            assert q.shape[0] == pm.CASE_TOKENS[case.phase], case
        elif case.module == "dequant_matmul":  # rows and layer are in the case name
            x, qweight = case.args[:2]
            layer, rows = case.kernel.split("_", 2)[2].rsplit("_m", 1)
            assert x.shape[0] == int(rows) and qweight.shape[1] == x.shape[1]
            cost = pm.case_cost(case.kernel, MODEL_SHAPES[0], "bfloat16", case.phase, (1, 1, 1))
            assert cost.flops == 2 * x.shape[0] * qweight.shape[0] * qweight.shape[1]
        elif case.module == "skinny_matmul":  # rows and layer are in the case name
            x, w = case.args
            rows = int(case.kernel.rsplit("_m", 1)[1])
            assert x.shape[0] == rows and w.shape[1] == x.shape[1]
            cost = pm.case_cost(case.kernel, MODEL_SHAPES[0], "bfloat16", case.phase, (1,))
            assert cost.flops == 2 * rows * w.shape[0] * w.shape[1]
        elif case.kernel.startswith("paged_attention_verify"):
            q, cache, tables = case.args[:3]
            assert tables.shape[0] == pm.VERIFY_SEQS and case.phase == "decode"
            assert q.shape[0] == pm.VERIFY_SEQS * pm.VERIFY_QUERY_LEN
            assert tables.shape[1] * cache.shape[-2] == pm.CASE_DECODE_CONTEXT
        elif case.kernel.startswith("paged_attention_splitk"):
            q, cache, tables = case.args[:3]
            assert q.shape[0] == tables.shape[0] == pm.SPLIT_K_CASE_SEQS[case.phase]
            assert tables.shape[1] * cache.shape[-2] == pm.CASE_DECODE_CONTEXT
        else:
            q, cache, tables = case.args[:3]
            assert q.shape[0] == pm.CASE_TOKENS[case.phase]
            assert tables.shape[0] == pm.CASE_SEQS[case.phase]
            if case.phase in ("decode", "decode1"):
                assert tables.shape[1] * cache.shape[-2] == pm.CASE_DECODE_CONTEXT


def _fake_results() -> list[cc.Result]:
    model = MODEL_SHAPES[0]  # qwen2.5-0.5b: 2 KV heads; prefill BQ = 16 for bf16
    base = dict(module="m", model=model.name, dtype="bfloat16", arch="sm_90a", num_warps=4,
                num_stages=1, registers=32, blocks_per_sm=8, occupancy=0.5, limiter="regs")
    return [
        cc.Result(kernel="rms_norm+residual", phase="decode", grid=(64, 1, 1), **base),
        cc.Result(kernel="rope", phase="prefill", grid=(512, 1, 1), **base),
        cc.Result(kernel="write_kv", phase="decode", grid=(4, 2, 1), **base),
        cc.Result(kernel="paged_attention_bs16", phase="decode", grid=(64, 1, 2), **base),
        cc.Result(kernel="paged_attention_bs16", phase="prefill", grid=(4, 128, 2), **base),
        cc.Result(kernel="paged_attention_verify_bs16_kv60g", phase="decode", grid=(16, 1, 2),
                  **base),
    ]


def test_model_rows_and_main_model_time(monkeypatch, tmp_path, capsys) -> None:
    rows = cc.model_rows(_fake_results())
    assert len(rows) == 6
    prefill = rows[4][-1]
    assert (prefill.launched, prefill.cost.programs) == (1024, 4 * 32 * 2)
    assert "768 programs exit at once" in prefill.note
    write_kv = rows[2][-1]
    assert "under-filled: 8 programs" in write_kv.note and write_kv.time_s == pm.FLOOR_US * 1e-6
    decode = rows[3][-1]  # 64 x 4096 keys x 2 KV heads x 64 x 2 (K, V) x 2 bytes = 134 MB
    assert decode.cost.bytes == pytest.approx(134.5e6, rel=1e-3)
    # The verify step, 16 sequences x 6 tokens at a 4096-token context (the 6 included): the
    # K/V and block table of a 16-sequence decode, q and o of 6 tokens instead of 1, and 6
    # query rows on 4090 + 1..6 keys.
    model = MODEL_SHAPES[0]
    verify = rows[5][-1]
    decode16 = pm.decode_attention_cost(16, 4096, model.num_heads, model.num_kv_heads,
                                        model.head_dim, "bfloat16")
    qo_per_token = 2 * 16 * model.num_heads * model.head_dim * 2
    assert verify.cost.bytes == decode16.bytes + 5 * qo_per_token
    assert verify.cost.flops == 4 * model.num_heads * model.head_dim * 16 * (6 * 4090 + 21)
    assert (verify.launched, verify.cost.programs) == (32, 32)
    assert "under-filled: 32 programs" in verify.note

    monkeypatch.setattr(cc, "run_checks", lambda *args, **kwargs: _fake_results())
    known = tmp_path / "known.txt"
    known.write_text("")
    assert cc.main(["--known", str(known), "--model-time"]) == 0
    out = capsys.readouterr().out
    assert "MODEL, NOT MEASUREMENT" in out and "| qwen2.5-7b | 64 | 8192 |" in out
    assert cc.main(["--known", str(known), "--model-time", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["model"]) == 6 and data["model"][0]["model_us"] >= pm.FLOOR_US
    assert pm.main([]) == 0
    assert "unsplit / split-K" in capsys.readouterr().out


def test_launch_bound_step_matches_the_first_gpu_run():
    # BENCHMARKS.md's GPU section: the 0.5B-shaped bfloat16 decode step at batch 1 took
    # 2.55-2.77 ms from dispatch to its candidates on the host, of which 1.69-1.82 ms was the
    # host's call of the step. The calibrated model must land within 25 % of both.
    pallas, fusions = pm.MEASURED_RUN_KERNELS  # the kernels that run launched
    # Its call took the weight tree, RoPE table, KV array, logits buffer and 7 input arrays.
    est = pm.launch_bound_step(QWEN2_SHAPES["qwen2.5-0.5b"], 1, 256, pallas_per_layer=pallas,
                               fusions_per_layer=fusions, arguments=180)
    assert 0.75 * 2.55e-3 <= est.step_s <= 1.25 * 2.77e-3
    assert 0.75 * 1.69e-3 <= est.host_s <= 1.25 * 1.82e-3
    # The runner's call now: the weight tree, RoPE table, KV, logits buffer, packed inputs.
    assert pm.launch_bound_step(QWEN2_SHAPES["qwen2.5-0.5b"], 1, 256).arguments == 174
    # Fewer arguments (the step's weights bound once) cut only the dispatch term.
    bound = pm.launch_bound_step(QWEN2_SHAPES["qwen2.5-0.5b"], 1, 256, arguments=3,
                                 pallas_per_layer=pallas, fusions_per_layer=fusions)
    assert est.host_s - bound.host_s == pytest.approx(177 * pm.ARG_US * 1e-6)
    assert bound.device_s == est.device_s
    # Two kernels a layer fewer (the QKV epilogue fused) take their launches off the host.
    now = pm.launch_bound_step(QWEN2_SHAPES["qwen2.5-0.5b"], 1, 256, arguments=3)
    assert bound.kernels - now.kernels == 2 * 24
    assert bound.host_s - now.host_s == pytest.approx(48 * pm.LAUNCH_US * 1e-6)
