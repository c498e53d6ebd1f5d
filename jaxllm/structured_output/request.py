"""StructuredOutputRequest: one request's constraint in the engine core, from its grammar text
to the matcher that follows its output."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import llguidance


@dataclass(eq=False)
class StructuredOutputRequest:
    """The grammar a request's output must follow and, once compiled, the request's own matcher
    (a copy of the cached prototype). `error` names why the request cannot go on (the grammar
    did not compile, or the matcher reached a dead end)."""

    grammar: str
    compiled: Future[llguidance.LLMatcher]
    matcher: llguidance.LLMatcher | None = None
    error: str | None = None
    # A thinking model's think block, which the constraint does not cover. While
    # `reasoning_end_token_id` is set the block may still come or is running; the constraint
    # starts after that token (`</think>`). While `reasoning_start_token_id` is set too, the
    # output has no token yet and its first decides: this one (`<think>`) opens the block,
    # any other is the constrained answer's first. Both None: the constraint is on.
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None

    @property
    def is_reasoning(self) -> bool:
        """Inside the block: no mask, the matcher waits."""
        return self.reasoning_end_token_id is not None and self.reasoning_start_token_id is None

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed): the request may leave the core's grammar wait."""
        return self.compiled.done()

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance the matcher by the tokens the scheduler accepted for the request. False,
        with `error` set, when the matcher refuses them."""
        assert self.matcher is not None  # only scheduled requests sample tokens
        if not self.matcher.consume_tokens(token_ids) or self.matcher.is_error():
            self.error = f"the structured-output matcher refused the output: " \
                         f"{error_summary(self.matcher.get_error())}"
            return False
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token."""
        return self.matcher is not None and self.matcher.is_stopped()


def error_summary(text: str) -> str:
    """The first line of an llguidance error (the rest is a parser-state dump)."""
    text = text.strip()
    return text.splitlines()[0] if text else "unknown error"
