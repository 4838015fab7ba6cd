"""The static draft step (runtime/speculative/draft_step.py: a whole Propose as static-shape device code, one CUDA
graph per batch bucket on a GPU) gives exactly the eager proposers' trees and generations, STANDALONE and EAGLE-3,
chains and trees, batch 1 and 6 (padded into buckets), and reads the device back once per Propose. On CPU its device
code runs eagerly with the triton backend through the interpreter, as the eager proposers here do."""

from __future__ import annotations

import random

import pytest
import torch

from draft_service.eagle import EagleProposer
from draft_service.proposer import SpecShape
from draft_service.standalone import StandaloneProposer
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from runtime.speculative import draft_step
from runtime.speculative.draft_step import select_tree_device
from runtime.speculative.tree import BeamTreeBuilder, _select_closed
from tests.graphs.test_graph_paths import _config, _record_trees, _standalone_loop
from tests.tiny_models import make_tiny_model

TREE = SpecShape(num_steps=3, topk=2, num_draft_tokens=5)
CHAIN = SpecShape(num_steps=3, topk=1, num_draft_tokens=4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("draft_step"))


class ReadbackCounter:
    """Counts device->host reads made while it is active: a static step's read_back, and .tolist / .item / .cpu of
    any tensor but what a read_back returned (host memory already on a GPU; the device's output itself on CPU)."""

    def __init__(self, monkeypatch) -> None:
        from runtime.speculative.static_step import StaticStep

        self.count = 0
        read = set()  # storages read_back returned
        original_read_back = StaticStep.read_back

        def read_back(step, out):
            self.count += 1
            host = original_read_back(step, out)
            read.add(host.untyped_storage().data_ptr())
            return host

        monkeypatch.setattr(StaticStep, "read_back", read_back)
        for name in ("tolist", "item", "cpu"):
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **kw):
                if t.untyped_storage().data_ptr() not in read:
                    self.count += 1
                return _original(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_device_selection_equals_the_host_frontier_selection():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        b, steps, k = 3, 4, 3
        builder = BeamTreeBuilder(b, steps, k, num_draft_tokens=9)
        vocab = 7
        logits = torch.randn(b, vocab, generator=gen)
        if trial % 3 == 0:  # exact ties and zero-probability tokens
            logits = torch.randint(0, 3, (b, vocab), generator=gen).float()
            logits[:, -1] = -torch.inf
        nodes = builder.first(torch.log_softmax(logits, dim=-1))
        for _ in range(1, steps):
            nodes = builder.next(torch.log_softmax(torch.randn(b, k, vocab, generator=gen), dim=-1))
        want = builder.finalize()
        scores, all_tokens, all_parents = builder.candidates()
        tokens, parents, count = select_tree_device(scores, all_tokens, all_parents, 8)
        for i, tree in enumerate(want):
            n = int(count[i])
            assert tokens[i, :n].tolist() == tree.token_ids
            assert parents[i, :n].tolist() == tree.parents
            assert (tokens[i, n:] == -1).all()
        # and the host reference itself on the same candidates
        host = _select_closed(scores[0].tolist(), all_tokens[0].tolist(), all_parents[0].tolist(), 8)
        assert host.token_ids == want[0].token_ids


@pytest.mark.parametrize("spec", [TREE, CHAIN], ids=["tree", "chain"])
def test_standalone_static_step_matches_eager(llama, spec, monkeypatch):
    static_p = StandaloneProposer(ModelRunner(llama, _config()))
    assert static_p.enable_static_step(spec, max_bs=8)
    step = static_p._static_steps[spec]
    eager_p = StandaloneProposer(ModelRunner(llama, _config()))
    rng = random.Random(3)
    prompts = {f"s{i}": [rng.randrange(3, 320) for _ in range(5 + i)] for i in range(6)}
    results = []
    for proposer in (static_p, eager_p):
        trees = _record_trees(proposer)
        target = ModelRunner(llama, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048, block_size=4))
        results.append((_standalone_loop(target, proposer, prompts, spec, steps=4), trees))
    # every Propose: the first's prompt (wider than the step's catch-up) is caught up eagerly, its tree still static
    assert step.num_replays == 4
    assert results[0] == results[1]
    assert all(len(tokens) == spec.num_draft_tokens - 1 for call in results[0][1] for tokens, _ in call)
    assert static_p.runner.num_free_tokens() == eager_p.runner.num_free_tokens()  # no leaked scratch blocks


