"""The static draft step as real CUDA graphs (one per batch bucket, the whole Propose inside) on the bundled demo
family: greedy generations equal the eager proposers' and plain decoding's, token for token (fp32), the trees are
the eager ones (all but near-ties: the graphs run the fused kernels), and a Propose replays one graph."""
from __future__ import annotations

import json

import pytest

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()

import torch  # noqa: E402

from draft_service.eagle import EagleProposer  # noqa: E402
from draft_service.proposer import SpecShape  # noqa: E402
from draft_service.standalone import StandaloneProposer  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.model_runner import ModelRunner  # noqa: E402
from tandem.args import DEFAULT_DRAFT, DEFAULT_EAGLE3, DEFAULT_MODEL  # noqa: E402
from tools.spec_eval import Method, _generate  # noqa: E402


def _config(spec: SpecShape) -> EngineConfig:
    return EngineConfig(device="cuda", dtype="float32", attention_backend="triton", max_total_tokens=32768,
                        cuda_graph_max_bs=8, cuda_graph_num_draft_tokens=spec.topk if spec.topk > 1 else None,
                        cuda_graph_mask_width=spec.num_steps * spec.topk)


def _prompts(n: int) -> list[list[int]]:
    lines = (DEFAULT_MODEL / "heldout_prompts.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["prompt_ids"] for line in lines]


def _record(proposer) -> list:
    trees, draft = [], proposer._draft

    def recording(inputs):
        out = draft(inputs)
        trees.extend((t.token_ids, t.parents) for t in out)
        return out

    proposer._draft = recording
    return trees


@pytest.mark.parametrize("algorithm,spec", [("EAGLE3", SpecShape(5, 4, 16)), ("EAGLE3", SpecShape(3, 1, 4)),
                                            ("STANDALONE", SpecShape(3, 1, 4)), ("STANDALONE", SpecShape(4, 2, 8))])
def test_static_draft_step_graphs_match_eager(algorithm, spec):
    from target_service.engine import TargetEngine

    target = ModelRunner(str(DEFAULT_MODEL), EngineConfig(device="cuda", dtype="float32", attention_backend="triton",
                                                           max_total_tokens=32768, cuda_graph_max_bs=8,
                                                           cuda_graph_num_draft_tokens=spec.num_draft_tokens))
    prompts = _prompts(6)
    method = Method("m", algorithm, spec.num_steps, spec.topk, spec.num_draft_tokens)
    results = {}
    for static in (True, False):
        if algorithm == "EAGLE3":
            proposer = EagleProposer(str(DEFAULT_MODEL), str(DEFAULT_EAGLE3), _config(spec), "EAGLE3")
            capture = {"feature_layers": proposer.target_capture_layers}
        else:
            proposer = StandaloneProposer(ModelRunner(str(DEFAULT_DRAFT), _config(spec)))
            capture = {}
        if static:
            assert proposer.enable_static_step(spec, max_bs=8)
            assert len(proposer._static_steps[spec].graphs) > 0
        trees = _record(proposer)
        engine = TargetEngine(target, **capture)
        outs = {}
        # batch 1 and batch 6 (bucket 6), greedy
        for batch in (1, 6):
            committed: dict = {}
            _generate(engine, proposer, method, prompts[:batch], 40, 0.0, 100 * batch, outputs=committed)
            outs[batch] = committed
        if static:
            assert proposer._static_steps[spec].num_replays > 0
        results[static] = (outs, trees)
    (outs_s, trees_s), (outs_e, trees_e) = results[True], results[False]
    assert outs_s == outs_e  # greedy: the same tokens whatever the draft
    plain = {}
    _generate(TargetEngine(target), None, Method("AR", "NONE"), prompts[:6], 40, 0.0, 600, outputs=plain)
    assert list(outs_s[6].values()) == list(plain.values())  # and plain decoding's
    same = sum(a == b for a, b in zip(trees_s, trees_e))
    assert same >= 0.9 * len(trees_e), f"{same}/{len(trees_e)} trees equal"


@pytest.mark.parametrize("algorithm,spec", [("EAGLE3", SpecShape(5, 4, 16)), ("STANDALONE", SpecShape(4, 2, 8))])
def test_static_verify_graphs_match_eager(algorithm, spec):
    """The static verify step's graphs (forward, tree walk, compaction, feature gather) with the static draft step:
    the same greedy tokens as the eager target and plain decoding, batch 1 and 6."""
    from target_service.engine import TargetEngine

    prompts = _prompts(6)
    method = Method("m", algorithm, spec.num_steps, spec.topk, spec.num_draft_tokens)
    outs = {}
    for static in (True, False):
        target = ModelRunner(str(DEFAULT_MODEL), EngineConfig(
            device="cuda", dtype="float32", attention_backend="triton", max_total_tokens=32768, cuda_graph_max_bs=8,
            cuda_graph_num_draft_tokens=spec.num_draft_tokens))
        if algorithm == "EAGLE3":
            proposer = EagleProposer(str(DEFAULT_MODEL), str(DEFAULT_EAGLE3), _config(spec), "EAGLE3")
            engine = TargetEngine(target, feature_layers=proposer.target_capture_layers)
        else:
            proposer = StandaloneProposer(ModelRunner(str(DEFAULT_DRAFT), _config(spec)))
            engine = TargetEngine(target)
        assert proposer.enable_static_step(spec, max_bs=8)
        if static:
            assert engine.enable_static_verify(spec.num_draft_tokens, max_bs=8)
            assert len(engine._static_verify.graphs) > 0
        for batch in (1, 6):
            committed: dict = {}
            _generate(engine, proposer, method, prompts[:batch], 40, 0.0, 100 * batch, outputs=committed)
            outs[(static, batch)] = list(committed.values())
        if static:
            assert engine._static_verify.num_replays > 0
    plain: dict = {}
    _generate(TargetEngine(target), None, Method("AR", "NONE"), prompts[:6], 40, 0.0, 600, outputs=plain)
    assert outs[(True, 6)] == outs[(False, 6)] == list(plain.values())
    assert outs[(True, 1)] == outs[(False, 1)]


def test_static_dflash_block_step_graphs_match_eager(tmp_path):
    """DFLASH's block forward as CUDA graphs (runtime/speculative/block_step.py: paged context KV, a step's new context
    rows injected in the graph) drafts the eager proposer's chains (dense gather + SDPA) on the demo target with a
    random block-4 draft, batch 1 and 5, greedy generation equal either way, and every Propose after the prompt's
    replays one graph."""
    from draft_service.dflash import DFlashProposer
    from target_service.engine import TargetEngine
    from tests.tiny_models import make_tiny_dflash_draft

    draft = make_tiny_dflash_draft(str(DEFAULT_MODEL), tmp_path / "dflash", block_size=4, target_layer_ids=[1, 3])
    config = EngineConfig(device="cuda", dtype="float32", max_total_tokens=32768)
    spec = SpecShape(1, 1, 4)
    method = Method("m", "DFLASH", spec.num_steps, spec.topk, spec.num_draft_tokens)
    for batch in (1, 5):
        runs = []
        for static in (True, False):
            proposer = DFlashProposer(str(DEFAULT_MODEL), str(draft), config)
            if static:
                assert proposer.enable_static_step(spec, max_bs=8) and proposer._block_step.graphs
            engine = TargetEngine(ModelRunner(str(DEFAULT_MODEL), config),
                                  feature_layers=proposer.target_capture_layers)
            trees, outputs = _record(proposer), {}
            _generate(engine, proposer, method, _prompts(batch), 32, 0.0, 0, outputs=outputs)
            runs.append((trees, outputs, proposer._block_step.num_replays if static else 0))
        (static_trees, static_out, replays), (eager_trees, eager_out, _) = runs
        assert static_out == eager_out
        agree = sum(a == b for a, b in zip(static_trees, eager_trees))
        assert len(static_trees) == len(eager_trees) and agree >= 0.95 * len(eager_trees), (agree, len(eager_trees))
        assert replays >= len(static_trees) // batch - 2  # every Propose but the prompt's went through the graphs
