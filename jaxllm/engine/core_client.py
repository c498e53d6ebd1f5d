"""EngineCoreClient: how the frontend talks to the engine core (vLLM's names).

`make_client(launch_config, engine_args)` (frontend.py) picks one of three:

  InprocClient   the core in this process and thread; get_output() runs one step
  SyncMPClient   the core in its own process (core_proc.py) over ZMQ; blocking calls
  AsyncMPClient  the same process and wire; `*_async` calls for an asyncio event loop

All three take requests in, give EngineCoreOutputs out and answer utility calls by name. The
multiprocess clients live in mp_client.py and never import the core (nor start a JAX backend);
the factory lives with its caller, so neither client module imports the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from jaxllm.engine import UTILITY_METHODS, EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from jaxllm.engine.core import EngineCore


class EngineCoreClient(ABC):
    @abstractmethod
    def get_engine_info(self) -> EngineCoreInfo:
        """What the core reported once it was ready (no round trip)."""

    # Blocking API (InprocClient, SyncMPClient).

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError(f"{type(self).__name__} has only the *_async methods")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has only the *_async methods")

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__} has only the *_async methods")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has only the *_async methods")

    # asyncio API (InprocClient, AsyncMPClient).

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no *_async methods")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no *_async methods")

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__} has no *_async methods")

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no *_async methods")

    def collective_rpc(self, method: str, args: tuple | list = ()) -> Any:
        """Call `method` on the core's model runner and return its result (vLLM's
        collective_rpc): how benchmarks and profilers read the worker."""
        return self.call_utility("collective_rpc", method, list(args))

    async def collective_rpc_async(self, method: str, args: tuple | list = ()) -> Any:
        return await self.call_utility_async("collective_rpc", method, list(args))

    def shutdown(self) -> None:  # noqa: B027 - nothing to release in process
        pass


def check_utility(method: str) -> None:
    if method not in UTILITY_METHODS:
        raise ValueError(f"{method!r} is not an engine-core utility; "
                         f"known: {sorted(UTILITY_METHODS)}")


class InprocClient(EngineCoreClient):
    """The engine core lives in this process and thread; get_output() runs one step. Its async
    methods run inline too (a step blocks the event loop: for debugging and tests)."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core

    def get_engine_info(self) -> EngineCoreInfo:
        return self.engine_core.get_engine_info()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        check_utility(method)
        return getattr(self.engine_core, method)(*args)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        return self.get_output()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return self.call_utility(method, *args)
