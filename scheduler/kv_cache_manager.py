"""Per-request block tables on top of the BlockPool, with prefix-cache lookup and registration."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from scheduler.request import Request


def prompt_blocks_needed(num_tokens: int, block_size: int, sliding_window: int | None,
                         max_chunk: int) -> int:
    """The most KV blocks a prompt of `num_tokens` tokens holds at once while it is computed
    in chunks of at most `max_chunk` tokens: all of its blocks, or, when every layer slides
    over `sliding_window` keys, those under one chunk's queries' windows (the blocks behind
    them are freed first), so such a prompt may be longer than the whole cache."""
    need = -(-num_tokens // block_size)
    if sliding_window is None:
        return need
    # A span of W - 1 + chunk positions, wherever it starts, touches at most one block more
    # than it fills.
    span = sliding_window - 1 + min(num_tokens, max_chunk)
    return min(need, -(-span // block_size) + 1)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        """`sliding_window` W: every layer's queries see only their last W keys, so a
        request's blocks wholly before its next query's window go back to the pool as it
        advances (vLLM's SlidingWindowManager); their place in its block table is then the
        null block."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache
        # (or were looked up there), so registration resumes where it left off.
        self.num_cached_blocks: dict[str, int] = {}

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

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs],
                                            request.lora_int_id))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that starts the request's tokens.

        Never covers the whole sequence: the last token must be computed so the step yields
        its logits. The blocks are not yet referenced; pass them to allocate_slots.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._update_block_hashes(request, max_blocks)[:max_blocks]
        if self.sliding_window is not None:
            return self._window_hits(hashes)
        hits: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hits(self, hashes: Sequence[bytes]) -> tuple[list[KVCacheBlock], int]:
        """With a sliding window only the blocks in the window of the first query to compute
        must be cached; those before it are the null block (vLLM's sliding-window hit search),
        so a prefix whose first blocks were evicted still hits. The longest such prefix."""
        bs, window = self.block_size, self.sliding_window
        assert window is not None
        cached = [self.block_pool.get_cached_block(h) for h in hashes]
        best = best_first = 0
        last_miss = -1
        for n in range(1, len(cached) + 1):
            if cached[n - 1] is None:
                last_miss = n - 1
            first = max(0, n * bs - window + 1) // bs  # the window's first block
            if last_miss < first:
                best, best_first = n, first
        null = self.block_pool.null_block
        hits = [null] * best_first + [b for b in cached[best_first:best] if b is not None]
        return hits, best * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` tokens after the request's computed and in-flight ones
        (and `num_lookahead_tokens` more slots past them).

        `new_computed_blocks` (from get_computed_blocks, only for a request without blocks)
        are referenced and prepended. Returns the newly allocated blocks, or None (changing
        nothing but the freeing of blocks behind a sliding window, which holds either way)
        when the free queue is too short.
        """
        self.remove_skipped_blocks(request, request.num_computed_tokens)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks and blocks:
            raise ValueError(f"request {request.request_id!r} already has blocks")
        num_computed = (request.num_computed_tokens + request.num_inflight_tokens
                        + len(new_computed_blocks) * self.block_size)
        num_needed = self.num_blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens)
        num_new_blocks = max(0, num_needed - len(blocks) - len(new_computed_blocks))
        # A hit on a free cached block takes it out of the free queue as well.
        num_hits_on_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_hits_on_free > self.block_pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks:
            null = self.block_pool.null_block
            self.block_pool.touch(b for b in new_computed_blocks if b is not null)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """With a sliding window: free the blocks no query from position `num_computed_tokens`
        on can see. The step in flight, if any, reads them before any later step can write
        them (steps run in order on the device), so counting only computed tokens is safe."""
        window = self.sliding_window
        blocks = self.req_to_blocks.get(request.request_id)
        if window is None or not blocks:
            return
        first_seen = max(0, num_computed_tokens - window + 1) // self.block_size
        null = self.block_pool.null_block
        freed = []
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
        blocks = self.req_to_blocks.get(request.request_id, ())
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        hashes = self._update_block_hashes(request, end)
        for i in range(start, end):
            if blocks[i] is not self.block_pool.null_block:  # freed: out of the window
                self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def truncate(self, request: Request, num_tokens: int) -> int | None:
        """Keep only the blocks the request's first `num_tokens` tokens need, the rest back to
        the pool (those of rejected draft tokens). Returns the blocks kept, or None when
        nothing was freed. Registered (prefix-cached) blocks are always below the cut: only
        computed tokens' full blocks are registered."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return None
        tail = blocks[keep:]
        del blocks[keep:]
        null = self.block_pool.null_block
        self.block_pool.free_blocks(b for b in reversed(tail) if b is not null)
        return keep

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: when evicted, a sequence loses its end
        before the prefix other requests are likelier to share."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        null = self.block_pool.null_block
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
