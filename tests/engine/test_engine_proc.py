"""The engine core in its own process: SyncMPClient / AsyncMPClient give the same tokens as
InprocClient, AsyncLLM streams, cancellation frees blocks, a dead core or parent never leaves
anyone hanging, and shutdown / garbage collection leave no process and no socket behind.

Every engine here is the tiny random Qwen2 with the real tokenizer (`tiny-qwen2`); every wait is
bounded."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pytest

from jaxllm import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from jaxllm.config import MP_ENV_VAR, UsageContext, resolve_multiprocess_mode
from jaxllm.engine import EngineDeadError
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.mp_client import AsyncMPClient, SyncMPClient

ENGINE_KW = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64,
                 num_kv_blocks=96, show_progress=False)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_path():
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    return str(tiny_qwen2_path())


@pytest.fixture(scope="module")
def engines(tiny_path):
    """{"inproc": LLM, "mp": LLM}; a test may take one out (and end it)."""
    d = {"inproc": LLM(tiny_path, multiprocess_mode=False, **ENGINE_KW),
         "mp": LLM(tiny_path, multiprocess_mode=True, **ENGINE_KW)}
    yield d
    for llm in d.values():
        llm.llm_engine.shutdown()


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


def _requests(tok) -> tuple[list, list[SamplingParams]]:
    prompts = ["The quick brown fox", "def fib(n):", {"prompt_token_ids": [1, 2, 3, 4, 5]},
               "Once upon a time", "import numpy as np", "hello"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2,
                             ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=10, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=10, ignore_eos=True)]
    return prompts, params


def _close(a: float | None, b: float | None) -> bool:
    return (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-4 * max(1, abs(a)))


def _logprobs_equal(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        (x is None) == (y is None) and (x is None or (
            list(x) == list(y) and all(_close(x[t].logprob, y[t].logprob)
                                       and x[t].rank == y[t].rank for t in x)))
        for x, y in zip(a, b, strict=True))


def assert_same(a, b) -> None:
    """Token for token (and text, endings, logprobs to float noise) the same RequestOutput."""
    assert a.prompt_token_ids == b.prompt_token_ids
    assert _logprobs_equal(a.prompt_logprobs, b.prompt_logprobs)
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert (x.index, x.token_ids, x.text) == (y.index, y.token_ids, y.text)
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert _close(x.cumulative_logprob, y.cumulative_logprob)
        assert _logprobs_equal(x.logprobs, y.logprobs)


def test_make_client_and_mode_resolution(engines, monkeypatch):
    from jaxllm.engine.core_client import InprocClient

    assert isinstance(engines["inproc"].llm_engine.engine_core_client, InprocClient)
    assert isinstance(engines["mp"].llm_engine.engine_core_client, SyncMPClient)
    monkeypatch.delenv(MP_ENV_VAR, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    llm = UsageContext.LLM_CLASS
    assert resolve_multiprocess_mode(True, llm) and not resolve_multiprocess_mode(False, llm)
    monkeypatch.setenv(MP_ENV_VAR, "0")  # the env var wins over the argument
    assert not resolve_multiprocess_mode(True, llm)
    monkeypatch.setenv(MP_ENV_VAR, "1")
    assert resolve_multiprocess_mode(False, llm)
    monkeypatch.setenv(MP_ENV_VAR, "yes")
    with pytest.raises(ValueError, match=MP_ENV_VAR):
        resolve_multiprocess_mode(None, llm)
    with pytest.raises(ValueError, match="multiprocess_mode"):
        EngineArgs(multiprocess_mode="on")


def test_sync_mp_parity(engines):
    inproc, mp = engines["inproc"], engines["mp"]
    prompts, params = _requests(inproc.tokenizer)
    want = inproc.generate(prompts, params, use_tqdm=False)
    got = mp.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
    assert len(got[2].outputs) == 3 and got[3].prompt_logprobs is not None
    a, b = mp.llm_engine.core_info, inproc.llm_engine.core_info
    # The same resolved config but for the mode each was asked for.
    assert a.config.launch_config.multiprocess_mode
    assert not b.config.launch_config.multiprocess_mode
    launch = dataclasses.replace(a.config.launch_config, multiprocess_mode=False)
    assert msgspec.structs.replace(
        a, compile_time_s=0, config=dataclasses.replace(a.config, launch_config=launch)) == \
        msgspec.structs.replace(b, compile_time_s=0)
    # Utility calls travel too; every block is free again.
    free, usable = mp.llm_engine.engine_core_client.call_utility("get_kv_block_counts")
    assert free == usable == ENGINE_KW["num_kv_blocks"] - 1
    # The model runner's methods too (collective_rpc): steps ran, each in a compiled shape.
    shapes = mp.collective_rpc("get_step_shape_counts")
    assert shapes and all(steps > 0 for _, _, steps in shapes)
    assert {(num_tokens, max_query_len) for num_tokens, max_query_len, _ in shapes} \
        <= {tuple(s) for s in a.bucket_shapes}
    with pytest.raises(RuntimeError, match="engine core"):
        mp.collective_rpc("time_weight_matmuls", ("not a list",))  # raises inside the core
    with pytest.raises(RuntimeError, match="no public method 'nope'"):
        mp.collective_rpc("nope")


def test_test_utility_calls_agree_across_modes(engines):
    """What tests read of the core and runner (scheduler state, compile count, a step's HLO and
    memory analysis, the KV array) arrives over the wire as it is in process."""
    inproc, mp = engines["inproc"], engines["mp"]
    kw = ENGINE_KW
    got = {}
    for name, llm in (("inproc", inproc), ("mp", mp)):
        state = llm.llm_engine.engine_core_client.call_utility("get_scheduler_state")
        assert state == {"num_free_blocks": kw["num_kv_blocks"] - 1,
                         "num_usable_blocks": kw["num_kv_blocks"] - 1, "num_requests": 0,
                         "num_waiting_reqs": 0, "num_running_reqs": 0,
                         "num_waiting_for_grammar": 0, "num_grammars_compiled": 0,
                         "num_spec_drafts": 0, "num_spec_draft_tokens": 0,
                         "num_spec_accepted_tokens": 0,
                         "num_preemptions": state["num_preemptions"]}
        kv = llm.collective_rpc("get_kv_cache_info")
        assert kv["num_blocks"] == kw["num_kv_blocks"] and kv["shape"][3] == kv["num_blocks"]
        assert kv["nbytes"] == math.prod(kv["shape"]) * 4 and kv["dtype"] == "float32"
        count = llm.collective_rpc("get_compile_count")
        assert isinstance(count, int) and count > 0  # warm-up compiled every bucket
        hlo = llm.collective_rpc("get_compiled_hlo", [1, 1])
        assert hlo.startswith("HloModule")
        memory = llm.collective_rpc("get_memory_analysis", (1, 1))
        assert set(memory) == {"argument", "output", "alias", "temp", "generated_code"}
        assert all(isinstance(v, int) for v in memory.values())
        assert memory["alias"] >= kv["nbytes"]  # the donated KV array is updated in place
        got[name] = (kv, memory)
    assert got["inproc"] == got["mp"]
    # A step shape that was not compiled is named, in either mode.
    with pytest.raises(ValueError, match=r"no compiled step of shape \(num_tokens=3"):
        inproc.collective_rpc("get_compiled_hlo", [3, 3])
    with pytest.raises(RuntimeError, match=r"ValueError: no compiled step of shape"):
        mp.collective_rpc("get_memory_analysis", [3, 3])


def test_sync_mp_stop_strings(engines):
    inproc, mp = engines["inproc"], engines["mp"]
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    text = inproc.generate("Stop here", sp, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    sp.stop = [stop]
    want = inproc.generate(["Stop here"] * 2, sp, use_tqdm=False)
    got = mp.generate(["Stop here"] * 2, sp, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
        assert a.outputs[0].stop_reason == stop and a.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def async_llm(tiny_path):
    engine = AsyncLLM(tiny_path, **ENGINE_KW)
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, sp, rid):
    outs = []
    async for out in engine.generate(prompt, sp, rid):
        outs.append(out)
    return outs


def test_async_llm_64_streams_equal_non_streamed(engines, async_llm):
    assert isinstance(async_llm.engine_core, AsyncMPClient)
    inproc = engines["inproc"]
    kinds = list(RequestOutputKind)
    prompts, params = [], []
    for i in range(64):
        prompts.append(f"request number {i}: " + "word " * (i % 7))
        n = 2 if i % 9 == 0 else 1
        params.append(SamplingParams(temperature=0 if n == 1 and i % 2 else 0.8, seed=i, n=n,
                                     max_tokens=4 + i % 9, ignore_eos=True,
                                     logprobs=1 if i % 5 == 0 else None,
                                     output_kind=kinds[i % 3]))
    want = inproc.generate(prompts, params, use_tqdm=False)

    async def main():
        client = async_llm.engine_core
        await client.collective_rpc_async("reset_step_shape_counts")
        streams = await asyncio.wait_for(asyncio.gather(*[
            _collect(async_llm, p, sp, f"s{i}") for i, (p, sp) in
            enumerate(zip(prompts, params, strict=True))]), timeout=120)
        return streams, await client.collective_rpc_async("get_step_shape_counts")

    streams, shapes = asyncio.run(main())
    # The async client reaches the model runner too: one step per token of the longest request.
    assert sum(steps for _, _, steps in shapes) >= max(sp.max_tokens for sp in params)
    for sp, w, outs in zip(params, want, streams, strict=True):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        if sp.output_kind is RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
            assert_same(outs[0], w)
        elif sp.output_kind is RequestOutputKind.CUMULATIVE:
            assert len(outs) > 1
            assert_same(outs[-1], w)
        else:  # DELTA: the pieces add up to the whole
            for c in w.outputs:
                pieces = [o2 for o in outs for o2 in o.outputs if o2.index == c.index]
                assert [t for p in pieces for t in p.token_ids] == c.token_ids
                assert "".join(p.text for p in pieces) == c.text
                assert pieces[-1].finish_reason == c.finish_reason
                if c.logprobs is not None:
                    assert _logprobs_equal([d for p in pieces for d in p.logprobs], c.logprobs)


def test_async_cancel_and_abort_free_blocks(async_llm):
    """Each way of stopping a stream aborts its request in the core. The utility call goes
    over the same socket right after the abort, so the core has handled the abort when it
    answers (the requests, 400 tokens long, would otherwise still hold their blocks)."""
    usable = ENGINE_KW["num_kv_blocks"] - 1
    sp = SamplingParams(temperature=0.8, max_tokens=400, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)

    async def blocks():
        return await asyncio.wait_for(async_llm.call_utility("get_kv_block_counts"), 10)

    async def main():
        counts = {}
        # A consumer that stops reading after 3 outputs (the generator is closed)...
        stream = async_llm.generate("cancel me " * 20, sp, "c1")
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        assert tuple(await blocks()) != (usable, usable)  # still running: it holds blocks
        await stream.aclose()
        counts["aclose"] = await blocks()
        # ... a consumer task cancelled mid-stream ...
        started = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate("cancel me too " * 20, sp, "c2"):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        counts["cancel"] = await blocks()
        # ... and engine.abort(): the stream ends with an "abort" output.
        outs = []

        async def consume_abort():
            async for out in async_llm.generate("abort me " * 20, sp, "c3"):
                outs.append(out)
                if len(outs) == 2:
                    await async_llm.abort("c3")

        await asyncio.wait_for(consume_abort(), 30)
        counts["abort"] = await blocks()
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        return counts

    counts = asyncio.run(main())
    assert all(tuple(c) == (usable, usable) for c in counts.values()), counts
    assert not async_llm.output_processor.has_unfinished() and async_llm.num_open_streams == 0


def test_async_kill_core_every_caller_gets_engine_dead(async_llm):
    """kill -9 of the core: every waiting stream and utility call fails within seconds; then
    shutdown leaves no process and no socket directory."""
    client = async_llm.engine_core
    pid, tmpdir = client.core_pid, client.resources.tmpdir
    sp = SamplingParams(temperature=0.8, max_tokens=240, ignore_eos=True)

    killed_at = []

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    async def main():
        tasks = [asyncio.create_task(_collect(async_llm, "x", sp, f"k{i}")) for i in range(4)]
        # From a thread: a pause of this process's event loop (a full garbage collection of the
        # suite's heap) must not delay the kill until the streams have finished.
        timer = threading.Timer(0.3, kill)
        timer.start()
        await asyncio.to_thread(timer.join)
        killed = killed_at[0]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        elapsed = time.monotonic() - killed
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(async_llm.call_utility("get_kv_block_counts"), 10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(async_llm, "y", sp, "late"), 10)
        return results, elapsed

    results, elapsed = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 5 and async_llm.errored
    async_llm.shutdown()
    assert _gone(pid) and not os.path.exists(tmpdir)


def test_sync_kill_core_engine_dead(tiny_path):
    llm = LLM(tiny_path, multiprocess_mode=True, **ENGINE_KW)
    client = llm.llm_engine.engine_core_client
    pid, tmpdir = client.core_pid, client.resources.tmpdir
    killed = []

    def kill():
        time.sleep(0.5)
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    sp = SamplingParams(temperature=0.8, max_tokens=240, ignore_eos=True)
    with pytest.raises(EngineDeadError):
        for _ in range(100):  # keep a caller waiting on the core until the kill lands
            llm.generate(["a", "b", "c", "d"], sp, use_tqdm=False)
    assert time.monotonic() - killed[0] < 5
    with pytest.raises(EngineDeadError):
        llm.generate("again", sp, use_tqdm=False)
    with pytest.raises(EngineDeadError):
        client.call_utility("get_kv_block_counts")
    del llm, client
    gc.collect()
    assert _gone(pid) and not os.path.exists(tmpdir)


_PARENT_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from jaxllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], multiprocess_mode=True, **json.loads(sys.argv[2]))
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    import jax._src.xla_bridge as xb
    client = llm.llm_engine.engine_core_client
    print(json.dumps({"backends": sorted(xb._backends), "pid": client.core_pid,
                      "dir": client.resources.tmpdir, "n": len(out[0].outputs[0].token_ids),
                      "dtype": llm.llm_engine.engine_config.dtype,
                      "platform": llm.llm_engine.engine_config.platform}), flush=True)
    time.sleep(120)
""")


