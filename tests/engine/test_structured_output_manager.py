"""StructuredOutputManager on the real Qwen2.5 vocabulary (tiny-qwen2's tokenizer): one
compilation per grammar text, independent matchers per request, masks checked against the
tokenizer's own decoding, and why a request cannot go on."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output.manager import StructuredOutputManager

VOCAB = 151936
EOS = [151645, 151643]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_qwen2_path())


@pytest.fixture(scope="module")
def manager():
    m = StructuredOutputManager(tiny_qwen2_path(), VOCAB, max_num_rows=2)
    yield m
    m.shutdown()


def allowed_ids(row: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits)


def test_one_compilation_per_grammar_and_a_matcher_per_request(manager, tokenizer):
    before = manager.num_compiled
    spec = StructuredOutputsParams(regex="ab?")
    a, b = manager.add_request(spec, EOS), manager.add_request(spec, EOS)
    other = manager.add_request(StructuredOutputsParams(regex="abc"), EOS)
    assert a.compiled is b.compiled and other.compiled is not a.compiled
    assert manager.num_compiled == before + 2
    assert manager.init_matcher(a) and manager.init_matcher(b)
    assert a.matcher is not b.matcher
    # Three rows, more than the two preallocated: the buffer grows.
    assert manager.init_matcher(other)
    assert a.accept_tokens(tokenizer.encode("a")) and not a.is_terminated
    bitmask, errors = manager.grammar_bitmask([a, b, other])
    assert errors == [None, None, None]
    # After "a": only tokens that continue to "ab", and EOS (the regex accepts "a").
    got = allowed_ids(bitmask[0])
    text = {int(t): tokenizer.decode([int(t)]) for t in got if t < len(tokenizer)}
    assert set(EOS) <= set(got.tolist())
    assert {t for t, s in text.items() if int(t) not in EOS} == {tokenizer.encode("b")[0]}
    # b is untouched by a's token: it still needs its "a".
    start = allowed_ids(bitmask[1])
    assert tokenizer.encode("a")[0] in start and not set(EOS) & set(start.tolist())
    assert all("abc".startswith(tokenizer.decode([int(t)])) for t in allowed_ids(bitmask[2]))
    # "ab" completes the grammar: nothing can follow.
    assert a.accept_tokens(tokenizer.encode("b")) and a.is_terminated


def test_why_a_request_cannot_go_on(manager, tokenizer):
    bad = manager.add_request(StructuredOutputsParams(grammar='start: "a" <|nope|>'), EOS)
    assert not manager.init_matcher(bad)
    assert "<|nope|>" in bad.error and "does not compile" in bad.error
    so = manager.add_request(StructuredOutputsParams(regex="[a-z]+"), EOS)
    assert manager.init_matcher(so)
    assert not so.accept_tokens(tokenizer.encode("!"))
    assert "refused" in so.error
    _, errors = manager.grammar_bitmask([so])
    assert errors[0] is not None and "matcher failed" in errors[0]


def test_a_mask_that_allows_nothing_is_a_dead_end(manager, monkeypatch):
    """A row the batched fill leaves without any allowed token (a grammar that cannot go on)
    is reported as a dead end, the other rows not."""
    from jaxllm.structured_output import manager as manager_module

    real_fill = manager_module.fill_next_token_bitmask_par

    def fill_then_block_row_0(executor, matchers, bitmask):
        real_fill(executor, matchers, bitmask)
        bitmask[0] = 0

    a = manager.add_request(StructuredOutputsParams(regex="[a-z]+"), EOS)
    b = manager.add_request(StructuredOutputsParams(regex="[a-z]+"), EOS)
    assert manager.init_matcher(a) and manager.init_matcher(b)
    monkeypatch.setattr(manager_module, "fill_next_token_bitmask_par", fill_then_block_row_0)
    bitmask, errors = manager.grammar_bitmask([a, b])
    assert errors[0] is not None and "dead end" in errors[0]
    assert errors[1] is None and bitmask[1].any()
