"""`jaxllm serve` through the official `openai` client, against one server this module starts
(loopback, a free port). The model is `tiny-qwen2`: random 2-layer weights, but the embedded
model's real tokenizer, vocabulary and chat template, so chat completions run the model's own
template at a fraction of the real model's cost. Oracles: the same request without streaming,
the in-process `LLM` on the same checkpoint, the tokenizer itself, and the responses' own usage
(for /metrics)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from http.client import HTTPConnection

import openai
import pytest

from tests.server.openai_server import bad_requests, http, metric, serve_tiny, stream_text

KEY = "test-key-123"
MAX_MODEL_LEN = 256
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time",
           "import numpy as np\n", "SELECT * FROM users WHERE", "Hello, my name is"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # SIGTERM ends it cleanly (exit 0) even after the engine-kill test below.
    yield from serve_tiny(tmp_path_factory.mktemp("serve"), MAX_MODEL_LEN, "--max-num-seqs", "32",
                          "--max-num-batched-tokens", "256", "--num-kv-blocks", "2048",
                          "--api-key", KEY, "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                      max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(tiny_path)


# --- basics ---------------------------------------------------------------------------------


def test_models_health_version_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-qwen2"]
    # Open routes need no key.
    assert http("GET", server.url + "/health")[0] == 200
    status, body = http("GET", server.url + "/version")
    assert status == 200 and b"version" in body
    assert http("GET", server.url + "/metrics")[0] == 200
    # /v1 routes do: missing and wrong keys are 401 with OpenAI's error body.
    status, body = http("GET", server.url + "/v1/models")
    assert status == 401 and b'"AuthenticationError"' in body
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny-qwen2", prompt="hi", max_tokens=2)
    # ... and the server still serves.
    assert client.completions.create(model="tiny-qwen2", prompt="hi", max_tokens=2,
                                     temperature=0).usage.completion_tokens == 2


def test_embeddings_refused_on_generate_runner(server, client):
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model="tiny-qwen2", input="hi")
    assert client.completions.create(model="tiny-qwen2", prompt="hi", max_tokens=2,
                                     temperature=0).usage.completion_tokens == 2


def test_completion_matches_offline_llm(client, tiny_path, tokenizer):
    from jaxllm import LLM, SamplingParams

    llm = LLM(tiny_path, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
              max_num_batched_tokens=32, num_kv_blocks=64, show_progress=False,
              multiprocess_mode=False)
    try:
        want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12,
                                                         logprobs=2), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    got = client.completions.create(model="tiny-qwen2", prompt=PROMPTS[0], max_tokens=12,
                                    temperature=0, logprobs=2)
    c = got.choices[0]
    assert c.text == want.outputs[0].text
    assert c.finish_reason == "length"
    assert got.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]))
    assert got.usage.completion_tokens == 12
    # Logprobs: the in-process engine's values, the legacy layout.
    wl = want.outputs[0].logprobs
    for i, tid in enumerate(want.outputs[0].token_ids):
        assert c.logprobs.token_logprobs[i] == pytest.approx(wl[i][tid].logprob, abs=1e-4)
        assert len(c.logprobs.top_logprobs[i]) >= 1
    assert "".join(c.logprobs.tokens) == c.text
    offsets = [len("".join(c.logprobs.tokens[:i])) for i in range(len(c.logprobs.tokens))]
    assert c.logprobs.text_offset == offsets
    # Token-id prompts give the same completion as the text they encode.
    ids = client.completions.create(model="tiny-qwen2", prompt=tokenizer.encode(PROMPTS[0]),
                                    max_tokens=12, temperature=0)
    assert ids.choices[0].text == want.outputs[0].text


def test_stream_equals_non_stream(client):
    kw = dict(model="tiny-qwen2", prompt=PROMPTS[1:3], max_tokens=10, temperature=0)
    full = client.completions.create(**kw)
    texts, reasons, usage = stream_text(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert usage.model_dump() == full.usage.model_dump()

    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model="tiny-qwen2", messages=msgs, temperature=0,
                                          max_completion_tokens=8)
    chunks = list(client.chat.completions.create(
        model="tiny-qwen2", messages=msgs, temperature=0, max_completion_tokens=8,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] \
        == chat.choices[0].finish_reason == "length"
    assert chunks[-1].usage.model_dump() == chat.usage.model_dump()


def test_chat_uses_the_models_template(client, tokenizer):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    chat = client.chat.completions.create(model="tiny-qwen2", messages=msgs, temperature=0,
                                          max_tokens=6)
    comp = client.completions.create(model="tiny-qwen2", prompt=text, temperature=0,
                                     max_tokens=6)
    assert chat.usage.prompt_tokens == len(tokenizer.encode(text))
    assert chat.choices[0].message.content == comp.choices[0].text


def test_32_concurrent_streams_match_non_streamed(aclient_factory):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]

    async def run() -> tuple[list[str], list[str]]:
        client = aclient_factory()
        kw = dict(model="tiny-qwen2", max_tokens=16, temperature=0)
        want = [(await client.completions.create(prompt=p, **kw)).choices[0].text
                for p in prompts]

        async def one(p: str) -> str:
            out = ""
            async for chunk in await client.completions.create(prompt=p, stream=True, **kw):
                out += "".join(c.text for c in chunk.choices)
            return out

        got = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 180)
        await client.close()
        return want, list(got)

    want, got = asyncio.run(run())
    assert got == want


# --- parameters -----------------------------------------------------------------------------


def test_stop_string(client):
    kw = dict(model="tiny-qwen2", prompt=PROMPTS[2], max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop
    out = client.completions.create(**kw, stop=[stop]).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(stop)]


def test_n_and_seed(client):
    kw = dict(model="tiny-qwen2", max_tokens=6, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(prompt=PROMPTS[:2], **kw)
    assert [c.index for c in a.choices] == list(range(6))
    b = client.completions.create(prompt=PROMPTS[:2], **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    # Prompt 1's choices are those of the same request with prompt 1 alone.
    alone = client.completions.create(prompt=PROMPTS[1], **kw)
    assert [c.text for c in alone.choices] == [c.text for c in a.choices[3:]]
    other = client.completions.create(prompt=PROMPTS[:2], **{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    assert a.usage.completion_tokens == 36


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="tiny-qwen2", messages=[{"role": "user", "content": "hi"}], temperature=0,
        max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert bytes(t.bytes) == t.token.encode()
        assert len(t.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True)


def test_partial_utf8_tokens_are_bytes_strings(tokenizer):
    from jaxllm.entrypoints.openai.serving_engine import token_text_and_bytes

    text = "你好世界 🤖 émoji ✓"
    added = set(tokenizer.added_tokens_decoder)
    infos = [token_text_and_bytes(tokenizer, t, added) for t in tokenizer.encode(text)]
    # The raw bytes of the tokens are the text's UTF-8, whatever the split.
    assert b"".join(raw for _, raw in infos) == text.encode()
    partial = [(s, raw) for s, raw in infos if s.startswith("bytes:")]
    assert partial  # the emoji is split over tokens
    for s, raw in partial:
        assert s == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        with pytest.raises(UnicodeDecodeError):
            raw.decode()


def test_text_offsets_are_the_decoded_prefix_lengths(tokenizer):
    """The legacy logprobs' text_offset of each token is len(decode(the tokens before it)),
    partial characters (U+FFFD), special tokens and ids past the tokenizer included, fed in
    chunks as a stream feeds them."""
    import random

    from jaxllm.entrypoints.openai.serving_completion import CompletionLogprobs
    from jaxllm.entrypoints.openai.serving_engine import token_text_and_bytes

    added = set(tokenizer.added_tokens_decoder)
    serving = type("Serving", (), {"token_info": staticmethod(
        lambda t: token_text_and_bytes(tokenizer, t, added))})()
    rng = random.Random(0)
    seqs = [tokenizer.encode("héllo 世界 🤖 <|im_start|>user\nx<|im_end|>\t ✓")]
    seqs += [[rng.randrange(151936) for _ in range(40)] for _ in range(8)]
    for ids in seqs:
        lp = CompletionLogprobs(serving, 0)  # type: ignore[arg-type]
        out = None
        i = 0
        while i < len(ids):
            k = rng.randint(1, 5)
            out = lp.add(ids[i:i + k], [None] * len(ids[i:i + k]), out)
            i += k
        assert out is not None
        assert out["text_offset"] == [len(tokenizer.decode(ids[:j])) for j in range(len(ids))]


def test_penalties_bias_and_min_tokens(client, tokenizer):
    base = dict(model="tiny-qwen2", prompt=PROMPTS[3], max_tokens=8, temperature=0)
    plain = client.completions.create(**base)
    first = tokenizer.encode(plain.choices[0].text)[0]
    # A strong bias against the greedy first token changes it; one for a token forces it.
    banned = client.completions.create(**base, logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].text)[0] != first
    forced = client.completions.create(**base, logit_bias={"9707": 100})
    assert forced.choices[0].text == tokenizer.decode([9707] * 8)
    eos = tokenizer.eos_token_id
    stop_now = client.completions.create(**base, logit_bias={str(eos): 100})
    assert stop_now.usage.completion_tokens == 1
    held = client.completions.create(**base, logit_bias={str(eos): 100},
                                     extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 5
    assert client.completions.create(**base, logit_bias={str(eos): 100},
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 8
    rep = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0,
                                    extra_body={"repetition_penalty": 1.5, "top_k": 5,
                                                "min_p": 0.0, "top_p": 0.9})
    assert rep.usage.completion_tokens == 8
    assert rep.choices[0].text != plain.choices[0].text


def test_allowed_token_ids_bad_words_and_truncation(client, tokenizer):
    """vLLM's extra sampling fields, on completions and chat completions."""
    base = dict(model="tiny-qwen2", max_tokens=6, temperature=0)
    word = tokenizer.decode([9707])
    assert tokenizer.encode(word, add_special_tokens=False) == [9707]
    # Two tokens allowed, one of them a bad word: only the other is left, EOS included.
    other = tokenizer.encode(" x", add_special_tokens=False)[0]
    extra = {"allowed_token_ids": [9707, other], "bad_words": [word]}
    out = client.completions.create(**base, prompt=PROMPTS[0], extra_body=extra)
    assert out.choices[0].text == tokenizer.decode([other] * 6)
    chat = client.chat.completions.create(
        **base, messages=[{"role": "user", "content": "hi"}],
        extra_body={"allowed_token_ids": [9707]})
    assert chat.choices[0].message.content == word * 6
    # Truncation keeps the prompt's last tokens, before the length check.
    ids = (tokenizer.encode(PROMPTS[3]) * 60)[:MAX_MODEL_LEN + 50]
    cut = client.completions.create(**base, prompt=ids, extra_body={"truncate_prompt_tokens": 10})
    direct = client.completions.create(**base, prompt=ids[-10:])
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == direct.choices[0].text
    chat = client.chat.completions.create(
        **base, messages=[{"role": "user", "content": "hello " * 300}],
        extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7


def test_beam_search_matches_offline_llm(client, tiny_path, tokenizer):
    """vLLM's use_beam_search: n beams, the offline LLM.beam_search's, on completions (streamed
    or not) and on chat; what the search would ignore is a 400 naming it."""
    from jaxllm import LLM, BeamSearchParams

    prompt_ids = tokenizer.encode(PROMPTS[1])
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    llm = LLM(tiny_path, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
              max_num_batched_tokens=64, num_kv_blocks=128, show_progress=False,
              multiprocess_mode=False)
    try:
        params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
        want, want_chat = llm.beam_search([{"prompt_token_ids": prompt_ids},
                                           {"prompt_token_ids": chat_ids}], params)
    finally:
        llm.shutdown()
    extra = {"use_beam_search": True, "length_penalty": 0.5}
    got = client.completions.create(model="tiny-qwen2", prompt=PROMPTS[1], n=3, max_tokens=6,
                                    logprobs=1, extra_body=extra)
    assert [c.text for c in got.choices] == \
        [tokenizer.decode(s.tokens[len(prompt_ids):]) for s in want.sequences]
    for c, s in zip(got.choices, want.sequences, strict=True):
        assert c.finish_reason == s.finish_reason
        assert sum(c.logprobs.token_logprobs) == pytest.approx(s.cum_logprob, abs=1e-3)
    assert got.usage.completion_tokens == sum(len(s.tokens) - len(prompt_ids)
                                              for s in want.sequences)
    # What OpenAI clients send by default asks for nothing the search would ignore.
    neutral = client.completions.create(
        model="tiny-qwen2", prompt=PROMPTS[1], n=3, max_tokens=6, top_p=1, presence_penalty=0,
        frequency_penalty=0, extra_body={**extra, "top_k": -1, "repetition_penalty": 1,
                                         "min_p": 0, "stop": []})
    assert [c.text for c in neutral.choices] == [c.text for c in got.choices]
    streamed = client.completions.create(model="tiny-qwen2", prompt=PROMPTS[1], n=3,
                                         max_tokens=6, stream=True, extra_body=extra)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in got.choices]
    chat = client.chat.completions.create(model="tiny-qwen2", n=3, max_tokens=6,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body=extra)
    assert [c.message.content for c in chat.choices] == \
        [tokenizer.decode(s.tokens[len(chat_ids):], skip_special_tokens=True)
         for s in want_chat.sequences]
    base = dict(model="tiny-qwen2", prompt=PROMPTS[1], max_tokens=4)
    for extra_fields, param in [({"use_beam_search": True, "stop": ["x"]}, "stop"),
                                ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
                                ({"use_beam_search": True, "n": 11}, "n"),
                                ({"use_beam_search": True, "guided_regex": "a+"}, "guided_regex"),
                                ({"use_beam_search": True, "echo": True, "logprobs": 1},
                                 "echo"),
                                ({"length_penalty": 2.0}, "length_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**base, extra_body=extra_fields)
        assert e.value.body["param"] == param, (extra_fields, e.value.body)


def test_reasoning_is_split_from_the_content(client, tokenizer):
    """--reasoning-parser qwen3: an answer that opens a think block (forced here by a regex)
    comes back as reasoning_content and content, streamed or not, as the raw completion of the
    same prompt splits; an answer without one is all content."""
    messages = [{"role": "user", "content": "think first"}]
    regex = r"<think>[a-z ]{3,12}</think>\n\n[a-z ]{3,12}"
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # Qwen's tokenizer adds no BOS: the completion's prompt ids are the chat's.
    raw = client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=60,
                                    temperature=0,
                                    extra_body={"guided_regex": regex}).choices[0].text
    assert raw.startswith("<think>") and "</think>" in raw, raw
    thought, _, answer = raw[len("<think>"):].partition("</think>")
    answer = answer.lstrip("\n")
    chat = client.chat.completions.create(model="tiny-qwen2", messages=messages, max_tokens=60,
                                          temperature=0, extra_body={"guided_regex": regex})
    message = chat.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == thought
    assert message.content == answer
    stream = client.chat.completions.create(model="tiny-qwen2", messages=messages,
                                            max_tokens=60, temperature=0, stream=True,
                                            extra_body={"guided_regex": regex})
    parts = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        for c in chunk.choices:
            delta = c.delta.model_dump()
            for key in parts:
                parts[key] += delta.get(key) or ""
    assert parts == {"reasoning_content": thought, "content": answer}
    plain = client.chat.completions.create(model="tiny-qwen2", messages=messages, max_tokens=8,
                                           temperature=0)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    assert plain.choices[0].message.content


# --- bad requests ---------------------------------------------------------------------------


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client, tokenizer):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for what, path, body, status, param in bad_requests(MAX_MODEL_LEN):
        got, raw = http("POST", server.url + path, body, auth)
        assert got == status, (what, raw[:300])
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, what
        assert err["code"] == status and err["message"], what
        if param is not None:
            assert err["param"] == param, (what, err)
    # A chunked 10 MB body is counted too.
    conn = HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    for k, v in {**auth, "Transfer-Encoding": "chunked"}.items():
        conn.putheader(k, v)
    conn.endheaders()
    piece = b"a" * (1 << 20)
    for _ in range(10):
        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    conn.send(b"0\r\n\r\n")
    assert conn.getresponse().status == 413
    conn.close()
    # Nothing leaked, and the next request is served.
    out = client.completions.create(model="tiny-qwen2", prompt="hi", max_tokens=3,
                                    temperature=0)
    assert out.usage.completion_tokens == 3
    assert metric(server, "jaxllm:kv_cache_usage_perc") == 0.0


