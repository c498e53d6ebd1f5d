"""Structured outputs and tool calling through `jaxllm serve` and the official `openai` client,
against one tiny-qwen2 server started with `--structured-outputs-config
'{"disable_any_whitespace": true}'` (random weights wander in JSON whitespace otherwise; the
schemas are bounded for the same reason). Oracles: `jsonschema` validation, Python's `re`, the
tokenizer's own chat template, the non-streamed answer for the streamed one, and the in-process
`LLM`'s prompt logprobs for echo."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.openai_server import ServerProcess, http

MAX_MODEL_LEN = 1024
MODEL = "tiny-qwen2"

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {
        "tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_path():
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    return str(tiny_qwen2_path())


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    srv = ServerProcess([MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64",
                         "--max-num-batched-tokens", "512", "--num-kv-blocks", "2048",
                         "--no-show-progress",
                         "--structured-outputs-config", '{"disable_any_whitespace": true}'],
                        tmp_path_factory.mktemp("serve-so") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(tiny_path)


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, **{"max_tokens": 120, **kw})


# --- JSON ------------------------------------------------------------------------------------


def test_response_format_json_schema_on_chat_and_completions(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        chat = _chat(client, messages=[{"role": "user", "content": "A person, please."}],
                     response_format=rf, **kw)
        c = chat.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
        comp = client.completions.create(model=MODEL, prompt="Person:", max_tokens=120,
                                         extra_body={"response_format": rf}, **kw)
        assert comp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(comp.choices[0].text), PERSON)
    # The constraint changes the answer: unconstrained, the random model writes no JSON.
    free = _chat(client, messages=[{"role": "user", "content": "A person, please."}],
                 temperature=0, max_tokens=30).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)


def test_response_format_json_object(client):
    for endpoint in ("chat", "completions"):
        if endpoint == "chat":
            text = _chat(client, messages=ASK, temperature=0, max_tokens=200,
                         response_format={"type": "json_object"}).choices[0].message.content
        else:
            text = client.completions.create(model=MODEL, prompt="{", max_tokens=200,
                                             temperature=0, seed=3, extra_body={
                                                 "response_format": {"type": "json_object"}}
                                             ).choices[0].text
        # A random model may not close the object within max_tokens, but what it wrote is
        # an object's beginning: a brace, then no whitespace (the server's default) but a key
        # or the closing brace.
        assert text.startswith("{") and text[1:2] in ('"', "}"), text
        if text.endswith("}"):
            assert isinstance(json.loads(text), dict)


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


def test_openai_client_parse(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe someone."}],
        response_format=Person, temperature=0, max_tokens=120)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert parsed == Person.model_validate_json(out.choices[0].message.content)


def test_structured_outputs_and_guided_fields(client):
    prompt = "Answer:"
    base = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=1.0, seed=11)

    def text(**extra):
        c = client.completions.create(**base, extra_body=extra).choices[0]
        assert c.finish_reason == "stop", (extra, c.text)
        return c.text

    pattern = r"[a-z]{3}-[0-9]{2,4}"
    assert re.fullmatch(pattern, text(structured_outputs={"regex": pattern}))
    assert re.fullmatch(pattern, text(guided_regex=pattern))
    choices = ["alpha", "beta", "gamma delta"]
    assert text(guided_choice=choices) in choices
    assert text(structured_outputs={"choice": choices}) in choices
    grammar = 'start: "yes" | "no" | NUM "!"\nNUM: /[0-9]{1,3}/'
    assert re.fullmatch(r"yes|no|[0-9]{1,3}!", text(guided_grammar=grammar))
    gbnf = 'root ::= "x" [0-9] [0-9]'
    assert re.fullmatch(r"x[0-9]{2}", text(guided_grammar=gbnf))
    jsonschema.validate(json.loads(text(guided_json=PERSON)), PERSON)
    jsonschema.validate(json.loads(text(guided_json=json.dumps(PERSON))), PERSON)
    jsonschema.validate(json.loads(text(structured_outputs={"json": PERSON})), PERSON)
    # A whitespace pattern (here: at most one space between JSON tokens) goes with the schema.
    spaced = text(guided_json=PERSON, guided_whitespace_pattern=" ")
    jsonschema.validate(json.loads(spaced), PERSON)


def test_a_stop_string_inside_the_constrained_answer_is_the_stop_reason(client):
    out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=8,
                                    extra_body={"guided_choice": ["yes"], "stop": ["y"]})
    c = out.choices[0]
    assert (c.text, c.finish_reason, c.model_extra.get("stop_reason")) == ("", "stop", "y")


def test_invalid_constraints_name_the_field(server):
    c, ch = server.url + "/v1/completions", server.url + "/v1/chat/completions"
    cases = [
        (c, {"prompt": "x", "guided_json": {"type": "object", "properties": {"a": {
            "type": "strnig"}}}}, "guided_json", "strnig"),
        (c, {"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex", "regex"),
        (c, {"prompt": "x", "structured_outputs": {"json": "{not json"}},
         "structured_outputs", "json"),
        (ch, {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "minProperties": "two"}}}},
         "response_format", "response_format"),
    ]
    for url, body, param, word in cases:
        status, raw = http("POST", url, {"model": MODEL, **body})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == param, (body, err)
        assert word in err["message"], err


def test_structured_outputs_config_flag():
    from jaxllm.entrypoints.openai.serving_engine import StructuredOutputsConfig

    assert StructuredOutputsConfig.from_json('{"disable_any_whitespace": true}') \
        == StructuredOutputsConfig(disable_any_whitespace=True)
    assert StructuredOutputsConfig.from_json("{}") == StructuredOutputsConfig()
    for bad, word in (("{nope", "not valid JSON"), ("[1]", "JSON object"),
                      ('{"backend": "xgrammar"}', "unknown key(s) ['backend']"),
                      ('{"disable_any_whitespace": 1}', "disable_any_whitespace")):
        with pytest.raises(ValueError, match=re.escape(word)):
            StructuredOutputsConfig.from_json(bad)


# --- tools -----------------------------------------------------------------------------------


def _check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS
    if name is not None:
        assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_tool_choice_required_and_named(client):
    for seed in (1, 2):
        r = _chat(client, messages=ASK, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        _check_call(c.message.tool_calls[0])
    for name in ("get_weather", "get_time"):
        r = _chat(client, messages=ASK, tools=TOOLS, temperature=0,
                  tool_choice={"type": "function", "function": {"name": name}})
        c = r.choices[0]
        assert c.finish_reason == "stop"  # a call forced by name, as OpenAI reports it
        assert [t.function.name for t in c.message.tool_calls] \
            == [name] * len(c.message.tool_calls)
        for call in c.message.tool_calls:
            _check_call(call, name)
    # "none": the tools are rendered, the answer is never parsed for calls.
    r = _chat(client, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
              max_tokens=10)
    assert r.choices[0].message.tool_calls in (None, [])
    assert r.choices[0].finish_reason == "length"


def test_tool_round_trip(client, tokenizer):
    first = _chat(client, messages=ASK, tools=TOOLS, temperature=0, parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    args = _check_call(call, "get_weather")
    # The client's own message object goes back as it is, as OpenAI's examples do.
    history = [*ASK, first.choices[0].message,
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    answer = _chat(client, messages=history, tools=TOOLS, tool_choice="none", temperature=0,
                   max_tokens=8)
    assert answer.choices[0].message.content
    # ... and as its plain dict (`model_dump()`: with OpenAI's empty refusal, annotations,
    # audio and function_call), as many clients send it back.
    dumped = _chat(client, messages=[*ASK, first.choices[0].message.model_dump(), history[-1]],
                   tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
    assert dumped.usage.prompt_tokens == answer.usage.prompt_tokens
    assert dumped.choices[0].message.content == answer.choices[0].message.content
    # The prompt is the template's rendering of the whole exchange: the call (its arguments
    # as an object) and the tool's result.
    want = tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": "get_weather", "arguments": args}}]},
         {"role": "tool", "content": "18 degrees, sunny"}],
        tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in want
    assert answer.usage.prompt_tokens == len(tokenizer.encode(want))


def _reassemble(chunks) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.function.name
                    calls[d.index] = [d.function.name, d.function.arguments or ""]
                else:
                    assert d.function.name is None
                    calls[d.index][1] += d.function.arguments
            finish = ch.finish_reason or finish
    return content or None, [(n, a) for _, (n, a) in sorted(calls.items())], finish


def test_a_named_tool_choice_is_exactly_one_call(client):
    # parallel_tool_calls is true by default: still one call, finishing "stop" (OpenAI's).
    for seed in range(4):
        c = _chat(client, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=300,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}
                  ).choices[0]
        assert c.finish_reason == "stop" and c.message.content is None, c
        assert len(c.message.tool_calls) == 1, c.message.tool_calls
        _check_call(c.message.tool_calls[0], "get_weather")


def test_required_tool_calls_are_bounded_and_never_leak_markup(client):
    # At most one call per tool: the answer ends instead of running to max_tokens.
    for seed in range(4):
        c = _chat(client, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                  tool_choice="required", max_tokens=400).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert 1 <= len(c.message.tool_calls) <= len(TOOLS)
        for call in c.message.tool_calls:
            _check_call(call)
    # Cut by max_tokens anywhere: the complete calls, never a cut one or its markup, and a
    # stream sends exactly those.
    for max_tokens in (12, 20, 27, 35, 45, 60):
        kw = {"tool_choice": "required", "seed": 0, "max_tokens": max_tokens,
              "temperature": 1.0}
        c = _chat(client, messages=ASK, tools=TOOLS, **kw).choices[0]
        assert c.message.content is None, (max_tokens, c)
        for call in c.message.tool_calls or []:
            _check_call(call)
        want = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        got = _reassemble(_chat(client, messages=ASK, tools=TOOLS, stream=True, **kw))
        assert got == (None, want, c.finish_reason), max_tokens


def test_streamed_tool_calls_equal_the_non_streamed(client):
    for kw in ({"tool_choice": "required", "seed": 5, "max_tokens": 150},
               {"tool_choice": {"type": "function", "function": {"name": "get_time"}},
                "seed": 6, "max_tokens": 150},
               {"tool_choice": "auto", "seed": 7, "max_tokens": 40}):
        full = _chat(client, messages=ASK, tools=TOOLS, temperature=1.0, **kw).choices[0]
        want_calls = [(t.function.name, t.function.arguments)
                      for t in full.message.tool_calls or []]
        if kw["tool_choice"] != "auto":
            assert want_calls
        got = _reassemble(_chat(client, messages=ASK, tools=TOOLS, temperature=1.0,
                                stream=True, **kw))
        assert got == (full.message.content, want_calls, full.finish_reason)


def test_64_concurrent_constrained_streams_equal_non_streamed(server):
    kinds = [
        {"guided_regex": r"[a-z]{2,6}( [a-z]{2,6}){0,3}"},
        {"guided_choice": ["red", "green", "blue"]},
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "p", "schema": PERSON}}},
        {"tools": TOOLS, "tool_choice": "required"},
    ]
    requests = [{"model": MODEL, "messages": [{"role": "user", "content": f"Item {i}"}],
                 "max_tokens": 100, "temperature": 1.0, "seed": i, **kinds[i % len(kinds)]}
                for i in range(64)]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                     max_retries=0, timeout=300)

        async def one(body: dict, stream: bool):
            main = {k: body[k] for k in ("model", "messages", "max_tokens", "temperature",
                                         "seed")}
            extra = {k: v for k, v in body.items() if k not in main}
            tools = {k: extra.pop(k) for k in ("tools", "tool_choice", "response_format")
                     if k in extra}
            # The client's overloads cannot tell a stream from a response by a bool variable.
            r: Any = await aclient.chat.completions.create(**main, **tools, extra_body=extra,
                                                           stream=stream)
            if not stream:
                c = r.choices[0]
                return (c.message.content, [(t.function.name, t.function.arguments)
                                            for t in c.message.tool_calls or []],
                        c.finish_reason)
            return _reassemble([chunk async for chunk in r])

        full = await asyncio.wait_for(asyncio.gather(*(one(b, False) for b in requests)), 300)
        streamed = await asyncio.wait_for(asyncio.gather(*(one(b, True) for b in requests)),
                                          300)
        await aclient.close()
        return full, streamed

    full, streamed = asyncio.run(run())
    assert streamed == full
    for i, (content, calls, finish) in enumerate(full):
        kind = i % len(kinds)
        if kind == 0:
            assert finish == "stop" and content is not None
            assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,3}", content)
        elif kind == 1:
            assert content in ("red", "green", "blue")
        elif kind == 2:
            assert content is not None
            jsonschema.validate(json.loads(content), PERSON)
        else:
            assert finish == "tool_calls" or finish == "length"
            assert calls and all(name in SCHEMAS for name, _ in calls)


# --- echo and prompt logprobs ----------------------------------------------------------------


def test_echo_prompt_logprobs_match_offline_llm(client, tiny_path, tokenizer):
    from jaxllm import LLM, SamplingParams
    from jaxllm.entrypoints.openai.serving_engine import token_text_and_bytes

    text = "The quick brown fox jumps over the lazy dog because"
    ids = tokenizer.encode(text)
    added = set(tokenizer.added_tokens_decoder)
    llm = LLM(tiny_path, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
              max_num_batched_tokens=64, num_kv_blocks=64, show_progress=False,
              multiprocess_mode=False)
    try:
        want = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    rows = want.prompt_logprobs
    assert rows is not None and len(rows) == len(ids)
    # lm-evaluation-harness's loglikelihood request.
    r = client.completions.create(model=MODEL, prompt=[ids], echo=True, max_tokens=1,
                                  logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == text + want.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for k, tid in enumerate(ids[1:], start=1):
        row = rows[k]
        assert row is not None
        assert lp.token_logprobs[k] == pytest.approx(row[tid].logprob, abs=1e-4)
        best = next(t for t, p in row.items() if p.rank == 1)
        assert max(lp.top_logprobs[k], key=lp.top_logprobs[k].get) \
            == token_text_and_bytes(tokenizer, best, added)[0]
    gen = want.outputs[0]
    assert gen.logprobs is not None
    assert lp.token_logprobs[-1] == pytest.approx(gen.logprobs[0][gen.token_ids[0]].logprob,
                                                  abs=1e-4)
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset[:3] == [0, len(tokenizer.decode(ids[:1])),
                                  len(tokenizer.decode(ids[:2]))]
    # vLLM's prompt_logprobs field, and echo streamed as one first chunk.
    extra = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    plp = (extra.choices[0].model_extra or {})["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for k, tid in enumerate(ids[1:], start=1):
        row = rows[k]
        assert row is not None
        assert plp[k][str(tid)]["logprob"] == pytest.approx(row[tid].logprob, abs=1e-4)
        assert plp[k][str(tid)]["rank"] == row[tid].rank
    chunks = list(client.completions.create(model=MODEL, prompt=[ids], echo=True,
                                            max_tokens=1, logprobs=1, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
