"""N-gram speculation on the embedded Qwen2.5-Coder-0.5B-Instruct, on the task it is made for: a
code edit whose answer repeats the prompt. Oracle: the same engine without speculation."""

from __future__ import annotations

import gc

import pytest

from jaxllm import LLM, SamplingParams
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
MESSAGES = [{"role": "user", "content": "Rename the function `moving_average` to "
                                        "`rolling_mean` and repeat the whole function, "
                                        "changing nothing else:\n\n```python\n" + CODE + "```"}]
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}


def test_code_edit_equals_spec_off_with_accepted_drafts(real_llm, real_model_path):
    # The oracle is the session's shared engine; the speculative one takes its settings (in
    # process, float32, its buckets; a small KV array) and is dropped at the end.
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    out = real_llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    want = (list(out.token_ids), out.text)
    llm = LLM(model=str(real_model_path), max_num_seqs=4, max_num_batched_tokens=64,
              show_progress=False, multiprocess_mode=False, dtype="float32", num_kv_blocks=128,
              speculative_config=SPEC)
    try:
        out = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
        got = (list(out.token_ids), out.text)
        state = scheduler_state(llm)
        assert_pool_free(llm)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    assert got == want
    assert len(got[0]) == 64
    assert "rolling_mean" in got[1]
    assert state["num_spec_draft_tokens"] > 0
    # The answer copies the prompt's code: most drafts are accepted.
    assert state["num_spec_accepted_tokens"] > state["num_spec_draft_tokens"] // 2, state
