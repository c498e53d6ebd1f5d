"""Speculative decoding on the embedded model: speculation off, n-gram (prompt lookup) with
k = 3, 5 and 8 draft tokens, and llama.cpp's prompt lookup decoding, in one process, the settings
taking turns in every round so a shared machine's drift lands on all of them.

    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode.py
    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode.py --settings off ngram5 --rounds 2

Settings: `off`; `off-sync` (speculation off and async scheduling off, as speculative steps
run: what the overlap of host and device is worth); `ngram3`, `ngram5`, `ngram8`
(speculative_config {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}); `llama.cpp`:
llama-cpp-python on the same GGUF file with `LlamaPromptLookupDecoding(num_pred_tokens=
--llama-pred-tokens)`, --llama-threads (2) threads, greedy, the same prompt token ids (needs the
optional `bench` extra; it serves one sequence, so batch 1 only). With a draft model
llama-cpp-python keeps the logits of every position (logits_all), the prompt's included, so its
TTFT pays the vocabulary projection of the whole prompt: it is not plain llama.cpp's prefill.

Every jaxllm setting is one LLM with the default engine settings, built once before the first
round and kept alive; they differ only in speculative_config, and get the same max_num_seqs (the
largest batch) and KV budget (--kv-cache-memory-bytes: the CPU default, and one that lets every
engine fit on one GPU).

Workloads:
  - `code`: benchmarks/data/code_edit_prompts.json (benchmarks/code_edit_workload.py): a small
    Python function shown in the prompt and asked back with one change, the model's chat
    template applied, greedy, up to --max-tokens (256) or EOS. Generation stops at EOS: what
    follows an end of turn is not an edit, and its acceptance would say nothing about the
    workload. The budget is still the same for every jaxllm setting: greedy output does not
    depend on speculation, so each emits the same tokens (checked, below); rates divide the
    tokens a setting actually produced (llama.cpp's greedy tokens may differ slightly) by its
    time.
  - `random`: random ordinary token ids as `jaxllm bench` draws them, --random-input-len (128)
    in, --random-output-len (128) out, EOS ignored; fresh prompts each round (seeded by the
    round), the same for every setting within it.

Batch sizes (--batch-sizes, default 1 16): batch 1 sends --num-prompts requests one at a time
(TTFT, TPOT, output tok/s = tokens over the summed request latencies); batch B sends them B at a
time, each group one `generate` call (output tok/s). A first, untimed pass runs every setting on
one group of each batch size (first calls, the prefix cache's copy of the code prompts).

Reported per (workload, batch size, setting), medians over rounds: output tok/s, TPOT and TTFT
(batch 1), speedup over `off` in the same round; for ngram the acceptance rate and mean accepted
length from the core's counter deltas over every round. Greedy check: at every batch size
every ngram setting must give `off`'s token ids for every prompt; a mismatch is printed loudly,
recorded in the JSON, and makes the exit status 1.

The table is printed as markdown; all numbers go to --out (benchmarks/results/spec_decode.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.benchmarks.common import scheduler_state
from jaxllm.benchmarks.datasets import TokenSampler, synthetic_workload, token_sampler_for
from jaxllm.benchmarks.metrics import SPEC_DECODE_COUNTERS, spec_decode_metrics
from jaxllm.config import resolve_model
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent
CODE_PROMPTS = ROOT / "data" / "code_edit_prompts.json"
NGRAM_KS = {"ngram3": 3, "ngram5": 5, "ngram8": 8}
SETTINGS = ("off", "off-sync", *NGRAM_KS, "llama.cpp")
WORKLOADS = ("code", "random")


def speculative_config(setting: str) -> dict[str, Any] | None:
    if setting in ("off", "off-sync"):
        return None
    return {"method": "ngram", "num_speculative_tokens": NGRAM_KS[setting],
            "prompt_lookup_min": 2, "prompt_lookup_max": 5}


class LlamaCppLookup:
    """llama-cpp-python with prompt lookup decoding, timed per request like the jaxllm runs: TTFT
    from the call to the first token, TPOT over the rest."""

    def __init__(self, n_ctx: int, num_pred_tokens: int, n_threads: int,
                 eos_token_ids: list[int]):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from jaxllm.model_executor.model_loader.default_model import default_model_path

        self.llm = llama_cpp.Llama(
            model_path=str(default_model_path()), n_ctx=n_ctx, n_threads=n_threads,
            n_threads_batch=n_threads,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens),
            verbose=False)
        self.eos = {*eos_token_ids, self.llm.token_eos()}
        self.version = llama_cpp.__version__

    def run(self, prompt: list[int], max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
        start = time.perf_counter()
        first = None
        tokens: list[int] = []
        # temp 0 and top_k 1: greedy. generate() does not stop at EOS by itself.
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            if not ignore_eos and token in self.eos:
                break
            tokens.append(int(token))
            if len(tokens) == max_tokens:
                break
        end = time.perf_counter()
        assert first is not None
        return {"token_ids": tokens, "latency": end - start, "ttft": first - start,
                "tpot": (end - first) / (len(tokens) - 1) if len(tokens) > 1 else None}


def run_jaxllm(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[dict[str, Any]]:
    """One `generate` call: per request its token ids, TTFT and TPOT; the call's wall time."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    latency = time.perf_counter() - start
    runs = []
    for o in outputs:
        ids = list(o.outputs[0].token_ids)
        m = o.metrics
        ttft = tpot = None
        if m is not None and m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            if len(ids) > 1 and m.finished_time is not None:
                tpot = (m.finished_time - m.first_token_time) / (len(ids) - 1)
        runs.append({"token_ids": ids, "ttft": ttft, "tpot": tpot, "latency": latency})
    return runs


