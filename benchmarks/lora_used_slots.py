"""What a decode step costs with LoRA slots used and unused: one engine with `enable_lora`
(`--max-loras` slots of rank `--rank`) and one without, on the default model (or `--model`).

    python benchmarks/lora_used_slots.py [--max-loras 4] [--rank 16] [--batch 8]
        [--reps 3] [--output-json F]

Synthetic PEFT adapters of rank `--rank` on every projection are written to a temporary
directory. Each case generates `--batch` prompts of 16 tokens greedily, and its decode step
time is (wall(8 + 48 tokens) - wall(8 tokens)) / 48 (the prefill cancels out); the median of
`--reps` alternated rounds:

- `no_lora_engine`: the engine without `enable_lora`;
- `slots_used_0`: the LoRA engine, no request naming an adapter;
- `slots_used_1`: every request with the same adapter (one slot used);
- `slots_used_all`: the requests spread over `--max-loras` adapters (every slot used).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from jaxllm.lora.adapter import lora_parts, module_dims  # noqa: E402
from jaxllm.model_executor.config import ModelConfig  # noqa: E402

SHORT, LONG, PROMPT_LEN = 8, 56, 16


def write_peft_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A PEFT directory with random A and B (B nonzero: the delta is real) on every projection
    the model's adapters may target, as PEFT names them."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (d_in, d_out) in module_dims(config).items():
        parent = lora_parts(config)[name][0]
        for i in range(config.num_hidden_layers):
            prefix = f"base_model.model.model.layers.{i}.{parent}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(
                0, 1 / math.sqrt(d_in), (rank, d_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(
                0, 0.01, (d_out, rank)).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
         "target_modules": list(module_dims(config)), "use_rslora": False,
         "use_dora": False}))


def wall(llm: LLM, prompts: list[list[int]], max_tokens: int,
         loras: list[LoRARequest | None] | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                 lora_request=loras)
    return time.perf_counter() - t


def step_ms(llm: LLM, prompts: list[list[int]], loras: Any) -> float:
    return (wall(llm, prompts, LONG, loras) - wall(llm, prompts, SHORT, loras)) \
        / (LONG - SHORT) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    common: dict[str, Any] = dict(model=args.model, max_num_seqs=args.batch,
                                  enable_prefix_caching=False, show_progress=False)
    lora_llm = LLM(**common, enable_lora=True, max_loras=args.max_loras,
                   max_lora_rank=args.rank)
    plain_llm = LLM(**common)
    config = lora_llm.llm_engine.model_config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, config.vocab_size - 100, PROMPT_LEN).tolist()
               for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        requests = []
        for i in range(1, args.max_loras + 1):
            write_peft_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i)
            requests.append(LoRARequest(f"a{i}", i, str(Path(tmp) / f"a{i}")))
        cases: dict[str, tuple[LLM, Any]] = {
            "no_lora_engine": (plain_llm, None),
            "slots_used_0": (lora_llm, None),
            "slots_used_1": (lora_llm, [requests[0]] * args.batch),
            "slots_used_all": (lora_llm, [requests[i % args.max_loras]
                                          for i in range(args.batch)]),
        }
        for llm, loras in cases.values():  # compiles, and the adapters' first reads
            wall(llm, prompts, SHORT, loras)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.reps):
            for name, (llm, loras) in cases.items():
                times[name].append(step_ms(llm, prompts, loras))
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "") if Path("/proc/cpuinfo").exists() else ""
    result = {"cpu": cpu, "model": args.model or "default", "max_loras": args.max_loras,
              "rank": args.rank, "batch": args.batch, "reps": args.reps,
              "decode_step_ms": {name: {"median": statistics.median(v), "all": v}
                                 for name, v in times.items()}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
