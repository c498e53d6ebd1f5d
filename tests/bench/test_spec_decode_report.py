"""benchmarks/spec_decode.py's bookkeeping, on hand-made measurements: the summary over rounds,
the greedy check against speculation off, the markdown table. Nothing here runs or times a
model."""

from __future__ import annotations

import pytest

from benchmarks.spec_decode import check_greedy, markdown_table, speculative_config, summarize


def _round(r, tok_s, tpot=None, counters=None, token_ids=()):
    m = {"round": r, "output_tokens_per_second": tok_s, "tpot_mean": tpot, "ttft_mean": None,
         "token_ids": [list(t) for t in token_ids]}
    if counters is not None:
        m["counters"] = dict(zip(("num_spec_drafts", "num_spec_draft_tokens",
                                  "num_spec_accepted_tokens"), counters, strict=True))
    return m


def test_summary_takes_medians_per_round_speedups_and_summed_counters():
    off = [_round(1, 10.0, 0.10, (0, 0, 0)), _round(2, 20.0, 0.05, (0, 0, 0)),
           _round(3, 10.0, 0.10, (0, 0, 0))]
    ngram = [_round(1, 30.0, 0.04, (2, 6, 3)), _round(2, 20.0, 0.06, (3, 9, 0)),
             _round(3, 15.0, 0.08, (1, 3, 3))]
    s = summarize(ngram, off)
    assert s["output_tokens_per_second"] == 20.0 and s["tpot_mean"] == 0.06
    assert s["ttft_mean"] is None
    # Per-round ratios 3.0, 1.0, 1.5: their median, not the ratio of the medians (20 / 10).
    assert s["speedup_vs_off"] == 1.5
    # 6 drafts of 18 tokens over the rounds, 6 accepted.
    assert s["spec_decode_num_drafts"] == 6 and s["spec_decode_num_draft_tokens"] == 18
    assert s["spec_decode_acceptance_rate"] == pytest.approx(6 / 18)
    assert s["spec_decode_mean_accepted_length"] == pytest.approx(1 + 6 / 6)
    base = summarize(off, None)
    assert "speedup_vs_off" not in base and "spec_decode_num_drafts" not in base
    assert base["output_tokens_per_second"] == 10.0


def test_greedy_check_names_each_differing_request():
    results = {("code", 1, "off"): [_round(1, 1.0, token_ids=[[1, 2, 3], [4, 5]])],
               ("code", 1, "ngram3"): [_round(1, 1.0, token_ids=[[1, 2, 3], [4, 6, 7]])],
               ("code", 1, "ngram8"): [_round(1, 1.0, token_ids=[[1, 2, 3], [4, 5]])]}
    assert check_greedy(results, "code") == [
        {"workload": "code", "batch_size": 1, "round": 1, "setting": "ngram3", "prompt": 1,
         "first_difference": 1, "off_len": 2, "setting_len": 3}]
    # A longer output that starts like off's differs where off's ends.
    results[("code", 1, "ngram8")] = [_round(1, 1.0, token_ids=[[1, 2, 3, 9], [4, 5]])]
    got = check_greedy(results, "code")
    assert [(m["setting"], m["prompt"], m["first_difference"]) for m in got] == \
        [("ngram3", 1, 1), ("ngram8", 0, 3)]


def test_markdown_table_rows():
    summary = {("code", 1, "ngram5"): {"output_tokens_per_second": 41.26, "tpot_mean": 0.0201,
                                       "ttft_mean": 0.35, "speedup_vs_off": 1.804,
                                       "spec_decode_acceptance_rate": 0.6234,
                                       "spec_decode_mean_accepted_length": 3.456},
               ("random", 16, "off"): {"output_tokens_per_second": 300.0, "tpot_mean": 0.05,
                                       "ttft_mean": 0.2}}
    lines = markdown_table(summary).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| workload | batch | setting |")
    assert lines[2] == "| code | 1 | ngram5 | 41.3 | 20.1 | 350.0 | 1.80 | 62.3 | 3.46 |"
    # Batch 16: no per-request latencies; off: no speedup or acceptance.
    assert lines[3] == "| random | 16 | off | 300.0 | - | - | - | - | - |"


def test_speculative_configs():
    assert speculative_config("off") is None
    assert speculative_config("ngram5") == {"method": "ngram", "num_speculative_tokens": 5,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 5}
