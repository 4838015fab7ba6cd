"""tools/train_draft.py trains both draft kinds for an arbitrary Llama target folder from a text corpus, and what it
writes loads in the proposers that serve it (STANDALONE through a ModelRunner, EAGLE-3 through EagleProposer)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from draft_service.eagle import EagleProposer
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from tests.tiny_models import make_tiny_model
from tools.lm_data import train_tokenizer
from tools.train_draft import main

ENGINE = EngineConfig(device="cpu", dtype="float32", max_total_tokens=1024, block_size=4)


@pytest.fixture(scope="module")
def target_with_tokenizer(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("train-draft")
    corpus = root / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 20)
    path = make_tiny_model("llama", str(root / "target"))
    train_tokenizer([corpus.read_text()], 320, Path(path))  # the tiny target's vocabulary is 320
    return path, str(corpus)


def test_standalone_draft_for_any_target_loads_in_the_engine(target_with_tokenizer, tmp_path):
    target, corpus = target_with_tokenizer
    out = tmp_path / "draft"
    main(["--kind", "standalone", "--target-model-path", target, "--corpus", corpus, "--output-dir", str(out),
          "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--hidden-size", "32", "--num-heads", "2",
          "--num-kv-heads", "1", "--intermediate-size", "64", "--device", "cpu"])
    runner = ModelRunner(str(out), ENGINE)
    assert runner.model_config.vocab_size == 320
    info = json.loads((out / "training_info.json").read_text())
    assert info["training"]["steps"] == 3 and info["kind"] == "standalone"
    assert os.path.exists(out / "tokenizer.json")


def test_eagle3_head_for_any_target_loads_in_the_proposer(target_with_tokenizer, tmp_path):
    target, corpus = target_with_tokenizer
    out = tmp_path / "head"
    main(["--kind", "eagle3", "--target-model-path", target, "--corpus", corpus, "--output-dir", str(out),
          "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--draft-vocab-size", "96",
          "--head-intermediate-size", "48", "--device", "cpu"])
    proposer = EagleProposer(target, str(out), ENGINE, algorithm="EAGLE3")
    assert proposer.model.lm_head.weight.shape[0] == 96
    assert json.loads((out / "training_info.json").read_text())["training"]["steps"] == 3
