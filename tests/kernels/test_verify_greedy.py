"""verify_tree_greedy (Triton) against its reference and against runtime.speculative.verify.verify_greedy."""

from __future__ import annotations

import random

import pytest
import torch

from tandem_kernels.verify_greedy import verify_tree_greedy, verify_tree_greedy_packed, verify_tree_greedy_ref
from runtime.speculative.tree import DraftTree
from runtime.speculative.verify import verify_greedy


def _random_batch(num_seqs: int, num_nodes: int, vocab: int, seed: int):
    """Root-inclusive (B, n+1) candidates/parents/targets; targets often follow a draft child so paths get long.
    Some sequences have fewer nodes (padding parents = -1)."""
    rng = random.Random(seed)
    cand = [[0] * num_nodes for _ in range(num_seqs)]
    par = [[-1] * num_nodes for _ in range(num_seqs)]
    pred = [[0] * num_nodes for _ in range(num_seqs)]
    trees = []
    for b in range(num_seqs):
        used = num_nodes if b % 3 else rng.randrange(1, num_nodes + 1)
        for m in range(1, used):
            par[b][m] = rng.randrange(0, m)
            cand[b][m] = rng.randrange(vocab)
        for m in range(num_nodes):
            children = [c for c in range(1, used) if par[b][c] == m]
            pred[b][m] = cand[b][rng.choice(children)] if children and rng.random() < 0.8 else rng.randrange(vocab)
        trees.append(DraftTree([cand[b][m] for m in range(1, used)], [par[b][m] - 1 for m in range(1, used)]))
    return torch.tensor(cand), torch.tensor(par, dtype=torch.int32), torch.tensor(pred), trees


@pytest.mark.parametrize("num_seqs,num_nodes,vocab", [(1, 1, 5), (4, 2, 3), (7, 9, 4), (5, 17, 3), (3, 33, 6)])
def test_verify_greedy_matches_ref_and_runtime_verify(num_seqs, num_nodes, vocab, device):
    cand, par, pred, trees = _random_batch(num_seqs, num_nodes, vocab, seed=num_nodes)
    got = verify_tree_greedy(cand.to(device), par.to(device), pred.to(device))
    want = verify_tree_greedy_ref(cand, par, pred)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, atol=0, rtol=0)
    accept_index, emitted, accept_lens = (t.cpu() for t in got)
    for b, tree in enumerate(trees):
        outcome = verify_greedy(tree, pred[b, :len(tree) + 1])
        n = int(accept_lens[b])
        assert n == outcome.accept_length
        assert emitted[b, :n].tolist() == outcome.tokens
        assert accept_index[b, 1:n].tolist() == [i + 1 for i in outcome.accepted_nodes]
        assert (emitted[b, n:] == -1).all() and (accept_index[b, n:] == -1).all()


def test_duplicate_sibling_tokens_take_the_lowest_index(device):
    # Root has children 1 and 2, both token 7; only node 2 has a matching grandchild. Lowest index wins (SGLang).
    cand = torch.tensor([[0, 7, 7, 9]], device=device)
    par = torch.tensor([[-1, 0, 0, 2]], device=device)
    pred = torch.tensor([[7, 9, 9, 4]], device=device)
    accept_index, emitted, accept_lens = verify_tree_greedy(cand, par, pred)
    assert accept_index.tolist() == [[0, 1, -1, -1]]
    assert emitted.tolist() == [[7, 9, -1, -1]]
    assert accept_lens.tolist() == [2]


def test_verify_greedy_asserts_shapes(device):
    t = torch.zeros(2, 4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="parents shape"):
        verify_tree_greedy(t, t[:, :3].contiguous(), t)
    with pytest.raises(ValueError, match="int32/int64"):
        verify_tree_greedy(t, t, t.float())


@pytest.mark.parametrize("num_seqs,num_nodes", [(1, 1), (4, 2), (7, 9), (3, 17)])
def test_packed_walk_equals_the_walk_and_the_torch_epilogue(num_seqs, num_nodes, device):
    """The static verify step's launch (walk + epilogue) writes the head row the torch epilogue concatenates and the
    compaction moves / feature rows it computes, reading row-strided inputs (views of the packed input rows)."""
    cand, par, pred, _ = _random_batch(num_seqs, num_nodes, 4, seed=num_nodes + 100)
    packed = torch.zeros(num_seqs, 5 * num_nodes, dtype=torch.int64)  # [cand, par, slots, pred, spare] per row
    packed[:, :num_nodes], packed[:, num_nodes:2 * num_nodes] = cand, par.long()
    packed[:, 2 * num_nodes:3 * num_nodes] = torch.randperm(num_seqs * num_nodes * 2)[:num_seqs * num_nodes].view(
        num_seqs, num_nodes)
    packed = packed.to(device)
    views = [packed[:, i * num_nodes:(i + 1) * num_nodes] for i in range(3)]
    head = torch.full((num_seqs, 2 * num_nodes + 1), 77, dtype=torch.int64, device=device)
    src, dst, rows = verify_tree_greedy_packed(views[0], views[1], pred.to(device), views[2], head)
    accept_index, emitted, lens = (t.long() for t in verify_tree_greedy_ref(cand, par, pred))
    assert torch.equal(head.cpu(), torch.cat([emitted, accept_index, lens.unsqueeze(1)], dim=1))
    slots = views[2].cpu()
    j = torch.arange(num_nodes).expand(num_seqs, num_nodes)
    moves = (j >= 1) & (j < lens.unsqueeze(1)) & (accept_index != j)
    want_src = torch.where(moves, slots.gather(1, accept_index.clamp(min=0)), torch.full_like(slots, -1))
    assert torch.equal(src.cpu(), want_src) and torch.equal(dst.cpu(), slots)
    assert torch.equal(rows.cpu(), torch.arange(num_seqs).unsqueeze(1) * num_nodes + accept_index.clamp(min=0))
