"""Smoke tests of `jaxllm bench ...` on a tiny random model: the commands run end to end, write
their JSON with the documented keys, and the profile's split adds up. No timing assertions."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from jaxllm.benchmarks.datasets import TokenSampler, load_dataset, synthetic_workload
from jaxllm.benchmarks.matmul_floor import matmul_floor
from jaxllm.benchmarks.metrics import format_spec_decode, spec_decode_metrics
from jaxllm.benchmarks.profile import PROFILE_PHASES
from jaxllm.benchmarks.roofline import ModelCost, roofline, workload_cost
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.entrypoints.cli.main import main
from jaxllm.worker.matmul_timing import time_weight_matmuls, weight_matmuls
from tests.utils import make_tiny_checkpoint

# One engine shape for every test, so the compiled buckets come from the disk cache after the
# first start-up.
ENGINE = ["--skip-tokenizer-init", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
          "--max-model-len", "64", "--no-progress"]
FAST_ROOFLINE = ["--roofline-gemm-size", "128", "--roofline-copy-mib", "4"]

THROUGHPUT_KEYS = ("elapsed_time", "num_requests", "total_prompt_tokens", "total_output_tokens",
                   "total_num_tokens", "requests_per_second", "output_tokens_per_second",
                   "total_tokens_per_second")
LATENCY_KEYS = ("avg_latency", "latency_mean", "latency_p50", "latency_p99", "ttft_mean",
                "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99",
                "output_tokens_per_second")
ROOFLINE_KEYS = ("gemm_flops_per_s", "xla_flops_per_s", "numpy_flops_per_s",
                 "bandwidth_bytes_per_s", "gemv_read_bytes_per_s", "flops", "bytes", "ideal_time_s",
                 "jaxllm_fraction")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_tiny")
    make_tiny_checkpoint(path, tied=False, seed=3)
    return path


def _run(args, out_json):
    assert main([*args, "--output-json", str(out_json)]) == 0
    return json.loads(out_json.read_text())


def _positive(d, keys):
    for k in keys:
        assert d[k] > 0, k


def test_throughput_with_hf_roofline_and_profile(tiny_path, tmp_path, capsys):
    res = _run(["bench", "throughput", "--model", str(tiny_path), "--num-prompts", "5",
                "--random-input-range", "3", "20", "--random-output-range", "2", "6",
                "--ignore-eos", "--compare-hf", "--hf-batch-size", "2", *FAST_ROOFLINE,
                "--profile", "--profile-batch-sizes", "1", "4", "8", "--profile-input-len", "5",
                "--profile-steps", "3", *ENGINE], tmp_path / "tp.json")
    _positive(res, THROUGHPUT_KEYS)
    assert res["num_requests"] == 5
    wl = res["workload"]
    assert 3 <= wl["prompt_len_min"] <= wl["prompt_len_max"] <= 20
    assert 2 <= wl["output_len_min"] <= wl["output_len_max"] <= 6
    # ignore_eos: every request generates exactly its output length.
    assert res["total_output_tokens"] == wl["total_output_tokens"]
    _positive(res["hf"], THROUGHPUT_KEYS)
    assert res["hf"]["total_output_tokens"] == wl["total_output_tokens"]
    assert res["speedup_vs_hf"] > 0
    _positive(res["roofline"], (*ROOFLINE_KEYS, "hf_fraction"))
    assert res["engine"]["max_num_seqs"] == 4
    prof = {p["batch_size"]: p for p in res["profile"]}
    assert "skipped" in prof[8]  # more than max_num_seqs
    for bs in (1, 4):
        p = prof[bs]
        assert p["steps"] == 3 and p["step_ms"] > 0
        parts = [p["phases"][name]["ms"] for name in PROFILE_PHASES]
        assert all(x >= 0 for x in parts)
        ph = {name: p["phases"][name]["ms"] for name in PROFILE_PHASES}
        if p["async_scheduling"]:  # device + critical section + unhidden host work
            crit = p["host_critical_ms"]
            assert crit > 0 and crit >= ph["sampling"] + ph["logits_transfer"] - 1e-9
            assert ph["other"] == pytest.approx(max(0.0, p["step_ms"] - ph["device_step"]
                                                    - crit), abs=1e-9)
            assert ph["device_step"] + crit + ph["other"] >= p["step_ms"] * (1 - 1e-6)
        else:
            assert p["host_critical_ms"] is None
            named = sum(parts) - ph["other"]
            assert named <= p["step_ms"] + 1e-9
            assert sum(parts) == pytest.approx(p["step_ms"], rel=1e-6)
    floor = res["matmul_floor"]
    # Every request needs its output length in steps; shapes are the engine's buckets.
    assert floor["steps"] >= wl["output_len_max"]
    assert floor["steps"] == sum(x["steps"] for x in floor["shapes"])
    for x in floor["shapes"]:
        assert 1 <= x["num_tokens"] <= 16 and x["matmul_s_per_step"] > 0
    assert 0 < floor["matmul_floor_s"] < res["elapsed_time"]
    out = capsys.readouterr().out
    assert "Throughput:" in out and "HF transformers" in out and "Roofline:" in out
    assert "Matmul floor:" in out
    assert "Step profile" in out and "device_step" in out


def test_latency_with_hf(tiny_path, tmp_path, capsys):
    res = _run(["bench", "latency", "--model", str(tiny_path), "--batch-size", "2",
                "--input-len", "6", "--output-len", "4", "--num-iters", "2",
                "--num-iters-warmup", "1", "--compare-hf", *FAST_ROOFLINE, *ENGINE],
               tmp_path / "lat.json")
    _positive(res, LATENCY_KEYS)
    assert len(res["latencies"]) == 2
    _positive(res["hf"], LATENCY_KEYS)
    assert res["speedup_vs_hf"] > 0
    _positive(res["roofline"], ROOFLINE_KEYS)
    # Per measured iteration: one prefill step of 2 x 6 tokens (bucket 16) and 3 decode steps
    # of 2 tokens; warm-up steps are not counted.
    shapes = {(x["num_tokens"], x["max_query_len"]): x["steps"]
              for x in res["matmul_floor"]["shapes"]}
    assert shapes == {(16, 16): 2, (2, 1): 6}
    dec = res["decode"]
    assert dec["jaxllm_tpot_s"] == pytest.approx(res["tpot_mean"])
    assert dec["jaxllm_fraction"] == pytest.approx(dec["bound_s_per_token"] / res["tpot_mean"])
    assert dec["hf_fraction"] == pytest.approx(dec["bound_s_per_token"] / res["hf"]["tpot_mean"])
    assert dec["matmul_floor_s_per_step"] > 0
    assert not [k for k in res if k.startswith("spec_decode")]  # speculation is off
    out = capsys.readouterr().out
    assert "TTFT" in out and "Decode vs the memory bound" in out
    assert "Speculative decoding" not in out


def test_weight_matmuls_is_the_models_matmul_chain(tiny_path):
    cfg, raw = _tiny_weights(tiny_path)
    params = jax_to_numpy(raw)
    x = np.random.default_rng(0).standard_normal((5, cfg.hidden_size)).astype(np.float32)
    got = np.asarray(weight_matmuls(raw, cfg, x, 3))
    h, inter = cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size
    want = x.astype(np.float64)
    for i in range(cfg.num_hidden_layers):
        attn, mlp = params[f"layers_{i}"]["self_attn"], params[f"layers_{i}"]["mlp"]
        qkv = want @ attn["qkv_proj"]["weight"].T
        want = want + qkv[:, :h] @ attn["o_proj"]["weight"].T
        gate_up = want @ mlp["gate_up_proj"]["weight"].T
        gate = gate_up[:, :inter]
        want = want + (gate / (1 + np.exp(-gate)) * gate_up[:, inter:]) @ mlp["down_proj"][
            "weight"].T
    head = params["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
    np.testing.assert_allclose(got, want[:3] @ head.T, rtol=1e-4, atol=1e-4)


def test_time_weight_matmuls_times_each_token_count_once(tiny_path):
    import jax.numpy as jnp

    cfg, params = _tiny_weights(tiny_path)
    got = time_weight_matmuls(params, cfg, jnp.float32, 4, [8, 2, 8], reps=1)
    assert sorted(got) == [2, 8]
    assert all(s > 0 for s in got.values())


def test_matmul_floor_prices_shapes_through_the_engine():
    calls = []

    def collective_rpc(method, args=()):
        assert method == "time_weight_matmuls"
        num_tokens, reps = args
        calls.append((list(num_tokens), reps))
        return {n: n * 1e-3 for n in num_tokens}

    llm = SimpleNamespace(collective_rpc=collective_rpc)
    floor = matmul_floor(llm, {(16, 16): 2, (2, 1): 6, (16, 1): 1}, reps=2)
    assert calls == [([2, 16], 2)]  # each token count timed once, in order
    assert floor["steps"] == 9
    assert floor["matmul_floor_s"] == pytest.approx(6 * 2e-3 + 3 * 16e-3)
    assert [(x["num_tokens"], x["max_query_len"], x["steps"]) for x in floor["shapes"]] == [
        (2, 1, 6), (16, 1, 1), (16, 16, 2)]


def _tiny_weights(path):
    """The tiny checkpoint's config and params, loaded as the engine loads them (float32)."""
    from jaxllm.model_executor.model_loader.loader import load_model

    loaded = load_model(path, progress=False)
    return loaded.config, loaded.params


