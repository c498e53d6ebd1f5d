"""`jaxllm serve tiny-qwen2 --enable-lora --lora-modules ...` through the official `openai`
client, against one server this module starts (loopback, a free port). Oracle: the offline
LLM with the same adapters as LoRARequests (itself held to Hugging Face with the adapters
merged by tests/lora/test_lora.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from tests.lora_adapters import ATTENTION_MODULES, write_adapter
from tests.server.openai_server import serve_tiny

MAX_MODEL_LEN = 128
PROMPTS = ["Hello there", "def fibonacci(n):"]
GREEDY = dict(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_path) -> dict[str, Path]:
    cfg = SimpleNamespace(**json.loads((Path(tiny_path) / "config.json").read_text()))
    root = tmp_path_factory.mktemp("adapters")
    write_adapter(root / "attn", cfg, rank=8, alpha=16, targets=ATTENTION_MODULES, seed=1)
    write_adapter(root / "mlp", cfg, rank=4, alpha=8, seed=2,
                  targets=("gate_proj", "up_proj", "down_proj"))
    return {"attn": root / "attn", "mlp": root / "mlp"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters):
    yield from serve_tiny(tmp_path_factory.mktemp("serve_lora"), MAX_MODEL_LEN,
                          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
                          "--num-kv-blocks", "256")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_path, adapters):
    from jaxllm import LLM, LoRARequest, SamplingParams

    llm = LLM(tiny_path, enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=MAX_MODEL_LEN, multiprocess_mode=False, show_progress=False)
    requests = {None: None, **{n: LoRARequest(n, i + 1, str(p))
                               for i, (n, p) in enumerate(adapters.items())}}
    texts = {}
    for name, lora in requests.items():
        outs = llm.generate(PROMPTS, SamplingParams(**GREEDY), lora_request=lora,
                            use_tqdm=False)
        texts[name] = [o.outputs[0].text for o in outs]
    llm.shutdown()
    # Each adapter changes the tiny model's greedy text: the comparisons below can fail.
    assert len({tuple(t) for t in texts.values()}) == len(texts)
    return texts


def test_models_lists_the_adapters_with_their_base(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-qwen2", "attn", "mlp"}
    for name in ("attn", "mlp"):
        assert models[name].model_dump().get("parent") == "tiny-qwen2"


@pytest.mark.parametrize("model", ["tiny-qwen2", "attn", "mlp"])
def test_completions_run_the_adapter_the_model_names(client, offline, model):
    want = offline[None if model == "tiny-qwen2" else model]
    got = client.completions.create(model=model, prompt=PROMPTS, **GREEDY)
    assert got.model == model
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    # Streamed, the pieces join to the same text.
    stream = client.completions.create(model=model, prompt=PROMPTS[0], stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want[0]


def test_an_unknown_model_is_a_404_naming_the_served_ones(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "attn" in str(e.value) and "mlp" in str(e.value)
    # The server keeps answering.
    assert client.completions.create(model="attn", prompt="x", max_tokens=2).choices


def test_metrics_name_the_running_adapters(client, server):
    """vLLM's lora_requests_info: while a request of adapter "mlp" streams, a series labelled
    with it as running is stamped with the current time."""
    import re
    import time

    from tests.server.openai_server import http

    start = time.time()
    stream = client.completions.create(model="mlp", prompt=PROMPTS[1], stream=True,
                                       temperature=0.0, max_tokens=48)
    next(iter(stream))  # the request runs
    body = http("GET", server.url + "/metrics")[1].decode()
    for _ in stream:
        pass
    series = re.findall(r'^jaxllm:lora_requests_info\{([^}]*)\} (\S+)$', body, re.M)
    running = [(labels, float(v)) for labels, v in series
               if 'running_lora_adapters="mlp"' in labels]
    assert running, series
    assert all('max_lora="2"' in labels for labels, _ in series)
    assert max(v for _, v in running) >= start - 1
