"""`jaxllm` command line: `jaxllm generate PROMPT...`, `jaxllm chat MESSAGE` (optionally
constrained: `--json-schema FILE`, `--regex`, `--choice`), `jaxllm serve
[MODEL]` (the OpenAI-compatible server) and `jaxllm bench throughput | latency | sweep | serve`
(see jaxllm/benchmarks/)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.entrypoints.cli.benchmark import add_bench_parser
from jaxllm.entrypoints.cli.serve import add_serve_parser
from jaxllm.entrypoints.utils import enable_compilation_cache


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    # Every EngineArgs field, with its default; only max_num_seqs follows the prompts here (a
    # smaller limit compiles fewer decode buckets, so a one-prompt chat starts faster).
    EngineArgs.add_cli_args(parser, skip=("show_progress",), help_overrides={
        "max_num_seqs": f"sequences per step (default: the number of prompts, at most "
                        f"{EngineArgs.max_num_seqs})"})
    parser.set_defaults(max_num_seqs=None)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _make_llm(args: argparse.Namespace, num_prompts: int):
    from jaxllm import LLM

    return LLM.from_engine_args(EngineArgs.from_cli_args(
        args, max_num_seqs=(min(num_prompts, EngineArgs.max_num_seqs)
                            if args.max_num_seqs is None else args.max_num_seqs)))


def _add_constraint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", default=None, metavar="FILE",
                       help="constrain the answer to JSON valid against this JSON schema file")
    group.add_argument("--regex", default=None, help="constrain the answer to this regex")
    group.add_argument("--choice", action="append", default=None,
                       help="constrain the answer to one of these strings (repeatable)")
    parser.add_argument("--disable-any-whitespace", action="store_true",
                        help="no whitespace between JSON tokens (small or untrained models "
                             "need it to close objects)")


def _structured_outputs(args: argparse.Namespace):
    from jaxllm import StructuredOutputsParams

    spec: dict = {}
    if getattr(args, "json_schema", None) is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                spec["json"] = json.load(f)
        except OSError as e:
            raise ValueError(f"--json-schema: cannot read {args.json_schema}: {e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema: {args.json_schema} is not JSON: {e}") from None
    elif getattr(args, "regex", None) is not None:
        spec["regex"] = args.regex
    elif getattr(args, "choice", None) is not None:
        spec["choice"] = args.choice
    if not spec:
        return None
    return StructuredOutputsParams(**spec,
                                   disable_any_whitespace=args.disable_any_whitespace)


def _sampling_params(args: argparse.Namespace):
    from jaxllm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, stop=args.stop,
                          structured_outputs=_structured_outputs(args))


def _print_stats(outputs, elapsed: float) -> None:
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"[{len(outputs)} request(s), {n_in} prompt + {n_out} generated tokens in "
          f"{elapsed:.1f} s, {n_out / max(elapsed, 1e-9):.1f} tok/s]", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args, len(args.prompts))
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, _sampling_params(args))
    elapsed = time.perf_counter() - start
    for out in outputs:
        assert out.prompt is not None  # a text prompt's output keeps its text
        print(out.prompt + out.outputs[0].text)
        print("-" * 40)
    _print_stats(outputs, elapsed)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # a bad constraint fails before the model loads
    llm = _make_llm(args, 1)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.message})
    start = time.perf_counter()
    outputs = llm.chat(messages, params)
    elapsed = time.perf_counter() - start
    print(f"user: {args.message}\n\nassistant: {outputs[0].outputs[0].text}")
    _print_stats(outputs, elapsed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete raw text prompts")
    gen.add_argument("prompts", nargs="+")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="answer one message through the model's chat template")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="system prompt (default: the template's)")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    _add_constraint_args(chat)
    chat.set_defaults(func=cmd_chat)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    enable_compilation_cache()
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"jaxllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
