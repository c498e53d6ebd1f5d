"""EngineArgs: every engine setting in one validated, serialisable dataclass (vLLM's
`EngineArgs`), with its help text on the field. `create_engine_config()` resolves it into the
EngineConfig the engine runs with. The CLI's engine options and docs/engine_args.md
(`scripts/generate_engine_args_doc.py`) are generated from the fields, so the Python API,
the CLI and the docs cannot disagree. Importing this module starts no JAX backend."""

from __future__ import annotations

import argparse
import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any

from jaxllm.config import (
    DATA_PARALLEL_BACKENDS,
    DATA_PARALLEL_ROUTINGS,
    DTYPES,
    KERNEL_BACKENDS,
    MATMUL_PRECISIONS,
    QUANTIZATIONS,
    RUNNERS,
    EngineConfig,
    LaunchConfig,
    PoolerConfig,
    SpeculativeConfig,
    UsageContext,
    resolve_activation_dtype,
    resolve_async_scheduling,
    resolve_attention_impl,
    resolve_cpu_int8_activations,
    resolve_cuda_graph_triton,
    resolve_data_parallel,
    resolve_draft_model_config,
    resolve_dtype,
    resolve_gemv_max_rows,
    resolve_gguf_layout,
    resolve_kernel_backend,
    resolve_kv_cache_dtype,
    resolve_lora_skip_unused_slots,
    resolve_matmul_precision,
    resolve_model,
    resolve_multiprocess_mode,
    resolve_pallas_gemv_max_rows,
    resolve_parallel_config,
    resolve_quantization,
)
from jaxllm.reasoning import REASONING_PARSERS

GGUF_TP_REFUSAL = ("quantization='gguf' does not run with tensor_parallel_size > 1 yet; leave "
                   "quantization unset (dequantized weights) for TP")


