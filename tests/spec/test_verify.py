"""Greedy tree verification cases, a χ² proof that target-only tree sampling and chain p/q rejection sampling reproduce
the target distribution, and SGLang's lossy accept thresholds (exact at 1.0, accepting more below)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from runtime.sampling import SamplingParams, process_logits
from runtime.speculative.tree import DraftTree
from runtime.speculative.verify import (AcceptThresholds, verify_batch, verify_chain_rejection, verify_greedy,
                                        verify_tree_sampling)

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


# ---- accept thresholds (SGLang §3.2, lossy below 1) -------------------------------------------------------------

@pytest.mark.parametrize("structure", list(TREES))
def test_thresholds_at_one_are_bit_identical_to_exact_tree_sampling(structure):
    tree, probs = _make_case(structure, "temp0.7")
    exact = _run(verify_tree_sampling, tree, probs, 500)
    ones = _run(lambda t, p, g: verify_tree_sampling(t, p, g, AcceptThresholds(1.0, 1.0)), tree, probs, 500)
    assert exact == ones


@pytest.mark.parametrize("thresholds", [AcceptThresholds(acc=0.3), AcceptThresholds(single=0.2),
                                        AcceptThresholds(0.5, 0.5)], ids=["acc", "single", "both"])
def test_thresholds_below_one_accept_more_drafts(thresholds):
    tree, probs = _make_case("wide", "temp0.7")
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    exact = [verify_tree_sampling(tree, probs, gen_a).num_accepted_drafts for _ in range(2000)]
    lossy = [verify_tree_sampling(tree, probs, gen_b, thresholds).num_accepted_drafts for _ in range(2000)]
    assert sum(lossy) > sum(exact) * 1.1


def test_threshold_single_accepts_a_likely_token_outright():
    probs = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5]])
    tree = DraftTree.chain([0])  # p = 0.6 at the root's row
    coins_high = [verify_tree_sampling(tree, probs, torch.Generator().manual_seed(s)) for s in range(200)]
    assert any(o.num_accepted_drafts == 0 for o in coins_high)  # exact: rejected when the coin lands past 0.6
    lossy = [verify_tree_sampling(tree, probs, torch.Generator().manual_seed(s), AcceptThresholds(single=0.6))
             for s in range(200)]
    assert all(o.num_accepted_drafts == 1 for o in lossy)


@pytest.mark.parametrize("single, acc", [(0.0, 1.0), (1.0, 0.0), (1.5, 1.0), (1.0, -0.1), (float("nan"), 1.0)])
def test_accept_thresholds_outside_zero_one_are_refused(single, acc):
    with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
        AcceptThresholds(single, acc)


# ---- chain rejection sampling (p/q, Leviathan/Chen) -------------------------------------------------------------

def _rejection_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target rows p (3, V) and draft distributions q (2, V) that differ a lot (so accepts, rejections and the
    residual all happen); q has mass where p has none and p where q has none."""
    gen = torch.Generator().manual_seed(seed)
    p = process_logits(torch.randn(3, V, generator=gen) * 1.5, SamplingParams(temperature=0.8, top_k=6))
    q = torch.softmax(torch.randn(2, V, generator=gen), dim=-1)
    q[:, int(p[0].argmax())] *= 0.1  # the draft under-proposes the target's favourite
    return p, q / q.sum(dim=-1, keepdim=True)


def _rejection_runs(p: torch.Tensor, q: torch.Tensor, num_trials: int, second_row=None) -> list[list[int]]:
    """Each trial drafts a chain x_1 ~ q_0, x_2 ~ q_1 (the draft's own stream), then verifies it with p/q rejection.
    second_row(x_1) -> p's row for position 2 given x_1 (a context-dependent target); default: p[1]."""
    draft_gen, verify_gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(1234)
    runs = []
    for _ in range(num_trials):
        x = torch.multinomial(q, 1, generator=draft_gen).squeeze(-1).tolist()
        rows = p if second_row is None else torch.stack([p[0], second_row(x[0]), p[2]])
        runs.append(verify_chain_rejection(DraftTree.chain(x), rows, q, verify_gen).tokens)
    return runs


def test_chain_rejection_sampling_is_exact():
    p, q = _rejection_case()
    # A context-dependent second row: what follows x_1 depends on x_1, as for a real target.
    second = {t: process_logits(torch.randn(V, generator=torch.Generator().manual_seed(t)).unsqueeze(0) * 1.5,
                                SamplingParams(temperature=0.9))[0] for t in range(V)}
    runs = _rejection_runs(p, q, NUM_TRIALS, lambda t: second[t])
    assert _chi2_pvalue([r[0] for r in runs], p[0]) > 1e-3
    accepted_first = [r for r in runs if len(r) >= 2]
    assert 300 < len(accepted_first) < NUM_TRIALS - 300  # both branches ran
    for token in range(V):
        seconds = [r[1] for r in accepted_first if r[0] == token]
        if len(seconds) >= 300:
            assert _chi2_pvalue(seconds, second[token]) > 1e-3


def _broken_rejection_without_residual(tree, p, q, gen):
    """The bug the real verifier avoids: resampling from p (not norm(max(p - q, 0))) after a rejection."""
    coin = float(torch.rand(1, generator=gen, dtype=torch.float64))
    x = tree.token_ids[0]
    if coin * float(q[0, x]) < float(p[0, x]):
        return [x]
    return [int(torch.multinomial(p[0], 1, generator=gen))]


def test_chi2_catches_rejection_sampling_without_the_residual():
    p, q = _rejection_case()
    draft_gen, gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(1234)
    firsts = []
    for _ in range(4000):
        x = torch.multinomial(q, 1, generator=draft_gen).squeeze(-1).tolist()
        firsts.append(_broken_rejection_without_residual(DraftTree.chain(x), p, q, gen)[0])
    assert _chi2_pvalue(firsts, p[0]) < 1e-6


def test_chain_rejection_with_q_equal_p_accepts_everything():
    p, _ = _rejection_case()
    out = verify_chain_rejection(DraftTree.chain([int(p[0].argmax()), int(p[1].argmax())]), p, p[:2].clone(),
                                 torch.Generator().manual_seed(0))
    assert out.num_accepted_drafts == 2 and len(out.tokens) == 3 and p[2, out.tokens[-1]] > 0


@pytest.mark.parametrize("case", ["tree", "shape", "zero_q"])
def test_chain_rejection_refuses_what_it_cannot_verify_exactly(case):
    p, q = _rejection_case()
    tree = DraftTree.chain([1, 2])
    if case == "tree":
        tree = DraftTree([1, 2], [-1, -1])
    elif case == "shape":
        q = q[:, :-1]
    else:
        q = q.clone()
        q[0, 1] = 0.0
    with pytest.raises(ValueError):
        verify_chain_rejection(tree, p, q, torch.Generator().manual_seed(0))
