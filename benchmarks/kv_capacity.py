"""How many long requests one KV budget serves at once, with the KV cache groups of a model
that mixes full and sliding-window layers and with one group for every layer
(`disable_hybrid_kv_cache_manager`).

    python benchmarks/kv_capacity.py [--budget-gib 16] [--contexts 8192 32768 131072]
        [--max-num-batched-tokens 512] [--output-json F]

For each model shape (no weights are needed) and context length L, the budget is cut into
blocks as the engine cuts it (`kv_block_bytes` of the groups' layer count, bfloat16), and the
real Scheduler is run with no model: requests of a 128-token prompt that generate up to L
tokens, three times as many as its bound says fit (and two, at most 160), arrive at once and
are scheduled in steps of the engine's default token budget until all have finished (each
step's outputs made up, prefix caching off). The measure is the most requests holding at least
L - 256 tokens of context at once (the pool's long-context concurrency: as they grow, the
latest are preempted), with the preemptions and the steps. `max_concurrency` is
EngineCoreInfo's bound (usable blocks over the blocks a request of L tokens may hold while a
chunk of its prompt is computed); where a pool holds no such request, the scheduler's refusal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxllm.model_executor.config import ModelConfig  # noqa: E402
from jaxllm.model_executor.kv_cache_groups import kv_cache_groups  # noqa: E402
from jaxllm.worker.model_runner import kv_block_bytes  # noqa: E402
from scheduler import Request, Scheduler, SchedulerConfig, prompt_blocks_needed  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 128
# Requests count as long once this close to the context length.
LONG_TAIL = 256
MAX_REQUESTS = 160

# Hugging Face config fields of the shapes (the published configs' attention sizes).
SHAPES = {
    "gemma-2-9b": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                   "num_hidden_layers": 42, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584,
                   "sliding_window": 4096, "max_position_embeddings": 8192},
    "gemma-3-1b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                   "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
                   "head_dim": 256, "hidden_size": 1152, "sliding_window": 512,
                   "sliding_window_pattern": 6, "max_position_embeddings": 32768},
    "gemma-3-27b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                    "num_hidden_layers": 62, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376,
                    "sliding_window": 1024, "sliding_window_pattern": 6,
                    "max_position_embeddings": 131072},
}


def model_config(name: str) -> ModelConfig:
    fields = {"vocab_size": 1024, "intermediate_size": 1024, **SHAPES[name]}
    return ModelConfig.from_hf_config(fields)


def run(config: ModelConfig, context: int, budget: int, hybrid: bool, chunk: int) -> dict:
    groups = kv_cache_groups(config, context, hybrid)
    per_block = kv_block_bytes(config, BLOCK_SIZE, jnp.bfloat16, groups.num_slots)
    num_blocks = budget // per_block
    need = prompt_blocks_needed(context, BLOCK_SIZE, groups.windows, chunk)
    bound = (num_blocks - 1) / need
    row = {"groups": len(groups.windows), "layers_per_block": groups.num_slots,
           "block_bytes": per_block, "num_blocks": num_blocks, "blocks_per_request": need,
           "max_concurrency": round(bound, 2)}
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=1024, max_num_batched_tokens=chunk, max_model_len=context,
        block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_caching=False,
        kv_group_windows=groups.windows))
    if bound < 1:
        try:
            sched.add_request(Request("r", [1] * context, max_tokens=1))
        except ValueError as e:
            return {**row, "refused": str(e)}
    num_requests = min(3 * int(bound) + 2, MAX_REQUESTS)
    for i in range(num_requests):
        # Distinct tokens per request: no prefix is shared.
        prompt = list(range(i * 7, i * 7 + PROMPT_LEN))
        sched.add_request(Request(f"r{i}", prompt, max_tokens=context - PROMPT_LEN,
                                  ignore_eos=True))
    steps = most_long = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        most_long = max(most_long, sum(1 for r in sched.running
                                       if r.num_computed_tokens >= context - LONG_TAIL))
        sched.update_from_output(out, {r.request_id: [1] for r in out.scheduled if r.do_sample})
        steps += 1
    return {**row, "requests": num_requests, "most_long_at_once": most_long,
            "preemptions": sched.num_preemptions, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="the step's token budget (the engine's default)")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    results = []
    for name in SHAPES:
        config = model_config(name)
        for context in args.contexts:
            if context > config.max_context_len:
                continue
            row = {"model": name, "context": context}
            for mode, hybrid in (("hybrid", True), ("one_group", False)):
                row[mode] = run(config, context, budget, hybrid, args.max_num_batched_tokens)
            one = row["one_group"].get("most_long_at_once", 0)
            row["gain"] = round(row["hybrid"]["most_long_at_once"] / one, 2) if one else None
            print(json.dumps(row), flush=True)
            results.append(row)
    doc = {"budget_bytes": budget, "block_size": BLOCK_SIZE,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "kv_dtype": "bfloat16", "results": results}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
