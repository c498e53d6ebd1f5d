"""What the completions and chat endpoints share: the model-name check, prompt tokenizing with
the max_model_len check, request -> SamplingParams (the structured-output constraint included),
generation with metrics and clean errors, logprob token strings, SSE framing."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, fields
from typing import Any

from jaxllm.config import config_dict
from jaxllm.engine import EngineDeadError
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.metrics import ServerMetrics
from jaxllm.entrypoints.openai.protocol import APIError
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.reasoning import REASONING_PARSERS
from jaxllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxllm.structured_output.validator import (
    GrammarValidator,
    schema_depth,
)


@dataclass
class StructuredOutputsConfig:
    """Server-wide defaults for constrained requests (vLLM's `--structured-outputs-config`):
    a request whose constraint does not set one of these fields gets the server's value. A
    random or small model needs `disable_any_whitespace` to ever close a JSON object."""

    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    @classmethod
    def from_json(cls, text: str) -> StructuredOutputsConfig:
        """From the command line's JSON object; unknown keys and non-bool values are errors
        naming them."""
        spec = config_dict(text, "--structured-outputs-config", {f.name for f in fields(cls)})
        for key, value in spec.items():
            if not isinstance(value, bool):
                raise ValueError(f"--structured-outputs-config: {key} must be true or false, "
                                 f"got {value!r}")
        return cls(**spec)


@dataclass
class ServerLimits:
    """What one request may ask of the server, each a `jaxllm serve` option; a request past one
    is a 400 naming it. Constraints are validated in worker processes (GrammarValidator) with a
    time and a memory limit."""

    # The constraint's JSON text (schema, regex, grammar, choices, or the tools' grammar).
    max_structured_output_bytes: int = 128 << 10
    # A JSON schema's nesting (its local $refs followed), and each tool's parameters'.
    max_structured_output_depth: int = 128
    structured_output_timeout: float = 10.0
    structured_output_memory_mib: int = 1024
    # Stop strings per request, and their total UTF-8 size (each child of n > 1 and of every
    # prompt carries them).
    max_stop_strings: int = 64
    max_stop_bytes: int = 8192
    # Prompt logprob entries a completions response may hold: prompt positions x (top-k + 1)
    # x the choices that carry them (echo with logprobs, prompt_logprobs).
    max_prompt_logprob_entries: int = 2_000_000
    # Calls in an answer that tool_choice "required" forces; None: one per tool.
    max_parallel_tool_calls: int | None = None


@dataclass
class Constraint:
    """A request's structured-output spec (StructuredOutputsParams' fields) and the request
    field it came from, which a 400 about it names."""

    spec: dict[str, Any]
    source: str


# vLLM's older request fields, each one kind of constraint.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def request_constraint(req: Any) -> Constraint | None:
    """The constraint a completions or chat request asks for: `structured_outputs`,
    `response_format` (json_object, json_schema) or one `guided_*` field; more than one is a
    400 (which should win is not ours to guess)."""
    found: list[Constraint] = []
    if req.structured_outputs is not None:
        found.append(Constraint(dict(req.structured_outputs), "structured_outputs"))
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(Constraint({"json_object": True}, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs "
                                "json_schema.schema", "response_format")
        found.append(Constraint({"json": rf.json_schema.json_schema}, "response_format"))
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append(Constraint({kind: value}, name))
    if len(found) > 1:
        raise APIError(400, f"give at most one output constraint, got "
                            f"{', '.join(c.source for c in found)}", found[1].source)
    if req.guided_whitespace_pattern is not None:
        if not found:
            raise APIError(400, "guided_whitespace_pattern needs a JSON constraint "
                                "(guided_json or response_format)", "guided_whitespace_pattern")
        found[0].spec.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    return found[0] if found else None


@dataclass
class TokenizedPrompt:
    text: str | None
    token_ids: list[int]


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event, as OpenAI frames them."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    return f"data: {payload}\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is a printable character in token
    strings; this is its inverse."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF = _unicode_to_byte()
_SAMPLING_PARAM = re.compile(r"SamplingParams\.(\w+)")
# A token id as a logit_bias key: canonical ASCII digits only (int() would also read " 5 ",
# Arabic-Indic digits or thousands of digits), at most 19 digits (an int64's width).
_TOKEN_ID_KEY = re.compile(r"(?:0|[1-9][0-9]{0,18})")


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """A request's logit_bias with its keys as token ids; a key that is not one is a 400."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise APIError(400, f"logit_bias keys must be token ids written as non-negative "
                                f"decimal integers, got {key!r:.50}", "logit_bias")
        out[int(key)] = value
    return out


