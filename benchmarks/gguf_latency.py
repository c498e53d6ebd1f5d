"""Latency of several engine settings on the embedded model in one run, taking turns (one batch
of 128/128 requests each per round), so a shared machine's drift lands on all of them.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_latency.py --rounds 4 none gguf
    PYTHONPATH=. .venv/bin/python benchmarks/gguf_latency.py --rounds 4 none bfloat16
    PYTHONPATH=.:<llama-cpp-python> .venv/bin/python benchmarks/gguf_latency.py --rounds 3 \
        --batch-size 16 --output-len 64 gguf llama.cpp

Batch 1: `max_num_seqs=1`, `max_num_batched_tokens` the prompt; TTFT and TPOT. A larger
`--batch-size`: that many requests at once, the engine's default token budget and
`max_num_seqs` the batch; output tok/s (batch x output tokens over the batch's wall time), and
llama.cpp runs the same batch through its batch API (prompts in chunks of up to 512 tokens,
then one token per sequence per step, greedy), as llama.cpp's batched-bench does.

Settings: `none` (float32, dequantized), `gguf` (quantization="gguf"), `gguf-compact` (and
gguf_compact=True), `gguf-int8` (and cpu_int8_activations=True: int8 activations, not exact),
`bfloat16`, and `llama.cpp`: llama-cpp-python on the same GGUF file, a
thread per core the process may use (`taskset` limits both engines alike), greedy, the same
prompt token ids
(needs the optional `bench` extra, `pip install -e '.[bench]'`, which builds llama.cpp from
source in ~8 minutes; never a test dependency).

A setting named with `@avx2` (`gguf@avx2`, `llama.cpp@avx2`) runs in a child process set up as
on an AVX2 machine (jaxllm.benchmarks.child.ISA_ENV: our C++ kernels' AVX2 build, XLA's code
generation capped at AVX2), taking turns with the others, so an AVX-512 machine times both
builds in one run:

    PYTHONPATH=.:<llama-cpp-python> .venv/bin/python benchmarks/gguf_latency.py --rounds 3 \
        gguf gguf@avx2 llama.cpp llama.cpp@avx2 --llama-cpp-avx2 <llama-cpp-python, AVX2 build>

Settings without `@` run in this process, on its build (`$JAXLLM_CPU_ISA`, default native).
`llama.cpp@avx2` needs `--llama-cpp-avx2`: a llama-cpp-python built without AVX-512 (the start-up
line prints each llama.cpp's own list of the instructions it was built for). `--model` takes
another .gguf than the embedded one (with `--no-tokenizer`, one without a tokenizer: the tests'
tiny model).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

from jaxllm import LLM
from jaxllm.benchmarks.child import Child, isa_env
from jaxllm.benchmarks.datasets import token_sampler_for
from jaxllm.benchmarks.latency import run_jaxllm_latency
from jaxllm.model_executor.layers import cpu_ffi
from jaxllm.model_executor.model_loader.default_model import default_model_path

SETTINGS = {"none": {"quantization": "none"}, "gguf": {"quantization": "gguf"},
            "gguf-compact": {"quantization": "gguf", "gguf_compact": True},
            "gguf-int8": {"quantization": "gguf", "cpu_int8_activations": True},
            "bfloat16": {"dtype": "bfloat16"}, "llama.cpp": None}


class LlamaCpp:
    """llama.cpp through llama-cpp-python, timed like run_jaxllm_latency: TTFT from the call to
    the first token, TPOT over the rest."""

    def __init__(self, model: Path, input_len: int, output_len: int):
        import os

        import llama_cpp

        # The cores this process may run on (as XLA sizes its pool): under `taskset` the same.
        threads = len(os.sched_getaffinity(0))
        self.llm = llama_cpp.Llama(model_path=str(model),
                                   n_ctx=input_len + output_len + 16, n_batch=input_len,
                                   n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.output_len = output_len

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


class LlamaCppBatch:
    """llama.cpp's batch API on `batch` sequences at once: the prompts' tokens in chunks of up
    to CHUNK (the sequences' last prompt tokens asking for logits), then one token per sequence
    per step; greedy (argmax of the returned logits)."""

    CHUNK = 512

    def __init__(self, model: Path, batch: int, input_len: int, output_len: int):
        import os

        import llama_cpp

        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(model).encode(),
                                                    lib.llama_model_default_params())
        params = lib.llama_context_default_params()
        threads = len(os.sched_getaffinity(0))
        params.n_ctx = batch * (input_len + output_len + 16)
        params.n_batch = params.n_ubatch = self.CHUNK
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(self.CHUNK, 0, 1)
        self.output_len = output_len

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits); returns the argmax of each wanted
        row, in order."""
        b, lib = self.batch, self.lib
        b.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = int(logits)
        if lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i),
                                          shape=(self.n_vocab,)).argmax())
                for i, item in enumerate(items) if item[3]]

    def run(self, prompts: list[list[int]]) -> dict[str, float]:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        flat = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts)
                for pos, tok in enumerate(p)]
        last: list[int] = []
        for a in range(0, len(flat), self.CHUNK):
            last += self._decode(flat[a:a + self.CHUNK])
        first = time.perf_counter()
        for step in range(self.output_len - 1):
            last = self._decode([(tok, len(p) + step, s, True)
                                 for s, (tok, p) in enumerate(zip(last, prompts, strict=True))])
        end = time.perf_counter()
        tokens = len(prompts) * self.output_len
        return {"ttft_mean": first - start, "tpot_mean": (end - first) / (self.output_len - 1),
                "avg_latency": end - start, "output_tokens_per_second": tokens / (end - start)}


