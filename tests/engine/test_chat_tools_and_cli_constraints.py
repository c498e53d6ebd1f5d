"""`LLM.chat(tools=..., chat_template_kwargs=...)` renders what the tokenizer's own template
renders, a tool-call grammar on it gives a call the hermes parser reads back with valid
arguments, and `jaxllm chat --json-schema / --choice` constrain the printed answer (`--regex`
builds the same StructuredOutputsParams; its errors are checked here, its enforcement by the
server tests).
Model: tiny-qwen2 (random weights, the real tokenizer and chat template)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.entrypoints.openai.tool_parsers import extract_tool_calls, tool_call_grammar
from tests.utils import assert_pool_free, kv_budget_kwargs

TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up",
    "parameters": {"type": "object", "properties": {
        "word": {"type": "string", "maxLength": 8}, "lang": {"enum": ["en", "fr"]}},
        "required": ["word", "lang"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Look up 'chat'"}]


@pytest.fixture(scope="module")
def tiny_path():
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    return str(tiny_qwen2_path())


@pytest.fixture(scope="module")
def llm(tiny_path):
    engine = LLM(tiny_path, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=256,
                 show_progress=False, multiprocess_mode=False, **kv_budget_kwargs())
    yield engine
    engine.shutdown()


def test_chat_renders_tools_and_a_grammar_enforces_the_call(llm):
    tok = llm.get_tokenizer()
    want = tok.apply_chat_template(MESSAGES, tools=[TOOL], tokenize=False,
                                   add_generation_prompt=True)
    assert "# Tools" in want and '"name": "lookup"' in want
    grammar = tool_call_grammar([TOOL["function"]], parallel=False, whitespace_flexible=False,
                                tags_are_tokens=True)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    out = llm.chat(MESSAGES, params, tools=[TOOL], use_tqdm=False)[0]
    assert out.prompt == want
    c = out.outputs[0]
    assert c.finish_reason == "stop", c.text
    found = extract_tool_calls(c.text)
    assert [t.name for t in found.tool_calls] == ["lookup"] and found.content is None
    jsonschema.validate(json.loads(found.tool_calls[0].arguments),
                        TOOL["function"]["parameters"])
    # chat_template_kwargs reach the template as its variables.
    template = "{{ greeting }}: {{ messages[0]['content'] }}"
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template_kwargs={"chat_template": template, "greeting": "Hi"})[0]
    assert out.prompt == "Hi: Look up 'chat'"
    assert_pool_free(llm)


def _answer(capsys, argv: list[str]) -> str:
    from jaxllm.entrypoints.cli.main import main

    assert main(argv) == 0
    out = capsys.readouterr().out
    return out.split("\n\nassistant: ", 1)[1].rstrip("\n")


def test_cli_chat_constraints(tmp_path, capsys):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    engine = ["--model", "tiny-qwen2", "--max-model-len", "256", "--max-num-batched-tokens",
              "128", "--num-kv-blocks", "64", "--no-multiprocess-mode",
              "--max-tokens", "60", "--temperature", "1.0", "--seed", "5"]
    answer = _answer(capsys, ["chat", "Give me JSON", "--json-schema", str(path),
                              "--disable-any-whitespace", *engine])
    jsonschema.validate(json.loads(answer), schema)
    assert _answer(capsys, ["chat", "Pick", "--choice", "left", "--choice", "right",
                            *engine]) in ("left", "right")


def test_cli_refuses_bad_constraints_before_loading(tmp_path, capsys):
    from jaxllm.entrypoints.cli.main import main

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["chat", "x", "--json-schema", str(bad)]) == 2
    assert "--json-schema" in capsys.readouterr().err
    assert main(["chat", "x", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["chat", "x", "--regex", "[a-"]) == 2
    assert "structured_outputs.regex is invalid" in capsys.readouterr().err
