"""`POST /v1/chat/completions`: the messages go through the model's own chat template (from its
tokenizer), then generate as a completion would; responses and `chat.completion.chunk` events
in OpenAI's layout, logprobs in the chat format (token, logprob, bytes, top_logprobs).

Tools: the template renders `tools` (and earlier calls and tool results in the messages); the
answer is parsed by the hermes tool parser into `message.tool_calls` (streamed as
`delta.tool_calls`). `tool_choice` "required" or a named function is enforced by a grammar over
the same format, so the model can only answer with calls of valid arguments."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, cast

from jaxllm.entrypoints.openai.protocol import (
    UNSUPPORTED_CHAT,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    TokenizeRequest,
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
    Constraint,
    OpenAIServing,
    now,
    random_id,
    request_constraint,
    sse,
)
from jaxllm.entrypoints.openai.tool_parsers import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    DeltaMessage,
    HermesToolParser,
    extract_tool_calls,
    tool_call_grammar,
)
from jaxllm.outputs import Logprob
from jaxllm.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    extract_reasoning,
)

_MIN_LOGPROB = -9999.0

# apply_chat_template's own arguments, which the server sets (from the request's fields where
# it has them): chat_template_kwargs may not (tokenize=True would return ids, not text).
_SERVER_SET_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
# Templates render off the event loop. A render past the timeout is answered with a 400, but
# Python cannot stop its thread: it runs to its end, taking a share of the GIL meanwhile (a
# daemon thread, so that it never holds up the server's exit). The model's own template
# renders in time linear in the messages; only a template from the request (allowed by
# --trust-request-chat-template) can run for longer.
_RENDER_TIMEOUT_S = 10.0
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _in_daemon_thread(fn: Callable[[], str]) -> asyncio.Future[str]:
    """fn() in a new daemon thread, as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()

    def settle(result: str, error: BaseException | None) -> None:
        if future.cancelled():  # timed out: nobody waits for it any more
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except Exception as e:  # handed to the waiting request
            result, error = "", e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while it ran
            pass

    threading.Thread(target=run, name="chat-template", daemon=True).start()
    return future


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
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages have tool_calls",
                               "messages")
            msg["tool_calls"] = [_template_tool_call(i, j, c.id, c.function.name,
                                                     c.function.arguments)
                                 for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _template_tool_call(i: int, j: int, call_id: str, name: str, arguments: str
                        ) -> dict[str, Any]:
    # Templates write the arguments with `tojson`: they want the object, not its JSON text
    # (as vLLM hands them over).
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid "
                            f"JSON: {e}", "messages") from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


@dataclass
class ToolUse:
    """How a request uses its tools: `parse` the answer for calls; `constraint`, the grammar
    that enforces them ("required" or a named function)."""

    tools: list[dict[str, Any]] | None
    parse: bool
    constraint: Constraint | None


