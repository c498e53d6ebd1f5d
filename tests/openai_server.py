"""A `jaxllm serve` subprocess for tests: loopback only, a free port, bounded waits, stopped
(SIGTERM, then SIGKILL) by the caller's fixture."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60.0
         ) -> tuple[int, bytes]:
    """(status, body) of one request, errors included (urllib raises on 4xx/5xx)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
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
