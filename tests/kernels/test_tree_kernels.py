"""tandem_kernels/tree.py against the torch paths it replaces inside the CUDA graphs: `region_mask` vs
verify_step.ancestor_mask (random forests, chains, padding parents), `select_tree` vs draft_step.select_tree_device
(beam trees from BeamTreeBuilder, exact ties, -inf and NaN candidates, a budget past the candidates) and the host
frontier selection."""

from __future__ import annotations

import math
import random

import pytest
import torch

from runtime.speculative.draft_step import select_tree_device
from runtime.speculative.tree import BeamTreeBuilder
from runtime.speculative.verify_step import ancestor_mask
from tandem_kernels import tree as tree_kernels
from tandem_kernels.tree import region_mask, select_tree
from tests.kernels.paged import random_parents


@pytest.mark.parametrize("width", [1, 2, 7, 16, 61])
def test_region_mask_matches_pointer_jumping(width, device):
    rng = random.Random(width)
    rows = [random_parents(width, rng) for _ in range(5)]
    rows.append([-1] + list(range(width - 1)))  # a chain: the deepest tree of this width
    rows.append([-1] * width)  # all roots
    parents = torch.tensor(rows, dtype=torch.int64, device=device)
    mask, depth = region_mask(parents)
    want = ancestor_mask(parents.cpu())
    assert mask.dtype == torch.uint8 and torch.equal(mask.cpu(), want)
    assert torch.equal(depth.cpu(), want.sum(dim=-1).long() - 1)
    assert depth[-2, -1] == width - 1


def _beam_candidates(b: int, steps: int, k: int, vocab: int, seed: int, ties: bool):
    gen = torch.Generator().manual_seed(seed)
    builder = BeamTreeBuilder(b, steps, k, num_draft_tokens=steps * k + 1)
    logits = torch.randn(b, vocab, generator=gen)
    if ties:  # exact ties and zero-probability tokens
        logits = torch.randint(0, 3, (b, vocab), generator=gen).float()
        logits[:, -1] = -math.inf
    builder.first(torch.log_softmax(logits, dim=-1))
    for _ in range(1, steps):
        child = torch.randn(b, k, vocab, generator=gen)
        if ties:
            child = torch.randint(0, 2, (b, k, vocab), generator=gen).float()
            child[..., :2] = -math.inf
            child[:, 0, 3:] = -math.inf  # beam 0 has one finite child: its other k - 1 are -inf
        builder.next(torch.log_softmax(child, dim=-1))
    return builder.candidates()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [1, 5, 15, 40])
def test_select_tree_matches_the_torch_selection(seed, budget, device):
    scores, tokens, parents = _beam_candidates(3, 4, 3 if seed % 2 else 4, 9, seed, ties=seed % 3 == 0)
    if seed == 5:  # NaN scores (a NaN draft row) are left out with their subtrees
        scores = scores.clone()
        scores[1, 2] = math.nan
        scores[1, parents[1] == 2] = math.nan
    want = select_tree_device(scores, tokens, parents, budget)
    got = select_tree(scores.to(device), tokens.to(device), parents.to(device), budget)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)
    finite = torch.isfinite(scores).sum(dim=-1)
    assert torch.equal(want[2], finite.clamp(max=budget))  # every finite candidate is selectable
    if seed in (0, 3, 5, 6):
        assert (finite < scores.shape[1]).any()  # and some were left out


def test_select_tree_root_children_keep_the_root_when_candidates_are_left_out(device):
    # candidate 1 is NaN: the device selection must still give the root's other children parent -1
    scores = torch.tensor([[-0.1, math.nan, -0.5, -0.2, -math.inf]])
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    parents = torch.tensor([[-1, -1, -1, 0, 0]])
    want_tokens, want_parents = [10, 12, 13], [-1, -1, 0]
    for fn, dev in ((select_tree_device, "cpu"), (select_tree, device)):
        t, p, c = fn(scores.to(dev), tokens.to(dev), parents.to(dev), 4)
        assert t.cpu().tolist() == [want_tokens + [-1]] and p.cpu().tolist() == [want_parents + [-1]]
        assert c.cpu().tolist() == [3]


