"""The OpenAI-compatible HTTP server (vLLM's `vllm serve`): FastAPI + uvicorn over one AsyncLLM.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (OpenAI's API), and
GET /health, GET /version, POST /tokenize, POST /detokenize, GET /metrics.

Every error is OpenAI's body ({"error": {"message", "type", "param", "code"}}) with a 4xx for a bad
request and 503 once the engine is dead; a bad request changes nothing in the engine. Bodies are
read here, not by FastAPI, so that the size limit (413) also counts chunked bodies and malformed
JSON is a 400 like any other. With an API key, every /v1 route wants `Authorization: Bearer KEY`
(compared in constant time); /health, /version and /metrics stay open, as in vLLM.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.engine import EngineDeadError
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.metrics import ServerMetrics
from jaxllm.entrypoints.openai.protocol import (
    APIError,
    DetokenizeRequest,
    parse_request,
)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxllm.entrypoints.openai.serving_engine import StructuredOutputsConfig

logger = logging.getLogger("jaxllm.server")

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


def engine_dead(engine: AsyncLLM) -> bool:
    """The output handler saw the core die, or the client's monitor did (an idle engine's
    handler is not waiting on the core)."""
    resources = getattr(engine.engine_core, "resources", None)
    return engine.errored or getattr(resources, "dead", None) is not None


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body; 413 over `limit` bytes (chunked bodies counted as they come),
    400 for anything that is not JSON (NaN and Infinity included)."""
    declared = request.headers.get("content-length", "")
    size, chunks, too_big = 0, [], declared.isdigit() and int(declared) > limit
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_big = True
        if too_big:
            if size > _DRAIN_LIMIT:
                break
            continue
        chunks.append(chunk)
    if too_big:
        raise APIError(413, f"the request body exceeds the server's limit of {limit} bytes "
                            f"(--max-request-bytes)", None, "RequestTooLargeError")

    def reject(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(b"".join(chunks), parse_constant=reject)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise APIError(400, "the request body is nested too deeply") from None


class AuthMiddleware:
    """401 for /v1 requests without `Authorization: Bearer <key>` (a pure ASGI middleware:
    streaming responses and their cancellation pass through untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") \
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


def _respond(result: dict[str, Any] | AsyncGenerator[str, None]) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def build_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="jaxllm OpenAI-compatible server", version=jaxllm.__version__,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

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
            raise APIError(503, "the engine core process is dead; restart the server",
                           None, "EngineDeadError")

    async def body_of(request: Request) -> Any:
        return await read_json(request, state.max_request_bytes)

    @app.get("/health")
    async def health() -> Response:
        if engine_dead(state.engine):
            return JSONResponse(APIError(503, "the engine core process is dead", None,
                                         "EngineDeadError").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": jaxllm.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        if not engine_dead(state.engine):
            try:
                free, usable = await state.engine.call_utility("get_kv_block_counts")
                state.metrics.record_kv_blocks(free, usable)
            except EngineDeadError:  # it died in between: serve the last values
                pass
            except Exception:  # a bug, not a death: say so, and still serve the counters
                logger.exception("reading the KV pool for /metrics failed")
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "jaxllm", "root": state.model_root, "parent": None,
            "max_model_len": state.completion.max_model_len}]}

    async def generate(request: Request, create: Callable[[Any], Awaitable[Any]]) -> Response:
        body = await body_of(request)
        live()
        result = await until_disconnect(request, create(body))
        return Response(status_code=499) if result is None else _respond(result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, state.completion.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, state.chat.create_chat_completion)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await state.chat.create_tokenize(await body_of(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await body_of(request))
        state.completion.check_model(req.model)
        vocab = state.engine.core_info.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                           "tokens")
        return {"prompt": state.completion.tokenizer.decode(req.tokens)}

    return AuthMiddleware(app, api_key) if api_key else app  # type: ignore[return-value]


def make_state(engine: AsyncLLM, model_name: str, model_root: str,
               metrics: ServerMetrics, max_request_bytes: int,
               structured_outputs_config: StructuredOutputsConfig | None = None,
               trust_request_chat_template: bool = False) -> ServerState:
    return ServerState(engine, model_name, model_root,
                       OpenAIServingCompletion(engine, model_name, metrics,
                                               structured_outputs_config),
                       OpenAIServingChat(engine, model_name, metrics,
                                         structured_outputs_config,
                                         trust_request_chat_template), metrics,
                       max_request_bytes, int(time.time()))

