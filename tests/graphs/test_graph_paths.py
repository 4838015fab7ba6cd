"""The CUDA-graph paths of ModelRunner, TargetEngine and the draft proposers on CPU (fake capture, see
fake_graphs.py): buckets and padding, lm_head + argmax taken from the graph's static outputs, greedy steps read back
as argmax only, EAGLE feature capture through graphs, and STANDALONE / EAGLE-3 draft steps through graphs give
exactly the eager tokens and trees."""

from __future__ import annotations

import random

import pytest
import torch

from draft_service.eagle import EagleProposer
from draft_service.proposer import ProposeInput, SpecShape, Status
from draft_service.standalone import StandaloneProposer
from runtime.config import EngineConfig
from runtime.forward_batch import SeqAttention
from runtime.model_runner import ModelRunner, SeqForward
from runtime.sampling import SamplingParams
from runtime.speculative.tree import DraftTree
from runtime.speculative.verify import verify_greedy
from core.types import StopRule
from target_service.engine import PrefillInput, TargetEngine, VerifyInput
from tests.graphs.fake_graphs import install_fake_graphs
from tests.tiny_models import make_tiny_model

NDT = 4  # verify width: root + 3 draft nodes
TREE = SpecShape(num_steps=3, topk=2, num_draft_tokens=5)


def _config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", attention_backend="triton", block_size=4, max_total_tokens=2048,
                cuda_graph_max_bs=4, cuda_graph_num_draft_tokens=NDT)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("graphs"))


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    got, want = torch.cat(got), torch.cat(want)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_buckets_per_width_and_what_runs_eager(llama):
    runner = ModelRunner(llama, _config(cuda_graph_max_bs=3, cuda_graph_max_bs_decode=5))
    gr = install_fake_graphs(runner)
    assert gr.sizes == {1: [1, 2, 3, 4, 5], NDT: [1, 2, 3]}
    assert set(gr.graphs) == {(b, 1) for b in range(1, 6)} | {(b, NDT) for b in range(1, 4)}

    def seq(query_len: int, tail: int | None = None) -> SeqAttention:
        rows = None if tail is None else [1 << i for i in range(query_len)]
        return SeqAttention(0, query_len, 10, 10 - (tail or query_len), [0, 1, 2], 4, runner.device, tree_rows=rows)

    assert gr.key_for([seq(1)] * 5) == (5, 1)  # decode: up to --cuda-graph-max-bs-decode
    assert gr.key_for([seq(NDT)] * 2) == (2, NDT)
    assert gr.key_for([seq(NDT)] * 4) is None  # verify: only up to --cuda-graph-max-bs
    assert gr.key_for([seq(1)] * 6) is None
    assert gr.key_for([seq(2)]) is None  # an uncaptured width
    assert gr.key_for([seq(1), seq(NDT)]) is None  # mixed widths
    assert gr.key_for([seq(NDT, tail=NDT)]) == (1, NDT)
    assert gr.key_for([seq(NDT, tail=NDT + 1)]) is None  # a tail wider than the graph's mask


