"""CPU-side pieces of the GPU engine: KV sizing under --mem-fraction-static, CUDA graph batch buckets, the new
EngineConfig checks and the flags that reach it."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig, ModelConfig
from runtime.cuda_graph import bucket_for, capture_batch_sizes
from runtime.kv_cache import OutOfKVBlocks
from runtime.memory import GiB, OutOfDeviceMemory, kv_bytes_per_block, plan_kv_blocks

LLAMA_8B = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)


def test_kv_block_bytes_match_the_8b_arithmetic():
    # 32 layers x (K, V) x 8 heads x 128 x 2 bytes = 128 KiB per token.
    assert kv_bytes_per_block(LLAMA_8B, 16, torch.bfloat16) == 16 * 128 * 1024


def test_plan_takes_the_smaller_of_static_fraction_and_free_memory():
    block = 2 * 1024 * 1024
    plan = plan_kv_blocks(total_bytes=140 * GiB, free_bytes=120 * GiB, weights_bytes=16 * GiB,
                          activation_peak_bytes=2 * GiB, bytes_per_block=block, mem_fraction_static=0.8)
    assert plan.num_kv_blocks == int((0.8 * 140 * GiB - 16 * GiB) // block)  # the fraction binds
    busy = plan_kv_blocks(total_bytes=140 * GiB, free_bytes=30 * GiB, weights_bytes=16 * GiB,
                          activation_peak_bytes=2 * GiB, bytes_per_block=block, mem_fraction_static=0.8)
    assert busy.num_kv_blocks == (30 - 2 - 1) * GiB // block  # another process holds memory: free binds
    assert busy.kv_bytes <= 27 * GiB


def test_plan_without_room_is_a_typed_error_that_callers_treat_as_out_of_kv():
    with pytest.raises(OutOfDeviceMemory, match="mem-fraction-static") as info:
        plan_kv_blocks(total_bytes=80 * GiB, free_bytes=60 * GiB, weights_bytes=16 * GiB, activation_peak_bytes=GiB,
                       bytes_per_block=1 << 21, mem_fraction_static=0.1)
    assert isinstance(info.value, OutOfKVBlocks)


def test_capture_batch_sizes_and_buckets():
    assert capture_batch_sizes(64) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 48, 64]
    assert capture_batch_sizes(12) == [1, 2, 3, 4, 5, 6, 7, 8, 12]
    assert capture_batch_sizes(256)[-5:] == [128, 160, 192, 224, 256]
    sizes = capture_batch_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 8, 9, 33, 64, 65)] == [1, 8, 16, 48, 64, None]


@pytest.mark.parametrize("kwargs", [{"mem_fraction_static": 0.0}, {"mem_fraction_static": 1.5},
                                    {"cuda_graph_max_bs": -1}, {"cuda_graph_num_draft_tokens": 0},
                                    {"torch_compile_max_bs": 0}])
def test_engine_config_rejects_bad_gpu_settings(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_gpu_flags_reach_the_engine_config():
    from tandem.cli import build_parser
    from tandem.services import _engine_config

    args = build_parser().parse_args([
        "target", "--mem-fraction-static", "0.7", "--cuda-graph-max-bs", "8", "--disable-cuda-graph",
        "--enable-torch-compile", "--torch-compile-max-bs", "4", "--speculative-num-draft-tokens", "16"])
    cfg = _engine_config(args, target=True)
    assert (cfg.mem_fraction_static, cfg.cuda_graph_max_bs, cfg.disable_cuda_graph) == (0.7, 8, True)
    assert (cfg.enable_torch_compile, cfg.torch_compile_max_bs, cfg.cuda_graph_num_draft_tokens) == (True, 4, 16)
    assert cfg.attention_backend == "auto"


def test_cpu_runner_resolves_auto_backend_to_torch_and_captures_nothing(tmp_path):
    from runtime.model_runner import ModelRunner

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, intermediate_size=64)
    runner = ModelRunner(None, EngineConfig(attention_backend="auto", max_total_tokens=64, load_format="dummy"), cfg)
    assert type(runner.attn_backend).__name__ == "TorchAttentionBackend"
    assert runner.graph_runner is None and runner.memory_plan is None


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_memory_profile_warm_up_forwards_feed_a_feature_head(tmp_path, algorithm):
    """The KV-sizing warm-up forwards (_profile_memory, CUDA only) run on EAGLE/EAGLE-3 heads too: they get zero
    features (on the H200 every EAGLE3 draft of tandem serve died at start-up when a head got none), and leave no
    sequence or KV behind."""
    from draft_service.eagle import EagleProposer
    from tests.eagle.heads import make_eagle3_head, make_eagle_head
    from tests.tiny_models import make_tiny_model

    target = make_tiny_model("llama", tmp_path / "target")
    make_head = make_eagle3_head if algorithm == "EAGLE3" else make_eagle_head
    head = make_head(target, str(tmp_path / "head"))
    config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=256, attention_backend="torch")
    runner = EagleProposer(target, head, config, algorithm=algorithm).runner
    free = runner.num_free_tokens()
    runner._warm_up_forwards(((40, "last"), (12, "all")))
    assert runner.num_free_tokens() == free and not runner.has_seq("__warmup__")
