"""Processor: a user's prompt + SamplingParams -> validated, tokenized EngineCoreRequests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class Processor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenize and validate one prompt; ValueError names what is wrong."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass "
                                 "{'prompt_token_ids': [...]} or drop skip_tokenizer_init")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                raw = prompt["prompt_token_ids"]
                if not all(isinstance(t, int) or hasattr(t, "__index__") for t in raw):
                    raise ValueError("prompt_token_ids must be integers")
                token_ids = [int(t) for t in raw]
            else:
                return self.process_prompt(prompt["prompt"])
        else:
            raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids', got "
                             f"{type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{self.max_model_len} (room for at least one new token is needed)")
        return ProcessedPrompt(text, token_ids)

    def max_tokens_for(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got "
                             f"{type(params).__name__}")
        bad = [t for t in list(params.stop_token_ids) + list((params.logit_bias or {}).keys())
               if t >= self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} in stop_token_ids/logit_bias are outside "
                             f"the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (stop strings match text)")