def test_static_step_with_the_fused_topk_and_selection_kernels_matches_eager(llama, monkeypatch):
    """Inside a CUDA graph the static step ranks each row with tandem_kernels/topk.py (log-softmax + top-k in one
    launch) instead of torch's five kernels and re-ranks the candidates with tandem_kernels/tree.select_tree: forced
    on here (the Triton interpreter), the same trees as eager."""
    from runtime.models import llama as llama_model

    used: list[str] = []
    real = llama_model._k
    for module in (llama_model, draft_step):
        monkeypatch.setattr(module, "_k", lambda name: used.append(name) or real(name))
    rng = random.Random(5)
    prompts = {f"s{i}": [rng.randrange(3, 320) for _ in range(5 + i)] for i in range(3)}
    results = []
    for static in (True, False):
        proposer = StandaloneProposer(ModelRunner(llama, _config()))
        if static:
            assert proposer.enable_static_step(TREE, max_bs=4)
        trees = _record_trees(proposer)
        target = ModelRunner(llama, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048, block_size=4))
        with llama_model.fused_elementwise(static):
            results.append((_standalone_loop(target, proposer, prompts, TREE, steps=3), trees))
    assert {"topk", "tree"} <= set(used), set(used)
    assert results[0] == results[1]


def test_standalone_static_step_batch_one_and_one_readback(llama, monkeypatch):
    static_p = StandaloneProposer(ModelRunner(llama, _config()))
    static_p.enable_static_step(TREE, max_bs=4)
    eager_p = StandaloneProposer(ModelRunner(llama, _config()))
    prompts = {"a": [5, 17, 42, 99, 7, 250]}
    outs = []
    for proposer in (static_p, eager_p):
        target = ModelRunner(llama, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048, block_size=4))
        outs.append(_standalone_loop(target, proposer, prompts, TREE, steps=3))
    assert outs[0] == outs[1]
    # One readback per Propose, whatever the batch: count it on a warm proposer.
    from draft_service.proposer import ProposeInput

    for batch in (1, 3):
        p = StandaloneProposer(ModelRunner(llama, _config()))
        p.enable_static_step(TREE, max_bs=4)
        seqs = {f"r{i}": [3 + i, 9, 27, 81, 200, 11 + i] for i in range(batch)}
        for s, toks in seqs.items():
            p.prefill(s, toks)
        counter = ReadbackCounter(monkeypatch)
        p.propose([ProposeInput(s, len(t), [], TREE) for s, t in seqs.items()])  # prompt caught up eagerly first
        assert counter.count == 1 and p._static_steps[TREE].num_replays == 1, batch
        counter = ReadbackCounter(monkeypatch)
        p.propose([ProposeInput(s, len(t) + 1, [1], TREE) for s, t in seqs.items()])
        assert counter.count == 1, batch
        monkeypatch.undo()


def test_padding_rows_write_no_kv(llama):
    """A batch of 9 in a bucket of 16: the padding rows' block tables are all block 0, which belongs to a live
    sequence here; their catch-up and tree nodes write no KV there (the KV that sequence holds keeps its values)."""
    from draft_service.proposer import ProposeInput

    p = StandaloneProposer(ModelRunner(llama, _config()))
    assert p.enable_static_step(TREE, max_bs=16)
    seqs = {f"r{i}": [3 + i, 9, 27, 81, 200, 11 + i] for i in range(9)}
    for s, toks in seqs.items():
        p.prefill(s, toks)
    p.propose([ProposeInput(s, len(t), [], TREE) for s, t in seqs.items()])  # prompt caught up eagerly first
    assert p._static_steps[TREE].bucket_for(len(seqs)) == 16
    bm, kv = p.runner.block_manager, p.runner.kv_pool.kv  # kv: (L, 2, blocks, block_size, kvh, hd)
    owner = next(s for s in seqs if 0 in bm.block_table(s))
    first = bm.block_table(owner).index(0) * bm.block_size  # the owner's position at block 0's slot 0
    held = [i for i in range(bm.block_size) if first + i < p.runner.kv_len(owner)]
    assert held
    before = kv[:, :, 0].clone()
    p.propose([ProposeInput(s, len(t) + 1, [1], TREE) for s, t in seqs.items()])
    assert p._static_steps[TREE].num_replays == 2
    for i in held:
        assert torch.equal(before[:, :, i], kv[:, :, 0, i]), f"block 0 slot {i} overwritten"


