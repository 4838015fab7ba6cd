"""NGRAM proposer: repeated patterns are drafted (BFS and PROB), budget and dedup hold, rollback, eviction, release."""
from __future__ import annotations

import pytest

from draft_service.ngram import NgramConfig, NgramProposer
from runtime.speculative.tree import DraftTree


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.token_ids, tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


def _assert_well_formed(tree: DraftTree, budget: int) -> None:
    tree.validate()
    assert len(tree) <= budget
    siblings = [(p, t) for t, p in zip(tree.token_ids, tree.parents)]
    assert len(siblings) == len(set(siblings)), "duplicate sibling tokens"


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_repeated_pattern_is_proposed(match_type):
    ngram = NgramProposer(NgramConfig(match_type=match_type, num_draft_tokens=6, max_trie_depth=8))
    pattern = [10, 11, 12, 13, 14, 15, 16]
    ngram.sync("s", pattern * 3 + [10, 11])
    (tree,) = ngram.propose(["s"])
    _assert_well_formed(tree, 5)
    assert (12, 13, 14, 15, 16) in _paths(tree)
    assert tree.token_ids[0] == 12 and tree.parents[0] == -1


def test_bfs_prefers_recent_and_prob_prefers_frequent():
    tokens = [1, 2, 3] * 4 + [1, 2, 4] + [1, 2]  # after (1, 2): 3 four times, 4 most recently
    bfs = NgramProposer(NgramConfig(match_type="BFS", num_draft_tokens=3, max_trie_depth=2, max_bfs_breadth=2))
    prob = NgramProposer(NgramConfig(match_type="PROB", num_draft_tokens=3, max_trie_depth=2, max_bfs_breadth=2))
    for ngram in (bfs, prob):
        ngram.sync("s", tokens)
    (bfs_tree,), (prob_tree,) = bfs.propose(["s"]), prob.propose(["s"])
    # max_trie_depth=2: the only anchor is the last token 2; its children are 3 (freq 4) and 4 (most recent).
    assert bfs_tree.token_ids[0] == 4 and set(bfs_tree.token_ids) == {3, 4}
    assert prob_tree.token_ids[0] == 3 and set(prob_tree.token_ids) == {3, 4}


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
@pytest.mark.parametrize("ndt", [1, 2, 5, 12, 40])
def test_budget_respected_and_no_duplicate_siblings(match_type, ndt):
    import random
    rng = random.Random(ndt)
    tokens = [rng.randrange(6) for _ in range(400)]  # small vocab: many anchors, many merges
    ngram = NgramProposer(NgramConfig(match_type=match_type, num_draft_tokens=ndt, max_trie_depth=6))
    ngram.sync("s", tokens)
    (tree,) = ngram.propose(["s"])
    _assert_well_formed(tree, ndt - 1)
    if ndt > 1:
        assert len(tree) == ndt - 1  # a dense trie fills the budget


def test_no_match_gives_empty_tree_not_padding():
    ngram = NgramProposer(NgramConfig(num_draft_tokens=8))
    ngram.sync("s", [1, 2, 3, 4])  # every token unique: the last token has no continuation
    assert ngram.propose(["s", "unknown"]) == [DraftTree([], []), DraftTree([], [])]


def test_incremental_sync_counts_each_ngram_once():
    whole, steps = NgramProposer(NgramConfig(max_trie_depth=4)), NgramProposer(NgramConfig(max_trie_depth=4))
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    whole.sync("s", tokens)
    for end in range(1, len(tokens) + 1, 3):
        steps.sync("s", tokens[:end])
    steps.sync("s", tokens)
    assert _trie_dump(whole._root) == _trie_dump(steps._root)


def test_rollback_via_shorter_sync_then_new_tokens():
    ngram = NgramProposer(NgramConfig(num_draft_tokens=4, max_trie_depth=4))
    ngram.sync("s", [7, 8, 9, 7, 8, 9, 7])
    ngram.sync("s", [7, 8, 9, 7, 8])  # rollback: shorter list
    (tree,) = ngram.propose(["s"])
    assert tree.token_ids[:1] == [9]  # drafted from the rolled-back tail (…, 7, 8)
    ngram.sync("s", [7, 8, 9, 7, 8, 5, 6])  # diverging continuation after the rollback
    (tree,) = ngram.propose(["s"])
    _assert_well_formed(tree, 3)
    assert ngram._seqs["s"] == [7, 8, 9, 7, 8, 5, 6]


def test_capacity_eviction_keeps_trie_bounded_and_prefers_recent():
    cfg = NgramConfig(capacity=40, max_trie_depth=4, num_draft_tokens=4)
    ngram = NgramProposer(cfg)
    ngram.sync("old", [100, 101, 102, 103] * 3)
    for i in range(30):
        ngram.sync(f"s{i}", [i, i + 1000, i + 2000, i])
        assert ngram.num_nodes <= cfg.capacity
    ngram.sync("new", [500, 501, 502, 500])
    assert ngram.num_nodes <= cfg.capacity
    (tree,) = ngram.propose(["new"])
    assert tree.token_ids[:1] == [501]  # the freshest pattern survives eviction
    assert 100 not in ngram._root.children  # the oldest was evicted
    _check_tree_links(ngram._root)
    assert len(_trie_dump(ngram._root)) == ngram.num_nodes


