"""LLMEngine: add_request -> step() loop over the engine core, with vLLM's names.

Loading (weights, tokenizer), KV sizing and ahead-of-time compilation happen here once; each
step() runs one EngineCore step and turns its outputs into RequestOutputs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxllm.engine.core import EngineCore, EngineCoreRequest, InprocClient
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.processor import Processor, PromptType
from jaxllm.model_executor.model_loader.default_model import (
    DEFAULT_MODEL_NAME,
    cache_dir,
    default_model_path,
)
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker.model_runner import ModelRunner, device_memory_bytes, kv_block_bytes
from scheduler import SchedulerConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class EngineArgs:
    """Engine settings beyond the model and dtype; unknown names are refused by LLM()."""

    kernel_backend: str | None = None  # None: "pallas" on a GPU, "reference" on CPU
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from the memory budget below
    gpu_memory_utilization: float = 0.9  # GPU: fraction of device memory for weights + KV
    kv_cache_memory_bytes: int | None = None  # CPU budget for the KV array (default 1 GiB)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    seed: int = 0
    skip_tokenizer_init: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        backend = self.kernel_backend
        if backend is not None and backend not in pallas_kernels.BACKENDS:
            raise ValueError(f"kernel_backend {backend!r} is not one of {pallas_kernels.BACKENDS}")
        if self.block_size not in (16, 32):
            raise ValueError(f"block_size must be 16 or 32, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), "
                             f"got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")


def enable_compilation_cache() -> None:
    """Keep compiled step buckets on disk (~/.cache/jaxllm/xla) so the next start-up skips most
    of the XLA compile time. JAXLLM_COMPILATION_CACHE=0 turns it off; a cache directory the
    user configured in JAX wins."""
    if os.environ.get("JAXLLM_COMPILATION_CACHE", "1") == "0":
        return
    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    # Only the multi-second step compiles are worth a disk entry.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def resolve_dtype(dtype: Any) -> Any:
    """None -> float32 on CPU, bfloat16 on GPU (bf16 GEMV is ~18x slower than f32 on this CPU)."""
    if dtype is None or dtype == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


class LLMEngine:
    def __init__(self, model: str | Path | None = None, dtype: Any = None,
                 engine_args: EngineArgs | None = None) -> None:
        args = engine_args or EngineArgs()
        self.engine_args = args
        enable_compilation_cache()
        self.dtype = resolve_dtype(dtype)
        path = default_model_path() if model is None else Path(model)
        self.model_name = DEFAULT_MODEL_NAME if model is None else str(model)
        loaded = load_model(path, dtype=self.dtype, progress=args.show_progress)
        self.model_config = config = loaded.config
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(path)
        self.kernel_backend = args.kernel_backend or pallas_kernels.default_backend()
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {config.max_position_embeddings}")
        self.num_kv_blocks = self._num_kv_blocks(loaded.params)
        eos = {t for t in (config.eos_token_id, getattr(self.tokenizer, "eos_token_id", None))
               if t is not None}
        self.eos_token_ids = frozenset(eos)
        runner = ModelRunner(
            config, loaded.params, dtype=self.dtype, kernel_backend=self.kernel_backend,
            block_size=args.block_size, num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens)
        self.compile_time_s = runner.compile(progress=args.show_progress)
        self.engine_core = EngineCore(runner, SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=args.block_size,
            num_blocks=self.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching))
        self.engine_core_client = InprocClient(self.engine_core)
        self.processor = Processor(self.tokenizer, config.vocab_size, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_index = 0
        self.last_output_processing_s = 0.0
        # Children of an n > 1 request wait until the first child has computed the prompt, so
        # they find its blocks in the prefix cache instead of recomputing them.
        self._pending_children: dict[str, list[EngineCoreRequest]] = {}

    def _num_kv_blocks(self, params: dict) -> int:
        args = self.engine_args
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        per_block = kv_block_bytes(self.model_config, args.block_size, self.dtype)
        total = device_memory_bytes()
        if total is None:
            budget = args.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        else:
            weights = sum(x.nbytes for x in jax.tree.leaves(params))
            # Headroom for activations and logits of the largest bucket.
            budget = args.kv_cache_memory_bytes or int(
                total * args.gpu_memory_utilization - weights - (1 << 30))
        blocks = budget // per_block
        if blocks < 2:
            raise ValueError(f"the KV budget of {budget} bytes holds {blocks} blocks of "
                             f"{per_block} bytes; raise kv_cache_memory_bytes or "
                             f"gpu_memory_utilization")
        return int(blocks)

    # --- vLLM's LLMEngine API -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue one request; a bad one raises ValueError and changes nothing."""
        params = params or SamplingParams()
        self.processor.check_params(params)
        processed = self.processor.process_prompt(prompt)
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival_time = arrival_time or time.time()
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        child_params = []
        core_requests = []
        index = self._request_index
        self._request_index += 1
        for i, cid in enumerate(child_ids):
            sp = params if n == 1 else params.clone()
            if n > 1:
                sp.n = 1
                sp.seed = None if params.seed is None else params.seed + i
            child_params.append(sp)
            core_requests.append(EngineCoreRequest(
                request_id=cid, prompt_token_ids=processed.prompt_token_ids,
                sampling_params=sp, eos_token_ids=self.eos_token_ids,
                seed=sp.seed if sp.seed is not None else [self.engine_args.seed, index, i],
                max_tokens=self.processor.max_tokens_for(sp, len(processed.prompt_token_ids)),
                arrival_time=arrival_time))
        self.engine_core_client.add_request(core_requests[0])
        self.output_processor.add_request(request_id, processed.prompt,
                                          processed.prompt_token_ids, child_ids, child_params,
                                          arrival_time)
        if len(core_requests) > 1:
            if self.engine_args.enable_prefix_caching:
                self._pending_children[child_ids[0]] = core_requests[1:]
            else:
                for req in core_requests[1:]:
                    self.engine_core_client.add_request(req)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (by the id given to add_request); returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outs = []
        for rid in request_ids:
            parent = self.output_processor.parents.get(rid)
            if parent is None:
                continue
            child_ids = [c.request_id for c in parent.children]
            for cid in child_ids:
                self._pending_children.pop(cid, None)
            self.engine_core_client.abort_requests(child_ids)
            out = self.output_processor.abort_parent(rid)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        outputs = self.engine_core_client.get_output()
        for out in outputs:
            pending = self._pending_children.pop(out.request_id, None)
            if pending is not None:
                for req in pending:
                    self.engine_core_client.add_request(req)
        t = time.perf_counter()
        finished, to_abort = self.output_processor.process_outputs(outputs)
        self.last_output_processing_s = time.perf_counter() - t
        if to_abort:
            self.engine_core_client.abort_requests(to_abort)
            for cid in to_abort:
                for req in self._pending_children.pop(cid, []):
                    self.engine_core_client.add_request(req)
        return finished

    @property
    def last_step_stats(self):
        return self.engine_core.last_stats

    def describe(self) -> dict[str, Any]:
        runner = self.engine_core.runner
        return {
            "model": self.model_name, "dtype": jnp.dtype(self.dtype).name,
            "kernel_backend": self.kernel_backend, "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.engine_args.block_size, "max_model_len": self.max_model_len,
            "buckets": runner.bucket_shapes(), "compile_time_s": round(self.compile_time_s, 2),
            **{f.name: getattr(self.engine_args, f.name)
               for f in dataclasses.fields(EngineArgs)
               if f.name in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")},
        }

    # --- what benchmarks and profilers read (utility calls on the core) ------------------------

    @property
    def last_scheduler_stats(self):
        """The last step's stats: num_running_reqs, num_waiting_reqs, kv_cache_usage,
        num_prefill_tokens, num_decode_tokens, step_shape, and phase seconds schedule_s,
        prepare_s, device_s, transfer_s, sample_s, update_s."""
        from types import SimpleNamespace

        st = self.engine_core.last_stats
        return SimpleNamespace(
            num_prefill_tokens=st.num_prefill_tokens, num_decode_tokens=st.num_decode_tokens,
            schedule_s=st.schedule_s, prepare_s=st.runner.prepare_s, device_s=st.runner.device_s,
            transfer_s=st.runner.transfer_s, sample_s=st.sample_s, update_s=st.update_s)

    def get_step_shape_counts(self) -> dict[tuple[int, int], int]:
        return dict(self.engine_core.runner.step_shape_counts)

    def reset_step_shape_counts(self) -> None:
        self.engine_core.runner.step_shape_counts.clear()

    def get_weight_stats(self) -> dict[str, int]:
        """body_params (decoder layers + final norm), head_params (LM head), itemsize."""
        import numpy as np

        params, cfg = self.engine_core.runner.params, self.model_config
        body = sum(int(x.size) for k, v in params.items()
                   if k not in ("embed_tokens", "lm_head") for x in jax.tree.leaves(v))
        return {"body_params": body, "head_params": cfg.vocab_size * cfg.hidden_size,
                "itemsize": int(np.dtype(params["norm"]["weight"].dtype).itemsize)}

    def time_weight_matmuls(self, num_tokens: list[int], reps: int = 3) -> dict[int, float]:
        """Best-of-`reps` seconds of one step's weight matmuls at each token count."""
        from jaxllm.benchmarks.matmul_floor import time_weight_matmuls

        runner = self.engine_core.runner
        return time_weight_matmuls(runner.params, runner.config, runner.dtype,
                                   runner.max_num_seqs, num_tokens, reps)