@pytest.mark.parametrize("spec", [TREE, CHAIN], ids=["tree", "chain"])
def test_eagle3_static_step_matches_eager(tmp_path, spec):
    from tests.eagle.heads import make_eagle3_head
    from tests.eagle.test_eagle_lossless import speculative_greedy

    target_path = make_tiny_model("llama", tmp_path / "target")
    head = make_eagle3_head(target_path, str(tmp_path / "eagle3"))
    results = []
    for static in (True, False):
        proposer = EagleProposer(target_path, head, _config(max_total_tokens=1024), algorithm="EAGLE3")
        if static:
            assert proposer.enable_static_step(spec, max_bs=4)
        trees = _record_trees(proposer)
        target = ModelRunner(target_path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048,
                                                       block_size=4))
        generated, accepts = speculative_greedy(target, proposer, [5, 17, 42, 99, 7], 10, spec)
        results.append((generated, accepts, trees))
        if static:
            assert proposer._static_steps[spec].num_replays == len(trees)  # the prompt's Propose too
    assert results[0] == results[1]


def test_synthetic_head_spends_its_compute_through_the_static_step():
    """SYNTHETIC's EAGLE-3-sized head (8B benchmarks) runs the static step too: the trees still come from the oracle,
    the head's KV ends at the committed positions [0, C-1), nothing leaks."""
    from draft_service.proposer import ProposeInput
    from draft_service.synthetic import Oracle, SyntheticHead, SyntheticProposer
    from runtime.config import ModelConfig

    target_config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)
    spec = SpecShape(3, 2, 6)
    trees = []
    for static in (True, False):
        head = SyntheticHead(target_config, _config(max_total_tokens=2048), 64, 100)
        proposer = SyntheticProposer(1.0, 512, Oracle({(1, 2, 3): list(range(10, 60))}), head=head)
        if static:
            assert proposer.enable_static_step(spec, max_bs=4)
        proposer.prefill("a", [1, 2, 3, 10])
        committed = [1, 2, 3, 10]
        got = []
        for new in ([], [11, 12]):
            committed += new
            tree = proposer.propose([ProposeInput("a", len(committed), new, spec)])[0].tree
            got.append((tree.token_ids, tree.parents))
            assert head.runner.kv_len("a") == len(committed) - 1
        trees.append(got)
        if static:
            assert head._static_steps[spec].num_replays == 2
        proposer.release(["a"])
        assert head.runner.num_free_tokens() == head.runner.num_total_tokens()
    assert trees[0] == trees[1]


@pytest.mark.parametrize("steps", [2, 3])
def test_multi_layer_eagle_static_step_matches_eager(tmp_path, steps):
    """Multi-layer EAGLE's static step (StaticMultiLayerDraftStep: every MTP layer over the catch-up window, one
    graph) proposes the eager chains at every Propose, through random commit patterns (windows of every width)."""
    from tests.test_multi_layer_eagle import drive
    from tests.tiny_models import add_mtp_layers

    target = add_mtp_layers(make_tiny_model("llama", tmp_path), num_layers=3)
    spec = SpecShape(steps, 1, steps + 1)
    static_p = EagleProposer(target, target, _config(max_total_tokens=1024), "NEXTN", multi_layer_steps=steps)
    assert static_p.enable_static_step(spec, max_bs=4)
    assert not static_p.enable_static_step(SpecShape(steps, 2, steps + 1), max_bs=4)  # chains only
    eager_p = EagleProposer(target, target, _config(max_total_tokens=1024), "NEXTN", multi_layer_steps=steps)
    got = [chain for _, _, chain in drive(static_p, spec, 8, seed=steps)]
    want = [chain for _, _, chain in drive(eager_p, spec, 8, seed=steps)]
    assert got == want and all(len(chain) == steps for chain in got)
    # Every Propose (the prompt's catch-up of 5 tokens too when it fits the 2S-wide window)
    assert static_p._static_steps[spec].num_replays == (8 if 5 <= 2 * steps else 7)
    static_p.release(["s"])
    assert static_p.runner.num_free_tokens() == static_p.runner.num_total_tokens()


