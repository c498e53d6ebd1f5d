"""Request handling at the engine's seams: validation before anything is queued, rollback, ids,
the core's wire-format messages and utility calls, and KV sizing from a measured footprint.
Each bug test here failed before its fix."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.engine import EngineCoreOutputs, EngineCoreRequest
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.worker.model_runner import kv_block_bytes
from tests.utils import assert_pool_free, core_of, make_llm, runner_of, scheduler_state

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):  # noqa: F811
    # In process: some tests here call the engine core's own methods and read its state.
    return make_llm(tiny[0], num_kv_blocks=24, dtype="float32", multiprocess_mode=False)


@pytest.fixture(scope="module")
def small_llm(tiny):  # noqa: F811
    """4 usable KV blocks of 16 tokens, at most 3 sequences per request."""
    return make_llm(tiny[0], num_kv_blocks=5, max_n=3)


def ids(n: int, start: int = 1) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


def test_negative_seed_is_no_seed_or_refused():
    assert SamplingParams(seed=-1).seed is None  # vLLM's server convention
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        SamplingParams(seed=-2)


def test_core_refusing_a_request_leaves_no_orphan(llm, prompts, hf_greedy):  # noqa: F811
    core = core_of(llm)
    bad = EngineCoreRequest("orphan", [1, 2, 3], GREEDY, [], max_tokens=4, seed=-5)
    with pytest.raises(ValueError, match="bad seed"):
        core.add_request(bad)
    assert "orphan" not in core.scheduler.requests and not core.scheduler.waiting
    out = llm.generate({"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tuple(prompts[0]))
    assert_pool_free(llm)


@pytest.mark.parametrize("bad, params, match", [
    # min_tokens above the room the prompt leaves (max_model_len 128)
    (ids(100), SamplingParams(min_tokens=40, max_tokens=50), "min_tokens"),
    # 120 tokens need 8 KV blocks of 16; the cache has 4
    (ids(120), GREEDY, "KV blocks"),
    ({"prompt_token_ids": [True, 5]}, GREEDY, "integers"),
    ({"prompt_token_ids": [np.bool_(True), 5]}, GREEDY, "integers"),
    (ids(4), SamplingParams(n=4, temperature=1.0), r"max_n \(3\)"),
])
def test_generate_is_all_or_nothing(small_llm, bad, params, match):
    llm = small_llm
    good = [ids(5), ids(7, 3)]
    with pytest.raises(ValueError, match=f"prompt 2: .*{match}"):
        llm.generate([*good, bad], [GREEDY, GREEDY, params], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    state = scheduler_state(llm)
    assert state["num_requests"] == state["num_waiting_reqs"] == state["num_running_reqs"] == 0
    # The good prompts never ran: the next call returns its own outputs only, whole.
    outs = llm.generate([ids(6, 9)], GREEDY, use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 6
    assert_pool_free(llm)


def test_interrupted_generate_aborts_only_its_own_requests(llm):
    engine = llm.llm_engine
    engine.add_request("other-caller", ids(9), GREEDY)
    real_step = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    engine.step = failing_step
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([ids(5), ids(8, 2)], GREEDY, use_tqdm=False)
    finally:
        del engine.step
    assert list(engine.output_processor.parents) == ["other-caller"]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert len(done["other-caller"].outputs[0].token_ids) == 6
    assert_pool_free(llm)


def test_sequence_ids_of_n_requests_cannot_collide(llm):
    engine = llm.llm_engine
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True)
    engine.add_request("x", ids(5), sp)  # sequences "0_x" and "1_x"
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("0_x", ids(5), GREEDY)
    engine.add_request("0_y", ids(5), GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", ids(5), sp)  # its first sequence would be "0_y"
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert sorted(done) == ["0_y", "x"] and len(done["x"].outputs) == 2
    assert_pool_free(llm)


def test_output_state_exists_before_the_core_sees_a_request(llm):
    engine = llm.llm_engine
    client = engine.engine_core_client
    seen = []
    real_add = client.add_request

    def spy(req):
        seen.append(engine.output_processor.owns(req.request_id))
        if req.request_id == "refused":
            raise ValueError("core says no")
        real_add(req)

    client.add_request = spy
    try:
        engine.add_request("accepted", ids(4), GREEDY)
        with pytest.raises(ValueError, match="core says no"):
            engine.add_request("refused", ids(4), GREEDY)
    finally:
        del client.add_request
    assert seen == [True, True]
    assert not engine.output_processor.owns("refused")
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_free(llm)


def test_engine_args_are_checked():
    for bad in (0, 1, -5, True):
        with pytest.raises(ValueError, match="max_model_len"):
            EngineArgs(max_model_len=bad)
    with pytest.raises(ValueError, match="max_n"):
        EngineArgs(max_n=0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        EngineArgs(seed=-1)  # would make every unseeded request's generator refuse it
    assert EngineArgs().max_n == 128


def test_cli_passes_engine_args_defaults(monkeypatch, capsys):
    import jaxllm
    from jaxllm.entrypoints.cli.main import main

    seen = []

    class Recorder:
        @classmethod
        def from_engine_args(cls, engine_args):
            seen.append(engine_args)
            raise RuntimeError("recorded")

    monkeypatch.setattr(jaxllm, "LLM", Recorder)
    for command in (["generate", "x"], ["chat", "x"]):
        assert main(command) == 2
        want = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        want["max_num_seqs"] = 1  # documented: the CLI sizes max_num_seqs to its prompts
        assert dataclasses.asdict(seen.pop()) == want, command
    # A zero is refused, not replaced by a default.
    assert main(["generate", "x", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be a positive integer, got 0" in capsys.readouterr().err
    assert not seen


def test_core_forgets_finished_and_aborted_requests(llm):
    """The core's per-request state (generator, penalties, owed prompt logprobs) lives exactly
    as long as the request: counted while it runs, gone once it finished or was aborted."""
    core = core_of(llm)
    penalized = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                               frequency_penalty=0.5)
    prompt_lp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    for rid, params in (("pen-a", penalized), ("pen-b", penalized), ("plp", prompt_lp),
                        ("plain", GREEDY)):
        core.add_request(EngineCoreRequest(rid, [5, 6, 7, 8], params, [], max_tokens=4))
    states = core.sampling_states
    assert set(states) == {"pen-a", "pen-b", "plp", "plain"}
    assert (states.num_penalized, states.num_prompt_logprobs) == (2, 1)
    core.step()
    core.abort_requests(["pen-a", "unknown"])
    assert "pen-a" not in states and states.num_penalized == 1
    emitted = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            emitted[o.request_id] = emitted.get(o.request_id, 0) + len(o.new_token_ids)
    assert {rid: emitted.get(rid) for rid in ("pen-b", "plp", "plain")} == dict.fromkeys(
        ("pen-b", "plp", "plain"), 4)
    assert not states and (states.num_penalized, states.num_prompt_logprobs) == (0, 0)
    assert_pool_free(llm)


def test_running_request_keeps_its_own_sampling_params(llm):
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate(ids(12, 30), sp, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("mutated", ids(12, 30), sp)
    engine.step()
    sp.temperature, sp.top_k = 50.0, -1  # the caller reuses its object for something else
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert done[0].outputs[0].token_ids == want
    assert_pool_free(llm)


def test_wire_messages_and_stats(llm):
    engine = llm.llm_engine
    prompt = ids(40, 7)
    llm.generate(prompt, GREEDY, use_tqdm=False)
    engine.add_request("again", prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=2,
                                                       prompt_logprobs=1, ignore_eos=True))
    engine.add_request("cached", prompt, GREEDY)
    core_outputs = engine.engine_core_client.get_output()
    if not core_outputs.outputs:  # async scheduling: the first call only dispatched the step
        core_outputs = engine.engine_core_client.get_output()
    # Through msgpack and back, as between processes: nothing lost.
    wire = msgspec.msgpack.encode(core_outputs)
    back = msgspec.msgpack.decode(wire, type=EngineCoreOutputs)
    assert back == core_outputs
    st = back.scheduler_stats
    # "again" asks for prompt logprobs, so it skips the cache; "cached" hits 2 full blocks.
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (40, 32)
    assert st.num_running_reqs == 2 and st.num_waiting_reqs == 0
    assert st.num_prefill_tokens == 40 + 8 and st.step_shape == (64, 64)
    assert 0 < st.kv_cache_usage <= 1 and st.device_s > 0
    again = next(o for o in back.outputs if o.request_id == "again")
    assert len(again.new_prompt_logprobs) == 39 and len(again.new_logprobs) == 1
    engine.output_processor.process_outputs(core_outputs.outputs)
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_free(llm)


def test_utility_calls(llm):
    engine = llm.llm_engine
    llm.collective_rpc("reset_step_shape_counts")
    llm.generate(ids(3), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert llm.collective_rpc("get_step_shape_counts") == [(1, 1, 3), (16, 16, 1)]
    with pytest.raises(ValueError, match="not an engine-core utility"):
        engine.engine_core_client.call_utility("add_request", None)
    # collective_rpc reaches the runner's public methods only.
    for method in ("no_such_method", "_forward", "step_shape_counts", 3):
        with pytest.raises(ValueError, match=f"no public method {method!r}"):
            llm.collective_rpc(method)


def test_progress_bar_shows_input_and_output_speed(llm, capsys):
    llm.generate([ids(10), ids(20)], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "est. speed input:" in err and "toks/s, output:" in err


def test_kv_array_sized_from_measured_activations(tiny, monkeypatch):  # noqa: F811
    from jaxllm.worker import model_runner as runner_module
    from jaxllm.worker.model_runner import ModelRunner

    # In process (the budget's inputs are patched in this process), with the platform's own
    # KV sizing rather than the test budget.
    sizing = dict(multiprocess_mode=False, num_kv_blocks=None)
    plain = make_llm(tiny[0], **sizing)  # CPU: the 1 GiB default, no measurement
    runner = runner_of(plain)
    # The kept logits buffers (one per step-shape row count) count as activations too.
    weights = runner.weight_bytes()
    activations = runner.measure_activation_bytes() + runner.logits_buffer_bytes()
    assert runner.logits_buffer_bytes() > 0 and activations > runner.logits_buffer_bytes()
    per_block = kv_block_bytes(runner.config, runner.block_size, runner.dtype)
    device_bytes = int((weights + activations + 50.5 * per_block) / 0.9)
    measured = []
    original = ModelRunner.measure_activation_bytes

    def counting(self, *args):
        measured.append(1)
        return original(self, *args)

    # The fake device: its limit, and in use only the new engine's weights (on a GPU the real
    # reading would also count the first engine's arrays).
    monkeypatch.setattr(runner_module, "device_memory_stats",
                        lambda: {"bytes_limit": device_bytes, "bytes_in_use": weights})
    monkeypatch.setattr(ModelRunner, "measure_activation_bytes", counting)
    llm = make_llm(tiny[0], gpu_memory_utilization=0.9, **sizing)
    assert measured == [1]
    expected = (int(device_bytes * 0.9) - weights - activations) // per_block
    assert llm.llm_engine.num_kv_blocks == expected == 50
    out = llm.generate(ids(30), GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    monkeypatch.setattr(runner_module, "device_memory_stats",
                        lambda: {"bytes_limit": weights + activations, "bytes_in_use": weights})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm(tiny[0], **sizing)