def test_dropped_stream_frees_its_blocks(server, client):
    aborts = metric(server, "jaxllm:request_success_total", 'finished_reason="abort"')
    # 16 sequences of 240 tokens: still running when the client goes away (the "abort"
    # finish reason, not "length", is the proof).
    stream = client.completions.create(model="tiny-qwen2", prompt=PROMPTS[0], n=16, seed=0,
                                       max_tokens=240, temperature=1.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    _wait_aborted_and_freed(server, aborts, time.monotonic() + 20, "the dropped stream's request")


def _wait_aborted_and_freed(server, aborts_before: float, deadline: float, what: str) -> None:
    """Until the abort counter moves past `aborts_before` and the KV pool is empty again."""
    while metric(server, "jaxllm:request_success_total",
                 'finished_reason="abort"') == aborts_before:
        assert time.monotonic() < deadline, f"{what} was not aborted"
        time.sleep(0.05)
    while metric(server, "jaxllm:kv_cache_usage_perc") != 0.0:
        assert time.monotonic() < deadline, f"{what}'s blocks were not freed"
        time.sleep(0.05)


def test_disconnected_non_streaming_request_is_aborted(server):
    aborts = metric(server, "jaxllm:request_success_total", 'finished_reason="abort"')
    # 16 sequences of 240 tokens: long enough to still be running when the client goes away
    # (the "abort" finish reason, not "length", is the proof).
    body = {"model": "tiny-qwen2", "prompt": PROMPTS[1], "max_tokens": 240, "n": 16,
            "temperature": 1.0, "seed": 0, "ignore_eos": True}
    conn = HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    deadline = time.monotonic() + 20
    while metric(server, "jaxllm:kv_cache_usage_perc") == 0.0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away without reading the answer
    conn.close()
    _wait_aborted_and_freed(server, aborts, deadline, "the abandoned request")


def test_metrics_count_exactly_the_tokens_served(server, client):
    names = ("jaxllm:prompt_tokens_total", "jaxllm:generation_tokens_total",
             "jaxllm:request_success_total", "jaxllm:time_to_first_token_seconds_count",
             "jaxllm:e2e_request_latency_seconds_count")
    before = {n: metric(server, n) for n in names}
    usages = [client.completions.create(model="tiny-qwen2", prompt=PROMPTS[4], max_tokens=7,
                                        temperature=0, n=1).usage,
              client.chat.completions.create(model="tiny-qwen2", max_tokens=5, temperature=0,
                                             messages=[{"role": "user", "content": "x"}]).usage]
    *_, usage = stream_text(client.completions.create(
        model="tiny-qwen2", prompt=PROMPTS[5], max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usages.append(usage)
    after = {n: metric(server, n) for n in names}
    assert after[names[0]] - before[names[0]] == sum(u.prompt_tokens for u in usages)
    assert after[names[1]] - before[names[1]] == sum(u.completion_tokens for u in usages) == 21
    for n in names[2:]:
        assert after[n] - before[n] == 3, n
    assert metric(server, "jaxllm:num_requests_running") == 0
    assert metric(server, "jaxllm:prefix_cache_queries_total") > 0
    assert metric(server, "jaxllm:num_engines_alive") == 1


def test_n_siblings_hit_the_prefix_cache(server, client):
    """The n sequences of one request: the first computes the prompt, the others wait for it
    and then find its full blocks in the prefix cache instead of computing them again."""
    # 70 fresh tokens: each sibling finds the 4 full blocks of 16 before the last token.
    prompt = [1000 + 7 * i for i in range(70)]
    names = ("jaxllm:prefix_cache_hits_total", "jaxllm:prefix_cache_queries_total")
    before = {n: metric(server, n) for n in names}
    out = client.completions.create(model="tiny-qwen2", prompt=prompt, n=4, max_tokens=3,
                                    temperature=1.0, seed=3)
    assert len(out.choices) == 4 and out.usage.prompt_tokens == 70
    after = {n: metric(server, n) for n in names}
    assert after[names[1]] - before[names[1]] == 4 * 70
    assert after[names[0]] - before[names[0]] == 3 * 64


def test_tokenize_detokenize(server, tokenizer):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, body = http("POST", server.url + "/tokenize", {"prompt": PROMPTS[0]}, auth)
    assert status == 200
    out = json.loads(body)
    assert out["tokens"] == tokenizer.encode(PROMPTS[0])
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    status, body = http("POST", server.url + "/detokenize", {"tokens": out["tokens"]}, auth)
    assert status == 200 and json.loads(body)["prompt"] == PROMPTS[0]
    msgs = [{"role": "user", "content": "hi"}]
    status, body = http("POST", server.url + "/tokenize", {"messages": msgs}, auth)
    assert json.loads(body)["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True))
    assert http("POST", server.url + "/detokenize", {"tokens": [-1]}, auth)[0] == 400


def test_bench_serve_against_the_server(server, tmp_path):
    """`jaxllm bench serve` counts exactly what the server generated (random prompts,
    ignore_eos: every request produces its full output length)."""
    from jaxllm.entrypoints.cli.main import main

    out = tmp_path / "bench.json"
    before = metric(server, "jaxllm:generation_tokens_total")
    assert main(["bench", "serve", "--port", str(server.port), "--api-key", KEY,
                 "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "5",
                 "--request-rate", "50", "--max-concurrency", "3", "--disable-tqdm",
                 "--output-json", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["completed"] == 6 and m["failed"] == 0
    assert m["total_input_tokens"] == 6 * 12 and m["total_output_tokens"] == 6 * 5
    assert metric(server, "jaxllm:generation_tokens_total") - before == 30
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert m["p99_tpot_ms"] > 0 and m["median_itl_ms"] > 0


def test_bench_serve_sharegpt_workload(tmp_path, tokenizer):
    import argparse

    from jaxllm.benchmarks.serve import build_workload

    recs = [{"conversations": [{"from": "human", "value": "Write a haiku"},
                               {"from": "gpt", "value": "Autumn moon rises"}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},  # skipped
            {"prompt": "def f(x):", "output_len": 7}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(recs))
    args = argparse.Namespace(num_prompts=10, seed=0, dataset_name="sharegpt",
                              dataset_path=str(path), sharegpt_output_len=None,
                              endpoint="/v1/completions")
    w = build_workload(args, tokenizer)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in w] == [
        ("Write a haiku", len(tokenizer.encode("Write a haiku")),
         len(tokenizer.encode("Autumn moon rises"))),
        ("def f(x):", len(tokenizer.encode("def f(x):")), 7)]


# --- last: the engine process dies ----------------------------------------------------------


def test_engine_death_gives_5xx_not_a_hang(server, client):
    results: dict[str, object] = {}
    streaming = threading.Event()
    # 8 x 240 tokens each: still running when the core is killed.
    kw = dict(model="tiny-qwen2", prompt=PROMPTS[0], max_tokens=240, temperature=1.0, n=8,
              seed=0, extra_body={"ignore_eos": True})

    def long_request() -> None:
        try:
            results["out"] = client.completions.create(**kw)
        except Exception as e:  # noqa: BLE001 - the error is what we check
            results["err"] = e

    def long_stream() -> None:
        try:
            for _ in client.completions.create(**kw, stream=True):
                streaming.set()
            results["stream_out"] = True
        except Exception as e:  # noqa: BLE001 - the error is what we check
            results["stream_err"] = e
        streaming.set()

    threads = [threading.Thread(target=long_request), threading.Thread(target=long_stream)]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    os.kill(server.core_pid(), signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "an in-flight request hung"
    if "err" in results:  # it may have finished just before the kill
        assert isinstance(results["err"], openai.APIStatusError)
        assert results["err"].status_code in (500, 503)
    # The stream was mid-way (240 tokens): it ends with the error event, not silently.
    assert "stream_out" not in results
    assert isinstance(results["stream_err"], openai.APIError)
    assert "engine" in str(results["stream_err"])
    deadline = time.monotonic() + 20
    while http("GET", server.url + "/health")[0] != 503:
        assert time.monotonic() < deadline, "/health did not turn 503"
        time.sleep(0.1)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny-qwen2", prompt="hi", max_tokens=2)
    assert e.value.status_code == 503 and "engine" in str(e.value)
    # Streaming requests fail the same way, before any event.
    with pytest.raises(openai.APIStatusError):
        list(client.completions.create(model="tiny-qwen2", prompt="hi", max_tokens=2,
                                       stream=True))
    # Every route that needs the engine says it is dead; the request gauges do not keep the
    # values of its last step.
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in (("GET", "/v1/models", None),
                               ("POST", "/tokenize", {"prompt": "hi"}),
                               ("POST", "/detokenize", {"tokens": [1]})):
        status, raw = http(method, server.url + path, body, auth)
        assert status == 503 and json.loads(raw)["error"]["type"] == "EngineDeadError", path
    for name in ("jaxllm:num_requests_running", "jaxllm:num_requests_waiting",
                 "jaxllm:kv_cache_usage_perc", "jaxllm:num_engines_alive"):
        assert metric(server, name) == 0, name
