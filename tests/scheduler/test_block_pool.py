"""BlockPool and KVCacheManager: reference counts, free queue, prefix cache, LRU eviction."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


NUM_BLOCKS = 14


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / decode / free / reset sequences against a fake KV store.

    Each 'computed' token is written into fake_kv at its slot, as a model runner would, so a
    cache hit can be checked against what is physically in the block.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS)
        self.fake_kv: list[list[int | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.live: dict[str, Request] = {}
        self.since_reset: set[str] = set()
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}
        self.prompts: list[list[int]] = [[]]
        self.counter = 0

    def _write(self, req: Request, start: int, end: int) -> None:
        ids = self.mgr.get_block_ids(req.request_id)[0]
        for pos in range(start, end):
            self.fake_kv[ids[pos // BS]][pos % BS] = req.all_token_ids[pos]
        toks = req.all_token_ids[:end]
        for i, h in enumerate(chain_hashes(toks)):
            self.hash_tokens[h] = tuple(toks[i * BS : i * BS + BS])

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
        blocks, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit % BS == 0 and num_hit <= len(prompt) - 1
        for i, blk in enumerate(blocks[0]):
            assert self.fake_kv[blk.block_id] == prompt[i * BS : i * BS + BS]
        # Every full block a live request computed since the last reset must be found.
        expect = 0
        for rid in self.since_reset & self.live.keys():
            other = self.live[rid]
            shared = common_prefix_len(other.all_token_ids[: other.num_computed_tokens], prompt)
            expect = max(expect, min(shared // BS, (len(prompt) - 1) // BS) * BS)
        assert num_hit >= expect
        if self.mgr.allocate_slots(req, len(prompt) - num_hit, blocks) is None:
            assert self.mgr.get_block_ids(req.request_id)[0] == []
            return
        self._write(req, num_hit, len(prompt))
        req.num_computed_tokens = len(prompt)
        self.mgr.cache_blocks(req, len(prompt))
        self.live[req.request_id] = req
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
        self._write(req, req.num_computed_tokens, req.num_tokens)
        req.num_computed_tokens += 1
        self.mgr.cache_blocks(req, req.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def free(self, pick: int) -> None:
        rid = sorted(self.live)[pick % len(self.live)]
        self.mgr.free(self.live.pop(rid))

    @rule()
    def reset(self) -> None:
        self.mgr.reset_prefix_cache()
        self.since_reset.clear()

    @invariant()
    def refcounts_match_holders(self) -> None:
        pool = self.mgr.block_pool
        holders: Counter[int] = Counter()
        for rid, req in self.live.items():
            ids = self.mgr.get_block_ids(rid)[0]
            assert len(ids) == len(set(ids)), "a block held twice by one request"
            assert NULL_BLOCK_ID not in ids
            assert len(ids) == -(-req.num_computed_tokens // BS)
            holders.update(ids)
        assert set(self.mgr.req_to_blocks) == set(self.live)
        for blk in pool.blocks[1:]:
            assert blk.ref_cnt == holders[blk.block_id]
            assert (blk.ref_cnt == 0) == (blk.block_id in pool.free_queue)
        assert pool.null_block.ref_cnt == 1 and NULL_BLOCK_ID not in pool.free_queue
        assert pool.num_free_blocks + len(holders) == NUM_BLOCKS - 1

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        pool = self.mgr.block_pool
        n = 0
        for h, copies in pool.cached_blocks.items():
            assert copies
            for bid, blk in copies.items():
                assert blk.block_id == bid and blk.block_hash == h
                assert tuple(self.fake_kv[bid]) == self.hash_tokens[h]
                n += 1
        assert n == sum(1 for b in pool.blocks if b.block_hash is not None)

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.mgr.free(req)
        assert self.mgr.num_free_blocks == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks[1:])


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
