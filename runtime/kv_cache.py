"""Paged KV bookkeeping: a fixed pool of blocks and one block table per sequence, in plain Python.

Owns which slots a sequence's KV entries live in; knows nothing about tensors (those are in `kv_pool.KVPool`), trees
or models. Slot `s` is token `s % block_size` of block `s // block_size`.
"""

from __future__ import annotations


class OutOfKVBlocks(RuntimeError):
    """Not enough free KV blocks; raised before any state changes."""

    def __init__(self, num_needed: int, num_free: int) -> None:
        super().__init__(f"out of KV blocks: need {num_needed}, {num_free} free")
        self.num_needed = num_needed
        self.num_free = num_free


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: recently freed blocks are reused first (warm in cache on GPU).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self._free)

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
        return self.blocks_for(num_tokens) <= len(self._free)

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
    def allocate_seq(self, seq_id: str, num_tokens: int = 0) -> None:
        if seq_id in self._tables:
            raise ValueError(f"seq {seq_id!r} already allocated")
        needed = self.blocks_for(num_tokens)
        if needed > len(self._free):
            raise OutOfKVBlocks(needed, len(self._free))
        self._tables[seq_id] = [self._free.pop() for _ in range(needed)]

    def ensure_capacity(self, seq_id: str, total_len: int) -> None:
        """Grow the sequence's table so KV indices [0, total_len) have slots."""
        needed = self.num_blocks_needed(seq_id, total_len)
        if needed > len(self._free):
            raise OutOfKVBlocks(needed, len(self._free))
        self._tables[seq_id].extend(self._free.pop() for _ in range(needed))

    def truncate(self, seq_id: str, new_len: int) -> None:
        """Free the blocks wholly past `new_len`; the partially used last block stays."""
        if new_len < 0:
            raise ValueError(f"new_len must be >= 0, got {new_len}")
        table = self._table(seq_id)
        keep = self.blocks_for(new_len)
        while len(table) > keep:
            self._free.append(table.pop())

    def free_seq(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise KeyError(f"unknown seq {seq_id!r}")
        self._free.extend(reversed(table))

    def _table(self, seq_id: str) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown seq {seq_id!r}") from None
