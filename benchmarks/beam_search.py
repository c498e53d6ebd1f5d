"""LLM.beam_search against greedy generate on the same prompt: wall time of each, beam widths
given on the command line, repeats taking turns in one process. Prints one JSON line per
measurement and writes them to --output."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--prompt", default="def quicksort(arr):")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--beam-widths", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", default="benchmarks/results/beam_search.json")
    args = p.parse_args()

    from jaxllm import LLM, BeamSearchParams, SamplingParams

    llm = LLM(args.model, max_num_seqs=16, show_progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([args.prompt], greedy, use_tqdm=False)  # warm-up
    rows = []
    for r in range(args.repeats):
        t = time.perf_counter()
        llm.generate([args.prompt], greedy, use_tqdm=False)
        rows.append({"repeat": r, "what": "greedy", "s": time.perf_counter() - t})
        print(json.dumps(rows[-1]), flush=True)
        for width in args.beam_widths:
            params = BeamSearchParams(beam_width=width, max_tokens=args.max_tokens,
                                      ignore_eos=True)
            t = time.perf_counter()
            llm.beam_search([args.prompt], params)
            rows.append({"repeat": r, "what": f"beam_width {width}",
                         "s": time.perf_counter() - t})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()
