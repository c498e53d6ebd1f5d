"""`LLM`: the offline entrypoint, with vLLM's names, over LLMEngine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from jaxllm.engine.llm_engine import EngineArgs, LLMEngine
from jaxllm.engine.processor import PromptType
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams


class LLM:
    """Generate text with a Qwen2 model: `LLM(model=None)` uses the embedded default model.

    Engine arguments (see EngineArgs): kernel_backend, block_size, num_kv_blocks,
    gpu_memory_utilization, kv_cache_memory_bytes, max_model_len, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, seed, skip_tokenizer_init, show_progress.
    """

    def __init__(self, model: str | Path | None = None, dtype: Any = None,
                 **engine_args: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine argument(s) {unknown}; "
                            f"known: {sorted(known)}")
        self.llm_engine = LLMEngine(model, dtype, EngineArgs(**engine_args))
        self._request_counter = 0

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt; results come back in input order.

        Every prompt is validated before any is queued: a bad one raises ValueError naming its
        index, and the engine is left as it was.
        """
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
        engine = self.llm_engine
        processed = []
        for i, (prompt, sp) in enumerate(zip(prompts, params_list, strict=True)):
            try:
                engine.processor.check_params(sp)
                p = engine.processor.process_prompt(prompt)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
            # Tokenized once: add_request takes the ids as they are.
            processed.append({"prompt": p.prompt, "prompt_token_ids": p.prompt_token_ids})
        ids = []
        for prompt, sp in zip(processed, params_list, strict=True):
            request_id = str(self._request_counter)
            self._request_counter += 1
            engine.add_request(request_id, prompt, sp)
            ids.append(request_id)
        return self._run_engine(ids, use_tqdm)

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

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req",
                   disable=not use_tqdm, dynamic_ncols=True)
        prefill_tokens = decode_tokens = 0
        start = time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
                stats = engine.last_step_stats
                prefill_tokens += stats.num_prefill_tokens
                decode_tokens += stats.num_decode_tokens
                if use_tqdm:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"prefill {prefill_tokens / elapsed:.1f} tok/s, "
                                        f"decode {decode_tokens / elapsed:.1f} tok/s",
                                        refresh=False)
        except BaseException:
            # Leave the engine clean (blocks returned) if generation is interrupted.
            engine.abort_request(list(engine.output_processor.parents))
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]
