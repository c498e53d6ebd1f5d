"""What a draft model costs on CPU: a random-weight target shaped like Qwen2.5-1.5B drafted by
the embedded Qwen2.5-Coder-0.5B GGUF, against the target alone.

    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode_draft.py
    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode_draft.py --num-prompts 1 --rounds 1

The target (hidden 1536, 28 layers, intermediate 8960, 12 heads, 2 KV heads, the embedded
model's vocabulary of 151,936 tokens, tied embeddings) is written once, with random weights, by
transformers' `save_pretrained` in bfloat16 under --cache-dir (the file is half the size; the
engine loads it in float32, the CPU default, so its steps are the float32 ones a real 1.5B
checkpoint would run). Its weights are random, so the draft's tokens are almost never the
target's: acceptance is near zero, and what this measures is the price of each speculative
step, not a speed-up. From those prices it computes the mean accepted length at which target +
draft would break even with the target alone.

One engine per k (3, then 5: its verification bucket holds 1 + k rows), in process, one at a
time so that one copy of the target's weights is in memory. Each serves two settings that take
turns in every round, so a shared machine's drift lands on both: `off (draftK engine)` proposes
no drafts (the core's largest spec batch set to zero between requests: the target runs its
plain decode steps; the draft still follows the schedule, which costs nothing) and `draftK`.

Batch 1: --num-prompts code-edit prompts (benchmarks/data/code_edit_prompts.json, the chat
template of the embedded model applied), one at a time, greedy, --max-tokens tokens with EOS
ignored. A first, untimed pass runs each setting for 8 tokens.

Reported per setting (sums over rounds): output tok/s (tokens over the summed request times);
the target's mean decode step (TPOT, `off`) or verification step; the draft's mean proposal
(catch-up on the tokens accepted since its last one, then k - 1 decode steps) and its first
proposal per request (the prompt's catch-up); acceptance rate and mean accepted length from the
core's counters; break-even accepted length = (verify step + proposal) / TPOT of the same
engine's `off`. Greedy check: every setting must emit the first `off`'s tokens. Markdown table
on stdout, all numbers to --out (benchmarks/results/spec_decode_draft.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxllm import LLM, SamplingParams
from jaxllm.benchmarks.common import scheduler_state
from jaxllm.benchmarks.metrics import SPEC_DECODE_COUNTERS
from jaxllm.engine.core_client import InprocClient
from jaxllm.model_executor.model_loader.default_model import default_model_path
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent
CODE_PROMPTS = ROOT / "data" / "code_edit_prompts.json"
DRAFT_KS = {"draft3": 3, "draft5": 5}
# Qwen2.5-1.5B's shape with the embedded model's vocabulary.
TARGET_SHAPE = dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960,
                    num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                    tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
                    rms_norm_eps=1e-6)
TARGET_NAME = "random-qwen2-1.5b-shape"


def target_checkpoint(cache_dir: Path) -> Path:
    """The random target's checkpoint directory, written on first use."""
    path = cache_dir / TARGET_NAME
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    print(f"writing the random target to {path} (once)", file=sys.stderr)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**TARGET_SHAPE)
    model = transformers.Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tmp.rename(path)  # a write cut short leaves no directory that looks complete
    return path


def code_prompts(count: int) -> list[list[int]]:
    records = json.loads(CODE_PROMPTS.read_text())
    if count > len(records):
        raise SystemExit(f"--num-prompts {count}: {CODE_PROMPTS} holds {len(records)} prompts")
    tok = load_tokenizer(default_model_path())
    texts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
             for r in records[:count]]
    return [list(tok.encode(t, add_special_tokens=False)) for t in texts]


@dataclass
class Tally:
    """Seconds and counts per kind of work."""

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, seconds: float, count: int = 1) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.counts[key] = self.counts.get(key, 0) + count

    def mean(self, key: str) -> float | None:
        return self.seconds[key] / self.counts[key] if self.counts.get(key) else None


def instrument(core: Any) -> Tally:
    """Time the target's steps (prefill chunks apart from decode or verification steps) and the
    draft's proposals (each request's first, the prompt's catch-up, apart from the rest) into
    the returned tally."""
    tally = Tally()
    runner, drafter = core.runner, core.drafter.proposer
    step, propose = runner.execute_model, drafter.propose

    def timed_step(scheduler_output, *args, **kwargs):
        t = time.perf_counter()
        out = step(scheduler_output, *args, **kwargs)
        decode = all(r.do_sample and r.num_tokens == 1 + r.num_draft_tokens
                     for r in scheduler_output.scheduled)
        tally.add("decode" if decode else "prefill", time.perf_counter() - t)
        return out

    def timed_propose(requests):
        first = any(r.request_id not in drafter._num_computed for r in requests)
        t = time.perf_counter()
        out = propose(requests)
        tally.add("first_proposal" if first else "proposal", time.perf_counter() - t)
        return out

    runner.execute_model = timed_step
    drafter.propose = timed_propose
    return tally


def build_engine(target: Path, draft: Path, k: int, max_model_len: int) -> LLM:
    return LLM(model=str(target), skip_tokenizer_init=True, dtype="float32",
               multiprocess_mode=False, max_num_seqs=1, max_num_batched_tokens=128,
               max_model_len=max_model_len, show_progress=False,
               speculative_config={"method": "draft_model", "model": str(draft),
                                   "num_speculative_tokens": k})


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "jaxllm" / "bench",
                   help="where the random target checkpoint is written once")
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "spec_decode_draft.json")
    return p.parse_args()


