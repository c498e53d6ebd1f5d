"""LLMEngine: add_request -> step() loop, with vLLM's names.

The frontend half of the engine: a client to the engine core (which owns the model, the KV
array and the scheduler), the Processor (validation, tokenizing) and the OutputProcessor
(detokenizing, stop strings, RequestOutputs).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from jaxllm.engine import EngineCoreInfo, EngineCoreRequest, SchedulerStats
from jaxllm.engine.arg_utils import EngineArgs, resolve_multiprocess_mode
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.processor import ProcessedRequest, Processor, PromptType
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.model_loader.default_model import default_model_path
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, engine_args: EngineArgs | None = None) -> None:
        args = self.engine_args = engine_args or EngineArgs()
        # The tokenizer first: a missing one fails in seconds, not after minutes of compiling.
        path = default_model_path() if args.model is None else Path(args.model)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(path)
        self.multiprocess_mode = resolve_multiprocess_mode(args.multiprocess_mode)
        self.engine_core_client = EngineCoreClient.make_client(
            multiprocess_mode=self.multiprocess_mode, asyncio_mode=False, engine_args=args)
        info: EngineCoreInfo = self.engine_core_client.get_engine_info()
        self.core_info = info
        eos = set(info.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.processor = Processor(self.tokenizer, info, self.eos_token_ids, args.max_n)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_index = 0
        # Children of an n > 1 request wait until the first child has computed the prompt, so
        # they find its blocks in the prefix cache instead of recomputing them.
        self._pending_children: dict[str, tuple[str, list[EngineCoreRequest]]] = {}
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
        return self.core_info.model_name

    @property
    def max_model_len(self) -> int:
        return self.core_info.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self.core_info.num_kv_blocks

    # --- vLLM's LLMEngine API -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue one request; a bad one raises ValueError and changes nothing."""
        self.add_processed_request(
            self.processor.process_inputs(request_id, prompt, params, arrival_time))

    def add_processed_request(self, req: ProcessedRequest) -> None:
        """Queue a request the Processor validated. Its output state is registered before the
        core sees it (a core in another process may answer at once) and removed again if the
        core refuses it."""
        taken = [i for i in [req.request_id, *req.child_ids] if self.output_processor.owns(i)]
        if taken:
            raise ValueError(f"request id {req.request_id!r} is already in use (or one of its "
                             f"sequence ids {req.child_ids} is): {taken}")
        index = self._request_index
        children = [c if c.seed is not None else
                    msgspec.structs.replace(c, seed=[self.engine_args.seed, index, i])
                    for i, c in enumerate(req.child_requests)]
        try:
            self.output_processor.add_request(req.request_id, req.prompt, req.prompt_token_ids,
                                              req.child_ids,
                                              [c.sampling_params for c in children],
                                              req.arrival_time)
            self.engine_core_client.add_request(children[0])
            if len(children) > 1:
                if self.engine_args.enable_prefix_caching:
                    self._pending_children[children[0].request_id] = (req.request_id,
                                                                      children[1:])
                else:
                    for child in children[1:]:
                        self.engine_core_client.add_request(child)
        except BaseException:
            self.abort_request(req.request_id)  # whatever the core took, and the output state
            raise
        # Only queued requests count, so a refused one does not shift later default seeds.
        self._request_index += 1

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (by the id given to add_request); returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outs = []
        for rid in request_ids:
            parent = self.output_processor.parents.get(rid)
            if parent is None:
                continue
            child_ids = [c.request_id for c in parent.children]
            self._pending_children.pop(child_ids[0], None)
            self.engine_core_client.abort_requests(child_ids)
            out = self.output_processor.abort_parent(rid)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        core_outputs = self.engine_core_client.get_output()
        if core_outputs.scheduler_stats is not None:
            self.last_scheduler_stats = core_outputs.scheduler_stats
        outputs = core_outputs.outputs
        t = time.perf_counter()
        finished, to_abort = self.output_processor.process_outputs(outputs)
        self.last_output_processing_s = time.perf_counter() - t
        if to_abort:
            self.engine_core_client.abort_requests(to_abort)
        for out in outputs:
            # Not on a prompt-logprobs-only output of a partial prefill: the prompt is whole
            # in the cache once the first sequence samples (or ends).
            if not (out.new_token_ids or out.finished):
                continue
            pending = self._pending_children.pop(out.request_id, None)
            if pending is not None:
                self._add_pending_children(*pending, finished)
        return finished

    def _add_pending_children(self, parent_id: str, children: list[EngineCoreRequest],
                              finished: list[RequestOutput]) -> None:
        """The first sequence has computed the prompt: queue the others. If the core refuses
        one, the whole request ends as aborted (its output is returned) and the step goes on."""
        try:
            for child in children:
                self.engine_core_client.add_request(child)
        except Exception:
            finished.extend(self.abort_request(parent_id))

    def describe(self) -> dict[str, Any]:
        info, args = self.core_info, self.engine_args
        return {
            "model": info.model_name, "dtype": info.dtype, "quantization": info.quantization,
            "kernel_backend": info.kernel_backend, "num_kv_blocks": info.num_kv_blocks,
            "block_size": info.block_size, "max_model_len": info.max_model_len,
            "buckets": [tuple(s) for s in info.bucket_shapes],
            "compile_time_s": round(info.compile_time_s, 2),
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": args.enable_prefix_caching,
            "multiprocess_mode": self.multiprocess_mode, "platform": info.platform,
        }

    # --- what benchmarks and profilers read (utility calls on the core) ------------------------

    def get_step_shape_counts(self) -> dict[tuple[int, int], int]:
        """Steps run per (num_tokens, max_query_len) since the last reset."""
        rows = self.engine_core_client.call_utility("get_step_shape_counts")
        return {(t, q): n for t, q, n in rows}

    def reset_step_shape_counts(self) -> None:
        self.engine_core_client.call_utility("reset_step_shape_counts")

    def get_weight_stats(self) -> dict[str, int]:
        """body_params (decoder layers + final norm), head_params (LM head), itemsize."""
        return self.engine_core_client.call_utility("get_weight_stats")

    def time_weight_matmuls(self, num_tokens: list[int], reps: int = 3) -> dict[int, float]:
        """Best-of-`reps` seconds of one step's weight matmuls at each token count."""
        return self.engine_core_client.call_utility("time_weight_matmuls", num_tokens, reps)

    def shutdown(self) -> None:
        self.engine_core_client.shutdown()
