"""`jaxllm bench serve` (vLLM's `vllm bench serve`): requests against a running server's OpenAI
endpoints, with Poisson arrivals at --request-rate (or all at once, `inf`), at most
--max-concurrency in flight. Every request streams (with usage), so each gets a TTFT, the gaps
between its chunks (ITL), a TPOT and an end-to-end latency; the run reports their mean, median
and p99 with request and token throughput.

Workloads: `random` (prompts of random ordinary token ids sent as token-id prompts, exact
lengths, `ignore_eos` so each produces exactly its output length), `prefix_repetition` (vLLM's:
the same, but --prefix-repetition-num-prefixes random prefixes each open an equal share of the
prompts, shared system prompts for the prefix cache and prefix routing, in shuffled order) or
`sharegpt` (a ShareGPT-style JSON: each record's first human turn is the prompt, the reply's
token count its output length; records with "prompt" / "output_len" are read too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxllm.benchmarks.datasets import TokenSampler, prefix_repetition_workload, read_records

# Random token ids: exact lengths, sent as token-id prompts with ignore_eos.
SYNTHETIC_DATASETS = ("random", "prefix_repetition")


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def _tokenizer(path: str | None) -> Any:
    from jaxllm.model_executor.model_loader.default_model import default_model_path
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path() if path is None else path)


def _as_text_for_chat(args: argparse.Namespace, tokenizer: Any, reqs: list[BenchRequest]
                      ) -> list[BenchRequest]:
    if args.endpoint == "/v1/chat/completions":
        # Chat messages are text: the ids' text (its length in tokens may differ a little, and
        # the chat template adds its own).
        for r in reqs:
            r.prompt = tokenizer.decode(r.prompt)
    return reqs


def build_workload(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    rng = np.random.default_rng(args.seed)
    if args.dataset_name == "random":
        if args.random_input_len < 1 or args.random_output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        sampler = TokenSampler(len(tokenizer), tokenizer)
        reqs = [BenchRequest(sampler.sample(rng, args.random_input_len), args.random_input_len,
                             args.random_output_len) for _ in range(args.num_prompts)]
        return _as_text_for_chat(args, tokenizer, reqs)
    if args.dataset_name == "prefix_repetition":
        wl = prefix_repetition_workload(
            TokenSampler(len(tokenizer), tokenizer), args.num_prompts,
            args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.seed)
        reqs = [BenchRequest(p, len(p), n) for p, n in
                zip(wl.prompts, wl.output_lens, strict=True)]
        return _as_text_for_chat(args, tokenizer, reqs)
    if args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    out = []
    for i, rec in enumerate(read_records(args.dataset_path)):
        if len(out) == args.num_prompts:
            break
        if not isinstance(rec, dict):
            raise ValueError(f"dataset record {i}: not an object")
        conv = rec.get("conversations")
        if isinstance(conv, list) and len(conv) >= 2:
            prompt, reply = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
            out_len = len(tokenizer.encode(reply))
        elif "prompt" in rec:
            prompt, out_len = str(rec["prompt"]), int(rec.get("output_len", 128))
        else:
            continue  # vLLM skips records without a prompt and a reply too
        if args.sharegpt_output_len is not None:
            out_len = args.sharegpt_output_len
        n_in = len(tokenizer.encode(prompt))
        if n_in < 1 or out_len < 1:
            continue
        out.append(BenchRequest(prompt, n_in, out_len))
    if not out:
        raise ValueError(f"dataset {args.dataset_path}: no usable records")
    return out


async def _one(client: Any, args: argparse.Namespace, model: str, req: BenchRequest,
               ignore_eos: bool) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len)
    extra = {"ignore_eos": ignore_eos}
    start = last = time.perf_counter()
    try:
        if args.endpoint == "/v1/completions":
            stream = await client.completions.create(
                model=model, prompt=req.prompt, max_tokens=req.output_len, temperature=0.0,
                stream=True, stream_options={"include_usage": True}, extra_body=extra)
        else:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": req.prompt}],
                max_completion_tokens=req.output_len, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            if chunk.usage is not None:
                res.output_tokens = chunk.usage.completion_tokens
            # Only chunks with text are tokens (a chat stream opens with a role-only chunk).
            if not any(getattr(c, "text", None) or getattr(getattr(c, "delta", None), "content",
                                                         None) for c in chunk.choices):
                continue
            now = time.perf_counter()
            if res.ttft == 0.0:
                res.ttft = now - start
            else:
                res.itl.append(now - last)
            last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float], name: str) -> dict[str, float]:
    arr = np.asarray(values or [0.0], np.float64) * 1000.0
    return {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
            f"p99_{name}_ms": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "request_throughput": len(ok) / duration,
            "output_throughput": out_tokens / duration,
            "total_token_throughput": (in_tokens + out_tokens) / duration,
            **_stats([r.ttft for r in ok], "ttft"), **_stats(tpots, "tpot"),
            **_stats([x for r in ok for x in r.itl], "itl"),
            **_stats([r.latency for r in ok], "e2el"),
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


async def run_benchmark(args: argparse.Namespace, workload: list[BenchRequest]
                        ) -> dict[str, Any]:
    from openai import AsyncOpenAI

    base = args.base_url or f"http://{args.host}:{args.port}"
    client = AsyncOpenAI(base_url=base.rstrip("/") + "/v1", api_key=args.api_key or "EMPTY",
                         max_retries=0, timeout=3600.0)
    model = args.model or (await client.models.list()).data[0].id
    ignore_eos = args.dataset_name in SYNTHETIC_DATASETS
    rng = np.random.default_rng(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(workload), disable=args.disable_tqdm, desc="requests")

    async def limited(req: BenchRequest) -> RequestResult:
        if sem is None:
            res = await _one(client, args, model, req, ignore_eos)
        else:
            async with sem:
                res = await _one(client, args, model, req, ignore_eos)
        bar.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    for i, req in enumerate(workload):
        if i and args.request_rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        tasks.append(asyncio.create_task(limited(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    await client.close()
    out = summarize(results, duration)
    out.update(model=model, endpoint=args.endpoint, request_rate=args.request_rate,
               max_concurrency=args.max_concurrency, num_prompts=len(workload),
               dataset=args.dataset_name)
    return out


def print_report(m: dict[str, Any]) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Request rate (req/s):", m["request_rate"]),
            ("Max concurrency:", m["max_concurrency"]),
            ("Benchmark duration (s):", f"{m['duration_s']:.2f}"),
            ("Total input tokens:", m["total_input_tokens"]),
            ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value!s:>20}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token "
                        "(excl. 1st token)"), ("itl", "Inter-token Latency"),
                        ("e2el", "End-to-end Latency")):
        print(f"{title:-^60}")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {name.upper()} (ms):':<40}"
                  f"{m[f'{stat}_{name}_ms']:>20.2f}")
    if m["errors"]:
        print("errors:", *m["errors"], sep="\n  ")
    print("=" * 60)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    workload = build_workload(args, _tokenizer(args.tokenizer))
    metrics = asyncio.run(run_benchmark(args, workload))
    print_report(metrics)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(metrics, f, indent=2)
    return 0 if metrics["completed"] else 1