def test_parent_without_main_guard_no_backend_and_kill_parent(tiny_path):
    """A user script without a __main__ guard starts the core; the frontend starts no JAX
    backend (dtype and platform come from the handshake); kill -9 of the parent ends the core,
    which removes the socket directory."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop(MP_ENV_VAR, None)
    # The core logs to the parent's stderr (a file here: a pipe could fill up).
    stderr = tempfile.TemporaryFile("w+")
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_SCRIPT, tiny_path,
                               json.dumps(ENGINE_KW)], stdout=subprocess.PIPE, stderr=stderr,
                              env=env, text=True)
    # Bounds the readline below, whatever happens in the script.
    guard = threading.Timer(240, parent.kill)
    guard.start()
    try:
        line = parent.stdout.readline()  # bounded: the script ends within its sleep
        info = json.loads(line)
    finally:
        guard.cancel()
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
    assert info["backends"] == [] and info["n"] == 3
    assert info["dtype"] == "float32" and info["platform"] == "cpu"
    assert _wait_gone(info["pid"], 10)
    assert _wait_gone_path(info["dir"], 5)
    stderr.seek(0)
    assert f"(EngineCore pid={info['pid']}) WARNING parent process gone" in stderr.read()


def _wait_gone_path(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def test_gc_of_mp_llm_leaves_nothing_behind(engines):
    llm = engines.pop("mp")
    client = llm.llm_engine.engine_core_client
    pid, tmpdir = client.core_pid, client.resources.tmpdir
    assert not _gone(pid) and os.path.isdir(tmpdir)
    del llm, client
    gc.collect()
    assert _gone(pid) and not os.path.exists(tmpdir)


def test_wire_numpy_arrays_and_utility_results():
    """numpy arrays cross as raw buffers (a msgpack extension, no pickle); utility results
    decode to the type the caller expects."""
    import numpy as np

    from jaxllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityOutput

    enc = MsgpackEncoder()
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    back = MsgpackDecoder().decode(enc.encode({"a": arr, "n": np.int64(3)}))
    assert back["n"] == 3 and back["a"].dtype == np.float32
    np.testing.assert_array_equal(back["a"], arr)
    assert b"pickle" not in enc.encode(arr) and len(enc.encode(arr)) < arr.nbytes + 64
    with pytest.raises(TypeError):
        enc.encode(np.array([object()]))
    out = MsgpackDecoder(UtilityOutput).decode(enc.encode(
        UtilityOutput(5, msgspec.Raw(enc.encode([[16, 16, 3]])))))
    assert out.call_id == 5 and out.error is None
    assert MsgpackDecoder().decode(out.result) == [[16, 16, 3]]


def test_core_start_up_failure_is_reported(tmp_path, monkeypatch):
    """A core that cannot start raises in the caller with the core's error, and leaves nothing
    behind."""
    from jaxllm.engine import mp_client

    made, real = [], tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(real(**kw))
        return made[-1]

    monkeypatch.setattr(mp_client.tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(RuntimeError, match="engine core failed to start"):
        LLM(str(tmp_path / "no-such-model"), multiprocess_mode=True, skip_tokenizer_init=True,
            **ENGINE_KW)
    assert len(made) == 1 and not os.path.exists(made[0])


def test_async_llm_in_process(engines, tiny_path):
    """AsyncLLM over InprocClient (steps inline on the event loop) streams the same tokens."""
    from jaxllm.engine.core_client import InprocClient

    engine = AsyncLLM(tiny_path, multiprocess_mode=False, **ENGINE_KW)
    try:
        assert isinstance(engine.engine_core, InprocClient)
        prompts = ["in process", "streams too", "third"]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True,
                                 output_kind=RequestOutputKind.FINAL_ONLY) for i in range(3)]
        want = engines["inproc"].generate(prompts, params, use_tqdm=False)

        async def main():
            return await asyncio.wait_for(asyncio.gather(*[
                _collect(engine, p, sp, f"i{i}") for i, (p, sp) in
                enumerate(zip(prompts, params, strict=True))]), timeout=60)

        for outs, w in zip(asyncio.run(main()), want, strict=True):
            assert len(outs) == 1
            assert_same(outs[0], w)
    finally:
        engine.shutdown()


def test_the_core_process_freezes_its_start_up_heap(monkeypatch, tmp_path):
    """Once its engine is built, the core moves its start-up heap out of the collector's
    reach before it reports ready, so no full collection of it stalls a step."""
    import queue as queue_mod
    from types import SimpleNamespace

    import jaxllm.engine.core as core_mod
    from jaxllm.engine import core_proc
    from jaxllm.engine.serial_utils import OutputType

    seen = {}

    class FakeCore:
        def __init__(self, _args, _launch_config=None) -> None:
            seen["frozen while building"] = gc.get_freeze_count()

        def get_engine_info(self):
            seen["frozen when ready"] = gc.get_freeze_count()
            return None

    monkeypatch.setattr(core_mod, "EngineCore", FakeCore)
    sent: queue_mod.Queue = queue_mod.Queue()
    monkeypatch.setattr(core_proc.EngineCoreProc, "process_output_socket",
                        lambda self, _addr: sent.put(self.output_queue.get()))
    monkeypatch.setattr(core_proc.EngineCoreProc, "process_input_socket",
                        lambda self, _addr: None)
    monkeypatch.setattr(core_proc, "ReadyMessage", lambda **kw: SimpleNamespace(**kw))
    gc.unfreeze()
    try:
        proc = core_proc.EngineCoreProc(SimpleNamespace(), "ipc://unused-in", "ipc://unused-out")
        kind, ready = sent.get(timeout=10)
    finally:
        gc.unfreeze()  # this process goes on with other tests
    proc.output_thread.join(timeout=10)
    proc.input_thread.join(timeout=10)
    proc.ctx.term()
    assert kind is OutputType.READY and ready.pid == os.getpid()
    assert seen["frozen while building"] == 0 and seen["frozen when ready"] > 0, seen


def test_closing_a_connection_while_another_thread_sends():
    """ZMQ sockets are not thread-safe: a close that destroyed them while another thread was
    sending (a joined core's heartbeat thread) could crash the process. In a child process of
    its own, so that a crash fails this test alone."""
    code = textwrap.dedent("""
        import threading, time, zmq
        from jaxllm.engine import EngineDeadError
        from jaxllm.engine.mp_client import CoreConnection
        from jaxllm.engine.serial_utils import RequestType

        for _ in range(100):
            conn = CoreConnection()
            input_address, _ = conn.bind("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
            peer_ctx = zmq.Context()
            peer = peer_ctx.socket(zmq.PULL)  # a core that reads nothing: sends never block
            peer.connect(input_address)

            def heartbeats():
                while True:
                    try:
                        conn.send(RequestType.HEARTBEAT)
                    except (EngineDeadError, zmq.ZMQError):
                        return

            sender = threading.Thread(target=heartbeats, daemon=True)
            sender.start()
            time.sleep(0.002)
            conn.closing = True
            conn._close_connection()
            sender.join(5)
            assert not sender.is_alive()
            peer_ctx.destroy(linger=0)
        print("closed")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "closed", (out.returncode,
                                                                     out.stderr[-2000:])