def test_graph_runner_matches_eager_for_decode_and_verify_with_padding(llama):
    graph, eager = ModelRunner(llama, _config()), ModelRunner(llama, _config())
    gr = install_fake_graphs(graph, sizes=[2, 4])  # 3 sequences run padded to 4, 1 padded to 2
    rng = random.Random(0)
    seqs = ["a", "b", "c"]
    for r in (graph, eager):
        for s in seqs:
            r.add_seq(s)
    prompts = {s: [rng.randrange(3, 320) for _ in range(rng.randrange(3, 9))] for s in seqs}
    outs = [r.forward([SeqForward(s, prompts[s]) for s in seqs]) for r in (graph, eager)]
    assert gr.num_replays() == 0  # prefill runs eager
    _close(outs[0].logits, outs[1].logits)
    next_ids = {s: int(row[-1].argmax()) for s, row in zip(seqs, outs[0].logits)}
    for step in range(3):
        batch = [SeqForward(s, [next_ids[s]]) for s in seqs[: 3 - step % 2 * 2]]  # 3 then 1 then 3 sequences
        got = graph.forward(batch, outputs="both")
        want = eager.forward(batch)
        _close(got.logits, want.logits)
        assert got.argmax == [row.argmax(-1).tolist() for row in want.logits]
        assert graph.forward  # the padding rows wrote no KV: slots of padding are -1 in the static inputs
        assert (gr.inputs[2, len(batch):4 if len(batch) > 2 else 2] == -1).all()
        next_ids.update({sf.seq_id: row[-1] for sf, row in zip(batch, got.argmax)})
    assert gr.num_replays() == 3
    parents = [-1, 0, 0, 1]
    batch = [SeqForward(s, [next_ids[s], 5, 6, 7], parents=parents, logits="all") for s in seqs]
    got, want = graph.forward(batch, outputs="argmax"), eager.forward(batch)
    assert got.logits == [] or all(t.numel() == 0 for t in got.logits)
    assert got.argmax == [row.argmax(-1).tolist() for row in want.logits]
    assert gr.num_replays() == 4
    for r in (graph, eager):
        for s in seqs:
            r.compact(s, [0, 1])
    batch = [SeqForward(s, [9]) for s in seqs]  # decode continues identically after compaction
    _close(graph.forward(batch).logits, eager.forward(batch).logits)
    assert gr.num_replays() == 5


def _engine(llama, graphs: bool) -> TargetEngine:
    runner = ModelRunner(llama, _config())
    if graphs:
        install_fake_graphs(runner)
    return TargetEngine(runner, feature_layers=[1, 3])  # recaptures graphs that return these layers' states


def test_target_engine_greedy_verify_and_features_through_graphs(llama):
    graph, eager = _engine(llama, True), _engine(llama, False)
    gr = graph.runner.graph_runner
    assert gr.capture_layers == [1, 3] and gr.num_replays() == 0
    walks = []
    forward = graph.runner.forward
    graph.runner.forward = lambda *a, **k: (lambda out: (walks.append(out.greedy_tree), out)[1])(forward(*a, **k))
    greedy = SamplingParams(temperature=0.0)
    rng = random.Random(1)
    prompts = {s: [rng.randrange(3, 320) for _ in range(6)] for s in ("x", "y")}
    outs = {}
    for name, engine in (("graph", graph), ("eager", eager)):
        pre = engine.prefill([PrefillInput(s, p, True, greedy, StopRule(64, prompt_len=6), return_features=True)
                              for s, p in prompts.items()])
        committed = {o.seq_id: prompts[o.seq_id] + o.token_ids for o in pre}
        steps = []
        for _ in range(3):
            tree = DraftTree([7, 8, 9], [-1, -1, 0])
            vin = [VerifyInput(s, len(c), c[-1], tree, greedy, StopRule(64, prompt_len=6), return_features=True)
                   for s, c in committed.items()]
            res = engine.verify(vin)
            for o in res:
                committed[o.seq_id] += o.token_ids
            steps.append([(o.token_ids, o.features) for o in res])
        outs[name] = (pre, steps)
    assert gr.num_replays() == 3  # every verify replayed a graph, with feature capture
    assert walks[0] is None and all(w is not None and None not in w for w in walks[1:])  # verify: walked on device
    for a, b in zip(outs["graph"][0], outs["eager"][0]):
        assert a.token_ids == b.token_ids and torch.allclose(a.features, b.features, atol=1e-5)
    for step_a, step_b in zip(outs["graph"][1], outs["eager"][1]):
        for (tok_a, feat_a), (tok_b, feat_b) in zip(step_a, step_b):
            assert tok_a == tok_b
            assert feat_a.shape == feat_b.shape == (len(tok_a), 2 * graph.runner.model_config.hidden_size)
            assert torch.allclose(feat_a, feat_b, atol=1e-4)


