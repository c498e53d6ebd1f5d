"""Beam search (`LLM.beam_search`, jaxllm/beam_search.py) against a reference search written
here over Hugging Face's log-softmax (float64) of the same tiny random checkpoint: every
candidate of every beam ranked by vLLM's length-penalised score, end-of-sequence candidates set
aside as completed beams. Plus the search alone over a table of logprobs, and the parameters'
refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from jaxllm import BeamSearchParams, SamplingParams
from jaxllm.beam_search import beam_search
from jaxllm.outputs import Logprob
from tests.utils import assert_pool_free, make_llm, make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 60))]


def reference(logprobs_of, prompt: list[int], width: int, max_tokens: int, eos: set[int],
              length_penalty: float = 1.0, ignore_eos: bool = False
              ) -> list[tuple[list[int], float]]:
    def score(item):
        seq, cum = item
        n = len(seq) - (1 if seq[-1] in eos else 0)
        return cum / n ** length_penalty

    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for seq, cum in live:
            lp = logprobs_of(seq)
            for t in np.argsort(-lp, kind="stable")[:2 * width].tolist():
                (done if t in eos and not ignore_eos else grown).append((seq + [t], cum + lp[t]))
        live = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint path, HF log-softmax of a prefix's next token, an EOS id the searches meet)."""
    torch = pytest.importorskip("torch", reason="torch (the Hugging Face oracle) is not "
                                                "installed in this test lane")
    path = tmp_path_factory.mktemp("beam")
    hf = make_tiny_checkpoint(path, tied=False, seed=21)

    def logprobs_of(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        return torch.log_softmax(logits, -1).numpy()

    # The second choice after the first prompt: some beam ends there at the first step.
    eos = int(np.argsort(-logprobs_of(PROMPTS[0]))[1])
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.exists():
            cfg = json.loads(file.read_text())
            cfg["eos_token_id"] = eos
            file.write_text(json.dumps(cfg))
    return path, logprobs_of, eos


@pytest.fixture(scope="module")
def llm(model):
    llm = make_llm(model[0], dtype="float32", max_model_len=64, max_num_seqs=16)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.0), (2, 2.0)])
def test_the_best_beams_are_the_reference_search(llm, model, width, length_penalty):
    _, logprobs_of, eos = model
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outs) == len(PROMPTS)
    ended = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = reference(logprobs_of, prompt, width, 6, {eos}, length_penalty)
        assert [s.tokens for s in out.sequences] == [seq for seq, _ in want]
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences],
                                   [cum for _, cum in want], atol=1e-4, rtol=0)
        for s in out.sequences:
            assert s.tokens[:len(prompt)] == prompt
            assert len(s.logprobs) == len(s.tokens) - len(prompt)
            np.testing.assert_allclose(sum(d[t].logprob for d, t in zip(
                s.logprobs, s.tokens[len(prompt):], strict=True)), s.cum_logprob, rtol=1e-6)
            if s.tokens[-1] == eos:
                assert (s.finish_reason, s.stop_reason) == ("stop", eos)
                ended += 1
            else:
                assert s.finish_reason == "length" and len(s.tokens) == len(prompt) + 6
            assert s.text is None  # no tokenizer
    if width > 1 and length_penalty == 1.0:
        assert ended  # the EOS was met
    assert_pool_free(llm)


def test_ignore_eos_and_one_beam_is_greedy(llm, model):
    _, logprobs_of, eos = model
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                          BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    greedy = llm.generate({"prompt_token_ids": PROMPTS[0]},
                          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    (best,) = out[0].sequences
    assert best.tokens[len(PROMPTS[0]):] == greedy
    want = reference(logprobs_of, PROMPTS[0], 1, 5, {eos}, ignore_eos=True)
    assert [best.tokens] == [seq for seq, _ in want]
    # Several prompts, searched two at a time, give what each gives alone.
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    both = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params,
                           concurrency_limit=1)
    alone = [llm.beam_search({"prompt_token_ids": p}, params)[0] for p in PROMPTS]
    assert [[s.tokens for s in o.sequences] for o in both] == \
        [[s.tokens for s in o.sequences] for o in alone]
    assert_pool_free(llm)


def test_beams_stop_at_max_model_len(llm, model):
    prompt = list(range(1, 61))  # 60 of the 64 positions
    out = llm.beam_search({"prompt_token_ids": prompt},
                          BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert [len(s.tokens) for s in out[0].sequences] == [64, 64]
    assert {s.finish_reason for s in out[0].sequences} == {"length"}
    assert_pool_free(llm)


# --- the search alone, over a table -------------------------------------------------------------


def test_the_search_over_a_table_and_its_text():
    rng = np.random.default_rng(0)
    vocab, eos = 12, {3, 7}
    table: dict[tuple[int, ...], np.ndarray] = {}

    def logprobs_of(seq) -> np.ndarray:
        key = tuple(seq)
        if key not in table:
            x = rng.normal(0, 2, vocab)
            table[key] = x - np.log(np.exp(x).sum())
        return table[key]

    def generate(prompts, sp):
        assert sp.max_tokens == 1 and sp.logprobs is not None
        outs = []
        for p in prompts:
            lp = logprobs_of(p["prompt_token_ids"])
            top = np.argsort(-lp, kind="stable")[:sp.logprobs]
            ranked = {int(t): Logprob(float(lp[t]), r + 1) for r, t in enumerate(top)}
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(logprobs=[ranked])]))
        return outs

    for width, penalty, ignore in [(2, 1.0, False), (3, 0.5, False), (5, 1.0, True)]:
        params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=penalty,
                                  ignore_eos=ignore)
        (out,) = beam_search(generate, [[1, 2]], params, frozenset(eos), 100,
                             decode=lambda ids: ",".join(map(str, ids)))
        want = reference(logprobs_of, [1, 2], width, 5, eos, penalty, ignore)
        assert [s.tokens for s in out.sequences] == [seq for seq, _ in want]
        for s in out.sequences:
            shown = s.tokens[2:-1] if s.finish_reason == "stop" else s.tokens[2:]
            assert s.text == ",".join(map(str, shown))
    stop = BeamSearchParams(beam_width=3, max_tokens=5, include_stop_str_in_output=True)
    (out,) = beam_search(generate, [[1, 2]], stop, frozenset(eos), 100,
                         decode=lambda ids: ",".join(map(str, ids)))
    assert all(s.text == ",".join(map(str, s.tokens[2:])) for s in out.sequences)


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0, max_tokens=4), r"beam_width must be an integer in \[1, 10\]"),
    (dict(beam_width=11, max_tokens=4), r"beam_width .* 2 x beam_width logprobs, at most 20"),
    (dict(beam_width=True, max_tokens=4), r"beam_width"),
    (dict(beam_width=2, max_tokens=0), r"max_tokens must be an integer in >= 1"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), r"length_penalty"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), r"temperature must be >= 0"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), r"ignore_eos must be a bool"),
])
def test_bad_params_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_bad_calls_are_named(llm):
    with pytest.raises(TypeError, match="params must be BeamSearchParams"):
        llm.beam_search({"prompt_token_ids": [1]}, SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt 1: "):
        llm.beam_search([{"prompt_token_ids": [1]}, {"prompt_token_ids": []}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search({"prompt_token_ids": [1]}, BeamSearchParams(beam_width=2, max_tokens=2),
                        concurrency_limit=0)
    assert_pool_free(llm)
