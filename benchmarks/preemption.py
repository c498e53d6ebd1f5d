"""What preemption costs when the KV cache runs out: the scheduler alone, no model.

    python benchmarks/preemption.py [--output-json F]

Two workloads, each with prefix caching on and off:

- lockstep: requests arrive at once and grow together past what the pool holds (the
  long-context case: every request needs more blocks every few steps);
- mixed: requests of random prompt and output lengths arrive a few per step (seeded), in a
  pool that holds about half of what they need at their peak.

Each step's outputs are made up (one token per sampled request), so the numbers count work,
not time: the steps until all finish (one model call each), the tokens computed (the
model's work), how many of those were computed again after a preemption, and the
preemptions. A request's ideal is its prompt and its output tokens but the last, computed once.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import Request, Scheduler, SchedulerConfig  # noqa: E402

BLOCK_SIZE = 16


def lockstep(num_requests: int = 24, prompt_len: int = 256, output_len: int = 2048,
             num_blocks: int = 1600) -> list[tuple[int, Request]]:
    # 24 requests of 2,304 tokens need 3,456 blocks; the pool holds about half.
    return [(0, Request(f"r{i}", list(range(i * 7, i * 7 + prompt_len)), max_tokens=output_len,
                        ignore_eos=True)) for i in range(num_requests)]


def mixed(seed: int = 0, num_requests: int = 200) -> list[tuple[int, Request]]:
    rng = random.Random(seed)
    arrivals = []
    step = 0
    for i in range(num_requests):
        step += rng.choice((0, 0, 1, 2, 4))
        prompt = [rng.randrange(1, 30000) for _ in range(rng.randint(16, 1500))]
        arrivals.append((step, Request(f"m{i}", prompt, max_tokens=rng.randint(16, 1200),
                                       ignore_eos=True)))
    return arrivals


def run(arrivals: list[tuple[int, Request]], num_blocks: int, prefix_caching: bool,
        max_num_batched_tokens: int = 512) -> dict:
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=256, max_num_batched_tokens=max_num_batched_tokens, max_model_len=8192,
        block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_caching=prefix_caching))
    pending = sorted(arrivals, key=lambda a: a[0])
    ideal = computed = steps = 0
    # Per request, the most tokens it ever had computed: what it computes beyond that is
    # computed again.
    high: dict[str, int] = {}
    recomputed = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= steps:
            sched.add_request(pending.pop(0)[1])
        out = sched.schedule()
        for item in out.scheduled:
            n = len(item.token_ids)
            computed += n
            top = high.get(item.request_id, 0)
            recomputed += max(0, min(item.start_position + n, top) - item.start_position)
            high[item.request_id] = max(top, item.start_position + n)
        sched.update_from_output(out, {r.request_id: [1] for r in out.scheduled if r.do_sample})
        steps += 1
    for _, request in arrivals:
        ideal += request.num_prompt_tokens + request.num_output_tokens - 1
    return {"steps": steps, "tokens_computed": computed, "tokens_ideal": ideal,
            "tokens_recomputed": recomputed, "preemptions": sched.num_preemptions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-json")
    args = parser.parse_args()
    results = []
    for name, make, num_blocks in (("lockstep", lockstep, 1600), ("mixed", mixed, 3000)):
        for prefix_caching in (True, False):
            row = {"workload": name, "num_blocks": num_blocks, "prefix_caching": prefix_caching,
                   **run(make(), num_blocks, prefix_caching)}
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"block_size": BLOCK_SIZE,
                                                      "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