def _record_trees(proposer) -> list:
    trees = []
    draft = proposer._draft

    def recording(inputs):
        out = draft(inputs)
        trees.append([(t.token_ids, t.parents) for t in out])
        return out

    proposer._draft = recording
    return trees


def _standalone_loop(target: ModelRunner, proposer, prompts: dict[str, list[int]], spec: SpecShape, steps: int):
    """Greedy speculative decoding of several sequences at once, the target eager; returns the generated tokens."""
    committed = {}
    for s, p in prompts.items():
        target.add_seq(s)
        out = target.forward([SeqForward(s, p)])
        committed[s] = p + [int(out.logits[0][-1].argmax())]
        assert proposer.prefill(s, committed[s]) == Status.OK
    new = {s: [] for s in prompts}
    for _ in range(steps):
        res = proposer.propose([ProposeInput(s, len(c), new[s], spec) for s, c in committed.items()])
        for r in res:
            s, tree = r.seq_id, r.tree
            kv_len = target.kv_len(s)
            depths = [0] + [d + 1 for d in tree.depths()]
            out = target.forward([SeqForward(s, [committed[s][-1], *tree.token_ids], positions=[kv_len + d for d in depths],
                                             parents=[-1] + [p + 1 for p in tree.parents], logits="all")])
            outcome = verify_greedy(tree, out.logits[0].argmax(-1))
            target.compact(s, [0] + [n + 1 for n in outcome.accepted_nodes])
            committed[s] += outcome.tokens
            new[s] = outcome.tokens
    for s in prompts:
        target.free_seq(s)
    return committed


@pytest.mark.parametrize("spec", [TREE, SpecShape(num_steps=3, topk=1, num_draft_tokens=3)], ids=["tree", "chain"])
def test_standalone_draft_steps_through_graphs_match_eager(llama, spec):
    # As tandem/services.py configures a draft: tree steps topk wide (a chain: decode graphs), tails up to steps*topk.
    widths = dict(cuda_graph_num_draft_tokens=spec.topk if spec.topk > 1 else None,
                  cuda_graph_mask_width=spec.num_steps * spec.topk)
    graph_p = StandaloneProposer(ModelRunner(llama, _config(**widths)))
    gr = install_fake_graphs(graph_p.runner, sizes=[2, 4])
    eager_p = StandaloneProposer(ModelRunner(llama, _config()))
    rng = random.Random(2)
    prompts = {s: [rng.randrange(3, 320) for _ in range(5)] for s in ("p", "q", "r")}
    results = []
    for proposer in (graph_p, eager_p):
        trees = _record_trees(proposer)
        target = ModelRunner(llama, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048, block_size=4))
        results.append((_standalone_loop(target, proposer, prompts, spec, steps=3), trees))
    # Tree steps (topk tokens, tails up to num_steps * topk) replayed graphs: 2 per propose (catch-ups may too).
    assert gr.num_replays() >= 2 * 3
    assert results[0] == results[1]
    assert all(len(t[0]) == spec.num_draft_tokens - 1 for t in results[0][1][0])


def test_eagle3_head_steps_through_graphs_match_eager(tmp_path):
    from tests.eagle.heads import make_eagle3_head
    from tests.eagle.test_eagle_lossless import speculative_greedy

    target_path = make_tiny_model("llama", tmp_path / "target")
    head = make_eagle3_head(target_path, str(tmp_path / "eagle3"))
    spec = TREE
    widths = dict(cuda_graph_num_draft_tokens=spec.topk, cuda_graph_mask_width=spec.num_steps * spec.topk,
                  max_total_tokens=1024)
    results = []
    for graphs in (True, False):
        proposer = EagleProposer(target_path, head, _config(**widths), algorithm="EAGLE3")
        if graphs:
            gr = install_fake_graphs(proposer.runner)
            assert gr.features is not None
        trees = _record_trees(proposer)
        target = ModelRunner(target_path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048,
                                                       block_size=4))
        generated, accepts = speculative_greedy(target, proposer, [5, 17, 42, 99, 7], 10, spec)
        results.append((generated, accepts, trees))
        if graphs:
            assert gr.num_replays() >= 2 * len(trees)  # the tree steps of every propose replayed graphs
    assert results[0] == results[1]


