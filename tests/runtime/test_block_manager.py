"""BlockManager: pure-Python paged KV bookkeeping."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.kv_cache import BlockManager, OutOfKVBlocks

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_block_manager_does_not_import_torch():
    code = "import sys, runtime.kv_cache; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=_ROOT)


def test_runtime_never_imports_grpc():
    code = ("import sys, runtime.model_runner, runtime.attention.torch_backend; "
            "assert not [m for m in sys.modules if m.startswith(('grpc', 'google.protobuf'))]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=_ROOT)


def test_allocate_and_ensure_capacity_take_whole_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.can_allocate(32) and not bm.can_allocate(33)
    bm.allocate_seq("a", 5)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks() == 6
    bm.ensure_capacity("a", 8)  # still fits in 2 blocks
    assert bm.num_free_blocks() == 6
    bm.ensure_capacity("a", 9)
    assert len(bm.block_table("a")) == 3 and bm.capacity("a") == 12
    assert bm.num_blocks_needed("a", 20) == 2


def test_slots_follow_block_table():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate_seq("x", 4)
    bm.allocate_seq("a", 10)
    table = bm.block_table("a")
    assert bm.slots("a", 0, 10) == [table[i // 4] * 4 + i % 4 for i in range(10)]
    assert bm.slot("a", 5) == table[1] * 4 + 1
    # Slots of different sequences never collide.
    assert not set(bm.slots("a", 0, 12)) & set(bm.slots("x", 0, 4))
    with pytest.raises(IndexError):
        bm.slot("a", 12)
    with pytest.raises(IndexError):
        bm.slots("a", 0, 13)


def test_truncate_frees_blocks_past_new_len():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_seq("a", 13)  # 4 blocks
    first_two = bm.block_table("a")[:2]
    bm.truncate("a", 5)  # indices 0..4 live in 2 blocks
    assert bm.block_table("a") == first_two and bm.num_free_blocks() == 6
    bm.truncate("a", 0)
    assert bm.block_table("a") == [] and bm.num_free_blocks() == 8


def test_out_of_blocks_is_typed_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate_seq("a", 8)
    with pytest.raises(OutOfKVBlocks) as info:
        bm.ensure_capacity("a", 17)
    assert info.value.num_needed == 3 and info.value.num_free == 2
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks() == 2
    with pytest.raises(OutOfKVBlocks):
        bm.allocate_seq("b", 9)
    assert not bm.has_seq("b")


def test_free_seq_returns_every_block():
    bm = BlockManager(num_blocks=12, block_size=2)
    for i in range(5):
        bm.allocate_seq(f"s{i}", 3)
    bm.ensure_capacity("s0", 6)
    bm.truncate("s1", 1)
    for i in range(5):
        bm.free_seq(f"s{i}")
    assert bm.num_free_blocks() == 12
    # Every block is usable again, each exactly once.
    bm.allocate_seq("big", 24)
    assert sorted(bm.block_table("big")) == list(range(12))


def test_unknown_and_duplicate_seq_errors():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate_seq("a")
    with pytest.raises(ValueError):
        bm.allocate_seq("a")
    with pytest.raises(KeyError):
        bm.free_seq("nope")
    with pytest.raises(KeyError):
        bm.ensure_capacity("nope", 1)