def _arg(default: Any, help: str) -> Any:  # noqa: A002 - argparse's name
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """Engine settings; unknown names are refused by LLM(), bad values raise ValueError."""

    model: str | None = _arg(
        None, "checkpoint directory, .gguf file, Hugging Face Hub model id "
              "(`Qwen/Qwen2.5-1.5B-Instruct`; a GGUF repo's file by its quantization type: "
              "`Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M`) or `tiny-qwen2` (a random 2-layer "
              "Qwen2 with the real tokenizer); not given: the embedded "
              "Qwen2.5-Coder-0.5B-Instruct")
    revision: str | None = _arg(
        None, "the specific model version to use, for a Hub model id: a branch name, a tag "
              "name or a commit id; not given: the default version")
    download_dir: str | None = _arg(
        None, "directory to download and load the weights of a Hub model id; not given: the "
              "default cache directory of Hugging Face")
    dtype: str | None = _arg(None, "weights' dtype; not given: float32 on CPU, bfloat16 on GPU")
    kernel_backend: str | None = _arg(
        None, "attention and norm kernels; not given: pallas on GPU, reference (XLA) on CPU")
    quantization: str | None = _arg(
        None, "gguf: keep a .gguf model's block weights quantized (int8 + per-block scales, "
              "exactly its values): on CPU our fused dequant matmul kernel runs every bucket on "
              "them (packed at load in panels of up to 64 output features, no float32 copies); "
              "with a Pallas backend every matmul runs the fused dequant kernel on them. none: "
              "dequantize to dtype. Not given: gguf for a .gguf model on CPU (float32, "
              "reference backend, one device, block formats kept exactly, our CPU kernel "
              "built), else none")
    gguf_compact: bool = _arg(
        False, "with quantization gguf on CPU: pack the values of 4- and 5-bit formats (Q4_0, "
               "Q5_0, Q4_K; a GGUF draft model's too) in 5 bits instead of a byte each, for "
               "less memory and the same logits bit for bit; more work per weight: as fast for "
               "one sequence, slower for batches on a CPU with few cores "
               "(docs/perf/gguf-cpu.md)")
    cpu_int8_activations: bool = _arg(
        False, "with quantization gguf on CPU: our kernel quantizes each row of activations to "
               "int8 per block of 32 values (as llama.cpp does) and multiplies by the GGUF "
               "values in integer dot products (AVX2 maddubs, AVX-512 VNNI), for every bucket "
               "(a tied LM head, read from the embedding, stays exact), its 4- to 6-bit "
               "values read nibble-packed; faster (fewer bytes at one sequence, fewer "
               "instructions for batches), but not "
               "exact: logprobs move slightly from HF's and greedy tokens can differ "
               "(docs/perf/gguf-cpu.md). Without AVX2 (aarch64) a warning and the exact path")
    block_size: int = _arg(16, "tokens per KV block (16 or 32)")
    num_kv_blocks: int | None = _arg(
        None, "KV blocks, overriding the memory budget (with KV cache groups a block holds one "
              "group's layers); not given: from the budget")
    gpu_memory_utilization: float = _arg(
        0.9, "GPU: fraction of device memory for weights, activations and the KV array")
    kv_cache_memory_bytes: int | None = _arg(
        None, "byte budget for the KV array, per device (with tensor parallelism each device "
              "holds its KV heads' share); not given: 1 GiB on CPU (over all devices), from "
              "gpu_memory_utilization on GPU")
    max_model_len: int | None = _arg(
        None, "longest prompt + output; not given: the positions the model takes (its "
              "max_position_embeddings, times the factor of a linear or YaRN RoPE scaling)")
    max_num_seqs: int = _arg(64, "sequences per step")
    max_num_batched_tokens: int = _arg(
        512, "token budget per step (longer prompts are prefilled in chunks)")
    max_n: int = _arg(128, "most sequences one request may ask for (SamplingParams.n)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = _arg(
        False, "a model mixing full and sliding-window layers (Gemma 2/3) keeps every layer's "
               "KV of every token, as if none slid; default: its sliding layers free the "
               "blocks behind their window, and a block holds one group of layers "
               "(docs/architecture.md, KV cache groups)")
    seed: int = _arg(0, "seeds requests that bring no seed of their own")
    skip_tokenizer_init: bool = _arg(False, "no tokenizer: token-id prompts only, no text")
    show_progress: bool = _arg(True, "loading and compiling progress bars")
    async_scheduling: bool | None = _arg(
        None, "schedule and prepare step N+1 while step N runs on the device; not given: on; "
              "always off with speculative_config")
    topk_sampling: bool | None = _arg(
        None, "the device returns each sampled row's top-64 logits and log-sum-exp; the host "
              "samples from them when exact; not given: on for GPU, off on CPU, where the "
              "device top-k costs more than the host saves")
    multiprocess_mode: bool | None = _arg(
        None, "run the engine core in its own process; not given: on for GPU and for "
              "AsyncLLM / the server, off for LLM on CPU; the environment variable "
              "JAXLLM_ENABLE_V1_MULTIPROCESSING=0/1 wins")
    matmul_precision: str | None = _arg(
        None, "precision of the steps' matmuls (jax.default_matmul_precision: default, high, "
              "highest); not given: highest for float32 on GPU (XLA would use TF32), else "
              "default")
    cuda_graph_triton: bool | None = _arg(
        None, "GPU: let XLA put custom calls, the Pallas kernels' Triton calls among them, into "
              "its CUDA graphs (XLA_FLAGS --xla_gpu_enable_command_buffer=+CUSTOM_CALL, set "
              "before the core process starts JAX; in-process only if JAX has not started "
              "yet); not given: off")
    pallas_gemv_max_rows: int | None = _arg(
        None, "with a Pallas kernel backend, dense weight matmuls (the LM head's too) of at "
              "most this many rows (1-16: decode steps, small verify steps) run through the "
              "Pallas weight-streaming GEMV (pallas_kernels/skinny_matmul.py) instead of "
              "XLA's dots; bfloat16 or float32 weights; not given: 0 (XLA's)")
    tensor_parallel_size: int = _arg(
        1, "devices the model is split over (Megatron-style tensor parallelism on a JAX mesh; "
           "must divide the query heads, intermediate size and vocabulary)")
    data_parallel_size: int = _arg(
        1, "data-parallel engine cores in all (over every host), each with its own "
           "tensor_parallel_size devices, scheduler and KV cache, behind one frontend that "
           "routes each request by prompt prefix and load (vLLM's data parallelism); above 1 "
           "the cores run in their own processes")
    data_parallel_size_local: int | None = _arg(
        None, "data-parallel engine cores this host runs, ranks data_parallel_start_rank "
              "onwards; the others join the frontend from other hosts (`jaxllm serve "
              "--headless`); not given: all of them not on another host's ranks (none with "
              "data_parallel_backend 'ray')")
    data_parallel_start_rank: int = _arg(
        0, "the rank of this host's first data-parallel engine core (0 on the frontend's "
           "host; a --headless host's first rank)")
    data_parallel_address: str | None = _arg(
        None, "the frontend's host address, which engine cores on other hosts and Ray actors "
              "connect to (the frontend binds its handshake and core sockets there); not "
              "given: 127.0.0.1")
    data_parallel_rpc_port: int = _arg(
        13345, "the frontend's TCP port for the handshakes of engine cores on other hosts or "
               "in Ray actors")
    data_parallel_backend: str = _arg(
        "mp", "how data-parallel engine cores start: 'mp', processes on this host (and "
              "--headless hosts), or 'ray', one Ray actor per core placed by Ray on a node with "
              "the devices it needs (the `ray` extra; joins the running Ray cluster, else starts "
              "one on this host)")
    data_parallel_routing: str = _arg(
        "prefix", "how the frontend picks a data-parallel engine core for a request: "
                  "'prefix', the core that recently served a prompt with the same first KV "
                  "blocks unless it is much busier than the least-loaded one, else the "
                  "least-loaded; 'load', the least-loaded one alone")
    data_parallel_max_restarts: int = _arg(
        3, "how many times the frontend restarts one of its own data-parallel engine core "
           "processes that died (same engine arguments and devices; it rejoins the routing "
           "once ready); 0: a dead core stays dead. Cores on other hosts or in Ray actors are "
           "not restarted")
    coordinator_address: str | None = _arg(
        None, "several hosts: host:port of process 0's jax.distributed coordinator (or "
              "JAXLLM_COORDINATOR_ADDRESS)")
    num_processes: int | None = _arg(
        None, "several hosts: processes in the job (or JAXLLM_NUM_PROCESSES)")
    process_id: int | None = _arg(
        None, "several hosts: this process's rank, 0 runs the engine (or JAXLLM_PROCESS_ID)")
    speculative_config: dict | None = _arg(
        None, "speculative decoding, a dict or its JSON text: {\"method\": \"ngram\", "
              "\"num_speculative_tokens\": k, \"prompt_lookup_min\": 2, "
              "\"prompt_lookup_max\": 5} proposes up to k draft tokens per step by prompt "
              "lookup, {\"method\": \"draft_model\", \"model\": path or Hub id, "
              "\"num_speculative_tokens\": k} (and \"revision\") by a smaller model with the "
              "same vocabulary; "
              "the target verifies them in one step (greedy output unchanged, sampling exact by "
              "rejection sampling); steps then run without async scheduling. Not given: off")
    runner: str = _arg(
        "auto", "what requests the engine serves: generate (text; LLM.generate, "
                "/v1/completions, /v1/chat/completions) or pooling (one embedding per prompt; "
                "LLM.embed, /v1/embeddings); an engine serves one kind. auto: generate")
    reasoning_parser: str | None = _arg(
        None, "a thinking model's <think>...</think> format: qwen3 (answers that open the "
              "block) or deepseek_r1 (templates that open it in the prompt). The server "
              "returns the block as reasoning_content; a structured-output constraint covers "
              "what follows the block (when the tokenizer spells each tag as one token; "
              "docs/structured_outputs.md). Not given: answers are all content, constrained "
              "from their first token")
    pooler_config: dict | None = _arg(
        None, "the pooling runner's pooler, a dict or its JSON text: {\"pooling_type\": "
              "\"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true | false}: the last "
              "prompt token's final-normed hidden state, their mean, or the first one's, "
              "L2-normalized unless normalize is false (a request's PoolingParams.normalize "
              "wins). MEAN and CLS requests skip the prefix cache (every row is needed). Not "
              "given: LAST, normalized")

    enable_lora: bool = _arg(
        False, "LoRA adapters: requests name a PEFT adapter (LLM.generate's lora_request); "
               "dense models (every family but the mixtures of experts) on one device")
    max_loras: int = _arg(1, "with enable_lora: most distinct adapters in one step (device "
                             "slots)")
    max_lora_rank: int = _arg(16, "with enable_lora: the highest adapter rank accepted")
    max_cpu_loras: int | None = _arg(
        None, "with enable_lora: most adapters kept read on the host (an LRU cache, at least "
              "max_loras); one it dropped is read from its directory again at its next "
              "request. Adapters of unfinished requests are never dropped, so the cache "
              "exceeds this while more adapters than this have requests waiting or running. "
              "Not given: max_loras")

    def __post_init__(self) -> None:
        if self.model is not None:
            self.model = str(self.model)
        if self.download_dir is not None:
            self.download_dir = str(self.download_dir)
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
        if backend is not None and backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend {backend!r} is not one of {KERNEL_BACKENDS}")
        if self.block_size not in (16, 32):
            raise ValueError(f"block_size must be 16 or 32, got {self.block_size}")
        for name, low, optional, why in (
                ("max_num_seqs", 1, False, "a positive integer"),
                ("max_num_batched_tokens", 1, False, "a positive integer"),
                ("max_n", 1, False, "a positive integer"),
                ("tensor_parallel_size", 1, False, "a positive integer"),
                ("data_parallel_size", 1, False, "a positive integer"),
                ("data_parallel_size_local", 0, True, "a non-negative integer or None"),
                ("data_parallel_start_rank", 0, False, "a non-negative integer"),
                ("data_parallel_rpc_port", 1, False, "a TCP port (1-65535)"),
                ("data_parallel_max_restarts", 0, False, "a non-negative integer"),
                ("num_processes", 1, True, "a positive integer or None"),
                ("process_id", 0, True, "a non-negative integer or None"),
                ("seed", 0, False, "a non-negative integer"),
                ("max_loras", 1, False, "a positive integer"),
                ("max_lora_rank", 1, False, "a positive integer"),
                ("max_cpu_loras", 1, True, "a positive integer or None"),
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
        if self.data_parallel_rpc_port > 65535:
            raise ValueError(f"data_parallel_rpc_port must be a TCP port (1-65535), got "
                             f"{self.data_parallel_rpc_port}")
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision {self.matmul_precision!r} is not one of "
                             f"{MATMUL_PRECISIONS} or None (per platform)")
        for name in ("async_scheduling", "topk_sampling", "multiprocess_mode",
                     "cuda_graph_triton"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            raise ValueError(GGUF_TP_REFUSAL)
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            if spec.num_speculative_tokens >= self.max_num_batched_tokens:
                raise ValueError(f"speculative_config.num_speculative_tokens "
                                 f"({spec.num_speculative_tokens}) must be below "
                                 f"max_num_batched_tokens ({self.max_num_batched_tokens})")
            if spec.method == "draft_model" and self.tensor_parallel_size > 1:
                raise ValueError("speculative_config method 'draft_model' runs on one device: "
                                 "it does not combine with tensor_parallel_size > 1")
            self.speculative_config = spec.to_arg()
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None, got "
                             f"{self.reasoning_parser!r}")
        if self.pooler_config is not None:
            if self.runner != "pooling":
                raise ValueError(f"pooler_config is for runner='pooling'; this engine has "
                                 f"runner={self.runner!r}")
            self.pooler_config = PoolerConfig.from_dict(self.pooler_config).to_arg()
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ValueError("speculative_config drafts tokens to generate; runner='pooling' "
                             "generates none: drop one of them")
        if self.enable_lora not in (True, False):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        if self.enable_lora:
            for clash, why in ((self.tensor_parallel_size > 1, "tensor_parallel_size > 1"),
                               (self.runner == "pooling", "runner='pooling'"),
                               (self.num_processes not in (None, 1), "several hosts")):
                if clash:
                    raise ValueError(f"enable_lora runs on one device and generates: it does "
                                     f"not combine with {why}")
            if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                                 f"({self.max_loras}): the adapters one step runs are all kept "
                                 f"on the host")
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
            field_help: str = f.metadata["help"]
            help_text = overrides.get(f.name, field_help)
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
            if f.name in ("model", "revision", "download_dir", "dtype", "kernel_backend",
                          "quantization", "data_parallel_address", "data_parallel_backend",
                          "data_parallel_routing",
                          "coordinator_address", "matmul_precision", "speculative_config",
                          "runner", "pooler_config", "reasoning_parser"):
                kind = str
            choices = {"dtype": DTYPES, "kernel_backend": KERNEL_BACKENDS,
                       "quantization": QUANTIZATIONS, "matmul_precision": MATMUL_PRECISIONS,
                       "block_size": (16, 32), "data_parallel_backend": DATA_PARALLEL_BACKENDS,
                       "data_parallel_routing": DATA_PARALLEL_ROUTINGS,
                       "runner": RUNNERS, "reasoning_parser": REASONING_PARSERS}.get(f.name)
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

    def create_launch_config(self, usage_context: UsageContext = UsageContext.LLM_CLASS
                             ) -> LaunchConfig:
        """Resolve what must be known before a JAX backend starts, without starting one, for
        the frontend `usage_context` (the frontend calls it; EngineCore when built alone)."""
        parallel = resolve_data_parallel(
            resolve_parallel_config(self.tensor_parallel_size, self.coordinator_address,
                                    self.num_processes, self.process_id),
            self.data_parallel_size, self.data_parallel_size_local,
            self.data_parallel_start_rank, self.data_parallel_address,
            self.data_parallel_rpc_port, self.data_parallel_backend, self.data_parallel_routing)
        return LaunchConfig(
            usage_context=usage_context,
            # Several cores each need a process of their own (their own devices).
            multiprocess_mode=resolve_multiprocess_mode(self.multiprocess_mode, usage_context)
            or parallel.data_parallel_size > 1,
            cuda_graph_triton=resolve_cuda_graph_triton(self.cuda_graph_triton),
            parallel_config=parallel)

    def create_engine_config(self, platform: str | None = None,
                             launch_config: LaunchConfig | None = None) -> EngineConfig:
        """Resolve every "None: per platform" setting for `platform` (JAX's backend name; None:
        the one JAX starts, so call it once the process applied `platform_env` and joined
        jax.distributed, as EngineCore does). `launch_config`: the frontend's, else resolved
        here for LLM."""
        launch = launch_config or self.create_launch_config()
        if platform is None:
            import jax

            platform = jax.default_backend()
        path = resolve_model(self.model, self.revision, self.download_dir)
        spec = None if self.speculative_config is None \
            else SpeculativeConfig.from_dict(self.speculative_config)
        dtype = resolve_dtype(self.dtype, platform)
        backend = resolve_kernel_backend(self.kernel_backend, platform)
        quantization = resolve_quantization(self.quantization, path, dtype, backend,
                                            launch.parallel_config.tensor_parallel_size,
                                            platform)
        kv_cache_dtype = resolve_kv_cache_dtype(dtype, platform)
        if self.gguf_compact and self.cpu_int8_activations:
            raise ValueError("gguf_compact and cpu_int8_activations each lay out the CPU "
                             "kernel's blocks their own way: ask for one of them")
        if self.gguf_compact and (quantization != "gguf" or platform != "cpu"
                                  or backend != "reference"):
            raise ValueError(f"gguf_compact packs the GGUF blocks our CPU kernel reads: it needs "
                             f"quantization 'gguf' on CPU with the reference kernel backend, "
                             f"this engine has quantization {quantization!r} on {platform} with "
                             f"{backend!r}")
        if self.model is None:
            from jaxllm.model_executor.model_loader.default_model import DEFAULT_MODEL_NAME

            name = DEFAULT_MODEL_NAME
        else:
            name = self.model
        int8 = resolve_cpu_int8_activations(self.cpu_int8_activations, quantization, platform,
                                            backend)
        if spec is not None and spec.method == "draft_model":
            spec = dataclasses.replace(spec, draft_model_config=resolve_draft_model_config(
                spec, dtype, backend, platform, self.gguf_compact, int8, self.download_dir))
        return EngineConfig(
            model=name, model_path=str(path), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
            activation_dtype=resolve_activation_dtype(dtype, kv_cache_dtype, backend),
            kernel_backend=backend, quantization=quantization,
            gguf_layout=resolve_gguf_layout(quantization, platform, backend, self.gguf_compact,
                                            int8),
            attention_impl=resolve_attention_impl(
                backend, platform, kv_cache_dtype,
                launch.parallel_config.tensor_parallel_size),
            gguf_compact=self.gguf_compact, cpu_int8_activations=int8,
            gemv_max_rows=resolve_gemv_max_rows(quantization, dtype, backend, platform),
            topk_sampling=platform != "cpu" if self.topk_sampling is None
            else self.topk_sampling,
            async_scheduling=resolve_async_scheduling(self.async_scheduling, spec is not None),
            launch_config=launch,
            matmul_precision=resolve_matmul_precision(self.matmul_precision, dtype, platform),
            pallas_gemv_max_rows=resolve_pallas_gemv_max_rows(self.pallas_gemv_max_rows,
                                                              backend, dtype),
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_n=self.max_n,
            enable_prefix_caching=self.enable_prefix_caching, seed=self.seed,
            # A draft model reads the target's block tables with its own attention.
            hybrid_kv_cache=not self.disable_hybrid_kv_cache_manager and (
                spec is None or spec.method != "draft_model"),
            enable_lora=self.enable_lora, max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras,
            lora_skip_unused_slots=resolve_lora_skip_unused_slots(platform),
            skip_tokenizer_init=self.skip_tokenizer_init, show_progress=self.show_progress,
            platform=platform,
            speculative_config=spec,
            runner="pooling" if self.runner == "pooling" else "generate",
            reasoning_parser=self.reasoning_parser,
            pooler_config=PoolerConfig.from_dict(self.pooler_config or {})
            if self.runner == "pooling" else None)


