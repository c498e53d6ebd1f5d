"""`jaxllm serve tiny-qwen2 --speculative-config ...`: completions with n-gram speculation equal
the in-process engine's without it (the oracle), streamed or not, with a stop string or not,
and /metrics counts the drafts the server verified and accepted."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.openai_server import metric, serve_tiny

MAX_MODEL_LEN = 128
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPTS = ["Repeat after me: one two three, one two three, one two three,",
           "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory.mktemp("serve_spec"), MAX_MODEL_LEN,
                          "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
                          "--num-kv-blocks", "64", "--speculative-config", json.dumps(SPEC))


@pytest.fixture(scope="module")
def spec_off(tiny_path):
    from jaxllm import LLM, SamplingParams

    llm = LLM(tiny_path, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
              max_num_batched_tokens=32, num_kv_blocks=64, show_progress=False,
              multiprocess_mode=False)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True), use_tqdm=False)
        # A stop string that the sixth token completes: with drafts it may arrive in the
        # middle of a step's tokens.
        tokenizer = llm.get_tokenizer()
        stops = [o.outputs[0].text[1:len(tokenizer.decode(o.outputs[0].token_ids[:6]))]
                 for o in outs]
        stopped = [llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                                       ignore_eos=True, stop=[stop]),
                                use_tqdm=False)[0]
                   for prompt, stop in zip(PROMPTS, stops, strict=True)]
    finally:
        llm.shutdown()
    return [(o.outputs[0], stop, s.outputs[0])
            for o, stop, s in zip(outs, stops, stopped, strict=True)]


def test_completions_equal_spec_off_and_metrics_count_drafts(server, spec_off):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    name = "jaxllm:spec_decode_num_draft_tokens_total"
    accepted = "jaxllm:spec_decode_num_accepted_tokens_total"
    assert metric(server, name) == 0
    for prompt, (want, stop, want_stopped) in zip(PROMPTS, spec_off, strict=True):
        kw = dict(model="tiny-qwen2", prompt=prompt, max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
        got = client.completions.create(**kw)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == len(want.token_ids)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw,
                                                                                  stream=True)
                           if c.choices)
        assert streamed == want.text
        assert want_stopped.finish_reason == "stop"
        got = client.completions.create(**kw, stop=[stop])
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want_stopped.text, "stop")
        assert got.usage.completion_tokens == len(want_stopped.token_ids)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            **kw, stop=[stop], stream=True) if c.choices)
        assert streamed == want_stopped.text
    drafts = metric(server, name)
    assert drafts > 0
    assert 0 < metric(server, accepted) <= drafts
    assert metric(server, "jaxllm:spec_decode_num_drafts_total") > 0


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"', "speculative_config is not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens must be an integer >= 1"),
])
def test_serve_refuses_a_bad_speculative_config(value, message, capsys):
    from jaxllm.entrypoints.cli.main import main

    assert main(["serve", "tiny-qwen2", "--speculative-config", value]) == 2
    assert message in capsys.readouterr().err
