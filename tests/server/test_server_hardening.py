"""`jaxllm serve` against hostile clients: which routes want the API key, request gauges after
aborts, bodies that are not UTF-8 JSON, slow clients (bodies, headers, idle connections), the
connection bound, and the served OpenAPI schema. One shared server (tests/server/conftest.py)."""

from __future__ import annotations

import json
import re
import socket
import time

import openai
import pytest

from tests.server.conftest import (
    BODY_TIMEOUT_S,
    HARDENED_KEY,
    HEADER_TIMEOUT_S,
    LIMIT_CONCURRENCY,
)
from tests.server.openai_server import http, metric

AUTH = {"Authorization": f"Bearer {HARDENED_KEY}"}


@pytest.fixture(scope="module")
def server(hardened_server):
    return hardened_server


def _raw(server, data: bytes, timeout: float) -> bytes:
    """What the server sends back on a connection given `data`, until it closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_api_key_guards_every_route_but_the_probes(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, raw = http("POST", server.url + path, body, headers)
            assert status == 401, (path, headers)
            assert json.loads(raw)["error"]["type"] == "AuthenticationError"
        assert http("POST", server.url + path, body, AUTH)[0] == 200, path
    assert http("GET", server.url + "/v1/models")[0] == 401
    for path in ("/health", "/version", "/metrics", "/openapi.json"):
        assert http("GET", server.url + path)[0] == 200, path


def test_request_gauges_return_to_zero_after_an_abort(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=HARDENED_KEY, max_retries=0,
                           timeout=60)
    aborts = metric(server, "jaxllm:request_success_total", 'finished_reason="abort"')
    # 16 sequences of 240 tokens: still running when the client goes away.
    stream = client.completions.create(model="tiny-qwen2", prompt="Once upon a time", n=16,
                                       seed=0, max_tokens=240, temperature=1.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    deadline = time.monotonic() + 20
    while metric(server, "jaxllm:num_requests_running") == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.01)
    stream.close()
    while metric(server, "jaxllm:request_success_total",
                 'finished_reason="abort"') == aborts \
            or metric(server, "jaxllm:kv_cache_usage_perc") != 0.0:
        assert time.monotonic() < deadline, "the dropped stream was not aborted and freed"
        time.sleep(0.05)
    # The engine is at rest: no step reports it, the scrape itself must.
    assert metric(server, "jaxllm:num_requests_running") == 0
    assert metric(server, "jaxllm:num_requests_waiting") == 0


@pytest.mark.parametrize("what,content_type,body", [
    ("text/plain", "text/plain", b'{"prompt": "hi"}'),
    ("a form", "application/x-www-form-urlencoded", b'{"prompt": "hi"}'),
    ("a UTF-16 charset", "application/json; charset=utf-16", b'{"prompt": "hi"}'),
    ("a UTF-16 body", "application/json", '{"prompt": "hi"}'.encode("utf-16")),
    ("a UTF-16-LE body without BOM", "application/json", '{"prompt": "hi"}'.encode("utf-16-le")),
    ("a UTF-8 BOM", "application/json", b'\xef\xbb\xbf{"prompt": "hi"}'),
])
def test_bodies_that_are_not_utf8_json_get_415(server, what, content_type, body):
    for path in ("/tokenize", "/v1/completions"):
        status, raw = http("POST", server.url + path, body,
                           {**AUTH, "Content-Type": content_type})
        assert status == 415, (what, path, raw[:200])
        err = json.loads(raw)["error"]
        assert err["code"] == 415 and err["type"] == "UnsupportedMediaTypeError", what
    # The same text as UTF-8 JSON, declared with its charset, is served.
    status, raw = http("POST", server.url + "/tokenize", b'{"prompt": "hi"}',
                       {**AUTH, "Content-Type": "application/json; charset=UTF-8"})
    assert status == 200 and json.loads(raw)["count"] == 1


def test_a_body_that_does_not_arrive_gets_408(server):
    head = (f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HARDENED_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    start = time.monotonic()
    out = _raw(server, head + b'{"prompt": ', timeout=BODY_TIMEOUT_S + 10)
    assert out.startswith(b"HTTP/1.1 408 "), out[:200]
    assert b"RequestTimeoutError" in out
    assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - start < BODY_TIMEOUT_S + 5


@pytest.mark.parametrize("sent", [b"", b"POST /tokenize HTTP/1.1\r\nHost: x\r\n"],
                         ids=["silent", "half the headers"])
def test_a_connection_without_headers_is_closed(server, sent):
    start = time.monotonic()
    assert _raw(server, sent, timeout=HEADER_TIMEOUT_S + 10) == b""
    assert HEADER_TIMEOUT_S - 0.5 < time.monotonic() - start < HEADER_TIMEOUT_S + 5
    assert http("GET", server.url + "/health")[0] == 200


def _read_response(s: socket.socket) -> bytes:
    """One response with a Content-Length body off a kept-alive connection."""
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {out[:200]!r}"
        out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed inside a response"
        body += chunk
    return head


def test_an_idle_kept_alive_connection_outlives_the_header_timeout(server):
    """Between requests only the keep-alive timeout applies (the server's, KEEP_ALIVE_S): a
    connection idle longer than the header timeout still serves its next request, while the
    next request's headers, once begun, get the header timeout again."""
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=HEADER_TIMEOUT_S + 10) as s:
        s.sendall(get)
        assert _read_response(s).startswith(b"HTTP/1.1 200 ")
        time.sleep(HEADER_TIMEOUT_S + 1)  # past the header timeout, within the keep-alive
        s.sendall(get)
        assert _read_response(s).startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET /health HTTP/1.1\r\n")  # half the next request's headers
        start = time.monotonic()
        assert s.recv(65536) == b""
        assert HEADER_TIMEOUT_S - 0.5 < time.monotonic() - start < HEADER_TIMEOUT_S + 5


