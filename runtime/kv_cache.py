"""Paged KV bookkeeping: a fixed pool of blocks and one block table per sequence, in plain Python, with an optional
prefix cache.

Owns which slots a sequence's KV entries live in; knows nothing about tensors (those are in `kv_pool.KVPool`), trees
or models. Slot `s` is token `s % block_size` of block `s // block_size`.

Prefix cache (`prefix_cache=True`, vLLM's automatic prefix caching at block granularity): a *full* block whose KV holds
committed tokens can be registered under its exact key (the key of the block before it, its tokens). A new sequence
whose first tokens match registered blocks starts with those blocks in its table (reference counted) instead of
recomputing them. A block nobody references stays cached and counts as free; it is evicted (least recently released
first) only when a free block is needed. Registered blocks are immutable: a truncation that would let a sequence
overwrite one takes it out of the cache (its only user) or copies its kept part to a private block (shared), and
reports that copy for the caller to perform on the KV tensors. Keys are compared exactly (token tuples), so a hit can
never return another prefix's KV.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


class OutOfKVBlocks(RuntimeError):
    """Not enough free KV blocks; raised before any state changes."""

    def __init__(self, num_needed: int, num_free: int) -> None:
        super().__init__(f"out of KV blocks: need {num_needed}, {num_free} free")
        self.num_needed = num_needed
        self.num_free = num_free


@dataclass
class _Entry:
    """A registered block: `key` = (id of the entry before it, or -1 at the start; its tokens)."""

    id: int
    block: int
    key: tuple[int, tuple[int, ...]]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        # LIFO free list: recently freed blocks are reused first (warm in cache on GPU).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._refs = [0] * num_blocks
        self._entries: dict[tuple[int, tuple[int, ...]], _Entry] = {}  # key -> registered block
        self._entry_of: dict[int, _Entry] = {}  # block -> its entry
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks, oldest first
        self._chains: dict[str, list[int]] = {}  # per seq: entry ids of its leading registered blocks
        self._ids = itertools.count()
        self.num_cache_queries = 0  # prompt tokens looked up (metrics)
        self.num_cache_hits = 0  # of those, tokens found cached

    # ---- queries -------------------------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get: never used, or cached but referenced by no sequence (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    def num_cached_blocks(self) -> int:
        return len(self._entry_of)

    def match_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` registered blocks hold (a multiple of block_size; 0 without a cache).
        No state changes."""
        return len(self._match(tokens)) * self.block_size

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._table(seq_id))

    def capacity(self, seq_id: str) -> int:
        """Tokens the sequence can hold without allocating."""
        return len(self._table(seq_id)) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq_id: str, total_len: int) -> int:
        """Extra blocks `ensure_capacity(seq_id, total_len)` would take."""
        return max(0, self.blocks_for(total_len) - len(self._table(seq_id)))

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks()

    def slot(self, seq_id: str, index: int) -> int:
        table = self._table(seq_id)
        block, offset = divmod(index, self.block_size)
        if index < 0 or block >= len(table):
            raise IndexError(f"KV index {index} outside the {len(table) * self.block_size} slots of seq {seq_id!r}")
        return table[block] * self.block_size + offset

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slots of KV indices [start, end)."""
        table = self._table(seq_id)
        if start < 0 or end > len(table) * self.block_size or start > end:
            raise IndexError(f"KV range [{start}, {end}) outside the {self.capacity(seq_id)} slots of seq {seq_id!r}")
        bs = self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    # ---- mutations -----------------------------------------------------------------------------------------------
    def allocate_seq(self, seq_id: str, num_tokens: int = 0, prefix_tokens: list[int] | None = None) -> int:
        """Start a sequence with room for num_tokens. With the prefix cache on and `prefix_tokens` given, its table
        first takes the registered blocks holding the longest cached prefix of them; returns how many tokens those
        hold (their KV is in place: the sequence's KV length starts there). 0 otherwise."""
        if seq_id in self._tables:
            raise ValueError(f"seq {seq_id!r} already allocated")
        hits = self._match(prefix_tokens) if prefix_tokens else []
        needed = max(0, self.blocks_for(num_tokens) - len(hits))
        if needed > self.num_free_blocks() - sum(1 for e in hits if e.block in self._evictable):
            raise OutOfKVBlocks(needed, self.num_free_blocks())
        if prefix_tokens and self.prefix_cache:
            self.num_cache_queries += len(prefix_tokens)
            self.num_cache_hits += len(hits) * self.block_size
        for entry in hits:
            self._evictable.pop(entry.block, None)
            self._refs[entry.block] += 1
        self._tables[seq_id] = [e.block for e in hits] + [self._take() for _ in range(needed)]
        self._chains[seq_id] = [e.id for e in hits]
        return len(hits) * self.block_size

    def register(self, seq_id: str, tokens: list[int], num_tokens: int | None = None) -> None:
        """The sequence's KV holds tokens[:num_tokens] (default all) at indices [0, num_tokens): register its full
        blocks not yet registered (no-op without the prefix cache). Only the new blocks' tokens are read, so calling
        this after every step costs O(new blocks). A block whose key is already cached elsewhere stays private."""
        if not self.prefix_cache:
            return
        table, chain = self._table(seq_id), self._chains[seq_id]
        bs = self.block_size
        n = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
        for i in range(len(chain), min(n // bs, len(table))):
            key = (chain[-1] if chain else -1, tuple(tokens[i * bs:(i + 1) * bs]))
            entry = self._entries.get(key)
            block = table[i]
            if entry is None and block not in self._entry_of:
                entry = self._entries[key] = _Entry(next(self._ids), block, key)
                self._entry_of[block] = entry
            if entry is None or entry.block != block:  # same tokens cached in another block: the chain ends here
                break
            chain.append(entry.id)

    def ensure_capacity(self, seq_id: str, total_len: int) -> None:
        """Grow the sequence's table so KV indices [0, total_len) have slots."""
        needed = self.num_blocks_needed(seq_id, total_len)
        if needed > self.num_free_blocks():
            raise OutOfKVBlocks(needed, self.num_free_blocks())
        self._tables[seq_id].extend(self._take() for _ in range(needed))

    def truncate(self, seq_id: str, new_len: int) -> list[tuple[int, int, int]]:
        """Free the blocks wholly past `new_len`; the partially used last block stays. Returns the KV copies the caller
        must make, (src block, dst block, tokens): when the kept partial block is a registered one that others use,
        the sequence continues in a private copy of its first `tokens` slots. Empty without the prefix cache."""
        if new_len < 0:
            raise ValueError(f"new_len must be >= 0, got {new_len}")
        table = self._table(seq_id)
        keep = self.blocks_for(new_len)
        while len(table) > keep:
            self._release(table.pop())
        chain = self._chains.get(seq_id)
        if chain is None or len(chain) * self.block_size <= new_len:
            return []
        del chain[new_len // self.block_size:]
        copies = []
        if new_len % self.block_size:  # writes will land in this registered block from new_len on
            block = table[-1]
            if self._refs[block] == 1:  # ours alone: it leaves the cache and becomes a private block
                entry = self._entry_of.pop(block)
                del self._entries[entry.key]
            else:
                if not self._free and not self._evictable:
                    raise OutOfKVBlocks(1, 0)
                private = self._take()
                self._release(block)
                table[-1] = private
                copies.append((block, private, new_len % self.block_size))
        return copies

    def free_seq(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise KeyError(f"unknown seq {seq_id!r}")
        self._chains.pop(seq_id, None)
        for block in reversed(table):
            self._release(block)

    def clear_cache(self) -> int:
        """Drop every cached block nobody references (e.g. after a weight update); returns how many."""
        dropped = list(self._evictable)
        for block in dropped:
            entry = self._entry_of.pop(block)
            del self._entries[entry.key]
            self._free.append(block)
        self._evictable.clear()
        return len(dropped)

    # ---- internals -----------------------------------------------------------------------------------------------
    def _match(self, tokens: list[int] | None) -> list[_Entry]:
        if not self.prefix_cache or not tokens:
            return []
        bs, hits, parent = self.block_size, [], -1
        for i in range(len(tokens) // bs):
            entry = self._entries.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if entry is None:
                break
            hits.append(entry)
            parent = entry.id
        return hits

    def _take(self) -> int:
        """A block for new KV: a never-cached free one, else the least recently released cached one (evicted)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            entry = self._entry_of.pop(block)
            del self._entries[entry.key]
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if block in self._entry_of:
            self._evictable[block] = None  # most recently released last
        else:
            self._free.append(block)

    def _table(self, seq_id: str) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown seq {seq_id!r}") from None
