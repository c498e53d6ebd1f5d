"""Every kernel compiles to sm_90a machine code that fits an H100 SM without spilling registers, or
is on the known-failures list (pip triton, no GPU; see pallas_kernels/checks/check_compile.py
and triton_compile.py)."""

from __future__ import annotations

import collections
import dataclasses
import json

import jax.numpy as jnp
import pytest

# The test extra in pyproject.toml installs triton: without it this module errors, never skips.
import triton  # noqa: F401

from pallas_kernels.checks import check_compile as cc
from pallas_kernels.checks import triton_compile as tc
from pallas_kernels.checks.check_lowering import MODEL_SHAPES, iter_cases

H100 = tc.ARCHES["sm_90a"]
A100 = tc.ARCHES["sm_80"]
KIB = 1024


@pytest.fixture(scope="module")
def sm90_results() -> list[cc.Result]:
    return cc.run_checks("sm_90a")


def test_every_case_compiles_fits_and_does_not_spill_unless_known(sm90_results) -> None:
    # One result per Triton kernel: one per case, except split-K decode (split + combine,
    # named case/kernel).
    per_case = collections.Counter((r.kernel.split("/")[0], r.model, r.dtype, r.phase)
                                   for r in sm90_results)
    assert set(per_case) == {(c.kernel, c.model, c.dtype, c.phase) for c in iter_cases()}
    multi = {r.kernel for r in sm90_results if "/" in r.kernel}
    assert all(n == 1 or key[0].startswith("paged_attention_splitk") and n == 2
               for key, n in per_case.items())
    assert {name.split("/")[1] for name in multi} == {"paged_attention_split",
                                                      "paged_attention_combine"}
    verdict = cc.judge(sm90_results, cc.load_known_failures())
    assert verdict.ok, "\n" + cc.format_table(verdict.new) + "\n" + cc.format_verdict(
        verdict, sm90_results, "sm_90a", 0.0, cc.KNOWN_FAILURES_PATH)
    ok = [r for r in sm90_results if r.status == "ok"]
    assert ok and all(r.registers > 0 and r.blocks_per_sm > 0 for r in ok)


def test_a_known_failure_that_no_longer_fails_is_reported(sm90_results) -> None:
    known = cc.load_known_failures()
    passing = next(r for r in sm90_results if r.status == "ok")
    fixed = cc.KnownFailure("sm_90a", passing.kernel, passing.model, passing.dtype,
                            passing.phase, "spills")
    gone = cc.KnownFailure("sm_90a", "no_such_kernel", "qwen2.5-0.5b", "float32", "decode",
                           "spills")
    verdict = cc.judge(sm90_results, [*known, fixed, gone])
    assert not verdict.ok and not verdict.new
    assert set(verdict.stale) == {(fixed, "ok"), (gone, "no such case")}
    # Listed with another status: the entry is stale and the case a new failure: a passing case
    # is made to spill.
    failing = dataclasses.replace(passing, spill_stores=8, spill_loads=8)
    assert failing.status == "spills"
    results = [failing if r is passing else r for r in sm90_results]
    other = [k for k in known if k.key != failing.key]
    wrong = cc.KnownFailure("sm_90a", failing.kernel, failing.model, failing.dtype,
                            failing.phase, "no-fit")
    verdict = cc.judge(results, [*other, wrong])
    assert verdict.new == [failing] and verdict.stale == [(wrong, "spills")]


def test_main_exits_1_on_a_stale_entry_and_writes_json(sm90_results, monkeypatch, tmp_path,
                                                       capsys) -> None:
    monkeypatch.setattr(cc, "run_checks", lambda *args, **kwargs: sm90_results)
    assert cc.main([]) == 0
    assert "0 new, 0 stale" in capsys.readouterr().out
    passing = next(r for r in sm90_results if r.status == "ok")
    known = tmp_path / "known.txt"
    known.write_text(cc.KNOWN_FAILURES_PATH.read_text()
                     + f"sm_90a {passing.key} spills  # fixed since\n")
    assert cc.main(["--known", str(known)]) == 1
    assert f"STALE: 'sm_90a {passing.key} spills' is now ok" in capsys.readouterr().out
    assert cc.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["arch"] == "sm_90a" and data["ok"] and len(data["results"]) == len(sm90_results)
    assert {"registers", "spill_stores", "stack", "shared", "blocks_per_sm", "occupancy",
            "matmul", "status", "known"} <= set(data["results"][0])


