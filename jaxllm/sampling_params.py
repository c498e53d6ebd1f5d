"""Per-request sampling parameters, named, defaulted and validated as in vLLM."""

from __future__ import annotations

import copy
import enum
import math
import numbers
import re
from dataclasses import dataclass, field, fields
from typing import Any

# Most top logprobs a request may ask for per position (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Integer fields travel to the engine core as msgpack integers and into int64 row arrays (top_k),
# token ids into int32 arrays: larger values are refused here, naming the field, rather than
# overflowing later inside a step.
INT64_MAX = 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1


class RequestOutputKind(enum.IntEnum):
    """What a streaming caller (AsyncLLM.generate) gets per step, as vLLM's."""

    CUMULATIVE = 0  # everything so far, each time
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


_CANONICAL_INT = re.compile(r"0|[1-9][0-9]{0,9}")

_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text, as vLLM's: exactly one of

    - `json`: a JSON schema (dict, or its JSON text): the output is a JSON value it accepts;
    - `json_object`: True: the output is any JSON object;
    - `regex`: the output matches the regular expression (Rust `regex` syntax, anchored);
    - `choice`: the output is one of these strings;
    - `grammar`: the output is a sentence of this Lark grammar (llguidance's dialect: rules
      `name: ...`, start rule `start`) or GBNF grammar (llama.cpp's: rules `name ::= ...`,
      start rule `root`).

    `disable_any_whitespace` allows no whitespace between JSON tokens (a small or untrained
    model may otherwise wander in whitespace); `whitespace_pattern` (a regex) replaces the
    default whitespace between them; `disable_additional_properties` closes every object of the
    schema that does not say otherwise. An invalid schema, regex or grammar raises ValueError
    here, naming it, before any request is queued.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The llguidance grammar of the constraint once validated (vLLM keeps its backend choice in
    # private fields too): it travels with the request, so the engine core compiles this text
    # instead of converting and validating the client's constraint again.
    _grammar: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"SamplingParams.structured_outputs must set exactly one of "
                             f"{', '.join(_STRUCTURED_KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json_object is not None and self.json_object is not True:
            raise self._bad("json_object", "must be True or None")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise self._bad("json", "must be a JSON schema (a dict or its JSON text)")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise self._bad(name, "must be a string")
        if self.grammar is not None and not self.grammar.strip():
            raise self._bad("grammar", "must not be empty")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if (not isinstance(self.choice, list) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise self._bad("choice", "must be a non-empty list of non-empty strings")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "must be a bool")
        if self._grammar is None:
            from jaxllm.structured_output.grammar import validate_grammar

            self._grammar = validate_grammar(self)

    def llguidance_grammar(self) -> str:
        """The constraint's llguidance grammar (validated when these params were built)."""
        if self._grammar is None:
            from jaxllm.structured_output.grammar import build_grammar

            self._grammar = build_grammar(self)
        return self._grammar

    def _bad(self, name: str, why: str) -> ValueError:
        return ValueError(f"SamplingParams.structured_outputs.{name} {why}, "
                          f"got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, json_object, regex, choice or grammar."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) is not None)

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> StructuredOutputsParams:
        """From a JSON object (the server's `structured_outputs` field); unknown keys are an
        error naming them."""
        if not isinstance(spec, dict):
            raise ValueError(f"SamplingParams.structured_outputs must be an object, got "
                             f"{type(spec).__name__}")
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs has unknown fields {unknown}; "
                             f"known: {sorted(known)}")
        return cls(**spec)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Invalid values raise ValueError naming the field,
    as `SamplingParams.<field> must ..., got <value>`.

    temperature 0 (or below 1e-5) means greedy; then top_p, top_k and min_p are reset to their
    disabled values, as vLLM does. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0 disable
    theirs. `seed` -1 means no seed (None), as in vLLM's OpenAI server; other negative seeds are
    refused. A request's random draws depend only on its `seed` (or the engine seed and its
    request index), never on the other requests in the batch.

    max_tokens None means "up to the model's max_model_len". `logprobs` N asks for the top-N
    log-probabilities (plus the sampled token's) per generated token; `prompt_logprobs` N the same
    per prompt token; both are of the model's raw distribution and at most MAX_LOGPROBS.
    `logit_bias` maps token id -> value added to that token's logit before anything else.
    `output_kind` (RequestOutputKind) is what AsyncLLM.generate yields per step; LLM.generate
    always returns final outputs. `structured_outputs` (StructuredOutputsParams, or a dict of
    its fields) constrains the output to a JSON schema, regex, choice or grammar: tokens it
    forbids are masked before any other logits processing, EOS is allowed only where the
    constraint is complete, and logprobs stay those of the raw distribution.

    As in vLLM V1, the logits are processed in this order: the structured-output mask and
    `allowed_token_ids` (every other token -inf), `bad_words`, logit_bias, min_tokens, then the
    penalties. `allowed_token_ids` (a non-empty list of token ids in the vocabulary): only these
    may be sampled. `bad_words` (strings): never generated; each is tokenized (without special
    tokens) as given, its leading whitespace removed, and again after one space when that
    spelling starts with another token but has as many (vLLM's rule); at each step, for each such
    token sequence whose all-but-last tokens are the last output tokens, its last token is -inf
    (a one-token word is always banned). Tokenizing takes the engine's tokenizer, so they are
    refused under skip_tokenizer_init. `truncate_prompt_tokens` k keeps only the last k prompt
    tokens (k >= 1; -1: the most the model takes, max_model_len - 1), before the prompt's
    length is checked; the output's prompt_token_ids are the kept ones.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # The bad words as token-id sequences, filled by the frontend's Processor (where the
    # tokenizer lives) and sent with the request, so the engine core never tokenizes (vLLM's
    # `_bad_words_token_ids`).
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False,
                                                          compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise self._bad("structured_outputs", "must be StructuredOutputsParams, a dict of "
                            "its fields, or None")
        if self.stop is None:
            stop = []
        elif isinstance(self.stop, str):
            stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            stop = list(self.stop)
        else:
            raise self._bad("stop", "must be a string, a list of strings or None")
        if any(not isinstance(s, str) or not s for s in stop):
            raise self._bad("stop", "must be non-empty strings")
        self.stop = stop
        if self.stop_token_ids is None:
            stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            why = f"must be integers in [0, {TOKEN_ID_MAX}]"
            stop_token_ids = [self._int(t, "stop_token_ids", why, 0, TOKEN_ID_MAX)
                              for t in self.stop_token_ids]
        else:
            raise self._bad("stop_token_ids", "must be a list of non-negative integers or None")
        self.stop_token_ids = stop_token_ids
        if self.logit_bias is not None:
            self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self._verify_token_lists()
        self._verify()
        if self.greedy:
            # As vLLM: greedy ignores the truncation knobs.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    # ---- validation -----------------------------------------------------------------------

    def _bad(self, name: str, why: str, value: object = None) -> ValueError:
        if value is None:
            value = getattr(self, name, None)
        return ValueError(f"SamplingParams.{name} {why}, got {value!r}")

    def _int(self, value: object, name: str, why: str, lo: int = -INT64_MAX - 1,
             hi: int = INT64_MAX) -> int:
        """An integer in [lo, hi] (bool and non-integral numbers refused), as a plain int."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise self._bad(name, why, value)
        if not lo <= int(value) <= hi:
            raise self._bad(name, why, value)
        return int(value)

    def _float(self, name: str, why: str) -> float:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self._bad(name, why)
        try:
            value = float(value)
        except OverflowError:  # an integer beyond float's range
            raise self._bad(name, why) from None
        setattr(self, name, value)
        return value

    def _normalise_logit_bias(self, bias: object) -> dict[int, float]:
        why = f"must map integer token ids in [0, {TOKEN_ID_MAX}] to finite floats"
        if not isinstance(bias, dict):
            raise self._bad("logit_bias", why)
        out: dict[int, float] = {}
        for key, value in bias.items():
            # JSON object keys are strings: only a canonical ASCII integer names a token
            # (not " 5 ", "+5", "05", or digits of other scripts, which int() would read).
            if isinstance(key, str) and _CANONICAL_INT.fullmatch(key):
                key = int(key)
            tok = self._int(key, "logit_bias", why, 0, TOKEN_ID_MAX)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise self._bad("logit_bias", why, bias)
            try:
                value = float(value)
            except OverflowError:
                raise self._bad("logit_bias", why, bias) from None
            if not math.isfinite(value):
                raise self._bad("logit_bias", why, bias)
            out[tok] = value
        return out

    def _verify_token_lists(self) -> None:
        if self.allowed_token_ids is not None:
            why = f"must be a non-empty list of integer token ids in [0, {TOKEN_ID_MAX}]"
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise self._bad("allowed_token_ids", why)
            self.allowed_token_ids = [self._int(t, "allowed_token_ids", why, 0, TOKEN_ID_MAX)
                                      for t in self.allowed_token_ids]
        if self.bad_words is not None:
            why = "must be a list of strings with a non-whitespace character"
            # One string is refused rather than read as a list of its characters.
            if not isinstance(self.bad_words, (list, tuple)):
                raise self._bad("bad_words", why)
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise self._bad("bad_words", why)
            self.bad_words = list(self.bad_words)
        ids = self._bad_words_token_ids
        if ids is not None:
            why = (f"token ids must be non-empty lists of integers in [0, {TOKEN_ID_MAX}] "
                   f"(one per bad word spelling)")
            if not isinstance(ids, (list, tuple)) or any(
                    not isinstance(w, (list, tuple)) or not w for w in ids):
                raise self._bad("bad_words", why, ids)
            self._bad_words_token_ids = [
                [self._int(t, "bad_words", why, 0, TOKEN_ID_MAX) for t in w] for w in ids]
        if self.truncate_prompt_tokens is not None:
            why = f"must be -1 (max_model_len - 1), an integer in [1, {INT64_MAX}] or None"
            k = self._int(self.truncate_prompt_tokens, "truncate_prompt_tokens", why, -1)
            if k == 0:
                raise self._bad("truncate_prompt_tokens", why)
            self.truncate_prompt_tokens = k

    def _verify(self) -> None:
        self.n = self._int(self.n, "n", f"must be an integer in [1, {INT64_MAX}]", 1)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= self._float(name, "must be in [-2, 2]") <= 2.0:
                raise self._bad(name, "must be in [-2, 2]")
        rep = self._float("repetition_penalty", "must be a finite number > 0")
        if not (math.isfinite(rep) and rep > 0.0):
            raise self._bad("repetition_penalty", "must be a finite number > 0")
        temp = self._float("temperature", "must be a finite number >= 0")
        if not (math.isfinite(temp) and temp >= 0.0):
            raise self._bad("temperature", "must be a finite number >= 0")
        if not 0.0 < self._float("top_p", "must be in (0, 1]") <= 1.0:
            raise self._bad("top_p", "must be in (0, 1]")
        why_k = f"must be -1 (disabled) or an integer in [1, {INT64_MAX}]"
        self.top_k = self._int(self.top_k, "top_k", why_k, -1)
        if self.top_k == 0:
            self.top_k = -1
        if not 0.0 <= self._float("min_p", "must be in [0, 1]") <= 1.0:
            raise self._bad("min_p", "must be in [0, 1]")
        if self.seed is not None:
            why = f"must be an integer in [0, {INT64_MAX}], -1 or None (no seed)"
            self.seed = self._int(self.seed, "seed", why, -1)
            if self.seed == -1:
                self.seed = None  # as vLLM's OpenAI server: -1 means "no seed"
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "must be a bool")
        if self.max_tokens is not None:
            why = f"must be an integer in [1, {INT64_MAX}] or None"
            self.max_tokens = self._int(self.max_tokens, "max_tokens", why, 1)
        self.min_tokens = self._int(self.min_tokens, "min_tokens",
                                    f"must be an integer in [0, {INT64_MAX}]", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise self._bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                why = f"must be None or an integer in [0, {MAX_LOGPROBS}]"
                setattr(self, name, self._int(getattr(self, name), name, why, 0, MAX_LOGPROBS))
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise self._bad("output_kind", "must be a RequestOutputKind") from None
        if self.n > 1 and self.greedy:
            raise self._bad("n", "must be 1 when using greedy sampling (temperature 0)")

    # ---- helpers ----------------------------------------------------------------------------

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """The bad words' token-id sequences (set by the Processor; None before)."""
        return self._bad_words_token_ids

    @bad_words_token_ids.setter
    def bad_words_token_ids(self, ids: list[list[int]] | None) -> None:
        self._bad_words_token_ids = ids
        self._verify_token_lists()

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below vLLM's epsilon 1e-5: the argmax of the processed logits."""
        return self.temperature < SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """A deep copy (lists and the logit_bias dict are not shared), but for the
        structured-output constraint: its grammar text is fixed once it is validated, and a
        large schema would cost a deep copy per request (n > 1 children, every prompt)."""
        so = self.structured_outputs
        return copy.deepcopy(self, None if so is None else {id(so): so})
