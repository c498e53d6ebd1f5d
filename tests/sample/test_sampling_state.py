"""Per-request sampling state (jaxllm/sample/state.py): what a new request gets, the counts the
engine core skips work by, penalty statistics following new tokens, and the prompt logprobs a
step owes (never twice across a preemption's recompute)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.engine import EngineCoreRequest
from jaxllm.sample.state import SamplingState, SamplingStates
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker.outputs import PromptLogprobRows
from scheduler import ScheduledRequest

PROMPT = [5, 6, 7, 8, 9]


def request(rid: str, seed: int | None = 0, **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(PROMPT), SamplingParams(**params), [2, 3], max_tokens=4,
                             seed=seed)


def scheduled(rid: str, start: int, num: int) -> ScheduledRequest:
    return ScheduledRequest(rid, PROMPT[start:start + num], start, [], False, start == 0)


def test_a_new_request_gets_what_its_params_ask_for():
    plain = SamplingState.from_request(request("a", seed=7))
    assert plain.eos_token_ids == {2, 3}
    assert plain.penalties is None and plain.prompt_logprobs_next is None
    assert plain.generator.random() == np.random.default_rng(7).random()
    asked = SamplingState.from_request(request("b", presence_penalty=0.5, prompt_logprobs=1))
    assert asked.penalties is not None and asked.prompt_logprobs_next == 0
    with pytest.raises(ValueError, match="bad seed"):
        SamplingState.from_request(request("c", seed=-1))


def test_counts_follow_adds_and_removes():
    states = SamplingStates()
    states.add(SamplingState.from_request(request("a", frequency_penalty=0.5)))
    states.add(SamplingState.from_request(request("b", prompt_logprobs=0)))
    states.add(SamplingState.from_request(request("c")))
    assert set(states) == {"a", "b", "c"} and len(states) == 3
    assert (states.num_penalized, states.num_prompt_logprobs, states.num_constrained) == (1, 1, 0)
    # A state left under a reused id is replaced, not counted twice.
    states.add(SamplingState.from_request(request("a", frequency_penalty=0.5)))
    assert states.num_penalized == 1
    states.remove("a")
    states.remove("unknown")
    assert "a" not in states and states.num_penalized == 0 and states.num_prompt_logprobs == 1


def test_penalty_statistics_follow_new_tokens():
    states = SamplingStates()
    states.add(SamplingState.from_request(request("a", presence_penalty=0.5)))
    penalties = states["a"].penalties
    assert penalties is not None
    states.append_output_tokens("a", [11, 11])
    states.append_output_tokens("gone", [11])
    ids, counts, seen = penalties.arrays()
    assert ids.tolist() == [11] and counts.tolist() == [2.0] and 11 in seen.tolist()


def test_prompt_logprobs_owed_once_across_chunks_and_recompute():
    states = SamplingStates()
    states.add(SamplingState.from_request(request("a", prompt_logprobs=1)))
    states.add(SamplingState.from_request(request("b")))
    # A first chunk of 3 prompt tokens: positions 0..2 predict tokens 1..3.
    want = states.prompt_logprob_positions([scheduled("a", 0, 3), scheduled("b", 0, 3)])
    assert want == {"a": (0, [6, 7, 8])}
    rows = states.prompt_logprobs("a", PromptLogprobRows(
        first_position=0, target_logit=np.array([1.0, 2.0, 3.0], np.float32),
        target_rank=np.array([1, 2, 1], np.int32),
        values=np.array([[1.0], [4.0], [3.0]], np.float32),
        token_ids=np.array([[6], [9], [8]], np.int32), lse=np.zeros(3, np.float32)))
    assert rows is not None
    assert rows.token_ids == [[6, 6], [7, 9], [8, 8]]
    assert rows.logprobs == [[1.0, 1.0], [2.0, 4.0], [3.0, 3.0]]
    assert rows.ranks == [[1, 1], [2, 1], [1, 1]]
    # Recomputed from the start (preemption): only the last position (3, predicting 9) is owed.
    assert states.prompt_logprob_positions([scheduled("a", 0, 5)]) == {"a": (3, [9])}
    assert states.prompt_logprobs("gone", PromptLogprobRows(
        0, *(np.zeros(0) for _ in range(5)))) is None
