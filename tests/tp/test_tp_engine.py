"""Tensor parallelism on CPU (gloo, 2 processes): the TargetEngine over a TP=2 ModelRunner gives the same greedy
tokens as TP=1 and as HF `generate`, for plain decode and for STANDALONE chain and tree verification; both ranks'
KV is freed at the end and rank 1 replayed every state change rank 0 made.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from target_service.tp import free_port, rank_device
from tests.stack import perturbed_copy
from tests.tiny_models import make_tiny_model

PROMPTS = [[5, 17, 99, 3, 250], [7], [11, 12, 13, 11, 12, 13, 11, 12]]
MAX_NEW = 20
# (num_steps, topk, num_draft_tokens); (0, 1, 1) = plain decode through Verify with an empty tree
SPECS = [(0, 1, 1), (3, 1, 4), (3, 2, 6)]


def _engine_config(device: str = "cpu", attention_backend: str = "torch") -> EngineConfig:
    return EngineConfig(device=device, dtype="float32", max_total_tokens=4096, attention_backend=attention_backend,
                        disable_cuda_graph=True)


def greedy_run(runner: ModelRunner, draft_path: str | None) -> dict[str, list[list[int]]]:
    # The draft runs unsharded next to rank 0 (on rank 0's device).
    """Greedy generation of every prompt under every spec through TargetEngine (+ a TP=1 STANDALONE draft)."""
    from draft_service.proposer import ProposeInput, SpecShape
    from draft_service.standalone import StandaloneProposer
    from runtime.sampling import SamplingParams
    from runtime.speculative.tree import DraftTree
    from core.types import StopRule
    from target_service.engine import PrefillInput, TargetEngine, VerifyInput

    engine = TargetEngine(runner)
    draft_config = _engine_config(str(runner.device), runner.engine_config.attention_backend)
    proposer = StandaloneProposer(ModelRunner(draft_path, draft_config)) if draft_path else None
    greedy = SamplingParams(temperature=0.0)
    results: dict[str, list[list[int]]] = {}
    for steps, topk, ndt in SPECS:
        outs = []
        for i, prompt in enumerate(PROMPTS):
            seq_id = f"s{steps}-{topk}-{i}"
            stop = StopRule(max_new_tokens=MAX_NEW, prompt_len=len(prompt))
            [first] = engine.prefill([PrefillInput(seq_id, prompt, True, greedy, stop)])
            tokens = prompt + first.token_ids
            synced = len(tokens)
            if steps and proposer is not None:
                proposer.prefill(seq_id, tokens)
            finished = False
            while not finished:
                tree = DraftTree([], [])
                if steps and proposer is not None:
                    [proposal] = proposer.propose([ProposeInput(seq_id, len(tokens), tokens[synced:],
                                                                SpecShape(steps, topk, ndt))])
                    synced, tree = len(tokens), proposal.tree
                [out] = engine.verify([VerifyInput(seq_id, len(tokens), tokens[-1], tree, greedy, stop)])
                assert out.status == 0, out.error
                tokens += out.token_ids
                finished = out.finish_reason is not None
            if proposer is not None:
                proposer.release([seq_id])
            outs.append(tokens[len(prompt):])
        results[f"{steps},{topk},{ndt}"] = outs
    assert runner.num_free_tokens() == runner.num_total_tokens(), "rank 0 KV leaked"
    return results


def _rank_main(rank: int, size: int, port: int, target: str, draft: str, out_path: str, device: str = "cpu",
               attention_backend: str = "torch") -> None:
    from runtime.distributed import destroy_tp, init_tp, run_worker

    device = rank_device(device, rank)
    tp = init_tp(rank, size, "127.0.0.1", port, device)
    runner = ModelRunner(target, _engine_config(device, attention_backend), tp=tp)
    try:
        if rank == 0:
            results = greedy_run(runner, draft)
            runner.stop_workers()
            Path(out_path).write_text(json.dumps(results))
        else:
            run_worker(runner)
            # rank 1 applied every free rank 0 made: its pool is empty too
            Path(out_path + ".rank1").write_text(json.dumps(
                {"free": runner.num_free_tokens(), "total": runner.num_total_tokens()}))
        torch.distributed.barrier()  # leave together (see tests/kernels/test_fused_model.py::_tp_rank_main)
    except BaseException:
        destroy_tp()
        raise
    # Done: leave without tearing the gloo pairs down. Even after the barrier a rank's teardown aborted it now and then
    # on a busy 2-core box ("terminate called without an active exception", exit -6); the OS closes the sockets.
    os._exit(0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    target = make_tiny_model("llama", root / "target")  # 4 heads, 2 KV heads: one KV head per rank
    draft = perturbed_copy(target, root / "draft", noise=0.03)
    return target, str(draft)


def spawn_tp2(target: str, draft: str, out: Path, device: str = "cpu", attention_backend: str = "torch") -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, target, draft, str(out), device, attention_backend))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"TP ranks exited with {codes}"


def test_tp2_greedy_matches_tp1_and_hf_generate(models, tmp_path):
    from tests.test_lossless_greedy import hf_greedy
    from tests.tiny_models import load_hf_model

    target, draft = models
    tp1 = greedy_run(ModelRunner(target, _engine_config()), draft)
    out = tmp_path / "tp2.json"
    spawn_tp2(target, draft, out)
    tp2 = json.loads(out.read_text())
    hf = load_hf_model(target)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    for spec, outs in tp1.items():
        assert outs == expected, f"TP=1 {spec} diverged from HF"
        assert tp2[spec] == outs, f"TP=2 {spec} diverged from TP=1"
    rank1 = json.loads((tmp_path / "tp2.json.rank1").read_text())
    assert rank1["free"] == rank1["total"], "rank 1 KV leaked: it missed a release"


def test_tp_shards_split_heads_and_replicate_kv_heads_past_their_count():
    from runtime.config import ModelConfig
    from runtime.distributed import TPShard

    cfg = ModelConfig("LlamaForCausalLM", vocab_size=321, hidden_size=64, num_layers=1, num_heads=8, num_kv_heads=2,
                      head_dim=8, intermediate_size=128)
    two = [TPShard.of(cfg, r, 2) for r in range(2)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in two] == [(4, 1, 0), (4, 1, 1)]
    four = [TPShard.of(cfg, r, 4) for r in range(4)]  # 2 KV heads over 4 ranks: each pair shares one
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in four] == [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]
    assert four[0].vocab_per_rank * 4 >= 321
    with pytest.raises(ValueError):
        TPShard.of(cfg, 0, 3)
