"""POST /v1/embeddings of `jaxllm serve tiny-qwen2 --runner pooling` through the official
`openai` client and raw HTTP, against one server this module starts (loopback, a free port).
Oracle: the offline LLM(runner="pooling") on the same checkpoint, itself held to Hugging Face
by tests/engine/test_embeddings.py."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest

from tests.server.openai_server import http, serve_tiny

MAX_MODEL_LEN = 128
TEXTS = ["Hello world", "The capital of France is Paris, and the capital of Italy is Rome.",
         "def fibonacci(n):"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A 32-token budget: the longer inputs are prefilled in chunks.
    yield from serve_tiny(tmp_path_factory.mktemp("serve_embed"), MAX_MODEL_LEN,
                          "--runner", "pooling", "--max-num-batched-tokens", "32",
                          "--num-kv-blocks", "256")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_path):
    from jaxllm import LLM

    llm = LLM(tiny_path, runner="pooling", max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=32, multiprocess_mode=False, show_progress=False)
    yield llm
    llm.shutdown()


def _post(server, body: dict) -> tuple[int, dict]:
    status, raw = http("POST", server.url + "/v1/embeddings", body)
    return status, json.loads(raw)


def test_openai_client_matches_offline(client, offline):
    want = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    # The client asks for base64 by default and decodes it itself; then floats explicitly.
    for fmt in (openai.NOT_GIVEN, "float"):
        resp = client.embeddings.create(model="tiny-qwen2", input=TEXTS, encoding_format=fmt)
        assert resp.object == "list" and resp.model == "tiny-qwen2"
        assert [d.index for d in resp.data] == [0, 1, 2]
        for d, w in zip(resp.data, want, strict=True):
            assert d.object == "embedding"
            np.testing.assert_allclose(d.embedding, w, atol=1e-6, rtol=0)
        num = sum(len(o.prompt_token_ids) for o in offline.embed(TEXTS, use_tqdm=False))
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == num


def test_token_ids_dimensions_and_base64(server, client, offline):
    ids = [[1, 2, 3, 4, 5], list(range(40))]
    want = [o.outputs.embedding for o in offline.embed(
        [{"prompt_token_ids": p} for p in ids], use_tqdm=False)]
    resp = client.embeddings.create(model="tiny-qwen2", input=ids, encoding_format="float")
    for d, w in zip(resp.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w, atol=1e-6, rtol=0)
    # One token-id list is one input.
    one = client.embeddings.create(model="tiny-qwen2", input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == 5
    # Matryoshka: the first 8 values, normalized again.
    small = client.embeddings.create(input="Hello world", model="tiny-qwen2", dimensions=8,
                                     encoding_format="float").data[0].embedding
    assert len(small) == 8 and np.isclose(np.linalg.norm(small), 1.0, atol=1e-6)
    # base64 (raw HTTP): little-endian float32 bytes, equal to the floats.
    status, floats = _post(server, {"input": TEXTS, "encoding_format": "float"})
    assert status == 200
    status, b64 = _post(server, {"input": TEXTS, "encoding_format": "base64"})
    assert status == 200
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == f["embedding"]


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": [[1, 2], "text"]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "x" * 10}, None),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 100000}, "dimensions"),
    ({"input": "hi", "dimensions": "8"}, "dimensions"),
    ({"input": "hi", "normalize": True, "foo": 1}, "normalize"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_requests(server, body, param):
    status, resp = _post(server, body)
    if param is None:  # a good request among the bad ones: the server still serves
        assert status == 200, resp
        return
    assert status == 400, resp
    assert resp["error"]["param"] == param, resp


def test_wrong_model_and_generate_routes_refused(server, client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}]})):
        status, raw = http("POST", server.url + route, body)
        err = json.loads(raw)["error"]
        assert status == 400 and "--runner generate" in err["message"], err
        assert err["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="runner"):
        client.completions.create(model="tiny-qwen2", prompt="hi", max_tokens=2)
