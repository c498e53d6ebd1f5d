"""Requests that could take the whole server down or hold up everyone else: grammars and
schemas nested deep enough to crash llguidance, constraints past the server's limits, seeds
whose children overflow, many stop strings, echoed prompt logprobs. Each costs its own request
only: it gets its 400 (or its answer), and /health and the next request are served as before.
The shared server of tests/server/conftest.py, and in-process checks of the pieces."""

from __future__ import annotations

import json
import queue
import re
import threading
import time

import pytest

from tests.server.conftest import HARDENED_KEY
from tests.server.openai_server import http, while_polling_health

AUTH = {"Authorization": f"Bearer {HARDENED_KEY}", "Content-Type": "application/json"}


def deep_lark(links: int) -> str:
    """A chain of `links` rules, each referring to the next: llguidance recurses once per link
    (3,000 overflow an 8 MiB stack)."""
    return ("start: r0\n" + "\n".join(f'r{i}: "t{i}" r{i + 1} | "u{i}"' for i in range(links))
            + f'\nr{links}: "z"')


def ref_chain(hops: int) -> dict:
    """A schema of `hops` objects, each holding the next through a $ref."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(hops)}
    defs[f"d{hops}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.fixture(scope="module")
def server(hardened_server):
    return hardened_server


def post(server, body: dict, path: str = "/v1/completions", timeout: float = 60
         ) -> tuple[int, dict]:
    status, raw = http("POST", server.url + path, {"model": "tiny-qwen2", **body}, AUTH,
                       timeout=timeout)
    return status, json.loads(raw)


def assert_serving(server) -> None:
    """/health answers, and so does a constrained request (a fresh validator worker)."""
    assert http("GET", server.url + "/health", timeout=10)[0] == 200
    status, out = post(server, {"prompt": "x", "max_tokens": 4, "guided_regex": "(yes|no)"})
    assert status == 200, out
    assert out["choices"][0]["text"] in ("yes", "no", "y", "n", "ye", "")


# --- constraints ---------------------------------------------------------------------------------

def test_a_grammar_that_crashes_llguidance_costs_only_its_request(server):
    grammar = deep_lark(3000)  # 104 KB: under the size limit, so it reaches the validator
    for field, body in (("guided_grammar", {"guided_grammar": grammar}),
                        ("structured_outputs", {"structured_outputs": {"grammar": grammar}})):
        status, out = post(server, {"prompt": "x", "max_tokens": 4, **body})
        assert status == 400 and out["error"]["param"] == field, out
        assert "crashed" in out["error"]["message"], out
        assert_serving(server)
    # A chain that fits the validator is served: the core compiles it on a larger stack.
    status, out = post(server, {"prompt": "x", "max_tokens": 4,
                                "guided_grammar": deep_lark(2000)})
    assert status == 200, out


def test_deeply_nested_schemas_are_refused_by_the_depth_limit(server):
    schema = ref_chain(1000)  # 76 KB: deep enough to crash llguidance
    status, out = post(server, {"prompt": "x", "max_tokens": 4, "guided_json": schema})
    assert status == 400 and out["error"]["param"] == "guided_json", out
    assert "--max-structured-output-depth 128" in out["error"]["message"], out
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": json.dumps(schema)}}}
    status, out = post(server, body, "/v1/chat/completions")
    assert status == 400 and out["error"]["param"] == "response_format", out
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(100)}}
    status, out = post(server, {"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 4, "tools": [tool], "tool_choice": "required"},
                       "/v1/chat/completions")
    assert status == 400 and out["error"]["param"] == "tools", out
    assert "--max-structured-output-depth" in out["error"]["message"], out
    # Nested too deeply for JSON parsing itself (98 KB of brackets, as a JSON string): a 400
    # too, from the server and from the validator alike.
    status, out = post(server, {"prompt": "x", "max_tokens": 4,
                                "guided_json": "[" * 49_000 + "]" * 49_000})
    assert status == 400 and out["error"]["param"] == "guided_json", out
    assert "nested too deeply" in out["error"]["message"], out
    # A dozen levels of objects are fine.
    status, out = post(server, {"prompt": "x", "max_tokens": 2, "guided_json": ref_chain(12)})
    assert status == 200, out
    assert_serving(server)


def test_a_constraint_past_the_size_limit_is_a_400_naming_it(server):
    grammar = deep_lark(4000)
    status, out = post(server, {"prompt": "x", "max_tokens": 4, "guided_grammar": grammar})
    assert status == 400 and out["error"]["param"] == "guided_grammar", out
    message = out["error"]["message"]
    assert "--max-structured-output-bytes 131072" in message, message
    size = len(json.dumps({"grammar": grammar, "disable_any_whitespace": False,
                           "disable_additional_properties": False}))
    assert f"{size} bytes" in message, message


def test_a_large_schema_is_validated_once_and_beside_the_event_loop(server):
    # 800 object variants (116 KB): ~0.07 s of llguidance per validation here; on the event
    # loop for every prompt (64 here) it would hold /health for seconds.
    schema = {"oneOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"},
                                                          f"v{i}": {"type": "string"}},
                         "required": [f"k{i}"], "additionalProperties": False}
                        for i in range(800)]}
    body = {"prompt": ["{"] * 64, "max_tokens": 1, "guided_json": schema}
    (status, out), latencies = while_polling_health(server, lambda: post(server, body,
                                                                         timeout=120))
    assert status == 200, out
    assert len(out["choices"]) == 64
    # On the event loop the validations held /health for ~9 s here; beside it, well under a
    # second on a quiet machine (3 s leaves room for a shared CI machine).
    assert max(latencies) < 3.0, latencies


# --- seeds ---------------------------------------------------------------------------------------

def test_children_of_the_largest_seed_get_valid_seeds(server):
    body = {"prompt": "hi", "n": 2, "seed": 2**63 - 1, "max_tokens": 4}
    status, out = post(server, body)
    assert status == 200, out
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    # The same request again: the same texts (the children's seeds are fixed).
    assert post(server, body)[1]["choices"] == out["choices"]
    assert_serving(server)


# --- stop strings --------------------------------------------------------------------------------

def test_stop_strings_are_bounded_in_count_and_size(server):
    base = {"prompt": "hi", "max_tokens": 4, "n": 2, "seed": 0}
    status, out = post(server, {**base, "stop": [f"s{i}" for i in range(10_000)]})
    assert status == 400 and out["error"]["param"] == "stop", out
    assert "10000 strings" in out["error"]["message"], out
    assert "--max-stop-strings 64" in out["error"]["message"], out
    status, out = post(server, {**base, "stop": ["x" * 5000, "y" * 5000]})
    assert status == 400 and out["error"]["param"] == "stop", out
    assert "10000 bytes" in out["error"]["message"], out
    assert "--max-stop-bytes 8192" in out["error"]["message"], out
    status, out = post(server, {**base, "stop": [f"never-{i}" for i in range(64)]})
    assert status == 200, out


# --- echoed prompt logprobs ---------------------------------------------------------------------

def test_echoed_prompt_logprobs_are_bounded_per_response(server):
    prompts = [list(range(1000 + i, 1250 + i)) for i in range(100)]  # 25,000 positions
    body = {"prompt": prompts, "n": 4, "seed": 0, "max_tokens": 1, "logprobs": 20,
            "echo": True}
    start = time.monotonic()
    status, out = post(server, body)
    # Refused before any work: well under the ~40 s the response took to build when allowed
    # (a loose bound: CI machines are shared).
    assert time.monotonic() - start < 20
    assert status == 400 and out["error"]["param"] == "logprobs", out
    message = out["error"]["message"]
    assert "2100000 prompt logprob entries" in message, message
    assert "--max-prompt-logprob-entries 2000000" in message, message
    status, out = post(server, {"prompt": prompts, "n": 4, "seed": 0, "max_tokens": 1,
                                "prompt_logprobs": 20})
    assert status == 400 and out["error"]["param"] == "prompt_logprobs", out
    # Within the bound: served, each choice with its prompt's logprobs.
    status, out = post(server, {**body, "prompt": prompts[:4], "n": 2, "logprobs": 5})
    assert status == 200, out
    assert [len(c["logprobs"]["tokens"]) for c in out["choices"]] == [251] * 8


# --- in process --------------------------------------------------------------------------------

def test_the_validator_replaces_a_worker_that_crashed_or_ran_out_of_time():
    import asyncio

    from jaxllm.structured_output.validator import GrammarRefused, GrammarValidator

    async def run() -> None:
        validator = GrammarValidator(num_workers=1, timeout_s=1e-4)
        try:
            with pytest.raises(GrammarRefused, match="did not finish in 0.0001 s"):
                await validator.validate({"grammar": deep_lark(500)})
            assert validator.num_crashed == 1
            # A timeout is not remembered: with time, the same grammar is valid.
            validator.timeout_s = 30.0
            assert "t499" in await validator.validate({"grammar": deep_lark(500)})
            # A crash is, and costs one worker only once.
            for _ in range(2):
                with pytest.raises(GrammarRefused, match="crashed"):
                    await validator.validate({"grammar": deep_lark(3000)})
            assert validator.num_crashed == 2
            assert "t0" in await validator.validate({"grammar": deep_lark(50)})
            # Nested too deeply for the worker's JSON parser: refused, the worker kept.
            with pytest.raises(GrammarRefused, match="nested too deeply"):
                await validator.validate({"json": "[" * 200_000 + "]" * 200_000})
            assert validator.num_crashed == 2
            # The worker runs under its address-space limit.
            (pid,) = validator.idle_worker_pids()
            limits = open(f"/proc/{pid}/limits").read()
            assert re.search(rf"Max address space\s+{validator.memory_bytes}\s", limits)
        finally:
            validator.close()

    asyncio.run(run())


def test_the_schema_depth_follows_refs_and_stops_at_the_limit():
    from jaxllm.structured_output.validator import schema_depth

    assert schema_depth({"type": "object", "properties": {"a": {"type": "string"}}}, 128) == 3
    assert schema_depth(ref_chain(10), 128) == 2 * 10 + 3  # $defs, d0, properties, x, d1, ...
    assert schema_depth(ref_chain(5000), 128) == 129
    recursive = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
                 "$ref": "#/$defs/a"}
    assert schema_depth(recursive, 128) < 10
    assert schema_depth({"$ref": "#/nowhere", "x": [[[1]]]}, 128) == 4


def test_the_core_input_thread_fails_only_the_request_it_cannot_decode():
    import zmq

    from jaxllm.engine import EngineCoreRequest
    from jaxllm.engine.core_proc import EngineCoreProc
    from jaxllm.engine.serial_utils import MsgpackEncoder, OutputType, RequestType
    from jaxllm.sampling_params import SamplingParams

    proc = object.__new__(EngineCoreProc)  # its socket threads alone, no engine
    proc.ctx = zmq.Context()
    proc.input_queue = queue.Queue()
    proc.output_queue = queue.Queue()
    push = proc.ctx.socket(zmq.PUSH)
    push.bind("inproc://core-input")
    thread = threading.Thread(target=proc.process_input_socket, args=("inproc://core-input",),
                              daemon=True)
    thread.start()
    params = SamplingParams(max_tokens=4)
    params.seed = 2**63  # past what the core's decoder accepts
    encoder = MsgpackEncoder()
    bad = EngineCoreRequest(request_id="bad", prompt_token_ids=[1, 2], sampling_params=params,
                            eos_token_ids=[0], max_tokens=4)
    push.send_multipart([RequestType.ADD.value, encoder.encode(bad)])
    push.send_multipart([RequestType.ABORT.value, encoder.encode(["other"])])
    push.send_multipart([RequestType.SHUTDOWN.value, b""])
    try:
        got = [proc.input_queue.get(timeout=10) for _ in range(2)]
        assert got == [(RequestType.ABORT, ["other"]), (RequestType.SHUTDOWN, None)], got
        item = proc.output_queue.get(timeout=10)
        assert item is not None
        kind, outputs = item
        assert kind is OutputType.OUTPUTS and outputs.outputs is not None
        (out,) = outputs.outputs
        assert out.request_id == "bad" and out.finish_reason == "error"
        assert "seed" in str(out.stop_reason)
    finally:
        thread.join(timeout=10)
        push.close(linger=0)
        proc.ctx.term()
