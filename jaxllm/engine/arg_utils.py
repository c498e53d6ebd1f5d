"""EngineArgs: every engine setting in one validated, serialisable dataclass (vLLM's
`EngineArgs`). The engine core is built from it alone, so it can be built in another process;
the CLI derives its engine options from its fields and defaults."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import numbers
import os
from dataclasses import dataclass
from typing import Any

import pallas_kernels

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("gguf", "none")

# Help for the CLI options generated from the fields below.
_HELP = {
    "model": "checkpoint directory or .gguf file (default: the embedded "
             "Qwen2.5-Coder-0.5B-Instruct)",
    "dtype": "float32 on CPU, bfloat16 on GPU when not given",
    "kernel_backend": "pallas on GPU, reference on CPU when not given",
    "quantization": "gguf: keep a .gguf model's block weights quantized (int8 + per-block "
                    "scales, exactly its values): on CPU our fused dequant matmul kernel "
                    "runs decode buckets of up to 16 rows on them, float32 copies the rest; "
                    "with a Pallas backend every matmul runs the fused dequant kernel on "
                    "them. none: dequantize to dtype. Not given: gguf for a .gguf model on "
                    "CPU (float32, reference backend, one device, block formats kept exactly, "
                    "our CPU kernel built), else none",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "overrides the KV sizing (when not given: from the memory budget)",
    "gpu_memory_utilization": "GPU: fraction of device memory for weights, activations and KV",
    "kv_cache_memory_bytes": "byte budget for the KV array (CPU default 1 GiB)",
    "max_model_len": "longest prompt + output (when not given: the model's)",
    "max_num_seqs": "sequences per step",
    "max_num_batched_tokens": "token budget per step (longer prompts are prefilled in chunks)",
    "max_n": "most sequences one request may ask for (SamplingParams.n)",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "seed": "seeds requests that bring no seed of their own",
    "skip_tokenizer_init": "no tokenizer: token-id prompts only, no text",
    "show_progress": "loading and compiling progress bars",
    "async_scheduling": "schedule and prepare step N+1 while step N runs on the device "
                        "(when not given: on for GPU and CPU)",
    "topk_sampling": "the device returns each sampled row's top-64 logits and log-sum-exp; "
                     "the host samples from them when exact (when not given: on for GPU, "
                     "off on CPU, where the device top-k costs more than the host saves)",
    "tensor_parallel_size": "devices the model is split over (Megatron-style tensor "
                            "parallelism on a JAX mesh; must divide the query heads, "
                            "intermediate size and vocabulary)",
    "coordinator_address": "several hosts: host:port of process 0's jax.distributed "
                           "coordinator (or JAXLLM_COORDINATOR_ADDRESS)",
    "num_processes": "several hosts: processes in the job (or JAXLLM_NUM_PROCESSES)",
    "process_id": "several hosts: this process's rank, 0 runs the engine (or JAXLLM_PROCESS_ID)",
    "multiprocess_mode": "run the engine core in its own process (default: per platform, see "
                         "README; the env var JAXLLM_ENABLE_V1_MULTIPROCESSING=0/1 wins)",
}

MP_ENV_VAR = "JAXLLM_ENABLE_V1_MULTIPROCESSING"


def gpu_platform_installed() -> bool:
    """Whether JAX would pick a GPU, judged without starting a backend (that would take most of
    the GPU's memory in the frontend process): JAX_PLATFORMS if set, else an installed CUDA
    plugin."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return any(p in platforms for p in ("cuda", "gpu", "rocm"))
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"))


def resolve_multiprocess_mode(value: bool | None, default_cpu: bool | None = None) -> bool:
    """JAXLLM_ENABLE_V1_MULTIPROCESSING (0/1) when set, else `value`, else the platform's
    default: on a GPU the core's own process (the frontend's host work then overlaps the device
    step), on CPU `default_cpu` if given, else in process (docs/perf/multiprocess.md)."""
    env = os.environ.get(MP_ENV_VAR)
    if env is not None and env.strip() != "":
        if env.strip() not in ("0", "1"):
            raise ValueError(f"{MP_ENV_VAR} must be 0 or 1, got {env!r}")
        return env.strip() == "1"
    if value is not None:
        return bool(value)
    if gpu_platform_installed():
        return True
    return DEFAULT_CPU_MULTIPROCESS if default_cpu is None else default_cpu


# On CPU the frontend and the core share the same few cores, so a second process buys nothing
# there (docs/perf/multiprocess.md).
DEFAULT_CPU_MULTIPROCESS = False


GGUF_TP_REFUSAL = ("quantization='gguf' does not run with tensor_parallel_size > 1 yet; leave "
                   "quantization unset (dequantized weights) for TP")


@dataclass
class EngineArgs:
    """Engine settings; unknown names are refused by LLM(), bad values raise ValueError."""

    model: str | None = None  # None: the embedded default model
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    kernel_backend: str | None = None  # None: "pallas" on a GPU, "reference" on CPU
    # "gguf": GGUF blocks kept quantized; "none": dequantized to dtype; None: "gguf" for a .gguf
    # model on CPU where that is faster (core.resolve_quantization), else "none".
    quantization: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from the memory budget below
    gpu_memory_utilization: float = 0.9  # GPU: fraction of device memory for the engine
    kv_cache_memory_bytes: int | None = None  # CPU budget for the KV array (default 1 GiB)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_n: int = 128
    enable_prefix_caching: bool = True
    seed: int = 0
    skip_tokenizer_init: bool = False
    show_progress: bool = True
    async_scheduling: bool | None = None  # None: per platform (see _HELP)
    topk_sampling: bool | None = None  # None: per platform (see _HELP)
    multiprocess_mode: bool | None = None  # None: per platform (resolve_multiprocess_mode)
    tensor_parallel_size: int = 1
    # Several hosts (jax.distributed); None: the JAXLLM_COORDINATOR_ADDRESS /
    # JAXLLM_NUM_PROCESSES / JAXLLM_PROCESS_ID environment variables, else one process.
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self) -> None:
        if self.model is not None:
            self.model = str(self.model)
        if self.dtype is not None and not isinstance(self.dtype, str):
            # jnp.float32 and friends: keep the config plain (serialisable).
            import numpy as np

            self.dtype = np.dtype(self.dtype).name
        if self.dtype == "auto":
            self.dtype = None
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not one of {QUANTIZATIONS} "
                             f"or None (automatic)")
        backend = self.kernel_backend
        if backend is not None and backend not in pallas_kernels.BACKENDS:
            raise ValueError(f"kernel_backend {backend!r} is not one of {pallas_kernels.BACKENDS}")
        if self.block_size not in (16, 32):
            raise ValueError(f"block_size must be 16 or 32, got {self.block_size}")
        for name, low, optional, why in (
                ("max_num_seqs", 1, False, "a positive integer"),
                ("max_num_batched_tokens", 1, False, "a positive integer"),
                ("max_n", 1, False, "a positive integer"),
                ("tensor_parallel_size", 1, False, "a positive integer"),
                ("num_processes", 1, True, "a positive integer or None"),
                ("process_id", 0, True, "a non-negative integer or None"),
                ("seed", 0, False, "a non-negative integer"),
                ("max_model_len", 2, True, "an integer >= 2 (a prompt token and a new one) or "
                                           "None for the model's"),
                ("num_kv_blocks", 2, True, "an integer >= 2 (block 0 is reserved) or None"),
                ("kv_cache_memory_bytes", 1, True, "a positive integer or None")):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                    or value < low:
                raise ValueError(f"{name} must be {why}, got {value!r}")
            setattr(self, name, int(value))  # numpy integers stay out of the messages
        for name in ("async_scheduling", "topk_sampling", "multiprocess_mode"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            raise ValueError(GGUF_TP_REFUSAL)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, numbers.Real) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {util!r}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                     help_overrides: dict[str, str] | None = None) -> argparse.ArgumentParser:
        """One `--option` per field, with the field's default, so the CLI and the Python API
        cannot disagree. `help_overrides` replaces a field's help text (a caller that derives a
        field's value itself says so there and sets its parser default to None)."""
        group = parser.add_argument_group("engine")
        overrides = help_overrides or {}
        for f in dataclasses.fields(EngineArgs):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            help_text = overrides.get(f.name, _HELP.get(f.name, ""))
            if f.type == "bool | None":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
                continue
            if isinstance(default, bool):
                if default:
                    group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name,
                                       action="store_false",
                                       help=f"turn off: {help_text} (on by default)")
                else:
                    group.add_argument(flag, action="store_true", help=help_text)
                continue
            kind: Any = {"gpu_memory_utilization": float}.get(f.name, int)
            if f.name in ("model", "dtype", "kernel_backend", "quantization",
                          "coordinator_address"):
                kind = str
            choices = {"dtype": DTYPES, "kernel_backend": pallas_kernels.BACKENDS,
                       "quantization": QUANTIZATIONS,
                       "block_size": (16, 32)}.get(f.name)
            shown = "" if default is None or f.name in overrides else f" (default: {default})"
            group.add_argument(flag, type=kind, default=default, choices=choices,
                               help=help_text + shown)
        return parser

    @classmethod
    def from_user(cls, owner: str, model: Any, dtype: Any, engine_args: dict[str, Any]
                  ) -> EngineArgs:
        """`LLM(...)` / `AsyncLLM(...)` keyword arguments -> EngineArgs; an unknown name is a
        TypeError naming `owner` and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)} - {"model", "dtype"}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"{owner}() got unknown engine argument(s) {unknown}; "
                            f"known: {sorted(known)}")
        return cls(model=model, dtype=dtype, **engine_args)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)}
        values.update(overrides)
        return cls(**values)
