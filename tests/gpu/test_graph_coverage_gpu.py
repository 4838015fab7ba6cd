"""CUDA-graph coverage on the GPU, real capture: lm_head + argmax inside the target's decode/verify graphs (greedy
steps read back only the argmax rows) == eager; TargetEngine greedy verify with EAGLE feature capture through graphs
== eager; STANDALONE draft tree steps and EAGLE-3 head steps replayed from graphs propose exactly the eager trees.
The same paths run on CPU with a fake capture in tests/graphs/."""

from __future__ import annotations

import random

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from draft_service.eagle import EagleProposer  # noqa: E402
from draft_service.standalone import StandaloneProposer  # noqa: E402
from runtime.config import EngineConfig, ModelConfig  # noqa: E402
from runtime.model_runner import ModelRunner, SeqForward  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402
from runtime.speculative.tree import DraftTree  # noqa: E402
from runtime.speculative.verify import verify_greedy  # noqa: E402
from core.types import StopRule  # noqa: E402
from target_service.engine import PrefillInput, TargetEngine, VerifyInput  # noqa: E402
from tests.graphs.test_graph_paths import TREE, _record_trees, _standalone_loop  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

# Llama-3.1-8B attention shapes, two layers, Llama-3 vocabulary (lm_head of real size inside the graph), float32 so
# that graph vs eager differences stay far below near-ties of the random-weight logits.
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=2, num_heads=32,
                     num_kv_heads=8, head_dim=128, intermediate_size=1024, max_position_embeddings=8192,
                     rope_theta=500000.0)
NDT = 8


def _cfg(graphs: bool, **kw) -> EngineConfig:
    base = dict(device="cuda", dtype="float32", load_format="dummy", attention_backend="triton", block_size=16,
                max_total_tokens=32768, seed=0, disable_cuda_graph=not graphs, cuda_graph_max_bs=16,
                cuda_graph_num_draft_tokens=NDT)
    return EngineConfig(**{**base, **kw})


def _counting(runner: ModelRunner) -> list:
    replays = []
    original = runner.graph_runner.replay

    def counting(key, *args, **kwargs):
        replays.append(key)
        return original(key, *args, **kwargs)

    runner.graph_runner.replay = counting
    return replays


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("graph_cov"))


def test_lm_head_and_argmax_in_graph_match_eager():
    graph = ModelRunner(None, _cfg(True, cuda_graph_max_bs_decode=32), CONFIG)
    eager = ModelRunner(None, _cfg(False), CONFIG)
    gr = graph.graph_runner
    assert gr.sizes[1][-1] == 32 and gr.sizes[NDT][-1] == 16, gr.sizes
    g = gr.graphs[(16, NDT)][1]
    assert g.logits.shape == (16 * NDT, CONFIG.vocab_size) and g.argmax.shape == (16 * NDT,)
    replays = _counting(graph)
    rng = random.Random(0)
    seqs = [f"s{i}" for i in range(11)]  # the 16 bucket pads 5
    for r in (graph, eager):
        for s in seqs:
            r.add_seq(s)
    prompts = [[rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randrange(1, 600))] for _ in seqs]
    for r in (graph, eager):
        r.forward([SeqForward(s, p) for s, p in zip(seqs, prompts)])
    ids = {s: rng.randrange(3, CONFIG.vocab_size) for s in seqs}
    agree = total = 0
    for step in range(4):
        batch = [SeqForward(s, [ids[s]]) for s in seqs]
        got = graph.forward(batch, outputs="both")
        want = eager.forward(batch)
        want_ids = [row.argmax(-1).tolist() for row in want.logits]
        agree += sum(a == b for a, b in zip(got.argmax, want_ids))
        total += len(seqs)
        diff = (torch.cat(got.logits) - torch.cat(want.logits)).abs().max().item()
        print(f"decode step {step}: max |graph - eager| logit {diff:.2e}, argmax agree {got.argmax == want_ids}")
        assert diff <= 1e-3 * torch.cat(want.logits).abs().max().item() + 1e-5
        ids = {s: row[-1] for s, row in zip(seqs, got.argmax)}
    parents = [-1] + [rng.randrange(0, j) for j in range(1, NDT)]
    batch = [SeqForward(s, [ids[s]] + [rng.randrange(3, 1000) for _ in range(NDT - 1)], parents=parents,
                        logits="all") for s in seqs]
    got, want = graph.forward(batch, outputs="argmax"), eager.forward(batch)
    assert all(t.numel() == 0 for t in got.logits)  # greedy: no logits leave the graph
    want_ids = [row.argmax(-1).tolist() for row in want.logits]
    # The graph also walked every fresh tree on the device: same path and tokens as the host walk over its argmax.
    draft = DraftTree(batch[0].token_ids[1:], [p - 1 for p in parents[1:]])
    assert got.greedy_tree is not None and len(got.greedy_tree) == len(seqs)
    for sf, argmax, (path, emitted) in zip(batch, got.argmax, got.greedy_tree):
        walk = verify_greedy(DraftTree(sf.token_ids[1:], draft.parents), argmax)
        assert path == [0] + [n + 1 for n in walk.accepted_nodes] and emitted == walk.tokens
    agree += sum(a == b for a, b in zip(got.argmax, want_ids))
    total += len(seqs)
    print(f"argmax agreement graph vs eager: {agree}/{total}; replays {replays}")
    assert replays == [(16, 1)] * 4 + [(16, NDT)]
    assert agree >= 0.99 * total  # other GEMM kernels for the padded rows: a near-tie may flip, nothing more


