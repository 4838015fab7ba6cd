"""DraftTree helpers, BeamTreeBuilder against a brute-force beam + rerank, and auto_speculative_params rules."""
from __future__ import annotations

import logging

import pytest
import torch

from runtime.speculative.tree import BeamTreeBuilder, DraftTree, ancestor_mask, auto_speculative_params

V = 12


def test_draft_tree_helpers():
    tree = DraftTree([7, 8, 9, 10], [-1, -1, 0, 2])
    tree.validate(vocab_size=11)
    assert tree.depths() == [0, 0, 1, 2]
    assert tree.children() == {-1: [0, 1], 0: [2], 1: [], 2: [3], 3: []}
    mask = ancestor_mask(tree)
    assert mask.shape == (5, 5)
    assert mask[4].tolist() == [True, True, False, True, True]  # node 3: root, node 0, node 2, itself
    assert mask[2].tolist() == [True, False, True, False, False]
    assert DraftTree.chain([4, 5, 6]).parents == [-1, 0, 1]


@pytest.mark.parametrize("tokens, parents", [([1, 2], [-1]), ([1, 2], [-1, 1]), ([1, 2], [0, -1]), ([1], [-2]),
                                             ([-1], [-1])])
def test_draft_tree_validate_rejects_bad_trees(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents).validate()


def test_draft_tree_validate_rejects_out_of_vocab_tokens():
    with pytest.raises(ValueError):
        DraftTree([12], [-1]).validate(vocab_size=12)


def _toy_logprobs(path: tuple[int, ...], seq: int) -> torch.Tensor:
    """A fixed 'draft model': log-probs over V depending on the whole path (distinct values, so no ties)."""
    gen = torch.Generator().manual_seed(hash((seq,) + path) % (2**31))
    return torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64) * 2, dim=-1).float()


def _run_builder(b: int, steps: int, k: int, ndt: int) -> list[DraftTree]:
    builder = BeamTreeBuilder(b, steps, k, ndt)
    nodes = builder.first(torch.stack([_toy_logprobs((), s) for s in range(b)]))
    paths = [[(int(t),) for t in nodes.tokens[s]] for s in range(b)]  # region index -> path, per sequence
    assert (nodes.parents == -1).all() and nodes.needs_forward == (steps > 1)
    beam = [list(p) for p in paths]
    for step in range(1, steps):
        assert nodes.needs_forward
        logprobs = torch.stack([torch.stack([_toy_logprobs(beam[s][r], s) for r in range(k)]) for s in range(b)])
        nodes = builder.next(logprobs)
        assert nodes.step == step and nodes.needs_forward == (step < steps - 1)
        assert nodes.region_indices == list(range(step * k, step * k + k))
        beam = [[paths[s][int(parent)] + (int(tok),) for tok, parent in zip(nodes.tokens[s], nodes.parents[s])]
                for s in range(b)]
        for s in range(b):
            paths[s].extend(beam[s])
    return builder.finalize()


def _brute_force(seq: int, steps: int, k: int, ndt: int) -> DraftTree:
    """Plain-Python beam expansion and rerank: candidates (score, flat index, path), best ndt-1 with closure."""
    cands: list[tuple[float, int, tuple[int, ...]]] = []
    lp = _toy_logprobs((), seq).double()
    level = sorted(((float(lp[t]), (t,)) for t in range(V)), key=lambda x: -x[0])[:k]
    beam = level
    cands += [(s, i, p) for i, (s, p) in enumerate(level)]
    for _ in range(1, steps):
        expanded = []
        for score, path in beam:
            lp = _toy_logprobs(path, seq).double()
            expanded += sorted(((score + float(lp[t]), path + (t,)) for t in range(V)), key=lambda x: -x[0])[:k]
        base = len(cands)
        cands += [(s, base + i, p) for i, (s, p) in enumerate(expanded)]
        beam = sorted(expanded, key=lambda x: -x[0])[:k]
    best = sorted(cands, key=lambda c: (-c[0], c[1]))[:ndt - 1]
    chosen = sorted(best, key=lambda c: c[1])
    paths = [c[2] for c in chosen]
    assert all(len(p) == 1 or p[:-1] in paths for p in paths), "top scores must already be ancestor-closed"
    return DraftTree([p[-1] for p in paths], [-1 if len(p) == 1 else paths.index(p[:-1]) for p in paths])


