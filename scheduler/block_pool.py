"""The paged KV cache's blocks: free list, reference counts and the prefix cache of full blocks."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Block 0 is never handed out: the model runner pads block tables with it and points the
# slot mapping of padding tokens into it, so their KV writes land where nobody reads.
NULL_BLOCK_ID = 0

# The parent of a request's first block; 32 bytes like every real hash, so the byte string
# hashed below always splits the same way into parent and tokens.
_ROOT_HASH = bytes(32)


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      lora_int_id: int = 0) -> bytes:
    """Hash of a full block: its parent's hash, its own tokens and the LoRA adapter that
    computed its KV (0: none, which adds nothing, so base-model hashes stay as they were).

    sha256 over little-endian int64s: unlike Python's `hash()` it is the same in every process,
    and collisions (which would silently serve another prompt's KV) are out of reach.
    """
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    if lora_int_id:
        # After the tokens, marked so no token sequence spells the same bytes.
        data += b"lora" + struct.pack("<q", lora_int_id)
    return hashlib.sha256((parent_hash or _ROOT_HASH) + data).digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache (full and computed).
    block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """A fixed set of blocks; block 0 is reserved (NULL_BLOCK_ID).

    Free blocks wait in one queue, taken from the front. A freed block that holds a cached
    prefix goes to the back and stays findable by its hash until it reaches the front and is
    reused, so cached blocks are evicted least recently freed first. A freed block without a
    hash holds nothing worth keeping and goes to the front.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # Held by the pool itself forever, so the invariant "free iff ref_cnt == 0" has no
        # exception.
        self.null_block.ref_cnt = 1
        # An OrderedDict is a linked list with O(1) removal from the middle (a cache hit on a
        # free block) as well as from the front.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        # Usually one block per hash; more when requests computed the same content in the
        # same step, so each copy stays findable until it is itself evicted.
        self.cached_blocks: dict[bytes, dict[int, KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        copies = self.cached_blocks.get(block_hash)
        if not copies:
            return None
        # A copy already in use costs no free block to share.
        return max(copies.values(), key=lambda b: b.ref_cnt > 0)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks off the free queue, evicting their cached contents."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; give the caller's eviction order (first freed is
        evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"freeing {block!r}, which is not held")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (a no-op if it already is)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, {})[block.block_id] = block

    def _uncache(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None, "only cached blocks are uncached"
        copies = self.cached_blocks[block_hash]
        del copies[block.block_id]
        if not copies:
            del self.cached_blocks[block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their contents but can no longer be hit
        (needed after new weights make cached KV stale)."""
        for copies in self.cached_blocks.values():
            for block in copies.values():
                block.block_hash = None
        self.cached_blocks.clear()