class OpenAIServingChat(OpenAIServing):
    def tool_use(self, req: ChatCompletionRequest) -> ToolUse:
        choice = req.tool_choice
        if choice is not None and choice != "none" and not req.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        if not req.tools:
            return ToolUse(None, False, None)
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        functions = [t["function"] for t in tools]
        for f in functions:
            # OpenAI's rule (and '.'): a name is written into the calls' markup and JSON.
            if not _TOOL_NAME.fullmatch(f["name"]):
                raise APIError(400, f"tool names must be 1 to 64 letters, digits, '_', '-' or "
                                    f"'.', got {f['name']!r:.100}", "tools")
        if choice is None:
            choice = "auto"
        if choice == "none":
            # As vLLM by default: the tools are still rendered (the conversation may refer to
            # them), but the answer is plain content, never parsed for calls.
            return ToolUse(tools, False, None)
        if choice == "auto":
            return ToolUse(tools, True, None)
        if isinstance(choice, NamedToolChoice):
            names = [f["name"] for f in functions]
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names the function {choice.function.name!r}, "
                                    f"which is not among the tools {names}", "tool_choice")
            functions = [f for f in functions if f["name"] == choice.function.name]
        for f in functions:
            self.check_schema_depth(f.get("parameters", {}), "tools",
                                    f"the parameters of tool {f['name']!r:.100}")
        tag_ids = [self.tokenizer.convert_tokens_to_ids(t) for t in (TOOL_CALL_START,
                                                                      TOOL_CALL_END)]
        tags = all(i is not None and i != self.tokenizer.unk_token_id for i in tag_ids)
        # A call forced by name is one call (OpenAI's); "required" allows parallel calls, at
        # most --max-parallel-tool-calls (default: one per tool), so that a model that
        # repeats itself ends instead of running to max_tokens.
        named = isinstance(choice, NamedToolChoice)
        max_calls = self.limits.max_parallel_tool_calls or len(functions)
        grammar = tool_call_grammar(
            functions, req.parallel_tool_calls and not named,
            not self.structured_outputs_config.disable_any_whitespace, tags, max_calls)
        return ToolUse(tools, True, Constraint({"grammar": grammar}, "tool_choice"))

    def template_kwargs(self, chat_template: str | None,
                        kwargs: dict[str, Any] | None) -> tuple[dict[str, Any], str | None]:
        """A request's extra template variables, checked, and the request field its own
        template came from (None: the model's). A template from the request runs the client's
        code in the server (time and memory without bound), so it is refused unless the
        server was started with --trust-request-chat-template, as vLLM does."""
        kwargs = dict(kwargs or {})
        for key in kwargs:
            if key in _SERVER_SET_KWARGS:
                raise APIError(400, f"chat_template_kwargs may not set {key!r}: the server "
                                    f"sets it (from the request's own field where there is "
                                    f"one)", "chat_template_kwargs")
        source = "chat_template" if chat_template is not None else None
        if "chat_template" in kwargs:
            if chat_template is not None:
                raise APIError(400, "give the chat template once: chat_template or "
                                    "chat_template_kwargs.chat_template", "chat_template")
            chat_template, source = kwargs.pop("chat_template"), "chat_template_kwargs"
        if source is not None:
            if not self.trust_request_chat_template:
                raise APIError(400, "this server does not take chat templates from requests "
                                    "(start it with --trust-request-chat-template to allow "
                                    "them)", source)
            if not isinstance(chat_template, str):
                raise APIError(400, f"the chat template must be a string, got "
                                    f"{type(chat_template).__name__}", source)
            kwargs["chat_template"] = chat_template
        return kwargs, source

    async def apply_chat_template(self, messages: list[ChatMessage],
                                  add_generation_prompt: bool,
                                  continue_final_message: bool = False,
                                  kwargs: dict[str, Any] | None = None,
                                  tools: list[dict[str, Any]] | None = None,
                                  chat_template: str | None = None) -> str:
        """The prompt text of `messages`, rendered in a thread of its own."""
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        if continue_final_message and add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                                "be true", "continue_final_message")
        template_kwargs, source = self.template_kwargs(chat_template, kwargs)
        if source is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        conversation = message_dicts(messages)

        def render() -> str:
            # transformers annotates every return kind at once; tokenize=False gives the text.
            return cast(str, self.tokenizer.apply_chat_template(
                conversation, tools=cast(list[Any] | None, tools), tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **template_kwargs))

        try:
            return await asyncio.wait_for(_in_daemon_thread(render), _RENDER_TIMEOUT_S)
        except TimeoutError:
            raise APIError(400, f"the chat template did not finish rendering in "
                                f"{_RENDER_TIMEOUT_S:g} s", source or "messages") from None
        except Exception as e:  # the template's own checks (jinja raise_exception, ...)
            raise APIError(400, f"the chat template failed on these messages: {e}",
                           source or "messages") from None

    async def create_tokenize(self, body: Any) -> dict[str, Any]:
        """`POST /tokenize`: the token ids of a prompt, or of messages through the chat
        template (vLLM's extension); rendering and tokenizing off the event loop."""
        req: TokenizeRequest = parse_request(TokenizeRequest, body)
        self.check_model(req.model)
        if req.messages is not None and req.prompt is None:
            text = await self.apply_chat_template(req.messages, req.add_generation_prompt)
        elif req.prompt is not None and req.messages is None:
            text = req.prompt
        else:
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        # Not given: as a completion (prompt) or a chat completion (messages) tokenizes it.
        special = req.add_special_tokens
        if special is None:
            special = req.messages is None
        ids = await asyncio.to_thread(self.tokenizer.encode, text,
                                      add_special_tokens=special)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    async def create_chat_completion(self, body: Any
                                     ) -> dict[str, Any] | AsyncGenerator[str, None]:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body,
                                                   UNSUPPORTED_CHAT)
        lora = self.check_model(req.model)
        self.check_runner("generate", "/v1/chat/completions")
        check_logprobs(req.top_logprobs, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")
        tool_use = self.tool_use(req)
        constraint = request_constraint(req)
        if constraint is not None and tool_use.constraint is not None:
            raise APIError(400, f"tool_choice {req.tool_choice!r} constrains the answer to tool "
                                f"calls; it cannot be combined with {constraint.source}",
                           "tool_choice")
        text = await self.apply_chat_template(req.messages, req.add_generation_prompt,
                                              req.continue_final_message,
                                              req.chat_template_kwargs, tool_use.tools,
                                              req.chat_template)
        # The template wrote the BOS it wants; the tokenizer must not add another.
        prompt = await self.tokenize(text, "messages", add_special_tokens=False,
                                     truncate_prompt_tokens=self.truncate_prompt_tokens(req))
        max_tokens, max_tokens_field = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, max_tokens_field = req.max_completion_tokens, "max_completion_tokens"
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        constraint = constraint or tool_use.constraint
        check_beam_search(req, constraint)
        check_lora_beam(req, lora)
        params = self.sampling_params(req, max_tokens, len(prompt.token_ids), num_top,
                                      req.stream, constraint,
                                      max_tokens_field=max_tokens_field,
                                      structured_outputs=await self.structured_outputs(
                                          constraint))
        beam = beam_search_params(req, params)
        request_id = random_id("chatcmpl")
        gen = self.generate(prompt, params, request_id, lora) if beam is None \
            else beam_search(self, prompt, beam, params, request_id)
        if req.stream:
            return self._stream(req, request_id, len(prompt.token_ids), gen, tool_use.parse)
        return await self._full(req, request_id, len(prompt.token_ids), gen, tool_use.parse)

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
                    gen: AsyncGenerator, parse_tools: bool) -> dict[str, Any]:
        forced = _calls_forced(req.tool_choice)
        choices: list[dict[str, Any] | None] = [None] * req.n
        num_completion = 0
        async for out in gen:
            for c in out.outputs:
                num_completion += len(c.token_ids)
                logprobs = None
                if req.logprobs:
                    logprobs = {"content": self._logprobs(c.token_ids, c.logprobs,
                                                          req.top_logprobs or 0)}
                text = c.text
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.reasoning_parser is not None:
                    reasoning, text = extract_reasoning(text, self.reasoning_parser)
                    message["content"] = text
                    if reasoning is not None:
                        message["reasoning_content"] = reasoning
                finish_reason = c.finish_reason
                if parse_tools:
                    found = extract_tool_calls(text, complete_calls_only=forced)
                    if forced:  # the calls that were completed, and never their markup
                        message["content"] = found.content
                    if found.tools_called:
                        message["content"] = found.content
                        message["tool_calls"] = [t.to_dict() for t in found.tool_calls]
                        finish_reason = _tool_finish_reason(finish_reason, req.tool_choice)
                choices[c.index] = {
                    "index": c.index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason}
        return {"id": request_id, "object": "chat.completion", "created": now(),
                "model": self.response_model(req.model), "choices": choices,
                "usage": self.usage(num_prompt, num_completion)}

    async def _stream(self, req: ChatCompletionRequest, request_id: str, num_prompt: int,
                      gen: AsyncGenerator, parse_tools: bool) -> AsyncGenerator[str, None]:
        forced = _calls_forced(req.tool_choice)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        base = {"id": request_id, "object": "chat.completion.chunk", "created": now(),
                "model": self.response_model(req.model)}
        extra = {"usage": None} if include_usage else {}
        num_completion = 0
        parsers = [HermesToolParser(complete_calls_only=forced) for _ in range(req.n)] \
            if parse_tools else None
        thinking = [ReasoningParser(self.reasoning_parser) for _ in range(req.n)] \
            if self.reasoning_parser is not None else None
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
                    finish_reason = c.finish_reason
                    text, reasoning = c.text, ""
                    if thinking is not None:
                        split = thinking[c.index].feed(text)
                        if finish_reason is not None:
                            end = thinking[c.index].finish()
                            split = ReasoningDelta(split.reasoning + end.reasoning,
                                                   split.content + end.content)
                        text, reasoning = split.content, split.reasoning
                    if parsers is None:
                        # Text the reasoning parser holds back (a tag may be starting) sends
                        # nothing yet.
                        empty = finish_reason is None and not reasoning and thinking is None
                        delta: dict[str, Any] = {"content": text} if text or empty else {}
                    else:
                        parser = parsers[c.index]
                        found = parser.feed(text)
                        if finish_reason is not None:
                            end = parser.finish()
                            found = DeltaMessage(found.content + end.content,
                                                 found.tool_calls + end.tool_calls)
                            if parser.tool_calls:
                                finish_reason = _tool_finish_reason(finish_reason, req.tool_choice)
                        delta = {}
                        if found.content:
                            delta["content"] = found.content
                        if found.tool_calls:
                            delta["tool_calls"] = [t.to_dict() for t in found.tool_calls]
                    if reasoning:
                        delta = {"reasoning_content": reasoning, **delta}
                    if not delta and finish_reason is None and logprobs is None:
                        continue  # held back: a tag or a call's closing brace may follow
                    yield sse({**base, "choices": [{
                        "index": c.index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason}],
                        **extra})
            if include_usage:
                yield sse({**base, "choices": [],
                           "usage": self.usage(num_prompt, num_completion)})
        except APIError as e:
            yield sse(e.body())
        yield sse("[DONE]")


def _calls_forced(tool_choice: Any) -> bool:
    """A grammar forces the answer to be calls ("required" or a named function): a call cut
    by max_tokens is dropped rather than returned as text."""
    return tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)


def _tool_finish_reason(finish_reason: str | None, tool_choice: Any) -> str | None:
    # OpenAI's reason for an answer that ends in calls, but "stop" for a call forced by name
    # (as OpenAI and vLLM report it); one cut by max_tokens stays "length".
    named = tool_choice is not None and not isinstance(tool_choice, str)
    return "tool_calls" if finish_reason == "stop" and not named else finish_reason
