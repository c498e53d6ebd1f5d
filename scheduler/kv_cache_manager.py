"""Per-request block tables on top of the BlockPool, with prefix-cache lookup and registration,
in one or more KV cache groups."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from scheduler.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from scheduler.request import Request


def prompt_blocks_needed(num_tokens: int, block_size: int,
                         group_windows: Sequence[int | None], max_chunk: int) -> int:
    """The most KV blocks a prompt of `num_tokens` tokens holds at once while it is computed
    in chunks of at most `max_chunk` tokens, summed over the KV cache groups: a group of full
    attention holds all of its blocks; a group whose layers slide over W keys only those under
    one chunk's queries' windows (the blocks behind them are freed first), so with every
    layer sliding a prompt may be longer than the whole cache."""
    need = -(-num_tokens // block_size)
    total = 0
    for window in group_windows:
        if window is None:
            total += need
            continue
        # A span of W - 1 + chunk positions, wherever it starts, touches at most one block
        # more than it fills.
        span = window - 1 + min(num_tokens, max_chunk)
        total += min(need, -(-span // block_size) + 1)
    return total


def _group_key(block_hash: bytes, group: int) -> bytes:
    """A block's prefix-cache key in KV cache group `group`: the groups' blocks of the same
    tokens hold different layers' KV. The first group's key is the hash itself."""
    return block_hash if group == 0 else block_hash + b"group" + struct.pack("<i", group)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 group_windows: Sequence[int | None] = (None,)) -> None:
        """`group_windows`: one entry per KV cache group (each a set of layers sharing one
        block table, all drawing on one pool; vLLM's hybrid allocator when they differ), its
        layers' attention window, or None for full attention. A sliding group's blocks wholly
        before a request's next query's window go back to the pool as it advances (vLLM's
        SlidingWindowManager); their place in its block table is then the null block."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        group_windows = tuple(group_windows)
        if not group_windows:
            raise ValueError("group_windows needs one entry per KV cache group, got none")
        for w in group_windows:
            if w is not None and w < 1:
                raise ValueError(f"a group's sliding window must be >= 1 or None, got {w}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Per request, one block list per group, all of one length (the null block stands in
        # for a sliding group's freed blocks).
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        # How many leading blocks of each request are already registered in the prefix cache
        # (or were looked up there), so registration resumes where it left off.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def frees_behind_windows(self) -> bool:
        """Whether some group slides: a step's progress frees blocks."""
        return any(w is not None for w in self.group_windows)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Every block but the reserved null block."""
        return self.block_pool.num_usable_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each group."""
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return tuple([] for _ in self.group_windows)
        return tuple([b.block_id for b in blocks] for blocks in groups)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one group's table needs for `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_free_blocks_to_hold(self, request: Request,
                                computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                max_chunk: int) -> int:
        """Free blocks the request's whole sequence so far would take from the pool, computed
        in chunks of at most `max_chunk` tokens after the prefix-cache hit `computed_blocks`
        (from get_computed_blocks): hits other requests hold cost nothing, hits on free
        cached blocks cost one each, like the blocks still to fill."""
        need = prompt_blocks_needed(request.num_tokens, self.block_size, self.group_windows,
                                    max_chunk)
        null = self.block_pool.null_block
        held = sum(1 for blocks in computed_blocks for b in blocks
                   if b is not null and b.ref_cnt > 0)
        return max(0, need - held)

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs],
                                            request.lora_int_id))
        return hashes

    def get_computed_blocks(self, request: Request
                            ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest run of cached full blocks that starts the request's tokens, in every
        group, and the tokens it covers.

        Never covers the whole sequence: the last token must be computed so the step yields
        its logits. The blocks are not yet referenced; pass them to allocate_slots.
        """
        empty = tuple([] for _ in self.group_windows)
        if not self.enable_caching or request.skip_prefix_cache:
            return empty, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._update_block_hashes(request, max_blocks)[:max_blocks]
        pool = self.block_pool
        cached = [[pool.get_cached_block(_group_key(h, g)) for h in hashes]
                  for g in range(self.num_groups)]
        # Each group's longest hit within the others': a sliding group's shorter hit can
        # leave another sliding group's window short of cached blocks, so until they agree.
        n = max_blocks
        while True:
            m = n
            for g, window in enumerate(self.group_windows):
                m = self._longest_hit(cached[g][:m], window)
            if m == n:
                break
            n = m
        if n == 0:
            return empty, 0
        null = pool.null_block
        hits = []
        for g, window in enumerate(self.group_windows):
            first = 0 if window is None else self._first_in_window(n, window)
            hits.append([null] * first + [b for b in cached[g][first:n] if b is not None])
        return tuple(hits), n * self.block_size

    def _first_in_window(self, num_blocks: int, window: int) -> int:
        """The first block the window of the query after `num_blocks` full blocks sees."""
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def _longest_hit(self, cached: Sequence[KVCacheBlock | None], window: int | None) -> int:
        """The most leading blocks a hit may cover in a group whose lookups are `cached`:
        with full attention a run of cached blocks from the first; with a window only the
        blocks in the window of the first query to compute must be cached, those before it
        are the null block (vLLM's sliding-window hit search), so a prefix whose first blocks
        were evicted still hits."""
        if window is None:
            return next((i for i, b in enumerate(cached) if b is None), len(cached))
        best = 0
        last_miss = -1
        for n in range(1, len(cached) + 1):
            if cached[n - 1] is None:
                last_miss = n - 1
            if last_miss < self._first_in_window(n, window):
                best = n
        return best

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]] = (),
        num_lookahead_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...] | None:
        """Make room for `num_new_tokens` tokens after the request's computed and in-flight ones
        (and `num_lookahead_tokens` more slots past them), in every group.

        `new_computed_blocks` (from get_computed_blocks, one list per group, only for a
        request without blocks) are referenced and prepended. Returns each group's newly
        allocated blocks, or None (changing nothing but the freeing of blocks behind a
        sliding window, which holds either way) when the free queue is too short.
        """
        self.remove_skipped_blocks(request, request.num_computed_tokens)
        rid = request.request_id
        groups = self.req_to_blocks.get(rid)
        num_hit_blocks = len(new_computed_blocks[0]) if new_computed_blocks else 0
        if num_hit_blocks and groups is not None and groups[0]:
            raise ValueError(f"request {rid!r} already has blocks")
        held = len(groups[0]) if groups is not None else 0
        num_computed = (request.num_computed_tokens + request.num_inflight_tokens
                        + num_hit_blocks * self.block_size)
        num_needed = self.num_blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens)
        num_new_blocks = max(0, num_needed - held - num_hit_blocks)
        # A hit on a free cached block takes it out of the free queue as well.
        num_hits_on_free = sum(1 for blocks in new_computed_blocks for b in blocks
                               if b.ref_cnt == 0)
        if num_new_blocks * self.num_groups + num_hits_on_free > self.block_pool.num_free_blocks:
            return None
        if groups is None:
            groups = self.req_to_blocks[rid] = tuple([] for _ in self.group_windows)
        if num_hit_blocks:
            null = self.block_pool.null_block
            for blocks, hits in zip(groups, new_computed_blocks, strict=True):
                self.block_pool.touch(b for b in hits if b is not null)
                blocks.extend(hits)
            self.num_cached_blocks[rid] = num_hit_blocks
        new_blocks = tuple(self.block_pool.get_new_blocks(num_new_blocks)
                           for _ in self.group_windows)
        for blocks, new in zip(groups, new_blocks, strict=True):
            blocks.extend(new)
        return new_blocks

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """In each sliding group: free the blocks no query from position `num_computed_tokens`
        on can see. The step in flight, if any, reads them before any later step can write
        them (steps run in order on the device), so counting only computed tokens is safe."""
        groups = self.req_to_blocks.get(request.request_id)
        if groups is None:
            return
        null = self.block_pool.null_block
        freed = []
        for blocks, window in zip(groups, self.group_windows, strict=True):
            if window is None:
                continue
            first_seen = max(0, num_computed_tokens - window + 1) // self.block_size
            # Nearest first, down to the blocks freed before: the run starts at block 0.
            for i in range(min(first_seen, len(blocks)) - 1, -1, -1):
                if blocks[i] is null:
                    break
                freed.append(blocks[i])
                blocks[i] = null
        # Freed newest first: a cached prefix's first blocks stay findable the longest.
        self.block_pool.free_blocks(freed)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that `num_computed_tokens` filled, prompt or output."""
        if not self.enable_caching:
            return
        groups = self.req_to_blocks.get(request.request_id)
        if not groups:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(groups[0]))
        if end <= start:
            return
        hashes = self._update_block_hashes(request, end)
        null = self.block_pool.null_block
        for g, blocks in enumerate(groups):
            for i in range(start, end):
                if blocks[i] is not null:  # freed: out of the window
                    self.block_pool.cache_block(blocks[i], _group_key(hashes[i], g))
        self.num_cached_blocks[request.request_id] = end

    def truncate(self, request: Request, num_tokens: int) -> int | None:
        """Keep only the blocks the request's first `num_tokens` tokens need, the rest back to
        the pool (those of rejected draft tokens). Returns the blocks kept per group, or None
        when nothing was freed. Registered (prefix-cached) blocks are always below the cut:
        only computed tokens' full blocks are registered."""
        groups = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_needed(num_tokens)
        if not groups or len(groups[0]) <= keep:
            return None
        self.block_pool.free_blocks(self._tails(groups, keep))
        for blocks in groups:
            del blocks[keep:]
        return keep

    def _tails(self, groups: Sequence[list[KVCacheBlock]], keep: int) -> list[KVCacheBlock]:
        """The groups' blocks from `keep` on, last position first (within a position, group by
        group), the null block left out: the pool evicts first what it is given first."""
        null = self.block_pool.null_block
        return [blocks[i] for i in range(len(groups[0]) - 1, keep - 1, -1) for blocks in groups
                if blocks[i] is not null]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: when evicted, a sequence loses its end
        before the prefix other requests are likelier to share."""
        groups = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if groups:
            self.block_pool.free_blocks(self._tails(groups, 0))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
