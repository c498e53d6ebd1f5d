"""Process 0 of a two-process engine (test_tp_multihost.py starts it and the follower, each
with two virtual CPU devices and JAXLLM_* variables): TP = 4 over both processes, greedy
PROMPTS; writes the tokens (or the error) to OUT as JSON.

usage: python tests/distributed/tp_multihost_child.py CHECKPOINT OUT.json [--then-wait-for FILE]
  --then-wait-for: after the first generate, write OUT.json.ready and wait for FILE, then
  generate again (the test kills the follower in between) and record the error.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PROMPTS = [[5, 6, 7, 8], list(range(10, 40)), [3] * 17]
MAX_NEW = 6
ENGINE = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=16, num_kv_blocks=64, show_progress=False,
              topk_sampling=True)


def sampling_params() -> list:
    """Greedy with prompt logprobs; the last prompt with a repetition penalty, whose rows need
    their full logits (gathered across processes)."""
    from jaxllm import SamplingParams

    sp = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=2)
    return [SamplingParams(**sp)] * (len(PROMPTS) - 1) + [
        SamplingParams(**sp, repetition_penalty=1.5)]


def _generate(llm) -> dict:
    t = time.perf_counter()
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling_params(),
                            use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - what a dead follower looks like is the result
        return {"error": f"{type(e).__name__}: {e}"[:500], "seconds": time.perf_counter() - t}
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "prompt_logprobs": [[lp[tok].logprob for lp, tok in zip(
                o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)] for o in outs]}


def main() -> None:
    from jaxllm import LLM

    path, out = sys.argv[1], Path(sys.argv[2])
    kill_test = len(sys.argv) > 3
    # The kill test runs the engine core in its own process, as a GPU frontend does: the
    # frontend must see EngineDeadError.
    llm = LLM(model=path, tensor_parallel_size=4, multiprocess_mode=kill_test, **ENGINE)
    result = {"first": _generate(llm)}
    out.write_text(json.dumps(result))
    if kill_test:
        Path(str(out) + ".ready").write_text("up")
        while not Path(sys.argv[4]).exists():
            time.sleep(0.05)
        result["after_kill"] = _generate(llm)
        out.write_text(json.dumps(result))
        llm.llm_engine.shutdown()
        raise SystemExit(3 if "error" in result["after_kill"] else 0)
    # The followers exit when process 0 does (multihost.attach registers Leader.stop).


if __name__ == "__main__":
    main()
