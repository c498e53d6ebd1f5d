"""Benchmark workloads: synthetic prompts of random ordinary token ids, or records read from a
JSON / JSONL dataset."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jaxllm import LLM


@dataclass
class Workload:
    """Prompts (token ids) and the number of tokens each must generate."""

    prompts: list[list[int]]
    output_lens: list[int]
    description: str = ""

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def summary(self) -> dict[str, Any]:
        p, o = self.prompt_lens, self.output_lens
        return {"description": self.description, "num_requests": len(self),
                "total_prompt_tokens": int(sum(p)), "total_output_tokens": int(sum(o)),
                "prompt_len_min": int(min(p)), "prompt_len_max": int(max(p)),
                "output_len_min": int(min(o)), "output_len_max": int(max(o))}


class TokenSampler:
    """Random ordinary token ids: [0, vocab) minus the tokenizer's special / added tokens (or the
    config's BOS/EOS when there is no tokenizer)."""

    def __init__(self, vocab_size: int, tokenizer=None, special_ids: set[int] | None = None):
        hi = vocab_size
        special = set(special_ids or ())
        if tokenizer is not None:
            hi = min(vocab_size, len(tokenizer))
            special |= set(getattr(tokenizer, "all_special_ids", ()) or ())
            special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        allowed = np.setdiff1d(np.arange(hi, dtype=np.int64),
                               np.fromiter(special, np.int64, len(special)))
        if allowed.size == 0:
            raise ValueError("no ordinary token ids to draw synthetic prompts from")
        self.allowed = allowed

    def sample(self, rng: np.random.Generator, length: int) -> list[int]:
        return [int(t) for t in rng.choice(self.allowed, size=length)]


def token_sampler_for(llm: LLM) -> TokenSampler:
    engine = llm.llm_engine
    cfg = engine.model_config
    special = {t for t in (cfg.bos_token_id, cfg.eos_token_id) if t is not None}
    special |= set(engine.eos_token_ids)
    return TokenSampler(cfg.vocab_size, engine.tokenizer, special)


def _lengths(rng: np.random.Generator, n: int, fixed: int, rng_range: list[int] | None,
             name: str) -> list[int]:
    if rng_range is None:
        if fixed < 1:
            raise ValueError(f"--{name}-len must be >= 1, got {fixed}")
        return [fixed] * n
    lo, hi = rng_range
    if not 1 <= lo <= hi:
        raise ValueError(f"--random-{name}-range needs 1 <= A <= B, got {lo} {hi}")
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def synthetic_workload(sampler: TokenSampler, num_prompts: int, input_len: int, output_len: int,
                       seed: int, input_range: list[int] | None = None,
                       output_range: list[int] | None = None) -> Workload:
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_prompts, input_len, input_range, "input")
    out_lens = _lengths(rng, num_prompts, output_len, output_range, "output")
    prompts = [sampler.sample(rng, n) for n in in_lens]
    ins = f"input {input_range[0]}-{input_range[1]}" if input_range else f"input {input_len}"
    outs = (f"output {output_range[0]}-{output_range[1]}" if output_range
            else f"output {output_len}")
    return Workload(prompts, out_lens, f"{num_prompts} random prompts, {ins}, {outs}")


def prefix_repetition_workload(sampler: TokenSampler, num_prompts: int, prefix_len: int,
                               suffix_len: int, num_prefixes: int, output_len: int,
                               seed: int) -> Workload:
    """vLLM's `prefix_repetition` dataset: `num_prefixes` random prefixes of `prefix_len` tokens
    (shared system prompts), each opening `num_prompts // num_prefixes` prompts that go on with
    a random suffix of their own (`suffix_len` tokens), in a seeded random order so that the
    prefix groups interleave as independent users' requests would."""
    if num_prefixes < 1:
        raise ValueError(f"--prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}")
    per_prefix = num_prompts // num_prefixes
    if per_prefix < 1:
        raise ValueError(f"--num-prompts ({num_prompts}) must be at least "
                         f"--prefix-repetition-num-prefixes ({num_prefixes})")
    if prefix_len < 1 or suffix_len < 0 or output_len < 1:
        raise ValueError("--prefix-repetition-prefix-len and -output-len must be >= 1 and "
                         "-suffix-len >= 0")
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num_prefixes):
        prefix = sampler.sample(rng, prefix_len)
        prompts += [prefix + sampler.sample(rng, suffix_len) for _ in range(per_prefix)]
    order = rng.permutation(len(prompts))
    return Workload([prompts[i] for i in order], [output_len] * len(prompts),
                    f"{len(prompts)} prompts, {num_prefixes} shared prefixes of {prefix_len} "
                    f"tokens + {suffix_len} random, output {output_len}")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON (a list of objects) or JSONL (one object a line) file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"dataset {path}: {e}") from e
    try:
        records = json.loads(text)
        if isinstance(records, dict):
            records = [records]
    except json.JSONDecodeError:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset {path}, line {lineno}: {e}") from e
    if not isinstance(records, list) or not records:
        raise ValueError(f"dataset {path}: expected a non-empty list of records")
    return records


def load_dataset(path: str | Path, tokenizer, default_output_len: int,
                 num_prompts: int | None = None) -> Workload:
    """JSON (a list of records) or JSONL (one record a line). A record has "prompt" (text, needs
    the tokenizer) or "prompt_token_ids", and optionally "output_len"."""
    path = Path(path)
    records = read_records(path)
    if num_prompts is not None:
        records = records[:num_prompts]
    prompts, out_lens = [], []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"dataset {path}, record {i}: not an object")
        if "prompt_token_ids" in rec:
            ids = [int(t) for t in rec["prompt_token_ids"]]
        elif "prompt" in rec:
            if tokenizer is None:
                raise ValueError(f"dataset {path}, record {i}: a text prompt needs the "
                                 f"tokenizer (drop --skip-tokenizer-init)")
            ids = list(tokenizer.encode(rec["prompt"]))
        else:
            raise ValueError(f"dataset {path}, record {i}: needs 'prompt' or 'prompt_token_ids'")
        if not ids:
            raise ValueError(f"dataset {path}, record {i}: empty prompt")
        out_len = int(rec.get("output_len", default_output_len))
        if out_len < 1:
            raise ValueError(f"dataset {path}, record {i}: output_len must be >= 1")
        prompts.append(ids)
        out_lens.append(out_len)
    return Workload(prompts, out_lens, f"{len(prompts)} prompts from {path.name}")
