"""ModelRunner: SchedulerOutput -> padded device inputs -> one jitted step -> sampled-row logits.

Every step's shapes come from a small fixed set of buckets, all compiled ahead of time at
start-up, so serving never compiles:
  - a step whose every sequence computes one token (pure decode) pads T to a decode bucket
    (powers of two from 1 up to the first one >= max_num_seqs) and uses max_query_len = 1 (the
    Pallas kernel picks decode tiles); small decode buckets matter on CPU, where a GEMM's time
    grows with its rows even when it is bound by the weights (24 layers of the 0.5B model:
    ~57 ms at 1 row, ~172 ms at 16);
  - any other step pads T to a token bucket (powers of two from 16 up to
    max_num_batched_tokens) with max_query_len = T;
  - the sequence count S and the number of logits rows are min(T, max_num_seqs), so they follow
    T and add no bucket dimension.
Weights are picked per bucket when it is compiled (`params_for`), between two trees of the same
values: with quantization="gguf" the decode buckets up to GGUF_GEMV_MAX_ROWS run on
`gemv_params` (GGUF blocks kept quantized, fused dequant GEMVs: fewer bytes per step), every
other bucket on `params` (float32 copies, fastest for multi-row dots). With dtype bfloat16 on
CPU, buckets under MIN_TOKEN_BUCKET rows run on float32 copies of the bfloat16 weights (a bf16
GEMV is ~12x slower than a float32 one there), the others on the bfloat16 weights (bf16 GEMMs
run ~2x the float32 rate on AVX512-BF16 cores).
Block tables are always max_model_len wide; each running request keeps its row in the
persistent InputBatch, updated from each SchedulerOutput's new block ids. The KV array is one
preallocated buffer, sized from a memory budget (`initialize_kv_cache`, after
`measure_activation_bytes` on a GPU), donated to every step so XLA updates it in place.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.models.qwen2 import (
    AttentionMetadata,
    Qwen2ForCausalLM,
    compute_logits,
    kv_cache_shape,
    rope_variables,
)
from jaxllm.worker.input_batch import InputBatch
from scheduler import SchedulerOutput

# Prompt-logprob rows go through the LM head in chunks of this many rows (one compiled shape).
PROMPT_LOGITS_CHUNK = 32
MIN_TOKEN_BUCKET = 16
# quantization="gguf": decode buckets of at most this many rows use the quantized GEMVs (one per
# row, so the int8 weights are read once per row); measured in BENCHMARKS.md (issue 17).
GGUF_GEMV_MAX_ROWS = 8


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    buckets = []
    t = MIN_TOKEN_BUCKET
    while t < max_num_batched_tokens:
        buckets.append(t)
        t *= 2
    buckets.append(max(max_num_batched_tokens, MIN_TOKEN_BUCKET))
    return buckets


def decode_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Token counts of pure-decode steps: powers of two up to the first >= max_num_seqs, and
    never past what one step may hold."""
    limit = min(max_num_seqs, max_num_batched_tokens)
    buckets = [1]
    while buckets[-1] < limit:
        buckets.append(min(buckets[-1] * 2, max_num_batched_tokens))
    return buckets


def float32_weights(params: dict) -> dict:
    """The tree with float32 copies of its matrices (exactly the same values); vectors (norms,
    biases) stay shared. For GEMVs of a bfloat16 model on CPU."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if x.ndim == 2 else x, params)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: Any) -> int:
    return (math.prod(kv_cache_shape(config, 1, block_size)) * jnp.dtype(dtype).itemsize)


def device_memory_bytes() -> int | None:
    """Total memory of the first accelerator, or None on CPU / when unknown."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    stats = dev.memory_stats() or {}
    return stats.get("bytes_limit")


@dataclass
class StepTimings:
    prepare_s: float = 0.0
    device_s: float = 0.0
    transfer_s: float = 0.0


@dataclass
class ModelRunnerOutput:
    """Logits of the rows that sample this step, and prompt-logprob logits where asked."""

    sample_req_ids: list[str]
    logits: np.ndarray  # [len(sample_req_ids), vocab] float32
    # request id -> (logits [n, vocab] of its prompt positions computed this step, their start)
    prompt_logits: dict[str, tuple[np.ndarray, int]] = field(default_factory=dict)
    timings: StepTimings = field(default_factory=StepTimings)
    step_shape: tuple[int, int] = (0, 0)  # (num_tokens, max_query_len) of the compiled step


