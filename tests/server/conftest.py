"""The tiny-qwen2 checkpoint's path, and one `jaxllm serve tiny-qwen2` for the hardening,
schema-fuzzing and soak modules (a server start costs 30-60 s on a small machine): short body
and header timeouts so that slow clients are cut off within the tests' time, an API key, and a
pool large enough for 256 streams."""

from __future__ import annotations

import pytest

from tests.server.openai_server import ServerProcess

HARDENED_KEY = "hardened-key"
HARDENED_MAX_MODEL_LEN = 256
# The soak's 256 streams share 2 cores with the server: a client's body, sent right after its
# headers, has arrived over 2 s late there (a 408 for an honest request); 5 s leaves room.
BODY_TIMEOUT_S = 5
# From a connection's opening to its request's headers: the soak's 256 honest clients, opened
# at once on 2 cores beside the server, have taken over 2 s.
HEADER_TIMEOUT_S = 5
# Longer than the header timeout: the keep-alive test sleeps past that one within this one.
KEEP_ALIVE_S = 10
LIMIT_CONCURRENCY = 320


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    return str(tiny_qwen2_path())


@pytest.fixture(scope="session")
def hardened_server(tmp_path_factory):
    srv = ServerProcess(["tiny-qwen2", "--max-model-len", str(HARDENED_MAX_MODEL_LEN),
                         "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
                         "--num-kv-blocks", "2048", "--no-show-progress",
                         "--api-key", HARDENED_KEY,
                         "--request-body-timeout", str(BODY_TIMEOUT_S),
                         "--request-header-timeout", str(HEADER_TIMEOUT_S),
                         "--timeout-keep-alive", str(KEEP_ALIVE_S),
                         "--limit-concurrency", str(LIMIT_CONCURRENCY)],
                        tmp_path_factory.mktemp("serve_hardened") / "server.log")
    yield srv
    code = srv.stop()
    assert code == 0, srv.log_tail()
