"""The Hugging Face transformers baseline (`--compare-hf`): the same weights and token ids through
transformers' batched greedy `generate` (left padding, every row generating its full length)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxllm.benchmarks.datasets import TokenSampler, Workload
from jaxllm.benchmarks.metrics import latency_metrics, throughput_metrics


class HFRunner:
    """The same weights through transformers' batched greedy `generate`."""

    def __init__(self, model: str | Path | None, dtype_name: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from jaxllm.model_executor.model_loader.default_model import default_model_path

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        path = default_model_path() if model is None else Path(model)
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16}.get(dtype_name, torch.float32)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        start = time.perf_counter()
        hf: Any  # transformers' annotations name a mixin without `to` / `generate`
        if path.is_file() and path.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=torch_dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
        self.model = hf.to(self.device).eval()
        self.load_time_s = time.perf_counter() - start
        self.dtype_name = str(torch_dtype).removeprefix("torch.")
        eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id = min(self.eos_ids) if self.eos_ids else 0

    def generate(self, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool,
                 record_times: bool = False) -> tuple[list[list[int]], list[float]]:
        """Greedy, left-padded batch. Returns each row's new tokens (cut at EOS unless
        ignore_eos) and, if asked, the perf_counter time of every decoding step's logits."""
        import transformers

        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        gen_config = transformers.GenerationConfig(
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens if ignore_eos else 0,
            do_sample=False, pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids) if self.eos_ids else None)
        times: list[float] = []
        extra = {}
        if record_times:
            class _Clock(transformers.LogitsProcessor):
                def __call__(self, input_ids, scores):
                    times.append(time.perf_counter())
                    return scores

            extra["logits_processor"] = transformers.LogitsProcessorList([_Clock()])
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device),
                                      attention_mask=mask.to(self.device),
                                      generation_config=gen_config, **extra)
        new = out[:, width:].cpu().tolist()
        if not ignore_eos and self.eos_ids:
            cut = []
            for row in new:
                end = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), len(row))
                cut.append(row[:end])
            new = cut
        return new, times

    def warm_up(self, prompts: list[list[int]]) -> None:
        """A short generate at the batch's width, so first-call costs stay out of the timing."""
        self.generate(prompts, 2, True)

    def throughput(self, workload: Workload, batch_size: int, ignore_eos: bool,
                   use_tqdm: bool = True) -> dict[str, Any]:
        """Prompts in input order, `batch_size` at a time; each batch generates its longest
        output length (transformers cannot stop rows separately); only the tokens each request
        asked for count as output."""
        self.warm_up(workload.prompts[:batch_size])
        computed = useful = 0
        start = time.perf_counter()
        bar = tqdm(total=len(workload), desc="HF generate", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        for i in range(0, len(workload), batch_size):
            prompts = workload.prompts[i:i + batch_size]
            lens = workload.output_lens[i:i + batch_size]
            new, _ = self.generate(prompts, max(lens), ignore_eos)
            computed += sum(len(r) for r in new)
            useful += sum(min(len(r), n) for r, n in zip(new, lens, strict=True))
            bar.update(len(prompts))
        elapsed = time.perf_counter() - start
        bar.close()
        out: dict[str, Any] = throughput_metrics(elapsed, sum(workload.prompt_lens), useful,
                                                 len(workload))
        out.update(batch_size=batch_size, generated_tokens_incl_padding_rows=computed,
                   dtype=self.dtype_name, device=self.device)
        return out

    def latency(self, sampler: TokenSampler, batch_size: int, input_len: int, output_len: int,
                num_iters: int, num_iters_warmup: int, seed: int,
                use_tqdm: bool = True) -> dict[str, Any]:
        """TTFT = time to the first step's logits; TPOT = the rest of the steps' mean."""
        rng = np.random.default_rng(seed)
        for _ in tqdm(range(max(1, num_iters_warmup)), desc="HF warm-up iterations",
                      disable=not use_tqdm):
            self.generate([sampler.sample(rng, input_len) for _ in range(batch_size)],
                          output_len, True)
        latencies, ttfts, tpots = [], [], []
        out_tokens = 0
        for _ in tqdm(range(num_iters), desc="HF iterations", disable=not use_tqdm):
            prompts = [sampler.sample(rng, input_len) for _ in range(batch_size)]
            start = time.perf_counter()
            new, times = self.generate(prompts, output_len, True, record_times=True)
            end = time.perf_counter()
            latencies.append(end - start)
            out_tokens += sum(len(r) for r in new)
            if times:
                ttfts.extend([times[0] - start] * batch_size)
                if output_len > 1:
                    tpots.extend([(end - times[0]) / (output_len - 1)] * batch_size)
        out = latency_metrics(latencies, ttfts, tpots, out_tokens)
        out.update(batch_size=batch_size, dtype=self.dtype_name, device=self.device)
        return out

