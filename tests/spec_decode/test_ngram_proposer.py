"""NgramProposer against a plain-Python prompt lookup (a loop over n-gram lengths and match
starts): random batches and random add/append/remove/propose sequences over small vocabularies
(so matches are frequent), hand-worked examples, row reuse and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxllm.spec_decode.ngram_proposer import NgramProposer


def reference_draft(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The tokens after the earliest occurrence of the longest matching suffix."""
    length = len(tokens)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n:]
        # The match must end before the last token: start j <= length - 1 - n.
        for j in range(length - n):
            if tokens[j:j + n] == suffix:
                return tokens[j + n:min(j + n + k, length)]
    return []


def proposer(k: int = 5, lookup_min: int = 1, lookup_max: int = 4, max_model_len: int = 64,
             max_num_seqs: int = 4) -> NgramProposer:
    return NgramProposer(k, lookup_min, lookup_max, max_model_len, max_num_seqs)


def draft_of(tokens: list[int], **kwargs) -> list[int]:
    p = proposer(**kwargs)
    p.add_request("r", tokens)
    return p.propose(["r"])[0]


def test_the_reference_on_worked_examples():
    # The oracle itself, by hand: [1, 2] occurs at 0 (then 3) and at 3 (then 4): the first wins.
    assert reference_draft([1, 2, 3, 1, 2, 4, 9, 1, 2], 3, 2, 2) == [3, 1, 2]
    assert reference_draft([5, 6, 7, 5, 6], 5, 2, 2) == [7, 5, 6]
    assert reference_draft([3, 3], 5, 2, 4) == []
    assert reference_draft([3, 3], 5, 1, 4) == [3]


# Hand-worked examples -----------------------------------------------------------------------


def test_two_earlier_occurrences_pick_the_first_one():
    tokens = [1, 2, 3, 1, 2, 4, 9, 1, 2]
    assert draft_of(tokens, k=1, lookup_min=2, lookup_max=2) == [3]
    assert draft_of(tokens, k=3, lookup_min=2, lookup_max=2) == [3, 1, 2]


def test_the_longest_ngram_wins_over_an_earlier_shorter_match():
    # [2, 3] occurs at 1 (then 5); [1, 2, 3] only later, at 4 (then 6).
    tokens = [7, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3]
    assert draft_of(tokens, k=2, lookup_min=2, lookup_max=3) == [6, 1]
    assert draft_of(tokens, k=2, lookup_min=2, lookup_max=2) == [5, 1]
    # A longer lookup_max than any match changes nothing: the longest that matches wins.
    assert draft_of(tokens, k=2, lookup_min=2, lookup_max=8) == [6, 1]


def test_drafts_stop_at_the_end_of_the_sequence():
    assert draft_of([5, 6, 7, 5, 6], k=5, lookup_min=2, lookup_max=2) == [7, 5, 6]
    assert draft_of([5, 6, 7, 5, 6], k=2, lookup_min=2, lookup_max=2) == [7, 5]
    # A run of one token: the first match of [4, 4] starts the sequence.
    assert draft_of([4, 4, 4, 4, 4], k=5, lookup_min=2, lookup_max=2) == [4, 4, 4]


def test_no_match_gives_no_draft():
    assert draft_of([1, 2, 3, 4, 5], lookup_min=1, lookup_max=4) == []
    # The suffix itself is no match; a match needs a token after it.
    assert draft_of([1, 2, 3, 1, 2, 3], lookup_min=4, lookup_max=5) == []


def test_short_sequences_give_no_draft():
    assert draft_of([], lookup_min=1, lookup_max=3) == []
    assert draft_of([3], lookup_min=1, lookup_max=3) == []
    assert draft_of([3, 3], lookup_min=2, lookup_max=3) == []
    assert draft_of([3, 3], lookup_min=1, lookup_max=3) == [3]
    assert draft_of([3, 3, 3], lookup_min=2, lookup_max=3) == [3]


def test_drafts_follow_the_order_of_the_listed_requests():
    p = proposer(k=2, lookup_min=1, lookup_max=2)
    p.add_request("a", [1, 2, 1])      # [1] at 0 -> [2, 1]
    p.add_request("b", [7, 8, 9])      # no match
    p.add_request("c", [5, 6, 0, 5, 6])  # [5, 6] at 0 -> [0, 5]
    assert p.propose(["c", "a", "b", "a"]) == [[0, 5], [2, 1], [], [2, 1]]
    assert p.propose([]) == []


