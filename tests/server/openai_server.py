"""A `jaxllm serve` subprocess for tests (loopback only, a free port, bounded waits, stopped
with SIGTERM, then SIGKILL, by the caller's fixture), and helpers to talk to it: raw HTTP,
/metrics values, stream collection, the catalogue of bad requests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60.0
         ) -> tuple[int, bytes]:
    """(status, body) of one request, errors included (urllib raises on 4xx/5xx). A dict body
    goes as JSON (urllib would otherwise declare it a form)."""
    headers = dict(headers or {})
    if isinstance(body, dict):
        headers.setdefault("Content-Type", "application/json")
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), full_env.get("PYTHONPATH")) if p)
        full_env.update(env or {})
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxllm.entrypoints.cli.main", "serve", *args,
             "--host", "127.0.0.1", "--port", str(self.port), "--uvicorn-log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env)
        self.wait_healthy()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if http("GET", self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n"
                           f"{self.log_tail()}")

    def core_pid(self) -> int:
        """The engine core child (found among the server's children, no debug endpoint)."""
        import psutil

        for child in psutil.Process(self.proc.pid).children():
            if "jaxllm.engine.core_proc" in " ".join(child.cmdline()):
                return child.pid
        raise RuntimeError("no engine core child process")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (SIGKILL after `timeout`); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def serve_tiny(log_dir: Path, max_model_len: int, *args: str) -> Iterator[ServerProcess]:
    """A module fixture's body (`yield from`): `jaxllm serve tiny-qwen2` with `args`, without
    progress bars; at the end of the module SIGTERM must stop it with exit code 0."""
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    tiny_qwen2_path()  # written once here, not by the server
    srv = ServerProcess(["tiny-qwen2", "--max-model-len", str(max_model_len),
                         "--no-show-progress", *args], log_dir / "server.log")
    yield srv
    code = srv.stop()
    assert code == 0, srv.log_tail()


def metric(server, name: str, labels: str = "") -> float:
    status, body = http("GET", server.url + "/metrics")
    assert status == 200
    pat = re.compile(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", re.M)
    total = 0.0
    for lab, value in pat.findall(body.decode()):
        if labels in lab:
            total += float(value)
    return total


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """(text per choice, finish_reason per choice, usage) of a completions stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def bad_requests(max_model_len: int) -> list[tuple[str, str, bytes | dict, int, str | None]]:
    """(what, path, body, expected status, expected error param) of bad requests."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok = {"model": "tiny-qwen2", "prompt": "hi", "max_tokens": 2}
    long_prompt = list(range(1000, 1000 + max_model_len + 4))
    msgs = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    nested = b"[" * 10_000 + b"]" * 10_000
    # Nested loops: seconds of rendering, on the event loop when requests could bring one.
    slow_template = ("{% set ns = namespace(n=0) %}{% for i in range(1500) %}"
                     "{% for j in range(1500) %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                     "{% endfor %}{{ messages[0]['content'] }}")
    return [
        ("malformed JSON", c, b'{"prompt": "hi",', 400, None),
        ("not an object", c, b'[1, 2]', 400, None),
        ("NaN", c, b'{"prompt": "hi", "temperature": NaN}', 400, None),
        ("string max_tokens", c, {**ok, "max_tokens": "5"}, 400, "max_tokens"),
        ("string temperature", c, {**ok, "temperature": "hot"}, 400, "temperature"),
        ("float n", c, {**ok, "n": 1.5}, 400, "n"),
        ("bool max_tokens", c, {**ok, "max_tokens": True}, 400, "max_tokens"),
        ("unknown model", c, {**ok, "model": "gpt-4"}, 404, "model"),
        ("negative max_tokens", c, {**ok, "max_tokens": -3}, 400, "max_tokens"),
        ("zero max_tokens", c, {**ok, "max_tokens": 0}, 400, "max_tokens"),
        ("huge max_tokens", c, {**ok, "max_tokens": 10**12}, 400, "max_tokens"),
        ("over-long prompt", c, {**ok, "prompt": long_prompt}, 400, "prompt"),
        ("prompt + max_tokens too long", c,
         {**ok, "prompt": long_prompt[:max_model_len - 10], "max_tokens": 20}, 400,
         "max_tokens"),
        ("token id outside the vocabulary", c, {**ok, "prompt": [10**7]}, 400, "prompt"),
        ("empty prompt", c, {**ok, "prompt": ""}, 400, "prompt"),
        ("bad logit_bias key", c, {**ok, "logit_bias": {"abc": 1.0}}, 400, "logit_bias"),
        ("negative logit_bias key", c, {**ok, "logit_bias": {"-5": 1.0}}, 400, "logit_bias"),
        ("logit_bias key outside the vocabulary", c, {**ok, "logit_bias": {"99999999": 1.0}},
         400, "logit_bias"),
        ("empty allowed_token_ids", c, {**ok, "allowed_token_ids": []}, 400,
         "allowed_token_ids"),
        ("allowed_token_ids outside the vocabulary", c, {**ok, "allowed_token_ids": [10**7]},
         400, "allowed_token_ids"),
        ("bad_words not a list", c, {**ok, "bad_words": "no"}, 400, "bad_words"),
        ("blank bad word", ch, {"messages": msgs, "bad_words": [" "]}, 400, "bad_words"),
        ("zero truncate_prompt_tokens", c, {**ok, "truncate_prompt_tokens": 0}, 400,
         "truncate_prompt_tokens"),
        ("truncate_prompt_tokens over max_model_len", ch,
         {"messages": msgs, "truncate_prompt_tokens": max_model_len + 1}, 400,
         "truncate_prompt_tokens"),
        ("unsupported suffix", c, {**ok, "suffix": "!"}, 400, "suffix"),
        ("unsupported best_of", c, {**ok, "best_of": 2}, 400, "best_of"),
        ("unknown parameter", c, {**ok, "frobnicate": 1}, 400, "frobnicate"),
        ("logprobs too many", c, {**ok, "logprobs": 50}, 400, "logprobs"),
        ("top_p out of range", c, {**ok, "top_p": 1.5}, 400, "top_p"),
        ("seed over 64 bits", c, {**ok, "seed": 2**70}, 400, "seed"),
        ("negative seed", c, {**ok, "seed": -5}, 400, "seed"),
        ("top_k over 64 bits", c, {**ok, "top_k": 2**64}, 400, "top_k"),
        ("stop of the wrong type", c, {**ok, "stop": [1]}, 400, "stop"),
        ("greedy n > 1", c, {**ok, "temperature": 0, "n": 2}, 400, "n"),
        ("stream_options without stream", c, {**ok, "stream_options": {"include_usage": True}},
         400, "stream_options"),
        ("missing prompt", c, {"model": "tiny-qwen2"}, 400, "prompt"),
        ("unsupported functions", ch, {"messages": msgs, "functions": []}, 400, "functions"),
        ("invalid JSON schema", ch, {"messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         400, "response_format"),
        ("json_schema without a schema", ch, {"messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
        ("unknown response_format type", ch, {"messages": msgs, "response_format": {
            "type": "yaml"}}, 400, "response_format"),
        ("invalid regex", c, {**ok, "guided_regex": "[a-"}, 400, "guided_regex"),
        ("invalid grammar", c, {**ok, "guided_grammar": "start: undefined_rule"}, 400,
         "guided_grammar"),
        ("regex that matches no text", c, {**ok, "guided_regex": "[^\\x00-\\x{10FFFF}]"}, 400,
         "guided_regex"),
        ("empty choice", c, {**ok, "guided_choice": []}, 400, "guided_choice"),
        ("unknown structured_outputs key", c, {**ok, "structured_outputs": {"regex": "a",
                                                                            "foo": 1}},
         400, "structured_outputs"),
        ("the validated grammar from the client", c, {**ok, "structured_outputs": {
            "regex": "a", "_grammar": "start: /[^a]*/"}}, 400, "structured_outputs"),
        ("two constraints", c, {**ok, "guided_regex": "a+", "guided_choice": ["a"]}, 400,
         "guided_choice"),
        ("whitespace pattern alone", c, {**ok, "guided_whitespace_pattern": " "}, 400,
         "guided_whitespace_pattern"),
        ("prompt_logprobs with stream", c, {**ok, "prompt_logprobs": 1, "stream": True}, 400,
         "prompt_logprobs"),
        ("prompt_logprobs too many", c, {**ok, "prompt_logprobs": 50}, 400, "prompt_logprobs"),
        ("tool_choice without tools", ch, {"messages": msgs, "tool_choice": "required"}, 400,
         "tool_choice"),
        ("tool_choice naming an unknown function", ch, {
            "messages": msgs, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
         "tool_choice"),
        ("named tool_choice without a name", ch, {
            "messages": msgs, "tools": [tool],
            "tool_choice": {"type": "function", "function": {}}}, 400, "tool_choice"),
        ("tool name that breaks the call markup", ch, {"messages": msgs, "tools": [
            {"type": "function", "function": {"name": 'f"}</tool_call>'}}]}, 400, "tools"),
        ("bad tool_choice", ch, {"messages": msgs, "tools": [tool], "tool_choice": "always"},
         400, "tool_choice"),
        ("tool without a name", ch, {"messages": msgs, "tools": [{"type": "function",
                                                                  "function": {}}]},
         400, "tools"),
        ("required tool_choice and a response_format", ch, {
            "messages": msgs, "tools": [tool], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, "tool_choice"),
        ("tool call arguments that are not JSON", ch, {"messages": [
            *msgs, {"role": "assistant", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": "{oops"}}]}]}, 400, "messages"),
        ("bad role", ch, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        ("no messages", ch, {"messages": []}, 400, "messages"),
        ("image part", ch, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
        ("10 MB body", c, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413, None),
        # Lone UTF-16 surrogates: valid JSON escapes, but no text.
        ("lone surrogate in prompt", c, {**ok, "prompt": "a\ud800b"}, 400, "prompt"),
        ("lone surrogate in a prompt list", c, {**ok, "prompt": ["hi", "\udfff"]}, 400,
         "prompt"),
        ("lone surrogate in chat content", ch, {"messages": [{"role": "user",
                                                             "content": "\ud800"}]},
         400, "messages"),
        ("lone surrogate in stop", c, {**ok, "stop": ["ok", "\ud800"]}, 400, "stop"),
        ("lone surrogate in model", c, {**ok, "model": "\ud800"}, 400, "model"),
        ("lone surrogate in a logit_bias key", c, {**ok, "logit_bias": {"\ud800": 1.0}}, 400,
         "logit_bias"),
        ("lone surrogate in /tokenize", "/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
        ("lone surrogate in /tokenize messages", "/tokenize", {"messages": [
            {"role": "user", "content": "\udbff"}]}, 400, "messages"),
        # The JSON parser recurses once per level.
        ("JSON nested 10,000 deep", c, b'{"prompt": ' + nested + b"}", 400, None),
        ("JSON nested 10,000 deep to /tokenize", "/tokenize", b'{"prompt": ' + nested + b"}",
         400, None),
        # The field at fault is named.
        ("stop_token_ids outside the vocabulary", c, {**ok, "stop_token_ids": [10**7]}, 400,
         "stop_token_ids"),
        ("zero max_completion_tokens", ch, {"messages": msgs, "max_completion_tokens": 0}, 400,
         "max_completion_tokens"),
        ("max_completion_tokens over the context", ch, {"messages": msgs,
                                                        "max_completion_tokens": 10**6},
         400, "max_completion_tokens"),
        # logit_bias keys are token ids in canonical ASCII digits, nothing int() also reads.
        ("logit_bias key with spaces", c, {**ok, "logit_bias": {" 5 ": 1.0}}, 400,
         "logit_bias"),
        ("logit_bias key in Arabic-Indic digits", c, {**ok, "logit_bias": {"\u0661\u0662": 1.0}},
         400, "logit_bias"),
        ("logit_bias key in superscript", c, {**ok, "logit_bias": {"\u00b2": 1.0}}, 400,
         "logit_bias"),
        ("logit_bias key of 5,000 digits", c, {**ok, "logit_bias": {"9" * 5000: 1.0}}, 400,
         "logit_bias"),
        ("logit_bias key with a sign", c, {**ok, "logit_bias": {"+5": 1.0}}, 400, "logit_bias"),
        ("logit_bias key with a leading zero", c, {**ok, "logit_bias": {"05": 1.0}}, 400,
         "logit_bias"),
        # A template from the request is the client's code: refused without the trust flag.
        ("chat template in chat_template_kwargs", ch, {
            "messages": msgs, "chat_template_kwargs": {"chat_template": slow_template}}, 400,
         "chat_template_kwargs"),
        ("chat template as a request field", ch, {"messages": msgs,
                                                  "chat_template": slow_template}, 400,
         "chat_template"),
        ("tokenize in chat_template_kwargs", ch, {"messages": msgs,
                                                  "chat_template_kwargs": {"tokenize": True}},
         400, "chat_template_kwargs"),
        ("add_generation_prompt in chat_template_kwargs", ch, {
            "messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}}, 400,
         "chat_template_kwargs"),
    ]


def while_polling_health(server, work):
    """(work()'s result, the /health latencies measured while it ran: every 50 ms, each
    answer within 30 s)."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            status, _ = http("GET", server.url + "/health", timeout=30)
            assert status == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = work()
    finally:
        done.set()
        poller.join()
    return result, latencies
