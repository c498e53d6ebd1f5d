"""Request bodies of the OpenAI-compatible server (pydantic models) and its error type.

Requests are validated strictly: a wrong type is a 400 naming the field, never a silent coercion
("5" is no integer), and a field we do not implement is a 400 naming it, never silently ignored.
Responses are built as plain dicts in the serving modules: OpenAI's exact field layout, no
second schema to keep in step.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxllm.sampling_params import MAX_LOGPROBS

# OpenAI parameters that exist but that we do not implement: refused by name.
UNSUPPORTED_COMPLETION = ("best_of", "suffix")
UNSUPPORTED_CHAT = ("functions", "function_call", "audio", "modalities", "prediction",
                    "reasoning_effort", "web_search_options", "store", "metadata",
                    "service_tier", "echo", "best_of")


class APIError(Exception):
    """An error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             413: "RequestTooLargeError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or self.TYPES.get(status, "BadRequestError")

    def body(self) -> dict[str, Any]:
        # Both may quote the request; a lone surrogate in them could not be sent as UTF-8.
        return {"error": {"message": _utf8_safe(self.message), "type": self.err_type,
                          "param": None if self.param is None else _utf8_safe(self.param),
                          "code": self.status}}


def _utf8_safe(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# Integers that travel to the core process must fit its 64-bit wire format.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaResponseFormat(_Strict):
    name: str
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the wire name stays OpenAI's.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class _SamplingFields(_Strict):
    """What completions and chat share: the sampling parameters, OpenAI's and vLLM's extras."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's extras: only these tokens; never these words; only the prompt's last k tokens.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int64 | None = None
    # vLLM's beam search: `n` beams, ranked by cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own logs; nothing to do here
    # Constrained decoding: OpenAI's response_format, vLLM's structured_outputs (the fields of
    # StructuredOutputsParams) and vLLM's older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None)
    echo: bool = False
    prompt_logprobs: int | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # What OpenAI's own assistant message carries besides, so that a client may send a reply
    # back as it got it (`message.model_dump()`): a refusal and annotations are not rendered;
    # audio and the legacy function_call are refused unless empty.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request; `truncate_prompt_tokens` is vLLM's extra field."""

    model: str | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    truncate_prompt_tokens: Int64 | None = None


# Union members as pydantic names them in an error's location (a model member by its class).
_MODEL_TAGS = {"NamedToolChoice"}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", *_MODEL_TAGS}


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_field(body: dict[str, Any]) -> str | None:
    """The first top-level field whose value (or a key inside it, or the field's own name)
    holds a lone UTF-16 surrogate: JSON's `\\ud800` escape decodes to one, and no tokenizer
    or UTF-8 encoder takes it. Walked without recursion: the depth is the client's."""
    for name, value in body.items():
        stack = [name, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    return name
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return None


def parse_request(model: type[BaseModel], body: Any,
                  unsupported: tuple[str, ...] = ()) -> Any:
    """A JSON body -> `model`, or an APIError(400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                            f"{type(body).__name__}")
    bad = lone_surrogate_field(body)
    if bad is not None:
        raise APIError(400, f"{bad!r} contains a lone UTF-16 surrogate (an unpaired \\ud800-"
                            f"\\udfff escape), which is not valid Unicode text", bad)
    for name in unsupported:
        if name in body and body[name] is not None:
            raise APIError(400, f"parameter {name!r} is not supported by this server", name)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        if isinstance(err.get("input"), dict):
            # An object where a union also takes a string (tool_choice): the object member's
            # error says what is wrong with it.
            err = next((x for x in errors if _MODEL_TAGS & set(map(str, x.get("loc", ())))),
                       err)
        # pydantic names the union member that failed ("str", "list[int]") in the location:
        # not a part of the request the caller wrote.
        loc = [str(p) for p in err.get("loc", ())
               if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        if err.get("type") == "extra_forbidden":
            msg = f"parameter {where!r} is not supported by this server"
        else:
            msg = f"invalid value for {where!r}: {err.get('msg')} (got {err.get('input')!r:.200})"
        raise APIError(400, msg, param) from None


def check_logprobs(value: int | None, name: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)
