"""Several hosts on one machine: two processes with two virtual CPU devices
each join jax.distributed over 127.0.0.1 (gloo collectives) and run TP = 4 across both; process
0 runs the engine core (in its own process, under a frontend), process 1 follows its broadcast
step inputs. Same greedy tokens as one process at TP = 1; a killed follower gives the frontend
EngineDeadError within seconds instead of a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.distributed.tp_multihost_child import ENGINE, PROMPTS, sampling_params
from tests.utils import save_tiny_checkpoint

CHILD = Path(__file__).with_name("tp_multihost_child.py")
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(port: int, process_id: int) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS="--xla_force_host_platform_device_count=2",
                PYTHONPATH=str(CHILD.parents[2]),
                JAXLLM_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAXLLM_NUM_PROCESSES="2",
                JAXLLM_PROCESS_ID=str(process_id))


def _follower_cmd(path: Path) -> list[str]:
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.multihost_follower", "--model", str(path),
           "--tensor-parallel-size", "4"]
    for key, value in ENGINE.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False:
            cmd.append("--no-" + key.replace("_", "-"))
        else:
            cmd += [flag, str(value)]
    return cmd


def test_two_processes_tp4_match_tp1_and_a_dead_follower_fails_fast(tmp_path):
    from jaxllm import LLM

    path = tmp_path / "ckpt"
    save_tiny_checkpoint(path, tied=False, seed=3, num_attention_heads=8, num_key_value_heads=4)
    out, go = tmp_path / "out.json", tmp_path / "go"
    ready = Path(str(out) + ".ready")
    port = _free_port()
    follower = subprocess.Popen(_follower_cmd(path), env=_env(port, 1),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    leader = subprocess.Popen([sys.executable, str(CHILD), str(path), str(out),
                               "--then-wait-for", str(go)], env=_env(port, 0),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            assert leader.poll() is None and follower.poll() is None, (
                (leader.poll() and leader.communicate()[0][-3000:]),
                (follower.poll() and follower.communicate()[0][-3000:]))
            assert time.monotonic() < deadline, "the two-process engine did not come up"
            time.sleep(0.1)
        first = json.loads(out.read_text())["first"]
        follower.send_signal(signal.SIGKILL)
        follower_log = follower.communicate(timeout=10)[0]
        killed = time.monotonic()
        go.write_text("go")
        rc = leader.wait(timeout=30)  # fails, never hangs
        failed_after = time.monotonic() - killed
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "tokens" in first, first
    assert "while serving" not in follower_log, follower_log[-2000:]
    after = json.loads(out.read_text())["after_kill"]
    # The engine core (process 0, in its own process) fails on its next collective or is ended
    # by JAX's coordination service; the frontend sees it dead, within seconds, no hang.
    assert rc == 3 and after["error"].startswith("EngineDeadError"), after
    assert after["seconds"] < 20 and failed_after < 30
    print(f"EngineDeadError {after['seconds']:.2f} s after the request, core process ended "
          f"{failed_after:.1f} s after the kill")

    llm = LLM(model=str(path), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling_params(),
                        use_tqdm=False)
    assert first["tokens"] == [o.outputs[0].token_ids for o in outs]
    # Prompt logprobs: the followers replay the prompt-statistics executable too.
    want = [[lp[tok].logprob for lp, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:],
                                                strict=True)] for o in outs]
    for got, ref in zip(first["prompt_logprobs"], want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
