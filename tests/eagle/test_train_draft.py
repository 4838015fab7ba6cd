"""tools/train_draft.py trains every draft kind for an arbitrary Llama target folder from a text corpus, and what it
writes loads in the proposers that serve it (STANDALONE through a ModelRunner, EAGLE-3 and EAGLE-2 through
EagleProposer)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

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


def test_eagle2_head_for_any_target_loads_in_the_proposer_and_proposes(target_with_tokenizer, tmp_path):
    target, corpus = target_with_tokenizer
    out = tmp_path / "eagle2"
    main(["--kind", "eagle", "--target-model-path", target, "--corpus", corpus, "--output-dir", str(out),
          "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--draft-vocab-size", "96",
          "--head-intermediate-size", "48", "--device", "cpu"])
    cfg = json.loads((out / "config.json").read_text())
    target_cfg = json.loads((Path(target) / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    assert cfg["hidden_size"] == target_cfg["hidden_size"] and cfg["intermediate_size"] == 48
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert not any(n.startswith(("lm_head", "embed_tokens", "norm", "model.")) for n in names)
    assert "layers.0.input_layernorm.weight" not in names
    proposer = EagleProposer(target, str(out), ENGINE, algorithm="EAGLE")
    # the served head scores the target's whole vocabulary (the 96-token training softmax is not a token map)
    assert proposer.model.lm_head.weight.shape[0] == target_cfg["vocab_size"]
    info = json.loads((out / "training_info.json").read_text())
    assert info["training"]["steps"] == 3 and info["kind"] == "eagle"
    # Propose through the real feature path: target features of a committed prompt, then a chain of 3.
    _propose_chain(target, proposer)


def _propose_chain(target: str, proposer: EagleProposer) -> None:
    from draft_service.proposer import ProposeInput, SpecShape, Status

    committed = [3, 77, 150, 8, 299, 61]
    feats = torch.randn(len(committed), proposer.feature_size, generator=torch.Generator().manual_seed(0))
    assert proposer.prefill("s", committed, feats[:-1]) == Status.OK
    [out] = proposer.propose([ProposeInput("s", len(committed), [], SpecShape(3, 1, 4), feats[:0])])
    assert out.status == Status.OK and len(out.tree.token_ids) == 3 and out.tree.parents == [-1, 0, 1]
    assert all(0 <= t < 320 for t in out.tree.token_ids)


def test_eagle2_training_unroll_is_the_served_head_math(target_path, tmp_path):
    """The training module's step 0 and its step 1 (own output fed back as the feature) equal the published-formula
    reference (tests/eagle/heads.py) on the saved checkpoint: what is trained is what the proposer serves."""
    from runtime.config import ModelConfig
    from tests.eagle.heads import RefHead
    from tools.train_eagle3 import TrainConfig, build_eagle_head, save_eagle

    torch.manual_seed(0)
    tcfg = ModelConfig.from_pretrained(target_path)
    target_head = RefHead.load("eagle", _dummy_head(target_path, tmp_path), target_path).target_head
    config = TrainConfig(intermediate_size=40)
    model = build_eagle_head(tcfg, target_head.float(), config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_eagle(model, str(tmp_path / "head"), tcfg, config)
    ref = RefHead.load("eagle", str(tmp_path / "head"), target_path)
    tokens = torch.tensor([[5, 17, 200, 33, 9, 250, 41, 7]])
    n, t = 2, tokens.shape[1] - 2
    feats = torch.randn(1, tokens.shape[1], tcfg.hidden_size)
    with torch.no_grad():
        embeds = torch.nn.functional.pad(ref.embed[tokens[:, 1:]], (0, 0, 0, 1))  # t_1.., as eagle_ttt_loss
        hiddens = model.unrolled_hidden(embeds, feats[:, :t], n)
    seq = tokens[0, 1:t + 1].tolist()
    causal = torch.ones(t, t).tril().bool()
    logits0, hidden0 = ref.forward(seq, feats[0, :t], list(range(t)), causal)
    torch.testing.assert_close(hiddens[0][0], hidden0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.logits(hiddens[0][0]), logits0, atol=1e-4, rtol=1e-4)
    for p in range(t):  # step 1 at base p: t_{p+2} with the head's own output as feature, after the prefix 0..p
        s = tokens[0, 1:p + 3].tolist()
        f = torch.cat([feats[0, :p + 1], hidden0[p:p + 1]])
        _, h1 = ref.forward(s, f, list(range(p + 2)), torch.ones(p + 2, p + 2).tril().bool())
        torch.testing.assert_close(hiddens[1][0, p], h1[-1], atol=1e-4, rtol=1e-4)


def _dummy_head(target_path: str, tmp_path) -> str:
    from tests.eagle.heads import make_eagle_head

    return make_eagle_head(target_path, str(tmp_path / "dummy"))
