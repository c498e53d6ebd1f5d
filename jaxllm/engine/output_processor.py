"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (incremental detokenizing, stop strings,
logprobs, n > 1 fan-in). Requests a stop string finished are reported back for abort in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from jaxllm.engine import EngineCoreOutput
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxllm.sampling_params import SamplingParams


@dataclass
class RequestState:
    """One sequence being generated (a child of its parent request when n > 1)."""

    request_id: str
    parent_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        text = ""
        if self.detokenizer is not None:
            if self.finish_reason is not None:
                # Flush bytes held back for an incomplete character (length / abort endings).
                self.detokenizer.finish()
            text = self.detokenizer.output_text
        return CompletionOutput(
            index=self.index, text=text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[RequestState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, prompt_logprobs=self.prompt_logprobs,
            outputs=[c.completion() for c in self.children], finished=self.finished,
            metrics=self.metrics, num_cached_tokens=self.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, RequestState] = {}

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_ids: list[str], child_params: list[SamplingParams],
                    arrival_time: float) -> None:
        children = []
        for index, (cid, sp) in enumerate(zip(child_ids, child_params, strict=True)):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, skip_special_tokens=sp.skip_special_tokens,
                    stop=sp.stop, include_stop_str_in_output=sp.include_stop_str_in_output)
            state = RequestState(cid, parent_id, index, sp, detok,
                                 logprobs=[] if sp.logprobs is not None else None,
                                 cumulative_logprob=0.0 if sp.logprobs is not None else None)
            children.append(state)
        first_params = child_params[0]
        parent = ParentState(
            parent_id, prompt, prompt_token_ids, children, RequestMetrics(arrival_time),
            prompt_logprobs=[None] if first_params.prompt_logprobs is not None else None)
        # Registered only once everything is built: a failure above leaves nothing behind.
        self.children.update((c.request_id, c) for c in children)
        self.parents[parent_id] = parent

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def owns(self, request_id: str) -> bool:
        """Whether a live request or sequence already has this id."""
        return request_id in self.parents or request_id in self.children

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (finished RequestOutputs, child ids to abort in the core: stopped by a
        stop string, which only the text side can see)."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        now = time.time()
        touched: dict[str, ParentState] = {}
        for out in outputs:
            state = self.children.get(out.request_id)
            if state is None:
                continue
            parent = self.parents[state.parent_id]
            if out.num_cached_tokens and state.index == 0:
                parent.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs and parent.prompt_logprobs is not None \
                    and state.index == 0:
                parent.prompt_logprobs.extend(out.new_prompt_logprobs.to_dicts())
            if out.new_token_ids:
                if parent.metrics.first_token_time is None:
                    parent.metrics.first_token_time = now
                state.token_ids.extend(out.new_token_ids)
                if state.logprobs is not None and out.new_logprobs:
                    state.logprobs.extend(out.new_logprobs.to_dicts())
                if state.cumulative_logprob is not None and out.new_sampled_logprobs:
                    state.cumulative_logprob += sum(out.new_sampled_logprobs)
            stop_string = None
            if state.detokenizer is not None and (out.new_token_ids or out.finished):
                stop_terminated = out.finish_reason == "stop" and \
                    not isinstance(out.stop_reason, str)
                stop_string = state.detokenizer.update(out.new_token_ids, stop_terminated)
            if stop_string is not None and out.finish_reason is None:
                state.finish_reason, state.stop_reason = "stop", stop_string
                to_abort.append(state.request_id)
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.finish_reason is not None:
                self.children.pop(state.request_id, None)
            touched[parent.request_id] = parent
        for parent in touched.values():
            if parent.finished and parent.request_id in self.parents:
                parent.metrics.finished_time = now
                finished.append(parent.output())
                del self.parents[parent.request_id]
        return finished, to_abort

    def abort_parent(self, parent_id: str) -> RequestOutput | None:
        parent = self.parents.pop(parent_id, None)
        if parent is None:
            return None
        for c in parent.children:
            if c.finish_reason is None:
                c.finish_reason = "abort"
            self.children.pop(c.request_id, None)
        parent.metrics.finished_time = time.time()
        return parent.output()