def engine_args_markdown() -> str:
    """docs/engine_args.md (written by scripts/generate_engine_args_doc.py): one row per
    EngineArgs field with its CLI flag, type, default and help."""
    lines = ["# Engine arguments", "",
             "Generated from the `EngineArgs` fields (jaxllm/engine/arg_utils.py) by "
             "`python scripts/generate_engine_args_doc.py`; edit the field's help there, not "
             "this file.", "",
             "Every argument is a keyword of `LLM(...)` and `AsyncLLM(...)` and a field of "
             "`EngineArgs`, and its flag is an option of `jaxllm serve` and of the multi-host "
             "follower (`python -m jaxllm.entrypoints.multihost_follower`); `jaxllm generate`, "
             "`chat` and `bench throughput | latency | sweep` take every flag but "
             "`--no-show-progress` (`bench` has `--no-progress`), and `jaxllm bench serve`, a "
             "client of a running server, takes none. A boolean that is on by default is turned "
             "off with `--no-...`; one whose default is `None` (decided per platform) takes "
             "`--flag` or `--no-flag`.", "",
             "| argument | flag | type | default | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(EngineArgs):
        flag = ("--no-" if f.default is True else "--") + f.name.replace("_", "-")
        cells = [f"`{f.name}`", f"`{flag}`", f"`{f.type}`", f"`{f.default!r}`",
                 f.metadata["help"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
