"""EngineConfig: every engine setting resolved, built once by `EngineArgs.create_engine_config()`.

EngineArgs holds what the user asked for, where None often means "per platform"; EngineConfig
holds what the engine runs with, so every such decision is made here, in one place: the model
path, dtypes, kernel backend, quantization and the GGUF blocks' layout, top-K sampling, async
scheduling, the rows that run on GEMV weights, the matmul precision, the draft model's settings
and the KV budget's arithmetic (`kv_budget_bytes`; the worker reads the device for it,
`num_kv_blocks_for` in worker/model_runner.py). The engine core builds it (it needs the JAX
platform); the frontend gets it back in EngineCoreInfo.

What must be known before any JAX backend starts (multiprocess mode, the XLA flags of CUDA
graphs, the devices and hosts: `LaunchConfig`) is decided by the frontend, which never starts
JAX, and handed to the core, whose EngineConfig carries it.

Importing this module starts no JAX backend, and nothing here changes the environment: the
process that starts JAX applies `platform_env` itself (EngineCore, the multiprocess client).
The resolvers that need JAX import it when called.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("gguf", "none")
# pallas_kernels.BACKENDS, named here so validating an argument imports no JAX.
KERNEL_BACKENDS = ("pallas", "interpret", "reference")
DEFAULT_CPU_KV_BYTES = 1 << 30
MP_ENV_VAR = "JAXLLM_ENABLE_V1_MULTIPROCESSING"
# Several hosts: the environment's names for the jax.distributed settings.
ENV_COORDINATOR = "JAXLLM_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXLLM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXLLM_PROCESS_ID"
# quantization="gguf" on XLA without our CPU kernel: decode buckets of at most this many rows
# run on the quantized weights through XLA's fused GEMVs (read once per row); larger buckets run
# float32 GEMMs. (Our CPU kernel runs every bucket on the quantized weights.)
GGUF_XLA_GEMV_MAX_ROWS = 8
# jax.default_matmul_precision's names: "default" lets XLA on a GPU run float32 dots in TF32.
MATMUL_PRECISIONS = ("default", "high", "highest")
# Put custom calls (the Pallas kernels' Triton calls among them) into XLA's command buffers
# (CUDA graphs), beside the fusions already there, so a decode step is not a string of launches.
# "+" adds to XLA's default command types. XLA 0.10.2 and later reject
# --legacy_command_buffer_custom_call_targets as an unknown flag (a fatal error).
CUDA_GRAPH_TRITON_XLA_FLAGS = ("--xla_gpu_enable_command_buffer=+CUSTOM_CALL",)


SPEC_DECODE_METHODS = ("ngram", "draft_model")
# What the engine runs requests for (vLLM's `runner`): "generate" samples tokens, "pooling"
# returns one vector per prompt (embeddings); "auto" is "generate" (every supported
# architecture is a causal LM).
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# How quantization="gguf" keeps a GGUF's block weights (the loader's layout, gguf_params.py):
# "panels": our CPU kernel's panels, a byte per value; "compact": those panels with 4- and
# 5-bit values in 5 bits; "int8": the panels of its integer path; "rows": int8 values and
# per-block scales as rows, read by the Pallas kernel or XLA's fused GEMVs; "none": no blocks
# kept (quantization "none").
GGUF_LAYOUTS = ("panels", "compact", "int8", "rows", "none")


class UsageContext(enum.Enum):
    """The frontend that runs the engine (as vLLM's usage context names it): the multiprocess
    default on CPU depends on it."""

    LLM_CLASS = "LLM_CLASS"  # LLM and LLMEngine: blocking calls
    ASYNC_LLM = "ASYNC_LLM"  # AsyncLLM and the OpenAI server: an asyncio event loop


# Multiprocess mode on CPU when neither the argument nor the environment decide (on a GPU: on).
# LLM: off, the frontend and the core would share the same few cores (docs/perf/multiprocess.md);
# AsyncLLM: on, in process each step would block its event loop.
DEFAULT_CPU_MULTIPROCESS = {UsageContext.LLM_CLASS: False, UsageContext.ASYNC_LLM: True}


def config_dict(value: Any, name: str, known: set[str]) -> dict[str, Any]:
    """A settings object given as a dict or as its JSON text (the command line's form), with
    only `known` keys; errors name `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (a JSON object), got {value!r}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; known: {sorted(known)}")
    return value


DATA_PARALLEL_BACKENDS = ("mp", "ray")
# "prefix": by the prompt's first KV blocks, then by load; "load": by load alone.
DATA_PARALLEL_ROUTINGS = ("prefix", "load")


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine is spread over devices and hosts (vLLM's ParallelConfig). Several hosts:
    every process joins jax.distributed at `coordinator_address` before JAX starts a backend
    (distributed/multihost.py)."""

    tensor_parallel_size: int = 1
    coordinator_address: str | None = None  # None: one process
    num_processes: int = 1
    process_id: int = 0  # 0 runs the engine, the others follow its device calls
    # Data-parallel engine cores, each on its own tensor_parallel_size devices (dp_client.py):
    # `data_parallel_size` in all, ranks [start_rank, start_rank + size_local) on this host; the
    # others join the frontend over TCP at `data_parallel_address`:`data_parallel_rpc_port`
    # (headless hosts, or Ray actors with backend "ray").
    data_parallel_size: int = 1
    data_parallel_size_local: int = 1
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 13345
    data_parallel_backend: str = "mp"
    data_parallel_routing: str = "prefix"

    @property
    def local_devices(self) -> int:
        """The devices of the model on this process's host (all of them on one host)."""
        return self.tensor_parallel_size // self.num_processes

    @property
    def multihost(self) -> bool:
        return self.coordinator_address is not None


@dataclass(frozen=True)
class LaunchConfig:
    """What is decided before any JAX backend starts, and without one: whether the engine core
    runs in its own process, the XLA flags its process starts JAX with, and the devices and
    hosts it spans. The frontend decides it (`EngineArgs.create_launch_config`) and hands it to
    the core, whose EngineConfig carries it."""

    usage_context: UsageContext
    multiprocess_mode: bool
    cuda_graph_triton: bool  # CUDA_GRAPH_TRITON_XLA_FLAGS in the core process's XLA_FLAGS
    parallel_config: ParallelConfig


@dataclass(frozen=True)
class DraftModelConfig:
    """The draft model of speculative decoding as the engine loads and runs it: its own
    checkpoint and quantization, with the target's dtype and kernel backend (vLLM's
    `SpeculativeConfig.draft_model_config`)."""

    model_path: str  # the checkpoint directory or .gguf file
    dtype: str
    kernel_backend: str
    quantization: str
    gguf_layout: str
    gemv_max_rows: int


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): up to `num_speculative_tokens`
    drafts per request and step, proposed by `ngram` (prompt lookup: the sequence's last
    `prompt_lookup_max` down to `prompt_lookup_min` tokens matched against its earlier tokens)
    or `draft_model` (`model`: a checkpoint directory, .gguf file or Hugging Face Hub id of a
    smaller model with the target's vocabulary, `revision` its Hub revision)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    revision: str | None = None
    # Resolved by EngineArgs.create_engine_config (method "draft_model"), not an argument.
    draft_model_config: DraftModelConfig | None = None

    @classmethod
    def arg_names(cls) -> tuple[str, ...]:
        """The keys of the `speculative_config` engine argument."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "draft_model_config")

    def to_arg(self) -> dict[str, Any]:
        """The engine argument this config is read from (`from_dict` of it gives it back)."""
        return {name: getattr(self, name) for name in self.arg_names()}

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """From the `speculative_config` engine argument (a dict, or its JSON text)."""
        name = "speculative_config"
        value = config_dict(value, name, set(cls.arg_names()))
        method = value.get("method")
        if method not in SPEC_DECODE_METHODS:
            raise ValueError(f"{name}.method must be one of {SPEC_DECODE_METHODS}, got {method!r}")
        for key, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1),
                         ("prompt_lookup_max", 1)):
            v = value.get(key, getattr(cls, key, None))
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}.{key} must be an integer >= {low}, got {v!r}")
        model = value.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(f"{name}: method 'draft_model' needs 'model', the draft model's "
                             f"checkpoint directory, .gguf file or Hub id, got {model!r}")
        revision = value.get("revision")
        if revision is not None and (not isinstance(revision, str) or not revision):
            raise ValueError(f"{name}.revision must be a branch, tag or commit of the draft "
                             f"model's Hub repo, got {revision!r}")
        if method == "ngram" and (model is not None or revision is not None):
            raise ValueError(f"{name}: method 'ngram' takes no 'model' or 'revision', got "
                             f"{model or revision!r}")
        config = cls(**value)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"{name}: prompt_lookup_min ({config.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling runner turns a prompt's final-normed hidden states into one vector
    (vLLM's `pooler_config`): `pooling_type` LAST (the last prompt token's row, as Qwen3-Embedding
    and gte-Qwen2 are trained), MEAN (the average of every prompt row) or CLS (the first row);
    `normalize`: L2-normalize it unless a request's PoolingParams.normalize says otherwise."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def to_arg(self) -> dict[str, Any]:
        return {"pooling_type": self.pooling_type, "normalize": self.normalize}

    @classmethod
    def from_dict(cls, value: Any) -> PoolerConfig:
        """From the `pooler_config` engine argument (a dict, or its JSON text)."""
        name = "pooler_config"
        value = config_dict(value, name, {"pooling_type", "normalize"})
        pooling_type = value.get("pooling_type", cls.pooling_type)
        if not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"{name}.pooling_type must be one of {POOLING_TYPES}, got "
                             f"{pooling_type!r}")
        normalize = value.get("normalize", cls.normalize)
        if not isinstance(normalize, bool):
            raise ValueError(f"{name}.normalize must be true or false, got {normalize!r}")
        return cls(pooling_type.upper(), normalize)


@dataclass(frozen=True)
class EngineConfig:
    """The settings an engine runs with, nothing left to the platform (see EngineArgs for what
    each one means)."""

    model: str  # as the user named it, or the embedded model's name
    model_path: str  # the checkpoint directory or .gguf file it resolved to
    dtype: str  # the weights' dtype
    kv_cache_dtype: str
    activation_dtype: str  # hidden states between the GEMMs
    kernel_backend: str
    quantization: str  # "gguf" or "none"
    gguf_layout: str  # one of GGUF_LAYOUTS: how the loader keeps the GGUF blocks
    # The model's paged attention: "cpu" (our CPU kernel, where the model's head size suits
    # it; layers/attention.py) or the kernel backend's.
    attention_impl: str
    gguf_compact: bool  # 4- and 5-bit GGUF values packed in 5 bits for our CPU kernel
    # Our CPU kernel's integer path: activations quantized to int8 (not exact; False where the
    # kernel's build has no such path)
    cpu_int8_activations: bool
    # Decode buckets up to this many rows run on the runner's GEMV weight tree (GGUF blocks kept
    # quantized, or float32 copies of bfloat16 weights on CPU); 0: one tree for every bucket.
    gemv_max_rows: int
    topk_sampling: bool
    async_scheduling: bool
    launch_config: LaunchConfig  # multiprocess mode, CUDA graphs' XLA flags, ParallelConfig
    matmul_precision: str  # jax.default_matmul_precision while the steps are lowered
    # Steps of up to this many tokens run their dense weight matmuls through the Pallas GEMV
    # kernel (a Pallas backend only); 0: XLA's dots everywhere.
    pallas_gemv_max_rows: int
    block_size: int
    # KV budget (worker/model_runner.py num_kv_blocks_for): num_kv_blocks when given, else
    # kv_cache_memory_bytes when given, else gpu_memory_utilization of the device less the
    # memory in use (weights included) and activations, else (a device that reports no memory:
    # CPU) DEFAULT_CPU_KV_BYTES over the devices.
    num_kv_blocks: int | None
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    max_model_len: int | None  # None: the positions the model takes (registry.context_len)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_n: int
    enable_prefix_caching: bool
    seed: int
    skip_tokenizer_init: bool
    show_progress: bool
    platform: str  # JAX's backend the engine core runs on ("cpu", "gpu")
    speculative_config: SpeculativeConfig | None = None
    runner: str = "generate"  # "generate" or "pooling" ("auto" resolved)
    pooler_config: PoolerConfig | None = None  # the pooling runner's; None for "generate"
    # LoRA adapters (jaxllm/lora/): max_loras device slots of rank up to max_lora_rank, and
    # at most max_cpu_loras adapters read on the host (beyond those of unfinished requests).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1  # resolved: EngineArgs' None is max_loras
    # The step computes a LoRA slot only when a token of the step uses it (a conditional per
    # slot and projection: CPU); False: every slot for every token, one graph with no
    # host-side predicate (GPU). jaxllm/lora/layers.py.
    lora_skip_unused_slots: bool = False
    reasoning_parser: str | None = None  # jaxllm/reasoning.py REASONING_PARSERS
    # A model mixing full and sliding-window layers gets a KV cache group per kind
    # (model_executor/kv_cache_groups.py); False: one group, nothing freed behind a window.
    hybrid_kv_cache: bool = True

    @property
    def parallel_config(self) -> ParallelConfig:
        return self.launch_config.parallel_config

    @property
    def tensor_parallel_size(self) -> int:
        return self.launch_config.parallel_config.tensor_parallel_size


def resolve_model(model: str | Path | None, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    """A model name -> its checkpoint: None -> the embedded default model, `tiny-qwen2` -> the
    tiny random checkpoint (written on first use), an existing or path-like name -> that path,
    anything else a Hugging Face Hub id (`owner/name`, `owner/name:QUANT` for a GGUF repo's
    file) -> its local snapshot at `revision` under `download_dir`, fetched when not cached."""
    if model is None:
        from jaxllm.model_executor.model_loader.default_model import default_model_path

        return default_model_path()
    from jaxllm.model_executor.model_loader.hub import download_model, is_hub_id
    from jaxllm.model_executor.model_loader.tiny_model import TINY_MODEL_NAME, tiny_qwen2_path

    if str(model) == TINY_MODEL_NAME:
        return tiny_qwen2_path()
    if is_hub_id(str(model)):
        return download_model(str(model), revision, download_dir)
    return Path(model).expanduser()


def gpu_platform_installed() -> bool:
    """Whether JAX would pick a GPU, judged without starting a backend (that would take most of
    the GPU's memory in the frontend process): JAX_PLATFORMS if set, else an installed CUDA
    plugin."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return any(p in platforms for p in ("cuda", "gpu", "rocm"))
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"))


def resolve_multiprocess_mode(value: bool | None, usage_context: UsageContext) -> bool:
    """JAXLLM_ENABLE_V1_MULTIPROCESSING (0/1) when set, else `value`, else the platform's
    default: on a GPU the core's own process (the frontend's host work then overlaps the device
    step), on CPU DEFAULT_CPU_MULTIPROCESS of the frontend that runs the engine. Decided in the
    frontend before any backend starts, so judged by `gpu_platform_installed`."""
    env = os.environ.get(MP_ENV_VAR)
    if env is not None and env.strip() != "":
        if env.strip() not in ("0", "1"):
            raise ValueError(f"{MP_ENV_VAR} must be 0 or 1, got {env!r}")
        return env.strip() == "1"
    if value is not None:
        return bool(value)
    if gpu_platform_installed():
        return True
    return DEFAULT_CPU_MULTIPROCESS[usage_context]


def resolve_parallel_config(tensor_parallel_size: int, coordinator_address: str | None,
                            num_processes: int | None, process_id: int | None) -> ParallelConfig:
    """The multi-host settings from the arguments, else the JAXLLM_* environment variables; no
    coordinator address: one process."""
    addr = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if not addr:
        return ParallelConfig(tensor_parallel_size)
    try:
        n = int(num_processes if num_processes is not None else os.environ[ENV_NUM_PROCESSES])
        pid = int(process_id if process_id is not None else os.environ[ENV_PROCESS_ID])
    except KeyError as e:
        raise ValueError(f"a coordinator address needs {e.args[0]} (or the engine argument) "
                         f"too") from e
    if n < 1 or not 0 <= pid < n:
        raise ValueError(f"process_id {pid} is not in [0, num_processes {n})")
    return ParallelConfig(tensor_parallel_size, addr, n, pid)


def resolve_data_parallel(parallel: ParallelConfig, size: int, size_local: int | None,
                          start_rank: int, address: str | None, rpc_port: int, backend: str,
                          routing: str) -> ParallelConfig:
    """`parallel` with the data-parallel settings: not given, this host runs every core
    (backend "mp") or none (backend "ray": every core a Ray actor); the frontend's address
    defaults to the loopback, where a core on this host or a local Ray cluster reaches it."""
    if backend not in DATA_PARALLEL_BACKENDS:
        raise ValueError(f"data_parallel_backend {backend!r} is not one of "
                         f"{DATA_PARALLEL_BACKENDS}")
    if routing not in DATA_PARALLEL_ROUTINGS:
        raise ValueError(f"data_parallel_routing {routing!r} is not one of "
                         f"{DATA_PARALLEL_ROUTINGS}")
    if address is not None and address.strip("[]") in ("0.0.0.0", "::", "*", ""):
        raise ValueError(f"data_parallel_address {address!r} is a wildcard: give the address of "
                         f"this host that the engine cores' hosts reach (the frontend binds "
                         f"it and tells the cores)")
    if backend == "ray":
        if size == 1:
            raise ValueError("data_parallel_backend 'ray' starts data-parallel engine cores: "
                             "give data_parallel_size > 1")
        if size_local not in (None, 0) or start_rank != 0:
            raise ValueError("data_parallel_backend 'ray' places every engine core itself: "
                             "leave data_parallel_size_local and data_parallel_start_rank unset")
        size_local = 0
    elif size_local is None:
        size_local = size - start_rank
    if not 0 <= start_rank < size or start_rank + size_local > size:
        raise ValueError(f"this host's engine cores, ranks [{start_rank}, "
                         f"{start_rank + size_local}) (data_parallel_start_rank, "
                         f"data_parallel_size_local), must lie in [0, {size}) "
                         f"(data_parallel_size)")
    if size > 1 and parallel.multihost and (backend == "ray" or size_local > 1):
        raise ValueError("a data-parallel engine core that spans hosts (a coordinator address: "
                         "tensor parallelism over jax.distributed) is the only core of its "
                         "host: data_parallel_size_local must be 1, and the backend 'mp'")
    return dataclasses.replace(
        parallel, data_parallel_size=size, data_parallel_size_local=size_local,
        data_parallel_start_rank=start_rank, data_parallel_address=address or "127.0.0.1",
        data_parallel_rpc_port=rpc_port, data_parallel_backend=backend,
        data_parallel_routing=routing)


def resolve_dtype(dtype: str | None, platform: str) -> str:
    """None -> bfloat16 on a GPU, float32 on CPU (where XLA's bfloat16 GEMVs are far slower)."""
    if dtype is not None:
        return dtype
    return "bfloat16" if platform == "gpu" else "float32"


def resolve_kernel_backend(kernel_backend: str | None, platform: str) -> str:
    """None -> the Pallas kernels on a GPU, XLA's reference ops elsewhere (interpret mode runs the
    kernels on CPU for tests, far slower than XLA)."""
    if kernel_backend is not None:
        return kernel_backend
    return "pallas" if platform == "gpu" else "reference"


def resolve_quantization(quantization: str | None, path: Path, dtype: str, kernel_backend: str,
                         tensor_parallel_size: int, platform: str) -> str:
    """None (automatic) -> "gguf" for a .gguf model where its quantized path is the faster one:
    on CPU with the reference backend, float32 and one device, every block format kept exactly
    and our CPU kernel built. On a GPU the fused Pallas kernel is proven but untimed, so it stays
    opt-in there. Else "none" (dequantized to dtype)."""
    if quantization is not None:
        return quantization
    if platform != "cpu" or kernel_backend != "reference" or tensor_parallel_size > 1 \
            or dtype != "float32":
        return "none"
    from jaxllm.model_executor.model_loader.loader import gguf_keeps_quantized, is_gguf_model

    # gguf_keeps_quantized: e.g. Q4_1 / IQ formats load dequantized.
    if not is_gguf_model(path) or not gguf_keeps_quantized(path):
        return "none"
    return "gguf" if cpu_kernel_available() else "none"


def cpu_kernel_available() -> bool:
    """Whether our CPU kernel (layers/quantization/cpu_dequant_matmul.py) is built here (it
    needs a C++ compiler; $JAXLLM_CPU_KERNELS=0 turns it off). Asked only for a CPU platform."""
    from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul

    return cpu_dequant_matmul.available()


def resolve_attention_impl(kernel_backend: str, platform: str, kv_cache_dtype: str,
                           tensor_parallel_size: int) -> str:
    """Our CPU attention kernel ("cpu") on XLA's CPU backend with the reference kernel backend,
    a float32 cache and one device (under tensor parallelism attention runs per shard inside
    shard_map, where the reference's plain XLA ops are the tested path), where it is built;
    else the kernel backend's paged attention."""
    if (kernel_backend == "reference" and platform == "cpu" and kv_cache_dtype == "float32"
            and tensor_parallel_size == 1):
        from jaxllm.model_executor.layers import cpu_attention

        if cpu_attention.available():
            return "cpu"
    return kernel_backend


def resolve_gguf_layout(quantization: str, platform: str, kernel_backend: str, compact: bool,
                        int8: bool) -> str:
    """How the loader keeps the GGUF blocks (GGUF_LAYOUTS): our CPU kernel's panels on CPU with
    the reference backend where the kernel is built (compact or int8 when asked for), else
    rows. `compact` and `int8` as validated and resolved for this engine."""
    if quantization != "gguf":
        return "none"
    if compact:
        return "compact"
    if int8:
        return "int8"
    if platform == "cpu" and kernel_backend == "reference" and cpu_kernel_available():
        return "panels"
    return "rows"


def resolve_gemv_max_rows(quantization: str, dtype: str, kernel_backend: str,
                          platform: str) -> int:
    """Decode buckets up to this many rows run on a second weight tree: GGUF blocks kept
    quantized for XLA's fused GEMVs (the loader's GEMV tree; with our CPU kernel or a Pallas
    backend every bucket runs a fused kernel on one tree), or float32 copies of bfloat16 weights
    on CPU, where a bfloat16 GEMV is much slower than a float32 one (docs/perf/gguf-cpu.md)."""
    if quantization == "gguf":
        if kernel_backend != "reference":
            return 0
        if platform != "cpu":
            return GGUF_XLA_GEMV_MAX_ROWS
        return 0 if cpu_kernel_available() else GGUF_XLA_GEMV_MAX_ROWS
    if dtype == "bfloat16" and platform == "cpu":
        from jaxllm.worker.buckets import MIN_TOKEN_BUCKET

        return MIN_TOKEN_BUCKET - 1
    return 0


def resolve_async_scheduling(async_scheduling: bool | None, speculative: bool) -> bool:
    """On unless speculative decoding is: a speculative step's drafts come from the tokens the
    step before it accepted, so it cannot be scheduled while that step runs (docs/spec_decode.md
    measures what that costs); asked for both, speculation wins and a warning says so."""
    if not speculative:
        return True if async_scheduling is None else async_scheduling
    if async_scheduling:
        import logging

        logging.getLogger(__name__).warning(
            "async_scheduling is off with speculative decoding: a speculative step needs the "
            "previous step's tokens to propose its drafts")
    return False


def resolve_kv_cache_dtype(dtype: str, platform: str) -> str:
    """XLA on CPU scatters into a 16-bit float KV array by converting all of it to float32 and
    back, twice per step: there the KV array stays float32."""
    return "float32" if platform == "cpu" and dtype in ("bfloat16", "float16") else dtype


def resolve_activation_dtype(dtype: str, kv_cache_dtype: str, kernel_backend: str) -> str:
    """Like the KV array on XLA (reference backend): XLA on CPU runs 16-bit elementwise ops,
    norms and attention slower than float32 ones, so only the GEMMs' operands are 16-bit there.
    Interpret-mode Pallas keeps the GPU's dtypes."""
    return kv_cache_dtype if kernel_backend == "reference" else dtype


def resolve_matmul_precision(matmul_precision: str | None, dtype: str, platform: str) -> str:
    """None -> "highest" for float32 weights on a GPU (XLA would run their dots in TF32, about
    10 mantissa bits, and drift from a float32 reference), else "default" (16-bit operands gain
    nothing from more; on CPU XLA's float32 dots are exact float32 already)."""
    if matmul_precision is not None:
        return matmul_precision
    return "highest" if platform == "gpu" and dtype == "float32" else "default"


def resolve_pallas_gemv_max_rows(rows: int | None, kernel_backend: str, dtype: str) -> int:
    """None -> 0: XLA's dots (the Pallas GEMV measured no faster on an H200: BENCHMARKS.md). A
    kernel for 1-16 rows of bfloat16 or float32, on a Pallas backend only."""
    from pallas_kernels.skinny_matmul import MAX_ROWS

    if rows is None:
        return 0
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= MAX_ROWS:
        raise ValueError(f"pallas_gemv_max_rows must be an integer from 0 to {MAX_ROWS}, got "
                         f"{rows!r}")
    if rows == 0:
        return 0
    if kernel_backend == "reference":
        raise ValueError(f"pallas_gemv_max_rows={rows} needs a Pallas kernel backend (pallas, "
                         f"or interpret on CPU); this engine's is 'reference'")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"pallas_gemv_max_rows={rows} runs bfloat16 or float32 weights; this "
                         f"engine's dtype is {dtype!r}")
    return rows


def resolve_cpu_int8_activations(requested: bool, quantization: str, platform: str,
                                  kernel_backend: str) -> bool:
    """The integer path of our CPU kernel (cpu_dequant_matmul.int8_matmul) where asked for: it
    needs the GGUF blocks kept quantized on CPU with the reference backend (ValueError
    otherwise), and a kernel build with AVX2 or AVX-512 VNNI; elsewhere (aarch64, x86 without
    AVX2, no compiler) a warning and the exact path."""
    if not requested:
        return False
    if quantization != "gguf" or platform != "cpu" or kernel_backend != "reference":
        raise ValueError(f"cpu_int8_activations runs our CPU kernel on GGUF blocks: it needs "
                         f"quantization 'gguf' on CPU with the reference kernel backend, this "
                         f"engine has quantization {quantization!r} on {platform} with "
                         f"{kernel_backend!r}")
    from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul

    if cpu_dequant_matmul.int8_supported() and cpu_dequant_matmul.available():
        return True
    logger.warning("cpu_int8_activations: our CPU kernel has no integer path here (it needs x86 "
                   "with AVX2, and a C++ compiler): the exact float32 path runs")
    return False


def resolve_lora_skip_unused_slots(platform: str) -> bool:
    """True on CPU, where XLA runs a conditional in place; on a GPU a conditional's predicate
    goes to the host before its branch launches (a copy and a sync per slot and projection),
    where computing every slot keeps the step one graph."""
    return platform == "cpu"


def resolve_cuda_graph_triton(cuda_graph_triton: bool | None) -> bool:
    """None -> off: whether XLA captures the Triton calls correctly is checked on a GPU first."""
    return bool(cuda_graph_triton)


def resolve_draft_model_config(spec: SpeculativeConfig, dtype: str, kernel_backend: str,
                               platform: str, compact: bool, int8: bool,
                               download_dir: str | None = None) -> DraftModelConfig:
    """The draft model's settings: its checkpoint (a Hub id fetched into `download_dir` like the
    target's), its quantization automatic (one device), its GGUF blocks in the target's layout
    choices (`compact`, `int8` as resolved for the target), its own GEMV rows; the target's
    dtype and kernel backend."""
    assert spec.model is not None  # checked by SpeculativeConfig.from_dict
    path = resolve_model(spec.model, spec.revision, download_dir)
    quantization = resolve_quantization(None, path, dtype, kernel_backend, 1, platform)
    gguf = quantization == "gguf"
    return DraftModelConfig(
        model_path=str(path), dtype=dtype, kernel_backend=kernel_backend,
        quantization=quantization,
        gguf_layout=resolve_gguf_layout(quantization, platform, kernel_backend,
                                        compact and gguf, int8 and gguf),
        gemv_max_rows=resolve_gemv_max_rows(quantization, dtype, kernel_backend, platform))


def xla_flags_with(flags: str, extra: tuple[str, ...]) -> str:
    """XLA_FLAGS `flags` with each of `extra` added unless a flag of that name is there (the
    user's value wins)."""
    given = {f.split("=", 1)[0] for f in flags.split()}
    added = [f for f in extra if f.split("=", 1)[0] not in given]
    return " ".join([flags.strip(), *added]).strip()


def platform_env(launch_config: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables, from `environ`, that the engine core's process must start JAX
    with (XLA reads XLA_FLAGS once, when JAX starts its backend); empty: nothing to change.
    Applied by the process that starts the core: this module changes nothing."""
    if not launch_config.cuda_graph_triton:
        return {}
    current = environ.get("XLA_FLAGS", "")
    wanted = xla_flags_with(current, CUDA_GRAPH_TRITON_XLA_FLAGS)
    return {} if wanted == current.strip() else {"XLA_FLAGS": wanted}


# The CPUs a data-parallel core on CPU keeps to ("0,1"), set before it starts JAX, whose thread
# pools size themselves to the CPUs the process may run on.
CPU_AFFINITY_ENV = "JAXLLM_CPU_AFFINITY"


def data_parallel_device_env(env: dict[str, str], local_index: int, num_local: int, tp: int
                             ) -> dict[str, str]:
    """The environment that gives this host's data-parallel core `local_index` (of
    `num_local`) its own `tp` devices (`ParallelConfig.local_devices`): on a GPU host devices
    [index * tp, (index + 1) * tp) of those this process may use (each core then sees its own
    as devices 0..tp-1); on CPU each
    core is a process with its own host platform, which needs its device count (XLA's flag, as
    for tensor parallelism) and its own share of the CPUs (cores sharing every CPU would slow
    each other's steps)."""
    if gpu_platform_installed():
        visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
        ids = visible.split(",") if visible else [str(i) for i in range((local_index + 1) * tp)]
        mine = ids[local_index * tp:(local_index + 1) * tp]
        if len(mine) < tp:
            raise ValueError(f"data-parallel engine core {local_index} of this host needs "
                             f"devices [{local_index * tp}, {(local_index + 1) * tp}) of "
                             f"CUDA_VISIBLE_DEVICES={visible!r}")
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
    out = {}
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // max(num_local, 1)
    if share >= 1 and num_local > 1:
        out[CPU_AFFINITY_ENV] = ",".join(map(str, cpus[local_index * share:
                                                        (local_index + 1) * share]))
    out["XLA_FLAGS"] = xla_flags_with(env.get("XLA_FLAGS", ""),
                                      (f"--xla_force_host_platform_device_count={tp}",))
    return out


def kv_budget_bytes(total: int, in_use: int, utilization: float, weights: int,
                    activations: int) -> tuple[int, str]:
    """Bytes of one device left for the KV array, and how they were reckoned: `utilization` of
    the device's `total` less what is in use now and the activations the steps will need.
    `in_use` counts everything this process holds on the device: this engine's weights (on the
    device already, so not subtracted twice), another engine's weights and KV, a benchmark's
    arrays; less than `weights` means the reading missed them, and the weights count instead."""
    used = max(in_use, weights)
    budget = int(total * utilization) - used - activations
    how = (f"{utilization} x {total} device bytes - {used} bytes in use ({weights} of them this "
           f"engine's weights) - {activations} of activations (largest step, measured) and kept "
           f"logits buffers")
    return budget, how
