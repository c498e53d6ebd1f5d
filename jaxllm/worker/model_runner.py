"""ModelRunner: SchedulerOutput -> padded device inputs -> one jitted step -> the sampled rows'
top-K candidates and log-sum-exp (full logits rows on request).

A step runs in three calls, so the engine core can overlap them with the device (async
scheduling): `prepare` (host inputs, while the previous step may still run; tokens that step
has yet to sample are placeholders), `dispatch` (fill them, launch) and `wait` (the small
outputs on the host). `execute_model` chains the three.

Every step's shapes come from a small fixed set of buckets, all compiled ahead of time at
start-up, so serving never compiles:
  - a step whose every sequence computes one token (pure decode) pads T to a decode bucket
    (powers of two from 1 up to the first one >= max_num_seqs) and uses max_query_len = 1 (the
    Pallas kernel picks decode tiles); small decode buckets matter on CPU, where a GEMM's time
    grows with its rows even when it is bound by the weights (docs/perf/cpu-step.md);
  - any other step pads T to a token bucket (powers of two from 16 up to
    max_num_batched_tokens) with max_query_len = T;
  - the sequence count S and the number of logits rows are min(T, max_num_seqs), so they follow
    T and add no bucket dimension;
  - with speculative decoding, a step where every request computes its next token and its draft
    tokens pads to a spec-decode bucket: s sequences (s a decode bucket) of 1 + k tokens, T =
    s * (1 + k), max_query_len = 1 + k, a logits row at every token (`step_sizes`); such
    buckets pick their weights like decode buckets of T rows.
Weights are picked per bucket when it is compiled (`params_for`), between two trees of the same
values: with quantization="gguf" where our CPU kernel cannot be built, the decode (and
spec-decode) buckets up to `gemv_max_rows` rows run on `gemv_params` (GGUF blocks kept
quantized, XLA's fused dequant GEMVs: fewer bytes per step), every other bucket on `params`
(float32 copies, fastest for multi-row dots there); with our CPU kernel or a Pallas kernel
backend the loader gives one tree, all quantized, and every bucket runs the fused dequant
matmul kernel (layers/quantization/cpu_dequant_matmul.cc, pallas_kernels/dequant_matmul.py).
With dtype bfloat16 on CPU, buckets under MIN_TOKEN_BUCKET rows run on float32 copies of the
bfloat16 weights (a bf16 GEMV is many times slower than a float32 one there), the others on the
bfloat16 weights (bf16 GEMMs outrun float32 ones on AVX512-BF16 cores; docs/perf/gguf-cpu.md).
Block tables are always max_model_len wide, one per KV cache group
(model_executor/kv_cache_groups.py); each running request keeps its row in the
persistent InputBatch, updated from each SchedulerOutput's new block ids. The KV array is one
preallocated buffer, sized from a memory budget (`initialize_kv_cache`, after
`measure_activation_bytes` on a GPU), donated to every step so XLA updates it in place; so is
each shape's logits buffer (`release` hands it back once a step's rows are sampled). Decode
buckets carry a static split-K partition count for paged attention (`bucket_table`).
With tensor_parallel_size N > 1 the weights, the KV array (its kv-head axis) and the logits
(vocabulary) are sharded over an N-device mesh and each step is one SPMD program
(jaxllm/distributed/tensor_parallel.py); sizes per device come from `local_config`.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxllm.config import (
    DEFAULT_CPU_KV_BYTES,
    kv_budget_bytes,
    resolve_attention_impl,
    resolve_lora_skip_unused_slots,
)
from jaxllm.distributed.tensor_parallel import (
    KV_SPEC,
    LOGITS_SPEC,
    TP_AXIS,
    make_mesh,
    per_device_bytes,
    shard_params,
    tp_layout,
)
from jaxllm.lora.layers import apply_lora
from jaxllm.lora.request import LoRARequest
from jaxllm.lora.slots import LoRASlots
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.kv_cache_groups import KVCacheGroups, kv_cache_groups
from jaxllm.model_executor.layers.attention import AttentionMetadata, kv_cache_shape
from jaxllm.model_executor.layers.attention import attention_impl as fit_attention_impl
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight
from jaxllm.model_executor.layers.rotary_embedding import rope_variables
from jaxllm.model_executor.models.registry import get_model_class
from jaxllm.sample.candidates import TopKLogits
from jaxllm.sample.topk import TOPK
from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.worker import machine_rates
from jaxllm.worker.buckets import decode_buckets, token_buckets
from jaxllm.worker.compile_counter import compile_count
from jaxllm.worker.input_batch import DeviceInputs, InputBatch
from jaxllm.worker.matmul_timing import time_runner_matmuls, weight_stats
from jaxllm.worker.outputs import (  # re-exported: the engine core imports them from here
    ModelRunnerOutput,
    PreparedStep,
    PromptLogprobRows,
    StepHandle,
    StepTimings,
    row_slice,
    take_rows,
    to_host,
)
from jaxllm.worker.step import StepOutputs, forward_step, prompt_stats
from jaxllm.worker.step_call import StepCall
from pallas_kernels.attention_common import decode_num_splits
from scheduler import SchedulerOutput

if TYPE_CHECKING:
    from jaxllm.config import EngineConfig
    from jaxllm.distributed.leader import Leader
    from jaxllm.model_executor.model_loader.loader import LoadedModel

# Prompt-logprob rows go through the LM head in chunks of this many rows, top-N up to the
# logprobs limit.
PROMPT_LOGPROB_ROWS = 32
MAX_COMPILE_THREADS = 8


def float32_weights(params: dict) -> dict:
    """The tree with float32 copies of its matrices (exactly the same values); vectors (norms,
    biases) and GGUF weights kept quantized stay shared. For GEMVs of a bfloat16 model on CPU."""
    return jax.tree.map(lambda x: x if isinstance(x, GGUFWeight) or x.ndim != 2
                        else x.astype(jnp.float32), params,
                        is_leaf=lambda x: isinstance(x, GGUFWeight))


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: Any,
                   num_slots: int | None = None) -> int:
    """Bytes of one block id's KV: `num_slots` layers' (KVCacheGroups.num_slots; None: all)."""
    return (math.prod(kv_cache_shape(config, 1, block_size, num_slots))
            * jnp.dtype(dtype).itemsize)


def gpu_sm_count(default: int = 132) -> int:
    """Streaming multiprocessors of the first GPU (what split-K decode fills); `default` (an
    H100 SXM's 132) where the platform does not say, e.g. when lowering on a CPU."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or default) if dev.platform == "gpu" else default


def device_memory_stats() -> dict[str, int] | None:
    """The first accelerator's allocator statistics (`bytes_limit`: what this process may
    allocate on it, `bytes_in_use`: what it holds now), or None on CPU / when unknown."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    return dev.memory_stats() or None


def device_memory_bytes() -> int | None:
    """Total memory of the first accelerator, or None on CPU / when unknown."""
    return (device_memory_stats() or {}).get("bytes_limit")


def num_kv_blocks_for(config: EngineConfig, runner: ModelRunner) -> int:
    """KV blocks from the budget: num_kv_blocks when given; else kv_cache_memory_bytes; else (a
    GPU) `kv_budget_bytes` of the device's memory stats; else (CPU) DEFAULT_CPU_KV_BYTES."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    # Per device: with tensor parallelism each holds its kv heads' slice of every block.
    per_block = kv_block_bytes(runner.local_config, config.block_size, runner.kv_cache_dtype,
                               runner.kv_groups.num_slots)
    total = device_memory_bytes()
    if config.kv_cache_memory_bytes is not None:
        budget, how = config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif total is None:
        # Virtual CPU devices share the host's memory: the default is for all of them.
        budget = DEFAULT_CPU_KV_BYTES // config.tensor_parallel_size
        how = "the CPU default of 1 GiB (over all devices)"
    else:
        # Compiling the probe step allocates nothing on the device: read the stats after it.
        activations = runner.measure_activation_bytes() + runner.logits_buffer_bytes()
        in_use = (device_memory_stats() or {}).get("bytes_in_use", 0)
        budget, how = kv_budget_bytes(total, in_use, config.gpu_memory_utilization,
                                      runner.weight_bytes(), activations)
    blocks = max(budget, 0) // per_block
    if blocks < 2:
        raise ValueError(f"the KV budget ({how}) holds {blocks} blocks of {per_block} bytes; "
                         f"raise kv_cache_memory_bytes or gpu_memory_utilization, free the "
                         f"device memory in use, or lower max_num_batched_tokens")
    return int(blocks)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def compile_threads(num_jobs: int) -> int:
    """Threads that compile the step buckets (XLA's compile releases the GIL): half the usable
    CPUs, since the lowering thread, XLA's own helper threads and the frontend want the rest (on
    2 CPUs a second compile thread made start-up slower: docs/perf/startup.md), capped because
    each compile holds its own copy of the program in memory."""
    return max(1, min(num_jobs, usable_cpus() // 2, MAX_COMPILE_THREADS))


class ModelRunner:
    def __init__(self, config: ModelConfig, params: dict, *, dtype: Any, kernel_backend: str,
                 block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, topk_sampling: bool = False,
                 gemv_params: dict | None = None, gemv_max_rows: int = 0,
                 kv_cache_dtype: Any = None, activation_dtype: Any = None,
                 tensor_parallel_size: int = 1, matmul_precision: str = "default",
                 num_speculative_tokens: int = 0, pallas_gemv_max_rows: int = 0,
                 attention_impl: str | None = None, max_loras: int = 0,
                 max_lora_rank: int = 0, max_cpu_loras: int | None = None,
                 lora_skip_unused_slots: bool | None = None,
                 kv_groups: KVCacheGroups | None = None) -> None:
        """`max_loras` > 0: LoRA adapters, in that many device slots of rank up to
        `max_lora_rank`, at most `max_cpu_loras` kept read on the host besides those of
        unfinished requests (None: max_loras; jaxllm/lora/). `kv_groups`: how the layers
        share the KV array and its block tables (None: one group). `gemv_max_rows`,
        `kv_cache_dtype`, `activation_dtype`, `matmul_precision`, `attention_impl` and
        `lora_skip_unused_slots` as EngineConfig resolved them (None: `dtype`; as the config
        would resolve it); with `gemv_max_rows` and no `gemv_params`, the GEMV buckets run on
        float32 copies of `params`."""
        self.config = config
        self.local_config = config  # one device's slice of the model
        self.mesh = None
        if tensor_parallel_size != 1:
            layout = tp_layout(config, tensor_parallel_size)
            # Kept quantized: a GEMV tree beside float32 copies (XLA), or one tree (Pallas).
            if gemv_params is not None or any(isinstance(x, GGUFWeight) for x in jax.tree.leaves(
                    params, is_leaf=lambda x: isinstance(x, GGUFWeight))):
                raise ValueError("quantization='gguf' does not run with tensor_parallel_size > 1 "
                                 "yet; leave quantization unset (dequantized weights) for TP")
            self.mesh = make_mesh(tensor_parallel_size)
            self.local_config = layout.local
            params = shard_params(params, layout, self.mesh)
        self.params = params
        self.gemv_params = gemv_params
        self.gemv_max_rows = gemv_max_rows
        if gemv_max_rows and gemv_params is None:  # bfloat16 weights on CPU
            self.gemv_params = float32_weights(params)
        self.dtype = dtype
        # Traced into every executable at lowering (the dots' precision attribute): only this
        # runner's steps, not the rest of the process, run at it.
        self.matmul_precision = matmul_precision
        self.kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        self.activation_dtype = dtype if activation_dtype is None else activation_dtype
        self.block_size = block_size
        self.num_kv_blocks = 0
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = token_buckets(max_num_batched_tokens)
        self.decode_buckets = decode_buckets(max_num_seqs, max_num_batched_tokens)
        # Speculative decoding: a step where every request verifies up to k drafts pads to a
        # spec-decode bucket, s sequences of 1 + k tokens each (s a decode bucket), logits at
        # every token (docs/spec_decode.md).
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_query_len = 1 + num_speculative_tokens
        # A one-sequence spec bucket the shape of a token bucket (1 + k a power of two) is
        # left to that token bucket, which holds as many logits rows.
        self.spec_buckets = ([t for s in self.decode_buckets
                              if (t := s * self.spec_query_len) <= max_num_batched_tokens
                              and not (t == self.spec_query_len and t in self.buckets)]
                             if num_speculative_tokens else [])
        if attention_impl is None:  # built without an engine config: as it would resolve
            attention_impl = resolve_attention_impl(
                kernel_backend, jax.default_backend(), jnp.dtype(self.kv_cache_dtype).name,
                tensor_parallel_size)
        self.attention_impl = fit_attention_impl(attention_impl, kernel_backend,
                                                 config.head_dim)
        self.kv_groups = kv_groups or KVCacheGroups.single(config.num_hidden_layers)
        self.model = get_model_class(config.architecture)(
            self.local_config, dtype=dtype, kernel_backend=kernel_backend,
            activation_dtype=self.activation_dtype,
            tp_axis=None if self.mesh is None else TP_AXIS,
            gemv_kernel_rows=pallas_gemv_max_rows, attention_impl=self.attention_impl,
            kv_groups=self.kv_groups)
        # Split-K decode (flash-decoding) per decode bucket: static, sized from the keys a
        # query sees at most (max_model_len, or the window when every layer slides) and the
        # bucket's sequences against the GPU's SM count. The reference backend (CPU) has one
        # XLA attention for every split count: 1 keeps its executables as they were.
        self.decode_splits = {
            t: 1 if kernel_backend == "reference" else decode_num_splits(
                config.max_attended_keys(max_model_len), min(t, max_num_seqs),
                self.local_config.num_key_value_heads, num_sms=gpu_sm_count())
            for t in self.decode_buckets}
        self.rope = rope_variables(config)
        if self.mesh is not None:
            self.rope = jax.device_put(self.rope, self._replicated())
        self.kv_cache: jax.Array | None = None
        self.lora_slots = None if not max_loras else LoRASlots(
            config, max_loras, max_lora_rank, self.activation_dtype, max_cpu_loras)
        self.lora_skip_unused_slots = (resolve_lora_skip_unused_slots(jax.default_backend())
                                       if lora_skip_unused_slots is None
                                       else lora_skip_unused_slots)
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, block_size,
                                      lora=self.lora_slots is not None,
                                      num_groups=self.kv_groups.num_groups)
        # 0: the step returns full logits only (the host finds candidates and normalisers).
        self.top_k = min(TOPK, config.vocab_size) if topk_sampling else 0
        # The logits output reuses the previous step's buffer of its shape (donated): no
        # vocabulary-sized allocation and release per step (docs/perf/host-path.md).
        self._step = jax.jit(self._forward,
                             static_argnames=("num_tokens", "max_query_len", "num_splits"),
                             donate_argnames=("kv_cache", "logits_buf"), keep_unused=True)
        self._compiled: dict[tuple[int, int], Any] = {}
        # Each compiled step with its weights bound, called through its executable
        # (jaxllm/worker/step_call.py); False: through `Compiled.__call__` (also with a mesh).
        self.fast_dispatch = True
        self._calls: dict[tuple[int, int], StepCall] = {}
        # Prompt logprobs: one small executable per hidden-state row count, reading the step's
        # hidden states where they are (see `add_prompt_logprobs`).
        self._prompt_fn = jax.jit(self._prompt_stats)
        self._compiled_prompt: dict[int, Any] = {}
        self._row_slices: dict[int, Any] = {}
        self._gathers: dict[int, Any] = {}  # several hosts: logits rows, replicated
        self.launches = 0
        self._logits_bufs: dict[int, jax.Array] = {}
        # Steps run per (num_tokens, max_query_len) shape: benchmarks price a run's shapes.
        self.step_shape_counts: Counter[tuple[int, int]] = Counter()
        # Several hosts, process 0: broadcasts each launch to the followers (multihost.py).
        self.leader: Leader | None = None

    @classmethod
    def from_engine_config(cls, config: EngineConfig, loaded: LoadedModel, max_model_len: int,
                           *, gemv_max_rows: int, tensor_parallel_size: int = 1,
                           num_speculative_tokens: int = 0) -> ModelRunner:
        """A runner for `loaded` (the target, or a draft model) with the engine's settings."""
        return cls(
            loaded.config, loaded.params, dtype=jnp.dtype(config.dtype),
            kernel_backend=config.kernel_backend, block_size=config.block_size,
            max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            topk_sampling=config.topk_sampling, gemv_params=loaded.gemv_params,
            gemv_max_rows=gemv_max_rows, kv_cache_dtype=jnp.dtype(config.kv_cache_dtype),
            activation_dtype=jnp.dtype(config.activation_dtype),
            tensor_parallel_size=tensor_parallel_size,
            matmul_precision=config.matmul_precision,
            num_speculative_tokens=num_speculative_tokens,
            pallas_gemv_max_rows=config.pallas_gemv_max_rows,
            attention_impl=config.attention_impl,
            max_loras=config.max_loras if config.enable_lora else 0,
            max_lora_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras,
            lora_skip_unused_slots=config.lora_skip_unused_slots,
            kv_groups=kv_cache_groups(loaded.config, max_model_len, config.hybrid_kv_cache))

    def _forward(self, params: dict, rope: dict, kv_cache: jax.Array, logits_buf: jax.Array,
                 packed: jax.Array, num_tokens: int, max_query_len: int,
                 num_splits: int) -> StepOutputs:
        del logits_buf  # only its buffer is wanted, for the logits output
        fields = DeviceInputs.unpack(packed, self.input_shapes((num_tokens, max_query_len)))
        attn_metadata = AttentionMetadata(**{name: fields[name]
                                             for name in AttentionMetadata._fields})

        def run(rope: dict) -> StepOutputs:
            return forward_step(self.model, self.top_k, self.mesh, params, rope, kv_cache,
                                fields["input_ids"], fields["positions"], attn_metadata,
                                max_query_len, num_splits)

        if self.lora_slots is None:
            return run(rope)
        with apply_lora(rope["lora"], fields["lora_slots"], self.lora_slots.num_slots,
                        skip_unused_slots=self.lora_skip_unused_slots):
            return run(rope["rope"])

    def _prompt_stats(self, params: dict, hidden: jax.Array, rows: jax.Array, targets: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        return prompt_stats(self.model, min(MAX_LOGPROBS, self.config.vocab_size), self.mesh,
                            params, hidden, rows, targets)

    def _replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The KV array's global shape: kv heads times the TP size (with replicas)."""
        shape = list(kv_cache_shape(self.local_config, num_blocks, self.block_size,
                                    self.kv_groups.num_slots))
        shape[2] *= 1 if self.mesh is None else self.mesh.size
        return tuple(shape)

    def _sharding(self, spec: P) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, spec)

    # --- compilation --------------------------------------------------------------------------

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """(num_tokens, max_query_len) of every step shape the runner can produce."""
        shapes = [(t, 1) for t in self.decode_buckets] + [(t, t) for t in self.buckets]
        return shapes + [shape for t in self.spec_buckets
                         if (shape := (t, self.spec_query_len)) not in shapes]

    def is_spec_shape(self, shape: tuple[int, int]) -> bool:
        return (bool(self.spec_buckets) and shape[1] == self.spec_query_len
                and shape[0] in self.spec_buckets)

    def step_sizes(self, shape: tuple[int, int]) -> tuple[int, int]:
        """(sequences, logits rows) of a step shape: min(T, max_num_seqs) of each, or for a
        spec-decode bucket its sequences and 1 + k rows per sequence."""
        if self.is_spec_shape(shape):
            seqs = min(shape[0] // self.spec_query_len, self.max_num_seqs)
            return seqs, seqs * self.spec_query_len
        seqs = min(shape[0], self.max_num_seqs)
        return seqs, seqs

    def input_shapes(self, shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """Each step input's shape in a bucket (`DeviceInputs.shapes`)."""
        return DeviceInputs.shapes(shape[0], *self.step_sizes(shape), self.max_blocks_per_seq,
                                   lora=self.lora_slots is not None,
                                   num_groups=self.kv_groups.num_groups)

    def step_consts(self) -> dict:
        """What a step reads besides the params that never changes per step: the RoPE
        tables, and with LoRA the adapter slots beside them (changed when a slot loads)."""
        if self.lora_slots is None:
            return self.rope
        return {"rope": self.rope, "lora": self.lora_slots.device_weights()}

    def bucket_table(self) -> list[tuple[int, int, int]]:
        """(num_tokens, max_query_len, attention split count) of every compiled step."""
        return [(num_tokens, max_query_len, self.decode_splits[num_tokens] if max_query_len == 1
                 else 1) for num_tokens, max_query_len in self.bucket_shapes()]

    def params_for(self, num_tokens: int, max_query_len: int) -> dict:
        """The param tree a bucket's executable is compiled for and runs with."""
        if self.gemv_params is not None and num_tokens <= self.gemv_max_rows \
                and (max_query_len == 1 or self.is_spec_shape((num_tokens, max_query_len))):
            return self.gemv_params
        return self.params

    def _packed_spec(self, shape: tuple[int, int]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((DeviceInputs.packed_size(self.input_shapes(shape)),),
                                    jnp.int32, sharding=self._replicated())

    def lower_step(self, num_tokens: int, max_query_len: int, num_kv_blocks: int) -> Any:
        """The step of one bucket lowered (at the runner's matmul precision), not compiled."""
        kv_spec = jax.ShapeDtypeStruct(self.kv_shape(num_kv_blocks), self.kv_cache_dtype,
                                       sharding=self._sharding(KV_SPEC))
        splits = self.decode_splits[num_tokens] if max_query_len == 1 else 1
        with jax.default_matmul_precision(self.matmul_precision):
            return self._step.lower(self.params_for(num_tokens, max_query_len),
                                    self.step_consts(),
                                    kv_spec, self._logits_spec(
                                        self.step_sizes((num_tokens, max_query_len))[1]),
                                    self._packed_spec((num_tokens, max_query_len)),
                                    num_tokens=num_tokens, max_query_len=max_query_len,
                                    num_splits=splits)

    def _compile_step(self, num_tokens: int, max_query_len: int, num_kv_blocks: int):
        return self.lower_step(num_tokens, max_query_len, num_kv_blocks).compile()

    def _logits_spec(self, rows: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, self.config.vocab_size),
                                    jnp.float32, sharding=self._sharding(LOGITS_SPEC))

    def weight_bytes(self) -> int:
        """Bytes of the weights and RoPE tables on one device (arrays both trees share once)."""
        return per_device_bytes((self.params, self.gemv_params, self.rope))

    def logits_buffer_bytes(self) -> int:
        """Device bytes of the kept logits buffers once every step shape has run."""
        rows = {self.step_sizes(shape)[1] for shape in self.bucket_shapes()}
        return sum(rows) * self.local_config.vocab_size * 4

    def measure_activation_bytes(self, probe_blocks: int = 16) -> int:
        """Device bytes the largest step needs besides weights and KV: its temporaries plus the
        outputs that do not alias the donated KV array, read from XLA's memory analysis of that
        step compiled against a small probe KV array (one extra compile)."""
        # The largest token bucket; the largest spec-decode bucket too, whose logits rows (one
        # per token) may make it the larger one.
        shapes = [(self.buckets[-1], self.buckets[-1])]
        if self.spec_buckets:
            shapes.append((self.spec_buckets[-1], self.spec_query_len))
        need = 0
        for num_tokens, max_query_len in shapes:
            ma = self._compile_step(num_tokens, max_query_len, probe_blocks).memory_analysis()
            if ma is None:
                raise RuntimeError(f"XLA gives no memory analysis on {jax.default_backend()} "
                                   "to size the KV cache from; give num_kv_blocks or "
                                   "kv_cache_memory_bytes")
            need = max(need, int(ma.temp_size_in_bytes + ma.output_size_in_bytes
                                 - ma.alias_size_in_bytes))
        return need

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the one paged KV array (every group's layers); compile() comes after."""
        self.num_kv_blocks = num_blocks
        self.kv_cache = jnp.zeros(self.kv_shape(num_blocks), self.kv_cache_dtype,
                                  device=self._sharding(KV_SPEC))
        self._compiled.clear()
        self._calls.clear()

    def compile(self, progress: bool = True) -> float:
        """Compile every bucket ahead of time; returns the seconds it took."""
        if self.kv_cache is None:
            raise RuntimeError("initialize_kv_cache() must come before compile()")
        start = time.perf_counter()
        shapes = self.bucket_shapes()
        rows = jax.ShapeDtypeStruct((PROMPT_LOGPROB_ROWS,), jnp.int32,
                                    sharding=self._replicated())
        # Spec-decode steps carry no prompt tokens: no prompt-logprob executable for them.
        prompt_tokens = sorted({num_tokens for shape in shapes if not self.is_spec_shape(shape)
                                for num_tokens in shape[:1]})
        # Tracing and lowering are Python (they hold the GIL): one after another here; XLA's
        # compiles release it and run in a pool. Each result lands under its own key, so the
        # executables do not depend on the order the compiles finish in.
        lowered: dict[Any, Any] = {}
        with tqdm(total=len(shapes) + len(prompt_tokens), desc="compiling step buckets",
                  unit="shape", disable=not progress) as bar:
            for num_tokens, max_query_len in shapes:
                lowered[("step", num_tokens, max_query_len)] = self.lower_step(
                    num_tokens, max_query_len, self.num_kv_blocks)
            for num_tokens in prompt_tokens:
                hidden = jax.ShapeDtypeStruct((num_tokens, self.config.hidden_size),
                                              self.activation_dtype,
                                              sharding=self._replicated())
                with jax.default_matmul_precision(self.matmul_precision):
                    lowered[("prompt", num_tokens)] = self._prompt_fn.lower(
                        self.params, hidden, rows, rows)

            def compile_one(item: tuple[Any, Any]) -> tuple[Any, Any]:
                key, low = item
                compiled = low.compile()
                bar.update()
                return key, compiled

            with ThreadPoolExecutor(compile_threads(len(lowered))) as pool:
                done = dict(pool.map(compile_one, lowered.items()))
        if self.lora_slots is not None:
            self.lora_slots.compile_update()
        self._compiled_prompt.clear()
        for key, compiled in done.items():
            if key[0] == "step":
                self._compiled[key[1:]] = compiled
            else:
                self._compiled_prompt[key[1]] = compiled
        self.set_fast_dispatch(self.fast_dispatch)
        self._logits_bufs.clear()
        self._row_slices.clear()
        self._gathers.clear()
        if self.mesh is not None and jax.process_count() > 1:
            for s in sorted({self.step_sizes(shape)[1] for shape in self.bucket_shapes()}):
                rows_spec = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=self._replicated())
                self._gathers[s] = jax.jit(take_rows, out_shardings=self._replicated()).lower(
                    self._logits_spec(s), rows_spec).compile()
        if jax.default_backend() != "cpu":
            row = jax.ShapeDtypeStruct((), jnp.int32)
            for shape in self.bucket_shapes():
                spec = self._logits_spec(self.step_sizes(shape)[1])
                if spec.shape[0] not in self._row_slices:
                    self._row_slices[spec.shape[0]] = jax.jit(row_slice).lower(spec,
                                                                               row).compile()
        return time.perf_counter() - start

    def set_fast_dispatch(self, enabled: bool) -> None:
        """Call the compiled steps through `StepCall` (True; only without a mesh and where this
        JAX has what it needs) or through `Compiled.__call__`; both run the same executables."""
        self.fast_dispatch = enabled
        self._calls = {shape: StepCall(compiled, (self.params_for(*shape), self.step_consts()))
                       for shape, compiled in self._compiled.items()
                       if enabled and self.mesh is None and StepCall.supported(compiled)}

    def compiled_shapes(self) -> tuple[list[tuple[int, int]], list[int]]:
        """The step shapes compiled so far (in the order of bucket_shapes()) and the
        token counts whose prompt-logprob executables were."""
        return list(self._compiled), list(self._compiled_prompt)

    def uses_fast_dispatch(self) -> bool:
        """Whether every compiled step is called through `StepCall`."""
        return bool(self._compiled) and set(self._calls) == set(self._compiled)

    def bucket_for(self, num_tokens: int, decode_only: bool = False) -> int:
        for t in self.decode_buckets if decode_only else self.buckets:
            if t >= num_tokens:
                return t
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def step_shape(self, scheduler_output: SchedulerOutput) -> tuple[int, int]:
        """The bucket a non-empty step pads to: a decode bucket when every request computes
        one token, a spec-decode bucket when every request computes its next token and its
        drafts, else a token bucket."""
        scheduled = scheduler_output.scheduled
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if num_tokens == len(scheduled):
            return self.bucket_for(num_tokens, decode_only=True), 1
        if scheduler_output.total_num_draft_tokens and self.spec_buckets and all(
                r.do_sample and r.num_tokens == 1 + r.num_draft_tokens for r in scheduled):
            seqs = self.bucket_for(len(scheduled), decode_only=True) * self.spec_query_len
            if seqs in self.spec_buckets:
                return seqs, self.spec_query_len
        padded = self.bucket_for(num_tokens)
        return padded, padded

    # --- one step -----------------------------------------------------------------------------

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a schedule to the persistent batch; also for a step with nothing to run, so
        that the requests it reports finished free their rows."""
        self.input_batch.update_states(scheduler_output)
        if self.lora_slots is not None:
            self._activate_loras(scheduler_output)

    def add_lora(self, lora: LoRARequest) -> None:
        """Read and check an adapter a request brings (ValueError if it does not fit)."""
        if self.lora_slots is None:
            raise ValueError("a lora_request needs an engine started with enable_lora=True")
        self.lora_slots.register(lora)

    def _activate_loras(self, scheduler_output: SchedulerOutput) -> None:
        """Give each request that starts this step its adapter's slot; if a slot was
        loaded, the steps bind the new slot arrays. A load donates the old ones to its
        in-place write: a step still in flight has already been handed them, and the device
        runs the write after it, but no step may be launched with them again."""
        assert self.lora_slots is not None
        batch = self.input_batch
        before = self.lora_slots.device_weights()
        try:
            in_use = None
            for r in scheduler_output.scheduled:
                if r.is_new and r.lora_int_id:
                    if in_use is None:
                        in_use = batch.live_lora_ids()
                    row = batch.req_id_to_row[r.request_id]
                    batch.lora_slot[row] = self.lora_slots.activate(r.lora_int_id, in_use)
        finally:  # a load before a failing one has donated `before` all the same
            if self.lora_slots.device_weights() is not before:
                consts = self.step_consts()
                for shape, call in self._calls.items():
                    call.rebind((self.params_for(*shape), consts))

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """Host inputs of a non-empty step (after applying it to the persistent batch)."""
        t0 = time.perf_counter()
        num_tokens = scheduler_output.total_num_scheduled_tokens
        shape = self.step_shape(scheduler_output)
        padded = shape[0]
        if shape not in self._compiled:
            raise RuntimeError(f"step shape {shape} was not compiled; call compile() first")
        self.update_states(scheduler_output)
        inputs = self.input_batch.prepare_inputs(scheduler_output, padded,
                                                 *self.step_sizes(shape))
        index = np.flatnonzero(inputs.input_ids[:num_tokens] < 0)
        req_ids = []
        if index.size:
            num_scheduled = len(scheduler_output.scheduled)
            owner = np.searchsorted(inputs.query_start_loc[1:num_scheduled + 1], index,
                                    side="right")
            req_ids = [scheduler_output.scheduled[i].request_id for i in owner.tolist()]
        return PreparedStep(scheduler_output, inputs, shape, index, req_ids,
                            time.perf_counter() - t0)

    def dispatch(self, prepared: PreparedStep,
                 placeholder_tokens: np.ndarray | None = None) -> StepHandle:
        """Fill the placeholders with the previous step's tokens (`placeholder_tokens`, in
        `placeholder_req_ids` order; 0 for a request that finished meanwhile: it computes a
        token nobody reads) and launch the step. Only the top-K candidates start their copy to
        the host."""
        inputs = prepared.inputs
        if prepared.placeholder_index.size:
            inputs.input_ids[prepared.placeholder_index] = (
                0 if placeholder_tokens is None else placeholder_tokens)
        self.step_shape_counts[prepared.shape] += 1
        t = time.perf_counter()
        packed = inputs.pack()
        if self.leader is not None:  # several hosts: the followers launch the same step
            self.leader.step(prepared.shape, packed)
        values, token_ids, lse, logits, hidden = self.launch(prepared.shape, packed)
        if logits.is_fully_addressable:
            for x in (values, token_ids, lse) if self.top_k else (logits,):
                x.copy_to_host_async()
        return StepHandle(prepared, values, token_ids, lse, logits, hidden, t,
                          time.perf_counter(), self.launches)

    def launch(self, shape: tuple[int, int], packed: np.ndarray) -> tuple:
        """Run a compiled step on its padded inputs packed into one vector
        (`DeviceInputs.pack`); returns (top-K values, ids, log-sum-exp, logits, hidden
        states)."""
        num_rows = self.step_sizes(shape)[1]
        buf = self._logits_bufs.pop(num_rows, None)
        if buf is None:  # first step of this shape (a transfer, not a compile)
            zeros = np.zeros((num_rows, self.config.vocab_size), np.float32)
            if self.mesh is None:
                buf = jax.device_put(zeros)
            else:  # per shard: device_put would compare the value across processes
                buf = jax.make_array_from_callback(
                    zeros.shape, NamedSharding(self.mesh, LOGITS_SPEC), lambda index: zeros[index])
        call = self._calls.get(shape)
        if call is not None and self.kv_cache is not None:
            *out, self.kv_cache = call(self.kv_cache, buf, packed)
        else:
            *out, self.kv_cache = self._compiled[shape](
                self.params_for(*shape), self.step_consts(), self.kv_cache, buf, packed)
        self.launches += 1
        return tuple(out)

    def gather_rows(self, logits: jax.Array, rows: np.ndarray) -> np.ndarray:
        """Several hosts: rows of a step's vocabulary-sharded logits, gathered (a collective:
        process 0 calls `_fetch_rows`, the followers this)."""
        return to_host(self._gathers[logits.shape[0]](logits, rows))

    def _fetch_rows(self, handle: StepHandle, rows: list[int]) -> np.ndarray:
        padded = np.zeros(handle.logits.shape[0], np.int32)
        padded[:len(rows)] = rows
        assert self.leader is not None  # rows are fetched this way only with several hosts
        self.leader.fetch(handle.launch_index, padded)
        return self.gather_rows(handle.logits, padded)[:len(rows)]

    def launch_prompt(self, hidden: jax.Array, rows: np.ndarray, targets: np.ndarray) -> list:
        """Prompt-logprob statistics of PROMPT_LOGPROB_ROWS rows of a step's hidden states."""
        if self.leader is not None:
            self.leader.prompt(rows, targets)
        return [to_host(x) for x in self._compiled_prompt[hidden.shape[0]](self.params, hidden,
                                                                         rows, targets)]

    def wait(self, handle: StepHandle) -> ModelRunnerOutput:
        """Block until the step's candidates are on the host. The full logits stay on the
        device (their buffer goes to the next step of the same shape once this output is
        released via `release`)."""
        n = handle.prepared.inputs.num_sampled_rows
        if self.top_k:
            values, token_ids, lse = handle.values, handle.token_ids, handle.lse
            assert values is not None and token_ids is not None and lse is not None  # top-K on
            host_values = to_host(values)[:n]
            ready = time.perf_counter()
            topk = TopKLogits(host_values, to_host(token_ids)[:n], to_host(lse)[:n],
                              self.top_k == self.config.vocab_size)
        else:
            handle.logits.block_until_ready()
            ready, topk = time.perf_counter(), None
        prepared = handle.prepared
        return ModelRunnerOutput(
            prepared.inputs.sample_req_ids, topk, handle, ready,
            StepTimings(prepared.prepare_s, ready - handle.dispatch_time,
                        time.perf_counter() - ready),
            prepared.shape, self._row_slices.get(handle.logits.shape[0]),
            fetch_rows=None if handle.logits.is_fully_addressable else self._fetch_rows)

    def release(self, out: ModelRunnerOutput) -> None:
        """The step's full logits are no longer needed: their buffer serves the next step."""
        self.reuse_logits(out.handle.logits)

    def reuse_logits(self, logits: jax.Array) -> None:
        """A step's logits nobody reads any more: the next step of that shape writes into them."""
        self._logits_bufs[logits.shape[0]] = logits

    def add_prompt_logprobs(self, out: ModelRunnerOutput,
                            wants: dict[str, tuple[int, list[int]]]) -> None:
        """Prompt logprob statistics into `out.prompt_logprobs`: request id -> (first position
        wanted, relative to the request's start in this step; the next prompt token of each
        wanted position from there). The LM head, log-sum-exp, top-N and the target's rank run
        on the device over the step's hidden states, PROMPT_LOGPROB_ROWS rows per call; only
        those statistics come to the host.

        Why a second executable rather than the rows inside the step: a static budget of prompt
        rows in the step would put that many extra rows through the LM head (a [rows, hidden] x
        [hidden, vocab] GEMM) in every step, asked for or not, while steps with prompt logprobs
        are rare; this costs nothing on the others (the hidden states stay on the device)."""
        if not wants:
            return
        rows, targets, owners = [], [], []
        offset = 0
        for r in out.handle.prepared.scheduler_output.scheduled:
            want = wants.get(r.request_id)
            if want is not None:
                skip, tokens = want
                rows.extend(range(offset + skip, offset + skip + len(tokens)))
                targets.extend(tokens)
                owners.append((r.request_id, r.start_position + skip, len(tokens)))
            offset += r.num_tokens
        if not rows:
            return
        hidden = out.handle.hidden
        parts = []
        for i in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            chunk_rows = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
            chunk_targets = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
            n = min(PROMPT_LOGPROB_ROWS, len(rows) - i)
            chunk_rows[:n] = rows[i:i + n]
            chunk_targets[:n] = targets[i:i + n]
            parts.append([x[:n] for x in self.launch_prompt(hidden, chunk_rows, chunk_targets)])
        target, rank, values, ids, lse = (np.concatenate(xs) for xs in zip(*parts, strict=True))
        start = 0
        for rid, first, n in owners:
            end = start + n
            out.prompt_logprobs[rid] = PromptLogprobRows(
                first, target[start:end], rank[start:end], values[start:end], ids[start:end],
                lse[start:end])
            start = end

    def hidden_rows(self, out: ModelRunnerOutput) -> np.ndarray:
        """The step's final-normed hidden states [T, hidden] (padding rows included) on the
        host, for the pooler: on CPU the array is already host memory; on a GPU one copy of
        the step's rows (a pooling runner's steps are prefill steps, whose rows all count for
        MEAN pooling)."""
        return to_host(out.handle.hidden)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      prompt_logprobs: dict[str, tuple[int, list[int]]] | None = None
                      ) -> ModelRunnerOutput:
        """Run one step synchronously: prepare, dispatch, wait (and the prompt logprobs)."""
        out = self.wait(self.dispatch(self.prepare(scheduler_output)))
        self.add_prompt_logprobs(out, prompt_logprobs or {})
        return out

    # --- what benchmarks read, through the engine core's collective_rpc ------------------------

    def get_step_shape_counts(self) -> list[tuple[int, int, int]]:
        """(num_tokens, max_query_len, steps) of every step shape run since the last reset."""
        return [(num_tokens, max_query_len, steps) for (num_tokens, max_query_len), steps
                in sorted(self.step_shape_counts.items())]

    def reset_step_shape_counts(self) -> None:
        self.step_shape_counts.clear()

    def get_weight_stats(self) -> dict[str, int]:
        """The weights' sizes (`matmul_timing.weight_stats`)."""
        return weight_stats(self)

    def measure_machine(self, gemm_size: int | None = None, copy_mib: int = 256
                        ) -> dict[str, float]:
        """The roofline's machine rates (`machine_rates.measure_machine`), measured here, in the
        process that holds the device (a frontend that allocated beside a core holding most of
        a GPU's memory would run out of it), in the steps' dtype and matmul precision."""
        with jax.default_matmul_precision(self.matmul_precision):
            return machine_rates.measure_machine(gemm_size, copy_mib,
                                                 dtype=jnp.dtype(self.dtype).name)

    def time_weight_matmuls(self, num_tokens: list[int], reps: int = 3) -> dict[int, float]:
        """Best-of-`reps` seconds of one step's weight matmuls at each token count: the
        benchmarks' matmul floor (it needs the weights, which only the runner holds)."""
        return time_runner_matmuls(self, num_tokens, reps)

    # --- what tests and the GPU checks read, through collective_rpc (either engine mode) ------

    def get_compile_count(self) -> int:
        """XLA backend compilations in this runner's process so far (any executable, not only
        steps): equal before and after serving means serving compiled nothing."""
        return compile_count()

    def _compiled_step(self, num_tokens: int, max_query_len: int) -> Any:
        compiled = self._compiled.get((num_tokens, max_query_len))
        if compiled is None:
            raise ValueError(f"no compiled step of shape (num_tokens={num_tokens}, "
                             f"max_query_len={max_query_len}); compiled: "
                             f"{sorted(self._compiled)}")
        return compiled

    def get_compiled_hlo(self, num_tokens: int, max_query_len: int) -> str:
        """The optimized HLO text of one compiled step shape."""
        return self._compiled_step(num_tokens, max_query_len).as_text()

    def get_memory_analysis(self, num_tokens: int, max_query_len: int) -> dict[str, int]:
        """XLA's memory analysis of one compiled step shape, in bytes: arguments, outputs,
        outputs aliasing a donated argument (the KV array, the logits buffer), temporaries and
        generated code."""
        ma = self._compiled_step(num_tokens, max_query_len).memory_analysis()
        if ma is None:
            raise RuntimeError(f"XLA gives no memory analysis on {jax.default_backend()}")
        return {name: int(getattr(ma, f"{name}_size_in_bytes"))
                for name in ("argument", "output", "alias", "temp", "generated_code")}

    def get_kv_cache_info(self) -> dict[str, Any]:
        """The KV array: global shape, dtype name (numpy's, e.g. "bfloat16"), global size in
        bytes and blocks."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated yet (initialize_kv_cache)")
        return {"shape": list(self.kv_cache.shape), "dtype": jnp.dtype(self.kv_cache.dtype).name,
                "nbytes": int(self.kv_cache.nbytes), "num_blocks": self.num_kv_blocks}
