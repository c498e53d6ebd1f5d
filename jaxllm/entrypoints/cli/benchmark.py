"""`jaxllm bench throughput | latency | sweep | serve`: vLLM-style benchmarks (`serve`: against a
running `jaxllm serve`, see jaxllm/benchmarks/serve.py; the others with a same-run baseline).

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

from jaxllm.engine.arg_utils import EngineArgs

# The parser imports nothing from jaxllm.benchmarks: each command's module (and jax, torch, ...)
# is imported when that command runs, so `jaxllm generate` / `jaxllm chat` never load them.



def _run_throughput(args: argparse.Namespace) -> int:
    from jaxllm.benchmarks.throughput import cmd_throughput

    return cmd_throughput(args)


def _run_latency(args: argparse.Namespace) -> int:
    from jaxllm.benchmarks.latency import cmd_latency

    return cmd_latency(args)


def _run_sweep(args: argparse.Namespace) -> int:
    from jaxllm.benchmarks.sweep import cmd_sweep

    return cmd_sweep(args)


def _run_serve(args: argparse.Namespace) -> int:
    from jaxllm.benchmarks.serve import cmd_bench_serve

    return cmd_bench_serve(args)


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
    # The engine's own options and defaults (EngineArgs); the bench sizes max_num_seqs to its
    # workload unless told, and its --seed also seeds the synthetic prompts.
    EngineArgs.add_cli_args(p, skip=("show_progress",), help_overrides={
        "model": "checkpoint directory, .gguf file, Hugging Face Hub model id, or "
                 "`tiny-qwen2`: a random 2-layer Qwen2 with the real vocabulary and tokenizer, "
                 "whose nearly free device step leaves the host path to measure (default: the "
                 "embedded model)",
        "max_num_seqs": "default: what the workload runs at once (throughput: the number of "
                        "prompts, at most 256; latency: the batch size; sweep: the largest "
                        "batch), raised to the largest --profile-batch-sizes with --profile",
        "seed": "seeds the engine and the synthetic prompts (default: 0)"})
    p.set_defaults(max_num_seqs=None)
    # The spelling the recorded benchmark commands use.
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)
    r = p.add_argument_group("baselines")
    r.add_argument("--compare-hf", action="store_true",
                   help="run the same workload through HF transformers' generate")
    r.add_argument("--no-roofline", action="store_true",
                   help="skip the machine measurement and the roofline")
    r.add_argument("--roofline-gemm-size", type=int, default=None,
                   help="n of the n x n x n GEMM timed for the peak FLOP rate (default: 8192 "
                        "on GPU, 2048 on CPU)")
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
    g.add_argument("--profile-sampling", choices=("greedy", "seeded-top-k-top-p"),
                   default="greedy", help="the profiled requests' sampling: greedy, or each "
                   "seeded with temperature 0.8, top_k 50, top_p 0.9")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    # A client of a running server: no engine options.
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default=None, help="served model name (default: the server's)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for the workload (default: the embedded model's)")
    p.add_argument("--dataset-name", default="random",
                   choices=("random", "prefix_repetition", "sharegpt"))
    p.add_argument("--dataset-path", default=None, help="the sharegpt JSON / JSONL file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="override each record's output length")
    g = p.add_argument_group("prefix_repetition dataset (random prompts that share prefixes)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="tokens of each shared prefix")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="random tokens after the prefix, each prompt its own")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="distinct prefixes; each opens num-prompts / num-prefixes prompts "
                        "(rounded down)")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128,
                   help="generated tokens per request (EOS ignored)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--output-json", default=None)



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
    tp.set_defaults(func=_run_throughput)

    lat = sub.add_parser("latency", help="end-to-end latency of one batch",
                         formatter_class=_HelpFormatter)
    lat.add_argument("--batch-size", type=int, default=8, help="requests sent together")
    _add_length_args(lat, 32)
    lat.add_argument("--num-iters", type=int, default=10, help="measured iterations")
    lat.add_argument("--num-iters-warmup", type=int, default=2,
                     help="unmeasured iterations first")
    _add_common_args(lat)
    _add_profile_args(lat)
    lat.set_defaults(func=_run_latency)

    sw = sub.add_parser("sweep", help="output tok/s vs batch size (+ HF, roofline), as a plot",
                        formatter_class=_HelpFormatter)
    sw.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64],
                    help="concurrent requests per point (that many prompts each)")
    _add_length_args(sw, 128)
    sw.add_argument("--output-png", default=None, help="plot here (needs matplotlib)")
    _add_common_args(sw)
    sw.set_defaults(func=_run_sweep)

    sv = sub.add_parser("serve", help="online serving: TTFT, TPOT, ITL against `jaxllm serve`",
                        formatter_class=_HelpFormatter)
    _add_serve_args(sv)
    sv.set_defaults(func=_run_serve)
    return bench
