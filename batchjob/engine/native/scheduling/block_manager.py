"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, and prefix sharing by content hash.

Block 0 is reserved as a scratch block: padding tokens of CUDA-graph batches write their K/V there, so it is
never handed to a sequence. A full block is registered under the hash of its tokens (chained with the hash of
the block before it); a later sequence whose prompt starts with the same tokens shares it instead of
recomputing it. That gives `n > 1` samples and shared-prefix workloads one prefill of the common part.

A hash alone never decides a hit: a block's K/V depend on every token before it, so each cached block keeps
its own token ids and the identity of the block before it (its number and the epoch at which that block got
its content), and a hit must match both. Two prompts whose hashes collide therefore never share a block.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple


class KVCacheExhausted(RuntimeError):
    pass


def block_hash(previous: int, tokens: Sequence[int]) -> int:
    return hash((previous, tuple(tokens)))


class CachedContent(NamedTuple):
    """What a registered block holds: checked in full on every hit."""

    hash: int
    parent: tuple[int, int] | None  # (block, epoch) of the block before it; None for a prompt's first block
    tokens: bytes  # the block's token ids, as the sequence's int64 array bytes


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (1 scratch + 1 usable), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Arrays, not lists, and the never-used blocks as a counter, not entries: a small model's KV cache can
        # hold tens of millions of blocks, and building a Python object per block took seconds of start-up.
        self.ref_counts = array("i", [0]) * num_blocks
        self.ref_counts[0] = 1
        # The free blocks in the order they are handed out: blocks freed without cached content (newest first),
        # then the never-used ones (`_fresh` up), then freed blocks with cached content (oldest first), so the
        # oldest cached content is evicted first and a just-finished prompt stays reusable longest.
        self._free_plain: list[int] = []
        self._fresh = 1
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # hash -> block and block -> content for full blocks whose content is known; a cached block with
        # ref count 0 stays in `_free_cached` until it is needed for something else.
        self._by_hash: dict[int, int] = {}
        self._content: dict[int, CachedContent] = {}
        # Bumped whenever a block is handed out anew, so a child block's parent reference goes stale with it.
        # Blocks never handed out have none.
        self._epoch: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + (self.num_blocks - self._fresh) + len(self._free_cached)

    def _take_free(self) -> int:
        if self._free_plain:
            block = self._free_plain.pop()
        elif self._fresh < self.num_blocks:
            block = self._fresh
            self._fresh += 1
        elif self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
        else:
            raise KVCacheExhausted("no free KV block")
        self._forget(block)
        self._epoch[block] = self._epoch.get(block, 0) + 1
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        old = self._content.pop(block, None)
        if old is not None and self._by_hash.get(old.hash) == block:
            del self._by_hash[old.hash]

    def parent_ref(self, block: int | None) -> tuple[int, int] | None:
        return None if block is None else (block, self._epoch[block])

    def _share(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free_cached[block]  # only a block with cached content is shared
        self.ref_counts[block] += 1

    def match_prefix(self, hashes: Sequence[int], token_blocks: Sequence[bytes]) -> list[int]:
        """Blocks already holding the leading full blocks with these hashes and token ids (longest match)."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        parent = None
        for h, tokens in zip(hashes, token_blocks, strict=True):
            block = self._by_hash.get(h)
            if block is None:
                break
            content = self._content[block]
            if content.tokens != tokens or content.parent != parent:
                break  # a hash collision, or the same tokens after another prefix
            blocks.append(block)
            parent = self.parent_ref(block)
        return blocks

    def blocks_needed(self, cached_blocks: int, total_tokens: int) -> int:
        return max(0, -(-total_tokens // self.block_size) - cached_blocks)

    def allocate(self, shared: Sequence[int], num_new: int) -> list[int]:
        """Take `shared` (from `match_prefix`) plus `num_new` fresh blocks, or nothing if that does not fit."""
        reusable_free = sum(1 for b in shared if self.ref_counts[b] == 0)
        if num_new > self.num_free - reusable_free:
            raise KVCacheExhausted(f"need {num_new} blocks, {self.num_free - reusable_free} free")
        for block in shared:
            self._share(block)
        return list(shared) + [self._take_free() for _ in range(num_new)]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def append_block(self) -> int:
        return self._take_free()

    def register(self, block: int, h: int, tokens: bytes, parent: int | None) -> None:
        """Record that `block` now holds a full block of `tokens` (hash `h`) following block `parent`."""
        if not self.enable_prefix_caching or block in self._content:
            return
        content = CachedContent(h, self.parent_ref(parent), tokens)
        holder = self._by_hash.get(h)
        if holder is not None:
            if self._content[holder] == content:
                return  # the same content is cached already
            # A collision, or an entry whose parent was reused since: the newer content takes the hash.
            del self._content[holder]
        self._by_hash[h] = block
        self._content[block] = content

    def free(self, blocks: Sequence[int]) -> None:
        # Blocks go back newest-first, so that a just-finished prompt's cached blocks are evicted last.
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            if count < 0 or block == 0:
                raise AssertionError(f"freeing block {block} with ref count {self.ref_counts[block]}")
            self.ref_counts[block] = count
            if count == 0:
                if block in self._content:
                    self._free_cached[block] = None
                else:
                    self._free_plain.append(block)

    def check_invariants(self) -> None:
        free = {*self._free_plain, *range(self._fresh, self.num_blocks), *self._free_cached}
        if len(free) != self.num_free:
            raise AssertionError("a block is on the free lists twice")
        for block in range(1, self.num_blocks):
            in_free = block in free
            if in_free != (self.ref_counts[block] == 0):
                raise AssertionError(f"block {block}: ref count {self.ref_counts[block]} but in free list = {in_free}")
        for h, block in self._by_hash.items():
            content = self._content.get(block)
            if content is None or content.hash != h:
                raise AssertionError(f"hash index out of sync for block {block}")
        if len(self._content) != len(self._by_hash):
            raise AssertionError(f"{len(self._content)} cached blocks but {len(self._by_hash)} indexed hashes")