@pytest.mark.parametrize("slack", [0, 16384])
def test_eviction_always_takes_the_least_recently_used_node(slack):
    """Random streams over a small vocabulary against a small pool: every eviction removes the node with the oldest
    touch of the whole trie (a leaf), with the recency log compacted often (slack 0) or never."""
    import random

    cfg = NgramConfig(capacity=60, max_trie_depth=5, num_draft_tokens=6)
    ngram = NgramProposer(cfg)
    ngram._log_slack = slack
    evict, evicted = ngram._evict_oldest_leaf, []

    def checked():
        nodes = _all_nodes(ngram._root)
        oldest = min(nodes, key=lambda n: n.last_used)
        evict()
        assert oldest.token not in oldest.parent.children or oldest.parent.children[oldest.token] is not oldest
        evicted.append(oldest)

    ngram._evict_oldest_leaf = checked
    rng = random.Random(3)
    seqs = {f"s{i}": [] for i in range(4)}
    for _ in range(300):
        seq_id = rng.choice(list(seqs))
        tokens = seqs[seq_id]
        if tokens and rng.random() < 0.1:
            del tokens[rng.randrange(len(tokens)):]  # a rollback
        tokens += [rng.randrange(12) for _ in range(rng.randint(1, 4))]
        ngram.sync(seq_id, tokens)
        assert ngram.num_nodes == len(_all_nodes(ngram._root)) <= cfg.capacity
        _check_tree_links(ngram._root)
        for node in _all_nodes(ngram._root):
            assert all(child.last_used < node.last_used for child in node.children.values())
        ngram.propose(list(seqs))
    assert len(evicted) > 100
    if slack == 0:
        assert len(ngram._log_nodes) <= 3 * ngram.num_nodes


def _all_nodes(root) -> list:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def test_release_forgets_the_sequence_but_keeps_the_trie():
    ngram = NgramProposer(NgramConfig(num_draft_tokens=4))
    ngram.sync("a", [1, 2, 3, 1, 2])
    size = ngram.num_nodes
    ngram.release("a")
    ngram.release("a")  # idempotent
    assert ngram.propose(["a"]) == [DraftTree([], [])]
    ngram.sync("b", [9, 1, 2])
    (tree,) = ngram.propose(["b"])
    assert tree.token_ids[:1] == [3] and ngram.num_nodes >= size


def test_config_validation():
    for bad in (dict(min_bfs_breadth=0), dict(min_bfs_breadth=5, max_bfs_breadth=4), dict(match_type="DFS"),
                dict(max_trie_depth=1), dict(capacity=3, max_trie_depth=4), dict(num_draft_tokens=0)):
        with pytest.raises(ValueError):
            NgramConfig(**bad)


def _trie_dump(node, prefix=()) -> dict:
    out = {}
    for token, child in node.children.items():
        out[prefix + (token,)] = child.freq
        out.update(_trie_dump(child, prefix + (token,)))
    return out


def _check_tree_links(node) -> None:
    for token, child in node.children.items():
        assert child.parent is node and child.token == token
        _check_tree_links(child)


def test_ngram_trees_are_padded_to_the_verify_width_and_stay_lossless():
    """Non-empty NGRAM trees hold exactly num_draft_tokens - 1 nodes (token-0 pads on the root, SGLang's fillResult),
    so the target verifies them with the CUDA graph of that width; empty trees stay empty; greedy and sampled
    verification of a padded tree equal those of the unpadded one (pads are never preferred over a real sibling,
    and the sampler skips repeated sibling tokens)."""
    import torch

    from draft_service.ngram import NgramConfig
    from draft_service.ngram_draft import NgramDraft, pad_tree
    from draft_service.proposer import ProposeInput, SpecShape
    from runtime.speculative.tree import DraftTree
    from runtime.speculative.verify import verify_greedy, verify_tree_sampling

    draft = NgramDraft(NgramConfig(num_draft_tokens=8))
    tokens = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    draft.prefill("s", tokens)
    (out,) = draft.propose([ProposeInput("s", len(tokens), [], SpecShape(1, 1, 8))])
    assert len(out.tree) == 7
    draft.prefill("t", [1, 2, 3])
    (empty,) = draft.propose([ProposeInput("t", 3, [], SpecShape(1, 1, 8))])
    assert empty.tree.token_ids == []

    gen = torch.Generator().manual_seed(0)
    real = DraftTree([3, 5, 2], [-1, 0, -1])
    padded = pad_tree(real, 8)
    assert padded.token_ids == [3, 5, 2, 0, 0, 0, 0] and padded.parents == [-1, 0, -1, -1, -1, -1, -1]
    for _ in range(50):
        argmax = torch.randint(0, 4, (len(padded) + 1,), generator=gen)
        want = verify_greedy(real, argmax[: len(real) + 1])
        got = verify_greedy(padded, argmax)
        if any(node >= len(real) for node in got.accepted_nodes):  # a pad matched: the target's own token was 0
            assert want.tokens == [0] and got.tokens[0] == 0
        else:
            assert got.tokens == want.tokens
    # Sampling: the first emitted token of the padded tree follows the target's root row exactly.
    from scipy.stats import chisquare

    probs = torch.softmax(torch.randn(len(padded) + 1, 6, generator=gen), dim=-1).double()
    counts = torch.zeros(6)
    for seed in range(3000):
        out = verify_tree_sampling(padded, probs, torch.Generator().manual_seed(seed))
        counts[out.tokens[0]] += 1
    expected = (probs[0] / probs[0].sum() * counts.sum()).numpy()
    assert chisquare(counts.double().numpy(), expected * counts.sum().item() / expected.sum()).pvalue > 1e-3
