"""`jaxllm bench throughput | latency | sweep`: vLLM-style benchmarks with a same-run baseline.

Every run can put its numbers next to two references measured in the same process:
  - `--compare-hf`: the same token ids through Hugging Face transformers' batched `generate`
    (greedy, left padding, every row generating its full length), and the speed-up over it;
  - a roofline: the machine's measured GEMM rate (best of XLA's jitted `jnp.dot` and numpy's `@`)
    and memory bandwidth (best of an XLA and a numpy array copy and an XLA GEMV read), the
    workload's useful FLOPs and bytes, its ideal time max(FLOPs / GEMM rate, bytes / bandwidth)
    and the fraction of it we reach;
  - with the roofline, a matmul floor: every step shape the run used, timed again through
    nothing but the model's own weight matmuls on XLA, times the steps of that shape. It is what
    the run would take if attention, norms, RoPE, KV writes, sampling and host work were free,
    so it splits the gap to the roofline into "XLA's matmul rate" and "everything else".
`--profile` adds a per-step split of host time (schedule, input preparation, device step, logits
transfer, sampling, scheduler update, detokenization, other) in decode steady state.

Synthetic prompts are random token ids (special tokens excluded), so their lengths are exact and
no tokenizer is needed (`--skip-tokenizer-init`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

DEFAULT_MAX_MODEL_LEN = 4096


# --- workloads -------------------------------------------------------------------------------


@dataclass
class Workload:
    """Prompts (token ids) and the number of tokens each must generate."""

    prompts: list[list[int]]
    output_lens: list[int]
    description: str = ""

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def summary(self) -> dict[str, Any]:
        p, o = self.prompt_lens, self.output_lens
        return {"description": self.description, "num_requests": len(self),
                "total_prompt_tokens": int(sum(p)), "total_output_tokens": int(sum(o)),
                "prompt_len_min": int(min(p)), "prompt_len_max": int(max(p)),
                "output_len_min": int(min(o)), "output_len_max": int(max(o))}


class TokenSampler:
    """Random ordinary token ids: [0, vocab) minus the tokenizer's special / added tokens (or the
    config's BOS/EOS when there is no tokenizer)."""

    def __init__(self, vocab_size: int, tokenizer=None, special_ids: set[int] | None = None):
        hi = vocab_size
        special = set(special_ids or ())
        if tokenizer is not None:
            hi = min(vocab_size, len(tokenizer))
            special |= set(getattr(tokenizer, "all_special_ids", ()) or ())
            special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        allowed = np.setdiff1d(np.arange(hi, dtype=np.int64),
                               np.fromiter(special, np.int64, len(special)))
        if allowed.size == 0:
            raise ValueError("no ordinary token ids to draw synthetic prompts from")
        self.allowed = allowed

    def sample(self, rng: np.random.Generator, length: int) -> list[int]:
        return [int(t) for t in rng.choice(self.allowed, size=length)]


def token_sampler_for(llm) -> TokenSampler:
    engine = llm.llm_engine
    cfg = engine.model_config
    special = {t for t in (cfg.bos_token_id, cfg.eos_token_id) if t is not None}
    special |= set(engine.eos_token_ids)
    return TokenSampler(cfg.vocab_size, engine.tokenizer, special)


def _lengths(rng: np.random.Generator, n: int, fixed: int, rng_range: list[int] | None,
             name: str) -> list[int]:
    if rng_range is None:
        if fixed < 1:
            raise ValueError(f"--{name}-len must be >= 1, got {fixed}")
        return [fixed] * n
    lo, hi = rng_range
    if not 1 <= lo <= hi:
        raise ValueError(f"--random-{name}-range needs 1 <= A <= B, got {lo} {hi}")
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def synthetic_workload(sampler: TokenSampler, num_prompts: int, input_len: int, output_len: int,
                       seed: int, input_range: list[int] | None = None,
                       output_range: list[int] | None = None) -> Workload:
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_prompts, input_len, input_range, "input")
    out_lens = _lengths(rng, num_prompts, output_len, output_range, "output")
    prompts = [sampler.sample(rng, n) for n in in_lens]
    ins = f"input {input_range[0]}-{input_range[1]}" if input_range else f"input {input_len}"
    outs = (f"output {output_range[0]}-{output_range[1]}" if output_range
            else f"output {output_len}")
    return Workload(prompts, out_lens, f"{num_prompts} random prompts, {ins}, {outs}")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON (a list of objects) or JSONL (one object a line) file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"dataset {path}: {e}") from e
    try:
        records = json.loads(text)
        if isinstance(records, dict):
            records = [records]
    except json.JSONDecodeError:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset {path}, line {lineno}: {e}") from e
    if not isinstance(records, list) or not records:
        raise ValueError(f"dataset {path}: expected a non-empty list of records")
    return records


def load_dataset(path: str | Path, tokenizer, default_output_len: int,
                 num_prompts: int | None = None) -> Workload:
    """JSON (a list of records) or JSONL (one record a line). A record has "prompt" (text, needs
    the tokenizer) or "prompt_token_ids", and optionally "output_len"."""
    path = Path(path)
    records = read_records(path)
    if num_prompts is not None:
        records = records[:num_prompts]
    prompts, out_lens = [], []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"dataset {path}, record {i}: not an object")
        if "prompt_token_ids" in rec:
            ids = [int(t) for t in rec["prompt_token_ids"]]
        elif "prompt" in rec:
            if tokenizer is None:
                raise ValueError(f"dataset {path}, record {i}: a text prompt needs the "
                                 f"tokenizer (drop --skip-tokenizer-init)")
            ids = list(tokenizer.encode(rec["prompt"]))
        else:
            raise ValueError(f"dataset {path}, record {i}: needs 'prompt' or 'prompt_token_ids'")
        if not ids:
            raise ValueError(f"dataset {path}, record {i}: empty prompt")
        out_len = int(rec.get("output_len", default_output_len))
        if out_len < 1:
            raise ValueError(f"dataset {path}, record {i}: output_len must be >= 1")
        prompts.append(ids)
        out_lens.append(out_len)
    return Workload(prompts, out_lens, f"{len(prompts)} prompts from {path.name}")


