"""`LLM`: the offline entrypoint, with vLLM's names.

Until the engine (scheduler + model runner) lands, generation runs one simple loop: a batch of
prompts gets contiguous runs of blocks in the paged KV array, is prefilled in one step, then
decoded step by step. The engine replaces this loop; it is not kept as a second path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import pallas_kernels
from jaxllm.default_model import DEFAULT_MODEL_NAME, default_model_path
from jaxllm.loader import load_model
from jaxllm.model import AttentionMetadata, Qwen2ForCausalLM, kv_cache_shape, rope_variables
from jaxllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxllm.sampler import sample
from jaxllm.sampling_params import SamplingParams
from jaxllm.tokenizer import load_tokenizer

PromptType = str | dict[str, Any]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass
class EngineArgs:
    """Engine settings beyond the model and dtype; unknown names are refused by LLM()."""

    kernel_backend: str | None = None  # None: "pallas" on a GPU, "reference" on CPU
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    seed: int = 0
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        backend = self.kernel_backend
        if backend is not None and backend not in pallas_kernels.BACKENDS:
            raise ValueError(f"kernel_backend {backend!r} is not one of {pallas_kernels.BACKENDS}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in 8..128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")


def resolve_dtype(dtype: Any) -> Any:
    """None -> float32 on CPU, bfloat16 on GPU (bf16 GEMV is ~18x slower than f32 on this CPU)."""
    if dtype is None or dtype == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


class LLM:
    """Generate text with a Qwen2 model: `LLM(model=None)` uses the embedded default model."""

    def __init__(self, model: str | Path | None = None, dtype: Any = None,
                 **engine_args: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine argument(s) {unknown}; "
                            f"known: {sorted(known)}")
        self.engine_args = EngineArgs(**engine_args)
        self.dtype = resolve_dtype(dtype)
        path = default_model_path() if model is None else Path(model)
        self.model_name = DEFAULT_MODEL_NAME if model is None else str(model)
        loaded = load_model(path, dtype=self.dtype)
        self.config = loaded.config
        self.params = loaded.params
        self.tokenizer = None if self.engine_args.skip_tokenizer_init else load_tokenizer(path)
        self.kernel_backend = self.engine_args.kernel_backend or pallas_kernels.default_backend()
        self.max_model_len = self.engine_args.max_model_len or self.config.max_position_embeddings
        self.model = Qwen2ForCausalLM(self.config, dtype=self.dtype,
                                      kernel_backend=self.kernel_backend)
        self._rope = rope_variables(self.config)
        self._step = jax.jit(self._forward, static_argnames=("max_query_len",),
                             donate_argnames=("kv_cache",))
        self._eos_ids = {t for t in (self.config.eos_token_id,
                                     getattr(self.tokenizer, "eos_token_id", None))
                         if t is not None}
        self._request_counter = 0

    def _forward(self, params, kv_cache, input_ids, positions, md, max_query_len):
        return self.model.apply({"params": params, "rope": self._rope}, input_ids, positions,
                                kv_cache, md, max_query_len=max_query_len)

    def get_tokenizer(self):
        return self.tokenizer

    # --- public API ------------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt; results come back in input order."""
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} "
                                 f"sampling_params; pass one, or one per prompt")
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        outputs: list[RequestOutput] = []
        bar = tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm)
        step = self.engine_args.max_num_seqs
        for start in range(0, len(requests), step):
            outputs.extend(self._generate_batch(requests[start:start + step]))
            bar.update(len(requests[start:start + step]))
        bar.close()
        return outputs

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Run one conversation or a list of them through the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this LLM was made with "
                             "skip_tokenizer_init=True")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conv, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # --- the simple loop (replaced by the engine) ----------------------------------------------

    def _make_request(self, prompt: PromptType, sp: SamplingParams) -> dict[str, Any]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass "
                                 "{'prompt_token_ids': [...]} or drop skip_tokenizer_init")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        else:
            raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids', got "
                             f"{type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{self.max_model_len} (room for at least one new token is needed)")
        request_id = str(self._request_counter)
        seed = sp.seed if sp.seed is not None else [self.engine_args.seed, self._request_counter]
        self._request_counter += 1
        max_tokens = min(sp.max_tokens or self.max_model_len, self.max_model_len - len(token_ids))
        return {"id": request_id, "prompt": text, "prompt_token_ids": token_ids, "params": sp,
                "max_tokens": max_tokens, "generator": np.random.default_rng(seed),
                "arrival": time.time()}

    def _generate_batch(self, reqs: list[dict[str, Any]]) -> list[RequestOutput]:
        bs = self.engine_args.block_size
        num_seqs = len(reqs)
        lens = [len(r["prompt_token_ids"]) for r in reqs]
        max_total = max(n + r["max_tokens"] for n, r in zip(lens, reqs, strict=True))
        blocks_per_seq = -(-max_total // bs)
        kv_cache = jnp.zeros(kv_cache_shape(self.config, num_seqs * blocks_per_seq, bs),
                             self.dtype)
        block_tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, -1)
        outputs: list[list[int]] = [[] for _ in reqs]
        finish: list[tuple[str, Any] | None] = [None] * num_seqs
        first_token_time: list[float | None] = [None] * num_seqs

        # Prefill: every prompt in one ragged step.
        tokens = np.concatenate([np.asarray(r["prompt_token_ids"], np.int32) for r in reqs])
        positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
        seq_ids = np.repeat(np.arange(num_seqs), lens)
        logits, kv_cache = self._run_step(tokens, positions, seq_ids, np.asarray(lens, np.int32),
                                          np.asarray(lens, np.int32), block_tables, kv_cache,
                                          max_query_len=_next_pow2(max(lens)))
        seq_lens = np.asarray(lens, np.int32)
        while True:
            active = [i for i in range(num_seqs) if finish[i] is None]
            new = sample(logits[active], [reqs[i]["params"] for i in active],
                         [reqs[i]["generator"] for i in active])
            now = time.time()
            for i, tok in zip(active, new.tolist(), strict=True):
                outputs[i].append(tok)
                first_token_time[i] = first_token_time[i] or now
                finish[i] = self._check_stop(reqs[i], outputs[i])
            if all(f is not None for f in finish):
                break
            # Decode: one token per sequence; finished ones ride along (their slots are unused).
            tokens = np.asarray([o[-1] for o in outputs], np.int32)
            positions = seq_lens.copy()
            seq_lens = seq_lens + 1
            logits, kv_cache = self._run_step(tokens, positions, np.arange(num_seqs), seq_lens,
                                              np.ones(num_seqs, np.int32), block_tables,
                                              kv_cache, max_query_len=1)
        results = []
        done = time.time()
        for i, r in enumerate(reqs):
            reason, stop_reason = finish[i]
            token_ids = outputs[i]
            text = self._decode(r, token_ids)
            if reason == "stop" and isinstance(stop_reason, str):
                text = text[:text.index(stop_reason)]  # vLLM cuts the stop string from the text
            results.append(RequestOutput(
                request_id=r["id"], prompt=r["prompt"], prompt_token_ids=r["prompt_token_ids"],
                outputs=[CompletionOutput(0, text, token_ids, finish_reason=reason,
                                          stop_reason=stop_reason)],
                finished=True,
                metrics=RequestMetrics(r["arrival"], first_token_time[i], done)))
        return results

    def _check_stop(self, req: dict[str, Any], out: list[int]) -> tuple[str, Any] | None:
        sp: SamplingParams = req["params"]
        tok = out[-1]
        if len(out) >= sp.min_tokens:
            if tok in sp.stop_token_ids:
                return "stop", tok
            if not sp.ignore_eos and tok in self._eos_ids:
                return "stop", None
            if sp.stop and self.tokenizer is not None:
                # Whole-text re-decode each step: quadratic, but this loop is temporary (the
                # engine's incremental detokenizer replaces it).
                text = self._decode(req, out)
                hits = [(text.index(s), s) for s in sp.stop if s in text]
                if hits:
                    return "stop", min(hits)[1]
        if len(out) >= req["max_tokens"]:
            return "length", None
        return None

    def _decode(self, req: dict[str, Any], token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids,
                                     skip_special_tokens=req["params"].skip_special_tokens)

    def _run_step(self, tokens, positions, seq_ids, seq_lens, query_lens, block_tables,
                  kv_cache, max_query_len):
        bs = self.engine_args.block_size
        num_tokens = len(tokens)
        padded = _next_pow2(num_tokens, 8)
        slots = block_tables[seq_ids, positions // bs] * bs + positions % bs
        pad = padded - num_tokens
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(np.pad(slots, (0, pad), constant_values=-1), jnp.int32),
            block_tables=jnp.asarray(block_tables),
            seq_lens=jnp.asarray(seq_lens, jnp.int32),
            query_start_loc=jnp.asarray(qsl),
            logits_indices=jnp.asarray(qsl[1:] - 1))
        logits, kv_cache = self._step(self.params, kv_cache,
                                      jnp.asarray(np.pad(tokens, (0, pad)), jnp.int32),
                                      jnp.asarray(np.pad(positions, (0, pad)), jnp.int32), md,
                                      max_query_len=max_query_len)
        return np.asarray(logits), kv_cache
