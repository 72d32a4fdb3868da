"""Paged KV block pool with reference counts and a hash-chained prefix cache.

Every FULL block of a sequence is keyed by `hash((parent_hash, token_ids))`, chained
from the first block, so a key names the whole prefix up to that block. The hash is
Python's built-in tuple hash over ints (deterministic across processes, 64-bit; the
root parent is the constant ROOT_HASH, never None, whose hash varies per process).
On a hit the block's stored parent hash and token ids are compared too, so a false
hit would need a 64-bit collision of the parent chain itself.

A block is registered as soon as all its tokens are computed, so a sequence admitted
in a later step reuses it even while its first owner is still running. The last,
partial block of a sequence is never cached. Freed blocks that carry a hash stay in
the cache (LRU order, a sequence's tail blocks first) and are only evicted when a new
block is needed and no uncached free block is left.

Sliding windows: when every layer of the model attends within a window (ModelConfig.kv_window),
a running sequence's leading blocks that fall wholly before the oldest position its next query
reads are given back early (`release_before`): the entry in its block_table becomes RELEASED
(the table keeps its length, so block i still covers positions i * block_size..), and the block
loses this sequence's reference like a freed one. A released block that was registered stays in
the prefix cache, intact, until evicted: its K/V are those of its positions whatever follows, so
a later prompt with the same prefix may reuse it (match_prefix only offers a chain that starts at
the first block and has every block up to the hit, and a block is only overwritten after
eviction, which drops its hash). A sequence never reads its own released entries again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

from nightshift.engine.sequence import Sequence

ROOT_HASH = 0x6E69676874736866  # parent hash of a sequence's first block
RELEASED = -1                   # a block_table entry given back (out of every layer's window)


def chain_hash(parent_hash: int, token_ids: Seq[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: Optional[int] = None
    parent_hash: int = ROOT_HASH
    token_ids: tuple = ()

    def reset(self) -> None:
        self.ref_count = 0
        self.hash = None
        self.parent_hash = ROOT_HASH
        self.token_ids = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # ref_count == 0 blocks: plain ones (used first), and cached ones in LRU order
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    # ---- capacity --------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (uncached free + evictable cached)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (they become plain free blocks)."""
        for block_id in self._free_cached:
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.reset()
            self._free_uncached.append(block_id)
        self._free_cached.clear()

    # ---- hashing ---------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of seq's first `num_blocks` full blocks (memoised on seq)."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(chain_hash(parent, seq.block_tokens(i)))
        return hashes[:num_blocks]

    def _lookup(self, block_hash: int, parent_hash: int, token_ids: tuple) -> Optional[int]:
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None  # hash collision
        return block_id

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of seq's longest cached prefix.

        At most (num_tokens - 1) // block_size blocks: the last token always runs so
        the model produces logits for it.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(seq, max_blocks)
        matched: list[int] = []
        parent = ROOT_HASH
        for i, h in enumerate(hashes):
            block_id = self._lookup(h, parent, tuple(seq.block_tokens(i)))
            if block_id is None:
                break
            matched.append(block_id)
            parent = h
        return matched

    def first_missing_block_hash(self, seq: Sequence, num_matched: int) -> Optional[int]:
        """Hash of the first prompt block after the cached prefix, if it is a full block."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if num_matched >= max_blocks:
            return None
        return self.block_hashes(seq, num_matched + 1)[num_matched]

    # ---- allocation ------------------------------------------------------------
    def admission_cost(self, matched: list[int], seq: Sequence, num_new_tokens: int, skip: int = 0) -> int:
        """Free blocks that admitting seq (cached prefix + first chunk) would consume; the first
        `skip` matched blocks are not taken (see allocate_prefix)."""
        revived = sum(1 for b in matched[skip:] if self.blocks[b].ref_count == 0)
        total = self.blocks_for_tokens(len(matched) * self.block_size + num_new_tokens)
        return revived + total - len(matched)

    def allocate_prefix(self, seq: Sequence, matched: list[int], skip: int = 0) -> int:
        """Give seq the cached blocks `matched` (from match_prefix). Returns cached tokens. With a
        window, the first `skip` of them lie wholly before the oldest position its first query
        reads: they enter its table RELEASED, never taken (a prompt longer than the pool, cached
        earlier, is admitted holding only its window's blocks)."""
        assert not seq.block_table, "sequence already holds blocks"
        for block_id in matched[skip:]:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
        seq.block_table = [RELEASED] * skip + list(matched[skip:])
        seq.num_released_blocks = skip
        seq.num_registered_blocks = len(matched)
        seq.num_computed_tokens = len(matched) * self.block_size
        return seq.num_computed_tokens

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        need = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, need - len(seq.block_table))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of seq; False (nothing taken) if full."""
        need = self.new_blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.pop()
        else:
            block_id, _ = self._free_cached.popitem(last=False)  # evict least recently used
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
        block = self.blocks[block_id]
        block.reset()
        block.ref_count = 1
        return block_id

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Enter seq's newly completed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            if seq.block_table[i] == RELEASED:      # (released blocks were registered before)
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = hashes[i]
                block.parent_hash = hashes[i - 1] if i else ROOT_HASH
                block.token_ids = tuple(seq.block_tokens(i))
                # a twin computed by another sequence keeps the entry; this one stays private
                self.hash_to_block.setdefault(block.hash, block.block_id)
        seq.num_registered_blocks = num_full

    def fork_cost(self, parent: Sequence) -> int:
        """Free blocks one fork of `parent` takes: a copy of its partial last block, if it has one."""
        return 1 if parent.num_computed_tokens % self.block_size else 0

    def fork(self, parent: Sequence, child: Sequence) -> Optional[tuple[int, int]]:
        """Give `child` (a fork holding no blocks) `parent`'s computed prefix: every full block
        shared (one more reference each), the partial last block copied to a fresh one. Returns
        the (source, destination) block ids whose K/V the caller must copy, or None. The caller
        checks fork_cost against num_free_blocks first."""
        assert not child.block_table, "fork target already holds blocks"
        full = parent.num_computed_tokens // self.block_size
        for block_id in parent.block_table[:full]:
            if block_id != RELEASED:
                self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table[:full])
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        child.num_released_blocks = parent.num_released_blocks
        if full == len(parent.block_table):
            return None
        block_id = self._take_free_block()
        child.block_table.append(block_id)
        return parent.block_table[full], block_id

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks reaching zero stay cached if they carry a hash."""
        for block_id in reversed(seq.block_table):  # tail blocks become LRU-first
            if block_id != RELEASED:
                self._drop(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0

    def release_before(self, seq: Sequence, position: int) -> int:
        """Give back seq's blocks that lie wholly before `position` (the oldest position any of its
        later queries reads) and are computed; their table entries become RELEASED. Returns how
        many blocks were given back. Only for models whose every layer attends within a window."""
        end = min(max(position, 0), seq.num_computed_tokens) // self.block_size
        released = 0
        for i in range(seq.num_released_blocks, min(end, len(seq.block_table))):
            self._drop(seq.block_table[i])
            seq.block_table[i] = RELEASED
            released += 1
        seq.num_released_blocks = max(seq.num_released_blocks, end)
        return released

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks seq holds (its table less the released entries)."""
        return len(seq.block_table) - seq.num_released_blocks

    def _drop(self, block_id: int) -> None:
        """One reference less; a block reaching zero stays cached if it carries a hash."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                self._free_cached[block_id] = None
            else:
                block.reset()
                self._free_uncached.append(block_id)