def test_select_tree_bad_arguments(device):
    scores = torch.zeros(2, 4, device=device)
    ids = torch.zeros(2, 4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError):
        select_tree(scores, ids, ids, 0)
    with pytest.raises(ValueError):
        select_tree(scores, ids.int(), ids, 2)
    with pytest.raises(ValueError):
        region_mask(ids.int())


@pytest.mark.parametrize("steps,k,ties", [(4, 3, False), (5, 4, True), (1, 2, False), (3, 1, True), (2, 8, False)])
def test_device_beam_equals_the_beam_builder_and_the_step_inputs(steps, k, ties, device):
    """DeviceBeam level by level against BeamTreeBuilder.first_topk/next_topk (the same candidates and beam nodes)
    and the static draft step's torch inputs (ancestors, slots with a padding row, positions, kv lengths, ids)."""
    b, vocab, q, block_size, max_blocks = 3, 11, 4, 4, 8
    gen = torch.Generator().manual_seed(steps * 10 + k)
    inputs = torch.zeros(b, 3 * q + 2 + max_blocks, dtype=torch.int64)
    table_col = 3 * q + 2
    inputs[:, 2 * q:3 * q] = 5  # live catch-up slots
    inputs[1, 3 * q - 1] = -1  # a padding row
    inputs[:, 3 * q + 1] = torch.tensor([3, 9, 0])  # kv_after
    inputs[:, table_col:] = torch.stack([torch.randperm(40, generator=gen)[:max_blocks] for _ in range(b)])
    mapping = torch.randperm(1000, generator=gen)[:vocab]
    builder = BeamTreeBuilder(b, steps, k, num_draft_tokens=2)
    beam = tree_kernels.DeviceBeam(b, steps, k, inputs.to(device), live_col=3 * q - 1, kv_col=3 * q + 1,
                                   table_col=table_col, block_size=block_size, draft_to_target=mapping.to(device))
    ancestors = torch.zeros(b, k, steps * k, dtype=torch.uint8)
    kv_after = inputs[:, 3 * q + 1]
    for level in range(steps):
        rows = b if level == 0 else b * k
        logits = torch.randn(rows, vocab, generator=gen)
        if ties:
            logits = torch.randint(0, 2, (rows, vocab), generator=gen).float()
            logits[0, 1:] = -math.inf  # one finite child: the others are -inf
        values, indices = _stable_order(torch.log_softmax(logits, dim=-1), k)
        if level == 0:
            nodes = builder.first_topk(values, indices)
        else:
            nodes = builder.next_topk(values.view(b, k, k), indices.view(b, k, k))
        ids, ranks, slots, positions = (t.cpu() for t in beam.expand(values.to(device), indices.to(device)))
        if level < steps - 1:  # a forward follows: its inputs
            want_ranks = nodes.parents - (level - 1) * k if level else torch.zeros_like(nodes.parents)
            assert torch.equal(ranks, want_ranks)
            if level:
                ancestors = ancestors.gather(1, want_ranks.unsqueeze(-1).expand(-1, -1, steps * k))
            ancestors[:, :, level * k:(level + 1) * k] |= torch.eye(k, dtype=torch.uint8)
            assert torch.equal(beam.ancestors.cpu(), ancestors)
            assert torch.equal(ids, mapping[nodes.tokens])
            region = kv_after.unsqueeze(1) + level * k + torch.arange(k)
            want_slots = inputs[:, table_col:].gather(1, region // block_size) * block_size + region % block_size
            want_slots[1] = -1
            assert torch.equal(slots, want_slots)
            assert torch.equal(positions, (kv_after + level).unsqueeze(1).expand(b, k))
            assert torch.equal(beam.kv_lens.cpu(), (kv_after + (level + 1) * k).int())
    for got, want in zip(beam.candidates(), builder.candidates()):
        assert torch.equal(got.cpu(), want)


def _stable_order(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.sort(logprobs, dim=-1, descending=True, stable=True)  # the topk kernel's order: ties to low index
    return order.values[:, :k].contiguous(), order.indices[:, :k].contiguous()
