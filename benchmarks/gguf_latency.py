"""Batch-1 latency of several engine settings on the embedded model, in one process, taking
turns (one 128/128 request each per round), so a shared machine's drift lands on all of them.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_latency.py --rounds 4 none gguf
    PYTHONPATH=. .venv/bin/python benchmarks/gguf_latency.py --rounds 4 none bfloat16

Settings: `none` (float32, dequantized), `gguf` (quantization="gguf"), `bfloat16`, and
`llama.cpp`: llama-cpp-python on the same GGUF file, a thread per core the process may use
(`taskset` limits both engines alike), greedy, the same prompt token ids
(needs the optional `bench` extra, `pip install -e '.[bench]'`, which builds llama.cpp from
source in ~8 minutes; never a test dependency).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from jaxllm import LLM
from jaxllm.benchmarks.datasets import token_sampler_for
from jaxllm.benchmarks.latency import run_jaxllm_latency

SETTINGS = {"none": {"quantization": "none"}, "gguf": {"quantization": "gguf"},
            "bfloat16": {"dtype": "bfloat16"}, "llama.cpp": None}


class LlamaCpp:
    """llama.cpp through llama-cpp-python, timed like run_jaxllm_latency: TTFT from the call to
    the first token, TPOT over the rest."""

    def __init__(self, input_len: int, output_len: int):
        import os

        import llama_cpp

        from jaxllm.model_executor.model_loader.default_model import default_model_path
        # The cores this process may run on (as XLA sizes its pool): under `taskset` the same.
        threads = len(os.sched_getaffinity(0))
        self.llm = llama_cpp.Llama(model_path=str(default_model_path()),
                                   n_ctx=input_len + output_len + 16, n_batch=input_len,
                                   n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.output_len = output_len

    def weight_bytes(self) -> int:
        return self.llm.model_size() if hasattr(self.llm, "model_size") else 0

    def run(self, prompt: list[int]) -> dict[str, float]:
        start = time.perf_counter()
        first = None
        n = 0
        # temp 0: greedy; EOS is not special to generate(), so all output_len tokens come.
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == self.output_len:
                break
        end = time.perf_counter()
        return {"ttft_mean": first - start, "tpot_mean": (end - first) / (n - 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("settings", nargs="+", choices=list(SETTINGS))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    llms = {}
    for name in args.settings:
        start = time.perf_counter()
        if SETTINGS[name] is None:
            llms[name] = LlamaCpp(args.input_len, args.output_len)
            print(f"{name}: start-up {time.perf_counter() - start:.1f} s", flush=True)
            continue
        llms[name] = LLM(max_num_seqs=1, max_num_batched_tokens=args.input_len,
                         show_progress=False, **SETTINGS[name])
        weight_bytes = llms[name].collective_rpc("weight_bytes")
        print(f"{name}: start-up {time.perf_counter() - start:.1f} s, weights "
              f"{weight_bytes / 1e9:.3f} GB, peak RSS so far "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB", flush=True)
    engines = [x for x in llms.values() if isinstance(x, LLM)]
    if not engines:
        raise SystemExit("name at least one jaxllm setting: its tokenizer draws the prompts")
    sampler = token_sampler_for(engines[0])
    results: dict[str, dict[str, list[float]]] = {n: {"ttft": [], "tpot": []} for n in llms}
    for r in range(args.rounds + 1):  # the first pass warms up
        for name, llm in llms.items():
            if isinstance(llm, LlamaCpp):  # the prompt run_jaxllm_latency draws for this seed
                m = llm.run(sampler.sample(np.random.default_rng(r), args.input_len))
            else:
                m = run_jaxllm_latency(llm, sampler, 1, args.input_len, args.output_len, 1, 0,
                                       seed=r, use_tqdm=False)
            if r:
                results[name]["ttft"].append(m["ttft_mean"])
                results[name]["tpot"].append(m["tpot_mean"])
                print(f"round {r} {name:>8}: TTFT {m['ttft_mean'] * 1e3:7.1f} ms, "
                      f"TPOT {m['tpot_mean'] * 1e3:6.1f} ms", flush=True)
    for name, res in results.items():
        print(f"{name:>8}: median TTFT {np.median(res['ttft']) * 1e3:7.1f} ms, median TPOT "
              f"{np.median(res['tpot']) * 1e3:6.1f} ms ({1 / np.median(res['tpot']):.1f} tok/s), "
              f"best TPOT {min(res['tpot']) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
