"""BlockPool and KVCacheManager: reference counts, free queue, prefix cache, LRU eviction,
in one KV cache group or several (full attention and sliding windows from one pool)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from scheduler import NULL_BLOCK_ID, BlockPool, KVCacheManager, Request, hash_block_tokens

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, max_tokens=1000)


def prefill(mgr: KVCacheManager, req: Request) -> int | None:
    """Allocate and 'compute' the whole sequence like a scheduler step; returns the hit tokens."""
    blocks, num_hit = mgr.get_computed_blocks(req)
    if mgr.allocate_slots(req, req.num_tokens - num_hit, blocks) is None:
        return None
    req.num_computed_tokens = req.num_tokens
    mgr.cache_blocks(req, req.num_computed_tokens)
    return num_hit


def decode(mgr: KVCacheManager, req: Request, token: int) -> bool:
    req.append_output_token_ids(token)
    if mgr.allocate_slots(req, 1) is None:
        return False
    req.num_computed_tokens += 1
    mgr.cache_blocks(req, req.num_computed_tokens)
    return True


def chain_hashes(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // BS):
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else None, tokens[i * BS : i * BS + BS])
        )
    return hashes


def test_hash_is_chained_and_stable_across_processes() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    # Python's hash() is salted per process; ours must not be.
    code = "from scheduler import hash_block_tokens as h; print(h(None, [1, 2, 3, 4]).hex())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == a.hex()


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4 and pool.num_usable_blocks == 4
    ids = [b.block_id for b in pool.get_new_blocks(4)]
    assert NULL_BLOCK_ID not in ids and sorted(ids) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.free_blocks([pool.null_block])


def test_prefix_hits_for_shared_prefixes() -> None:
    mgr = KVCacheManager(num_blocks=32, block_size=BS)
    base = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    a = make_request("a", base)
    assert prefill(mgr, a) == 0
    assert mgr.num_free_blocks == 31 - 3

    # Shares the two full blocks, then diverges.
    b = make_request("b", base[:8] + [1, 2, 3])
    assert prefill(mgr, b) == 8
    assert mgr.get_block_ids("b")[0][:2] == mgr.get_block_ids("a")[0][:2]
    assert mgr.block_pool.blocks[mgr.get_block_ids("a")[0][0]].ref_cnt == 2
    assert mgr.num_free_blocks == 31 - 3 - 1

    # Diverges inside the first block: nothing to share.
    c = make_request("c", base[:3] + [7] * 7)
    assert prefill(mgr, c) == 0

    # Exactly the cached 8 tokens: the last one must be computed, so only one block hits.
    d = make_request("d", base[:8])
    assert prefill(mgr, d) == 4

    # Same prompt as a: hits stop before the last token.
    e = make_request("e", list(base))
    assert prefill(mgr, e) == 8


def test_blocks_filled_by_generated_tokens_are_cached() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3])
    prefill(mgr, a)
    for t in [4, 5, 6, 7, 8]:
        assert decode(mgr, a, t)
    # 8 tokens computed -> 2 full blocks, the second made of generated tokens.
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert prefill(mgr, b) == 8


def test_freed_cached_blocks_stay_findable_until_reused_lru() -> None:
    # 6 usable blocks; three requests of one full block + 1 token each.
    mgr = KVCacheManager(num_blocks=7, block_size=BS)
    reqs = {n: make_request(n, [i] * BS + [0]) for i, n in enumerate("abc", start=1)}
    for r in reqs.values():
        assert prefill(mgr, r) == 0
    full_block = {n: mgr.get_block_ids(n)[0][0] for n in reqs}
    assert mgr.num_free_blocks == 0
    for n in "bac":  # b is freed first, so its cached block is the first to go
        mgr.free(reqs[n])
    assert mgr.num_free_blocks == 6
    pool = mgr.block_pool
    hashes = {n: chain_hashes(reqs[n].all_token_ids)[0] for n in reqs}
    assert all(pool.get_cached_block(hashes[n]) is not None for n in reqs)

    # The three uncached tail blocks are reused before any cached block.
    got = pool.get_new_blocks(3)
    assert full_block["b"] not in {b.block_id for b in got}
    assert all(pool.get_cached_block(hashes[n]) is not None for n in reqs)

    # Then the least recently freed cached block: b's, then a's.
    (blk,) = pool.get_new_blocks(1)
    assert blk.block_id == full_block["b"] and blk.block_hash is None
    assert pool.get_cached_block(hashes["b"]) is None
    assert pool.get_cached_block(hashes["a"]) is not None
    (blk,) = pool.get_new_blocks(1)
    assert blk.block_id == full_block["a"]
    assert pool.get_cached_block(hashes["c"]).block_id == full_block["c"]


def test_hit_on_free_block_touches_it() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", [5] * 9)
    prefill(mgr, a)
    mgr.free(a)
    assert mgr.num_free_blocks == 7
    b = make_request("b", [5] * 9)
    hits, num_hit = mgr.get_computed_blocks(b)
    (blocks,) = hits
    assert num_hit == 8 and all(blk.ref_cnt == 0 for blk in blocks)
    assert mgr.allocate_slots(b, 1, hits) is not None
    assert all(blk.ref_cnt == 1 for blk in blocks)
    assert all(blk.block_id not in mgr.block_pool.free_queue for blk in blocks)
    assert mgr.num_free_blocks == 7 - 3


def test_allocate_fails_cleanly_when_short() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", [1] * 9)
    assert prefill(mgr, a) == 0
    b = make_request("b", [2] * 5)
    assert mgr.allocate_slots(b, 5) is None
    assert mgr.get_block_ids("b")[0] == [] and mgr.num_free_blocks == 0
    mgr.free(a)
    # A hit on a free block counts against the free blocks too: 2 hits + 1 new = 3.
    c = make_request("c", [1] * 9)
    blocks, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8
    assert mgr.allocate_slots(c, 1, blocks) is not None
    assert mgr.num_free_blocks == 0


def test_allocate_counts_every_groups_blocks_and_hits_on_free_blocks() -> None:
    """Two groups: a request needs its new blocks in each group, and each group's hits on
    free cached blocks take those out of the free queue too; one short returns None and
    changes nothing."""
    mgr = KVCacheManager(num_blocks=8, block_size=BS, group_windows=(None, None))  # 7 usable
    a = make_request("a", [1] * 9)
    assert prefill(mgr, a) == 0
    a_tables = mgr.get_block_ids("a")
    mgr.free(a)  # 4 cached full blocks, 2 uncached tails, 1 never used: all free
    c = make_request("c", [2] * 3)
    assert prefill(mgr, c) == 0  # takes the 2 uncached tails
    assert mgr.num_free_blocks == 5
    b = make_request("b", [1] * 9)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and [[blk.block_id for blk in h] for h in hits] == [
        ids[:2] for ids in a_tables]
    # 2 hits on free blocks and 1 new block in each group: 6 > 5.
    assert mgr.allocate_slots(b, 1, hits) is None
    assert mgr.get_block_ids("b") == ([], []) and mgr.num_free_blocks == 5
    assert all(blk.ref_cnt == 0 and blk.block_hash is not None for h in hits for blk in h)
    mgr.free(c)
    new = mgr.allocate_slots(b, 1, hits)
    assert new is not None and [len(blocks) for blocks in new] == [1, 1]
    assert mgr.num_free_blocks == 7 - 6


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", [3] * 9)
    prefill(mgr, a)
    mgr.reset_prefix_cache()
    assert mgr.block_pool.cached_blocks == {}
    assert prefill(mgr, make_request("b", [3] * 9)) == 0


def test_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    prefill(mgr, make_request("a", [3] * 9))
    assert prefill(mgr, make_request("b", [3] * 9)) == 0
    assert mgr.block_pool.cached_blocks == {}


MAX_HIT_BLOCKS = 8


@settings(max_examples=200, deadline=None)
@given(
    windows=st.lists(st.one_of(st.none(), st.integers(1, 12)), min_size=1, max_size=4),
    block_size=st.integers(1, 5),
    num_full_blocks=st.integers(1, MAX_HIT_BLOCKS),
    # Per group, per block: evicted or not (the first num_full_blocks of each).
    evicted=st.lists(st.lists(st.booleans(), min_size=MAX_HIT_BLOCKS, max_size=MAX_HIT_BLOCKS),
                     min_size=4, max_size=4),
)
# The sliding group first finds its last block, the full group cuts to 3 blocks, where the
# sliding group misses its block 2: the groups agree on 2 only when asked again.
@example(windows=[4, None], block_size=4, num_full_blocks=4,
         evicted=[[False, False, True, False] * 2, [False, False, False, True] * 2,
                  [False] * 8, [False] * 8])
def test_a_prefix_hit_is_the_longest_every_group_agrees_on(
    windows: list[int | None], block_size: int, num_full_blocks: int,
    evicted: list[list[bool]]
) -> None:
    """A computed prompt's blocks, then any of them evicted in any group: a prompt of the same
    tokens hits the most leading blocks for which every group still holds what it reads (a
    full group all of them, a sliding group those under its first query's window), each
    group its own blocks."""
    group_windows = tuple(windows)
    num_groups = len(group_windows)
    tokens = list(range(1, num_full_blocks * block_size + 2))
    mgr = KVCacheManager(1 + num_groups * (num_full_blocks + 1), block_size,
                         group_windows=group_windows)
    a = make_request("a", tokens)
    # (A hit on an empty cache when every group's window is 1: no query reads an earlier
    # block, so the whole prefix is skipped, null blocks in every group.)
    prefill(mgr, a)
    tables = mgr.get_block_ids("a")
    mgr.free(a)
    pool = mgr.block_pool
    gone = [{i for i in range(num_full_blocks) if evicted[g][i]} for g in range(num_groups)]
    evict = [pool.blocks[tables[g][i]] for g in range(num_groups) for i in sorted(gone[g])
             if tables[g][i] != NULL_BLOCK_ID]
    for blk in reversed(evict):
        pool.free_queue.move_to_end(blk.block_id, last=False)
    assert pool.get_new_blocks(len(evict)) == evict
    pool.free_blocks(evict)

    def first(n: int, w: int | None) -> int:
        return 0 if w is None else max(0, n * block_size - w + 1) // block_size

    expected = next(n for n in range(num_full_blocks, -1, -1)
                    if all(i not in gone[g] for g, w in enumerate(group_windows)
                           for i in range(first(n, w), n)))
    hits, num_hit = mgr.get_computed_blocks(make_request("b", tokens))
    assert num_hit == expected * block_size
    for g, w in enumerate(group_windows):
        skipped = first(expected, w) if expected else 0
        assert [b.block_id for b in hits[g]] == (
            [NULL_BLOCK_ID] * skipped + tables[g][skipped:expected])


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


NUM_BLOCKS = 14


def first_in_window(num_blocks: int, window: int) -> int:
    """The first block the window of the query after `num_blocks` full blocks sees."""
    return max(0, num_blocks * BS - window + 1) // BS


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / decode / free / reset sequences against a fake KV store.

    Each 'computed' token is written into fake_kv at its slot in every group's block, tagged
    with the group, as a model runner would, so a cache hit can be checked against what is
    physically in each hit block of each group.
    """

    def __init__(self) -> None:
        super().__init__()
        self._start((None,), NUM_BLOCKS)

    def _start(self, windows: tuple[int | None, ...], num_blocks: int) -> None:
        self.windows = windows
        self.num_blocks = num_blocks
        self.mgr = KVCacheManager(num_blocks, BS, group_windows=windows)
        self.fake_kv: list[list[tuple[int, int] | None]] = [[None] * BS
                                                            for _ in range(num_blocks)]
        self.live: dict[str, Request] = {}
        # Per live request, the position of the first query of its last allocate_slots (a
        # hit's end, or its computed tokens before a decode): what its sliding groups free.
        self.query_at: dict[str, int] = {}
        self.since_reset: set[str] = set()
        # The prefix-cache key each group's block of a token prefix was registered under
        # (as seen on the blocks), and back: which group and prefix a key stands for.
        self.key_of: dict[tuple[int, tuple[int, ...]], bytes] = {}
        self.owner: dict[bytes, tuple[int, tuple[int, ...]]] = {}
        self.prompts: list[list[int]] = [[]]
        self.counter = 0

    def _write(self, req: Request, start: int, end: int) -> None:
        for g, ids in enumerate(self.mgr.get_block_ids(req.request_id)):
            for pos in range(start, end):
                assert ids[pos // BS] != NULL_BLOCK_ID
                self.fake_kv[ids[pos // BS]][pos % BS] = (g, req.all_token_ids[pos])

    def _cache(self, req: Request) -> None:
        """cache_blocks, then note the key each newly registered block got."""
        self.mgr.cache_blocks(req, req.num_computed_tokens)
        toks = req.all_token_ids
        hashes = chain_hashes(toks[: req.num_computed_tokens])
        pool = self.mgr.block_pool
        for g, ids in enumerate(self.mgr.get_block_ids(req.request_id)):
            for i in range(len(hashes)):
                key = pool.blocks[ids[i]].block_hash
                if ids[i] == NULL_BLOCK_ID or key is None:  # freed, or registered before a reset
                    continue
                prefix = tuple(toks[: (i + 1) * BS])
                if g == 0:
                    assert key == hashes[i]  # the first group's key is the hash itself
                assert self.key_of.setdefault((g, prefix), key) == key
                assert self.owner.setdefault(key, (g, prefix)) == (g, prefix), (
                    f"one key for group {g}'s and group {self.owner[key][0]}'s blocks")

    def _expected_hit(self, prompt: list[int]) -> int:
        """The most leading blocks every group finds cached: a full group all of them, a
        sliding group those from its first query's window on."""
        cached = self.mgr.block_pool.cached_blocks

        def found(g: int, i: int) -> bool:
            return self.key_of.get((g, tuple(prompt[: (i + 1) * BS]))) in cached

        for n in range((len(prompt) - 1) // BS, 0, -1):
            if all(found(g, i) for g, w in enumerate(self.windows)
                   for i in range(0 if w is None else first_in_window(n, w), n)):
                return n
        return 0

    @rule(
        base=st.integers(0, 1000),
        cut=st.integers(0, 16),
        suffix=st.lists(st.integers(0, 2), max_size=10),
    )
    def add(self, base: int, cut: int, suffix: list[int]) -> None:
        prompt = self.prompts[base % len(self.prompts)][:cut] + suffix
        if not prompt:
            return
        self.counter += 1
        req = make_request(f"r{self.counter}", prompt)
        hits, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit % BS == 0 and num_hit <= len(prompt) - 1
        assert num_hit == self._expected_hit(prompt) * BS
        assert len(hits) == len(self.windows)
        for g, (blocks, w) in enumerate(zip(hits, self.windows, strict=True)):
            assert len(blocks) * BS == num_hit
            skipped = 0 if w is None else first_in_window(num_hit // BS, w)
            for i, blk in enumerate(blocks):
                if i < skipped:
                    assert blk.block_id == NULL_BLOCK_ID
                else:
                    assert self.fake_kv[blk.block_id] == [
                        (g, t) for t in prompt[i * BS : i * BS + BS]]
        if self.windows == (None,) * len(self.windows):
            # Every full block a live request computed since the last reset must be found.
            expect = 0
            for rid in self.since_reset & self.live.keys():
                other = self.live[rid]
                shared = common_prefix_len(other.all_token_ids[: other.num_computed_tokens],
                                           prompt)
                expect = max(expect, min(shared // BS, (len(prompt) - 1) // BS) * BS)
            assert num_hit >= expect
        if self.mgr.allocate_slots(req, len(prompt) - num_hit, hits) is None:
            assert all(ids == [] for ids in self.mgr.get_block_ids(req.request_id))
            return
        self._write(req, num_hit, len(prompt))
        req.num_computed_tokens = len(prompt)
        self._cache(req)
        self.live[req.request_id] = req
        self.query_at[req.request_id] = num_hit
        self.since_reset.add(req.request_id)
        self.prompts.append(prompt)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000), token=st.integers(0, 2))
    def decode(self, pick: int, token: int) -> None:
        req = self.live[sorted(self.live)[pick % len(self.live)]]
        req.append_output_token_ids(token)
        if self.mgr.allocate_slots(req, 1) is None:
            # What the scheduler would do: preempt, giving every block back.
            self.mgr.free(req)
            del self.live[req.request_id]
            return
        self.query_at[req.request_id] = req.num_computed_tokens
        self._write(req, req.num_computed_tokens, req.num_tokens)
        req.num_computed_tokens += 1
        self._cache(req)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def free(self, pick: int) -> None:
        rid = sorted(self.live)[pick % len(self.live)]
        self.mgr.free(self.live.pop(rid))

    @rule(pick=st.integers(0, 1000))
    def evict(self, pick: int) -> None:
        """Evict any one free cached block (as if others' hits had kept the rest longer), so
        each group's cache ends up with holes anywhere."""
        pool = self.mgr.block_pool
        cached = [b for b in pool.free_queue.values() if b.block_hash is not None]
        if not cached:
            return
        blk = cached[pick % len(cached)]
        pool.free_queue.move_to_end(blk.block_id, last=False)
        (taken,) = pool.get_new_blocks(1)
        assert taken is blk and blk.block_hash is None
        pool.free_blocks([blk])

    @rule()
    def reset(self) -> None:
        self.mgr.reset_prefix_cache()
        self.since_reset.clear()

    @invariant()
    def refcounts_match_holders(self) -> None:
        pool = self.mgr.block_pool
        holders: Counter[int] = Counter()
        group_of: dict[int, int] = {}
        for rid, req in self.live.items():
            mine: list[int] = []
            for g, (ids, w) in enumerate(zip(self.mgr.get_block_ids(rid), self.windows,
                                             strict=True)):
                assert len(ids) == -(-req.num_computed_tokens // BS)
                lead = next((i for i, b in enumerate(ids) if b != NULL_BLOCK_ID), len(ids))
                # Exactly a sliding group's blocks wholly behind the window of the last
                # allocation's first query are freed (the null block in their place).
                q = self.query_at[rid]
                assert lead == (0 if w is None else max(0, q - w + 1) // BS)
                assert NULL_BLOCK_ID not in ids[lead:]
                for i, b in enumerate(ids[lead:], start=lead):
                    assert group_of.setdefault(b, g) == g, "a block held in two groups"
                    # It holds this group's KV of the request's tokens.
                    end = min((i + 1) * BS, req.num_computed_tokens)
                    assert self.fake_kv[b][: end - i * BS] == [
                        (g, t) for t in req.all_token_ids[i * BS : end]]
                mine += ids[lead:]
            assert len(mine) == len(set(mine)), "a block held twice by one request"
            holders.update(mine)
        assert set(self.mgr.req_to_blocks) == set(self.live)
        for blk in pool.blocks[1:]:
            assert blk.ref_cnt == holders[blk.block_id]
            assert (blk.ref_cnt == 0) == (blk.block_id in pool.free_queue)
        assert pool.null_block.ref_cnt == 1 and NULL_BLOCK_ID not in pool.free_queue
        assert pool.num_free_blocks + len(holders) == self.num_blocks - 1

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        pool = self.mgr.block_pool
        n = 0
        for h, copies in pool.cached_blocks.items():
            assert copies
            g, prefix = self.owner[h]
            for bid, blk in copies.items():
                assert blk.block_id == bid and blk.block_hash == h
                assert self.fake_kv[bid] == [(g, t) for t in prefix[-BS:]]
                n += 1
        assert n == sum(1 for b in pool.blocks if b.block_hash is not None)

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.mgr.free(req)
        assert self.mgr.num_free_blocks == self.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks[1:])


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


class HybridKVCacheMachine(KVCacheMachine):
    """The same over several KV cache groups of one pool: full attention and sliding windows
    (of 2 to 6 tokens over blocks of 4, so a window covers one or two blocks), the groups
    chosen before the first rule."""

    @initialize(windows=st.sampled_from([(None, 4), (None, 2, 6), (6, None, 4), (4, None),
                                         (None, None)]))
    def choose_groups(self, windows: tuple[int | None, ...]) -> None:
        self._start(windows, 1 + 8 * len(windows))


HybridKVCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                                  deadline=None)
TestHybridKVCacheMachine = HybridKVCacheMachine.TestCase
