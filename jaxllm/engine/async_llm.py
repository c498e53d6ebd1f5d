"""AsyncLLM: the asyncio engine (vLLM's v1 AsyncLLM), what a server stands on.

    engine = AsyncLLM(model=..., **engine_args)
    async for out in engine.generate(prompt, SamplingParams(...), request_id):
        ...  # RequestOutputs as tokens arrive (SamplingParams.output_kind)

The engine core runs in its own process (AsyncMPClient) unless multiprocess_mode=False (then each
step runs inline on the event loop: for debugging). One output-handler task per engine moves the
core's outputs through the OutputProcessor (detokenizing, stop strings) into per-request queues;
`generate` reads its queue. A consumer that stops early (cancelled, or the generator closed)
aborts its request in the core, which frees its KV blocks.

The handler task and the finalizer hold the client, the processors and the queues, never the
AsyncLLM: dropping the last reference to the engine shuts the core down.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxllm.engine import EngineCoreInfo, EngineDeadError, SchedulerStats
from jaxllm.engine.arg_utils import EngineArgs, resolve_multiprocess_mode
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.processor import Processor, PromptType
from jaxllm.entrypoints.utils import enable_compilation_cache
from jaxllm.model_executor.model_loader.default_model import default_model_path
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _OutputState:
    """What the output handler shares with the engine (and nothing that refers back to it)."""

    client: EngineCoreClient
    output_processor: OutputProcessor
    queues: dict[str, asyncio.Queue] = field(default_factory=dict)
    has_requests: asyncio.Event | None = None
    dead: BaseException | None = None
    last_scheduler_stats: SchedulerStats = field(default_factory=SchedulerStats)
    # Called with every step's stats (vLLM's stat loggers; the server's /metrics is one).
    stat_loggers: list[Callable[[SchedulerStats], None]] = field(default_factory=list)


async def _output_handler(state: _OutputState) -> None:
    client, op = state.client, state.output_processor
    try:
        while True:
            if not op.has_unfinished():
                # Idle: an in-process core would otherwise step in a busy loop.
                state.has_requests.clear()
                await state.has_requests.wait()
            outs = await client.get_output_async()
            if outs.scheduler_stats is not None:
                state.last_scheduler_stats = outs.scheduler_stats
                for log in state.stat_loggers:
                    try:
                        log(outs.scheduler_stats)
                    except Exception:  # a broken logger must not take the engine down
                        logger.exception("stat logger %r failed", log)
            request_outputs, to_abort = op.process_outputs(outs.outputs, stream=True)
            for ro in request_outputs:
                q = state.queues.get(ro.request_id)
                if q is not None:
                    q.put_nowait(ro)
                if ro.finished:
                    state.queues.pop(ro.request_id, None)
            if to_abort:
                await client.abort_requests_async(to_abort)
            # Let the consumers run (an in-process step returns without yielding).
            await asyncio.sleep(0)
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        err = e if isinstance(e, EngineDeadError) else EngineDeadError(
            f"the output handler failed: {type(e).__name__}: {e}")
        if err is not e:
            err.__cause__ = e
        state.dead = err
        for q in state.queues.values():
            q.put_nowait(err)
        state.queues.clear()


def _shutdown(client: EngineCoreClient, handler: list[asyncio.Task]) -> None:
    for task in handler:
        try:
            task.cancel()
        except RuntimeError:  # its loop is closed
            pass
    client.shutdown()


class AsyncLLM:
    """`AsyncLLM(model=None, dtype=None, stat_loggers=None, **engine_args)`, with the engine
    arguments of `LLM`; each stat logger is called with every step's SchedulerStats."""

    def __init__(self, model: str | Path | None = None, dtype: Any = None,
                 stat_loggers: list[Callable[[SchedulerStats], None]] | None = None,
                 **engine_args: Any) -> None:
        args = self.engine_args = EngineArgs.from_user("AsyncLLM", model, dtype, engine_args)
        enable_compilation_cache()
        path = default_model_path() if args.model is None else Path(args.model)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(path)
        # The core's own process unless asked otherwise, on every platform: in process, each
        # step would block the event loop.
        self.multiprocess_mode = resolve_multiprocess_mode(args.multiprocess_mode,
                                                           default_cpu=True)
        client = EngineCoreClient.make_client(self.multiprocess_mode, True, args)
        self.engine_core = client
        info: EngineCoreInfo = client.get_engine_info()
        self.core_info = info
        eos = set(info.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.processor = Processor(self.tokenizer, info, frozenset(eos), args.max_n)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._state = _OutputState(client, self.output_processor,
                                   stat_loggers=list(stat_loggers or ()))
        self._handler: list[asyncio.Task] = []  # shared with the finalizer
        self._request_index = 0
        self._finalizer = weakref.finalize(self, _shutdown, client, self._handler)

    # --- requests -----------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's RequestOutputs as the core produces them (by
        `sampling_params.output_kind`); the last one has `finished` set. Leaving the loop early
        (break, cancellation) aborts the request."""
        if request_id is None:
            request_id = f"async-{self._request_index}"
        q = await self.add_request(request_id, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                out = q.get_nowait() if not q.empty() else await q.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(*out.args) from out
                finished = out.finished
                yield out
        finally:
            if not finished and self._finalizer.alive:
                await self.abort(request_id)

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams | None = None) -> asyncio.Queue:
        """Validate and queue a request; returns the queue its outputs arrive on."""
        state = self._state
        if state.dead is not None:
            raise EngineDeadError(*state.dead.args)
        self._ensure_output_handler()
        req = self.processor.process_inputs(request_id, prompt, sampling_params)
        op = self.output_processor
        taken = [i for i in [req.request_id, *req.child_ids] if op.owns(i)]
        if taken:
            raise ValueError(f"request id {request_id!r} is already in use (or one of its "
                             f"sequence ids is): {taken}")
        index = self._request_index
        seed = self.engine_args.seed
        children = [c if c.seed is not None else _with_seed(c, [seed, index, i])
                    for i, c in enumerate(req.child_requests)]
        q: asyncio.Queue = asyncio.Queue()
        op.add_request(req.request_id, req.prompt, req.prompt_token_ids, req.child_ids,
                       [c.sampling_params for c in children], req.arrival_time)
        state.queues[request_id] = q
        try:
            for child in children:
                await self.engine_core.add_request_async(child)
        except BaseException:
            await self.abort(request_id)
            raise
        self._request_index += 1
        state.has_requests.set()
        return q

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests in the core (their blocks are freed); their streams end with a final
        output whose finish_reason is "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            parent = self.output_processor.parents.get(rid)
            if parent is None:
                continue
            child_ids = [c.request_id for c in parent.children if c.finish_reason is None]
            out = self.output_processor.abort_parent(rid, stream=True)
            q = self._state.queues.pop(rid, None)
            if q is not None and out is not None:
                q.put_nowait(out)
            if child_ids and self._state.dead is None:
                await self.engine_core.abort_requests_async(child_ids)

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._handler[0] if self._handler else None
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._state.has_requests = asyncio.Event()
        self._handler[:] = [loop.create_task(_output_handler(self._state),
                                             name="AsyncLLM.output_handler")]

    # --- engine -------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._state.dead is not None

    @property
    def last_scheduler_stats(self) -> SchedulerStats:
        return self._state.last_scheduler_stats

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def call_utility(self, method: str, *args: Any) -> Any:
        """A utility call on the core (see UTILITY_METHODS), e.g. "get_kv_block_counts"."""
        return await self.engine_core.call_utility_async(method, *args)

    def shutdown(self) -> None:
        """Stop the output handler and the core's process; idempotent."""
        self._finalizer()


def _with_seed(req: Any, seed: list[int]) -> Any:
    import msgspec

    return msgspec.structs.replace(req, seed=seed)
