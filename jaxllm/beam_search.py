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


def step_params(params: BeamSearchParams) -> SamplingParams:
    """The SamplingParams of each beam's one-token request. Greedy: the step's own token is not
    used, only the ranked candidates (rank 1 first)."""
    return SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True,
                          temperature=0.0)


@dataclass
class _Instance:
    prompt_len: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """The search's state for some prompts, driven by a caller that runs the steps' requests
    (`beam_search` below, or the server's asyncio loop): `step_prompts()` gives the token ids
    of the next step's requests (None once the search is over), `advance` takes each request's
    ranked candidates (its output's `logprobs[0]`), `results` the best beams."""

    def __init__(self, prompt_token_ids: Sequence[Sequence[int]], params: BeamSearchParams,
                 eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.steps = 0
        self._instances = [_Instance(len(ids), [BeamSearchSequence(list(ids))])
                           for ids in prompt_token_ids]
        self._live: list[tuple[_Instance, BeamSearchSequence]] = []

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_ids,
                                 self.params.length_penalty)

    def step_prompts(self) -> list[list[int]] | None:
        if self.steps >= self.params.max_tokens:
            return None
        for inst in self._instances:
            # A beam at the model's length cannot take another token.
            full = [b for b in inst.beams if len(b.tokens) >= self.max_model_len]
            for b in full:
                b.finish_reason = "length"
            inst.completed.extend(full)
            inst.beams = [b for b in inst.beams if len(b.tokens) < self.max_model_len]
        self._live = [(inst, beam) for inst in self._instances for beam in inst.beams]
        return [beam.tokens for _, beam in self._live] or None

    def advance(self, ranked_rows: Sequence[dict[int, Logprob]]) -> None:
        if len(ranked_rows) != len(self._live):
            raise ValueError(f"advance: {len(ranked_rows)} rows for {len(self._live)} beams")
        ignore_eos = self.params.ignore_eos
        grown: dict[int, list[BeamSearchSequence]] = {id(i): [] for i in self._instances}
        for (inst, beam), ranked in zip(self._live, ranked_rows, strict=True):
            for token, lp in ranked.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [ranked],
                                         beam.cum_logprob + lp.logprob)
                if token in self.eos_token_ids and not ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    inst.completed.append(new)
                else:
                    grown[id(inst)].append(new)
        width = self.params.beam_width
        for inst in self._instances:
            inst.beams = sorted(grown[id(inst)], key=self._score, reverse=True)[:width]
        self._live = []
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str] | None = None
                ) -> list[BeamSearchOutput]:
        """Per prompt, the best beams, best first; `decode` turns generated token ids into
        text (None: no text)."""
        out = []
        for inst in self._instances:
            for beam in inst.beams:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(inst.completed + inst.beams, key=self._score,
                          reverse=True)[:self.params.beam_width]
            if decode is not None:
                for beam in best:
                    generated = beam.tokens[inst.prompt_len:]
                    if beam.finish_reason == "stop" and \
                            not self.params.include_stop_str_in_output:
                        generated = generated[:-1]
                    beam.text = decode(generated)
            out.append(BeamSearchOutput(best))
        return out


def beam_search(generate: Callable[[list[Any], SamplingParams], list[Any]],
                prompt_token_ids: list[list[int]], params: BeamSearchParams,
                eos_token_ids: frozenset[int], max_model_len: int,
                decode: Callable[[list[int]], str] | None = None,
                on_step: Callable[[], object] | None = None) -> list[BeamSearchOutput]:
    """Run the search for each prompt. `generate(prompts, sampling_params)` is LLM.generate
    without its progress bar; `decode` turns generated token ids into text (None: no text)."""
    search = BeamSearch(prompt_token_ids, params, eos_token_ids, max_model_len)
    sp = step_params(params)
    while (prompts := search.step_prompts()) is not None:
        outputs = generate([{"prompt_token_ids": p} for p in prompts], sp)
        search.advance([out.outputs[0].logprobs[0] for out in outputs])
        if on_step is not None:
            on_step()
    return search.results(decode)