def test_sm80_compiles_in_process() -> None:
    results = cc.run_checks("sm_80", ["rms_norm"], MODEL_SHAPES[:1], [jnp.bfloat16], ["decode"],
                            jobs=1)
    assert [r.kernel for r in results] == ["rms_norm", "rms_norm+residual"]
    assert all(r.arch == "sm_80" and r.status == "ok" and r.registers > 0 for r in results)


def test_occupancy_arithmetic() -> None:
    # 255 registers -> 8192 per warp (255 * 32 = 8160, rounded up to 256s): 2 warps in each of
    # the 4 sub-partitions of 16384 -> 8 warps -> 2 blocks of 4 warps.
    occ = tc.occupancy(H100, 255, 4, 0)
    assert (occ.blocks, occ.warps, occ.fraction, occ.limiter) == (2, 8, 0.125, "regs")
    # Allocation granularity: 33 registers -> 1056 -> 1280 per warp -> 12 warps per
    # sub-partition -> 48 warps -> 12 blocks of 4 (unrounded 1056 would give 15).
    assert tc.occupancy(H100, 33, 4, 0).blocks == 12
    # Sub-partitions: 96 registers -> 3072 per warp; 16384 // 3072 = 5 -> 20 one-warp blocks
    # (65536 // 3072 = 21 if the register file were one pool).
    assert tc.occupancy(H100, 96, 1, 0).by_limit["regs"] == 20
    # Shared memory: 80 KiB + the 1 KiB reserve = 81 KiB -> 228 // 81 = 2 blocks on an H100.
    occ = tc.occupancy(H100, 32, 8, 80 * KIB)
    assert (occ.blocks, occ.limiter, occ.by_limit["regs"]) == (2, "shared", 8)
    # 113 KiB + 1 KiB = 114 KiB: exactly 2 blocks of 228 KiB; one byte more rounds up to the
    # next 128-byte unit and leaves 1.
    assert tc.occupancy(H100, 32, 4, 113 * KIB).blocks == 2
    assert tc.occupancy(H100, 32, 4, 113 * KIB + 1).blocks == 1
    # The per-block opt-in maximum is 227 KiB (+ reserve) on an H100, 163 KiB on an A100.
    assert tc.occupancy(H100, 32, 4, 227 * KIB).blocks == 1
    assert tc.occupancy(H100, 32, 4, 227 * KIB + 1).blocks == 0
    assert tc.occupancy(A100, 32, 4, 163 * KIB).blocks == 1
    assert tc.occupancy(A100, 32, 4, 163 * KIB + 1).blocks == 0
    assert tc.occupancy(A100, 32, 4, 80 * KIB).blocks == 2  # 164 // 81
    # Block and warp limits: tiny one-warp blocks stop at 32 blocks (50% of 64 warps); 8-warp
    # blocks at 8 (64 warps); more than 1024 threads never fit.
    occ = tc.occupancy(H100, 24, 1, 0)
    assert (occ.blocks, occ.fraction, occ.limiter) == (32, 0.5, "blocks")
    occ = tc.occupancy(H100, 32, 8, 0)
    assert (occ.blocks, occ.fraction, occ.limiter) == (8, 1.0, "regs+warps")
    assert tc.occupancy(H100, 16, 33, 0).blocks == 0


def test_tool_output_parsers() -> None:
    log = ("ptxas info    : Compiling entry function 'paged_attention' for 'sm_90a'\n"
           "ptxas info    : Function properties for paged_attention\n"
           "    240 bytes stack frame, 412 bytes spill stores, 324 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 240 bytes cumulative stack size\n")
    assert tc.parse_ptxas_log(log) == {"registers": 255, "stack": 240, "spill_stores": 412,
                                       "spill_loads": 324}
    usage = ("Resource usage:\n Common:\n  GLOBAL:11 CONSTANT[4]:8\n Function paged_attention:\n"
             "  REG:255 STACK:240 SHARED:1024 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0\n")
    assert tc.parse_resource_usage(usage) == {"registers": 255, "stack": 240,
                                              "static_shared": 1024, "local": 0}
    with pytest.raises(ValueError):
        tc.parse_ptxas_log("ptxas info    : Compile time = 1 ms")
    dot = "%0 = tt.dot %a, %b, %c"
    assert tc.matmul_kind(dot, "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == "wgmma"
    assert tc.matmul_kind(dot, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == "mma"
    assert tc.matmul_kind(dot, "fma.rn.f32 %f1, %f2, %f3, %f4;") == "FMA"
    assert tc.matmul_kind("tt.load", "fma.rn.f32") == "-"


def test_known_failures_list_parses() -> None:
    known = cc.load_known_failures()
    assert len({(k.arch, k.key) for k in known}) == len(known)  # no duplicates
