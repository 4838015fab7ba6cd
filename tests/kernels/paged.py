"""Builders of random paged-KV batches (chain and tree appends) shared by the kernel tests and tests/gpu."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor  # (N, nh, hd)
    k_cache: torch.Tensor  # (num_blocks, block_size, kvh, hd)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (B, max_blocks) int32
    query_start: torch.Tensor  # (B+1,) int32
    kv_lens: torch.Tensor  # (B,) int32
    prefix_lens: torch.Tensor  # (B,) int32
    max_query_len: int
    tree_mask: torch.Tensor | None  # (N, W) bool
    use_tree: torch.Tensor | None  # (B,) bool

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start, self.kv_lens,
                self.prefix_lens)


def random_parents(num_nodes: int, rng: random.Random) -> list[int]:
    """parents[j] in [-1, j): -1 attaches to the prefix."""
    return [rng.randrange(-1, j) for j in range(num_nodes)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(n, n) bool: row j is True at j and its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for j, p in enumerate(parents):
        mask[j, j] = True
        if p >= 0:
            mask[j] |= mask[p]
    return mask


def make_batch(
    prefix_lens: list[int],
    query_lens: list[int],
    tree: list[bool],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    region_lens: list[int] | None = None,
) -> PagedBatch:
    """Random q/KV for B sequences. Sequence b has prefix_lens[b] committed keys and query_lens[b] new ones; for a
    tree sequence the open region holds region_lens[b] (>= query_len) nodes whose last query_len are the queries.
    Blocks are shuffled over the pool so page tables are non-trivial; slack pool entries hold noise."""
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: real-size pools are GiBs of noise
    cpu_gen = torch.Generator().manual_seed(seed)
    region_lens = region_lens or query_lens
    kv_lens = [p + r if t else p + q for p, q, r, t in zip(prefix_lens, query_lens, region_lens, tree)]
    blocks_per_seq = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    max_blocks = max(blocks_per_seq + [1])
    table = torch.zeros(len(kv_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        table[b, :nb] = torch.tensor(order[used:used + nb], dtype=torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=device).to(dtype)
    query_start = torch.tensor([0] + list(_cumsum(query_lens)), dtype=torch.int32)
    tree_mask = use_tree = None
    if any(tree):
        width = max(r for r, t in zip(region_lens, tree) if t)
        tree_mask = torch.zeros(num_tokens, width, dtype=torch.bool)
        for b, is_tree in enumerate(tree):
            if not is_tree:
                # Chain rows of a mixed batch: the kernel must ignore them, so fill them with noise.
                rows = slice(int(query_start[b]), int(query_start[b + 1]))
                tree_mask[rows] = torch.rand(query_lens[b], width, generator=cpu_gen) < 0.5
                continue
            full = ancestor_mask(random_parents(region_lens[b], rng))  # (region, region)
            rows = slice(int(query_start[b]), int(query_start[b + 1]))
            tree_mask[rows, :region_lens[b]] = full[region_lens[b] - query_lens[b]:]
        use_tree = torch.tensor(tree, dtype=torch.bool)
    return PagedBatch(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table.to(device),
        query_start=query_start.to(device), kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device), max_query_len=max(query_lens),
        tree_mask=None if tree_mask is None else tree_mask.to(device),
        use_tree=None if use_tree is None else use_tree.to(device),
    )


def _cumsum(values: list[int]):
    total = 0
    for v in values:
        total += v
        yield total
