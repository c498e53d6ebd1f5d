"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (incremental detokenizing, stop strings,
logprobs, n > 1 fan-in). Requests a stop string finished are reported back for abort in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from jaxllm.engine import EngineCoreOutput
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from jaxllm.sampling_params import RequestOutputKind, SamplingParams


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
    # Streaming (DELTA): how much was already sent; whether the final output was.
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_final: bool = False

    def completion_partial(self) -> CompletionOutput:
        """CUMULATIVE while unfinished: the text holds back what a stop string might still
        take away (the detokenizer's streaming buffer)."""
        if self.finish_reason is not None:
            return self.completion()
        text = "" if self.detokenizer is None else \
            self.detokenizer.get_next_output_text(finished=False, delta=False)
        return CompletionOutput(
            index=self.index, text=text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs))

    def completion_delta(self) -> CompletionOutput:
        """DELTA: only what was not sent before (the cumulative logprob stays cumulative)."""
        finished = self.finish_reason is not None
        text = "" if self.detokenizer is None else \
            self.detokenizer.get_next_output_text(finished=finished, delta=True)
        ids = self.token_ids[self.sent_tokens:]
        self.sent_tokens = len(self.token_ids)
        lps = None
        if self.logprobs is not None:
            lps = self.logprobs[self.sent_logprobs:]
            self.sent_logprobs = len(self.logprobs)
        self.sent_final = finished
        return CompletionOutput(
            index=self.index, text=text, token_ids=ids,
            cumulative_logprob=self.cumulative_logprob, logprobs=lps,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)

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
    sent_prompt_logprobs: int = 0  # DELTA: entries already sent
    # An embedding request: its vector, once the core sent it.
    pooling: bool = False
    embedding: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.children[0].params.output_kind

    def stream_output(self) -> RequestOutput | EmbeddingRequestOutput | None:
        """What a streaming caller gets now, by the request's output_kind (None: nothing); an
        embedding request has one output, when it finishes."""
        finished = self.finished
        if self.pooling:
            return self.output() if finished else None
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            return self.output() if finished else None
        if kind is RequestOutputKind.CUMULATIVE:
            return self.output(partial=True)
        completions = [c.completion_delta() for c in self.children
                       if c.sent_tokens < len(c.token_ids)
                       or (c.finish_reason is not None and not c.sent_final)]
        plp = None
        if self.prompt_logprobs is not None:
            plp = self.prompt_logprobs[self.sent_prompt_logprobs:]
            self.sent_prompt_logprobs = len(self.prompt_logprobs)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, prompt_logprobs=plp, outputs=completions,
            finished=finished, metrics=self.metrics, num_cached_tokens=self.num_cached_tokens)

    def output(self, partial: bool = False) -> RequestOutput | EmbeddingRequestOutput:
        if self.pooling:
            return self.embedding_output()
        plp = self.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=list(plp) if partial and plp is not None else plp,
            outputs=[c.completion_partial() if partial else c.completion()
                     for c in self.children], finished=self.finished,
            metrics=self.metrics, num_cached_tokens=self.num_cached_tokens)

    def embedding_output(self) -> EmbeddingRequestOutput:
        """An embedding request's output: its vector as floats (empty if it ended without
        one: aborted, or an error)."""
        vector = [] if self.embedding is None else self.embedding.tolist()
        return EmbeddingRequestOutput(
            request_id=self.request_id, outputs=EmbeddingOutput(vector),
            prompt_token_ids=self.prompt_token_ids, finished=self.finished, prompt=self.prompt,
            metrics=self.metrics, num_cached_tokens=self.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, RequestState] = {}

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_ids: list[str], child_params: list[SamplingParams],
                    arrival_time: float, pooling: bool = False) -> None:
        """`pooling`: an embedding request (no text to detokenize; its output is its vector)."""
        children = []
        for index, (cid, sp) in enumerate(zip(child_ids, child_params, strict=True)):
            detok = None
            if self.tokenizer is not None and not pooling:
                assert isinstance(sp.stop, list)  # SamplingParams normalises stop to a list
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
            prompt_logprobs=[None] if first_params.prompt_logprobs is not None else None,
            pooling=pooling)
        # Registered only once everything is built: a failure above leaves nothing behind.
        self.children.update((c.request_id, c) for c in children)
        self.parents[parent_id] = parent

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def owns(self, request_id: str) -> bool:
        """Whether a live request or sequence already has this id."""
        return request_id in self.parents or request_id in self.children

    def process_outputs(self, outputs: list[EngineCoreOutput], stream: bool = False
                        ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Returns (finished RequestOutputs, child ids to abort in the core: stopped by a
        stop string, which only the text side can see). With `stream`, the first list holds
        every output due by the requests' output_kind (streaming callers), finished or not."""
        finished: list[RequestOutput | EmbeddingRequestOutput] = []
        to_abort: list[str] = []
        now = time.time()
        touched: dict[str, ParentState] = {}
        progressed: set[str] = set()  # parents with new tokens or an ending this step
        for out in outputs:
            state = self.children.get(out.request_id)
            if state is None:
                continue
            parent = self.parents[state.parent_id]
            if out.num_cached_tokens and state.index == 0:
                parent.num_cached_tokens = out.num_cached_tokens
            if out.pooling_output is not None:
                parent.embedding = out.pooling_output
            if out.new_prompt_logprobs and parent.prompt_logprobs is not None \
                    and state.index == 0:
                parent.prompt_logprobs.extend(out.new_prompt_logprobs.to_dicts())
            stop_string = None
            new_ids = out.new_token_ids
            if state.detokenizer is not None and (new_ids or out.finished):
                stop_terminated = out.finish_reason == "stop" and \
                    not isinstance(out.stop_reason, str) and not out.stopped_on_text
                if len(new_ids) > 1 and state.detokenizer.stop:
                    # Several tokens (accepted drafts): one at a time, so those after the
                    # token that completes a stop string are dropped, as without drafts.
                    for i in range(len(new_ids)):
                        last = i == len(new_ids) - 1
                        stop_string = state.detokenizer.update(new_ids[i:i + 1],
                                                               stop_terminated and last)
                        if stop_string is not None:
                            new_ids = new_ids[:i + 1]
                            break
                else:
                    stop_string = state.detokenizer.update(new_ids, stop_terminated)
            if new_ids:
                if parent.metrics.first_token_time is None:
                    parent.metrics.first_token_time = now
                n = len(new_ids)
                state.token_ids.extend(new_ids)
                if state.logprobs is not None and out.new_logprobs:
                    state.logprobs.extend(out.new_logprobs.to_dicts()[:n])
                if state.cumulative_logprob is not None and out.new_sampled_logprobs:
                    state.cumulative_logprob += sum(out.new_sampled_logprobs[:n])
            # A stop string inside several tokens ends the request there, whatever ended it
            # at the last of them in the core; one completed by the token that also ended it
            # (a complete grammar, max_tokens, a stop token after it) is the reason it stopped.
            cut = len(new_ids) < len(out.new_token_ids)
            if stop_string is not None and (out.finish_reason in (None, "stop", "length")
                                            or cut):
                state.finish_reason, state.stop_reason = "stop", stop_string
                if out.finish_reason is None:
                    to_abort.append(state.request_id)
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.finish_reason is not None:
                self.children.pop(state.request_id, None)
            touched[parent.request_id] = parent
            if new_ids or state.finish_reason is not None:
                progressed.add(parent.request_id)
        for parent in touched.values():
            if parent.request_id not in self.parents:
                continue
            if parent.finished:
                parent.metrics.finished_time = now
                out = parent.stream_output() if stream else parent.output()
                assert out is not None  # a finished request always has a final output
                finished.append(out)
                del self.parents[parent.request_id]
            elif stream and parent.request_id in progressed:
                out = parent.stream_output()
                if out is not None:
                    finished.append(out)
        return finished, to_abort

    def abort_parent(self, parent_id: str, stream: bool = False
                     ) -> RequestOutput | EmbeddingRequestOutput | None:
        parent = self.parents.pop(parent_id, None)
        if parent is None:
            return None
        for c in parent.children:
            if c.finish_reason is None:
                c.finish_reason = "abort"
            self.children.pop(c.request_id, None)
        parent.metrics.finished_time = time.time()
        return parent.stream_output() if stream else parent.output()
