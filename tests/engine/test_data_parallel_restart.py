"""Data parallelism on one host: an engine-core process that dies is started again and rejoins.

Two cores on CPU (tiny-qwen2): the requests a killed core held fail, its replacement (a new
process for the same core index) then serves requests with the tokens of one core in process,
and the server's /health and /metrics show it back; a shutdown while a replacement starts
leaves no process. (A core that stays dead with data_parallel_max_restarts=0:
test_data_parallel.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import psutil
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine import EngineDeadError
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.dp_client import DPLBClient, DPRouter
from tests.engine.dp_cases import (
    ENGINE,
    PROMPTS,
    alive,
    collect,
    core_children,
    params,
    reference_runner,
    routed,
    token_prompt,
    wait_until,
)
from tests.server.openai_server import http, metric, serve_tiny

# A replacement loads and compiles the model again (seconds for tiny-qwen2, more on a busy host).
RESTART_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def reference():
    """One core, in this process: the tokens (and text) every data-parallel run must give."""
    yield from reference_runner()


def test_router_forgets_a_rejoined_core():
    r = DPRouter(2, block_size=16, load_margin=2)
    prefix = list(range(32))
    hashes = r.prefix_hashes(prefix + [1])
    r.add("p0", 1, hashes)
    r.add("0_par", 1, [])
    r.add("a", 0, [])
    r.reset_engine(1)
    assert r.loads == [1, 0] and set(r.request_core) == {"a"}
    r.add("b", 0, [])
    r.add("x", 1, [])
    r.add("y", 1, [])
    assert r.loads == [2, 2] and r.routed == [2, 4]  # core 0: the least loaded by routed
    # Neither the prefix nor the n > 1 parent is on core 1 any more (its cache is empty).
    assert r.pick("p1", r.prefix_hashes(prefix + [2]), [0, 1]) == 0
    assert r.pick("1_par", [], [0, 1]) == 0
    # What is not forgotten still counts.
    r.add("p2", 1, r.prefix_hashes(prefix + [3]))
    assert r.pick("p3", r.prefix_hashes(prefix + [4]), [0, 1]) == 1


def _rejoined(client: DPLBClient, i: int, old_pid: int) -> bool:
    state = client.engine_states()[i]
    return state.alive and state.pid != old_pid


def test_killed_core_restarts_and_serves_again(reference):
    sps = [params(i) for i in range(len(PROMPTS))]
    want = reference(PROMPTS, sps)
    long_sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main() -> list[int]:
        engine = AsyncLLM("tiny-qwen2", data_parallel_size=2, **ENGINE)
        client = engine.engine_core
        assert isinstance(client, DPLBClient)
        pids = client.core_pids
        try:
            # Four long requests, two per core; core 1 is stopped once each has a token (so its
            # requests are surely unfinished), then killed.
            gens = [engine.generate(token_prompt([2000 + i, 5, 6]), long_sp, f"long{i}")
                    for i in range(4)]
            assert not any([(await asyncio.wait_for(anext(g), 60)).finished for g in gens])
            os.kill(pids[1], signal.SIGSTOP)
            on_core = dict(client.router.request_core)
            os.kill(pids[1], signal.SIGKILL)

            async def rest(g):
                try:
                    async for out in g:
                        if out.finished:
                            return len(out.outputs[0].token_ids)
                except EngineDeadError as e:
                    return str(e)

            ends = await asyncio.wait_for(asyncio.gather(*[rest(g) for g in gens]), 60)
            for i, end in enumerate(ends):
                if on_core[f"long{i}"] == 1:
                    assert "data-parallel engine core 1 died" in str(end), (on_core, ends)
                else:
                    assert end == 100, (on_core, ends)
            assert sorted(on_core.values()) == [0, 0, 1, 1]
            # The replacement: a new process for core 1, its restart counted.
            deadline = time.monotonic() + RESTART_TIMEOUT_S
            while not _rejoined(client, 1, pids[1]):
                assert time.monotonic() < deadline, client.engine_states()
                await asyncio.sleep(0.1)
            states = client.engine_states()
            assert [s.restarts for s in states] == [0, 1] and states[0].pid == pids[0]
            assert client.num_live_engines == 2 and not engine.errored
            assert not alive(pids[1]) and alive(states[1].pid)
            # Both cores serve new requests, with one core's tokens.
            before = routed(client)
            got = await asyncio.wait_for(asyncio.gather(*[
                collect(engine, p, sp, f"again{i}")
                for i, (p, sp) in enumerate(zip(PROMPTS, sps, strict=True))]), 120)
            assert got == want
            served = [b - a for a, b in zip(before, routed(client), strict=True)]
            assert min(served) >= 2, served
            assert client.router.loads == [0, 0]
            states = await client.call_utility_async("get_scheduler_state")
            assert [s["num_requests"] for s in states] == [0, 0], states
            return [*pids, client.core_pids[1]]
        finally:
            engine.shutdown()

    pids = asyncio.run(main())
    assert not any(alive(p) for p in pids)


def test_shutdown_while_a_core_restarts():
    def cores() -> set[int]:  # other tests' engines may hold cores of their own meanwhile
        return set(core_children(psutil.Process(), recursive=True))

    before = cores()
    llm = LLM("tiny-qwen2", data_parallel_size=2, **ENGINE)
    try:
        client = llm.llm_engine.engine_core_client
        assert isinstance(client, DPLBClient)
        pids = client.core_pids
        os.kill(pids[1], signal.SIGKILL)
        # The replacement's process is up, its model not yet ready.
        wait_until(lambda: len(cores() - before - set(pids)) == 1)
        (new,) = cores() - before - set(pids)
        assert client.engine_states()[1].restarts == 1
        assert not client.engine_states()[1].alive
    finally:
        t = time.monotonic()
        llm.llm_engine.shutdown()
    assert time.monotonic() - t < 60
    # The start was abandoned and waited for: no restart thread, no process left.
    assert not [t for t in threading.enumerate() if t.name.startswith("EngineCoreRestart")]
    assert not any(alive(p) for p in [*pids, new]) and not psutil.pid_exists(new)
    assert not cores() - before
    assert client.core_pids[1] == pids[1]  # it never rejoined


# --- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory.mktemp("serve_dp_restart"), ENGINE["max_model_len"],
                          "--data-parallel-size", "2", "--max-num-seqs", "32",
                          "--max-num-batched-tokens", "128", "--num-kv-blocks", "256",
                          "--data-parallel-max-restarts", "1")


def test_server_health_and_metrics_show_the_rejoined_core(server, reference):
    pids = sorted(core_children(psutil.Process(server.proc.pid)))
    assert len(pids) == 2
    health = json.loads(http("GET", server.url + "/health")[1])
    core = next(e["engine"] for e in health["engines"] if e["pid"] == pids[1])
    assert [e["restarts"] for e in health["engines"]] == [0, 0]
    os.kill(pids[1], signal.SIGKILL)

    def back() -> bool:
        status, body = http("GET", server.url + "/health")
        engines = json.loads(body)["engines"]
        return status == 200 and engines[core]["alive"] and engines[core]["pid"] != pids[1]

    wait_until(back, timeout=RESTART_TIMEOUT_S)
    health = json.loads(http("GET", server.url + "/health")[1])
    assert health["num_live_engines"] == 2, health
    assert [e["restarts"] for e in health["engines"]] == [int(i == core) for i in range(2)]
    assert metric(server, "jaxllm:num_engines_alive") == 2
    assert metric(server, "jaxllm:engine_alive", f'engine="{core}"') == 1
    assert metric(server, "jaxllm:engine_restarts_total", f'engine="{core}"') == 1
    assert metric(server, "jaxllm:engine_restarts_total", f'engine="{1 - core}"') == 0
    # The replacement serves, with one core's text.
    before = metric(server, "jaxllm:engine_requests_routed", f'engine="{core}"')
    prompts = [PROMPTS[i % len(PROMPTS)] + [3100 + i] for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [text for _, text in reference(prompts, [sp] * len(prompts))]

    async def main() -> list[str]:
        import openai

        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                     timeout=120)
        try:
            outs = await asyncio.gather(*[
                aclient.completions.create(model="tiny-qwen2", prompt=p, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
                for p in prompts])
        finally:
            await aclient.close()
        return [o.choices[0].text for o in outs]

    assert asyncio.run(main()) == want
    assert metric(server, "jaxllm:engine_requests_routed", f'engine="{core}"') - before >= 2