def jax_to_numpy(tree):
    return {k: jax_to_numpy(v) if isinstance(v, dict) else np.asarray(v, np.float64)
            for k, v in tree.items()}


def test_throughput_from_jsonl_dataset(tiny_path, tmp_path):
    data = tmp_path / "data.jsonl"
    records = [{"prompt_token_ids": [5, 6, 7, 8], "output_len": 3},
               {"prompt_token_ids": list(range(10, 30))},
               {"prompt_token_ids": [1, 2], "output_len": 5}]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    res = _run(["bench", "throughput", "--model", str(tiny_path), "--dataset", str(data),
                "--output-len", "2", "--ignore-eos", "--no-roofline", *ENGINE],
               tmp_path / "ds.json")
    assert res["num_requests"] == 3
    assert res["total_prompt_tokens"] == 4 + 20 + 2
    assert res["total_output_tokens"] == 3 + 2 + 5
    assert "roofline" not in res and "hf" not in res
    _positive(res, THROUGHPUT_KEYS)


def test_spec_decode_metrics_from_counter_deltas():
    before = {"num_spec_drafts": 2, "num_spec_draft_tokens": 10, "num_spec_accepted_tokens": 4,
              "num_free_blocks": 7}
    after = {"num_spec_drafts": 6, "num_spec_draft_tokens": 30, "num_spec_accepted_tokens": 16,
             "num_free_blocks": 3}
    m = spec_decode_metrics(before, after)
    # 4 drafts of 20 tokens in the run, 12 of them accepted.
    assert m == {"spec_decode_acceptance_rate": 0.6, "spec_decode_mean_accepted_length": 4.0,
                 "spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 20,
                 "spec_decode_num_accepted_tokens": 12}
    assert format_spec_decode(m) == ("Speculative decoding: acceptance rate 60.0%, mean "
                                     "accepted length 4.00 (4 drafts, 20 draft tokens, "
                                     "12 accepted)")
    # No step carried drafts (speculation off), or a core without the counters.
    assert spec_decode_metrics(after, after) == {}
    assert spec_decode_metrics({"num_free_blocks": 7}, {"num_free_blocks": 3}) == {}
    assert format_spec_decode({"output_tokens_per_second": 1.0}) is None


