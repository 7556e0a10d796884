"""The KV block manager's prefix cache: a hit needs the same tokens after the same blocks, never a hash alone."""

from __future__ import annotations

import time
from array import array

import numpy as np

from batchjob.engine.native.scheduling.block_manager import KVBlockManager

BLOCK = 4


def blocks_of(tokens: list[int]) -> list[bytes]:
    ids = np.asarray(tokens, dtype=np.int64)
    return [ids[i : i + BLOCK].tobytes() for i in range(0, len(ids) - BLOCK + 1, BLOCK)]


def admit(manager: KVBlockManager, tokens: list[int], hashes: list[int]) -> tuple[list[int], list[int]]:
    """Allocate a prompt's blocks as the scheduler does and register them; returns (shared, block table)."""
    contents = blocks_of(tokens)
    shared = manager.match_prefix(hashes, contents)
    table = manager.allocate(shared, len(contents) - len(shared))
    for index, block in enumerate(table):
        manager.register(block, hashes[index], contents[index], table[index - 1] if index else None)
    manager.check_invariants()
    return shared, table


def test_identical_prompts_share_their_blocks() -> None:
    manager = KVBlockManager(num_blocks=16, block_size=BLOCK)
    prompt = list(range(8))
    _, first = admit(manager, prompt, [11, 12])
    shared, second = admit(manager, prompt, [11, 12])
    assert shared == first == second


def test_colliding_hashes_with_other_tokens_are_not_shared() -> None:
    manager = KVBlockManager(num_blocks=16, block_size=BLOCK)
    _, first = admit(manager, list(range(8)), [7, 7])
    shared, second = admit(manager, list(range(100, 108)), [7, 7])
    assert shared == []
    assert not set(first) & set(second)


def test_same_tokens_after_another_prefix_are_not_shared() -> None:
    manager = KVBlockManager(num_blocks=16, block_size=BLOCK)
    _, first = admit(manager, [1, 2, 3, 4, 9, 9, 9, 9], [5, 6])
    # Block 2 has the same tokens and (colliding) hash, but its K/V were computed after other tokens.
    shared, _ = admit(manager, [8, 8, 8, 8, 9, 9, 9, 9], [15, 6])
    assert shared == []


def test_a_cached_child_is_not_matched_after_its_parent_block_got_other_content() -> None:
    manager = KVBlockManager(num_blocks=3, block_size=BLOCK)
    _, (parent, child) = admit(manager, [0, 1, 2, 3, 4, 5, 6, 7], [1, 2])
    manager.free([parent])
    manager.free([child])
    _, (reused,) = admit(manager, [50, 51, 52, 53], [9])
    assert reused == parent
    # Same first block as the new content and a second block whose hash collides with the old child's:
    # the child's K/V were computed after other tokens, so only the first block may be shared.
    assert manager.match_prefix([9, 2], blocks_of([50, 51, 52, 53, 4, 5, 6, 7])) == [parent]


def test_blocks_go_out_plain_freed_first_then_never_used_then_oldest_cached() -> None:
    manager = KVBlockManager(num_blocks=10, block_size=BLOCK)
    _, cached = admit(manager, list(range(8)), [1, 2])  # blocks 1, 2 hold a prompt's content
    plain = manager.allocate([], 2)  # blocks 3, 4 hold none
    assert (cached, plain) == ([1, 2], [3, 4])
    manager.free(cached)
    manager.free(plain)
    manager.check_invariants()
    assert manager.num_free == 9
    # freed without content first (a sequence's first block first), then 5..9, then the cached blocks, so a
    # finished prompt's content is evicted last, its first block (the one a later prompt shares first) last of all
    assert manager.allocate([], 9) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    manager.check_invariants()
    assert manager.num_free == 0
    assert not manager.can_allocate(1)


def median_seconds(make) -> float:
    """The median of three timings of `make()`, each result dropped before the next."""
    timings = []
    for _ in range(3):
        began = time.perf_counter()
        made = make()
        timings.append(time.perf_counter() - began)
        del made
    return sorted(timings)[1]


def test_a_cache_of_tens_of_millions_of_blocks_is_ready_at_once() -> None:
    # Timed against filling an array with one number per block, in this process, rather than in seconds: a machine
    # busy with other work is several times slower at both. The manager takes one to two such fills; a Python
    # object per block took about 9 s, some 100 fills (a plain list of 40 million ints alone takes 12).
    fill = median_seconds(lambda: array("i", [0]) * 40_000_000)
    assert median_seconds(lambda: KVBlockManager(num_blocks=40_000_000, block_size=BLOCK)) < 10 * fill
    manager = KVBlockManager(num_blocks=40_000_000, block_size=BLOCK)
    assert manager.num_free == 40_000_000 - 1
    assert manager.allocate([], 3) == [1, 2, 3]