def measure(engine: LLM | LlamaCppLookup, prompts: list[list[int]], batch_size: int,
            max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """Every prompt once, `batch_size` at a time: output tok/s over the summed call times, mean
    TTFT and TPOT of the requests, their token ids, and the spec-decode counter deltas."""
    before = scheduler_state(engine) if isinstance(engine, LLM) else {}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    runs, elapsed = [], 0.0
    for i in range(0, len(prompts), batch_size):
        group = prompts[i:i + batch_size]
        if isinstance(engine, LlamaCppLookup):
            assert batch_size == 1, "llama-cpp-python serves one sequence"
            got = [engine.run(group[0], max_tokens, ignore_eos)]
        else:
            got = run_jaxllm(engine, group, sp)
        elapsed += got[0]["latency"]
        runs += got
    out_tokens = sum(len(r["token_ids"]) for r in runs)
    ttfts = [r["ttft"] for r in runs if r["ttft"] is not None]
    tpots = [r["tpot"] for r in runs if r["tpot"] is not None]
    result: dict[str, Any] = {
        "output_tokens": out_tokens, "elapsed_s": elapsed,
        "output_tokens_per_second": out_tokens / max(elapsed, 1e-9),
        "ttft_mean": float(np.mean(ttfts)) if ttfts else None,
        "tpot_mean": float(np.mean(tpots)) if tpots else None,
        "token_ids": [r["token_ids"] for r in runs]}
    if isinstance(engine, LLM):
        after = scheduler_state(engine)
        result["counters"] = {k: int(after.get(k, 0)) - int(before.get(k, 0))
                              for k in SPEC_DECODE_COUNTERS}
    return result


def code_prompts(tok: Any, path: Path, count: int) -> list[list[int]]:
    records = json.loads(path.read_text())
    if count > len(records):
        raise SystemExit(f"--num-prompts {count}: {path} holds {len(records)} prompts")
    texts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
             for r in records[:count]]
    return [list(tok.encode(t, add_special_tokens=False)) for t in texts]


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def summarize(cell: list[dict[str, Any]], off: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Medians over rounds (speedup: of the per-round ratios to `off`); spec decode from the
    counters summed over rounds."""
    def med(key: str) -> float | None:
        xs = [r[key] for r in cell if r.get(key) is not None]
        return float(np.median(xs)) if xs else None

    out: dict[str, Any] = {"output_tokens_per_second": med("output_tokens_per_second"),
                           "tpot_mean": med("tpot_mean"), "ttft_mean": med("ttft_mean")}
    if off is not None:
        out["speedup_vs_off"] = float(np.median(
            [r["output_tokens_per_second"] / o["output_tokens_per_second"]
             for r, o in zip(cell, off, strict=True)]))
    if cell and "counters" in cell[0]:
        total = {k: sum(r["counters"][k] for r in cell) for k in SPEC_DECODE_COUNTERS}
        out.update(spec_decode_metrics({}, total))
    return out


def markdown_table(summary: dict[tuple[str, int, str], dict[str, Any]]) -> str:
    def fmt(x: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
        return "-" if x is None else format(x * scale, spec)

    rows = ["| workload | batch | setting | output tok/s | TPOT ms | TTFT ms | speedup vs off "
            "| acceptance | mean accepted length |", "|---|---|---|---|---|---|---|---|---|"]
    for (workload, bs, setting), s in summary.items():
        rows.append(
            f"| {workload} | {bs} | {setting} | {fmt(s['output_tokens_per_second'])} "
            f"| {fmt(s['tpot_mean'] if bs == 1 else None, 1e3)} "
            f"| {fmt(s['ttft_mean'] if bs == 1 else None, 1e3)} "
            f"| {fmt(s.get('speedup_vs_off'), spec='.2f')} "
            f"| {fmt(s.get('spec_decode_acceptance_rate'), 100, '.1f')} "
            f"| {fmt(s.get('spec_decode_mean_accepted_length'), spec='.2f')} |")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    ap.add_argument("--num-prompts", type=int, default=16,
                    help="requests per (workload, batch size, setting) and round")
    ap.add_argument("--max-tokens", type=int, default=256, help="code workload: most tokens")
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--llama-pred-tokens", type=int, default=8,
                    help="llama.cpp: LlamaPromptLookupDecoding's num_pred_tokens")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama.cpp: threads")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30,
                    help="every jaxllm engine's KV budget")
    ap.add_argument("--prompts-file", type=Path, default=CODE_PROMPTS)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "spec_decode.json")
    args = ap.parse_args()
    for name in ("rounds", "num_prompts", "max_tokens", "random_input_len", "random_output_len",
                 "llama_pred_tokens", "llama_threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(b < 1 for b in args.batch_sizes):
        ap.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    return args


def build_engines(args: argparse.Namespace) -> dict[str, LLM]:
    # Several engines share the device: on a GPU none may take it all when its backend starts.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    engines = {}
    for setting in [s for s in args.settings if s != "llama.cpp"]:
        start = time.perf_counter()
        spec = speculative_config(setting)
        extra: dict[str, Any] = {} if spec is None else {"speculative_config": spec}
        if setting == "off-sync":  # what speculation gives up: it runs steps synchronously
            extra["async_scheduling"] = False
        engines[setting] = LLM(max_num_seqs=max(args.batch_sizes),
                               kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                               show_progress=False, **extra)
        print(f"{setting}: start-up {time.perf_counter() - start:.1f} s", flush=True)
    return engines


def check_greedy(results: dict[tuple[str, int, str], list[dict[str, Any]]], workload: str,
                 batch_size: int = 1) -> list[dict[str, Any]]:
    """The latest round's requests of every ngram setting against `off`'s, at one batch size."""
    reference = results[(workload, batch_size, "off")][-1]
    mismatches = []
    for setting in [s for s in NGRAM_KS if (workload, batch_size, s) in results]:
        got = results[(workload, batch_size, setting)][-1]
        for i, (a, b) in enumerate(zip(reference["token_ids"], got["token_ids"], strict=True)):
            if a != b:
                at = first_difference(a, b)
                mismatches.append({"workload": workload, "batch_size": batch_size,
                                   "round": got["round"],
                                   "setting": setting, "prompt": i, "first_difference": at,
                                   "off_len": len(a), "setting_len": len(b)})
                print(f"GREEDY MISMATCH: {workload} batch {batch_size} round {got['round']} "
                      f"prompt {i}: {setting} "
                      f"differs from off at output token {at} ({len(b)} vs {len(a)} tokens)",
                      file=sys.stderr, flush=True)
    return mismatches


def main() -> int:
    args = parse_args()
    engines: dict[str, LLM | LlamaCppLookup] = dict(build_engines(args))
    first = next(iter(engines.values()), None)
    if isinstance(first, LLM):
        tokenizer, eos, sampler = (first.get_tokenizer(), sorted(first.llm_engine.eos_token_ids),
                                   token_sampler_for(first))
    else:  # llama.cpp alone: the embedded model's tokenizer, as the engine would load it
        tokenizer = load_tokenizer(resolve_model(None))
        eos = [tokenizer.eos_token_id]
        sampler = TokenSampler(len(tokenizer), tokenizer, set(eos))
    code = code_prompts(tokenizer, args.prompts_file, args.num_prompts) \
        if "code" in args.workloads else []
    if "llama.cpp" in args.settings and 1 in args.batch_sizes:
        longest = max([len(p) + args.max_tokens for p in code]
                      + [args.random_input_len + args.random_output_len])
        start = time.perf_counter()
        engines["llama.cpp"] = LlamaCppLookup(longest + 16, args.llama_pred_tokens,
                                              args.llama_threads, eos)
        print(f"llama.cpp: start-up {time.perf_counter() - start:.1f} s", flush=True)

    def prompts_for(workload: str, r: int) -> tuple[list[list[int]], int, bool]:
        if workload == "code":
            return code, args.max_tokens, False
        wl = synthetic_workload(sampler, args.num_prompts, args.random_input_len,
                                args.random_output_len, seed=r)
        return wl.prompts, args.random_output_len, True

    results: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    mismatches: list[dict[str, Any]] = []
    for r in range(args.rounds + 1):  # round 0 warms up
        for workload in args.workloads:
            prompts, max_tokens, ignore_eos = prompts_for(workload, r)
            for bs in args.batch_sizes:
                for setting, engine in engines.items():
                    if bs > 1 and isinstance(engine, LlamaCppLookup):
                        continue
                    m = measure(engine, prompts[:bs] if r == 0 else prompts, bs, max_tokens,
                                ignore_eos)
                    if r == 0:
                        continue
                    results[(workload, bs, setting)].append({"round": r, **m})
                    tpot = f", TPOT {m['tpot_mean'] * 1e3:6.1f} ms" \
                        if bs == 1 and m["tpot_mean"] is not None else ""
                    print(f"round {r} {workload:>6} batch {bs:>2} {setting:>9}: "
                          f"{m['output_tokens_per_second']:7.1f} output tok/s{tpot}", flush=True)
                if r and "off" in engines:
                    mismatches += check_greedy(results, workload, bs)

    summary = {key: summarize(cell, None if key[2] == "off"
                              else results.get((key[0], key[1], "off")))
               for key, cell in results.items()}
    print()
    print(markdown_table(summary))
    if mismatches:
        print(f"\nGREEDY MISMATCH: {len(mismatches)} requests of an ngram setting "
              f"differ from off (see 'greedy_mismatches' in {args.out})", file=sys.stderr)
    elif "off" in engines and any(s in engines for s in NGRAM_KS) and 1 in args.batch_sizes:
        print("\ngreedy check: every ngram setting matches off on every request")
    out = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "engine": first.llm_engine.describe() if isinstance(first, LLM) else None,
           "llama_cpp_version": getattr(engines.get("llama.cpp"), "version", None),
           "greedy_mismatches": mismatches,
           "results": [{"workload": w, "batch_size": b, "setting": s, "summary": summary[(w, b, s)],
                        "rounds": [{k: v for k, v in x.items() if k != "token_ids"}
                                   for x in cell]}
                       for (w, b, s), cell in results.items()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"results written to {args.out}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