class ModelRunner:
    def __init__(self, config: ModelConfig, params: dict, *, dtype: Any, kernel_backend: str,
                 block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, gemv_params: dict | None = None) -> None:
        self.config = config
        self.params = params
        self.gemv_params = gemv_params
        self.gemv_max_rows = GGUF_GEMV_MAX_ROWS
        if gemv_params is None and jnp.dtype(dtype) == jnp.bfloat16 \
                and jax.default_backend() == "cpu":
            self.gemv_params = float32_weights(params)
            self.gemv_max_rows = MIN_TOKEN_BUCKET - 1
        self.dtype = dtype
        # XLA on CPU scatters into a 16-bit float KV array by converting all of it to float32
        # and back, twice per step (3 s per step for a 1 GiB bfloat16 cache): keep it float32.
        self.kv_cache_dtype = jnp.float32 if jnp.dtype(dtype).itemsize == 2 \
            and jax.default_backend() == "cpu" else dtype
        self.block_size = block_size
        self.num_kv_blocks = 0
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = token_buckets(max_num_batched_tokens)
        self.decode_buckets = decode_buckets(max_num_seqs, max_num_batched_tokens)
        self.model = Qwen2ForCausalLM(config, dtype=dtype, kernel_backend=kernel_backend)
        self.rope = rope_variables(config)
        self.kv_cache: jax.Array | None = None
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, block_size)
        self._step = jax.jit(self._forward, static_argnames=("max_query_len",),
                             donate_argnames=("kv_cache",))
        self._logits_fn = jax.jit(lambda params, h: compute_logits(params, config, h))
        self._compiled: dict[tuple[int, int], Any] = {}
        self._compiled_logits = None
        # Steps run per (num_tokens, max_query_len) shape: benchmarks price a run's shapes.
        self.step_shape_counts: Counter[tuple[int, int]] = Counter()

    def _forward(self, params, rope, kv_cache, input_ids, positions, md, max_query_len):
        return self.model.apply({"params": params, "rope": rope}, input_ids, positions, kv_cache,
                                md, max_query_len=max_query_len)

    # --- compilation --------------------------------------------------------------------------

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """(num_tokens, max_query_len) of every step shape the runner can produce."""
        return [(t, 1) for t in self.decode_buckets] + [(t, t) for t in self.buckets]

    def params_for(self, num_tokens: int, max_query_len: int) -> dict:
        """The param tree a bucket's executable is compiled for and runs with."""
        if self.gemv_params is not None and max_query_len == 1 \
                and num_tokens <= self.gemv_max_rows:
            return self.gemv_params
        return self.params

    def _abstract_inputs(self, num_tokens: int):
        s = min(num_tokens, self.max_num_seqs)
        i32 = jnp.int32

        def spec(*shape):
            return jax.ShapeDtypeStruct(shape, i32)

        md = AttentionMetadata(spec(num_tokens), spec(s, self.max_blocks_per_seq), spec(s),
                               spec(s + 1), spec(s))
        return spec(num_tokens), spec(num_tokens), md

    def _compile_step(self, num_tokens: int, max_query_len: int, num_kv_blocks: int):
        kv_spec = jax.ShapeDtypeStruct(
            kv_cache_shape(self.config, num_kv_blocks, self.block_size), self.kv_cache_dtype)
        ids, pos, md = self._abstract_inputs(num_tokens)
        return self._step.lower(self.params_for(num_tokens, max_query_len), self.rope, kv_spec,
                                ids, pos, md,
                                max_query_len=max_query_len).compile()

    def weight_bytes(self) -> int:
        """Bytes of the weights and RoPE tables on the device (arrays both trees share once)."""
        leaves = jax.tree.leaves((self.params, self.gemv_params, self.rope))
        return sum({id(x): x.nbytes for x in leaves}.values())

    def measure_activation_bytes(self, probe_blocks: int = 16) -> int:
        """Device bytes the largest step needs besides weights and KV: its temporaries plus the
        outputs that do not alias the donated KV array, read from XLA's memory analysis of that
        step compiled against a small probe KV array (one extra compile)."""
        num_tokens = self.buckets[-1]
        ma = self._compile_step(num_tokens, num_tokens, probe_blocks).memory_analysis()
        return int(ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the one paged KV array (all layers); compile() comes after."""
        self.num_kv_blocks = num_blocks
        self.kv_cache = jnp.zeros(kv_cache_shape(self.config, num_blocks, self.block_size),
                                  self.kv_cache_dtype)
        self._compiled.clear()

    def compile(self, progress: bool = True) -> float:
        """Compile every bucket ahead of time; returns the seconds it took."""
        if self.kv_cache is None:
            raise RuntimeError("initialize_kv_cache() must come before compile()")
        start = time.perf_counter()
        for num_tokens, max_query_len in tqdm(self.bucket_shapes(), desc="compiling step buckets",
                                              unit="shape", disable=not progress):
            self._compiled[(num_tokens, max_query_len)] = self._compile_step(
                num_tokens, max_query_len, self.num_kv_blocks)
        hidden = jax.ShapeDtypeStruct((PROMPT_LOGITS_CHUNK, self.config.hidden_size), self.dtype)
        self._compiled_logits = self._logits_fn.lower(self.params, hidden).compile()
        return time.perf_counter() - start

    def bucket_for(self, num_tokens: int, decode_only: bool = False) -> int:
        for t in self.decode_buckets if decode_only else self.buckets:
            if t >= num_tokens:
                return t
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    # --- one step -----------------------------------------------------------------------------

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply a schedule to the persistent batch; also for a step with nothing to run, so
        that the requests it reports finished free their rows."""
        self.input_batch.update_states(so)

    def execute_model(self, so: SchedulerOutput,
                      prompt_logprob_reqs: dict[str, int] | None = None) -> ModelRunnerOutput:
        """Run one step. `prompt_logprob_reqs` maps a request id to the number of prompt
        positions whose logits it needs (it wants logprobs for its prompt)."""
        t0 = time.perf_counter()
        reqs = so.scheduled
        num_tokens = so.total_num_scheduled_tokens
        decode_only = num_tokens == len(reqs)  # every request computes one token
        padded = self.bucket_for(num_tokens, decode_only)
        num_seqs = min(padded, self.max_num_seqs)
        max_query_len = 1 if decode_only else padded
        self.update_states(so)
        inputs = self.input_batch.prepare_inputs(so, padded, num_seqs)
        input_ids, positions = inputs.input_ids, inputs.positions
        sample_req_ids = inputs.sample_req_ids
        md = AttentionMetadata(inputs.slot_mapping, inputs.block_tables, inputs.seq_lens,
                               inputs.query_start_loc, inputs.logits_indices)
        t1 = time.perf_counter()
        step = self._compiled.get((padded, max_query_len))
        if step is None:
            raise RuntimeError(f"step shape ({padded}, {max_query_len}) was not compiled; "
                               f"call compile() first")
        self.step_shape_counts[(padded, max_query_len)] += 1
        logits, hidden, self.kv_cache = step(self.params_for(padded, max_query_len), self.rope,
                                             self.kv_cache, input_ids, positions, md)
        logits.block_until_ready()
        t2 = time.perf_counter()
        # Only the sampled rows are fetched; on CPU this is a view, on GPU a small copy.
        host_logits = np.asarray(logits)[:len(sample_req_ids)]
        prompt_logits = {}
        if prompt_logprob_reqs:
            host_hidden = np.asarray(hidden)
            offset = 0
            for r in reqs:
                want = prompt_logprob_reqs.get(r.request_id, 0)
                if want > 0:
                    rows = min(want, r.num_tokens)
                    prompt_logits[r.request_id] = (
                        self._logits_rows(host_hidden[offset:offset + rows]), r.start_position)
                offset += r.num_tokens
        t3 = time.perf_counter()
        return ModelRunnerOutput(sample_req_ids, host_logits, prompt_logits,
                                 StepTimings(t1 - t0, t2 - t1, t3 - t2), (padded, max_query_len))

    def _logits_rows(self, host_hidden: np.ndarray) -> np.ndarray:
        count = len(host_hidden)
        out = []
        for i in range(0, count, PROMPT_LOGITS_CHUNK):
            chunk = host_hidden[i:i + PROMPT_LOGITS_CHUNK]
            padded = np.zeros((PROMPT_LOGITS_CHUNK, chunk.shape[1]), chunk.dtype)
            padded[:len(chunk)] = chunk
            out.append(np.asarray(self._compiled_logits(self.params, padded))[:len(chunk)])
        return np.concatenate(out, axis=0)
