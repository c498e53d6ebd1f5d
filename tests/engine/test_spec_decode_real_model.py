"""Speculative decoding on the embedded Qwen2.5-Coder-0.5B-Instruct: n-gram prompt lookup on the
task it is made for, a code edit whose answer repeats the prompt, and the model drafting for
itself. Oracle: the session's shared engine, without speculation."""

from __future__ import annotations

import gc

import pytest

from jaxllm import LLM, SamplingParams
from tests.engine.spec_decode_utils import draft_model, ngram
from tests.utils import assert_pool_free, scheduler_state

pytestmark = pytest.mark.real_model

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
EDIT = [{"role": "user", "content": "Rename the function `moving_average` to `rolling_mean` and "
                                    "repeat the whole function, changing nothing else:\n\n"
                                    "```python\n" + CODE + "```"}]
FIBONACCI = [{"role": "user", "content": "Write a Python function that returns the n-th "
                                         "Fibonacci number iteratively, with a docstring."}]


@pytest.mark.parametrize("messages, max_tokens, method, min_acceptance, must_contain", [
    # The answer copies the prompt's code: most drafts are accepted.
    pytest.param(EDIT, 64, "ngram", 0.5, "rolling_mean", id="ngram-code-edit"),
    # The draft is the target: nearly every draft is its next token.
    pytest.param(FIBONACCI, 48, "draft_model", 0.8, None, id="drafting-for-itself"),
])
def test_greedy_equals_spec_off_with_accepted_drafts(real_llm, real_model_path, messages,
                                                     max_tokens, method, min_acceptance,
                                                     must_contain):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = real_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    want = (list(out.token_ids), out.text)
    spec = (ngram(5, lookup_min=2, lookup_max=5) if method == "ngram"
            else draft_model(real_model_path, 3))
    # The speculative engine (a draft model shares the target's loaded weights) runs this one
    # request: one sequence, a small token budget and KV array, so few buckets to compile and
    # little memory; it is dropped at the end.
    llm = LLM(model=str(real_model_path), max_num_seqs=1, max_num_batched_tokens=32,
              show_progress=False, multiprocess_mode=False, dtype="float32", num_kv_blocks=32,
              speculative_config=spec)
    try:
        out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        got = (list(out.token_ids), out.text)
        state = scheduler_state(llm)
        assert_pool_free(llm)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    assert got == want
    assert len(got[0]) == max_tokens
    if must_contain is not None:
        assert must_contain in got[1]
    assert state["num_spec_draft_tokens"] > 0
    assert state["num_spec_accepted_tokens"] > min_acceptance * state["num_spec_draft_tokens"], \
        state
