"""`POST /v1/completions`: one prompt (text or token ids) or a list of them, `n` choices each,
streamed as OpenAI's `text_completion` chunks or returned whole. Choice i*n + j is prompt i's
j-th sequence, as OpenAI numbers them.

With `echo`, each choice's text starts with its prompt, and its logprobs with the prompt's
tokens (the first one's logprob None: nothing precedes it), from the engine's prompt logprobs:
what lm-evaluation-harness's loglikelihood requests read."""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncGenerator
from typing import Any, cast

from jaxllm.entrypoints.openai.protocol import (
    UNSUPPORTED_COMPLETION,
    APIError,
    CompletionRequest,
    check_logprobs,
    parse_request,
)
from jaxllm.entrypoints.openai.serving_beam_search import (
    beam_search,
    beam_search_params,
    check_beam_search,
    check_lora_beam,
)
from jaxllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    TokenizedPrompt,
    merge,
    now,
    random_id,
    request_constraint,
    sse,
)
from jaxllm.outputs import Logprob

_MIN_LOGPROB = -9999.0  # OpenAI's floor; JSON has no -inf


class CompletionLogprobs:
    """The legacy completions logprobs of one choice: tokens, token_logprobs, top_logprobs and
    text_offset (each token's character offset in the choice's text), built chunk by chunk."""

    def __init__(self, serving: OpenAIServing, num_top: int) -> None:
        self.serving = serving
        self.num_top = num_top
        # The text so far, as its length: the tokens' raw bytes through an incremental UTF-8
        # decoder (an echoed prompt has thousands of tokens; decoding each prefix again would be
        # quadratic, on the event loop).
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = 0

    def _text_length(self) -> int:
        """len(tokenizer.decode(tokens so far)): a partial character at the end counts as the
        U+FFFD the decode shows for it."""
        pending = self._utf8.getstate()[0]
        return self._num_chars + (len(pending.decode("utf-8", "replace")) if pending else 0)

    def add(self, token_ids: list[int], rows: list[dict[int, Logprob] | None] | None,
            out: dict[str, Any] | None = None) -> dict[str, Any]:
        """The entries of `token_ids` (appended to `out` when given). A None row (the prompt's
        first token) has no logprob and no top logprobs."""
        if out is None:
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, row in zip(token_ids, rows or [], strict=False):
            out["text_offset"].append(self._text_length())
            text, raw = self.serving.token_info(tid)
            self._num_chars += len(self._utf8.decode(raw))
            out["tokens"].append(text)
            if row is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp = row.get(tid)
            out["token_logprobs"].append(None if lp is None else max(lp.logprob, _MIN_LOGPROB))
            top = {}
            for t, p in row.items():
                if t == tid or (p.rank is not None and p.rank <= self.num_top):
                    top[self.serving.token_info(t)[0]] = max(p.logprob, _MIN_LOGPROB)
            out["top_logprobs"].append(top)
        return out


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, body: Any) -> dict[str, Any] | AsyncGenerator[str, None]:
        req: CompletionRequest = parse_request(CompletionRequest, body, UNSUPPORTED_COMPLETION)
        lora = self.check_model(req.model)
        self.check_runner("generate", "/v1/completions")
        check_logprobs(req.logprobs, "logprobs")
        check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not available when stream is true (echo "
                                "with logprobs streams the prompt's logprobs)", "prompt_logprobs")
        constraint = request_constraint(req)
        check_beam_search(req, constraint)
        check_lora_beam(req, lora)
        # As vLLM: echo with logprobs asks the engine for the prompt's logprobs too.
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo:
            prompt_logprobs = req.logprobs
        prompts = self._prompts(req.prompt)
        truncate = self.truncate_prompt_tokens(req)
        tokenized = [await self.tokenize(p, truncate_prompt_tokens=truncate) for p in prompts]
        self.check_prompt_logprob_work(req, tokenized, prompt_logprobs)
        structured_outputs = await self.structured_outputs(constraint)  # once for all prompts
        params = [self.sampling_params(req, req.max_tokens, len(t.token_ids), req.logprobs,
                                       req.stream, constraint, prompt_logprobs,
                                       structured_outputs=structured_outputs)
                  for t in tokenized]
        beams = [beam_search_params(req, p) for p in params]
        request_id = random_id("cmpl")
        created = now()
        gens = [self.generate(t, p, f"{request_id}-{i}", lora) if b is None
                else beam_search(self, t, b, p, f"{request_id}-{i}")
                for i, (t, p, b) in enumerate(zip(tokenized, params, beams, strict=True))]
        if req.stream:
            return self._stream(req, request_id, created, tokenized, gens)
        return await self._full(req, request_id, created, tokenized, gens)

    def check_prompt_logprob_work(self, req: CompletionRequest,
                                  tokenized: list[TokenizedPrompt],
                                  prompt_logprobs: int | None) -> None:
        """A 400 when the response would hold more prompt logprob entries than the server
        allows: each choice repeats its prompt's (echo with logprobs, prompt_logprobs), so
        long prompts x top-k x n build a response of hundreds of megabytes."""
        if prompt_logprobs is None:
            return
        copies = int(bool(req.echo and req.logprobs is not None)) \
            + int(req.prompt_logprobs is not None)
        positions = sum(len(t.token_ids) for t in tokenized)
        entries = positions * (prompt_logprobs + 1) * req.n * copies
        limit = self.limits.max_prompt_logprob_entries
        if entries > limit:
            field = "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"
            raise APIError(400, f"the response would hold {entries} prompt logprob entries "
                                f"({positions} prompt tokens x {prompt_logprobs + 1} logprobs "
                                f"x n {req.n}{' x 2' if copies == 2 else ''}), more than "
                                f"this server allows (--max-prompt-logprob-entries {limit}); "
                                f"ask for fewer prompts, tokens, choices or logprobs", field)

    def prompt_text(self, prompt: TokenizedPrompt) -> str:
        """The prompt as text (a token-id prompt decoded), for echo."""
        if prompt.text is not None:
            return prompt.text
        # transformers annotates decode's batch form too; one id list gives one string.
        return cast(str, self.tokenizer.decode(prompt.token_ids))

    def prompt_logprobs_json(self, rows: list[dict[int, Logprob] | None] | None
                             ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` of a choice: per prompt token, None for the first, else
        {token id: {logprob, rank, decoded_token}} of the prompt token and the top ones."""
        if rows is None:
            return None
        return [None if row is None else {
            str(t): {"logprob": max(p.logprob, _MIN_LOGPROB), "rank": p.rank,
                     "decoded_token": self.token_info(t)[0]} for t, p in row.items()}
            for row in rows]

    @staticmethod
    def _prompts(prompt: Any) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    async def _full(self, req: CompletionRequest, request_id: str, created: int,
                    tokenized: list[TokenizedPrompt], gens: list) -> dict[str, Any]:
        n = req.n
        choices: list[dict[str, Any] | None] = [None] * (len(gens) * n)
        num_completion = 0
        async for i, out in merge(gens):
            for c in out.outputs:
                text, logprobs = c.text, None
                if req.echo:
                    text = self.prompt_text(tokenized[i]) + text
                if req.logprobs is not None:
                    lp = CompletionLogprobs(self, req.logprobs)
                    echoed = None
                    if req.echo:
                        # A prompt of thousands of positions: built beside the event loop.
                        echoed = await asyncio.to_thread(lp.add, tokenized[i].token_ids,
                                                         out.prompt_logprobs)
                    logprobs = lp.add(c.token_ids, c.logprobs, echoed)
                num_completion += len(c.token_ids)
                choice = {
                    "index": i * n + c.index, "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = await asyncio.to_thread(
                        self.prompt_logprobs_json, out.prompt_logprobs)
                choices[i * n + c.index] = choice
        num_prompt = sum(len(t.token_ids) for t in tokenized)
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.response_model(req.model), "choices": choices,
                "usage": self.usage(num_prompt, num_completion)}

    async def _stream(self, req: CompletionRequest, request_id: str, created: int,
                      tokenized: list[TokenizedPrompt], gens: list
                      ) -> AsyncGenerator[str, None]:
        n = req.n
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        logprobs = [CompletionLogprobs(self, req.logprobs) for _ in range(len(gens) * n)] \
            if req.logprobs is not None else None
        num_completion = 0
        base = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.response_model(req.model)}
        # Echo: a choice's first chunk carries its prompt, and with logprobs the prompt's
        # logprobs, which arrive with (or before) the first generated token.
        echo_pending = set(range(len(gens) * n)) if req.echo else set()
        prompt_rows: list[list] = [[] for _ in gens]
        try:
            async for i, out in merge(gens):
                if out.prompt_logprobs:
                    prompt_rows[i].extend(out.prompt_logprobs)
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    index = i * n + c.index
                    num_completion += len(c.token_ids)
                    text, echoed = c.text, None
                    if index in echo_pending:
                        echo_pending.discard(index)
                        text = self.prompt_text(tokenized[i]) + text
                        if logprobs is not None:
                            echoed = await asyncio.to_thread(logprobs[index].add,
                                                             tokenized[i].token_ids,
                                                             prompt_rows[i])
                    lp = None if logprobs is None else logprobs[index].add(c.token_ids,
                                                                           c.logprobs, echoed)
                    chunk = {**base, "choices": [{
                        "index": index, "text": text, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
            if include_usage:
                num_prompt = sum(len(t.token_ids) for t in tokenized)
                yield sse({**base, "choices": [],
                           "usage": self.usage(num_prompt, num_completion)})
        except APIError as e:
            # The status line is sent: the error travels as an event, as vLLM sends it.
            yield sse(e.body())
        yield sse("[DONE]")
