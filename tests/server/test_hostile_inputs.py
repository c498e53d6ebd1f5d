"""Hostile requests that cost the server time: a slow chat template from a trusted client, a
prompt of megabytes, a long /tokenize. Each must be answered (or refused) without holding up
the event loop: `/health` keeps answering within a second meanwhile. One server, started with
--trust-request-chat-template (the refusals without it are in `bad_requests`, run against the
main server test's). Oracles: the tokenizer itself and the clock."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.server.openai_server import ServerProcess, http, while_polling_health

MAX_MODEL_LEN = 256
JSON = {"Content-Type": "application/json"}
# 360,000 sandboxed assignments: seconds of pure-Python rendering, to the message alone.
SLOW_TEMPLATE = ("{% set ns = namespace(n=0) %}{% for i in range(600) %}"
                 "{% for j in range(600) %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}"
                 "{{ messages[0]['content'] }}")


@pytest.fixture(scope="module")
def tokenizer():
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_qwen2_path()))


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    srv = ServerProcess(["tiny-qwen2", "--max-model-len", str(MAX_MODEL_LEN),
                         "--max-num-seqs", "8", "--num-kv-blocks", "256", "--no-show-progress",
                         "--trust-request-chat-template"],
                        tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def test_health_answers_while_a_trusted_template_renders(server, tokenizer):
    body = {"messages": [{"role": "user", "content": "the answer is"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}}
    start = time.monotonic()
    (status, raw), latencies = while_polling_health(
        server, lambda: http("POST", server.url + "/v1/chat/completions", body, JSON))
    elapsed = time.monotonic() - start
    assert status == 200, raw[:300]
    # The template rendered (to the message alone) and was used as the prompt.
    assert json.loads(raw)["usage"]["prompt_tokens"] == len(tokenizer.encode("the answer is"))
    assert elapsed > 1.0 and len(latencies) >= 5, (elapsed, latencies)
    assert max(latencies) < 1.0, latencies


def test_a_trusted_template_that_renders_megabytes_is_a_400(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{{ 'ab ' * 1000000 }}"}
    start = time.monotonic()
    status, raw = http("POST", server.url + "/v1/chat/completions", body, JSON)
    assert time.monotonic() - start < 5.0
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "messages", err
    assert "3000000 characters" in err["message"], err


def test_a_prompt_of_megabytes_is_refused_without_tokenizing(server):
    prompt = "\u4e2d\u6587 " * 580_000  # 3.9 MiB of UTF-8
    assert 3.8 * 2**20 < len(json.dumps({"prompt": prompt}, ensure_ascii=False).encode()) \
        < 4 * 2**20
    body = json.dumps({"prompt": prompt, "max_tokens": 2}, ensure_ascii=False).encode()
    start = time.monotonic()
    (status, raw), latencies = while_polling_health(
        server, lambda: http("POST", server.url + "/v1/completions", body, JSON))
    assert time.monotonic() - start < 1.5
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "prompt", err
    assert f"{len(prompt)} characters" in err["message"], err
    assert max(latencies) < 1.0, latencies


def test_a_long_tokenize_runs_beside_the_event_loop(server, tokenizer):
    prompt = "hello world, " * 250_000
    (status, raw), latencies = while_polling_health(
        server, lambda: http("POST", server.url + "/tokenize", {"prompt": prompt}, JSON))
    assert status == 200, raw[:300]
    assert json.loads(raw)["count"] == len(tokenizer.encode(prompt))
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


def test_a_render_past_the_timeout_is_a_400_naming_the_template(tokenizer, monkeypatch):
    from jaxllm.entrypoints.openai import serving_chat
    from jaxllm.entrypoints.openai.protocol import APIError, ChatMessage

    monkeypatch.setattr(serving_chat, "_RENDER_TIMEOUT_S", 0.2)
    engine = SimpleNamespace(tokenizer=tokenizer,
                             core_info=SimpleNamespace(max_model_len=MAX_MODEL_LEN))
    chat = serving_chat.OpenAIServingChat(engine, "m", trust_request_chat_template=True)
    messages = [ChatMessage(role="user", content="hi")]

    async def render(template: str) -> str:
        return await chat.apply_chat_template(messages, True, chat_template=template)

    assert asyncio.run(render("<{{ messages[0]['content'] }}>")) == "<hi>"
    start = time.monotonic()
    with pytest.raises(APIError) as e:
        asyncio.run(render(SLOW_TEMPLATE))
    assert time.monotonic() - start < 1.0
    assert e.value.status == 400 and e.value.param == "chat_template"
    assert "did not finish rendering in 0.2 s" in e.value.message


# --- in process: the checks themselves -------------------------------------------------------

# Text that tokenizes into few tokens per character, or shrinks under NFC: combining marks and
# Hangul jamo that compose, CJK, repeats of long vocabulary strings, whitespace runs.
_PIECES = ["a\u0323\u0302", "\u1100\u1161\u11a8", "\u03b1\u0313\u0342\u0345", "\u4e2d\u6587",
           "=" * 64, " " * 40, "-" * 100, "\n\n\n", "hello", "\ufdfa", "e\u0301"]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from(_PIECES) | st.text(max_size=30), max_size=60))
def test_the_prompt_character_bound_never_refuses_text_that_fits(tokenizer, pieces):
    """Sound: a text needs at least len(text) / (4 x longest) tokens, so one refused by the
    bound (longer than max_model_len x longest x 4 characters) cannot fit."""
    from jaxllm.engine.processor import max_prompt_chars

    text = "".join(pieces).encode("utf-8", "ignore").decode("utf-8")  # no lone surrogates
    longest = max_prompt_chars(tokenizer, 1) // 4
    assert len(tokenizer.encode(text)) * longest * 4 >= len(text)


def test_no_prompt_character_bound_where_it_would_not_hold(tokenizer):
    import copy

    from tokenizers import normalizers

    from jaxllm.engine.processor import max_prompt_chars

    assert max_prompt_chars(tokenizer, 10) == 10 * 4 * max(map(len, tokenizer.get_vocab()))
    # Stripping accents can delete any number of characters: no bound is sure.
    stripping = copy.deepcopy(tokenizer)
    stripping.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFD(), normalizers.StripAccents()])
    assert max_prompt_chars(stripping, 10) is None
    assert max_prompt_chars(SimpleNamespace(), 10) is None  # not a fast tokenizer


@pytest.mark.parametrize("key, ok", [
    ("0", True), ("5", True), ("151935", True), ("9223372036854775807", True),
    ("", False), (" 5 ", False), ("05", False), ("+5", False), ("-5", False), ("5.0", False),
    ("\u0661\u0662", False), ("\u00b2", False), ("9" * 20, False), ("9" * 5000, False),
])
def test_logit_bias_keys_are_canonical_ascii_integers(key, ok):
    from jaxllm.entrypoints.openai.protocol import APIError
    from jaxllm.entrypoints.openai.serving_engine import logit_bias_ids

    if ok:
        assert logit_bias_ids({key: 1.5}) == {int(key): 1.5}
    else:
        with pytest.raises(APIError) as e:
            logit_bias_ids({key: 1.5})
        assert e.value.status == 400 and e.value.param == "logit_bias"