def test_graph_flags_reach_target_and_draft_engine_configs():
    from tandem.cli import build_parser
    from tandem.services import _engine_config

    args = build_parser().parse_args([
        "target", "--cuda-graph-max-bs", "8", "--cuda-graph-max-bs-decode", "32", "--speculative-num-draft-tokens", "6"])
    cfg = _engine_config(args, target=True)
    assert (cfg.cuda_graph_max_bs, cfg.cuda_graph_max_bs_decode, cfg.cuda_graph_num_draft_tokens) == (8, 32, 6)
    assert cfg.cuda_graph_mask_width is None
    args = build_parser().parse_args([
        "draft", "--cuda-graph-max-bs", "16", "--disable-cuda-graph", "--speculative-algorithm", "STANDALONE",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"])
    cfg = _engine_config(args, draft=True)
    assert (cfg.cuda_graph_max_bs, cfg.disable_cuda_graph, cfg.cuda_graph_max_bs_decode) == (16, True, None)
    assert (cfg.cuda_graph_num_draft_tokens, cfg.cuda_graph_mask_width) == (4, 12)  # tree steps: topk wide
    args = build_parser().parse_args(["draft", "--speculative-algorithm", "STANDALONE", "--speculative-num-steps",
                                      "5", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "6"])
    cfg = _engine_config(args, draft=True)
    assert (cfg.cuda_graph_num_draft_tokens, cfg.cuda_graph_mask_width) == (None, 5)  # chain: decode graphs only
    with pytest.raises(ValueError, match="cuda_graph_max_bs_decode"):
        EngineConfig(cuda_graph_max_bs_decode=-1)


def test_torch_compiled_draft_graphs_match_eager(llama, monkeypatch):
    """--enable-torch-compile: graphs of <= --torch-compile-max-bs sequences capture the torch.compile'd forward
    (dynamo's "eager" backend here: the tracing, graph breaks around attention and guards, without inductor)."""
    import runtime.cuda_graph as cuda_graph

    monkeypatch.setattr(cuda_graph, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    spec = SpecShape(num_steps=2, topk=2, num_draft_tokens=4)
    widths = dict(cuda_graph_num_draft_tokens=spec.topk, cuda_graph_mask_width=spec.num_steps * spec.topk)
    compiled_p = StandaloneProposer(ModelRunner(llama, _config(**widths, enable_torch_compile=True,
                                                               torch_compile_max_bs=2)))
    gr = install_fake_graphs(compiled_p.runner, sizes=[2, 4])
    assert gr.compiled is not None and gr.compile_max_bs == 2
    calls = []
    compiled_forward = gr.compiled.forward
    gr.compiled.forward = lambda *a, **k: (calls.append(a[0].shape[0]), compiled_forward(*a, **k))[1]
    eager_p = StandaloneProposer(ModelRunner(llama, _config()))
    rng = random.Random(4)
    prompts = {s: [rng.randrange(3, 320) for _ in range(5)] for s in ("u", "v")}  # bucket 2: compiled
    results = []
    for proposer in (compiled_p, eager_p):
        trees = _record_trees(proposer)
        target = ModelRunner(llama, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048, block_size=4))
        results.append((_standalone_loop(target, proposer, prompts, spec, steps=2), trees))
    assert gr.num_replays() >= 2 and calls, "the compiled forward never ran"
    assert results[0] == results[1]
    torch._dynamo.reset()


def test_sampled_requests_take_logits_out_of_the_graph(llama):
    """A batch with a sampled sequence copies logits out of the graph's static buffer (the greedy one beside it still
    gets the eager greedy tokens); a seeded sampler draws the same tokens as eager."""
    graph, eager = _engine(llama, True), _engine(llama, False)
    gr = graph.runner.graph_runner
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=11)
    prompts = {"g": [11, 22, 33, 44], "t": [55, 66, 77, 88]}
    params = {"g": greedy, "t": sampled}
    results = []
    for engine in (graph, eager):
        forward = engine.runner.forward
        modes = []
        engine.runner.forward = lambda *a, **k: (modes.append(k.get("outputs")), forward(*a, **k))[1]
        pre = engine.prefill([PrefillInput(s, p, True, params[s], StopRule(64, prompt_len=4)) for s, p in prompts.items()])
        committed = {o.seq_id: prompts[o.seq_id] + o.token_ids for o in pre}
        for _ in range(3):
            res = engine.verify([VerifyInput(s, len(c), c[-1], DraftTree([7, 8, 9], [-1, 0, 1]), params[s],
                                             StopRule(64, prompt_len=4)) for s, c in committed.items()])
            for o in res:
                committed[o.seq_id] += o.token_ids
        results.append(committed)
        assert modes == ["logits"] * 4
    assert gr.num_replays() == 4  # the 4-token prompts are a chain of the wide graph's width: graph too
    assert results[0] == results[1]


def test_greedy_tree_walk_in_the_graph_equals_the_host_walk(llama):
    """Wide graphs verify fresh trees on the device (tandem_kernels.verify_greedy): the path and tokens read back with the
    argmax equal runtime.speculative.verify.verify_greedy over that argmax, from a rejected root to a fully
    accepted path (trees rebuilt from the target's own predictions until they converge)."""
    runner = ModelRunner(llama, _config(cuda_graph_mask_width=8))
    gr = install_fake_graphs(runner, sizes=[4])
    seqs = ["m", "n", "o"]  # padded to 4
    for s in seqs:
        runner.add_seq(s)
    runner.forward([SeqForward(s, [10 + i, 20, 30]) for i, s in enumerate(seqs)])
    parents = [-1, -1, 0]  # draft nodes: 0 and 1 under the root, 2 under 0
    tokens = {s: [5, 6, 7] for s in seqs}
    roots = {s: 40 + i for i, s in enumerate(seqs)}
    accepted = []
    for _ in range(4):
        kv = {s: runner.kv_len(s) for s in seqs}
        batch = [SeqForward(s, [roots[s], *tokens[s]], parents=[-1] + [p + 1 for p in parents], logits="all")
                 for s in seqs]
        out = runner.forward(batch, outputs="argmax")
        assert out.greedy_tree is not None and len(out.greedy_tree) == 3
        for s, argmax, (path, emitted) in zip(seqs, out.argmax, out.greedy_tree):
            want = verify_greedy(DraftTree(tokens[s], parents), argmax)
            assert path == [0] + [n + 1 for n in want.accepted_nodes] and emitted == want.tokens
            accepted.append(want.num_accepted_drafts)
            # Next round: each node's token = the target's choice after its parent (row 0 = after the root).
            tokens[s] = [argmax[p + 1] for p in parents]
            runner.truncate(s, kv[s])
    assert gr.num_replays() == 4
    assert accepted[-3:] == [2, 2, 2] and min(accepted) == 0, accepted
    # A second append into an open region is not a fresh tree: no device walk for it.
    batch = [SeqForward(s, [roots[s], 5], parents=[-1, 0], logits="all") for s in seqs]
    runner.forward(batch)
    extend = [SeqForward(s, [1, 2, 3, 4], parents=[0, 1, 1, 2], logits="all") for s in seqs]
    out = runner.forward(extend, outputs="argmax")
    assert out.greedy_tree == [None, None, None] and gr.num_replays() == 5
