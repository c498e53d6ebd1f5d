"""The OpenAI-compatible HTTP server (vLLM's `vllm serve`): FastAPI + uvicorn over one AsyncLLM.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings
(OpenAI's API; an engine serves text or, with --runner pooling, embeddings), and
GET /health, GET /version, POST /tokenize, POST /detokenize, GET /metrics, GET /openapi.json
(the request models' schemas, so that clients and fuzzers know the bounds).

Every error is OpenAI's body ({"error": {"message", "type", "param", "code"}}) with a 4xx for a bad
request and 503 once the engine is dead; a bad request changes nothing in the engine. Bodies are
read here, not by FastAPI, so that the size limit (413) also counts chunked bodies and malformed
JSON is a 400 like any other; a POST body must be UTF-8 JSON (415 otherwise) and arrive within
the body timeout (408). With an API key, every route but /health, /version, /metrics and
/openapi.json wants `Authorization: Bearer KEY` (compared in constant time).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.engine import EngineDeadError
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.dp_client import DPLBClient
from jaxllm.entrypoints.openai.metrics import ServerMetrics
from jaxllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    parse_request,
)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from jaxllm.entrypoints.openai.serving_engine import ServerLimits, StructuredOutputsConfig
from jaxllm.lora.request import LoRARequest
from jaxllm.structured_output.validator import GrammarValidator

logger = logging.getLogger("jaxllm.server")

# Routes that need no API key: probes, scrapers and the schema carry no request data.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json"})

# How long a /metrics scrape waits for the engine core's counters.
METRICS_STATE_TIMEOUT_S = 2.0

# A body over the limit is still read (and dropped) up to this size, so that the client sees
# the 413 instead of a connection reset; beyond it the connection is closed.
_DRAIN_LIMIT = 64 << 20


@dataclass
class ServerState:
    engine: AsyncLLM
    model_name: str
    model_root: str
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    metrics: ServerMetrics
    max_request_bytes: int
    created: int
    # Seconds a client gets to send a whole request body (408 after).
    body_timeout: float = 60.0
    embedding: OpenAIServingEmbedding | None = None
    # --lora-modules: adapter name -> its request, each also a model a request may name.
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)


def engine_dead(engine: AsyncLLM) -> bool:
    """The output handler saw the core die, or the client's monitor did (an idle engine's
    handler is not waiting on the core); with data parallelism, every core."""
    client = engine.engine_core
    if isinstance(client, DPLBClient):
        return engine.errored or client.num_live_engines == 0
    resources = getattr(client, "resources", None)
    return engine.errored or getattr(resources, "dead", None) is not None


def num_engines(engine: AsyncLLM) -> int:
    client = engine.engine_core
    return len(client.cores) if isinstance(client, DPLBClient) else 1


def check_content_type(request: Request) -> None:
    """415 unless the body is declared JSON in UTF-8, the only encoding the server reads (a
    request without Content-Type is read as JSON)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media, _, params = declared.partition(";")
    charset = ""
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.strip().lower() != "application/json" or charset not in ("", "utf-8", "utf8"):
        raise APIError(415, f"the request body must be JSON in UTF-8 (Content-Type: "
                            f"application/json), got Content-Type {declared[:100]!r}",
                       None, "UnsupportedMediaTypeError")


