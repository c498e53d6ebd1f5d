"""The messages between the engine frontend (LLMEngine: Processor, OutputProcessor) and the
engine core: plain msgspec structs, so the core can live in this process or another one.

Nothing here holds a Python object the core built for the user: logprobs travel as arrays
(`LogprobsLists`) and become `Logprob` dicts in the frontend.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.lora.request import LoRARequest
from jaxllm.model_executor.config import ModelConfig
from jaxllm.pooling_params import PoolingParams
from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sampling_params import SamplingParams
from scheduler import prompt_blocks_needed


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request as the engine core receives it (one per sequence: a
    user request with n > 1 becomes n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int  # already capped by max_model_len
    # Seeds this request's own numpy Generator; None: fresh entropy (the frontend fills it in
    # from the engine seed and the request's index for requests without a seed).
    seed: int | list[int] | None = None
    arrival_time: float = 0.0
    # An embedding request (a pooling runner's): its prompt is prefilled and pooled, nothing
    # is sampled (`sampling_params` is then a placeholder the scheduler carries along).
    pooling_params: PoolingParams | None = None
    # A constrained request of a thinking model (Processor.think_state): the constraint starts
    # after this token (`</think>`) in the output; with `reasoning_start_token_id` too, only if
    # the output's first token is that one (`<think>`), else at once. None: from the first
    # token.
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None
    # The LoRA adapter it runs with (the Processor checked it against the model); None: none.
    lora_request: LoRARequest | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request got from one step."""

    request_id: str
    new_token_ids: list[int]
    # One row per new token when the request asked for logprobs.
    new_logprobs: LogprobsLists | None = None
    # Raw logprob of each new token (cumulative_logprob), when the request asked for logprobs.
    new_sampled_logprobs: list[float] | None = None
    # Prompt-logprob rows computed this step, in prompt order.
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # The stop token id that ended it; for "error", why.
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Finished "stop" on a token that belongs to the text (its grammar is complete), not on a
    # stop token, whose text is left out.
    stopped_on_text: bool = False
    # An embedding request's pooled vector (float32, as the pooler made it: truncated and
    # normalized), with its final output; a raw array on the wire, not a list of floats.
    pooling_output: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """The state of the core after one step, and where that step's host time went. Carried
    with every step's outputs: the progress bar, benchmarks, the profiler and metrics read this
    instead of reaching into the core."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks in use
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # of them, found
    num_preemptions: int = 0  # this step
    num_prefill_tokens: int = 0  # prompt tokens computed this step (chunks and recomputes)
    num_decode_tokens: int = 0  # sequences that computed one token to sample from it
    # (num_tokens, max_query_len) of the compiled step that ran, None for an empty step.
    step_shape: tuple[int, int] | None = None
    schedule_s: float = 0.0
    prepare_s: float = 0.0  # the runner's input preparation
    device_s: float = 0.0  # dispatch until the step's logits are ready
    transfer_s: float = 0.0  # logits to the host (and prompt-logprob rows)
    sample_s: float = 0.0
    update_s: float = 0.0  # scheduler update and output building
    # Async scheduling: the previous step's candidates on the host until this step's dispatch
    # (the device's idle gap); None in synchronous steps.
    host_critical_s: float | None = None
    # How long the call launching the next step took to return (on CPU the step it starts takes
    # the cores from the calling thread at once, so this mostly measures the device's start).
    launch_s: float | None = None
    num_full_row_samples: int = 0  # rows sampled from full logits, not top-K candidates
    # Speculative decoding this step: requests that verified drafts, their draft tokens, and
    # how many were accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # LoRA: the adapters of the running and of the waiting requests, by name, with how many
    # requests each (empty without LoRA).
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}
    # Which data-parallel engine core stepped (set by the frontend's DP client on receipt).
    engine_index: int = 0


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.time)


class EngineCoreInfo(msgspec.Struct):
    """What the frontend learns from the core once, after it loaded the model and sized the KV
    array: the resolved EngineConfig (the core resolves it: it knows the platform), the limits
    the Processor validates against, and a description for benchmarks."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    num_kv_blocks: int  # including the reserved null block
    eos_token_ids: list[int]  # from the model's config
    bucket_shapes: list[tuple[int, int]]
    compile_time_s: float
    # The scheduler's KV cache groups' windows (None: full attention; a sliding group frees
    # the blocks behind its window).
    kv_group_windows: tuple[int | None, ...] = (None,)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_kv_blocks - 1

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the KV cache holds at once (vLLM's "maximum
        concurrency"): a sliding group holds only its window's blocks of each."""
        need = prompt_blocks_needed(self.max_model_len, self.config.block_size,
                                    self.kv_group_windows, self.config.max_num_batched_tokens)
        return self.num_usable_blocks / need


# What a client may call on the core besides add/abort/step (vLLM's call_utility). Here, not in
# core.py: the multiprocess clients check names without importing the core (model, runner).
# collective_rpc reaches the model runner's public methods (what benchmarks read).
UTILITY_METHODS = frozenset({"get_engine_info", "get_kv_block_counts", "get_scheduler_state",
                             "collective_rpc"})


class EngineDeadError(RuntimeError):
    """The engine core's process died (killed, or an exception in its busy loop): every caller
    waiting on it gets this instead of waiting forever. The engine cannot be used again."""


class EngineCoreDeadError(EngineDeadError):
    """One of several data-parallel engine cores died: the requests it held (`request_ids`,
    the core's sequence ids) end with this error, while the engine serves on with the others.
    Raised once per death of a core by the DP client's get_output; the frontend fails those
    requests alone."""

    def __init__(self, message: str, engine_index: int, request_ids: list[str]) -> None:
        super().__init__(message)
        self.engine_index = engine_index
        self.request_ids = request_ids


__all__ = ["UTILITY_METHODS", "EngineCoreDeadError", "EngineCoreInfo", "EngineCoreOutput",
           "EngineCoreOutputs", "EngineCoreRequest", "EngineDeadError", "LogprobsLists",
           "SchedulerStats"]
