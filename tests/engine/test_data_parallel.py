"""Data parallelism on one host: two engine-core processes behind one frontend (DPLBClient).

Against one core (in process, the same settings): the same greedy and seeded tokens per request,
offline, with AsyncLLM and through the server's OpenAI API; requests spread over the cores, n > 1
siblings and prefix-sharing requests kept on one; a killed core fails only its own requests
while the other serves on, and /health says which lives (with data_parallel_max_restarts=0 it
stays dead; its restart: test_data_parallel_restart.py); a core that cannot start fails the
start; shutdown leaves no process. Each engine of this module is started once (tiny-qwen2: a
start is seconds)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import openai
import psutil
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine import EngineDeadError
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.dp_client import DPLBClient, DPRouter
from jaxllm.sampling_params import StructuredOutputsParams
from tests.engine.dp_cases import (
    ENGINE,
    MAX_TOKENS,
    PREFIX,
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
from tests.server.openai_server import http, metric, serve_tiny, stream_text


@pytest.fixture(scope="module")
def reference():
    """One core, in this process: the tokens (and text) every data-parallel run must give."""
    yield from reference_runner()


# --- routing, without processes ---------------------------------------------------------------


def test_router_load_prefix_siblings_and_margin():
    r = DPRouter(2, block_size=16, load_margin=2)
    live = [0, 1]
    prefix = list(range(32))
    assert r.prefix_hashes(prefix[:15]) == [] and len(r.prefix_hashes(prefix * 9)) == 8

    def add(rid: str, tokens: list[int], alive: list[int] = live) -> int:
        hashes = r.prefix_hashes(tokens)
        core = r.pick(rid, hashes, alive)
        r.add(rid, core, hashes)
        return core

    # No shared prefix: the least-loaded core, then the one routed to less.
    assert [add(f"a{i}", [i]) for i in range(4)] == [0, 1, 0, 1]
    # A shared prefix follows its first request while the load gap stays within the margin.
    first = add("p0", prefix + [1])
    assert [add(f"p{i}", prefix + [i + 1]) for i in range(1, 3)] == [first, first]
    assert add("p3", prefix + [9]) == 1 - first  # 3 more than the other: over the margin
    # The longest known prefix wins: one block in common with `prefix` only.
    assert add("q", prefix[:16] + [99] * 16) in (0, 1)
    # An n > 1 request's later sequences follow its first, whatever the load.
    core = add("0_par", [5])
    assert [add(f"{i}_par", [5]) for i in (1, 2, 3)] == [core] * 3
    # Finished and aborted requests leave the load; a dead core's are dropped and skipped.
    assert r.remove("a0") == 0 and r.remove("a0") is None
    held = set(r.drop_engine(1))
    assert held and all(r.request_core.get(rid) is None for rid in held)
    assert r.loads[1] == 0 and add("p9", prefix + [7], alive=[0]) == 0


def test_launch_config(monkeypatch):
    monkeypatch.setenv("JAXLLM_ENABLE_V1_MULTIPROCESSING", "0")
    launch = EngineArgs(data_parallel_size=2, tensor_parallel_size=2).create_launch_config()
    assert launch.multiprocess_mode  # whatever else says otherwise: a process per core
    assert (launch.parallel_config.data_parallel_size,
            launch.parallel_config.tensor_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="only core of its host"):
        EngineArgs(data_parallel_size=2, coordinator_address="10.0.0.1:1234", num_processes=2,
                    process_id=0).create_launch_config()
    # A core that spans two hosts, one device of its model on each.
    parallel = EngineArgs(data_parallel_size=2, data_parallel_size_local=1,
                          tensor_parallel_size=2, coordinator_address="10.0.0.1:1234",
                          num_processes=2, process_id=0).create_launch_config().parallel_config
    assert parallel.multihost and parallel.local_devices == 1


# --- offline ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dp_llm():
    llm = LLM("tiny-qwen2", data_parallel_size=2, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_offline_same_tokens_as_one_core(dp_llm, reference):
    client = dp_llm.llm_engine.engine_core_client
    assert isinstance(client, DPLBClient) and len(set(client.core_pids)) == 2
    assert dp_llm.llm_engine.launch_config.multiprocess_mode
    # Each core has its own grammar manager: two constrained requests, one per core.
    constrained = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(regex="[a-z]{2,5}")),
        SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    prompts = PROMPTS + PROMPTS[:2]
    sps = [params(i) for i in range(len(PROMPTS))] + constrained
    outs = dp_llm.generate([token_prompt(p) for p in prompts], sps, use_tqdm=False)
    got = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    assert got == reference(prompts, sps)
    assert re.fullmatch("[a-z]{2,5}", got[-2][1]) and got[-1][1] in ("yes", "no"), got[-2:]
    # Utility calls answer per core; the engine's info is core 0's.
    states = dp_llm.llm_engine.engine_core_client.call_utility("get_scheduler_state")
    assert len(states) == 2 and all(s["num_requests"] == 0 for s in states)
    assert dp_llm.llm_engine.num_kv_blocks == ENGINE["num_kv_blocks"]


def test_load_is_spread(dp_llm):
    client = dp_llm.llm_engine.engine_core_client
    before = routed(client)
    prompts = [token_prompt([1000 + i, 7, 8, 9]) for i in range(64)]
    outs = dp_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    served = [b - a for a, b in zip(before, routed(client), strict=True)]
    assert sum(served) == 64 and min(served) > 64 // 4, served
    assert [e.num_requests for e in client.engine_states()] == [0, 0]


def test_prefix_sharing_requests_land_on_one_core(dp_llm):
    client = dp_llm.llm_engine.engine_core_client
    before = routed(client)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # The first one alone computes the prefix; the others then find it in that core's cache.
    dp_llm.generate([token_prompt(PREFIX + [1, 2, 3])], sp, use_tqdm=False)
    outs = dp_llm.generate([token_prompt(PREFIX + [4 + i] * (i + 1)) for i in range(5)], sp,
                           use_tqdm=False)
    served = sorted(b - a for a, b in zip(before, routed(client), strict=True))
    assert served == [0, 6]
    assert all(o.num_cached_tokens >= 32 for o in outs), [o.num_cached_tokens for o in outs]


def test_siblings_stay_on_one_core(dp_llm, reference):
    client = dp_llm.llm_engine.engine_core_client
    before = routed(client)
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True)
    out = dp_llm.generate(token_prompt(PROMPTS[0]), sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    served = sorted(b - a for a, b in zip(before, routed(client), strict=True))
    assert served == [0, 3]


def test_offline_dead_core_and_shutdown(dp_llm, reference):
    """A core killed while idle: new requests go to the other one; shutdown ends both."""
    client = dp_llm.llm_engine.engine_core_client
    pids = client.core_pids
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: client.num_live_engines == 1)
    sps = [params(i) for i in range(4)]
    outs = dp_llm.generate([token_prompt(p) for p in PROMPTS[:4]], sps, use_tqdm=False)
    assert [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs] == \
        reference(PROMPTS[:4], sps)
    dp_llm.llm_engine.shutdown()
    assert not any(alive(p) for p in pids)


def test_a_core_that_cannot_start_fails_the_start(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a checkpoint that is not one

    def cores() -> set[int]:  # other tests' engines may hold cores of their own meanwhile
        return set(core_children(psutil.Process(), recursive=True))

    before = cores()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to start") as e:
        LLM(str(tmp_path), data_parallel_size=2, skip_tokenizer_init=True, **ENGINE)
    assert "num_attention_heads" in str(e.value)  # the core's own error
    assert time.monotonic() - t < 120
    assert not cores() - before


def test_data_and_tensor_parallel(reference):
    """DP = 2 x TP = 2: each core a process with two virtual CPU devices."""
    llm = LLM("tiny-qwen2", data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    try:
        info = llm.llm_engine.core_info
        assert info.config.tensor_parallel_size == 2
        sps = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 4
        outs = llm.generate([token_prompt(p) for p in PROMPTS[:4]], sps, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == \
            [t for t, _ in reference(PROMPTS[:4], sps)]
    finally:
        llm.llm_engine.shutdown()


def test_speculative_decoding_on_each_core(reference):
    """n-gram drafts on both cores: the greedy tokens of one core without them."""
    llm = LLM("tiny-qwen2", data_parallel_size=2, **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        # Repeating prompts: the tiny model continues them, so prompt lookup finds drafts.
        prompts = [[300 + i, 301 + i, 302 + i] * 6 for i in range(6)]
        sps = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 6
        outs = llm.generate([token_prompt(p) for p in prompts], sps, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == \
            [t for t, _ in reference(prompts, sps)]
        client = llm.llm_engine.engine_core_client
        assert isinstance(client, DPLBClient) and min(routed(client)) > 0
        assert llm.llm_engine.core_info.config.speculative_config is not None
    finally:
        llm.llm_engine.shutdown()


# --- AsyncLLM -----------------------------------------------------------------------------------


def test_async_llm_same_tokens_and_a_killed_core(reference):
    sps = [params(i) for i in range(len(PROMPTS))]
    want = reference(PROMPTS, sps)
    long_sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        engine = AsyncLLM("tiny-qwen2", data_parallel_size=2, data_parallel_max_restarts=0,
                          **ENGINE)
        client = engine.engine_core
        assert isinstance(client, DPLBClient)
        pids = client.core_pids
        children = set(core_children(psutil.Process()))
        try:
            got = await asyncio.wait_for(asyncio.gather(*[
                collect(engine, p, sp, f"r{i}")
                for i, (p, sp) in enumerate(zip(PROMPTS, sps, strict=True))]), 120)
            assert got == want
            # An abort goes to the core that holds the request: right after it, neither core
            # holds one (each handles the abort before the state query sent after it).
            gens = [engine.generate(token_prompt([1500 + i, 5, 6]), long_sp, f"ab{i}")
                    for i in range(2)]
            assert not any([(await anext(g)).finished for g in gens])
            assert sorted(client.router.request_core[f"ab{i}"] for i in range(2)) == [0, 1]
            await engine.abort(["ab0", "ab1"])
            states = await client.call_utility_async("get_scheduler_state")
            assert [s["num_requests"] for s in states] == [0, 0], states
            for g in gens:
                outs = [o async for o in g]
                assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            assert client.router.loads == [0, 0]
            # Four long requests, two per core; once each has a token, core 0 is stopped (so
            # its requests are surely unfinished) and killed.
            gens = [engine.generate(token_prompt([2000 + i, 5, 6]), long_sp, f"long{i}")
                    for i in range(4)]
            firsts = [await anext(g) for g in gens]
            assert not any(o.finished for o in firsts)
            os.kill(pids[0], signal.SIGSTOP)
            on_core = dict(client.router.request_core)
            os.kill(pids[0], signal.SIGKILL)

            async def rest(g):
                try:
                    async for out in g:
                        if out.finished:
                            return len(out.outputs[0].token_ids)
                except EngineDeadError:
                    return "dead"

            ends = await asyncio.wait_for(asyncio.gather(*[rest(g) for g in gens]), 60)
            for i, end in enumerate(ends):
                assert end == ("dead" if on_core.get(f"long{i}") == 0 else 100), (on_core, ends)
            assert "dead" in ends and 100 in ends
            assert client.num_live_engines == 1 and not engine.errored
            # The other core serves every new request.
            again = await asyncio.wait_for(asyncio.gather(*[
                collect(engine, p, sp, f"again{i}")
                for i, (p, sp) in enumerate(zip(PROMPTS, sps, strict=True))]), 120)
            assert again == want
            # Not restarted: no new process, none counted, and it stays dead.
            assert not set(core_children(psutil.Process())) - children
            assert [e.restarts for e in client.engine_states()] == [0, 0]
            assert client.num_live_engines == 1
        finally:
            engine.shutdown()
        return pids

    pids = asyncio.run(main())
    assert not any(alive(p) for p in pids)


# --- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory.mktemp("serve_dp"), ENGINE["max_model_len"],
                          "--data-parallel-size", "2", "--max-num-seqs", "32",
                          "--max-num-batched-tokens", "128", "--num-kv-blocks", "256",
                          "--data-parallel-max-restarts", "0")


def core_pids(server) -> list[int]:
    return sorted(core_children(psutil.Process(server.proc.pid)))


def test_server_streams_same_as_one_core(server, reference):
    n = 64
    prompts = [PROMPTS[i % len(PROMPTS)] + [3000 + i] for i in range(n)]
    sps = [params(i) for i in range(n)]
    want = reference(prompts, sps)

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                     timeout=120)

        async def one(p, sp):
            stream = await aclient.completions.create(
                model="tiny-qwen2", prompt=p, max_tokens=sp.max_tokens, stream=True,
                temperature=sp.temperature, seed=sp.seed, extra_body={"ignore_eos": True})
            texts, reasons = {}, {}
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
                    reasons[c.index] = c.finish_reason or reasons.get(c.index)
            return texts[0], reasons[0]

        try:
            return await asyncio.wait_for(asyncio.gather(*[
                one(p, sp) for p, sp in zip(prompts, sps, strict=True)]), 180)
        finally:
            await aclient.close()

    got = asyncio.run(main())
    assert [t for t, _ in got] == [text for _, text in want]
    assert all(r == "length" for _, r in got)
    for i in range(2):
        assert metric(server, "jaxllm:engine_requests_routed", f'engine="{i}"') > n // 4
        assert metric(server, "jaxllm:engine_alive", f'engine="{i}"') == 1
    assert metric(server, "jaxllm:num_engines_alive") == 2
    status, body = http("GET", server.url + "/health")
    health = json.loads(body)
    assert status == 200 and health["num_live_engines"] == 2, health


def test_server_prefix_hits_on_one_core(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    before = [metric(server, "jaxllm:engine_requests_routed", f'engine="{i}"') for i in (0, 1)]
    hits0 = [metric(server, "jaxllm:prefix_cache_hits_total", f'engine="{i}"') for i in (0, 1)]
    for i in range(4):
        client.completions.create(model="tiny-qwen2", prompt=PREFIX + [7 + i], max_tokens=2)
    served = [metric(server, "jaxllm:engine_requests_routed", f'engine="{i}"') - b
              for i, b in zip((0, 1), before, strict=True)]
    assert sorted(served) == [0, 4]
    core = served.index(4)
    hits = [metric(server, "jaxllm:prefix_cache_hits_total", f'engine="{i}"') - h
            for i, h in zip((0, 1), hits0, strict=True)]
    assert hits[core] >= 3 * 32 and hits[1 - core] == 0, hits


def test_server_killed_cores(server):
    pids = core_pids(server)
    assert len(pids) == 2
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    streams = [client.completions.create(model="tiny-qwen2", prompt=[2500 + i, 5, 6],
                                         max_tokens=100, stream=True,
                                         extra_body={"ignore_eos": True})
               for i in range(4)]
    for s in streams:
        next(iter(s))  # each has a token: two in flight on each core
    os.kill(pids[0], signal.SIGKILL)
    ends = []
    for s in streams:
        try:
            _, reasons, _ = stream_text(s)
            ends.append(reasons.get(0))
        except openai.APIError:
            ends.append("dead")
    assert "dead" in ends and "length" in ends, ends
    status, body = http("GET", server.url + "/health")
    health = json.loads(body)
    assert status == 200 and health["num_live_engines"] == 1, health
    assert sorted(e["alive"] for e in health["engines"]) == [False, True]
    assert metric(server, "jaxllm:num_engines_alive") == 1
    # The live core serves every new request.
    for i in range(4):
        out = client.completions.create(model="tiny-qwen2", prompt=[40 + i], max_tokens=3)
        assert out.choices[0].finish_reason == "length"
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: http("GET", server.url + "/health")[0] == 503)
    status, body = http("POST", server.url + "/v1/completions",
                        {"model": "tiny-qwen2", "prompt": "hi", "max_tokens": 2})
    assert status == 503, body
    assert json.loads(http("GET", server.url + "/health")[1])["num_live_engines"] == 0
