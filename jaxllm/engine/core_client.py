"""EngineCoreClient: how the frontend talks to the engine core (vLLM's names). Today the core
runs in the caller's process (InprocClient); the interface is the one a client for a core in
another process implements: requests in, EngineCoreOutputs out, utility calls by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from jaxllm.engine import EngineCoreOutputs, EngineCoreRequest
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.core import UTILITY_METHODS, EngineCore


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(engine_args: EngineArgs) -> EngineCoreClient:
        return InprocClient(EngineCore(engine_args))

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    def shutdown(self) -> None:  # noqa: B027 - nothing to release in process
        pass


class InprocClient(EngineCoreClient):
    """The engine core lives in this process and thread; get_output() runs one step."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        if method not in UTILITY_METHODS:
            raise ValueError(f"{method!r} is not an engine-core utility; "
                             f"known: {sorted(UTILITY_METHODS)}")
        return getattr(self.engine_core, method)(*args)
