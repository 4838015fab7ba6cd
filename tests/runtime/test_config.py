"""ModelConfig from HF configs and EngineConfig validation."""

from __future__ import annotations

import json
import os

import pytest

from runtime.config import EngineConfig, ModelConfig
from tests.tiny_models import tiny_hf_config


def test_model_config_reads_each_family():
    llama = ModelConfig.from_hf_config(tiny_hf_config("llama"))
    assert (llama.architecture, llama.num_kv_heads, llama.head_dim) == ("LlamaForCausalLM", 2, 16)
    assert not llama.attention_bias and not llama.qk_norm and not llama.tie_word_embeddings
    qwen2 = ModelConfig.from_hf_config(tiny_hf_config("qwen2"))
    assert qwen2.attention_bias and qwen2.tie_word_embeddings
    qwen3 = ModelConfig.from_hf_config(tiny_hf_config("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    assert llama.rope_scaling is None and llama.rope_theta == 10000.0


def test_model_config_reads_llama3_rope_scaling():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    cfg = ModelConfig.from_hf_config(tiny_hf_config("llama", rope_parameters=rope))
    assert cfg.rope_theta == 500000.0 and cfg.rope_type == "llama3" and cfg.rope_scaling["factor"] == 8.0


def test_unsupported_architecture_is_a_clear_error():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf_config(GPT2Config(architectures=["GPT2LMHeadModel"]))


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    cfg = tiny_hf_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert mc.eos_token_ids == (2, 7) and mc.bos_token_id == 1


@pytest.mark.parametrize("kwargs", [
    {"dtype": "int8"}, {"load_format": "pt"}, {"block_size": 0}, {"num_kv_blocks": 0}, {"max_total_tokens": -1},
])
def test_engine_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_engine_config_derives_blocks_from_max_total_tokens():
    assert EngineConfig(block_size=16, max_total_tokens=100).resolved_num_kv_blocks == 7
    assert EngineConfig(num_kv_blocks=3).resolved_num_kv_blocks == 3