def test_appended_tokens_extend_the_lookup():
    p = proposer(k=3, lookup_min=2, lookup_max=3)
    p.add_request("a", [1, 2, 3, 4])
    assert p.propose(["a"]) == [[]]
    p.append("a", [1])
    assert p.propose(["a"]) == [[]]
    p.append("a", [2])
    assert p.propose(["a"]) == [[3, 4, 1]]
    p.append("a", [3, 9])
    assert p.propose(["a"]) == [[]]


# Rows and their reuse ------------------------------------------------------------------------


def test_a_reused_row_leaks_no_tokens_of_its_previous_request():
    p = proposer(k=5, lookup_min=1, lookup_max=3, max_num_seqs=1)
    p.add_request("old", [1, 2, 3, 9, 9, 9, 1, 2, 3, 7, 7])
    p.remove("old")
    assert p.num_requests == 0
    p.add_request("new", [1, 2, 3])
    assert p.propose(["new"]) == [[]]
    p.append("new", [1])
    # [1] at 0 is followed by [2, 3, 1] and then the end of the sequence (the row still holds
    # the old request's 9s after it).
    assert p.propose(["new"]) == [[2, 3, 1]]


def test_adding_a_tracked_id_replaces_its_tokens():
    p = proposer(k=5, lookup_min=1, lookup_max=3, max_num_seqs=1)
    p.add_request("a", [4, 5, 6, 4, 5, 6, 4])
    assert p.propose(["a"]) == [[5, 6, 4]]
    p.add_request("a", [4, 5])  # at capacity, but the id keeps its row
    assert p.num_requests == 1
    assert p.propose(["a"]) == [[]]


def test_remove_ignores_unknown_ids_and_frees_the_row():
    p = proposer(max_num_seqs=2)
    p.add_request("a", [1, 1])
    p.add_request("b", [2, 2])
    p.remove("nobody")
    p.remove("a")
    p.remove("a")
    assert p.num_requests == 1
    p.add_request("c", [3, 3])
    assert p.num_requests == 2
    assert p.propose(["b", "c"]) == [[2], [3]]


# Errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    ((0, 1, 3, 16, 2), "num_speculative_tokens must be at least 1, got 0"),
    ((2, 0, 3, 16, 2), "prompt_lookup_min=0, prompt_lookup_max=3"),
    ((2, 4, 3, 16, 2), "prompt_lookup_min=4, prompt_lookup_max=3"),
    ((2, 1, 3, 0, 2), "max_model_len must be at least 1, got 0"),
    ((2, 1, 3, 16, 0), "max_num_seqs must be at least 1, got 0"),
])
def test_bad_constructor_arguments_are_refused(args, message):
    with pytest.raises(ValueError) as e:
        NgramProposer(*args)
    assert message in str(e.value)


def test_more_requests_than_max_num_seqs_are_refused():
    p = proposer(max_num_seqs=2)
    p.add_request("a", [1, 2, 1])
    p.add_request("b", [3, 4, 3])
    with pytest.raises(ValueError, match=r"request 'c'.*max_num_seqs=2"):
        p.add_request("c", [5])
    assert p.num_requests == 2
    assert p.propose(["a", "b"]) == [[2, 1], [4, 3]]


def test_too_many_tokens_are_refused_and_change_nothing():
    p = proposer(k=5, lookup_min=1, max_model_len=6)
    with pytest.raises(ValueError, match=r"request 'a' has 7 tokens, more than max_model_len=6"):
        p.add_request("a", [1, 2, 3, 4, 5, 6, 7])
    assert p.num_requests == 0
    p.add_request("a", [1, 2, 3, 1])
    with pytest.raises(ValueError, match=r"request 'a' would have 7 tokens.*max_model_len=6"):
        p.append("a", [2, 3, 1])
    assert p.propose(["a"]) == [[2, 3, 1]]
    p.append("a", [2, 3])  # exactly max_model_len
    assert p.propose(["a"]) == [[1, 2, 3]]
    with pytest.raises(ValueError, match=r"request 'a' would have 7 tokens"):
        p.append("a", [9])


