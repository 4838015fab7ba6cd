"""Prefix cache (runtime/kv_cache.py, ModelRunner.add_seq/cache_prefix): exact block keys, reference counts, LRU
eviction of unreferenced cached blocks, copy-on-write when a truncation cuts into a shared block, and a reused
prefix giving the same logits as computing it."""
from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.kv_cache import BlockManager, OutOfKVBlocks
from runtime.model_runner import ModelRunner, SeqForward
from tests.tiny_models import make_tiny_model

BS = 4


def _registered(bm: BlockManager, seq: str, tokens: list[int]) -> list[int]:
    bm.ensure_capacity(seq, len(tokens))
    bm.register(seq, tokens)
    return bm.block_table(seq)


def test_a_prefix_of_full_blocks_is_shared_and_only_exact_keys_hit():
    bm = BlockManager(num_blocks=16, block_size=BS, prefix_cache=True)
    a = list(range(10, 24))  # 14 tokens: 3 full blocks + 2
    assert bm.allocate_seq("a", 0, a) == 0
    table_a = _registered(bm, "a", a)
    assert bm.num_cached_blocks() == 3  # the partial 4th block is never registered
    assert bm.match_prefix(a) == 12 and bm.match_prefix(a[:11]) == 8 and bm.match_prefix(a[:3]) == 0
    assert bm.allocate_seq("b", 0, a[:13]) == 12
    assert bm.block_table("b") == table_a[:3]
    other = a[:8] + [99] + a[9:]  # block 2 differs -> only blocks 0 and 1
    assert bm.match_prefix(other) == 8
    moved = [99] + a[1:]  # block 0 differs -> nothing, although blocks 1 and 2 hold the same tokens
    assert bm.match_prefix(moved) == 0
    assert bm.num_cache_queries == 14 + 13 and bm.num_cache_hits == 12


def test_unreferenced_cached_blocks_count_as_free_and_are_evicted_oldest_first():
    bm = BlockManager(num_blocks=6, block_size=BS, prefix_cache=True)
    first, second = list(range(8)), list(range(100, 108))
    for seq, tokens in (("x", first), ("y", second)):
        bm.allocate_seq(seq, 0, tokens)
        _registered(bm, seq, tokens)
    bm.free_seq("x")  # released first: evicted first, its tail block before its head (heads are shared more)
    bm.free_seq("y")
    assert bm.num_free_blocks() == 6 and bm.num_cached_blocks() == 4
    bm.allocate_seq("z", 8)  # 2 never-used blocks first, no eviction
    assert bm.match_prefix(first) == 8 and bm.match_prefix(second) == 8
    bm.ensure_capacity("z", 12)  # the oldest cached block (x's tail) is evicted
    assert bm.match_prefix(first) == 4 and bm.match_prefix(second) == 8
    bm.ensure_capacity("z", 16)  # then x's head
    assert bm.match_prefix(first) == 0 and bm.match_prefix(second) == 8
    with pytest.raises(OutOfKVBlocks):
        bm.ensure_capacity("z", 4 * 7)
    bm.free_seq("z")
    assert bm.num_free_blocks() == 6


def test_a_hit_on_an_evictable_block_takes_it_back_and_refcounts_keep_shared_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS, prefix_cache=True)
    tokens = list(range(9))
    bm.allocate_seq("a", 0, tokens)
    _registered(bm, "a", tokens)  # 3 blocks, 2 registered
    bm.free_seq("a")
    assert bm.allocate_seq("b", 0, tokens) == 8 and bm.num_free_blocks() == 2
    bm.allocate_seq("c", 0, tokens)
    bm.free_seq("b")  # c still uses the blocks: they must stay out of the free pool
    assert bm.num_free_blocks() == 2
    shared = bm.block_table("c")[:2]
    bm.ensure_capacity("c", 16)  # the two free blocks; the shared ones are not evictable while c holds them
    assert bm.block_table("c")[:2] == shared and bm.match_prefix(tokens) == 8
    with pytest.raises(OutOfKVBlocks):
        bm.allocate_seq("d", 8)


def test_truncating_into_a_registered_block_unregisters_it_or_copies_it_when_shared():
    bm = BlockManager(num_blocks=10, block_size=BS, prefix_cache=True)
    tokens = list(range(12))
    bm.allocate_seq("a", 0, tokens)
    table = _registered(bm, "a", tokens)
    bm.allocate_seq("b", 0, tokens)  # shares all three blocks
    copies = bm.truncate("b", 6)  # b will write index 6 onward into block 1, which a uses
    assert len(copies) == 1 and copies[0][0] == table[1] and copies[0][2] == 2
    assert bm.block_table("b") == [table[0], copies[0][1]]
    assert bm.match_prefix(tokens) == 12  # a's blocks stay cached and untouched
    bm.free_seq("a")
    bm.allocate_seq("c", 0, tokens)
    assert bm.truncate("c", 8) == []  # a cut at a block boundary writes into new blocks only
    bm.free_seq("c")
    bm.allocate_seq("d", 0, tokens[:8])
    bm.free_seq("b")
    assert bm.truncate("d", 5) == []  # d alone uses block 1: it leaves the cache instead of being copied
    assert bm.match_prefix(tokens) == 4


def test_without_the_prefix_cache_nothing_is_shared():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))
    assert bm.allocate_seq("a", 0, tokens) == 0
    _registered(bm, "a", tokens)
    assert bm.match_prefix(tokens) == 0 and bm.num_cached_blocks() == 0
    assert bm.truncate("a", 3) == []
    assert bm.clear_cache() == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("prefix") / "m")


def test_a_reused_prefix_gives_the_logits_of_computing_it(tiny):
    runner = ModelRunner(tiny, EngineConfig(device="cpu", dtype="float32", block_size=BS, max_total_tokens=512,
                                            enable_prefix_cache=True))
    prompt = [3 + (7 * i) % 60 for i in range(23)]
    assert runner.add_seq("a", prompt[:-1]) == 0
    full = runner.forward([SeqForward("a", prompt, logits="all")]).logits[0]
    runner.cache_prefix("a", prompt)
    cached = runner.add_seq("b", prompt[:-1])
    assert cached == 20 and runner.kv_len("b") == 20
    rest = runner.forward([SeqForward("b", prompt[cached:], logits="all")]).logits[0]
    torch.testing.assert_close(rest, full[cached:], rtol=1e-5, atol=1e-5)
    # b cuts into the shared block 4 (copy-on-write) and appends other tokens; a's cached KV is unchanged.
    runner.truncate("b", 18)
    other = runner.forward([SeqForward("b", [5, 6, 7], logits="all")]).logits[0]
    runner.add_seq("ref")
    expect = runner.forward([SeqForward("ref", prompt[:18] + [5, 6, 7], logits="all")]).logits[0][18:]
    torch.testing.assert_close(other, expect, rtol=1e-5, atol=1e-5)
    assert runner.add_seq("c", prompt[:-1]) == 20
    again = runner.forward([SeqForward("c", prompt[20:], logits="all")]).logits[0]
    torch.testing.assert_close(again, full[20:], rtol=1e-5, atol=1e-5)
    for seq in ("a", "b", "c", "ref"):
        runner.free_seq(seq)
    assert runner.num_free_tokens() == runner.num_total_tokens()
