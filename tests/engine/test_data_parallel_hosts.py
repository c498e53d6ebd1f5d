"""Data-parallel engine cores on other hosts: two process groups on 127.0.0.1, the frontend's
(its own core, rank 0) and a `jaxllm serve --headless` one whose cores join over TCP.

Against one core in process (test_data_parallel's reference): the same greedy and seeded tokens;
requests spread over every core; a killed remote core (heartbeats stop) fails only its own
requests; a frontend that dies takes the headless cores with it; refused and missing cores fail
the start with errors naming them, in bounded time; nothing is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.dp_client import DPLBClient
from tests.engine.dp_cases import (
    ENGINE,
    MAX_TOKENS,
    PROMPTS,
    alive,
    core_children,
    params,
    reference_runner,
    routed,
    token_prompt,
    wait_until,
)
from tests.server.openai_server import ROOT, ServerProcess, free_port, http

HEARTBEAT_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def reference():
    yield from reference_runner()


@pytest.fixture(autouse=True)
def _short_heartbeats(monkeypatch):
    monkeypatch.setenv("JAXLLM_DP_HEARTBEAT_TIMEOUT_S", str(HEARTBEAT_TIMEOUT_S))


class Headless:
    """`jaxllm serve --headless` in its own process group, with its log in a file."""

    def __init__(self, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), full_env.get("PYTHONPATH")) if p)
        full_env.update(env or {})
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxllm.entrypoints.cli.main", "serve", "--headless", *args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, start_new_session=True)

    def cores(self) -> list[int]:
        return sorted(core_children(psutil.Process(self.proc.pid)))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def headless_args(port: int, size: int, local: int, start: int) -> list[str]:
    return ["--data-parallel-size", str(size), "--data-parallel-size-local", str(local),
            "--data-parallel-start-rank", str(start), "--data-parallel-rpc-port", str(port)]


def test_settings_are_checked():
    with pytest.raises(ValueError, match=r"ranks \[2, 4\).*must lie in \[0, 3\)"):
        EngineArgs(data_parallel_size=3, data_parallel_start_rank=2,
                   data_parallel_size_local=2).create_launch_config()
    with pytest.raises(ValueError, match="backend 'ray' places every engine core"):
        EngineArgs(data_parallel_size=2, data_parallel_backend="ray",
                   data_parallel_size_local=1).create_launch_config()
    with pytest.raises(ValueError, match="data_parallel_backend"):
        EngineArgs(data_parallel_backend="k8s").create_launch_config()
    with pytest.raises(ValueError, match="data_parallel_rpc_port"):
        EngineArgs(data_parallel_rpc_port=70000)
    parallel = EngineArgs(data_parallel_size=4, data_parallel_size_local=1
                          ).create_launch_config().parallel_config
    assert (parallel.data_parallel_size_local, parallel.data_parallel_address) == \
        (1, "127.0.0.1")
    with pytest.raises(ValueError, match="wildcard"):
        EngineArgs(data_parallel_size=2, data_parallel_address="0.0.0.0").create_launch_config()
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        EngineArgs(data_parallel_backend="ray").create_launch_config()
    with pytest.raises(ValueError, match="first rank of a --headless host"):
        LLM("tiny-qwen2", data_parallel_size=2, data_parallel_start_rank=1, **ENGINE)


def test_two_hosts_same_tokens_a_killed_remote_core_and_shutdown(tmp_path, reference):
    """Ranks 1 and 2 on the headless "host", rank 0 beside the frontend."""
    port = free_port()
    host_b = Headless(tmp_path / "headless.log", "tiny-qwen2", *headless_args(port, 3, 2, 1))
    try:
        llm = LLM("tiny-qwen2", data_parallel_size=3, data_parallel_size_local=1,
                  data_parallel_rpc_port=port, **ENGINE)
        try:
            client = llm.llm_engine.engine_core_client
            assert isinstance(client, DPLBClient)
            remote = host_b.cores()
            assert len(remote) == 2 and sorted(client.core_pids[1:]) == remote
            assert core_children(psutil.Process()) == [client.core_pids[0]]
            # Each headless core keeps to its own CPU, as this host's cores do.
            cpus = [set(psutil.Process(p).cpu_affinity()) for p in remote]
            if len(os.sched_getaffinity(0)) >= 2:
                assert all(cpus) and not cpus[0] & cpus[1], cpus
            sps = [params(i) for i in range(len(PROMPTS))]
            prompts = PROMPTS + [[900 + i, 3, 4] for i in range(22)]
            sps += [params(i) for i in range(22)]
            outs = llm.generate([token_prompt(p) for p in prompts], sps, use_tqdm=False)
            assert [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs] == \
                reference(prompts, sps)
            assert min(routed(client)) >= 5, routed(client)
            # A remote core killed: its heartbeats stop, the frontend counts it as dead and
            # serves on with the other two.
            os.kill(client.core_pids[2], signal.SIGKILL)
            wait_until(lambda: client.num_live_engines == 2, timeout=HEARTBEAT_TIMEOUT_S + 30)
            assert "sent nothing for" in str(client.cores[2].dead)
            before = routed(client)
            outs = llm.generate([token_prompt(p) for p in PROMPTS[:6]], sps[:6],
                                use_tqdm=False)
            assert [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs] == \
                reference(PROMPTS[:6], sps[:6])
            assert routed(client)[2] == before[2]
            states = client.engine_states()
            assert [s.alive for s in states] == [True, True, False]
        finally:
            llm.llm_engine.shutdown()
        # The frontend's shutdown stops the headless cores; their launcher then exits.
        host_b.wait(30)
        assert not any(alive(p) for p in remote)
    finally:
        host_b.close()


def test_headless_cores_end_with_their_frontend(tmp_path):
    """The server and a headless host, over IPv6; the server killed outright: the remote core
    exits once the heartbeats stop, and its launcher with it."""
    port = free_port()
    host_b = Headless(tmp_path / "headless.log", *headless_args(port, 2, 1, 1),
                      "--data-parallel-address", "::1")
    server = None
    try:
        server = ServerProcess(["tiny-qwen2", "--no-show-progress", "--max-model-len", "128",
                                "--num-kv-blocks", "64", "--data-parallel-size", "2",
                                "--data-parallel-size-local", "1", "--data-parallel-address",
                                "::1", "--data-parallel-rpc-port", str(port)],
                               tmp_path / "server.log")
        status, body = http("GET", server.url + "/health")
        health = json.loads(body)
        assert status == 200 and health["num_live_engines"] == 2, health
        assert [e["pid"] for e in health["engines"]][1:] == host_b.cores()
        assert all(e["host"] for e in health["engines"])
        status, body = http("POST", server.url + "/v1/completions",
                            {"model": "tiny-qwen2", "prompt": [5, 6, 7], "max_tokens": 3})
        assert status == 200, body
        remote = host_b.cores()
        server.proc.kill()
        server.proc.wait()
        code = host_b.wait(HEARTBEAT_TIMEOUT_S + 30)
        assert code != 0, host_b.log()
        assert "the frontend sent nothing" in host_b.log()
        assert not any(alive(p) for p in remote)
    finally:
        host_b.close()
        if server is not None:
            server.stop()


def test_refused_and_missing_cores_fail_the_start(tmp_path, monkeypatch):
    """A core offering a rank nobody waits for and one started with another model are refused
    (they exit with the reason); the rank never offered fails the start at the deadline."""
    monkeypatch.setenv("JAXLLM_ENGINE_READY_TIMEOUT_S", "25")
    port = free_port()
    wrong_rank = Headless(tmp_path / "rank.log", "tiny-qwen2", *headless_args(port, 3, 1, 2))
    wrong_model = Headless(tmp_path / "model.log", "other-model", *headless_args(port, 2, 1, 1))
    try:
        t = time.monotonic()
        with pytest.raises(RuntimeError, match=r"core\(s\) \[1\] did not join the frontend "
                                               r"at tcp://127.0.0.1:\d+ within 25 s") as e:
            LLM("tiny-qwen2", data_parallel_size=2, data_parallel_size_local=1,
                data_parallel_rpc_port=port, **ENGINE)
        assert "--headless" in str(e.value)
        assert time.monotonic() - t < 60
        assert wrong_rank.wait(30) == 1 and wrong_model.wait(30) == 1
        assert "rank 2 is not one the frontend waits for" in wrong_rank.log()
        assert "started with model 'other-model'" in wrong_model.log()
        assert not core_children(psutil.Process(), recursive=True)
        # The port is free again.
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", port))
    finally:
        wrong_rank.close()
        wrong_model.close()


def engine_flags(engine: dict) -> list[str]:
    flags = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def test_a_core_that_spans_two_hosts(tmp_path, reference):
    """DP = 2 x TP = 2: rank 0 beside the frontend on two devices; rank 1 a jax.distributed job
    of two processes with one device each, its process 0 a headless core, its process 1 a
    multi-host follower."""
    port, coordinator = free_port(), free_port()
    job = {"JAXLLM_COORDINATOR_ADDRESS": f"127.0.0.1:{coordinator}",
           "JAXLLM_NUM_PROCESSES": "2"}
    host_b = Headless(tmp_path / "headless.log", "tiny-qwen2", *headless_args(port, 2, 1, 1),
                      "--tensor-parallel-size", "2", env={**job, "JAXLLM_PROCESS_ID": "0"})
    follower_log = open(tmp_path / "follower.log", "wb")
    follower = subprocess.Popen(
        [sys.executable, "-m", "jaxllm.entrypoints.multihost_follower", "--model", "tiny-qwen2",
         "--tensor-parallel-size", "2", *engine_flags(ENGINE)],
        env={**os.environ, **job, "JAXLLM_PROCESS_ID": "1",
             "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
             "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                           if p)},
        stdout=follower_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    try:
        llm = LLM("tiny-qwen2", data_parallel_size=2, data_parallel_size_local=1,
                  tensor_parallel_size=2, data_parallel_rpc_port=port, **ENGINE)
        try:
            client = llm.llm_engine.engine_core_client
            assert isinstance(client, DPLBClient)
            assert llm.llm_engine.core_info.config.tensor_parallel_size == 2
            prompts = PROMPTS + [[700 + i, 8, 9] for i in range(8)]
            sps = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * \
                len(prompts)
            outs = llm.generate([token_prompt(p) for p in prompts], sps, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == \
                [t for t, _ in reference(prompts, sps)]
            assert min(routed(client)) >= 4, routed(client)
        finally:
            llm.llm_engine.shutdown()
        # Rank 1's process 0 stops, and tells its follower to.
        assert host_b.wait(60) == 0, host_b.log()
        assert follower.wait(60) == 0, (tmp_path / "follower.log").read_text()[-3000:]
    finally:
        host_b.close()
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait()
        follower_log.close()
