"""LLMEngine: add_request -> step() loop, with vLLM's names.

The frontend half of the engine, the blocking shell over EngineFrontend (frontend.py, shared
with AsyncLLM): a client to the engine core (which owns the model, the KV array and the
scheduler), the Processor (validation, tokenizing) and the OutputProcessor (detokenizing, stop
strings, RequestOutputs).
"""

from __future__ import annotations

import time
from typing import Any

from jaxllm.config import UsageContext
from jaxllm.engine import EngineCoreDeadError, SchedulerStats
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.frontend import EngineFrontend
from jaxllm.engine.processor import ProcessedRequest, PromptType
from jaxllm.lora.request import LoRARequest
from jaxllm.model_executor.config import ModelConfig
from jaxllm.outputs import AnyRequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


class LLMEngine(EngineFrontend):
    def __init__(self, engine_args: EngineArgs | None = None) -> None:
        super().__init__(engine_args or EngineArgs(), UsageContext.LLM_CLASS)
        self.last_scheduler_stats = SchedulerStats()
        self.last_output_processing_s = 0.0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args)

    @property
    def model_config(self) -> ModelConfig:
        return self.core_info.model_config

    @property
    def model_name(self) -> str:
        return self.engine_config.model

    @property
    def max_model_len(self) -> int:
        return self.core_info.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self.core_info.num_kv_blocks

    # --- vLLM's LLMEngine API -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue one request; a bad one raises ValueError and changes nothing."""
        self.add_processed_request(self.processor.process_inputs(
            request_id, prompt, params, arrival_time, lora_request=lora_request))

    def add_processed_request(self, req: ProcessedRequest) -> None:
        """Queue a request the Processor validated; if the core refuses it, nothing of it is
        left behind."""
        parent = self.parent_requests.admit(req)
        try:
            for child in parent.requests_to_add():
                self.engine_core_client.add_request(child)
        except BaseException:
            self.abort_request(req.request_id)  # whatever the core took, and the output state
            raise
        self.parent_requests.admitted()

    def abort_request(self, request_ids: str | list[str]) -> list[AnyRequestOutput]:
        """Abort requests (by the id given to add_request); returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outs = []
        for rid in request_ids:
            child_ids, out = self.parent_requests.abort(rid)
            if child_ids:
                self.engine_core_client.abort_requests(child_ids)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def step(self) -> list[AnyRequestOutput]:
        """One engine step; returns the requests that finished in it (EmbeddingRequestOutput
        for an embedding request)."""
        try:
            core_outputs = self.engine_core_client.get_output()
        except EngineCoreDeadError as e:
            # One of several cores died: its requests end here, the engine serves on.
            for request_id in self.parent_requests.parents_of(e.request_ids):
                self.parent_requests.abort(request_id)
            raise
        if core_outputs.scheduler_stats is not None:
            self.last_scheduler_stats = core_outputs.scheduler_stats
        outputs = core_outputs.outputs
        t = time.perf_counter()
        finished, to_abort = self.output_processor.process_outputs(outputs)
        self.last_output_processing_s = time.perf_counter() - t
        if to_abort:
            self.engine_core_client.abort_requests(to_abort)
        for parent in self.parent_requests.release_siblings(outputs):
            # If the core refuses one, the whole request ends as aborted (its output is
            # returned) and the step goes on.
            try:
                for child in parent.waiting_siblings:
                    self.engine_core_client.add_request(child)
            except Exception:
                finished.extend(self.abort_request(parent.request_id))
        return finished

    def collective_rpc(self, method: str, args: tuple | list = ()) -> Any:
        """Call `method` on the engine core's model runner, wherever the core runs (vLLM's
        name): what benchmarks and profilers read, e.g. "get_step_shape_counts"."""
        return self.engine_core_client.collective_rpc(method, args)

    def shutdown(self) -> None:
        self.engine_core_client.shutdown()
