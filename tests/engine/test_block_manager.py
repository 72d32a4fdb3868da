"""BlockManager: allocation, reference counts, hash chaining, LRU eviction."""
import pytest

from nightshift.engine.block_manager import ROOT_HASH, BlockManager, chain_hash
from nightshift.engine.sequence import Sequence
from nightshift.engine.types import GenerationRequest

BS = 4


def make_seq(tokens, rid="r"):
    return Sequence(GenerationRequest(rid, list(tokens)), block_size=BS)


def admit(bm, seq, num_new=None):
    """What the scheduler does: take the cached prefix, allocate the rest, compute it."""
    matched = bm.match_prefix(seq)
    bm.allocate_prefix(seq, matched)
    n = seq.num_uncomputed_tokens if num_new is None else num_new
    assert bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.register_computed_blocks(seq)
    return len(matched)


def test_allocation_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(10))
    admit(bm, seq)
    assert len(seq.block_table) == 3          # 10 tokens -> 3 blocks of 4
    assert bm.num_used_blocks == 3
    assert len(set(seq.block_table)) == 3
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    assert seq.block_table == [] and seq.num_computed_tokens == 0


def test_allocate_slots_refuses_without_taking_anything_when_full():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(range(12))
    bm.allocate_prefix(seq, [])
    assert not bm.allocate_slots(seq, 12)     # needs 3 blocks, pool has 2
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate_slots(seq, 8)


def test_hash_is_chained_over_parent_and_tokens():
    seq = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm = BlockManager(num_blocks=8, block_size=BS)
    hashes = bm.block_hashes(seq, 2)
    assert hashes[0] == chain_hash(ROOT_HASH, [1, 2, 3, 4])
    assert hashes[1] == chain_hash(hashes[0], [5, 6, 7, 8])
    # same block tokens behind a different first block: different key
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 1])
    assert bm.block_hashes(other, 2)[1] != hashes[1]


def test_shared_prefix_reuses_full_blocks_and_counts_references():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    admit(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44], "b")
    assert admit(bm, b) == 2                  # two full blocks shared, partial third is not
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert bm.num_used_blocks == 3


def test_partial_last_block_is_never_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5, 6], "a")
    admit(bm, a)
    assert bm.blocks[a.block_table[1]].hash is None
    assert len(bm.hash_to_block) == 1


def test_last_token_is_always_recomputed_even_when_fully_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(8), "a")
    admit(bm, a)
    assert len(bm.hash_to_block) == 2
    b = make_seq(range(8), "b")
    assert admit(bm, b, num_new=None) == 1    # 2nd block holds the last token: recomputed
    assert b.num_computed_tokens == 8


def test_freed_blocks_stay_cached_and_are_revived():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(9), "a")
    admit(bm, a)
    cached_ids = a.block_table[:2]
    bm.free(a)
    assert bm.num_cached_free_blocks == 2 and bm.num_used_blocks == 0
    b = make_seq(list(range(8)) + [77, 78], "b")
    assert admit(bm, b) == 2
    assert b.block_table[:2] == cached_ids
    assert bm.num_cached_free_blocks == 0


def test_uncached_free_blocks_are_used_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(9), "a")              # 2 cacheable full blocks + 1 partial
    admit(bm, a)
    bm.free(a)
    c = make_seq([100, 101], "c")
    admit(bm, c)                               # takes a plain free block
    assert bm.num_cached_free_blocks == 2
    assert len(bm.hash_to_block) == 2


def test_lru_eviction_drops_the_oldest_and_tail_blocks_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = make_seq(range(9), "old")            # blocks [x, y, partial]
    admit(bm, old)
    old_ids = list(old.block_table)
    bm.free(old)                               # LRU order: y (tail) then x
    filler = make_seq([50, 51, 52, 53, 54, 55, 56, 57, 58], "filler")
    admit(bm, filler)                          # needs 3 blocks: 2 uncached + evicts 1 cached
    assert old_ids[1] in filler.block_table    # the tail block went first
    assert old_ids[0] not in filler.block_table
    probe = make_seq(list(range(8)) + [1], "probe")
    bm.free(filler)
    assert len(bm.match_prefix(probe)) == 1    # the head block survived, the tail did not


def test_collision_with_different_tokens_is_not_a_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    block = bm.blocks[a.block_table[0]]
    # forge a collision: another prompt's first-block hash pointing at a's block
    b = make_seq([9, 9, 9, 9, 5], "b")
    forged = bm.block_hashes(b, 1)[0]
    bm.hash_to_block[forged] = block.block_id
    assert bm.match_prefix(b) == []


def test_twin_blocks_computed_twice_keep_one_cache_entry_and_free_cleanly():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(range(5), "a"), make_seq(range(5), "b")
    for s in (a, b):                           # both admitted before either computed
        bm.allocate_prefix(s, bm.match_prefix(s))
        assert bm.allocate_slots(s, 5)
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.register_computed_blocks(s)
    assert bm.hash_to_block[bm.block_hashes(a, 1)[0]] == a.block_table[0]
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0
    assert bm.num_cached_free_blocks == 1      # b's twin went back as a plain block


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(range(9), "a")
    admit(bm, a)
    b = make_seq(range(9), "b")
    assert admit(bm, b) == 0
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    assert bm.num_cached_free_blocks == 0


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(3), "a")
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


def test_reset_prefix_cache_forgets_free_cached_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=BS)
    held, freed = make_seq(range(9), "held"), make_seq(range(100, 109), "freed")
    admit(bm, held)
    admit(bm, freed)
    bm.free(freed)
    assert bm.num_cached_free_blocks == 2
    bm.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 8 - 3
    assert bm.match_prefix(make_seq(range(100, 109))) == []          # forgotten
    assert len(bm.match_prefix(make_seq(range(9)))) == 2             # a held sequence's blocks stay


def test_fork_shares_full_blocks_copies_the_partial_one_and_frees_each_once():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = make_seq(range(10))                # 2 full blocks + a partial one
    admit(bm, parent)
    child = parent.fork(1)
    assert bm.fork_cost(parent) == 1
    source, destination = bm.fork(parent, child)
    assert source == parent.block_table[2] and destination not in parent.block_table
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] == destination
    assert child.num_computed_tokens == 10
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    bm.free(parent)
    assert bm.num_used_blocks == 3              # the child still holds the shared blocks and its copy
    bm.free(child)
    assert bm.num_used_blocks == 0
    even = make_seq(range(100, 108))            # whole blocks only: nothing to copy
    admit(bm, even)
    assert bm.fork_cost(even) == 0 and bm.fork(even, even.fork(1)) is None
