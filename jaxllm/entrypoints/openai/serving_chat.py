"""`POST /v1/chat/completions`: the messages go through the model's own chat template (from its
tokenizer), then generate as a completion would; responses and `chat.completion.chunk` events
in OpenAI's layout, logprobs in the chat format (token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, cast

from jaxllm.entrypoints.openai.protocol import (
    UNSUPPORTED_CHAT,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    check_logprobs,
    parse_request,
)
from jaxllm.entrypoints.openai.serving_engine import OpenAIServing, now, random_id, sse
from jaxllm.outputs import Logprob

_MIN_LOGPROB = -9999.0


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them; content parts must be text."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts "
                                        f"({{'type': 'text', 'text': ...}}) are supported, "
                                        f"got {part!r:.200}", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


class OpenAIServingChat(OpenAIServing):
    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool,
                            continue_final_message: bool = False,
                            kwargs: dict[str, Any] | None = None) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        if continue_final_message and add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                                "be true", "continue_final_message")
        try:
            # transformers annotates every return kind at once; tokenize=False gives the text.
            return cast(str, self.tokenizer.apply_chat_template(
                message_dicts(messages), tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(kwargs or {})))
        except APIError:
            raise
        except Exception as e:  # the template's own checks (jinja raise_exception, ...)
            raise APIError(400, f"the chat template failed on these messages: {e}",
                           "messages") from None

    async def create_chat_completion(self, body: Any
                                     ) -> dict[str, Any] | AsyncGenerator[str, None]:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body,
                                                   UNSUPPORTED_CHAT)
        self.check_model(req.model)
        check_logprobs(req.top_logprobs, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")
        text = self.apply_chat_template(req.messages, req.add_generation_prompt,
                                        req.continue_final_message, req.chat_template_kwargs)
        prompt = self.tokenize(text)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, len(prompt.token_ids), num_top,
                                      req.stream)
        request_id = random_id("chatcmpl")
        gen = self.generate(prompt, params, request_id)
        if req.stream:
            return self._stream(req, request_id, len(prompt.token_ids), gen)
        return await self._full(req, request_id, len(prompt.token_ids), gen)

    def _logprobs(self, token_ids: list[int], rows: list[dict[int, Logprob]] | None,
                  num_top: int) -> list[dict[str, Any]]:
        content = []
        for tid, row in zip(token_ids, rows or [], strict=False):
            token, raw = self.token_info(tid)
            lp = row.get(tid)
            top = sorted(((p.rank, t, p.logprob) for t, p in row.items()
                          if p.rank is not None and p.rank <= num_top))
            content.append({
                "token": token, "bytes": list(raw),
                "logprob": _MIN_LOGPROB if lp is None else max(lp.logprob, _MIN_LOGPROB),
                "top_logprobs": [{"token": self.token_info(t)[0],
                                  "bytes": list(self.token_info(t)[1]),
                                  "logprob": max(p, _MIN_LOGPROB)} for _, t, p in top]})
        return content

    async def _full(self, req: ChatCompletionRequest, request_id: str, num_prompt: int,
                    gen: AsyncGenerator) -> dict[str, Any]:
        choices: list[dict[str, Any] | None] = [None] * req.n
        num_completion = 0
        async for out in gen:
            for c in out.outputs:
                num_completion += len(c.token_ids)
                logprobs = None
                if req.logprobs:
                    logprobs = {"content": self._logprobs(c.token_ids, c.logprobs,
                                                          req.top_logprobs or 0)}
                choices[c.index] = {
                    "index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
        return {"id": request_id, "object": "chat.completion", "created": now(),
                "model": self.model_name, "choices": choices,
                "usage": self.usage(num_prompt, num_completion)}

    async def _stream(self, req: ChatCompletionRequest, request_id: str, num_prompt: int,
                      gen: AsyncGenerator) -> AsyncGenerator[str, None]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        base = {"id": request_id, "object": "chat.completion.chunk", "created": now(),
                "model": self.model_name}
        extra = {"usage": None} if include_usage else {}
        num_completion = 0
        try:
            # The first chunk of every choice carries the role, as OpenAI's do.
            for i in range(req.n):
                yield sse({**base, "choices": [{
                    "index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}], **extra})
            async for out in gen:
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    num_completion += len(c.token_ids)
                    logprobs = None
                    if req.logprobs:
                        logprobs = {"content": self._logprobs(c.token_ids, c.logprobs,
                                                              req.top_logprobs or 0)}
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    yield sse({**base, "choices": [{
                        "index": c.index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                        **extra})
            if include_usage:
                yield sse({**base, "choices": [],
                           "usage": self.usage(num_prompt, num_completion)})
        except APIError as e:
            yield sse(e.body())
        yield sse("[DONE]")
