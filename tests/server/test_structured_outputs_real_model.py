"""The `openai` client's `parse()` and a tool-call round trip against `jaxllm serve` with the
embedded Qwen2.5-Coder-0.5B-Instruct: the real model's own tool-call text through the hermes
parser, and its JSON under a schema. Small buckets keep start-up short."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from jaxllm.model_executor.model_loader.default_model import DEFAULT_MODEL_NAME
from tests.server.openai_server import ServerProcess

pytestmark = pytest.mark.real_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"}},
        "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(real_model_path, tmp_path_factory):
    srv = ServerProcess(["--max-model-len", "1024", "--max-num-seqs", "2",
                         "--max-num-batched-tokens", "256", "--num-kv-blocks", "256",
                         "--no-show-progress"],
                        tmp_path_factory.mktemp("serve-real") / "server.log")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
    assert srv.stop() == 0, srv.log_tail()


class Language(BaseModel):
    name: str
    year: int


def test_parse_returns_the_pydantic_object(client):
    out = client.chat.completions.parse(
        model=DEFAULT_MODEL_NAME, response_format=Language, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "Which year was the Python programming "
                                              "language first released?"}])
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert message.parsed == Language.model_validate_json(message.content)
    assert "python" in message.parsed.name.lower()


def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    # "required": under "auto" this small model writes the call's JSON without the
    # <tool_call> tags its template asks for, which no hermes parser reads as a call.
    first = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages,
                                           tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0,
                                           max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id,
                                  "content": json.dumps({"temperature_c": 31,
                                                         "sky": "sunny"})}]
    # "auto" again: the answer is text, parsed and found to hold no call.
    answer = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages,
                                            tools=[WEATHER], temperature=0, max_tokens=64)
    c = answer.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    # The answer reads the tool's result.
    assert "31" in c.message.content, c.message.content


THREE_CITIES = [{"role": "user", "content": "What is the weather in Paris, Tokyo and Lima?"}]


def test_a_named_tool_choice_is_one_call_finishing_stop(client):
    out = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=THREE_CITIES, tools=[WEATHER], temperature=0,
        max_tokens=200, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = out.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None, c
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    json.loads(c.message.tool_calls[0].function.arguments)


def test_required_calls_end_and_a_cut_one_leaks_nothing(client):
    # One tool: at most one call by default, so the answer ends instead of repeating it.
    out = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=THREE_CITIES, tools=[WEATHER], temperature=0,
        max_tokens=200, tool_choice="required")
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert len(c.message.tool_calls) == 1
    # Two tools, cut inside the second call: the first one, without markup.
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    out = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=THREE_CITIES, tools=[WEATHER, clock],
        temperature=0, max_tokens=35, tool_choice="required", seed=0)
    c = out.choices[0]
    assert c.message.content is None, c
    for call in c.message.tool_calls or []:
        json.loads(call.function.arguments)