def fmt(x: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def main() -> int:
    args = parse_args()
    target = target_checkpoint(args.cache_dir.expanduser())
    draft = default_model_path()
    prompts = code_prompts(args.num_prompts)
    max_model_len = -(-(max(len(p) for p in prompts) + args.max_tokens + 8) // 128) * 128
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results: dict[str, dict[str, Any]] = {}
    timers: dict[str, Tally] = {}
    outputs: dict[str, list[list[int]]] = {}
    start_s: dict[str, float] = {}
    for setting, k in DRAFT_KS.items():
        # One engine per k (its verification bucket holds 1 + k rows); `off` runs on each.
        t0 = time.perf_counter()
        llm = build_engine(target, draft, k, max_model_len)
        start_s[setting] = time.perf_counter() - t0
        client = llm.llm_engine.engine_core_client
        assert isinstance(client, InprocClient)  # the timers wrap the core's objects
        core = client.engine_core
        max_spec_seqs = core.drafter.max_spec_seqs
        live = instrument(core)  # each run's share is moved to timers[name]
        names = {"off": f"off ({setting} engine)", setting: setting}

        def run(which: str, prompt: list[int], sp: SamplingParams,
                core=core, llm=llm, max_spec_seqs=max_spec_seqs) -> tuple[list[int], float]:
            # Between requests: no drafts for `off` (a spec step holds no request), else the
            # engine's k.
            core.drafter.max_spec_seqs = 0 if which == "off" else max_spec_seqs
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            return list(out[0].outputs[0].token_ids), time.perf_counter() - t

        for which in names:  # untimed: first calls
            run(which, prompts[0], warm)
        for name in names.values():
            results[name] = {"seconds": 0.0, "tokens": 0,
                             "counters": dict.fromkeys(SPEC_DECODE_COUNTERS, 0)}
            timers[name], outputs[name] = Tally(), []
        for r in range(args.rounds):
            for which in (list(names) if r % 2 == 0 else list(names)[::-1]):
                name = names[which]
                before = scheduler_state(llm)
                live.seconds.clear()
                live.counts.clear()
                for prompt in prompts:
                    tokens, seconds = run(which, prompt, params)
                    results[name]["seconds"] += seconds
                    results[name]["tokens"] += len(tokens)
                    if r == 0:
                        outputs[name].append(tokens)
                after = scheduler_state(llm)
                for key in SPEC_DECODE_COUNTERS:
                    results[name]["counters"][key] += int(after[key]) - int(before[key])
                for key, dt in live.seconds.items():
                    timers[name].add(key, dt, live.counts[key])
                print(f"round {r} {name}: {results[name]['tokens']} tokens so far",
                      file=sys.stderr)
        llm.shutdown()
        del llm, core, client, live, run
        gc.collect()  # one target in memory at a time

    reference = outputs[f"off ({next(iter(DRAFT_KS))} engine)"]
    greedy_ok = {name: out == reference for name, out in outputs.items()}
    table = {}
    for name in results:
        res, tm = results[name], timers[name]
        c = res["counters"]
        drafts = c["num_spec_drafts"]
        draft_tokens = c["num_spec_draft_tokens"]
        accepted = c["num_spec_accepted_tokens"]
        step = tm.mean("decode")
        proposal = tm.mean("proposal")
        tpot = None if name.startswith("off") else timers[f"off ({name} engine)"].mean("decode")
        table[name] = {
            "output_tok_s": res["tokens"] / res["seconds"], "tokens": res["tokens"],
            "seconds": res["seconds"], "target_step_s": step,
            "target_prefill_s": tm.seconds.get("prefill", 0.0),
            "target_decode_total_s": tm.seconds.get("decode", 0.0),
            "draft_proposal_s": proposal, "draft_first_proposal_s": tm.mean("first_proposal"),
            "draft_total_s": tm.seconds.get("proposal", 0.0)
            + tm.seconds.get("first_proposal", 0.0),
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "break_even_accepted_length": (step + proposal) / tpot
            if step and proposal and tpot else None,
            "greedy_equals_off": greedy_ok[name], "counters": c}

    lines = ["| setting | output tok/s | target step ms | draft proposal ms | draft share of "
             "step time | acceptance | mean accepted length | break-even length |",
             "|---|---|---|---|---|---|---|---|"]
    for s, row in table.items():
        share = None
        if row["draft_total_s"]:
            share = row["draft_total_s"] / (row["draft_total_s"] + row["target_decode_total_s"])
        lines.append(f"| {s} | {fmt(row['output_tok_s'], '.2f')} | "
                     f"{fmt(row['target_step_s'], '.0f', 1e3)} | "
                     f"{fmt(row['draft_proposal_s'], '.0f', 1e3)} | {fmt(share, '.0%')} | "
                     f"{fmt(row['acceptance_rate'], '.3f')} | "
                     f"{fmt(row['mean_accepted_length'], '.2f')} | "
                     f"{fmt(row['break_even_accepted_length'], '.2f')} |")
    print("\n".join(lines))
    print("\nTarget step: TPOT for off, the verification step otherwise. The draft's first "
          "proposal per request (the prompt's catch-up): "
          + ", ".join(f"{s} {fmt(table[s]['draft_first_proposal_s'], '.0f', 1e3)} ms"
                      for s in DRAFT_KS)
          + ". Random target weights: acceptance near 0 is expected. Engine start: "
          + ", ".join(f"{s} {v:.0f} s" for s, v in start_s.items()) + ".")
    bad = [s for s, ok in greedy_ok.items() if not ok]
    if bad:
        print(f"GREEDY MISMATCH: {bad} differ from off", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "target": {"shape": TARGET_SHAPE, "checkpoint": str(target), "dtype": "float32"},
        "draft": str(draft), "num_prompts": args.num_prompts, "prompt_lens":
        [len(p) for p in prompts], "max_tokens": args.max_tokens, "rounds": args.rounds,
        "engine_start_s": start_s, "settings": table}, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
