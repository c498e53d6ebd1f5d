"""What LLMEngine (blocking) and AsyncLLM (asyncio) share, so they cannot drift.

EngineFrontend, their base class, builds the frontend: the tokenizer, the engine core client, the
Processor and the OutputProcessor. ParentRequests admits requests (id check, default seeds,
output state, n > 1 fan-out as ParentRequests) and aborts them. Neither makes a call to the core
for a request: the two shells send what ParentRequests returns, the one with blocking calls, the
other with `*_async` ones. ParentRequests refers to no shell, so AsyncLLM's output handler can
hold it without keeping the engine alive.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from jaxllm.config import EngineConfig, LaunchConfig, UsageContext, resolve_model
from jaxllm.engine import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.core_client import EngineCoreClient, InprocClient
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.processor import ProcessedRequest, Processor
from jaxllm.model_executor.model_loader.hub import is_hub_id
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
from jaxllm.outputs import AnyRequestOutput


@dataclass
class ParentRequest:
    """A user request fanned out to its n sequences (vLLM's ParentRequest). The core gets the
    first one at once; with prefix caching the siblings wait until it has computed the prompt,
    so they find its KV blocks in the prefix cache instead of computing them again."""

    request_id: str
    child_requests: list[EngineCoreRequest]
    waiting_siblings: list[EngineCoreRequest]

    @property
    def first_child_id(self) -> str:
        return self.child_requests[0].request_id

    def requests_to_add(self) -> list[EngineCoreRequest]:
        """What the core gets at admission."""
        return self.child_requests[:len(self.child_requests) - len(self.waiting_siblings)]


class ParentRequests:
    """The live requests' admission and abort bookkeeping around the OutputProcessor."""

    def __init__(self, output_processor: OutputProcessor, seed: int,
                 enable_prefix_caching: bool) -> None:
        self.output_processor = output_processor
        self.seed = seed
        self.defer_siblings = enable_prefix_caching
        # Parents whose siblings wait, by the id of their first child.
        self._waiting: dict[str, ParentRequest] = {}
        self.request_index = 0  # requests admitted so far: default seeds and ids

    def admit(self, req: ProcessedRequest) -> ParentRequest:
        """Register a validated request (its output state, its waiting siblings) before the
        core sees any of it: a core in another process may answer at once. The caller adds
        `requests_to_add()` to the core, then calls `admitted`; if adding fails, `abort`."""
        owner = self.output_processor
        taken = [i for i in [req.request_id, *req.child_ids] if owner.owns(i)]
        if taken:
            raise ValueError(f"request id {req.request_id!r} is already in use (or one of its "
                             f"sequence ids {req.child_ids} is): {taken}")
        index = self.request_index
        children = [c if c.seed is not None else _with_seed(c, [self.seed, index, i])
                    for i, c in enumerate(req.child_requests)]
        owner.add_request(req.request_id, req.prompt, req.prompt_token_ids, req.child_ids,
                          [c.sampling_params for c in children], req.arrival_time,
                          pooling=children[0].pooling_params is not None)
        parent = ParentRequest(req.request_id, children,
                               children[1:] if self.defer_siblings else [])
        if parent.waiting_siblings:
            self._waiting[parent.first_child_id] = parent
        return parent

    def admitted(self) -> None:
        # Only queued requests count, so a refused one does not shift later default seeds.
        self.request_index += 1

    def abort(self, request_id: str, stream: bool = False
              ) -> tuple[list[str], AnyRequestOutput | None]:
        """End a request (by the id it was admitted with) as aborted: (its unfinished sequence
        ids, to abort in the core; its final output, None for an unknown id)."""
        parent = self.output_processor.parents.get(request_id)
        if parent is None:
            return [], None
        child_ids = [c.request_id for c in parent.children if c.finish_reason is None]
        self._waiting.pop(parent.children[0].request_id, None)
        return child_ids, self.output_processor.abort_parent(request_id, stream=stream)

    def parents_of(self, child_ids: list[str]) -> list[str]:
        """The live requests these sequence ids belong to (each once, in order)."""
        children = self.output_processor.children
        return list(dict.fromkeys(children[c].parent_id for c in child_ids if c in children))

    def release_siblings(self, outputs: list[EngineCoreOutput]) -> list[ParentRequest]:
        """The parents whose first sequence computed the whole prompt in this step: their
        siblings go to the core now."""
        released = []
        for out in outputs:
            # Not on a prompt-logprobs-only output of a partial prefill: the prompt is whole
            # in the cache once the first sequence samples (or ends).
            if out.new_token_ids or out.finished:
                parent = self._waiting.pop(out.request_id, None)
                if parent is not None:
                    released.append(parent)
        return released


def make_client(launch_config: LaunchConfig, engine_args: EngineArgs,
                remote_engine_args: EngineArgs | None = None) -> EngineCoreClient:
    """The client of a new engine core: in this process (InprocClient), or in its own process
    with blocking (SyncMPClient) or asyncio (AsyncMPClient, for AsyncLLM) calls, or several
    data-parallel cores in processes of their own (DPLBClient) (vLLM's
    EngineCoreClient.make_client). The core is imported only when it runs here (it brings JAX),
    the multiprocess clients only when picked (they bring ZMQ)."""
    if launch_config.parallel_config.data_parallel_size > 1:
        from jaxllm.engine.dp_client import DPLBClient

        # Cores on other hosts get the model as the user named it (each resolves a Hub id).
        return DPLBClient(engine_args, launch_config, remote_engine_args)
    if launch_config.multiprocess_mode:
        from jaxllm.engine.mp_client import AsyncMPClient, SyncMPClient

        if launch_config.usage_context is UsageContext.ASYNC_LLM:
            return AsyncMPClient(engine_args, launch_config)
        return SyncMPClient(engine_args, launch_config)
    from jaxllm.engine.core import EngineCore

    return InprocClient(EngineCore(engine_args, launch_config))


def local_core_args(args: EngineArgs, path: Path, num_local_cores: int) -> EngineArgs:
    """The engine arguments of this host's cores: Hub ids (the model, resolved to `path`, and
    a draft model) looked up and downloaded here, once, so that the cores load local snapshots
    (cores on other hosts get the ids as named and resolve them themselves). A draft only where
    this host runs cores: elsewhere its name may be a path that exists on the cores' hosts."""
    changes: dict[str, Any] = {}
    if is_hub_id(args.model):
        changes["model"] = str(path)
    spec = args.speculative_config
    if spec is not None and num_local_cores > 0 and is_hub_id(spec.get("model")):
        draft = resolve_model(spec["model"], spec.get("revision"), args.download_dir)
        changes["speculative_config"] = {**spec, "model": str(draft), "revision": None}
    return dataclasses.replace(args, **changes) if changes else args


def named_as_given(config: EngineConfig, args: EngineArgs) -> EngineConfig:
    """`config` of cores that loaded local snapshots, with the models named as in `args`."""
    spec = config.speculative_config
    if spec is not None and args.speculative_config is not None:
        given = args.speculative_config
        spec = dataclasses.replace(spec, model=given.get("model"),
                                   revision=given.get("revision"))
    return dataclasses.replace(config, model=args.model or config.model,
                               speculative_config=spec)


class EngineFrontend:
    """The frontend of one engine; `usage_context` names the shell (LLMEngine or AsyncLLM)."""

    def __init__(self, engine_args: EngineArgs, usage_context: UsageContext) -> None:
        # Decided here, before any JAX backend starts; the core gets the outcome.
        self.launch_config = engine_args.create_launch_config(usage_context)
        args = self.engine_args = engine_args
        path = resolve_model(args.model, args.revision, args.download_dir)
        # The tokenizer first: a missing one fails in seconds, not after minutes of compiling.
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(path)
        core_args = local_core_args(
            args, path, self.launch_config.parallel_config.data_parallel_size_local)
        self.engine_core_client = make_client(self.launch_config, core_args, args)
        info: EngineCoreInfo = self.engine_core_client.get_engine_info()
        if core_args is not args:  # named as the user named them, not by snapshot directories
            info.config = named_as_given(info.config, args)
        self.core_info = info
        eos = set(info.eos_token_ids)
        tokenizer_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        if isinstance(tokenizer_eos, int):  # None: the tokenizer names no EOS token
            eos.add(tokenizer_eos)
        self.eos_token_ids = frozenset(eos)
        self.processor = Processor(self.tokenizer, info, self.eos_token_ids, args.max_n)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.parent_requests = ParentRequests(self.output_processor, args.seed,
                                              args.enable_prefix_caching)

    @property
    def engine_config(self) -> EngineConfig:
        return self.core_info.config

    def describe(self) -> dict[str, Any]:
        info, config = self.core_info, self.engine_config
        return {
            "model": config.model, "dtype": config.dtype, "quantization": config.quantization,
            "kernel_backend": config.kernel_backend, "num_kv_blocks": info.num_kv_blocks,
            "block_size": config.block_size, "max_model_len": info.max_model_len,
            "kv_cache_groups": list(info.kv_group_windows),
            "max_concurrency": round(info.max_concurrency, 2),
            "buckets": [tuple(s) for s in info.bucket_shapes],
            "compile_time_s": round(info.compile_time_s, 2),
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_prefix_caching": config.enable_prefix_caching,
            "multiprocess_mode": config.launch_config.multiprocess_mode,
            "platform": config.platform,
            "data_parallel_size": config.launch_config.parallel_config.data_parallel_size,
            "lora": {"max_loras": config.max_loras, "max_lora_rank": config.max_lora_rank,
                     "max_cpu_loras": config.max_cpu_loras} if config.enable_lora else None,
        }


def _with_seed(req: EngineCoreRequest, seed: list[int]) -> EngineCoreRequest:
    return msgspec.structs.replace(req, seed=seed)
