"""Weight loading: sharded safetensors, dummy weights, clear errors for what is not supported."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.config import EngineConfig, ModelConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.models.loader import load_model
from tests.tiny_models import hf_logits, load_hf_model, make_tiny_model, tiny_hf_config

IDS = [5, 17, 250, 3, 99, 42, 7]


def test_sharded_checkpoint_loads_and_matches_hf(tiny_dir):
    path = make_tiny_model("llama", f"{tiny_dir}/sharded")
    hf = load_hf_model(path)
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="50KB")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):  # left from the first, unsharded save; the index must be what gets read
        os.remove(single)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    runner = ModelRunner(path, EngineConfig(block_size=4, max_total_tokens=64))
    runner.add_seq("a")
    out = runner.forward([SeqForward("a", IDS, logits="all")])
    torch.testing.assert_close(out.logits[0], hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_qkv_and_gate_up_are_fused(tiny_model):
    path, hf = tiny_model("qwen2")
    model = load_model(path, ModelConfig.from_pretrained(path), EngineConfig())
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.self_attn.qkv_proj.bias" in names and "layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied
    assert model.lm_head.weight.dtype == torch.float32  # dtype "auto" on CPU


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_dummy_load_builds_any_shape_without_files(family):
    config = ModelConfig.from_hf_config(tiny_hf_config(family, num_hidden_layers=2, vocab_size=1000))
    engine = EngineConfig(load_format="dummy", block_size=8, max_total_tokens=128, seed=3)
    runner = ModelRunner(None, engine, config)
    runner.add_seq("a")
    logits = runner.forward([SeqForward("a", IDS, logits="all")]).logits[0]
    assert logits.shape == (len(IDS), 1000) and torch.isfinite(logits).all()
    # Deterministic from the seed.
    again = ModelRunner(None, engine, config)
    for (name, p), (_, q) in zip(runner.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(p, q), name
    other = ModelRunner(None, EngineConfig(load_format="dummy", seed=4, max_total_tokens=64), config)
    assert not torch.equal(other.model.embed_tokens.weight, runner.model.embed_tokens.weight)


def test_bin_only_checkpoint_is_a_clear_error(tmp_path):
    cfg = tiny_hf_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        ModelRunner(str(tmp_path), EngineConfig())


def test_checkpoint_missing_tensors_is_an_error(tmp_path):
    from safetensors.torch import save_file

    cfg = tiny_hf_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(320, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        ModelRunner(str(tmp_path), EngineConfig())


def test_mistral_prefill_matches_hf(tiny_dir):
    path = make_tiny_model("mistral", tiny_dir)
    hf = load_hf_model(path)
    runner = ModelRunner(path, EngineConfig(block_size=4, max_total_tokens=64))
    runner.add_seq("a")
    out = runner.forward([SeqForward("a", IDS, logits="all")])
    torch.testing.assert_close(out.logits[0], hf_logits(hf, IDS), atol=1e-4, rtol=0)