# --- jaxllm runs ------------------------------------------------------------------------------


def _sampling_params(out_len: int, ignore_eos: bool):
    from jaxllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=ignore_eos)


def _warm_up(llm, sampler: TokenSampler) -> None:
    """One short request, so first-call costs do not land in the measurement."""
    rng = np.random.default_rng(12345)
    llm.generate([{"prompt_token_ids": sampler.sample(rng, 4)}], _sampling_params(2, True),
                 use_tqdm=False)


def throughput_metrics(elapsed: float, prompt_tokens: int, output_tokens: int,
                       num_requests: int) -> dict[str, float]:
    elapsed = max(elapsed, 1e-9)
    return {"elapsed_time": elapsed, "num_requests": num_requests,
            "total_prompt_tokens": prompt_tokens, "total_output_tokens": output_tokens,
            "total_num_tokens": prompt_tokens + output_tokens,
            "requests_per_second": num_requests / elapsed,
            "output_tokens_per_second": output_tokens / elapsed,
            "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            # vLLM's name for the total rate
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed}


def run_jaxllm_throughput(llm, workload: Workload, ignore_eos: bool,
                          use_tqdm: bool = True) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [_sampling_params(n, ignore_eos) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return throughput_metrics(elapsed, sum(workload.prompt_lens), out_tokens, len(workload))


def _stats(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, np.float64)
    return {f"{prefix}_mean": float(arr.mean()), f"{prefix}_p50": float(np.percentile(arr, 50)),
            f"{prefix}_p99": float(np.percentile(arr, 99))}


def latency_metrics(latencies: list[float], ttfts: list[float], tpots: list[float],
                    output_tokens: int) -> dict[str, Any]:
    out = {"avg_latency": float(np.mean(latencies)), "latencies": [float(x) for x in latencies],
           **_stats(latencies, "latency"), **_stats(ttfts, "ttft"), **_stats(tpots, "tpot")}
    out["output_tokens_per_second"] = output_tokens / max(sum(latencies), 1e-9)
    return out


def run_jaxllm_latency(llm, sampler: TokenSampler, batch_size: int, input_len: int,
                       output_len: int, num_iters: int, num_iters_warmup: int, seed: int,
                       use_tqdm: bool = True) -> dict[str, Any]:
    """Each iteration sends a fresh batch (so the prefix cache cannot skip prefills)."""
    rng = np.random.default_rng(seed)
    sp = _sampling_params(output_len, True)

    def batch():
        return [{"prompt_token_ids": sampler.sample(rng, input_len)} for _ in range(batch_size)]

    for _ in tqdm(range(num_iters_warmup), desc="Warm-up iterations", disable=not use_tqdm):
        llm.generate(batch(), sp, use_tqdm=False)
    # Only measured iterations count toward the run's step shapes (the matmul floor).
    llm.llm_engine.engine_core.runner.step_shape_counts.clear()
    latencies, ttfts, tpots = [], [], []
    out_tokens = 0
    for _ in tqdm(range(num_iters), desc="Measured iterations", disable=not use_tqdm):
        prompts = batch()
        start = time.perf_counter()
        outputs = llm.generate(prompts, sp, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
        for o in outputs:
            m = o.metrics
            n = len(o.outputs[0].token_ids)
            out_tokens += n
            if m is None or m.first_token_time is None:
                continue
            ttfts.append(m.first_token_time - m.arrival_time)
            if n > 1 and m.finished_time is not None:
                tpots.append((m.finished_time - m.first_token_time) / (n - 1))
    return latency_metrics(latencies, ttfts, tpots, out_tokens)


# --- matmul floor ----------------------------------------------------------------------------


def decoder_matmuls(params: dict, config, x):
    """The decoder layers with everything but their weight matmuls removed: per layer qkv, o,
    gate_up and down, with the SiLU gate and residual adds that chain them as in the model.
    `params` needs only `layers_{i}` in the model's naming; `config` only the sizes used."""
    import jax

    from jaxllm.model_executor.models.qwen2 import linear

    q_width = config.num_attention_heads * config.head_dim
    inter = config.intermediate_size
    for i in range(config.num_hidden_layers):
        attn, mlp = params[f"layers_{i}"]["self_attn"], params[f"layers_{i}"]["mlp"]
        qkv = linear(x, attn["qkv_proj"]["weight"])
        x = x + linear(qkv[:, :q_width], attn["o_proj"]["weight"])
        gate_up = linear(x, mlp["gate_up_proj"]["weight"])
        x = x + linear(jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:],
                       mlp["down_proj"]["weight"])
    return x


def weight_matmuls(params: dict, config, x, logits_rows: int):
    """`decoder_matmuls`, then the LM head on the first `logits_rows` rows, as the engine's
    step runs it: the model's forward pass with nothing but its weight matmuls."""
    from jaxllm.model_executor.models.qwen2 import compute_logits

    return compute_logits(params, config, decoder_matmuls(params, config, x)[:logits_rows])


def matmul_floor(llm, step_shape_counts: dict[tuple[int, int], int],
                 reps: int = 3) -> dict[str, Any]:
    """Seconds the steps in `step_shape_counts` ((num_tokens, max_query_len) -> steps, as
    the runner counts them) take through `weight_matmuls` alone: best of `reps` per shape."""
    import jax
    import jax.numpy as jnp

    runner = llm.llm_engine.engine_core.runner
    config, params = runner.config, runner.params
    step_s: dict[int, float] = {}
    shapes = []
    total = 0.0
    for (num_tokens, max_query_len), steps in sorted(step_shape_counts.items()):
        if num_tokens not in step_s:
            rows = min(num_tokens, runner.max_num_seqs)
            fn = jax.jit(lambda p, x, _rows=rows: weight_matmuls(p, config, x, _rows))
            x = jnp.full((num_tokens, config.hidden_size), 0.01, runner.dtype)
            step_s[num_tokens] = best_seconds(
                lambda _fn=fn, _x=x: _fn(params, _x).block_until_ready(), reps)
        shapes.append({"num_tokens": num_tokens, "max_query_len": max_query_len,
                       "steps": steps, "matmul_s_per_step": step_s[num_tokens]})
        total += steps * step_s[num_tokens]
    return {"matmul_floor_s": total, "steps": sum(step_shape_counts.values()),
            "shapes": shapes}


def print_matmul_floor(floor: dict[str, Any], elapsed: float, what: str) -> None:
    shapes = ", ".join(f"{s['steps']} x {s['num_tokens']}"
                       + ("" if s["max_query_len"] == 1 else " mixed")
                       + f" at {_fmt_s(s['matmul_s_per_step'])}" for s in floor["shapes"])
    rest = elapsed - floor["matmul_floor_s"]
    tail = (f"attention, norms, RoPE, KV writes, sampling and host took the other {_fmt_s(rest)}"
            if rest > 0 else "above the run itself: the machine was slower while the floor was "
            "timed (after the run) than during it; it drifts, rerun to split the time")
    print(f"Matmul floor: {what}, {floor['steps']} steps ({shapes}), through nothing but the "
          f"weight matmuls on XLA: {_fmt_s(floor['matmul_floor_s'])} = "
          f"{floor['matmul_floor_s'] / max(elapsed, 1e-12) * 100:.1f}% of {_fmt_s(elapsed)}; "
          + tail)


# --- Hugging Face transformers baseline ------------------------------------------------------


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
        out = throughput_metrics(elapsed, sum(workload.prompt_lens), useful, len(workload))
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


# --- roofline ---------------------------------------------------------------------------------


def best_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Fastest of `reps` timed calls of `fn` after one untimed warm-up call."""
    fn()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_gemm(n: int = 2048, reps: int = 3, dtype: str = "float32") -> dict[str, float]:
    """Best-of-`reps` rate of an n x n x n GEMM: XLA (jitted jnp.dot on the default device, in
    `dtype`) and numpy (float32, host)."""
    import jax
    import jax.numpy as jnp

    flops = 2.0 * n ** 3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    dot = jax.jit(jnp.dot)
    xa, xb = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    best_xla = best_seconds(lambda: dot(xa, xb).block_until_ready(), reps)
    best_np = best_seconds(lambda: a @ b, reps)
    xla, numpy_rate = flops / best_xla, flops / best_np
    return {"gemm_size": n, "xla_flops_per_s": xla, "numpy_flops_per_s": numpy_rate,
            "gemm_flops_per_s": max(xla, numpy_rate)}


def measure_bandwidth(mib: int = 256, reps: int = 5) -> dict[str, float]:
    """Best-of-`reps` streaming bandwidth over `mib` MiB: numpy's copyto into a second array
    (host) and a jitted XLA scale of an array donated to it, so it runs in place (default
    device; a fresh output buffer each call would time page faults), both counting read + write
    bytes; and an XLA GEMV reading a `mib` MiB matrix (read bytes only). The bandwidth used for
    bounds is the best of the three."""
    import jax
    import jax.numpy as jnp

    from jaxllm.model_executor.models.qwen2 import linear

    n = max(1, mib * (1 << 20) // 4)
    moved = 2.0 * n * 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    best_np = best_seconds(lambda d=dst, s=src: np.copyto(d, s), reps)
    del dst
    scale = jax.jit(lambda x: x * 0.5, donate_argnums=0)
    held = {"x": jnp.asarray(src)}  # each call donates the previous result
    del src

    def scale_in_place() -> None:
        held["x"] = scale(held["x"]).block_until_ready()

    best_xla = best_seconds(scale_in_place, reps)
    held.clear()
    # Decode streams weights without writing anything back: time that pattern too, as a GEMV
    # over a [rows, 1024] matrix kept [out, in] like the model's weights.
    w = jnp.ones((max(1, n // 1024), 1024), jnp.float32)
    vec = jnp.ones((1, 1024), jnp.float32)
    gemv = jax.jit(linear)
    best_gemv = best_seconds(lambda m=w: gemv(vec, m).block_until_ready(), reps)
    read_rate = w.size * 4 / best_gemv
    del w
    xla, numpy_rate = moved / best_xla, moved / best_np
    return {"copy_mib": mib, "xla_bytes_per_s": xla, "numpy_bytes_per_s": numpy_rate,
            "gemv_read_bytes_per_s": read_rate,
            "bandwidth_bytes_per_s": max(xla, numpy_rate, read_rate)}


def measure_machine(gemm_size: int = 2048, copy_mib: int = 256,
                    dtype: str = "float32") -> dict[str, float]:
    return {**measure_gemm(gemm_size, dtype=dtype), **measure_bandwidth(copy_mib)}


@dataclass
class ModelCost:
    """What one token costs a Qwen2 model, from its config and loaded weights."""

    body_params: int  # decoder layers + final norm (every processed token goes through them)
    head_params: int  # LM head (only rows that sample)
    itemsize: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_llm(cls, llm) -> ModelCost:
        import jax

        runner = llm.llm_engine.engine_core.runner
        cfg = runner.config
        body = sum(int(x.size) for k, v in runner.params.items()
                   if k not in ("embed_tokens", "lm_head") for x in jax.tree.leaves(v))
        head = cfg.vocab_size * cfg.hidden_size
        itemsize = int(np.dtype(runner.params["norm"]["weight"].dtype).itemsize)
        return cls(body, head, itemsize, cfg.num_hidden_layers, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim)

    @property
    def weight_bytes(self) -> int:
        """Bytes a step must read at least: every weight but the embedding table (a lookup)."""
        return (self.body_params + self.head_params) * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


def _tri(a: int, b: int) -> int:
    """sum of (p + 1) for p in [a, b)."""
    return (b * (b + 1) - a * (a + 1)) // 2 if b > a else 0


def workload_cost(cost: ModelCost, prompt_lens: list[int], output_lens: list[int],
                  max_num_seqs: int, max_num_batched_tokens: int) -> dict[str, float]:
    """Useful FLOPs and the bytes any engine with these limits must move."""
    processed = sampled = attn_ctx = kv_read_tokens = 0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        n = p + o - 1  # the last generated token is never fed back
        processed += n
        sampled += o
        attn_ctx += _tri(0, n)  # token at position q attends to q + 1 positions
        kv_read_tokens += _tri(p, n)  # decode steps re-read the cached context
    matmul = 2.0 * cost.body_params * processed + 2.0 * cost.head_params * sampled
    attn = 4.0 * cost.num_layers * cost.num_heads * cost.head_dim * attn_ctx
    # Every request needs o steps (its prefill's last chunk, then o - 1 decodes); a step holds
    # at most max_num_seqs sequences and max_num_batched_tokens tokens.
    steps = max(max(output_lens), math.ceil(sum(output_lens) / max_num_seqs),
                math.ceil(processed / max_num_batched_tokens))
    weight_bytes = float(steps) * cost.weight_bytes
    kv_bytes = float(kv_read_tokens) * cost.kv_bytes_per_token
    return {"processed_tokens": processed, "sampled_tokens": sampled, "matmul_flops": matmul,
            "attention_flops": attn, "flops": matmul + attn, "min_steps": steps,
            "weight_bytes_per_step": cost.weight_bytes, "weight_bytes": weight_bytes,
            "kv_read_bytes": kv_bytes, "bytes": weight_bytes + kv_bytes}


def roofline(machine: dict[str, float], work: dict[str, float],
             measured: dict[str, float]) -> dict[str, Any]:
    """`measured` maps a name ("jaxllm", "hf") to its elapsed seconds for this workload."""
    t_compute = work["flops"] / machine["gemm_flops_per_s"]
    t_memory = work["bytes"] / machine["bandwidth_bytes_per_s"]
    ideal = max(t_compute, t_memory)
    out = {**machine, **work, "ideal_compute_s": t_compute, "ideal_memory_s": t_memory,
           "ideal_time_s": ideal, "bound": "compute" if t_compute >= t_memory else "memory",
           "batch1_decode_bound_tok_per_s":
               machine["bandwidth_bytes_per_s"] / work["weight_bytes_per_step"]}
    for name, elapsed in measured.items():
        out[f"{name}_elapsed_s"] = elapsed
        out[f"{name}_fraction"] = ideal / max(elapsed, 1e-12)
    return out


ROOFLINE_ASSUMPTIONS = (
    "roofline assumes: FLOPs = 2 x (decoder + final-norm params) x processed tokens "
    "(prompt + output - 1 per request) + 2 x LM-head params x output tokens + 4 x layers x heads "
    "x head_dim x attended context, summed over processed tokens; bytes = the fewest steps any "
    "engine with this max_num_seqs / max_num_batched_tokens needs x all weights but the "
    "embedding table, + the K/V context re-read by every decode token; ideal time = max(FLOPs / "
    "best measured GEMM rate, bytes / best measured bandwidth); "
    "fraction = ideal / measured elapsed.")


def _fmt_rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.1f} {prefix}{unit}"
    return f"{x:.1f} {unit}"


def _fmt_s(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3f} ms"


def print_roofline(r: dict[str, Any]) -> None:
    print(f"Machine: GEMM {_fmt_rate(r['gemm_flops_per_s'], 'FLOP/s')} "
          f"(XLA {_fmt_rate(r['xla_flops_per_s'], 'FLOP/s')}, "
          f"numpy {_fmt_rate(r['numpy_flops_per_s'], 'FLOP/s')}, {r['gemm_size']}^3), "
          f"bandwidth {_fmt_rate(r['bandwidth_bytes_per_s'], 'B/s')} "
          f"(XLA in-place scale {_fmt_rate(r['xla_bytes_per_s'], 'B/s')}, "
          f"numpy copy {_fmt_rate(r['numpy_bytes_per_s'], 'B/s')}, "
          f"XLA GEMV read {_fmt_rate(r['gemv_read_bytes_per_s'], 'B/s')}, {r['copy_mib']} MiB)")
    print(f"Workload: {r['flops'] / 1e9:.3f} GFLOP (attention "
          f"{r['attention_flops'] / 1e9:.3f}), {r['bytes'] / 1e9:.3f} GB ({r['min_steps']} steps x "
          f"{r['weight_bytes_per_step'] / 1e6:.1f} MB weights + "
          f"{r['kv_read_bytes'] / 1e9:.3f} GB KV reads); ideal {_fmt_s(r['ideal_time_s'])} "
          f"({r['bound']}-bound: compute {_fmt_s(r['ideal_compute_s'])}, "
          f"memory {_fmt_s(r['ideal_memory_s'])})")
    parts = [f"{name} {r[f'{name}_fraction'] * 100:.1f}% of ideal "
             f"({_fmt_s(r[f'{name}_elapsed_s'])})"
             for name in ("jaxllm", "hf") if f"{name}_fraction" in r]
    print("Roofline: " + ", ".join(parts)
          + f"; batch-1 decode bound {r['batch1_decode_bound_tok_per_s']:.1f} tok/s")
    print(textwrap.fill(f"({ROOFLINE_ASSUMPTIONS})", width=100))


# --- step profile -----------------------------------------------------------------------------

PROFILE_PHASES = ("schedule", "prepare_inputs", "device_step", "logits_transfer", "sampling",
                  "update", "detokenize", "other")


@dataclass
class _StepRecord:
    wall_s: float
    parts: dict[str, float] = field(default_factory=dict)


def profile_steps(llm, sampler: TokenSampler, batch_sizes: list[int], input_len: int,
                  num_steps: int, seed: int = 0, warmup_steps: int = 2,
                  use_tqdm: bool = True) -> list[dict[str, Any]]:
    """Host time per engine step in decode steady state (every request of the batch decoding,
    none prefilling), split by phase; mean over `num_steps` such steps after `warmup_steps`.
    "detokenize" is the output processor (incremental detokenizing, RequestOutputs); "update"
    is the scheduler's update_from_output; "other" is the step's wall time minus the rest."""
    engine = llm.llm_engine
    args = engine.engine_args
    rng = np.random.default_rng(seed)
    results = []
    for bs in batch_sizes:
        if bs > args.max_num_seqs or bs > args.max_num_batched_tokens:
            results.append({"batch_size": bs, "skipped":
                            f"batch {bs} exceeds max_num_seqs {args.max_num_seqs} or "
                            f"max_num_batched_tokens {args.max_num_batched_tokens}"})
            continue
        # Decode until enough steady steps are seen, then abort (the batch's prefills may take
        # any number of steps, mixed with the first requests' decodes).
        room = engine.max_model_len - input_len
        if room < 1 + warmup_steps + num_steps:
            raise ValueError(f"--profile-input-len {input_len} leaves {room} tokens of "
                             f"max_model_len {engine.max_model_len}; need "
                             f"{1 + warmup_steps + num_steps}")
        sp = _sampling_params(room, True)
        ids = [f"profile-{bs}-{i}-{time.monotonic_ns()}" for i in range(bs)]
        for rid in ids:
            engine.add_request(rid, {"prompt_token_ids": sampler.sample(rng, input_len)}, sp)
        detok = [0.0]
        processor = engine.output_processor
        original = processor.process_outputs

        def timed(outputs, _orig=original, _acc=detok):
            t = time.perf_counter()
            try:
                return _orig(outputs)
            finally:
                _acc[0] += time.perf_counter() - t

        processor.process_outputs = timed
        steady: list[_StepRecord] = []
        bar = tqdm(desc=f"profile batch {bs}", unit="step", disable=not use_tqdm)
        want = warmup_steps + num_steps
        try:
            while engine.has_unfinished_requests() and len(steady) < want:
                detok[0] = 0.0
                t = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t
                bar.update(1)
                st = engine.last_step_stats
                if st.num_prefill_tokens or st.num_decode_tokens != bs:
                    continue
                parts = {"schedule": st.schedule_s, "prepare_inputs": st.runner.prepare_s,
                         "device_step": st.runner.device_s,
                         "logits_transfer": st.runner.transfer_s, "sampling": st.sample_s,
                         "update": st.update_s, "detokenize": detok[0]}
                parts["other"] = max(0.0, wall - sum(parts.values()))
                steady.append(_StepRecord(wall, parts))
        finally:
            engine.abort_request(ids)
            bar.close()
            del processor.process_outputs  # back to the class's method
        steady = steady[warmup_steps:]
        if not steady:
            results.append({"batch_size": bs, "skipped": "no steady-state decode step"})
            continue
        step_ms = 1e3 * float(np.mean([s.wall_s for s in steady]))
        phases = {}
        for name in PROFILE_PHASES:
            ms = 1e3 * float(np.mean([s.parts[name] for s in steady]))
            phases[name] = {"ms": ms, "percent": 100.0 * ms / max(step_ms, 1e-12)}
        host_ms = step_ms - phases["device_step"]["ms"]
        results.append({"batch_size": bs, "input_len": input_len, "steps": len(steady),
                        "step_ms": step_ms, "host_ms": host_ms,
                        "host_percent": 100.0 * host_ms / max(step_ms, 1e-12),
                        "decode_tokens_per_second": bs * 1e3 / max(step_ms, 1e-12),
                        "phases": phases})
    return results


def print_profile(results: list[dict[str, Any]]) -> None:
    done = [r for r in results if "phases" in r]
    for r in results:
        if "skipped" in r:
            print(f"profile batch {r['batch_size']}: skipped ({r['skipped']})")
    if not done:
        return
    print("Step profile: host time per decode step (every request decoding), mean ms and % "
          "of the step")
    head = f"{'phase':<16}" + "".join(f"{'batch ' + str(r['batch_size']):>20}" for r in done)
    print(head)
    for name in PROFILE_PHASES:
        print(f"{name:<16}" + "".join(
            f"{r['phases'][name]['ms']:>11.2f} ms {r['phases'][name]['percent']:>5.1f}%"
            for r in done))
    print(f"{'step':<16}" + "".join(f"{r['step_ms']:>11.2f} ms {100.0:>5.1f}%" for r in done))
    print(f"{'host (non-dev)':<16}" + "".join(
        f"{r['host_ms']:>11.2f} ms {r['host_percent']:>5.1f}%" for r in done))
    print(f"{'decode tok/s':<16}" + "".join(
        f"{r['decode_tokens_per_second']:>20.1f}" for r in done))


# --- commands ---------------------------------------------------------------------------------


def _make_llm(args: argparse.Namespace, max_num_seqs: int):
    from jaxllm import LLM

    kw: dict[str, Any] = dict(kernel_backend=args.kernel_backend, seed=args.seed,
                              max_model_len=args.max_model_len, max_num_seqs=max_num_seqs,
                              skip_tokenizer_init=args.skip_tokenizer_init,
                              show_progress=not args.no_progress)
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_kv_blocks is not None:
        kw["num_kv_blocks"] = args.num_kv_blocks
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    return LLM(model=args.model, dtype=args.dtype, **kw)


def _check_fits(llm, workload: Workload) -> None:
    longest = max(p + o for p, o in zip(workload.prompt_lens, workload.output_lens, strict=True))
    limit = llm.llm_engine.max_model_len
    if longest > limit:
        raise ValueError(f"a request needs {longest} tokens (prompt + output) but max_model_len "
                         f"is {limit}; raise --max-model-len")


def _machine(args: argparse.Namespace, llm) -> dict[str, float] | None:
    if args.no_roofline:
        return None
    return measure_machine(args.roofline_gemm_size, args.roofline_copy_mib,
                           dtype=llm.llm_engine.describe()["dtype"])


def _hf_runner(args: argparse.Namespace, llm) -> HFRunner:
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its GGUF conversion and weight-loading bars
    return HFRunner(args.model, llm.llm_engine.describe()["dtype"])


def _profile_max_seqs(args: argparse.Namespace, need: int) -> int:
    if args.max_num_seqs is not None:
        return args.max_num_seqs
    if getattr(args, "profile", False):
        need = max(need, *args.profile_batch_sizes)
    return need


def _finish(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"results written to {path}")


def _args_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("func",)}


def cmd_throughput(args: argparse.Namespace) -> int:
    if args.dataset is None and args.num_prompts is None:
        args.num_prompts = 64
    count = args.num_prompts
    if args.dataset is not None:
        count = len(read_records(args.dataset))
        count = min(count, args.num_prompts or count)
    need_seqs = min(count, 256)
    llm = _make_llm(args, _profile_max_seqs(args, need_seqs))
    engine = llm.llm_engine
    sampler = token_sampler_for(llm)
    if args.dataset is not None:
        workload = load_dataset(args.dataset, engine.tokenizer, args.output_len, args.num_prompts)
    else:
        workload = synthetic_workload(sampler, args.num_prompts, args.input_len, args.output_len,
                                      args.seed, args.random_input_range,
                                      args.random_output_range)
    _check_fits(llm, workload)
    result: dict[str, Any] = {"command": "throughput", "engine": engine.describe(),
                              "workload": workload.summary(), "args": _args_dict(args)}
    print(f"Workload: {workload.description} ({sum(workload.prompt_lens)} prompt, "
          f"{sum(workload.output_lens)} output tokens), ignore_eos={args.ignore_eos}")
    _warm_up(llm, sampler)
    engine.engine_core.runner.step_shape_counts.clear()
    ours = run_jaxllm_throughput(llm, workload, args.ignore_eos, use_tqdm=not args.no_progress)
    step_shapes = dict(engine.engine_core.runner.step_shape_counts)
    result.update(ours)
    print(f"Throughput: {ours['requests_per_second']:.2f} requests/s, "
          f"{ours['total_tokens_per_second']:.1f} total tokens/s, "
          f"{ours['output_tokens_per_second']:.1f} output tokens/s "
          f"({ours['num_requests']} requests, {ours['total_prompt_tokens']} prompt + "
          f"{ours['total_output_tokens']} output tokens in {ours['elapsed_time']:.2f} s)")
    measured = {"jaxllm": ours["elapsed_time"]}
    if args.compare_hf:
        hf = _hf_runner(args, llm).throughput(workload, args.hf_batch_size, args.ignore_eos,
                                              use_tqdm=not args.no_progress)
        hf["speedup"] = ours["output_tokens_per_second"] / hf["output_tokens_per_second"]
        result["hf"] = hf
        result["speedup_vs_hf"] = hf["speedup"]
        measured["hf"] = hf["elapsed_time"]
        print(f"HF transformers (batch {hf['batch_size']}, {hf['dtype']}, {hf['device']}): "
              f"{hf['requests_per_second']:.2f} requests/s, "
              f"{hf['total_tokens_per_second']:.1f} total tokens/s, "
              f"{hf['output_tokens_per_second']:.1f} output tokens/s in "
              f"{hf['elapsed_time']:.2f} s -> jaxllm / HF output tok/s = {hf['speedup']:.2f}x")
    machine = _machine(args, llm)
    if machine is not None:
        work = workload_cost(ModelCost.from_llm(llm), workload.prompt_lens,
                             workload.output_lens, engine.engine_args.max_num_seqs,
                             engine.engine_args.max_num_batched_tokens)
        result["roofline"] = roofline(machine, work, measured)
        print_roofline(result["roofline"])
        result["matmul_floor"] = matmul_floor(llm, step_shapes)
        print_matmul_floor(result["matmul_floor"], ours["elapsed_time"], "the run")
    _maybe_profile(args, llm, sampler, result)
    _finish(args, result)
    return 0


def _maybe_profile(args: argparse.Namespace, llm, sampler: TokenSampler,
                   result: dict[str, Any]) -> None:
    if not args.profile:
        return
    prof = profile_steps(llm, sampler, args.profile_batch_sizes, args.profile_input_len,
                         args.profile_steps, seed=args.seed + 1, use_tqdm=not args.no_progress)
    result["profile"] = prof
    print_profile(prof)


def cmd_latency(args: argparse.Namespace) -> int:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    llm = _make_llm(args, _profile_max_seqs(args, args.batch_size))
    engine = llm.llm_engine
    if args.batch_size > engine.engine_args.max_num_seqs:
        print(f"warning: --batch-size {args.batch_size} > max_num_seqs "
              f"{engine.engine_args.max_num_seqs}: requests queue", file=sys.stderr)
    sampler = token_sampler_for(llm)
    workload = Workload([[0] * args.input_len] * args.batch_size,
                        [args.output_len] * args.batch_size,
                        f"batch {args.batch_size}, input {args.input_len}, "
                        f"output {args.output_len}")
    _check_fits(llm, workload)
    result: dict[str, Any] = {"command": "latency", "engine": engine.describe(),
                              "workload": workload.summary(), "args": _args_dict(args)}
    print(f"Workload: {workload.description}, {args.num_iters} iterations "
          f"(+{args.num_iters_warmup} warm-up), ignore_eos=True")
    _warm_up(llm, sampler)
    ours = run_jaxllm_latency(llm, sampler, args.batch_size, args.input_len, args.output_len,
                              args.num_iters, args.num_iters_warmup, args.seed,
                              use_tqdm=not args.no_progress)
    result.update(ours)
    _print_latency("jaxllm", ours)
    measured = {"jaxllm": ours["latency_mean"]}
    if args.compare_hf:
        hf = _hf_runner(args, llm).latency(sampler, args.batch_size, args.input_len,
                                           args.output_len, args.num_iters,
                                           args.num_iters_warmup, args.seed,
                                           use_tqdm=not args.no_progress)
        hf["speedup"] = hf["latency_mean"] / ours["latency_mean"]
        result["hf"] = hf
        result["speedup_vs_hf"] = hf["speedup"]
        measured["hf"] = hf["latency_mean"]
        _print_latency(f"HF transformers ({hf['dtype']}, {hf['device']})", hf)
        print(f"HF / jaxllm mean latency = {hf['speedup']:.2f}x")
    machine = _machine(args, llm)
    if machine is not None:
        work = workload_cost(ModelCost.from_llm(llm), workload.prompt_lens, workload.output_lens,
                             args.batch_size, engine.engine_args.max_num_batched_tokens)
        result["roofline"] = roofline(machine, work, measured)
        print_roofline(result["roofline"])
        floor = matmul_floor(llm, engine.engine_core.runner.step_shape_counts)
        result["matmul_floor"] = floor
        print_matmul_floor(floor, sum(ours["latencies"]),
                           f"the {args.num_iters} measured iterations")
        result["decode"] = decode_vs_bound(floor, result["roofline"], ours.get("tpot_mean"),
                                           result.get("hf", {}).get("tpot_mean"))
        print_decode_vs_bound(result["decode"])
    _maybe_profile(args, llm, sampler, result)
    _finish(args, result)
    return 0


def decode_vs_bound(floor: dict[str, Any], roof: dict[str, Any], tpot: float | None,
                    hf_tpot: float | None) -> dict[str, Any]:
    """A decode step against the memory bound (all weights read once at the measured
    bandwidth): the measured TPOT, and the decode shape's matmul floor, i.e. the best any XLA
    step of weight matmuls could do at this moment."""
    bound_s = roof["weight_bytes_per_step"] / roof["bandwidth_bytes_per_s"]
    decode = [s for s in floor["shapes"] if s["max_query_len"] == 1]
    out: dict[str, Any] = {"bound_s_per_token": bound_s}
    if decode:
        step = max(decode, key=lambda s: s["steps"])
        out["matmul_floor_s_per_step"] = step["matmul_s_per_step"]
        out["matmul_floor_fraction"] = bound_s / step["matmul_s_per_step"]
    for name, value in (("jaxllm", tpot), ("hf", hf_tpot)):
        if value:
            out[f"{name}_tpot_s"] = value
            out[f"{name}_fraction"] = bound_s / value
    return out


def print_decode_vs_bound(d: dict[str, Any]) -> None:
    parts = [f"{name} TPOT {d[f'{name}_tpot_s'] * 1e3:.1f} ms = {d[f'{name}_fraction'] * 100:.1f}%"
             for name in ("jaxllm", "hf") if f"{name}_tpot_s" in d]
    if "matmul_floor_s_per_step" in d:
        parts.append(f"the decode step's weight matmuls alone "
                     f"{d['matmul_floor_s_per_step'] * 1e3:.1f} ms = "
                     f"{d['matmul_floor_fraction'] * 100:.1f}%")
    print(f"Decode vs the memory bound ({d['bound_s_per_token'] * 1e3:.1f} ms per step: weights / "
          f"bandwidth): " + "; ".join(parts))


def _print_latency(name: str, m: dict[str, Any]) -> None:
    print(f"{name}: latency mean {m['latency_mean']:.3f} s, p50 {m['latency_p50']:.3f} s, "
          f"p99 {m['latency_p99']:.3f} s; TTFT mean {m['ttft_mean'] * 1e3:.1f} ms, "
          f"p50 {m['ttft_p50'] * 1e3:.1f} ms, p99 {m['ttft_p99'] * 1e3:.1f} ms; "
          f"TPOT mean {m.get('tpot_mean', float('nan')) * 1e3:.1f} ms, "
          f"p50 {m.get('tpot_p50', float('nan')) * 1e3:.1f} ms, "
          f"p99 {m.get('tpot_p99', float('nan')) * 1e3:.1f} ms; "
          f"{m['output_tokens_per_second']:.1f} output tok/s")


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.output_png and importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("--output-png needs matplotlib (pip install matplotlib)")
    sizes = sorted(set(args.batch_sizes))
    llm = _make_llm(args, args.max_num_seqs or max(sizes))
    engine = llm.llm_engine
    sampler = token_sampler_for(llm)
    machine = _machine(args, llm)
    cost = ModelCost.from_llm(llm)
    hf_runner = _hf_runner(args, llm) if args.compare_hf else None
    _warm_up(llm, sampler)
    rows = []
    for bs in sizes:
        workload = synthetic_workload(sampler, bs, args.input_len, args.output_len,
                                      args.seed + bs)
        _check_fits(llm, workload)
        ours = run_jaxllm_throughput(llm, workload, True, use_tqdm=not args.no_progress)
        row: dict[str, Any] = {"batch_size": bs, "jaxllm": ours}
        measured = {"jaxllm": ours["elapsed_time"]}
        if hf_runner is not None:
            row["hf"] = hf_runner.throughput(workload, bs, True, use_tqdm=not args.no_progress)
            measured["hf"] = row["hf"]["elapsed_time"]
        if machine is not None:
            work = workload_cost(cost, workload.prompt_lens, workload.output_lens,
                                 min(bs, engine.engine_args.max_num_seqs),
                                 engine.engine_args.max_num_batched_tokens)
            row["roofline"] = roofline(machine, work, measured)
            row["roofline_output_tokens_per_second"] = (
                sum(workload.output_lens) / row["roofline"]["ideal_time_s"])
        rows.append(row)
        line = f"batch {bs}: jaxllm {ours['output_tokens_per_second']:.1f} output tok/s"
        if "hf" in row:
            line += f", HF {row['hf']['output_tokens_per_second']:.1f}"
        if "roofline" in row:
            line += (f", roofline {row['roofline_output_tokens_per_second']:.1f} "
                     f"({row['roofline']['jaxllm_fraction'] * 100:.1f}% reached)")
        print(line)
    result = {"command": "sweep", "engine": engine.describe(), "args": _args_dict(args),
              "machine": machine, "rows": rows}
    if args.output_png:
        plot_sweep(rows, args.output_png,
                   f"{Path(engine.model_name).name}, {engine.describe()['dtype']}, "
                   f"input {args.input_len} / "
                   f"output {args.output_len}")
        print(f"plot written to {args.output_png}")
    _finish(args, result)
    return 0


def plot_sweep(rows: list[dict[str, Any]], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["jaxllm"]["output_tokens_per_second"] for r in rows], "o-", label="jaxllm")
    if all("hf" in r for r in rows):
        ax.plot(xs, [r["hf"]["output_tokens_per_second"] for r in rows], "s-",
                label="HF transformers")
    if all("roofline" in r for r in rows):
        ax.plot(xs, [r["roofline_output_tokens_per_second"] for r in rows], "k--",
                label="roofline (ideal)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- argument parsing -------------------------------------------------------------------------


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default unless its help already speaks of it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.option_strings \
                and all(action.default is not x for x in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def _add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or .gguf file (default: the embedded model)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on GPU")
    g.add_argument("--kernel-backend", default=None, choices=["pallas", "interpret", "reference"],
                   help="default: pallas on GPU, reference on CPU")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: what the workload runs at once (throughput: the number of "
                        "prompts, at most 256; latency: the batch size; sweep: the largest "
                        "batch), raised to the largest --profile-batch-sizes with --profile")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: the engine's, 512)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="default: from the memory budget (1 GiB on CPU)")
    g.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                   help="longest prompt + output")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="turn the prefix cache off")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: token-id prompts only, no detokenizing")
    g.add_argument("--seed", type=int, default=0, help="seeds the engine and the synthetic prompts")
    r = p.add_argument_group("baselines")
    r.add_argument("--compare-hf", action="store_true",
                   help="run the same workload through HF transformers' generate")
    r.add_argument("--no-roofline", action="store_true",
                   help="skip the machine measurement and the roofline")
    r.add_argument("--roofline-gemm-size", type=int, default=2048,
                   help="n of the n x n x n GEMM timed for the peak FLOP rate")
    r.add_argument("--roofline-copy-mib", type=int, default=256,
                   help="array size (MiB) copied for the bandwidth")
    p.add_argument("--output-json", default=None, help="write all results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_length_args(p: argparse.ArgumentParser, input_len: int,
                     output_help: str = "generated tokens per request (EOS ignored)") -> None:
    p.add_argument("--input-len", type=int, default=input_len, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help=output_help)


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("step profile")
    g.add_argument("--profile", action="store_true",
                   help="after the benchmark, split host time per decode step by phase")
    g.add_argument("--profile-batch-sizes", type=int, nargs="+", default=[1, 64, 256],
                   help="concurrent requests per profiled decode step")
    g.add_argument("--profile-input-len", type=int, default=128,
                   help="prompt tokens of each profiled request")
    g.add_argument("--profile-steps", type=int, default=8,
                   help="steady-state decode steps averaged per batch size")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="throughput / latency benchmarks",
                                  description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = sub.add_parser("throughput", help="offline throughput of N requests",
                        formatter_class=_HelpFormatter)
    tp.add_argument("--num-prompts", type=int, default=None,
                    help="default 64 (synthetic) or every record (--dataset)")
    _add_length_args(tp, 128, "also the default for dataset records without output_len")
    tp.add_argument("--random-input-range", type=int, nargs=2, metavar=("A", "B"), default=None,
                    help="input lengths uniform in [A, B] (seeded)")
    tp.add_argument("--random-output-range", type=int, nargs=2, metavar=("A", "B"),
                    default=None, help="output lengths uniform in [A, B] (seeded)")
    tp.add_argument("--dataset", default=None,
                    help='JSON / JSONL records: "prompt" or "prompt_token_ids", '
                         'optional "output_len"')
    tp.add_argument("--ignore-eos", action="store_true",
                    help="generate every request's full output length")
    tp.add_argument("--hf-batch-size", type=int, default=16,
                    help="prompts per HF generate call (--compare-hf)")
    _add_common_args(tp)
    _add_profile_args(tp)
    tp.set_defaults(func=cmd_throughput)

    lat = sub.add_parser("latency", help="end-to-end latency of one batch",
                         formatter_class=_HelpFormatter)
    lat.add_argument("--batch-size", type=int, default=8, help="requests sent together")
    _add_length_args(lat, 32)
    lat.add_argument("--num-iters", type=int, default=10, help="measured iterations")
    lat.add_argument("--num-iters-warmup", type=int, default=2,
                     help="unmeasured iterations first")
    _add_common_args(lat)
    _add_profile_args(lat)
    lat.set_defaults(func=cmd_latency)

    sw = sub.add_parser("sweep", help="output tok/s vs batch size (+ HF, roofline), as a plot",
                        formatter_class=_HelpFormatter)
    sw.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64],
                    help="concurrent requests per point (that many prompts each)")
    _add_length_args(sw, 128)
    sw.add_argument("--output-png", default=None, help="plot here (needs matplotlib)")
    _add_common_args(sw)
    sw.set_defaults(func=cmd_sweep)
    return bench