@pytest.mark.parametrize("steps, k, ndt", [(3, 2, 7), (4, 3, 12), (2, 4, 20), (3, 1, 4), (5, 4, 8), (1, 3, 4)])
def test_beam_tree_matches_brute_force(steps, k, ndt):
    trees = _run_builder(2, steps, k, ndt)
    for s, tree in enumerate(trees):
        tree.validate(vocab_size=V)
        assert len(tree) == ndt - 1
        want = _brute_force(s, steps, k, ndt)
        assert (tree.token_ids, tree.parents) == (want.token_ids, want.parents)


def test_beam_tree_with_topk_one_is_a_chain():
    (tree,) = _run_builder(1, 4, 1, 5)
    assert tree.parents == [-1, 0, 1, 2]


def test_beam_tree_keeps_ancestor_closure_under_nan_and_ties():
    builder = BeamTreeBuilder(1, 2, 2, 5)
    flat = torch.full((1, 4), -5.0)
    flat[0, 0], flat[0, 1] = -1.0, float("nan")  # NaN must never outrank a real score
    nodes = builder.first(flat)
    assert nodes.tokens[0].tolist()[0] == 0
    # Non-monotone scores (log-probs > 0 are not real log-probs, but they must not break closure).
    nodes = builder.next(torch.tensor([[[3.0, 3.0, 3.0, 3.0], [2.0, 2.0, 0.5, 0.5]]]))
    (tree,) = builder.finalize()
    tree.validate()
    assert 1 not in [t for t, p in zip(tree.token_ids, tree.parents) if p == -1]  # the NaN token was never drafted
    assert len(tree) == 4


def test_beam_builder_validation_and_misuse():
    with pytest.raises(ValueError):
        BeamTreeBuilder(1, 2, 2, 8)  # 7 > 2 + 4
    with pytest.raises(ValueError):
        BeamTreeBuilder(1, 0, 1, 1)
    builder = BeamTreeBuilder(1, 2, 2, 3)
    with pytest.raises(RuntimeError):
        builder.next(torch.zeros(1, 2, V))
    with pytest.raises(ValueError):
        builder.first(torch.zeros(2, V))  # wrong batch size
    builder.first(torch.zeros(1, V))
    builder.next(torch.zeros(1, 2, V))
    with pytest.raises(RuntimeError):
        builder.next(torch.zeros(1, 2, V))


# ---- auto_speculative_params ------------------------------------------------------------------------------------

def test_auto_params_defaults():
    assert auto_speculative_params("STANDALONE", "LlamaForCausalLM") == (3, 1, 4)
    assert auto_speculative_params("eagle", "LlamaForCausalLM") == (5, 4, 8)
    assert auto_speculative_params("EAGLE3", "LlamaForCausalLM") == (5, 4, 8)
    assert auto_speculative_params("EAGLE", "Qwen2ForCausalLM") == (3, 1, 4)
    assert auto_speculative_params("EAGLE", "DeepseekV3ForCausalLM") == (3, 1, 4)


def test_auto_params_all_or_none():
    with pytest.raises(ValueError, match="all three"):
        auto_speculative_params("EAGLE", "LlamaForCausalLM", num_steps=3)
    assert auto_speculative_params("EAGLE", None, 4, 2, 6) == (4, 2, 6)


def test_auto_params_topk_one_forces_chain_length(caplog):
    with caplog.at_level(logging.WARNING):
        assert auto_speculative_params("STANDALONE", None, 4, 1, 9) == (4, 1, 5)
    assert "topk == 1" in caplog.text


@pytest.mark.parametrize("args", [
    ("EAGLE", None, 0, 1, 2), ("EAGLE", None, 2, 2, 8), ("DRAFTY", None, None, None, None),
])
def test_auto_params_errors(args):
    with pytest.raises(ValueError):
        auto_speculative_params(*args)


def test_auto_params_ngram():
    assert auto_speculative_params("NGRAM") == (1, 10, 12)
    assert auto_speculative_params("NGRAM", num_draft_tokens=16, max_bfs_breadth=4) == (4, 4, 16)
    with pytest.raises(ValueError):
        auto_speculative_params("NGRAM", num_draft_tokens=0)