def test_unknown_requests_and_bad_token_ids_are_refused():
    p = proposer()
    with pytest.raises(ValueError, match=r"append to request 'x': it is not tracked"):
        p.append("x", [1])
    p.add_request("a", [1, 2])
    with pytest.raises(ValueError, match=r"propose for request 'x': it is not tracked"):
        p.propose(["a", "x"])
    with pytest.raises(ValueError, match=r"request 'b' must be a flat sequence of ints"):
        p.add_request("b", [1.5, 2.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"request 'b' must be a flat sequence of ints"):
        p.add_request("b", [[1, 2], [3]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"request 'a' must be in \[0, 2147483647\], got "
                                         r"values from -1 to 2"):
        p.append("a", [-1, 2])
    with pytest.raises(ValueError, match=r"request 'b' must be in \[0, 2147483647\]"):
        p.add_request("b", [2**31])
    with pytest.raises(ValueError, match=r"request 'b' must be in \[0, 2147483647\], got "
                                         r"values from -3 to 4"):
        p.add_request("b", np.array([4, -3]))
    assert p.num_requests == 1
    assert p.propose(["a"]) == [[]]


def test_token_ids_may_come_as_numpy_arrays():
    p = proposer(k=3, lookup_min=1, lookup_max=2)
    p.add_request("a", np.array([6, 7, 8], np.int64))
    p.append("a", np.array([6], np.uint32))
    p.add_request("b", np.array([], np.int32))
    assert p.propose(["a", "b"]) == [[7, 8, 6], []]


# Properties against the reference ---------------------------------------------------------------

lookup_params = st.integers(1, 4).flatmap(
    lambda lo: st.tuples(st.integers(1, 6), st.just(lo), st.integers(lo, lo + 4)))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(params=lookup_params, vocab=st.integers(2, 6), data=st.data())
def test_a_batch_of_requests_equals_the_reference(params, vocab, data):
    k, lo, hi = params
    seqs = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=40),
                              min_size=1, max_size=8), label="sequences")
    p = NgramProposer(k, lo, hi, max_model_len=40, max_num_seqs=8)
    for i, seq in enumerate(seqs):
        p.add_request(f"r{i}", seq)
    order = data.draw(st.permutations(range(len(seqs))), label="order")
    got = p.propose([f"r{i}" for i in order])
    assert got == [reference_draft(seqs[i], k, lo, hi) for i in order]


class ProposerMachine(RuleBasedStateMachine):
    """Interleaved add/append/remove/propose on a small proposer, rows reused often; after
    every step each tracked request's draft equals the reference's on its own tokens."""

    ids = st.sampled_from([f"r{i}" for i in range(6)])

    @initialize(params=lookup_params, vocab=st.integers(2, 6),
                max_model_len=st.integers(1, 24), max_num_seqs=st.integers(1, 4))
    def setup(self, params, vocab, max_model_len, max_num_seqs):
        self.k, self.lo, self.hi = params
        self.vocab = vocab
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.proposer = NgramProposer(self.k, self.lo, self.hi, max_model_len, max_num_seqs)
        self.tokens: dict[str, list[int]] = {}

    def token_lists(self, min_size: int, max_size: int):
        return st.lists(st.integers(0, self.vocab - 1), min_size=min_size, max_size=max_size)

    @rule(request_id=ids, data=st.data())
    def add(self, request_id, data):
        tokens = data.draw(self.token_lists(0, self.max_model_len + 2))
        full = request_id not in self.tokens and len(self.tokens) == self.max_num_seqs
        if full or len(tokens) > self.max_model_len:
            with pytest.raises(ValueError, match=repr(request_id)):
                self.proposer.add_request(request_id, tokens)
        else:
            self.proposer.add_request(request_id, tokens)
            self.tokens[request_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = data.draw(self.token_lists(1, 4))
        if len(self.tokens[request_id]) + len(tokens) > self.max_model_len:
            with pytest.raises(ValueError, match="max_model_len"):
                self.proposer.append(request_id, tokens)
        else:
            self.proposer.append(request_id, tokens)
            self.tokens[request_id] = self.tokens[request_id] + tokens

    @rule(request_id=ids)
    def remove(self, request_id):
        self.proposer.remove(request_id)
        self.tokens.pop(request_id, None)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def propose_some(self, data):
        listed = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), max_size=6))
        assert self.proposer.propose(listed) == [
            reference_draft(self.tokens[r], self.k, self.lo, self.hi) for r in listed]

    @invariant()
    def every_request_proposes_like_the_reference(self):
        listed = sorted(self.tokens)
        assert self.proposer.num_requests == len(listed)
        assert self.proposer.propose(listed) == [
            reference_draft(self.tokens[r], self.k, self.lo, self.hi) for r in listed]


ProposerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, derandomize=True, database=None)
test_interleaved_operations_equal_the_reference = ProposerMachine.TestCase
