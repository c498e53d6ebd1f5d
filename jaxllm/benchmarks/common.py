"""What every `jaxllm bench` command shares: the engine it builds from the flags, the checks and
references around a run (max_model_len, warm-up, machine measurement, HF runner) and writing the
result JSON."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxllm.benchmarks.datasets import TokenSampler, Workload
from jaxllm.benchmarks.hf_runner import HFRunner
from jaxllm.config import resolve_model
from jaxllm.engine.arg_utils import EngineArgs

if TYPE_CHECKING:
    from jaxllm import LLM


def repeat_ms(f: Callable[[], object], reps: int) -> list[float]:
    """Wall milliseconds of `reps` calls of f, after one untimed warm-up call."""
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(1e3 * (time.perf_counter() - t))
    return times


def sampling_params(out_len: int, ignore_eos: bool):
    from jaxllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=ignore_eos)


def warm_up(llm: LLM, sampler: TokenSampler) -> None:
    """One short request, so first-call costs do not land in the measurement."""
    rng = np.random.default_rng(12345)
    llm.generate([{"prompt_token_ids": sampler.sample(rng, 4)}], sampling_params(2, True),
                 use_tqdm=False)


def scheduler_state(llm: LLM) -> dict[str, int]:
    """The core's counters (get_scheduler_state), in either engine mode."""
    return llm.llm_engine.engine_core_client.call_utility("get_scheduler_state")


def make_llm(args: argparse.Namespace, max_num_seqs: int) -> LLM:
    from jaxllm import LLM

    # The HF baseline reads args.model later: it gets the resolved checkpoint too.
    if args.model is not None:
        args.model = str(resolve_model(args.model, args.revision, args.download_dir))
    return LLM.from_engine_args(EngineArgs.from_cli_args(
        args, max_num_seqs=max_num_seqs, show_progress=not args.no_progress))


def check_fits(llm: LLM, workload: Workload) -> None:
    longest = max(p + o for p, o in zip(workload.prompt_lens, workload.output_lens, strict=True))
    limit = llm.llm_engine.max_model_len
    if longest > limit:
        raise ValueError(f"a request needs {longest} tokens (prompt + output) but max_model_len "
                         f"is {limit}; raise --max-model-len")


def machine_for(args: argparse.Namespace, llm: LLM) -> dict[str, float] | None:
    """The roofline's machine rates, measured by the engine core (its device, dtype and matmul
    precision): this process starts no backend of its own beside it."""
    if args.no_roofline:
        return None
    return llm.collective_rpc("measure_machine",
                              (args.roofline_gemm_size, args.roofline_copy_mib))


def make_hf_runner(args: argparse.Namespace, llm: LLM) -> HFRunner:
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its GGUF conversion and weight-loading bars
    return HFRunner(args.model, llm.llm_engine.describe()["dtype"])


def profile_max_seqs(args: argparse.Namespace, need: int) -> int:
    if args.max_num_seqs is not None:
        return args.max_num_seqs
    if getattr(args, "profile", False):
        need = max(need, *args.profile_batch_sizes)
    return need


def finish(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"results written to {path}")


def args_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("func",)}

