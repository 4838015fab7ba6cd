"""Greedy tree verification cases and a χ² proof that target-only tree sampling reproduces the target distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from runtime.sampling import SamplingParams, process_logits
from runtime.speculative.tree import DraftTree
from runtime.speculative.verify import verify_batch, verify_greedy, verify_tree_sampling

V = 8


# ---- greedy ---------------------------------------------------------------------------------------------------

def test_greedy_chain_full_accept_emits_bonus():
    tree = DraftTree.chain([5, 6, 7])
    out = verify_greedy(tree, torch.tensor([5, 6, 7, 2]))
    assert out.accepted_nodes == [0, 1, 2] and out.tokens == [5, 6, 7, 2] and out.num_accepted_drafts == 3


def test_greedy_chain_zero_accept_emits_target_token():
    out = verify_greedy(DraftTree.chain([5, 6]), torch.tensor([4, 6, 1]))
    assert out.accepted_nodes == [] and out.tokens == [4] and out.num_accepted_drafts == 0


def test_greedy_chain_partial_accept_bonus_from_last_accepted_row():
    out = verify_greedy(DraftTree.chain([5, 6, 7]), torch.tensor([5, 3, 7, 1]))
    assert out.tokens == [5, 3] and out.accepted_nodes == [0]


def test_greedy_tree_takes_matching_branch():
    # root -> {0:a=1, 1:b=2}; 1 -> {2:c=3, 3:d=4}; 3 -> {4:e=5}
    tree = DraftTree([1, 2, 3, 4, 5], [-1, -1, 1, 1, 3])
    argmax = torch.tensor([2, 0, 4, 0, 5, 6])  # rows: root, n0, n1, n2, n3, n4
    out = verify_greedy(tree, argmax)
    assert out.accepted_nodes == [1, 3, 4] and out.tokens == [2, 4, 5, 6]


def test_greedy_duplicate_siblings_first_in_node_order_wins():
    tree = DraftTree([3, 3], [-1, -1])
    out = verify_greedy(tree, [3, 1, 2])
    assert out.accepted_nodes == [0] and out.tokens == [3, 1]


def test_greedy_empty_tree_is_plain_decode():
    assert verify_greedy(DraftTree([], []), torch.tensor([9])).tokens == [9]


def test_greedy_rejects_wrong_row_count():
    with pytest.raises(ValueError):
        verify_greedy(DraftTree.chain([1]), torch.tensor([1]))


def test_sampling_with_one_hot_targets_equals_greedy():
    tree = DraftTree([1, 2, 3, 4, 5], [-1, -1, 1, 1, 3])
    argmax = torch.tensor([2, 0, 4, 0, 5, 6])
    probs = torch.nn.functional.one_hot(argmax, V).float()
    out = verify_tree_sampling(tree, probs, torch.Generator().manual_seed(0))
    assert out == verify_greedy(tree, argmax)


def test_verify_batch_mixes_greedy_and_sampling():
    tree = DraftTree.chain([1])
    rows = torch.nn.functional.one_hot(torch.tensor([1, 2]), V).float()
    outs = verify_batch([tree, tree], [rows, rows], [True, False], [None, torch.Generator().manual_seed(0)])
    assert [o.tokens for o in outs] == [[1, 2], [1, 2]]


# ---- sampling: χ² ----------------------------------------------------------------------------------------------

PROCESSINGS = {
    "temp0.7": SamplingParams(temperature=0.7),
    "topk3": SamplingParams(top_k=3),
    "topp0.8": SamplingParams(temperature=0.9, top_p=0.8),
}
# Structures; tokens are filled from each parent's target row so that drafts carry real mass (and some none).
# rank r = the r-th most likely token of the parent's row.
TREES = {
    "chain": ([-1, 0, 1], [1, 0, 0]),
    "wide": ([-1, -1, -1, -1, 0, 0, 1], [0, 2, 1, 6, 0, 1, 0]),
    "dup": ([-1, -1, -1, 0, 0], [0, 0, 1, 0, 0]),  # nodes 0 and 1 share a token: a duplicate sibling
}
NUM_TRIALS = 8_000


def _make_case(structure: str, processing: str, seed: int = 0) -> tuple[DraftTree, torch.Tensor]:
    parents, ranks = TREES[structure]
    logits = torch.randn(len(parents) + 1, V, generator=torch.Generator().manual_seed(seed)) * 1.5
    tokens: list[int] = []
    for i, (parent, rank) in enumerate(zip(parents, ranks)):
        order = logits[parent + 1].argsort(descending=True).tolist()
        tokens.append(order[rank])
        if structure == "dup" and i == 1:
            logits[2] = logits[1]  # the same token after the same context has the same next-token distribution
    return DraftTree(tokens, parents), process_logits(logits, PROCESSINGS[processing])


def _run(verify, tree, probs, num_trials=NUM_TRIALS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [verify(tree, probs, gen).tokens for _ in range(num_trials)]


def _chi2_pvalue(samples: list[int], expected: torch.Tensor) -> float:
    counts = np.bincount(np.asarray(samples, dtype=np.int64), minlength=V).astype(float)
    p = expected.double().numpy()
    p = p / p.sum()
    assert counts[p == 0].sum() == 0, "sampled a token the target gives no mass"
    exp = p * len(samples)
    small = (exp < 5) & (p > 0)  # merge thin bins so the χ² approximation holds
    obs_bins = list(counts[(p > 0) & ~small]) + ([counts[small].sum()] if small.any() else [])
    exp_bins = list(exp[(p > 0) & ~small]) + ([exp[small].sum()] if small.any() else [])
    if len(obs_bins) < 2:
        return 1.0
    return float(chisquare(obs_bins, exp_bins).pvalue)


@pytest.mark.parametrize("processing", list(PROCESSINGS))
@pytest.mark.parametrize("structure", list(TREES))
def test_tree_sampling_is_exact(structure, processing):
    tree, probs = _make_case(structure, processing)
    runs = _run(verify_tree_sampling, tree, probs)
    assert _chi2_pvalue([r[0] for r in runs], probs[0]) > 1e-3
    # Second token given the first: a first token equal to a root child's token is always that child accepted
    # (first occurrence; its duplicates are skipped), so the next token follows that child's row.
    first_nodes: dict[int, int] = {}
    for node, (parent, token) in enumerate(zip(tree.parents, tree.token_ids)):
        if parent == -1:
            first_nodes.setdefault(token, node)
    tested = 0
    for token, node in first_nodes.items():
        seconds = [r[1] for r in runs if r[0] == token]
        assert all(len(r) >= 2 for r in runs if r[0] == token)
        if len(seconds) >= 300:
            assert _chi2_pvalue(seconds, probs[node + 1]) > 1e-3
            tested += 1
    assert tested >= 1


def test_tree_sampling_is_reproducible_with_a_seeded_generator():
    tree, probs = _make_case("wide", "temp0.7")
    a = [verify_tree_sampling(tree, probs, torch.Generator().manual_seed(s)).tokens for s in range(50)]
    b = [verify_tree_sampling(tree, probs, torch.Generator().manual_seed(s)).tokens for s in range(50)]
    assert a == b and len({tuple(x) for x in a}) > 1


def test_tree_sampling_never_emits_zero_mass_tokens():
    tree, probs = _make_case("wide", "topk3")  # node 3 drafts the 7th-ranked token, which top-k zeroes
    for tokens in (r for r in _run(verify_tree_sampling, tree, probs, 2000)):
        assert probs[0, tokens[0]] > 0


def _broken_verify_double_counting(tree: DraftTree, probs: torch.Tensor, gen: torch.Generator):
    """The bug the real verifier avoids: duplicate siblings each add their probability to the running mass."""
    coin = float(torch.rand(1, generator=gen))
    mass, rejected = 0.0, []
    for node, (parent, token) in enumerate(zip(tree.parents, tree.token_ids)):
        if parent != -1:
            continue
        mass += float(probs[0, token])
        if coin < mass:
            return type("Out", (), {"tokens": [token]})()
        rejected.append(token)
    row = probs[0].clone()
    row[rejected] = 0
    return type("Out", (), {"tokens": [int(torch.multinomial(row, 1, generator=gen))]})()


def test_chi2_catches_duplicate_sibling_double_counting():
    tree, probs = _make_case("dup", "temp0.7")
    runs = _run(_broken_verify_double_counting, tree, probs, 4000)
    assert _chi2_pvalue([r[0] for r in runs], probs[0]) < 1e-6