def token_text_and_bytes(tokenizer: Any, token_id: int, added: set[int]) -> tuple[str, bytes]:
    """A token's string and raw bytes for logprobs. A token that is not whole UTF-8 on its own
    (part of a character) is written `bytes:\\xe4\\xb8` (its bytes in hex), as OpenAI and vLLM
    write it; its `bytes` are the raw ones either way. `added`: the tokenizer's added-token ids
    (special tokens), whose strings are their text, not byte-level symbols."""
    tok = tokenizer.convert_ids_to_tokens(token_id)
    if tok is None:
        raw = b""
    elif token_id in added or any(c not in _BYTE_OF for c in tok):
        raw = tok.encode("utf-8")
    else:
        raw = bytes(_BYTE_OF[c] for c in tok)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, raw


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_name: str,
                 metrics: ServerMetrics | None = None,
                 structured_outputs_config: StructuredOutputsConfig | None = None,
                 trust_request_chat_template: bool = False,
                 limits: ServerLimits | None = None,
                 validator: GrammarValidator | None = None,
                 reasoning_parser: str | None = None) -> None:
        """`reasoning_parser`: a REASONING_PARSERS name, splitting a chat answer's thinking
        into `reasoning_content`; None leaves answers whole."""
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: "
                             f"{', '.join(REASONING_PARSERS)})")
        self.reasoning_parser = reasoning_parser
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.validator = validator or GrammarValidator(
            timeout_s=self.limits.structured_output_timeout,
            memory_mib=self.limits.structured_output_memory_mib)
        self.trust_request_chat_template = trust_request_chat_template
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self.model_name = served_model_name
        # --lora-modules: the adapters a request's `model` may name (filled by make_state).
        self.lora_modules: dict[str, LoRARequest] = {}
        if engine.tokenizer is None:
            raise ValueError("the OpenAI server needs the engine's tokenizer (drop "
                             "skip_tokenizer_init)")
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.core_info.max_model_len
        self.metrics = metrics
        self._token_cache: dict[int, tuple[str, bytes]] = {}
        self._added = set(getattr(self.tokenizer, "added_tokens_decoder", {}) or {})

    # --- validation ---------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model). As vLLM: a request may
        leave the model out; an unknown name is a 404."""
        if model is None or model == self.model_name:
            return None
        lora = self.lora_modules.get(model)
        if lora is None:
            names = ", ".join(f"`{n}`" for n in (self.model_name, *self.lora_modules))
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{names}", "model", "NotFoundError")
        return lora

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter the request ran with, else the base."""
        return model if model is not None and model in self.lora_modules else self.model_name

    def check_runner(self, runner: str, route: str) -> None:
        """A 400 naming the engine's runner when `route` needs the other one (an engine serves
        one kind of request: text or embeddings)."""
        have = self.engine.engine_config.runner
        if have != runner:
            other = "/v1/embeddings" if have == "pooling" else \
                "/v1/completions and /v1/chat/completions"
            raise APIError(400, f"{route} needs a model served with --runner {runner}; "
                                f"`{self.model_name}` runs with --runner {have}, which serves "
                                f"{other}", "model")

    async def tokenize(self, prompt: str | list[int], param: str = "prompt",
                       add_special_tokens: bool = True,
                       truncate_prompt_tokens: int | None = None) -> TokenizedPrompt:
        """Token ids for a text or token-id prompt, validated by the engine's processor (which
        refuses a text too long to fit before tokenizing it, unless it is to be truncated to
        its last `truncate_prompt_tokens`). In a worker thread: a long text takes a while, and
        the event loop serves every other connection meanwhile."""
        value: Any = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        try:
            p = await asyncio.to_thread(self.engine.processor.process_prompt, value,
                                        add_special_tokens, truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param) from None
        return TokenizedPrompt(p.prompt, p.prompt_token_ids)

    def truncate_prompt_tokens(self, req: Any) -> int | None:
        """The request's truncate_prompt_tokens, checked before the prompt is tokenized (the
        truncation decides whether a long prompt fits)."""
        k = req.truncate_prompt_tokens
        if k is not None and not (k == -1 or 1 <= k <= self.max_model_len):
            raise APIError(400, f"truncate_prompt_tokens must be -1 or an integer in [1, "
                                f"max_model_len ({self.max_model_len})], got {k}",
                           "truncate_prompt_tokens")
        return k

    def check_schema_depth(self, schema: Any, param: str, what: str) -> None:
        """A 400 naming `param` when a JSON schema nests deeper than the server allows (the
        validator would recurse that deep)."""
        limit = self.limits.max_structured_output_depth
        depth = schema_depth(schema, limit)
        if depth > limit:
            raise APIError(400, f"{what} nests more than {limit} levels deep (its $refs "
                                f"followed), more than this server allows "
                                f"(--max-structured-output-depth {limit})", param)

    def check_stop(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else stop or []
        limit = self.limits.max_stop_strings
        if len(stops) > limit:
            raise APIError(400, f"stop has {len(stops)} strings, more than this server allows "
                                f"(--max-stop-strings {limit})", "stop")
        size = sum(len(s.encode("utf-8", "surrogatepass")) for s in stops
                   if isinstance(s, str))
        limit = self.limits.max_stop_bytes
        if size > limit:
            raise APIError(400, f"stop has {size} bytes of strings, more than this server "
                                f"allows (--max-stop-bytes {limit})", "stop")

    async def structured_outputs(self, constraint: Constraint | None
                                 ) -> StructuredOutputsParams | None:
        """The constraint with the server's defaults for the fields it leaves out, validated
        once per request in the validator's worker (off the event loop, where a crash or a
        runaway costs only this request); an invalid, too large or too deep schema, regex or
        grammar is a 400 naming the request field it came from."""
        if constraint is None:
            return None
        spec = dict(constraint.spec)
        config = self.structured_outputs_config
        # An explicit whitespace pattern says what whitespace to allow: no default overrides it.
        if "whitespace_pattern" not in spec:
            spec.setdefault("disable_any_whitespace", config.disable_any_whitespace)
        spec.setdefault("disable_additional_properties", config.disable_additional_properties)
        source = constraint.source
        size = len(json.dumps(spec, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        limit = self.limits.max_structured_output_bytes
        if size > limit:
            raise APIError(400, f"{source}: the constraint is {size} bytes of JSON, more than "
                                f"this server allows (--max-structured-output-bytes {limit})",
                           source)
        schema = spec.get("json")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise APIError(400, f"{source}: the JSON schema is nested too deeply to parse "
                                    f"(--max-structured-output-depth "
                                    f"{self.limits.max_structured_output_depth})",
                               source) from None
            except ValueError:
                schema = None  # the validator says what is wrong with it
        if schema is not None:
            self.check_schema_depth(schema, source, f"{source}: the JSON schema")
        try:
            grammar = await self.validator.validate(spec)
            return StructuredOutputsParams(**spec, _grammar=grammar)
        except (ValueError, TypeError) as e:  # GrammarRefused is a ValueError
            raise APIError(400, f"{source}: {e}", source) from None

    def sampling_params(self, req: Any, max_tokens: int | None, num_prompt_tokens: int,
                        logprobs: int | None, stream: bool,
                        constraint: Constraint | None = None,
                        prompt_logprobs: int | None = None,
                        max_tokens_field: str = "max_tokens",
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """The request's SamplingParams; as vLLM's server (not the offline LLM, which clamps),
        a prompt plus max_tokens over max_model_len is a 400 naming the numbers.
        `max_tokens_field`: the request field max_tokens came from, which a 400 names;
        `structured_outputs`: `constraint` as `structured_outputs()` validated it."""
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = room
        elif not isinstance(max_tokens, bool) and isinstance(max_tokens, int) \
                and max_tokens > room:
            raise APIError(400, f"This model's maximum context length is "
                                f"{self.max_model_len} tokens. However, you requested "
                                f"{num_prompt_tokens + max_tokens} tokens "
                                f"({num_prompt_tokens} in the prompt, {max_tokens} for the "
                                f"completion). Please reduce the prompt or "
                                f"{max_tokens_field}.", max_tokens_field)
        self.check_stop(req.stop)
        kw: dict[str, Any] = dict(
            # A beam search's width is its n; each of its requests is one sequence.
            n=1 if getattr(req, "use_beam_search", False) else req.n, stop=req.stop,
            stop_token_ids=req.stop_token_ids, seed=req.seed,
            max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias_ids(req.logit_bias),
            structured_outputs=structured_outputs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        try:
            params = SamplingParams(**kw)
            self.engine.processor.check_params(params)
            self.engine.processor.bad_words_token_ids(params.bad_words)  # a word without tokens
        except ValueError as e:
            m = _SAMPLING_PARAM.search(str(e))
            param = m.group(1) if m else None
            if param == "structured_outputs" and constraint is not None:
                param = constraint.source
            elif param == "max_tokens":
                param = max_tokens_field
            raise APIError(400, str(e), param) from None
        return params

    # --- generation ---------------------------------------------------------------------------

    async def generate(self, prompt: TokenizedPrompt, params: SamplingParams,
                       request_id: str, lora_request: LoRARequest | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """engine.generate with the server's error mapping and per-request metrics."""
        engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt.token_ids}
        if prompt.text is not None:
            engine_prompt["prompt"] = prompt.text
        num_generated = 0
        last: RequestOutput | None = None
        reason: str | None = "abort"
        try:
            async for out in self.engine.generate(engine_prompt, params, request_id,
                                                  lora_request):
                last = out
                num_generated += sum(len(c.token_ids) for c in out.outputs)
                if out.finished:
                    reason = next((c.finish_reason for c in out.outputs if c.finish_reason),
                                  "stop")
                yield out
        except EngineDeadError as e:
            raise APIError(503, f"the engine is dead and cannot serve requests: {e}",
                           None, "EngineDeadError") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        finally:
            if self.metrics is not None:
                self.metrics.record_request(len(prompt.token_ids), num_generated,
                                            last.metrics if last else None, reason,
                                            len(last.outputs) if last else 1)

    # --- logprobs -----------------------------------------------------------------------------

    def token_info(self, token_id: int) -> tuple[str, bytes]:
        hit = self._token_cache.get(token_id)
        if hit is None:
            hit = self._token_cache[token_id] = token_text_and_bytes(self.tokenizer, token_id,
                                                                     self._added)
        return hit

    def usage(self, num_prompt: int, num_completion: int) -> dict[str, int]:
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion}


async def merge(gens: list[AsyncIterator[Any]]) -> AsyncGenerator[tuple[int, Any], None]:
    """Items of several async iterators as they come, tagged with the iterator's index. An
    error in one ends the merge with it; leaving early cancels (and so aborts) the rest."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: B036 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def now() -> int:
    return int(time.time())