def _engine(path: str, graphs: bool) -> TargetEngine:
    cfg = _cfg(graphs, load_format="auto", cuda_graph_num_draft_tokens=4)
    return TargetEngine(ModelRunner(path, cfg), feature_layers=[1, 3])


def test_target_engine_greedy_features_through_graphs(tiny):
    graph, eager = _engine(tiny, True), _engine(tiny, False)
    assert graph.runner.graph_runner.capture_layers == [1, 3]
    replays = _counting(graph.runner)
    greedy = SamplingParams(temperature=0.0)
    rng = random.Random(1)
    prompts = {f"x{i}": [rng.randrange(3, 320) for _ in range(6)] for i in range(5)}
    results = []
    for engine in (graph, eager):
        pre = engine.prefill([PrefillInput(s, p, True, greedy, StopRule(64, prompt_len=6), return_features=True)
                              for s, p in prompts.items()])
        committed = {o.seq_id: prompts[o.seq_id] + o.token_ids for o in pre}
        steps = []
        for _ in range(4):
            tree = DraftTree([7, 8, 9], [-1, -1, 0])
            res = engine.verify([VerifyInput(s, len(c), c[-1], tree, greedy, StopRule(64, prompt_len=6),
                                             return_features=True) for s, c in committed.items()])
            for o in res:
                committed[o.seq_id] += o.token_ids
            steps.append([(o.token_ids, o.features) for o in res])
        results.append((committed, steps))
    print("engine replays:", replays)
    assert replays == [(5, 4)] * 4
    assert results[0][0] == results[1][0]
    for step_a, step_b in zip(results[0][1], results[1][1]):
        for (tok_a, feat_a), (tok_b, feat_b) in zip(step_a, step_b):
            assert tok_a == tok_b and torch.allclose(feat_a, feat_b, atol=1e-4)


def _draft_cfg(graphs: bool, spec, **kw) -> EngineConfig:
    return _cfg(graphs, load_format="auto", cuda_graph_num_draft_tokens=spec.topk,
                cuda_graph_mask_width=spec.num_steps * spec.topk, **kw)


def test_standalone_draft_steps_graphs_match_eager(tiny):
    results, all_replays = [], None
    for graphs in (True, False):
        proposer = StandaloneProposer(ModelRunner(tiny, _draft_cfg(graphs, TREE)))
        if graphs:
            all_replays = _counting(proposer.runner)
        trees = _record_trees(proposer)
        target = ModelRunner(tiny, _cfg(False, load_format="auto"))
        rng = random.Random(2)
        prompts = {f"p{i}": [rng.randrange(3, 320) for _ in range(5)] for i in range(3)}
        results.append((_standalone_loop(target, proposer, prompts, TREE, steps=4), trees))
    print("draft replays:", all_replays)
    assert sum(key == (3, TREE.topk) for key in all_replays) >= 4 * (TREE.num_steps - 1)
    assert results[0] == results[1]


def test_eagle3_head_steps_graphs_match_eager(tmp_path, tiny):
    from tests.eagle.heads import make_eagle3_head
    from tests.eagle.test_eagle_lossless import speculative_greedy

    head = make_eagle3_head(tiny, str(tmp_path / "eagle3"))
    results, all_replays = [], None
    for graphs in (True, False):
        proposer = EagleProposer(tiny, head, _draft_cfg(graphs, TREE), algorithm="EAGLE3")
        if graphs:
            assert proposer.runner.graph_runner is not None and proposer.runner.graph_runner.features is not None
            all_replays = _counting(proposer.runner)
        trees = _record_trees(proposer)
        target = ModelRunner(tiny, _cfg(False, load_format="auto"))
        generated, accepts = speculative_greedy(target, proposer, [5, 17, 42, 99, 7], 24, TREE)
        results.append((generated, accepts, trees))
    print("eagle3 replays:", all_replays, "accepts:", results[0][1])
    assert sum(key == (1, TREE.topk) for key in all_replays) >= len(results[0][2]) * (TREE.num_steps - 1)
    assert results[0] == results[1]


def test_torch_compiled_draft_graphs_match_eager_graphs(tiny):
    """--enable-torch-compile: the graphs of <= --torch-compile-max-bs sequences capture the inductor-compiled forward
    (compiled by the capture warm-up); the proposals equal those of the uncompiled graphs."""
    import time

    results = []
    for compiled in (True, False):
        torch._dynamo.reset()
        start = time.perf_counter()
        cfg = _draft_cfg(True, TREE, cuda_graph_max_bs=4, enable_torch_compile=compiled, torch_compile_max_bs=4)
        proposer = StandaloneProposer(ModelRunner(tiny, cfg))
        gr = proposer.runner.graph_runner
        print(f"compile={compiled}: runner with graphs {sorted(gr.graphs)} built in {time.perf_counter() - start:.1f} s")
        assert (gr.compiled is not None) == compiled
        trees = _record_trees(proposer)
        target = ModelRunner(tiny, _cfg(False, load_format="auto"))
        rng = random.Random(6)
        prompts = {f"c{i}": [rng.randrange(3, 320) for _ in range(5)] for i in range(3)}
        results.append((_standalone_loop(target, proposer, prompts, TREE, steps=4), trees))
    assert results[0] == results[1]