@pytest.mark.skipif("speculative_config" not in {f.name for f in dataclasses.fields(EngineArgs)},
                    reason="this engine has no speculative_config")
def test_throughput_reports_spec_decode(tiny_path, tmp_path, capsys):
    """A prompt that repeats a 4-token pattern: its last 2 tokens occur earlier, so the n-gram
    proposer drafts from the first decode step on."""
    data = tmp_path / "repeat.jsonl"
    data.write_text(json.dumps({"prompt_token_ids": [5, 6, 7, 8] * 6, "output_len": 8}) + "\n")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 5}
    res = _run(["bench", "throughput", "--model", str(tiny_path), "--dataset", str(data),
                "--ignore-eos", "--no-roofline", "--speculative-config", json.dumps(spec),
                *ENGINE], tmp_path / "spec.json")
    assert res["total_output_tokens"] == 8
    drafts, tokens = res["spec_decode_num_drafts"], res["spec_decode_num_draft_tokens"]
    accepted = res["spec_decode_num_accepted_tokens"]
    assert 1 <= drafts <= tokens <= 3 * drafts and 0 <= accepted <= tokens
    assert res["spec_decode_acceptance_rate"] == pytest.approx(accepted / tokens)
    assert res["spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    assert format_spec_decode(res) in capsys.readouterr().out


def test_sweep_json_and_png(tiny_path, tmp_path):
    png = tmp_path / "sweep.png"
    res = _run(["bench", "sweep", "--model", str(tiny_path), "--batch-sizes", "1", "2",
                "--input-len", "4", "--output-len", "3", "--output-png", str(png),
                *FAST_ROOFLINE, *ENGINE], tmp_path / "sweep.json")
    assert [r["batch_size"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["jaxllm"]["output_tokens_per_second"] > 0
        assert r["roofline_output_tokens_per_second"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dataset_records(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt_token_ids": [1, 2, 3]}, {"prompt": "hi"}]))
    with pytest.raises(ValueError, match="needs the tokenizer"):
        load_dataset(path, None, 4)

    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]

    wl = load_dataset(path, Tok(), 4)
    assert wl.prompts == [[1, 2, 3], [104, 105]] and wl.output_lens == [4, 4]
    assert len(load_dataset(path, Tok(), 4, num_prompts=1)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1]}\n{oops\n')
    with pytest.raises(ValueError, match="line 2"):
        load_dataset(bad, None, 4)


def test_synthetic_prompts_avoid_special_tokens():
    sampler = TokenSampler(10, special_ids={0, 9})
    wl = synthetic_workload(sampler, 50, 8, 4, seed=1, input_range=[2, 6])
    ids = {t for p in wl.prompts for t in p}
    assert ids <= set(range(1, 9))
    assert {len(p) for p in wl.prompts} <= set(range(2, 7))
    again = synthetic_workload(sampler, 50, 8, 4, seed=1, input_range=[2, 6])
    assert again.prompts == wl.prompts  # seeded


def test_workload_cost_counts():
    cost = ModelCost(body_params=100, head_params=10, itemsize=4, num_layers=2,
                               num_heads=3, num_kv_heads=1, head_dim=5)
    w = workload_cost(cost, [2], [3], max_num_seqs=1, max_num_batched_tokens=512)
    # Positions 0..3 are processed (the last output token is never fed back).
    assert w["processed_tokens"] == 4 and w["sampled_tokens"] == 3
    assert w["matmul_flops"] == 2 * 100 * 4 + 2 * 10 * 3
    assert w["attention_flops"] == 4 * 2 * 3 * 5 * (1 + 2 + 3 + 4)
    assert w["min_steps"] == 3
    assert w["weight_bytes"] == 3 * 110 * 4
    assert w["kv_read_bytes"] == (3 + 4) * 2 * 2 * 1 * 5 * 4
    machine = {"gemm_flops_per_s": 1e3, "bandwidth_bytes_per_s": 1e3}
    r = roofline(machine, w, {"jaxllm": 10.0})
    assert r["ideal_time_s"] == pytest.approx(max(w["flops"], w["bytes"]) / 1e3)
    assert r["jaxllm_fraction"] == pytest.approx(r["ideal_time_s"] / 10.0)
    assert np.isfinite(r["batch1_decode_bound_tok_per_s"])


def test_cli_parser_does_not_import_the_benchmarks():
    """`jaxllm chat` / `generate` (and building the `bench` parser, or parsing its flags) load
    no benchmark code: each bench command imports its module when it runs. A fresh interpreter,
    so modules this test process already imported cannot hide an import."""
    root = Path(__file__).resolve().parents[2]
    code = ("import sys\n"
            "from jaxllm.entrypoints.cli.main import build_parser\n"
            "parser = build_parser()\n"
            "parser.parse_args(['bench', 'latency', '--batch-size', '2'])\n"
            "parser.parse_args(['chat', 'hi'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('jaxllm.benchmarks')))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, check=True, timeout=300).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.real_model  # its tokenizer is the embedded model's
def test_tiny_qwen2_is_a_real_qwen2_and_benches_the_host_path(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm import LLM, SamplingParams
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    path = tiny_qwen2_path()
    assert tiny_qwen2_path() == path  # written once, then reused
    # Hugging Face reads the same checkpoint: identical greedy tokens through both.
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = [9707, 1879, 11, 1246]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                           min_new_tokens=8)[0, len(prompt):].tolist()
    llm = LLM(model=str(path), max_model_len=64, max_num_seqs=2, show_progress=False)
    got = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want
    assert llm.get_tokenizer().encode("Hello world") == [9707, 1879]
    res = _run(["bench", "latency", "--model", "tiny-qwen2", "--batch-size", "2",
                "--input-len", "8", "--output-len", "4", "--num-iters", "1",
                "--num-iters-warmup", "0", "--no-roofline", "--profile",
                "--profile-batch-sizes", "2", "--profile-input-len", "8", "--profile-steps", "2",
                "--max-model-len", "64", "--no-progress"], tmp_path / "tiny.json")
    assert res["engine"]["model"] == str(path)
    (prof,) = res["profile"]
    assert prof["batch_size"] == 2 and prof["step_ms"] > 0
