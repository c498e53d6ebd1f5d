"""`jaxllm serve` on SIGTERM: it stops taking new connections, lets a running stream finish
within the grace period, then exits 0 (its own server, as it ends it). The API key comes from
JAXLLM_API_KEY here, and the model is served under --served-model-name."""

from __future__ import annotations

import signal
import threading
import time

import openai

from tests.server.openai_server import ServerProcess, http


def test_sigterm_finishes_running_stream_then_exits_0(tmp_path):
    key = "env-key"
    srv = ServerProcess(["tiny-qwen2", "--max-model-len", "512", "--max-num-seqs", "4",
                         "--max-num-batched-tokens", "64", "--num-kv-blocks", "256",
                         "--no-show-progress",
                         "--graceful-shutdown-timeout", "60", "--served-model-name", "story-model"],
                        tmp_path / "server.log", env={"JAXLLM_API_KEY": key})
    try:
        assert http("GET", srv.url + "/v1/models")[0] == 401  # the env var's key is required
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0,
                               timeout=120)
        assert [m.id for m in client.models.list().data] == ["story-model"]
        want = client.completions.create(model="story-model", prompt="Once upon a time",
                                         max_tokens=300, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        got: dict[str, object] = {"text": "", "reason": None}
        first = threading.Event()

        def stream() -> None:
            try:
                for chunk in client.completions.create(
                        model="story-model", prompt="Once upon a time", max_tokens=300,
                        temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    for c in chunk.choices:
                        got["text"] += c.text
                        got["reason"] = c.finish_reason or got["reason"]
                    first.set()
            except Exception as e:  # noqa: BLE001 - checked below
                got["err"] = e
                first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        refused = False
        try:
            http("GET", srv.url + "/health", timeout=5)
        except OSError:
            refused = True
        assert refused, "the server still took a new connection after SIGTERM"
        t.join(90)
        assert not t.is_alive()
        assert "err" not in got, got.get("err")
        assert got["text"] == want and got["reason"] == "length"
        assert srv.proc.wait(60) == 0, srv.log_tail()
    finally:
        srv.stop()
