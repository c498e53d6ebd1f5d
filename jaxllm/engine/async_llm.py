"""AsyncLLM: the asyncio engine (vLLM's v1 AsyncLLM), what a server stands on.

    engine = AsyncLLM(model=..., **engine_args)
    async for out in engine.generate(prompt, SamplingParams(...), request_id):
        ...  # RequestOutputs as tokens arrive (SamplingParams.output_kind)

The engine core runs in its own process (AsyncMPClient), or several in theirs with
data_parallel_size > 1 (DPLBClient), unless multiprocess_mode=False (then each step runs inline
on the event loop: for debugging). One output-handler task per engine moves the
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

from jaxllm.config import UsageContext
from jaxllm.engine import EngineCoreDeadError, EngineDeadError, SchedulerStats
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.frontend import EngineFrontend, ParentRequests
from jaxllm.engine.processor import PromptType
from jaxllm.entrypoints.utils import enable_compilation_cache
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import EmbeddingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _OutputState:
    """What the output handler shares with the engine (and nothing that refers back to it)."""

    client: EngineCoreClient
    parent_requests: ParentRequests
    queues: dict[str, asyncio.Queue] = field(default_factory=dict)
    # Replaced by one of the running loop's own whenever the output handler (re)starts.
    has_requests: asyncio.Event = field(default_factory=asyncio.Event)
    dead: BaseException | None = None
    last_scheduler_stats: SchedulerStats = field(default_factory=SchedulerStats)
    # Called with every step's stats (vLLM's stat loggers; the server's /metrics is one).
    stat_loggers: list[Callable[[SchedulerStats], None]] = field(default_factory=list)


async def _abort(state: _OutputState, request_id: str) -> None:
    """End a request as aborted: its stream gets the final output, the core drops it."""
    child_ids, out = state.parent_requests.abort(request_id, stream=True)
    queue = state.queues.pop(request_id, None)
    if queue is not None and out is not None:
        queue.put_nowait(out)
    if child_ids and state.dead is None:
        await state.client.abort_requests_async(child_ids)


async def _fail_requests(state: _OutputState, err: EngineCoreDeadError) -> None:
    """End the requests a dead data-parallel core held: their streams raise EngineDeadError,
    as every stream does when the only core dies."""
    for request_id in state.parent_requests.parents_of(err.request_ids):
        child_ids, _ = state.parent_requests.abort(request_id, stream=True)
        queue = state.queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(EngineDeadError(*err.args))
        if child_ids:
            await state.client.abort_requests_async(child_ids)


async def _output_handler(state: _OutputState) -> None:
    client, output_processor = state.client, state.parent_requests.output_processor
    try:
        while True:
            if not output_processor.has_unfinished():
                # Idle: an in-process core would otherwise step in a busy loop.
                state.has_requests.clear()
                await state.has_requests.wait()
            try:
                outs = await client.get_output_async()
            except EngineCoreDeadError as e:  # one of several cores: its requests alone end
                await _fail_requests(state, e)
                continue
            if outs.scheduler_stats is not None:
                state.last_scheduler_stats = outs.scheduler_stats
                for log in state.stat_loggers:
                    try:
                        log(outs.scheduler_stats)
                    except Exception:  # a broken logger must not take the engine down
                        logger.exception("stat logger %r failed", log)
            request_outputs, to_abort = output_processor.process_outputs(outs.outputs,
                                                                         stream=True)
            for ro in request_outputs:
                queue = state.queues.get(ro.request_id)
                if queue is not None:
                    queue.put_nowait(ro)
                if ro.finished:
                    state.queues.pop(ro.request_id, None)
            if to_abort:
                await client.abort_requests_async(to_abort)
            for parent in state.parent_requests.release_siblings(outs.outputs):
                try:
                    for child in parent.waiting_siblings:
                        await client.add_request_async(child)
                except Exception:  # the core refused one: the whole request ends as aborted
                    await _abort(state, parent.request_id)
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
        for queue in state.queues.values():
            queue.put_nowait(err)
        state.queues.clear()


def _shutdown(client: EngineCoreClient, handler: list[asyncio.Task]) -> None:
    for task in handler:
        try:
            task.cancel()
        except RuntimeError:  # its loop is closed
            pass
    client.shutdown()


class AsyncLLM(EngineFrontend):
    """`AsyncLLM(model=None, dtype=None, stat_loggers=None, **engine_args)`, with the engine
    arguments of `LLM` (docs/engine_args.md); each stat logger is called with every step's
    SchedulerStats."""

    def __init__(self, model: str | Path | None = None, dtype: Any = None,
                 stat_loggers: list[Callable[[SchedulerStats], None]] | None = None,
                 **engine_args: Any) -> None:
        self._start(EngineArgs.from_user("AsyncLLM", model, dtype, engine_args), stat_loggers)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs,
                         stat_loggers: list[Callable[[SchedulerStats], None]] | None = None
                         ) -> AsyncLLM:
        engine = cls.__new__(cls)
        engine._start(engine_args, stat_loggers)
        return engine

    def _start(self, engine_args: EngineArgs,
               stat_loggers: list[Callable[[SchedulerStats], None]] | None) -> None:
        enable_compilation_cache()
        # The core's own process unless asked otherwise, on every platform
        # (DEFAULT_CPU_MULTIPROCESS): in process, each step would block the event loop.
        super().__init__(engine_args, UsageContext.ASYNC_LLM)
        client = self.engine_core = self.engine_core_client  # vLLM's AsyncLLM name
        self._state = _OutputState(client, self.parent_requests,
                                   stat_loggers=list(stat_loggers or ()))
        self._handler: list[asyncio.Task] = []  # shared with the finalizer
        self._finalizer = weakref.finalize(self, _shutdown, client, self._handler)

    # --- requests -----------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request: LoRARequest | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's RequestOutputs as the core produces them (by
        `sampling_params.output_kind`); the last one has `finished` set. Leaving the loop early
        (break, cancellation) aborts the request. `lora_request`: the adapter it runs with
        (needs enable_lora)."""
        outputs = self._outputs(prompt, sampling_params, request_id, lora_request)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # now, not when collected: it aborts an unfinished request

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None
                     ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """An embedding request (vLLM's AsyncLLM.encode; needs runner="pooling"): yields its
        one EmbeddingRequestOutput when the prompt is pooled. Leaving early aborts it."""
        outputs = self._outputs(prompt, pooling_params or PoolingParams(), request_id)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # now, not when collected: it aborts an unfinished request

    async def _outputs(self, prompt: PromptType, params: SamplingParams | PoolingParams | None,
                       request_id: str | None, lora_request: LoRARequest | None = None
                       ) -> AsyncGenerator[Any, None]:
        """Queue the request and yield its outputs until the finished one; leaving early
        aborts it."""
        if request_id is None:
            request_id = f"async-{self.parent_requests.request_index}"
        queue = await self.add_request(request_id, prompt, params, lora_request)
        finished = False
        try:
            while not finished:
                out = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(*out.args) from out
                finished = out.finished
                yield out
        finally:
            if not finished and self._finalizer.alive:
                await self.abort(request_id)

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams | PoolingParams | None = None,
                          lora_request: LoRARequest | None = None) -> asyncio.Queue:
        """Validate and queue a request; returns the queue its outputs arrive on."""
        state = self._state
        if state.dead is not None:
            raise EngineDeadError(*state.dead.args)
        self._ensure_output_handler()
        req = self.processor.process_inputs(request_id, prompt, sampling_params,
                                            lora_request=lora_request)
        parent = self.parent_requests.admit(req)
        queue: asyncio.Queue = asyncio.Queue()
        state.queues[request_id] = queue
        try:
            for child in parent.requests_to_add():
                await self.engine_core.add_request_async(child)
        except BaseException:
            await self.abort(request_id)
            raise
        self.parent_requests.admitted()
        state.has_requests.set()
        return queue

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests in the core (their blocks are freed); their streams end with a final
        output whose finish_reason is "abort"."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            await _abort(self._state, rid)

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

    @property
    def num_open_streams(self) -> int:
        """Requests whose output queue is still open (a finished or aborted one's is closed:
        none should outlive its request)."""
        return len(self._state.queues)

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def call_utility(self, method: str, *args: Any) -> Any:
        """A utility call on the core (see UTILITY_METHODS), e.g. "get_kv_block_counts"."""
        return await self.engine_core.call_utility_async(method, *args)

    def shutdown(self) -> None:
        """Stop the output handler and the core's process; idempotent."""
        self._finalizer()

