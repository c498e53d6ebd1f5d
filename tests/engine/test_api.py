"""The public API's shape: LLM / SamplingParams / RequestOutput, input forms and clear errors."""

from __future__ import annotations

import pytest

import jaxllm
from jaxllm import LLM, RequestOutput, SamplingParams
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
from tests.utils import kv_budget_kwargs, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, real_model_path):
    """A tiny random model with the real Qwen vocabulary and tokenizer (fast, text-capable)."""
    path = tmp_path_factory.mktemp("tiny_tok")
    tok = load_tokenizer(real_model_path)
    save_tiny_checkpoint(path, tied=True, vocab_size=151936)
    tok.save_pretrained(path)
    return LLM(model=str(path), max_model_len=128, **kv_budget_kwargs())


def test_public_names():
    assert {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput"} <= set(jaxllm.__all__)


def test_prompt_forms_and_order(tiny_llm):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = tiny_llm.tokenizer.encode("Hello world")
    single = tiny_llm.generate("Hello world", sp, use_tqdm=False)
    assert len(single) == 1 and isinstance(single[0], RequestOutput)
    outs = tiny_llm.generate(["a longer prompt than the others, by far", "Hello world",
                              {"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert [o.prompt for o in outs] == ["a longer prompt than the others, by far", "Hello world",
                                        None]
    assert outs[1].prompt_token_ids == ids == outs[2].prompt_token_ids
    # Same tokens, greedy: same continuation, whichever form and batch position.
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids \
        == single[0].outputs[0].token_ids
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and len(c.token_ids) == 5
        assert c.finish_reason == "length"
        assert c.text == tiny_llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert o.metrics.first_token_time >= o.metrics.arrival_time


def test_per_prompt_sampling_params(tiny_llm):
    outs = tiny_llm.generate(["x", "y"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                          SamplingParams(max_tokens=4, ignore_eos=True)],
                             use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="2 prompts but 3 sampling_params"):
        tiny_llm.generate(["x", "y"], [SamplingParams()] * 3)


def test_seeded_sampling_is_reproducible(tiny_llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    a = tiny_llm.generate("seeded", sp, use_tqdm=False)[0].outputs[0].token_ids
    b = tiny_llm.generate(["other prompt", "seeded"], sp, use_tqdm=False)[1].outputs[0].token_ids
    assert a == b


def test_stop_token_ids_end_generation(tiny_llm):
    free = tiny_llm.generate("count", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[2]
    out = tiny_llm.generate("count", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    stop_token_ids=[stop_at]),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:free.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string_cuts_text(tiny_llm):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = tiny_llm.generate("words", sp, use_tqdm=False)[0].outputs[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = tiny_llm.generate("words", SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:free.text.index(stop)]
    assert out.token_ids == free.token_ids[:len(out.token_ids)]


def test_chat_uses_template(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "hi"}],
                        SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids[-3:] == tiny_llm.tokenizer.encode("<|im_start|>assistant\n")


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [5, 151936]}, "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1] * 128}, "max_model_len"),
    (42, "must be a str or a dict"),
    ("a\ud800b", "lone UTF-16 surrogate.*at character 1"),
    ({"prompt": "\udfff"}, "lone UTF-16 surrogate"),
])
def test_bad_prompts_are_named(tiny_llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate(prompt, use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_chat_with_a_lone_surrogate_is_a_value_error(tiny_llm):
    with pytest.raises(ValueError, match="prompt 1: .*lone UTF-16 surrogate"):
        tiny_llm.chat([[{"role": "user", "content": "hi"}],
                       [{"role": "user", "content": "x\ud800"}]], use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("params, kind", [({"temperature": 0}, "dict"), (5, "int")])
def test_chat_names_sampling_params_of_the_wrong_type(tiny_llm, params, kind):
    with pytest.raises(TypeError, match=rf"sampling_params must be SamplingParams or a "
                                        rf"sequence of them, got {kind}"):
        tiny_llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("params, match", [
    (SamplingParams(stop=["ok", "\ud800"]), r"SamplingParams\.stop .*surrogate"),
    (SamplingParams(stop_token_ids=[151936]), r"SamplingParams\.stop_token_ids .*151936"),
    (SamplingParams(logit_bias={151936: 1.0}), r"SamplingParams\.logit_bias .*151936"),
])
def test_bad_params_are_named(tiny_llm, params, match):
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate("hi", params, use_tqdm=False)


def test_text_that_cannot_fit_is_refused_before_tokenizing(tiny_llm, monkeypatch):
    """Byte-level BPE: no token covers more characters than its vocabulary string has symbols,
    and NFC shrinks text at most 4-fold, so a text over 4 x max_model_len x the longest symbol
    string cannot fit; one at the bound is tokenized as before."""
    processor = tiny_llm.llm_engine.processor
    longest = max(len(t) for t in tiny_llm.tokenizer.get_vocab())
    limit = 128 * longest * 4
    assert processor.max_prompt_chars == limit
    calls = []
    encode = processor.tokenizer.encode
    monkeypatch.setattr(processor.tokenizer, "encode",
                        lambda text, *a, **k: calls.append(len(text)) or encode(text, *a, **k))
    with pytest.raises(ValueError, match=f"{limit + 1} characters.*max_model_len"):
        tiny_llm.generate("ab" * (limit // 2) + "c", use_tqdm=False)
    assert calls == []
    with pytest.raises(ValueError, match="tokens; max_model_len is 128"):
        tiny_llm.generate("ab" * (limit // 2), use_tqdm=False)
    assert calls == [limit]


def test_bad_engine_args(tiny_models):
    path = str(tiny_models["tied"][0])
    with pytest.raises(TypeError, match="unknown engine argument.*max_num_sequences"):
        LLM(model=path, max_num_sequences=3)
    with pytest.raises(ValueError, match="kernel_backend 'triton'"):
        LLM(model=path, kernel_backend="triton")
    with pytest.raises(ValueError, match="dtype 'float64'"):
        LLM(model=path, dtype="float64")


def test_text_prompt_without_tokenizer(tiny_models):
    llm = LLM(model=str(tiny_models["tied"][0]), skip_tokenizer_init=True, **kv_budget_kwargs())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate("text", use_tqdm=False)
