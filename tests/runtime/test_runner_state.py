"""ModelRunner bookkeeping: hidden-state capture, error paths that must leave state untouched, capacity accounting."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.kv_cache import OutOfKVBlocks
from runtime.model_runner import ModelRunner, SeqForward, UnknownSeq

IDS = [5, 17, 250, 3, 99, 42, 7, 8, 9]


@pytest.fixture
def runner(tiny_model) -> ModelRunner:
    path, _ = tiny_model("llama")
    return ModelRunner(path, EngineConfig(block_size=4, num_kv_blocks=6))


def test_capture_hidden_and_aux_layers_match_hf_hidden_states(tiny_model):
    path, hf = tiny_model("llama")
    runner = ModelRunner(path, EngineConfig(block_size=4, max_total_tokens=64))
    runner.add_seq("a")
    out = runner.forward([SeqForward("a", IDS, logits="all", capture_hidden=True)], capture_layers=[2, 0])
    with torch.no_grad():
        ref = hf(torch.tensor([IDS]), output_hidden_states=True).hidden_states  # L+1 entries, last one normed
    torch.testing.assert_close(out.hidden[0], ref[-1][0], atol=1e-4, rtol=0)
    h = runner.model_config.hidden_size
    assert out.features[0].shape == (len(IDS), 2 * h)
    torch.testing.assert_close(out.features[0][:, :h], ref[2][0], atol=1e-4, rtol=0)  # input of layer 2
    torch.testing.assert_close(out.features[0][:, h:], ref[0][0], atol=1e-4, rtol=0)  # embeddings


def test_logits_modes_give_the_right_rows(runner):
    runner.add_seq("a")
    runner.add_seq("b")
    out = runner.forward([SeqForward("a", IDS[:4], logits="none"), SeqForward("b", IDS[:3], logits="all")])
    assert out.logits[0].shape == (0, 320) and out.logits[1].shape == (3, 320)
    assert out.hidden == [None, None] and out.logits[1].dtype == torch.float32
    out = runner.forward([SeqForward("a", [1, 2]), SeqForward("b", [3], capture_hidden=True)])
    assert out.logits[0].shape == (1, 320) and out.hidden[1].shape == (1, 64)


def test_out_of_kv_raises_before_touching_state(runner):
    assert runner.num_total_tokens() == 24
    runner.add_seq("a")
    runner.add_seq("b")
    runner.forward([SeqForward("a", IDS[:8], logits="none")])  # 2 blocks
    free = runner.num_free_tokens()
    assert free == 16
    with pytest.raises(OutOfKVBlocks):
        # Each fits alone; together they need 5 blocks of the 4 free.
        runner.forward([SeqForward("a", IDS[:8]), SeqForward("b", IDS[:9])])
    assert runner.kv_len("a") == 8 and runner.kv_len("b") == 0 and runner.num_free_tokens() == free
    runner.free_seq("a")
    runner.free_seq("b")
    assert runner.num_free_tokens() == 24 and not runner.has_seq("a")


def test_chain_append_while_tree_region_open_is_an_error(runner):
    runner.add_seq("a")
    runner.forward([SeqForward("a", IDS[:3])])
    runner.forward([SeqForward("a", [4, 5], parents=[-1, 0])])
    with pytest.raises(ValueError, match="tree region"):
        runner.forward([SeqForward("a", [6])])
    assert runner.kv_len("a") == 5 and runner.region_start("a") == 3
    runner.compact("a", [0])
    assert runner.kv_len("a") == 4
    runner.forward([SeqForward("a", [6])])
    with pytest.raises(ValueError, match="no tree region"):
        runner.compact("a", [0])


@pytest.mark.parametrize("bad", [
    SeqForward("a", []),
    SeqForward("a", [1, 2], parents=[-1, 1]),  # a node cannot be its own parent
    SeqForward("a", [1, 2], parents=[-1]),
    SeqForward("a", [1, 2], positions=[0]),
    SeqForward("a", [1], logits="first"),
    SeqForward("a", [100000]),
])
def test_invalid_requests_are_rejected_without_state_change(runner, bad):
    runner.add_seq("a")
    runner.forward([SeqForward("a", IDS[:2])])
    with pytest.raises(ValueError):
        runner.forward([bad])
    assert runner.kv_len("a") == 2 and runner.region_start("a") is None


def test_unknown_and_duplicate_sequences(runner):
    with pytest.raises(UnknownSeq):
        runner.forward([SeqForward("nope", [1])])
    runner.add_seq("a")
    with pytest.raises(ValueError):
        runner.add_seq("a")
    with pytest.raises(ValueError):
        runner.forward([SeqForward("a", [1]), SeqForward("a", [2])])
    with pytest.raises(ValueError):
        runner.truncate("a", 1)  # beyond kv_len
