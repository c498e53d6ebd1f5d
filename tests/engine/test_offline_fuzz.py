"""Offline input is hostile too: any SamplingParams fields (wrong types, extremes, None, NaN,
huge integers) and any prompt shape (empty, nested, bools, out-of-vocabulary or huge) either
generate tokens of the vocabulary within max_tokens, or raise ValueError / TypeError naming
what is wrong; either way the engine is left with no request and every KV block free."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxllm import SamplingParams
from tests.utils import assert_pool_free, make_llm

VOCAB = 512  # the tiny checkpoint's
MAX_MODEL_LEN = 128

# The public fields (a private one is filled by the frontend, never by a caller).
FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")]

# Integers beyond what int32 token ids, int64 rows and the msgpack wire hold, or any size.
HUGE_INT = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400]) \
    | st.integers()
HOSTILE = HUGE_INT | st.sampled_from([
    None, True, False, 0, 1, -1, -2, 2, 3, 2**31 - 1, 0.0, -0.0, 0.5, 1.5, float("nan"),
    float("inf"), float("-inf"), 1e308,
    5e-324, "", "x", "1", " 5 ", "\u0661\u0662", "\ud800", b"1", [], [1], [-1], [2**40], [True],
    ["a"], [[1]], {}, {1: 1.0}, {"1": 1.0}, {2**31: 1.0}, {1: float("nan")}, {1: 10**400},
    {"json": "{"}, {"regex": 5}, {"choice": []}, {"bogus": 1}, object(),
])

# Values each field takes in normal use, so that valid requests reach the engine too.
SANE = {
    "n": st.integers(1, 3), "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]), "top_k": st.sampled_from([-1, 0, 1, 5, 2**63 - 1]),
    "min_p": st.sampled_from([0.0, 0.1]), "seed": st.sampled_from([None, -1, 0, 2**63 - 1]),
    "max_tokens": st.integers(1, 6), "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 2), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB + 2), st.floats(-5, 5), max_size=3),
    "logprobs": st.sampled_from([None, 0, 2, 20]), "prompt_logprobs": st.sampled_from([None, 1]),
    "ignore_eos": st.booleans(), "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([1.0, 1.3]), "frequency_penalty": st.floats(-2, 2),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "output_kind": st.sampled_from([0, 1, 2]), "stop": st.just(None),
    "structured_outputs": st.just(None),
    "allowed_token_ids": st.none() | st.lists(st.integers(0, VOCAB + 2), min_size=1, max_size=3),
    # Bad words are tokenized, and this engine has no tokenizer: only hostile values reach it.
    "bad_words": st.just(None), "truncate_prompt_tokens": st.sampled_from([None, -1, 1, 5]),
}


@st.composite
def sampling_kwargs(draw):
    kwargs = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique=True)):
        # Mostly sane values, so that one hostile value at a time is what a request carries.
        kwargs[name] = draw(st.one_of(SANE[name], SANE[name], HOSTILE))
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = 4  # keeps the valid cases short
    return kwargs


TOKENS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
VALID_PROMPT = st.builds(lambda ids: {"prompt_token_ids": ids}, TOKENS)
PROMPT = st.one_of(
    VALID_PROMPT, VALID_PROMPT, VALID_PROMPT,
    st.sampled_from([
        "", "text needs a tokenizer", [], [[]], [[1, 2]], None, 5, b"bytes", {},
        {"prompt_token_ids": []}, {"prompt_token_ids": [True, 2]}, {"prompt_token_ids": [1.0]},
        {"prompt_token_ids": [VOCAB]}, {"prompt_token_ids": [-1]},
        {"prompt_token_ids": [2**63]}, {"prompt_token_ids": [10**30]},
        {"prompt_token_ids": "1 2"}, {"prompt_token_ids": None}, {"prompt_token_ids": [[1]]},
        {"prompt_token_ids": [1] * MAX_MODEL_LEN}, {"prompt_token_ids": [1] * 100_000},
        {"prompt": None}, {"prompt": 5}, {"prompt": {"prompt_token_ids": [1, 2]}},
    ]))

# What a clear error names: a SamplingParams field, the prompt, or the argument.
NAMED = re.compile(r"SamplingParams\.\w+|prompt|sampling_params|token ids")


@pytest.fixture(scope="module")
def llm(tiny):
    llm = make_llm(tiny[0], max_model_len=MAX_MODEL_LEN, multiprocess_mode=False, max_n=3)
    yield llm
    llm.llm_engine.shutdown()


def _check_engine_clean(llm) -> None:
    assert not llm.llm_engine.has_unfinished_requests()
    assert_pool_free(llm)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kwargs=sampling_kwargs(), prompts=st.lists(PROMPT, min_size=1, max_size=3))
def test_hostile_params_and_prompts(llm, kwargs, prompts):
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        field = re.search(r"SamplingParams\.(\w+)", str(e))
        assert field, f"the error names no field: {e}"
        assert field.group(1) in kwargs or field.group(1) == "structured_outputs", str(e)
        event("SamplingParams refused")
        return
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, TypeError) as e:
        assert NAMED.search(str(e)), f"the error names nothing: {e}"
        event("generate refused")
    else:
        event("generated")
        assert len(outputs) == len(prompts)
        for out in outputs:
            assert out.finished and len(out.outputs) == params.n
            for c in out.outputs:
                # None: up to what max_model_len leaves after the prompt.
                assert 1 <= len(c.token_ids) <= (params.max_tokens or MAX_MODEL_LEN)
                assert all(0 <= t < VOCAB for t in c.token_ids)
                if params.logprobs is not None:
                    # The sampled token's logprob, and the top-N, each step.
                    assert len(c.logprobs) == len(c.token_ids)
                    for d, t in zip(c.logprobs, c.token_ids, strict=True):
                        assert t in d and len(d) <= params.logprobs + 1
                        assert all(lp.logprob <= 0.0 for lp in d.values())
    _check_engine_clean(llm)


def test_dict_as_sampling_params_is_named(llm):
    with pytest.raises(TypeError, match=r"sampling_params must be SamplingParams or a sequence "
                                        r"of them, got dict"):
        llm.generate([{"prompt_token_ids": [1, 2]}], {"temperature": 0}, use_tqdm=False)
    _check_engine_clean(llm)


def test_huge_top_k_refused_before_the_engine(llm):
    with pytest.raises(ValueError, match=r"^SamplingParams\.top_k must .*, got 10{30}$"):
        SamplingParams(top_k=10**30)
    # The largest accepted top_k is "every token" and generates.
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(top_k=2**63 - 1, max_tokens=3, ignore_eos=True, seed=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    _check_engine_clean(llm)


def test_deeply_nested_prompt_dict_is_refused(llm):
    prompt = functools.reduce(lambda p, _: {"prompt": p}, range(5000), {"prompt_token_ids": [1]})
    with pytest.raises(ValueError, match=r"prompt 0: a prompt dict's 'prompt' must be a str, "
                                         r"got dict"):
        llm.generate([prompt], use_tqdm=False)
    _check_engine_clean(llm)
