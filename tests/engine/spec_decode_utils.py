"""Shared by the speculative-decoding engine tests (n-gram and draft model): their tiny target
and its Hugging Face oracle, the core's spec-decode counters, and the checks of spec-on outputs
against the spec-off engine's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxllm import SamplingParams
from tests.utils import assert_pool_free, compile_count, save_tiny_checkpoint, scheduler_state

VOCAB = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def ngram(k: int, lookup_min: int = 1, lookup_max: int = 3) -> dict:
    """The speculative config of n-gram prompt lookup proposing `k` tokens."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max}


def draft_model(path: Path | str, k: int) -> dict:
    """The speculative config of a draft model at `path` proposing `k` tokens."""
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def save_spec_target(path: Path) -> Path:
    """The tiny target: a larger weight scale than the other engine tests' (whose greedy output
    repeats one token), so its greedy output wanders: prompt lookup finds runs that are partly
    rejected, and a poor draft model is really refused."""
    save_tiny_checkpoint(path, tied=False, seed=2, initializer_range=0.1)
    return path


def generate(llm, prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def token_ids(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def assert_spec_off_equals_hf(path: Path, prompts: list[list[int]],
                              plain_greedy: list[list[int]]) -> None:
    """The oracle of the greedy tests: the engine without speculation decodes the checkpoint at
    `path` as Hugging Face's greedy decoding does."""
    torch = pytest.importorskip(
        "torch", reason="torch (the Hugging Face oracle) is not installed in this test lane")
    import transformers

    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(path)).eval()
    n = GREEDY.max_tokens
    for prompt, want in zip(prompts, plain_greedy, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == want


class SpecCounters:
    """The core's speculative-decoding counters over a block of the test."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.before = self._read()

    def _read(self) -> dict[str, int]:
        state = scheduler_state(self.llm)
        return {k: state[k] for k in ("num_spec_drafts", "num_spec_draft_tokens",
                                      "num_spec_accepted_tokens")}

    def delta(self) -> dict[str, int]:
        now = self._read()
        return {k: now[k] - self.before[k] for k in now}

    def assert_accepted(self) -> dict[str, int]:
        """Drafts were verified and some accepted. (In a step that also carries a prefill
        chunk, drafts beyond the step's logits rows count as rejected even when right: the
        draft log, not this rate, checks a self-draft's tokens in a batch.)"""
        d = self.delta()
        assert d["num_spec_drafts"] > 0 and d["num_spec_draft_tokens"] >= d["num_spec_drafts"], d
        assert d["num_spec_accepted_tokens"] > 0, d
        assert d["num_spec_accepted_tokens"] <= d["num_spec_draft_tokens"], d
        return d

    def assert_exercised(self, rejected: bool = True) -> dict[str, int]:
        """Drafts were verified and some accepted; with `rejected`, some were also refused."""
        d = self.assert_accepted()
        if rejected:
            assert d["num_spec_accepted_tokens"] < d["num_spec_draft_tokens"], d
        return d

    def assert_high(self, rate: float = 0.9) -> dict[str, int]:
        """Drafts were verified and at least `rate` of them accepted (a target drafting for
        itself)."""
        d = self.assert_accepted()
        assert d["num_spec_accepted_tokens"] >= rate * d["num_spec_draft_tokens"], d
        return d

    def assert_verified(self) -> dict[str, int]:
        """Drafts were verified and some refused (a poor draft)."""
        d = self.delta()
        assert d["num_spec_drafts"] > 0 and d["num_spec_draft_tokens"] >= d["num_spec_drafts"], d
        assert d["num_spec_accepted_tokens"] < d["num_spec_draft_tokens"], d
        return d


def assert_same_logprobs(got: list | None, want: list | None, where: str) -> None:
    """Per position: the same token ids in the same order, the same ranks, logprobs within
    1e-4 (the steps' shapes differ, so float rounding may)."""
    assert (got is None) == (want is None), where
    for j, (dg, dw) in enumerate(zip(got or (), want or (), strict=True)):
        assert (dg is None) == (dw is None), f"{where}, position {j}"
        assert list(dg or ()) == list(dw or ()), f"{where}, position {j}"
        for t in dw or ():
            assert dg[t].rank == dw[t].rank, f"{where}, position {j}"
            assert dg[t].logprob == pytest.approx(dw[t].logprob, abs=1e-4), \
                f"{where}, position {j}"


def assert_same_outputs(got, want) -> None:
    """Spec-on outputs against spec-off ones: tokens, stops, logprobs, prompt logprobs."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"request {i}"
        assert_same_logprobs(g.prompt_logprobs, w.prompt_logprobs, where + " prompt")
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert (list(gc.token_ids), gc.finish_reason, gc.stop_reason) == \
                (list(wc.token_ids), wc.finish_reason, wc.stop_reason), where
            assert_same_logprobs(gc.logprobs, wc.logprobs, where)
            if wc.cumulative_logprob is not None:
                assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob,
                                                              abs=1e-3), where


def check_equals_spec_off(llm, plain, prompts: list[list[int]], params) -> SpecCounters:
    """`prompts` with `params` give on the speculative engine `llm` the outputs of the spec-off
    engine `plain`, and leave every KV block free. Returns the counters over the spec-on run."""
    want = generate(plain, prompts, params)
    counters = SpecCounters(llm)
    got = generate(llm, prompts, params)
    assert_same_outputs(got, want)
    assert_pool_free(llm)
    return counters


def check_greedy_without_recompiles(llm, plain_greedy: list[list[int]],
                                    prompts: list[list[int]]) -> SpecCounters:
    """The prompts as one greedy batch give the spec-off tokens without compiling anything
    after warm-up. Returns the counters over the run."""
    counters = SpecCounters(llm)
    before = compile_count(llm)
    outs = generate(llm, prompts, GREEDY)
    assert compile_count(llm) == before, "the engine compiled after warm-up"
    assert token_ids(outs) == plain_greedy
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_pool_free(llm)
    return counters


def check_aborts_mid_run(llm, prompts: list[list[int]], plain_greedy: list[list[int]]
                         ) -> SpecCounters:
    """The prompts as greedy requests, the second and fourth aborted at the fifth step: the
    others finish with the spec-off tokens and every KV block is free again. Returns the
    counters over the run."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    done = {}
    counters = SpecCounters(llm)
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            done[o.request_id] = o
        if step == 4:
            engine.abort_request(["r1", "r3"])
    assert set(done) == {"r0", "r2", "r4"}
    for i in (0, 2, 4):
        assert list(done[f"r{i}"].outputs[0].token_ids) == plain_greedy[i]
    assert_pool_free(llm)
    return counters


def check_prefix_cache_hits(llm, plain, base: list[int]) -> SpecCounters:
    """`base` (70 tokens) alone, then two prompts that share its first 48 and 50 tokens (three
    full blocks): those hit the cache, and all three give the spec-off tokens. Returns the
    counters over both runs."""
    rng = np.random.default_rng(5)
    shared = [base[:48] + rng.integers(0, VOCAB, 5).tolist(),
              base[:50] + rng.integers(0, VOCAB, 12).tolist()]
    want = token_ids(generate(plain, [base] + shared, GREEDY))
    counters = SpecCounters(llm)
    assert token_ids(generate(llm, [base], GREEDY)) == want[:1]
    outs = generate(llm, shared, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [48, 48]
    assert token_ids(outs) == want[1:]
    assert_pool_free(llm)
    return counters