def test_connections_beyond_the_limit_get_503(server):
    for _ in range(3):
        start = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                for _ in range(LIMIT_CONCURRENCY)]
        try:
            time.sleep(0.2)  # let the server accept them all
            status = http("GET", server.url + "/health")[0]
        finally:
            for s in idle:
                s.close()
        # The header timeout closes idle connections: on a machine too loaded to open them
        # all well within it, the server may have dropped the first ones; try again.
        if time.monotonic() - start < HEADER_TIMEOUT_S - 0.5:
            break
    assert status == 503
    deadline = time.monotonic() + 10
    while http("GET", server.url + "/health")[0] != 200:
        assert time.monotonic() < deadline, "the server did not recover from the idle clients"
        time.sleep(0.1)


def test_openapi_json_carries_the_request_models(server):
    status, raw = http("GET", server.url + "/openapi.json")
    assert status == 200
    schema = json.loads(raw)
    paths = schema["paths"]
    assert set(paths) == {"/health", "/version", "/metrics", "/v1/models", "/v1/completions",
                          "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"}
    components = schema["components"]["schemas"]
    for path, model, field in (("/v1/completions", "CompletionRequest", "prompt"),
                               ("/v1/chat/completions", "ChatCompletionRequest", "messages"),
                               ("/tokenize", "TokenizeRequest", "prompt"),
                               ("/detokenize", "DetokenizeRequest", "tokens"),
                               ("/v1/embeddings", "EmbeddingRequest", "input")):
        op = paths[path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert field in components[model]["properties"]
        assert components[model]["additionalProperties"] is False  # unknown fields: 400
        assert op["security"] == [{"bearer": []}]
        assert {"400", "401", "413", "415"} <= set(op["responses"])
    assert "security" not in paths["/health"]["get"]


@pytest.mark.parametrize("flag", ["--request-body-timeout", "--request-header-timeout",
                                  "--limit-concurrency", "--timeout-keep-alive",
                                  "--h11-max-incomplete-event-size", "--max-request-bytes"])
def test_serve_refuses_a_non_positive_bound(flag, capsys):
    from jaxllm.entrypoints.cli.main import main

    assert main(["serve", "tiny-qwen2", flag, "0"]) == 2  # before any engine starts
    assert f"{flag} must be positive, got 0" in capsys.readouterr().err


def test_serve_does_its_start_up_work_before_serving(monkeypatch):
    """Work that held the GIL, and so the event loop, for a large part of a second (BENCHMARKS.md,
    the soak) while a burst of requests came in: a full garbage collection of the start-up heap
    (frozen now, so collections skip it) and the first text prompt's read of the whole
    vocabulary (the prompt-length bound, computed now). `jaxllm serve` does both before uvicorn
    serves anything."""
    import functools
    import gc
    import signal
    from types import SimpleNamespace

    import uvicorn

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.cli.main import main

    class Processor:
        @functools.cached_property
        def max_prompt_chars(self) -> int:
            return 1 << 20

    engine = SimpleNamespace(
        engine_core=SimpleNamespace(), processor=Processor(), tokenizer=SimpleNamespace(),
        core_info=SimpleNamespace(max_model_len=64),
        engine_config=SimpleNamespace(model="m", model_path="m", reasoning_parser=None),
        shutdown=lambda: None)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", lambda *a, **k: engine)
    seen = {}

    def run(self) -> None:
        seen["frozen"] = gc.get_freeze_count()
        seen["bound read"] = "max_prompt_chars" in engine.processor.__dict__

    monkeypatch.setattr(uvicorn.Server, "run", run)
    gc.unfreeze()
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["serve", "tiny-qwen2"]) == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        gc.unfreeze()  # this process goes on with other tests
    assert seen["frozen"] > 0 and seen["bound read"], seen
