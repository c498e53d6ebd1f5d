"""The embedded Qwen2.5-Coder-0.5B GGUF through our loader vs transformers loading the same file.

Both sides dequantize the same Q4_K_M blocks to float32, so the weights are identical; what
differs is float32 summation order over 24 layers (XLA vs PyTorch GEMMs, softmax, RMSNorm).
Measured here: max |logit difference| at the last position 1e-4 to 3e-4 on logits of magnitude ~20,
so the test allows 2e-3 absolute; greedy tokens must be identical.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from jaxllm import SamplingParams
from tests.model_inputs import prefill_inputs
from tests.utils import runner_of, scheduler_state

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def fibonacci(n):",
    "The history of the printing press begins",
    "请用中文介绍一下你自己。",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]
LOGIT_ATOL = 2e-3


def test_tokenizer_known_ids(real_llm):
    tok = real_llm.tokenizer
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643, 151644, 151645]


@pytest.mark.parametrize("text", ["你好，世界！这是一个测试。", "emoji 🎉🚀 mixed 中文 and ascii",
                                  "日本語のテキスト 👨‍👩‍👧 family", "tabs\tand\nnewlines  "])
def test_tokenizer_round_trip(real_llm, text):
    tok = real_llm.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_is_embedded(real_llm):
    text = real_llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                  tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_last_position_logits_close_to_hf(real_llm, hf_real_model):
    tok = real_llm.tokenizer
    runner = runner_of(real_llm)  # in process (the fixture pins it): its model and weights
    prompts = [tok.encode(p) for p in PROMPTS]
    ids, pos, kv, md = prefill_inputs(runner.config, prompts)
    logits, _, _ = runner.model.apply({"params": runner.params, "rope": runner.rope},
                                      ids, pos, kv, md)
    logits = np.asarray(logits)
    ends = np.cumsum([len(p) for p in prompts]) - 1
    worst = 0.0
    for prompt, end in zip(prompts, ends, strict=True):
        with torch.no_grad():
            want = hf_real_model(torch.tensor([prompt])).logits[0, -1].numpy()
        diff = np.abs(logits[end] - want).max()
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, f"max |logit diff| {diff} for prompt {prompt[:8]}"
        assert logits[end].argmax() == want.argmax()
    print(f"max |last-position logit diff| vs HF: {worst:.2e}")


def test_greedy_continuations_identical_to_hf(real_llm, hf_real_model):
    tok = real_llm.tokenizer
    outs = real_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32),
                             use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf_real_model.generate(ids, max_new_tokens=32, do_sample=False,
                                         eos_token_id=sorted(real_llm.llm_engine.eos_token_ids))
        want = ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want, (prompt, out.outputs[0].text)
    assert outs[0].outputs[0].text.startswith('\n    if n <= 0:\n        return "Invalid input"')


def test_chat_answers_through_template(real_llm):
    out = real_llm.chat([{"role": "user", "content": "What is 2 + 3? Answer with one number."}],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert "5" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_engine_under_pressure_matches_hf(real_model_path, real_llm, hf_real_model):
    """Preemption, chunked prefill and prefix-cache hits at once, on the real model."""
    from jaxllm import LLM

    tok = real_llm.tokenizer
    system = ("You are a careful senior Python engineer. Answer with short, correct code and "
              "one sentence of explanation. Prefer the standard library.")
    questions = ["Reverse a string.", "Check if a number is prime.", "Flatten a nested list.",
                 "Read a CSV file into dicts.", "Count words in a text."]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True)
               for q in questions] + ["def fibonacci(n):"]
    llm = LLM(model=str(real_model_path), max_num_seqs=4, max_num_batched_tokens=32,
              num_kv_blocks=9, show_progress=False, dtype="float32")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)
        state = scheduler_state(llm)
    finally:
        # Its weights go before HF generates: the session's engine and HF's model stay.
        llm.shutdown()
        del llm
        gc.collect()
    assert state["num_preemptions"] > 0
    assert sum(o.num_cached_tokens for o in outs) >= 16 * 3  # the shared system prompt
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf_real_model.generate(ids, max_new_tokens=24, do_sample=False,
                                         eos_token_id=sorted(real_llm.llm_engine.eos_token_ids))
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    assert state["num_free_blocks"] == 8
