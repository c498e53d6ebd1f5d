"""Beam search over the engine, as vLLM's `LLM.beam_search`.

Each step submits every live beam (its prompt and the tokens it chose so far) as a prompt for one
token with its top 2 x beam_width logprobs; each candidate extends its beam's cumulative logprob;
a candidate that is an end-of-sequence token completes its beam (unless ignore_eos); the best
beam_width of the rest, by `beam_search_score`, go on. The prefix cache holds every beam's
earlier positions, so a step computes little beyond each beam's last, partly filled KV block.
At the end the completed beams and the live ones are ranked together and the best beam_width
returned. Scores are the model's raw logprobs (those `SamplingParams.logprobs` reports), so
`temperature` does not change the search.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxllm.outputs import Logprob
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams (each step ranks 2 x beam_width candidates
    per beam), up to `max_tokens` new tokens; `length_penalty` divides a beam's cumulative
    logprob by its length (prompt included) to this power; `include_stop_str_in_output` keeps a
    final end-of-sequence token's text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        most = MAX_LOGPROBS // 2
        for name, low, high in (("beam_width", 1, most), ("max_tokens", 1, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (
                    high is not None and value > high):
                limit = f"[{low}, {high}]" if high is not None else f">= {low}"
                why = f" (each step asks for 2 x beam_width logprobs, at most {MAX_LOGPROBS})" \
                    if name == "beam_width" else ""
                raise ValueError(f"BeamSearchParams.{name} must be an integer in {limit}{why}, "
                                 f"got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"BeamSearchParams.{name} must be a finite number, got "
                                 f"{value!r}")
        if self.temperature < 0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got "
                             f"{self.temperature!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BeamSearchParams.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's and the generated ones; `logprobs` one dict per
    generated token (the candidates its step ranked); `text` the generated tokens' text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop": an end-of-sequence token; "length"
    stop_reason: int | None = None    # the end-of-sequence token that ended it


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: Sequence[int], cum_logprob: float, eos_token_ids: frozenset[int],
                      length_penalty: float = 1.0) -> float:
    """vLLM's score: the cumulative logprob over the length (prompt included, a final
    end-of-sequence token not) to the power `length_penalty`."""
    n = len(tokens)
    if n and tokens[-1] in eos_token_ids:
        n -= 1
    return cum_logprob / (n ** length_penalty)


@dataclass
class _Instance:
    prompt_len: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(generate: Callable[[list[Any], SamplingParams], list[Any]],
                prompt_token_ids: list[list[int]], params: BeamSearchParams,
                eos_token_ids: frozenset[int], max_model_len: int,
                decode: Callable[[list[int]], str] | None = None,
                on_step: Callable[[], None] | None = None) -> list[BeamSearchOutput]:
    """Run the search for each prompt. `generate(prompts, sampling_params)` is LLM.generate
    without its progress bar; `decode` turns generated token ids into text (None: no text)."""
    width = params.beam_width
    # Greedy: the step's own token is not used, only the ranked candidates (rank 1 first).
    step_params = SamplingParams(max_tokens=1, logprobs=2 * width, ignore_eos=True,
                                 temperature=0.0)

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos_token_ids,
                                 params.length_penalty)

    instances = [_Instance(len(ids), [BeamSearchSequence(list(ids))]) for ids in prompt_token_ids]
    for _ in range(params.max_tokens):
        for inst in instances:
            # A beam at the model's length cannot take another token.
            full = [b for b in inst.beams if len(b.tokens) >= max_model_len]
            for b in full:
                b.finish_reason = "length"
            inst.completed.extend(full)
            inst.beams = [b for b in inst.beams if len(b.tokens) < max_model_len]
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        outputs = generate([{"prompt_token_ids": beam.tokens} for _, beam in live], step_params)
        candidates: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), out in zip(live, outputs, strict=True):
            logprobs = out.outputs[0].logprobs
            assert logprobs, "a beam step returns its logprobs"
            ranked = logprobs[0]
            for token, lp in ranked.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [ranked],
                                         beam.cum_logprob + lp.logprob)
                if token in eos_token_ids and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    inst.completed.append(new)
                else:
                    candidates[id(inst)].append(new)
        for inst in instances:
            inst.beams = sorted(candidates[id(inst)], key=score, reverse=True)[:width]
        if on_step is not None:
            on_step()
    results = []
    for inst in instances:
        for beam in inst.beams:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(inst.completed + inst.beams, key=score, reverse=True)[:width]
        if decode is not None:
            for beam in best:
                generated = beam.tokens[inst.prompt_len:]
                if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                    generated = generated[:-1]
                beam.text = decode(generated)
        results.append(BeamSearchOutput(best))
    return results