class Jaxllm:
    """One jaxllm setting's engine, and the prompts its tokenizer draws (as run_jaxllm_latency
    draws them for a seed)."""

    def __init__(self, settings: dict, args: argparse.Namespace):
        start = time.perf_counter()
        limits = (dict(max_num_seqs=1, max_num_batched_tokens=args.input_len)
                  if args.batch_size == 1 else dict(max_num_seqs=args.batch_size))
        self.llm = LLM(args.model, show_progress=False, skip_tokenizer_init=args.no_tokenizer,
                       **limits, **settings)
        self.sampler = token_sampler_for(self.llm)
        self.args = args
        weight_bytes = self.llm.collective_rpc("weight_bytes")
        self.startup = (f"start-up {time.perf_counter() - start:.1f} s, CPU kernels "
                        f"{cpu_ffi.default_isa()} build, weights {weight_bytes / 1e9:.3f} GB, "
                        f"peak RSS so far "
                        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")

    def describe(self) -> str:
        return self.startup

    def prompts(self, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [self.sampler.sample(rng, self.args.input_len)
                for _ in range(self.args.batch_size)]

    def run(self, seed: int, prompts: list[list[int]]) -> dict[str, float]:
        # run_jaxllm_latency draws `prompts` again from the seed.
        a = self.args
        return run_jaxllm_latency(self.llm, self.sampler, a.batch_size, a.input_len,
                                  a.output_len, 1, 0, seed=seed, use_tqdm=False)


class LlamaCppSetting:
    """llama.cpp at the run's batch size, from the llama-cpp-python on `lib` (a folder put first
    on the path) or the one importable."""

    def __init__(self, args: argparse.Namespace, lib: str | None = None):
        if lib:
            sys.path.insert(0, lib)
        import llama_cpp

        start = time.perf_counter()
        model = args.model or default_model_path()
        self.batch = args.batch_size
        self.llm = (LlamaCpp(model, args.input_len, args.output_len) if self.batch == 1
                    else LlamaCppBatch(model, self.batch, args.input_len, args.output_len))
        # llama.cpp's own account of the instructions its CPU backend was built for.
        system = llama_cpp.llama_print_system_info().decode().strip()
        self.startup = (f"start-up {time.perf_counter() - start:.1f} s, llama-cpp-python "
                        f"{llama_cpp.__version__} from {Path(llama_cpp.__file__).parent.parent}"
                        f", built for: {system}")

    def describe(self) -> str:
        return self.startup

    def run(self, seed: int, prompts: list[list[int]]) -> dict[str, float]:
        return self.llm.run(prompts[0]) if self.batch == 1 else self.llm.run(prompts)


def make_setting(name: str, args: argparse.Namespace):
    """The setting `name` (a SETTINGS key and an optional `@isa`) in this process."""
    base, _, isa = name.partition("@")
    if SETTINGS[base] is None:
        return LlamaCppSetting(args, args.llama_cpp_avx2 if isa == "avx2" else None)
    return Jaxllm(SETTINGS[base], args)


def setting_name(name: str) -> str:
    """argparse's check of a setting: a SETTINGS key, optionally `@` and an instruction set."""
    base, at, isa = name.partition("@")
    if base not in SETTINGS or (at and isa not in cpu_ffi.ISA_FLAGS):
        raise argparse.ArgumentTypeError(
            f"{name!r}: expected one of {', '.join(SETTINGS)}, optionally with "
            f"@{' / @'.join(cpu_ffi.ISA_FLAGS)}")
    return name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("settings", nargs="+", type=setting_name,
                    help=f"{', '.join(SETTINGS)}; NAME@avx2 runs it as on an AVX2 machine")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--model", help="a .gguf file (default: the embedded model)")
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="no tokenizer (skip_tokenizer_init): a .gguf without one")
    ap.add_argument("--llama-cpp-avx2", metavar="DIR",
                    help="a llama-cpp-python built without AVX-512, for llama.cpp@avx2")
    args = ap.parse_args(argv)
    batch = args.batch_size
    if "llama.cpp@avx2" in args.settings and not args.llama_cpp_avx2:
        ap.error("llama.cpp@avx2 needs --llama-cpp-avx2 DIR (a llama-cpp-python built for AVX2)")
    llms: dict = {}
    width = max(map(len, args.settings))
    for name in args.settings:
        isa = name.partition("@")[2]
        # The kernels' build and XLA's flags are chosen once per process: a setting named with
        # its instruction set runs in a child process set up for it.
        llms[name] = (Child(make_setting, name, args, env=isa_env(isa)) if isa
                      else make_setting(name, args))
        print(f"{name}: {llms[name].describe()}", flush=True)
    source = next((llms[n] for n in args.settings if SETTINGS[n.partition("@")[0]] is not None),
                  None)
    if source is None:
        raise SystemExit("name at least one jaxllm setting: its tokenizer draws the prompts")
    keys = ("ttft_mean", "tpot_mean", "output_tokens_per_second")
    results: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in llms}
    for r in range(args.rounds + 1):  # the first pass warms up
        prompts = source.prompts(r)
        for name, llm in llms.items():
            m = llm.run(r, prompts)
            if r:
                for k in keys:
                    if k in m:
                        results[name][k].append(m[k])
                line = (f"TTFT {m['ttft_mean'] * 1e3:7.1f} ms, TPOT {m['tpot_mean'] * 1e3:6.1f} "
                        f"ms")
                if batch > 1:
                    line += f", {m['output_tokens_per_second']:6.1f} output tok/s"
                print(f"round {r} {name:>{width}}: {line}", flush=True)
    for name, res in results.items():
        line = (f"{name:>{width}}: median TTFT {np.median(res['ttft_mean']) * 1e3:7.1f} ms, median "
                f"TPOT {np.median(res['tpot_mean']) * 1e3:6.1f} ms "
                f"({1 / np.median(res['tpot_mean']):.1f} tok/s), best TPOT "
                f"{min(res['tpot_mean']) * 1e3:6.1f} ms")
        if batch > 1:
            line += (f", median {np.median(res['output_tokens_per_second']):.1f} output tok/s "
                     f"(rounds {' / '.join(f'{x:.1f}' for x in res['output_tokens_per_second'])})")
        print(line, flush=True)
    for llm in llms.values():
        if isinstance(llm, Child):
            llm.close()


if __name__ == "__main__":
    main()
