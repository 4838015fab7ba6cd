"""Tensor parallelism on 2 GPUs (NCCL, ranks on cuda:0 and cuda:1): the same greedy check as the CPU test — TP=2
equals TP=1 and HF `generate` for plain decode, STANDALONE chain and tree — with the torch and triton attention
backends. Skipped without 2 CUDA devices.
"""
from __future__ import annotations

import json

import pytest
import torch

from runtime.model_runner import ModelRunner
from tests.tp.test_tp_engine import MAX_NEW, PROMPTS, _engine_config, greedy_run, models, spawn_tp2  # noqa: F401

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tp2_nccl_greedy_matches_tp1_and_hf_generate(models, tmp_path, backend):  # noqa: F811
    from tests.test_lossless_greedy import hf_greedy
    from tests.tiny_models import load_hf_model

    if backend == "triton":
        pytest.importorskip("triton")
    target, draft = models
    tp1 = greedy_run(ModelRunner(target, _engine_config("cuda:0", backend)), draft)
    out = tmp_path / "tp2.json"
    spawn_tp2(target, draft, out, device="cuda:0", attention_backend=backend)
    tp2 = json.loads(out.read_text())
    hf = load_hf_model(target)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    for spec, outs in tp1.items():
        assert outs == expected, f"TP=1 {spec} on cuda diverged from HF"
        assert tp2[spec] == outs, f"TP=2 {spec} over NCCL diverged from TP=1"
    rank1 = json.loads((tmp_path / "tp2.json.rank1").read_text())
    assert rank1["free"] == rank1["total"]