async def read_json(request: Request, limit: int, timeout: float = 60.0) -> Any:
    """The request's JSON body; 413 over `limit` bytes (chunked bodies counted as they come),
    408 when it has not all arrived within `timeout` seconds, 415 for a body that is not
    UTF-8 (a byte-order mark, UTF-16), 400 for anything that is not JSON (NaN and Infinity
    included)."""
    check_content_type(request)
    declared = request.headers.get("content-length", "")
    size, chunks, too_big = 0, [], declared.isdigit() and int(declared) > limit
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    too_big = True
                if too_big:
                    if size > _DRAIN_LIMIT:
                        break
                    continue
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       None, "RequestTimeoutError") from None
    if too_big:
        raise APIError(413, f"the request body exceeds the server's limit of {limit} bytes "
                            f"(--max-request-bytes)", None, "RequestTooLargeError")
    data = b"".join(chunks)
    # json.loads would guess UTF-16/32 from the first bytes and skip a BOM; we read UTF-8 only.
    if data[:3] == b"\xef\xbb\xbf" or b"\x00" in data[:4]:
        raise APIError(415, "the request body must be UTF-8 JSON without a byte-order mark "
                            "(it looks like UTF-16, UTF-32 or has a BOM)",
                       None, "UnsupportedMediaTypeError")

    def reject(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(data.decode(), parse_constant=reject)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise APIError(400, "the request body is nested too deeply") from None


class AuthMiddleware:
    """401 for requests without `Authorization: Bearer <key>` outside OPEN_PATHS (a pure ASGI
    middleware: streaming responses and their cancellation pass through untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS \
                and scope.get("method") != "OPTIONS":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer "
                                    "<key>'", None, "AuthenticationError")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (which
    aborts its requests in the engine) and None returned (vLLM's with_cancellation). Streaming
    responses need none of this: Starlette cancels their generator itself."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        # The body was read; the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


def _render_json(content: dict[str, Any]) -> bytes:
    """What JSONResponse renders."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


def _respond(result: dict[str, Any] | AsyncGenerator[str, None]) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}
_REQUEST_BODIES = {"/v1/completions": CompletionRequest,
                   "/v1/chat/completions": ChatCompletionRequest,
                   "/v1/embeddings": EmbeddingRequest,
                   "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
_OK_SCHEMAS: dict[str, dict[str, Any]] = {
    "/tokenize": {"type": "object", "required": ["count", "max_model_len", "tokens"],
                  "properties": {"count": {"type": "integer"},
                                 "max_model_len": {"type": "integer"},
                                 "tokens": {"type": "array", "items": {"type": "integer"}}}},
    "/detokenize": {"type": "object", "required": ["prompt"],
                    "properties": {"prompt": {"type": "string"}}},
    "/v1/models": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"]}}}},
    "/v1/completions": {"type": "object", "required": ["id", "object", "choices"]},
    "/v1/chat/completions": {"type": "object", "required": ["id", "object", "choices"]},
    "/v1/embeddings": {"type": "object", "required": ["object", "data", "model", "usage"]},
}


def openapi_schema(app: FastAPI, api_key: bool, model_name: str,
                   adapter_names: list[str] | None = None) -> dict[str, Any]:
    """FastAPI's schema of the routes, with what it cannot see: the bodies are read by
    `read_json`, not by FastAPI, so each POST route's request model is added here (`model`
    narrowed to the served name and the LoRA adapters' names, the only ones not answered
    404), with the error body of every 4xx/5xx the server answers."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = _ERROR_SCHEMA
    error = {"description": "OpenAI's error body", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            responses = op["responses"] = {"200": op["responses"].get("200", {
                "description": "OK"})}
            ok = _OK_SCHEMAS.get(path)
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}
            elif path == "/health":
                responses["200"] = {"description": "OK, no body (with data parallelism: "
                                                   "each engine core, live or dead, as JSON)"}
            elif ok is not None:
                content = {"application/json": {"schema": ok}}
                if path.startswith("/v1/") and method == "post" and path != "/v1/embeddings":
                    # Each event: a JSON chunk as `data`, the last one `[DONE]`.
                    content["text/event-stream"] = {"schema": {
                        "type": "object", "required": ["data"],
                        "properties": {"data": {"type": "string"}}}}
                responses["200"] = {"description": "OK", "content": content}
            model = _REQUEST_BODIES.get(path)
            if model is not None:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}",
                                               by_alias=True)
                components.update(body.pop("$defs", {}))
                body["properties"]["model"] = {"anyOf": [
                    *({"const": name} for name in [model_name, *(adapter_names or [])]),
                    {"type": "null"}]}
                components[model.__name__] = body
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
                codes = ("400", "404", "408", "413", "415", "503")
            elif path in OPEN_PATHS:
                codes = ("503",) if path == "/health" else ()
            else:
                codes = ("503",)
            if api_key and path not in OPEN_PATHS:
                codes = ("401", *codes)
            if path.startswith("/v1/") and method == "post":
                codes = (*codes, "499")  # the client went away before the answer
            for code in codes:
                responses[code] = error if code != "499" else {"description": "no answer"}
            if api_key and path not in OPEN_PATHS:
                op["security"] = [{"bearer": []}]
    if api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                              "scheme": "bearer"}}
    return schema


def build_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="jaxllm OpenAI-compatible server", version=jaxllm.__version__,
                  docs_url=None, redoc_url=None)
    app.state.server = state
    cached: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not cached:
            cached.append(openapi_schema(app, api_key is not None, state.model_name,
                                         list(state.lora_modules)))
        return cached[0]

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(e.status_code, str(e.detail), None,
                       "NotFoundError" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        err = APIError(500, f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(err.body(), status_code=500)

    def live() -> None:
        if engine_dead(state.engine):
            client = state.engine.engine_core
            if isinstance(client, DPLBClient) and client.num_restarting_engines \
                    and not state.engine.errored:
                raise APIError(503, "every engine core process is dead; one is restarting",
                               None, "EngineDeadError")
            raise APIError(503, "the engine core process is dead; restart the server",
                           None, "EngineDeadError")

    async def body_of(request: Request) -> Any:
        return await read_json(request, state.max_request_bytes, state.body_timeout)

    @app.get("/health")
    async def health() -> Response:
        client = state.engine.engine_core
        dead = engine_dead(state.engine)
        if not isinstance(client, DPLBClient):
            if dead:
                return JSONResponse(APIError(503, "the engine core process is dead", None,
                                             "EngineDeadError").body(), status_code=503)
            return Response(status_code=200)
        # Data parallelism: healthy while one core lives; the body says which do.
        engines = [{"engine": e.engine_index, "host": e.host, "pid": e.pid,
                    "alive": e.alive and not dead, "restarts": e.restarts,
                    **({} if e.placement is None else {"placement": e.placement})}
                   for e in client.engine_states()]
        body = {"num_live_engines": sum(e["alive"] for e in engines), "engines": engines}
        if dead:
            restarting = client.num_restarting_engines and not state.engine.errored
            message = "every engine core process is dead" + ("; one is restarting"
                                                             if restarting else "")
            return JSONResponse({**APIError(503, message, None, "EngineDeadError").body(),
                                 **body}, status_code=503)
        return JSONResponse(body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": jaxllm.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        client = state.engine.engine_core
        if isinstance(client, DPLBClient):
            state.metrics.record_engines([(e.engine_index, e.alive, e.num_routed, e.restarts)
                                          for e in client.engine_states()])
        else:
            state.metrics.engines_alive.set(int(not engine_dead(state.engine)))
        if engine_dead(state.engine):
            for i in range(num_engines(state.engine)):
                state.metrics.record_engine_dead(i)
        else:
            try:
                # The core answers between steps; a long one (a first compile) must not hold
                # the scrape past a scraper's timeout: the gauges keep their last values.
                answer = await asyncio.wait_for(
                    state.engine.call_utility("get_scheduler_state"), METRICS_STATE_TIMEOUT_S)
                # One answer per core with data parallelism (None: a dead one).
                for i, sched in enumerate(answer if isinstance(answer, list) else [answer]):
                    if sched is None:
                        state.metrics.record_engine_dead(i)
                    else:
                        state.metrics.record_scheduler_state(sched, i)
            except TimeoutError:
                pass
            except EngineDeadError:  # it died in between: it holds nothing any more
                for i in range(num_engines(state.engine)):
                    state.metrics.record_engine_dead(i)
            except Exception:  # a bug, not a death: say so, and still serve the counters
                logger.exception("reading the scheduler for /metrics failed")
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        live()
        base = {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "jaxllm", "root": state.model_root, "parent": None,
                "max_model_len": state.completion.max_model_len}
        # As vLLM: each adapter a model of its own, its parent the base model.
        adapters = [{**base, "id": name, "root": lora.lora_path, "parent": state.model_name}
                    for name, lora in state.lora_modules.items()]
        return {"object": "list", "data": [base, *adapters]}

    async def generate(request: Request, create: Callable[[Any], Awaitable[Any]]) -> Response:
        body = await body_of(request)
        live()
        result = await until_disconnect(request, create(body))
        if result is None:
            return Response(status_code=499)
        if isinstance(result, dict):
            # Rendered beside the event loop: echoed logprobs make responses of megabytes.
            return Response(await asyncio.to_thread(_render_json, result),
                            media_type="application/json")
        return _respond(result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, state.completion.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, state.chat.create_chat_completion)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        assert state.embedding is not None  # make_state builds it
        return await generate(request, state.embedding.create_embedding)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        live()
        return await state.chat.create_tokenize(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        live()
        req: DetokenizeRequest = parse_request(DetokenizeRequest, body)
        state.completion.check_model(req.model)
        vocab = state.engine.core_info.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                           "tokens")
        return {"prompt": state.completion.tokenizer.decode(req.tokens)}

    return AuthMiddleware(app, api_key) if api_key else app  # type: ignore[return-value]


def header_timeout_protocol(timeout: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a request's headers
    within `timeout` seconds of its opening or of the first byte of a later request: uvicorn's
    keep-alive timer stops at the first byte, so a client trickling headers would hold a
    connection forever (the body has its own timeout, in `read_json`). Between requests the
    connection is idle and the keep-alive timeout alone applies: a shorter timer there would
    close idle connections a client's pool still counts as open, and the request it sends on
    one as it closes fails."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _between_requests = False  # a response done, the next request's first byte not in

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._between_requests and data:
                self._between_requests = False
                self._arm()
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are in
                self._between_requests = False
                self._disarm()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()  # may start a pipelined request (a new cycle)
            if self.cycle is cycle and not self.transport.is_closing():
                if self.conn.their_state is h11.SEND_BODY:
                    # Answered before its body was all in (a body timeout, a size limit): what
                    # follows on this connection cannot be told from the rest of that body.
                    self.transport.close()
                else:
                    self._between_requests = True

    return HeaderTimeoutH11Protocol


def make_state(engine: AsyncLLM, model_name: str, model_root: str,
               metrics: ServerMetrics, max_request_bytes: int,
               structured_outputs_config: StructuredOutputsConfig | None = None,
               trust_request_chat_template: bool = False,
               limits: ServerLimits | None = None,
               reasoning_parser: str | None = None,
               lora_modules: dict[str, LoRARequest] | None = None) -> ServerState:
    """`lora_modules`: adapter name -> LoRARequest, each checked by the engine's processor
    now (a bad one stops the server from starting, naming it)."""
    limits = limits or ServerLimits()
    lora_modules = dict(lora_modules or {})
    for name, lora in lora_modules.items():
        if name == model_name:
            raise ValueError(f"--lora-modules: adapter name {name!r} is the served model's")
        engine.processor.check_lora(lora)
    # One pool of validator workers for both routes.
    validator = GrammarValidator(timeout_s=limits.structured_output_timeout,
                                 memory_mib=limits.structured_output_memory_mib)
    state = ServerState(engine, model_name, model_root,
                       OpenAIServingCompletion(engine, model_name, metrics,
                                               structured_outputs_config, limits=limits,
                                               validator=validator),
                       OpenAIServingChat(engine, model_name, metrics,
                                         structured_outputs_config,
                                         trust_request_chat_template, limits, validator,
                                         reasoning_parser),
                       metrics, max_request_bytes, int(time.time()),
                       embedding=OpenAIServingEmbedding(engine, model_name, metrics,
                                                        limits=limits, validator=validator),
                       lora_modules=lora_modules)
    for serving in (state.completion, state.chat, state.embedding):
        if serving is not None:
            serving.lora_modules = lora_modules
    return state

