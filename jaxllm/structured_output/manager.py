"""StructuredOutputManager: grammars compiled off the step loop, and each step's token masks.

The engine core owns one. The LLTokenizer is
built at the first constrained request, on a thread, from the model's own tokenizer; engines
that never see a constrained request never pay for it. Grammars compile on a small thread pool
(llguidance drops the GIL while it compiles), cached by a hash of the grammar text: the cache
holds a compiled prototype matcher, and every request gets its own `deep_copy()`, so one spec
compiles once however many requests (or n > 1 children) use it.

Per step, the masks of all constrained sampled rows are filled by one batched call
(`fill_next_token_bitmask_par`, llguidance's thread pool) into a preallocated int32 bitmask:
bit t of a row says token t is allowed. EOS is allowed only where the grammar accepts, since
the LLTokenizer knows the EOS ids.

Speculative decoding: to verify k draft tokens per step, `draft_bitmasks` gives the masks of
every verified position (one row per position, the matcher advanced through the drafts and
rolled back with `LLMatcher.rollback`); the engine core then feeds the matcher the accepted
tokens (`StructuredOutputRequest.accept_tokens`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from jaxllm.sample.token_mask import allow_token
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output.request import StructuredOutputRequest, error_summary
from jaxllm.structured_output.validator import COMPILE_STACK_BYTES

# Compiled grammars kept; the oldest is dropped past this (requests hold their own copies).
GRAMMAR_CACHE_SIZE = 256
# Grammar compilations at once: enough to hide a slow schema behind others.
COMPILE_WORKERS = 2


def _compile_pool() -> ThreadPoolExecutor:
    """The compile threads, all started now with COMPILE_STACK_BYTES of stack (a thread's stack
    is fixed when it starts, whichever process the manager lives in), each held at a barrier
    until every one has started, so the pool never starts another later."""
    pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="grammar")
    barrier = threading.Barrier(COMPILE_WORKERS + 1)
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        for _ in range(COMPILE_WORKERS):
            pool.submit(barrier.wait)
    finally:
        threading.stack_size(previous)
    barrier.wait()
    return pool


class StructuredOutputManager:
    """`model_path`: where the model's tokenizer is; `vocab_size`: the model's logits width
    (the masks' width; ids past the tokenizer's own are never allowed); `max_num_rows`: the most
    sampled rows a step has."""

    def __init__(self, model_path: str | Path, vocab_size: int, max_num_rows: int) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self._pool = _compile_pool()
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self.num_compiled = 0  # grammars compiled (cache misses) since start
        self._executor: llguidance.LLExecutor | None = None
        words = (vocab_size + 31) // 32
        self._bitmask = np.full((max_num_rows, words), -1, np.int32)

    # --- compilation (off the step loop) ------------------------------------------------------

    def add_request(self, params: StructuredOutputsParams,
                    eos_token_ids: list[int]) -> StructuredOutputRequest:
        """Start compiling the request's grammar (or share a compilation of the same text).
        The first call also starts building the tokenizer, whose EOS ids are these."""
        if self._tokenizer is None:
            self._tokenizer = self._pool.submit(self._load_tokenizer, list(eos_token_ids))
        try:
            grammar = params.llguidance_grammar()
        except ValueError as e:
            failed: Future[llguidance.LLMatcher] = Future()
            failed.set_exception(e)
            return StructuredOutputRequest("", failed)
        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._cache[key] = self._pool.submit(self._compile, grammar)
                self.num_compiled += 1
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return StructuredOutputRequest(grammar, compiled)

    def _load_tokenizer(self, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
        import llguidance.hf  # imports transformers: only in a core that needs it
        from transformers import PreTrainedTokenizerFast

        from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.model_path)
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ValueError(f"structured outputs need a fast (Rust) tokenizer; {self.model_path} "
                             f"has a {type(tokenizer).__name__}")
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                            eos_token=eos_token_ids or None)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        assert self._tokenizer is not None  # started before any compilation
        # Silent: what goes wrong reaches the request as its finish reason.
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the structured-output grammar does not compile: "
                             f"{error_summary(matcher.get_error())}")
        return matcher

    def init_matcher(self, request: StructuredOutputRequest) -> bool:
        """Give a compiled request its own matcher; False, with `request.error` set, when the
        compilation failed."""
        try:
            prototype = request.compiled.result()
        except Exception as e:  # a bad grammar, or no usable tokenizer for the model
            request.error = error_summary(str(e)) if isinstance(e, ValueError) \
                else f"the structured-output grammar did not compile: {type(e).__name__}: {e}"
            return False
        request.matcher = prototype.deep_copy()
        return True

    @staticmethod
    def wait_any(requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Block until one of the requests' grammars is compiled, or `timeout` seconds."""
        wait([r.compiled for r in requests], timeout=timeout, return_when=FIRST_COMPLETED)

    # --- the step's masks ---------------------------------------------------------------------

    def grammar_bitmask(self, requests: list[StructuredOutputRequest]
                        ) -> tuple[np.ndarray, list[str | None]]:
        """The next-token masks of these requests' matchers, one row each, filled in one
        batched call: (bitmask [n, ceil(vocab / 32)] int32, a view valid until the next call;
        per request None, or why it cannot go on: its matcher failed or allows no token)."""
        n = len(requests)
        if n > len(self._bitmask):
            self._bitmask = np.full((n, self._bitmask.shape[1]), -1, np.int32)
        bitmask = self._bitmask[:n]
        errors: list[str | None] = [None] * n
        batch = []
        for i, r in enumerate(requests):
            m = r.matcher
            assert m is not None  # scheduled requests have their matcher
            if m.is_error():
                errors[i] = f"the structured-output matcher failed: " \
                            f"{error_summary(m.get_error())}"
                bitmask[i] = 0
            else:
                batch.append((m, i))
        if batch:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            fill_next_token_bitmask_par(self._executor, batch, bitmask)
            for i in np.flatnonzero(~bitmask.any(axis=1)).tolist():
                if errors[i] is None:
                    errors[i] = "the structured-output grammar allows no next token " \
                                "(dead end)"
        return bitmask, errors

    def draft_bitmasks(self, request: StructuredOutputRequest,
                       draft_token_ids: list[int]) -> np.ndarray | None:
        """Speculative decoding: the masks of the request's verified positions, [m, words]
        int32 with m <= len(draft_token_ids) + 1: row j is the mask after drafts 1..j. It stops
        at the first draft its row does not allow (nothing after it can be accepted). The
        matcher is rolled back to where it was.

        A thinking model's request (StructuredOutputRequest's think fields): in its block, rows
        allow everything up to a draft that ends it, the grammar's masks after it (None when
        no draft ends it: no position is constrained); before its first token, row 0 also
        allows the block's opening tag, and a draft of it opens the block."""
        opener = request.reasoning_start_token_id
        if opener is None:
            return self._draft_rows(request, draft_token_ids, request.is_reasoning)
        if draft_token_ids and draft_token_ids[0] == opener:
            first = self._draft_rows(request, [], False)
            assert first is not None  # not in a block
            after = self._draft_rows(request, draft_token_ids[1:], True)
            if after is None:
                after = np.full((len(draft_token_ids), first.shape[1]), -1, np.int32)
            rows = np.concatenate([first[:1], after])
        else:
            rows = self._draft_rows(request, draft_token_ids, False)
            assert rows is not None  # not in a block
        allow_token(rows[0], opener)
        return rows

    def _draft_rows(self, request: StructuredOutputRequest, draft_token_ids: list[int],
                    in_block: bool) -> np.ndarray | None:
        matcher = request.matcher
        assert matcher is not None  # scheduled requests have their matcher
        start = 0
        if in_block:
            if request.reasoning_end_token_id not in draft_token_ids:
                return None
            start = draft_token_ids.index(request.reasoning_end_token_id) + 1
        rows = np.zeros((len(draft_token_ids) + 1, self._bitmask.shape[1]), np.int32)
        rows[:start] = -1
        consumed = 0
        for j in range(start, len(draft_token_ids) + 1):
            if matcher.is_error():
                break
            fill_next_token_bitmask(matcher, rows, j)
            if j == len(draft_token_ids):
                break
            t = int(draft_token_ids[j])
            allowed = 0 <= t < self.vocab_size and (rows[j, t >> 5] >> (t & 31)) & 1
            if not allowed or not matcher.consume_token(t):
                break
            consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return rows[:j + 1]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