@pytest.mark.parametrize("spec", [TREE, CHAIN], ids=["tree", "chain"])
def test_eagle3_predraft_static_matches_eager_and_a_miss_rolls_back(tmp_path, spec):
    """A pre-draft (append_guess: feature rows for the committed tokens only, the head's own hidden states over the
    guessed path) gives the same guess and tree through the static step (own-hidden rows in its catch-up) as
    eagerly; the real Propose after a wrong guess gives the tree of a draft that never saw the guess."""
    from core.steps import ProposeInput
    from tests.eagle.heads import make_eagle3_head

    target_path = make_tiny_model("llama", tmp_path / "target")
    head = make_eagle3_head(target_path, str(tmp_path / "eagle3"))
    prompt = [5, 17, 42, 99, 7, 31, 12]
    real = [40, 50, 61]
    results = []
    for static in (True, False, None):  # None: a fresh draft that only ever sees the real tokens
        proposer = EagleProposer(target_path, head, _config(max_total_tokens=1024), algorithm="EAGLE3")
        feats = torch.randn(len(prompt) + len(real), proposer.feature_size, generator=torch.Generator().manual_seed(1))
        if static:
            assert proposer.enable_static_step(spec, max_bs=4)
        if static is None:
            proposer.prefill("s", prompt + real, feats[:len(prompt) + len(real) - 1])
            [out] = proposer.propose([ProposeInput("s", len(prompt) + len(real), [], spec)])
            results.append((None, None, out.tree.token_ids, out.tree.parents))
            continue
        proposer.prefill("s", prompt, feats[:len(prompt) - 1])
        proposer.propose([ProposeInput("s", len(prompt), [], spec)])  # the prompt's catch-up
        [pre] = proposer.propose([ProposeInput("s", len(prompt) + 2, [40, 41], spec,
                                               torch.empty(0, proposer.feature_size), append_guess=True)])
        assert pre.status == 0 and len(pre.guessed_token_ids) == 1, pre.error
        assert pre.base_committed_len == len(prompt) + 3 and len(pre.tree.token_ids) > 0
        # the target committed 40, 50, 61 instead (a miss): rows for every token after the prompt's last
        [out] = proposer.propose([ProposeInput("s", len(prompt) + len(real), real, spec,
                                               feats[len(prompt) - 1:len(prompt) + len(real) - 1])])
        results.append(((pre.guessed_token_ids, pre.tree.token_ids, pre.tree.parents), proposer._own.get("s"),
                        out.tree.token_ids, out.tree.parents))
        if static:  # the pre-draft's tree and the real Propose both went through the static step
            assert proposer._static_steps[spec].num_replays >= 2
    static_run, eager_run, fresh = results
    assert static_run[0] == eager_run[0], "pre-draft: static step and eager differ"
    assert static_run[2:] == eager_run[2:] == fresh[2:], "after a miss the draft must be as if it never guessed"
    assert not static_run[1] and not eager_run[1], "own hiddens of a wrong guess must be dropped"


def test_static_steps_under_torch_compile_match_eager(tmp_path, monkeypatch):
    """--enable-torch-compile: the graphs of <= --torch-compile-max-bs sequences capture the static draft and verify
    steps' device code compiled by torch.compile (dynamo's "eager" backend here: tracing, graph breaks around the
    attention kernels, guards; inductor's fusion runs on the GPU). Run through the compiled code, the trees and the
    generation equal the eager proposer's and the eager verify's."""
    import runtime.cuda_graph as cuda_graph
    from runtime.speculative.static_step import StaticStep
    from target_service.engine import TargetEngine
    from tests.graphs.test_verify_step import _generate, Method

    monkeypatch.setattr(cuda_graph, "COMPILE_BACKEND", "eager")
    # Dynamo falls back to running a frame uncompiled once it recompiled it recompile_limit (8) times; here that is an
    # error. Every decoder layer's frame (resumed after the attention break) would otherwise recompile per layer and
    # shape: a deep model's later layers ran uncompiled on the H200 (compile_steps, 11th session).
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    torch._dynamo.reset()
    used = []

    def replay(self, bs):  # as a captured graph would: the code its capture ran
        code = self.code_for(bs)
        used.append((type(self).__name__, bs, code != self.run))
        with torch.inference_mode():
            return code(bs)

    monkeypatch.setattr(StaticStep, "replay", replay)
    llama = make_tiny_model("llama", tmp_path, num_hidden_layers=6)
    results = []
    for compiled in (True, False):
        cfg = _config(enable_torch_compile=compiled, torch_compile_max_bs=2, max_total_tokens=4096)
        engine = TargetEngine(ModelRunner(llama, cfg))
        assert engine.enable_static_verify(TREE.num_draft_tokens, max_bs=4)
        proposer = StandaloneProposer(ModelRunner(llama, cfg))
        assert proposer.enable_static_step(TREE, max_bs=4)
        rng = random.Random(8)
        prompts = [[rng.randrange(3, 320) for _ in range(6 + i)] for i in range(2)]
        committed: dict = {}
        steps, _ = _generate(engine, proposer, Method("m", "STANDALONE", TREE.num_steps, TREE.topk,
                                                      TREE.num_draft_tokens), prompts, 10, 0.0, 0, outputs=committed)
        results.append((committed, steps))
    assert results[0] == results[1]
    ran = {(name, c) for name, _, c in used}
    assert {("StaticDraftStep", True), ("StaticVerifyStep", True)} <= ran, used  # the compiled code ran
    assert ("StaticVerifyStep", False) in ran  # and the plain code without --enable-torch-compile
    torch._dynamo.reset()
