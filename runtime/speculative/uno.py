"""UNO's draft shapes (sglang_spec.md §7.4): from the clean root and the logits of the LoRA rows of one draft pass,
the chain of linear mode or the best-first tree of tree mode, as a DraftTree whose node 0 is the clean root.

Row i of `draft_logits` (F - 1, V) predicts the token i + 1 places after the clean root, from noise inputs: the rows
are independent guesses per depth, so a path's score is the sum of its tokens' log-probabilities. Knows nothing about
models, KV or the wire; the target engine runs the draft pass (target_service/engine.py `self_draft`).
"""
from __future__ import annotations

import heapq

import torch

from core.types import ROOT, DraftTree, SamplingParams
from runtime.sampling import process_logits


def draft_chain(root_token_id: int, draft_logits: torch.Tensor, sampling: SamplingParams | None,
                generator: torch.Generator | None = None) -> DraftTree:
    """Linear mode: [clean root, d_1 .. d_{F-1}]. Greedy: each row's argmax. Sampled: each d_i drawn from q_i, the
    row's distribution under the request's temperature / top-k / top-p, and the q_i travel with the chain
    so the target can run exact p/q rejection. Row 0 of draft_probs is one-hot at the clean root: a target that
    verifies from the clean root emits it untested; one that does not (it lost the draft pass's KV) tests it like
    any node, which is exact for a token fixed before the target's coins are drawn."""
    if draft_logits.shape[0] == 0:
        return DraftTree.chain([root_token_id])
    if sampling is None or sampling.is_greedy:
        return greedy_chains([root_token_id], [draft_logits])[0]
    q = process_logits(draft_logits.float(), sampling)  # (F - 1, V)
    drafts = torch.multinomial(q, 1, generator=generator).squeeze(-1).tolist()
    root = torch.zeros_like(q[:1])
    root[0, root_token_id] = 1.0
    probs = torch.cat([root, q])  # (F, V)
    tree = DraftTree.chain([root_token_id, *drafts])
    tree.draft_probs = probs
    return tree


def greedy_chains(roots: list[int], draft_logits: list[torch.Tensor]) -> list[DraftTree]:
    """Linear mode for greedy sequences, batched: [clean root, argmax of each row] per sequence, one argmax and one
    readback for all of them (`draft_chain` per sequence would read back once each)."""
    if not roots:
        return []
    lengths = [rows.shape[0] for rows in draft_logits]
    flat = torch.cat(draft_logits).argmax(dim=-1).tolist() if sum(lengths) else []
    chains, start = [], 0
    for root, n in zip(roots, lengths):
        chains.append(DraftTree.chain([root, *flat[start:start + n]]))
        start += n
    return chains


def draft_trees(roots: list[int], draft_logits: list[torch.Tensor], topk: int, num_nodes: int,
                temperatures: list[float]) -> list[DraftTree]:
    """Tree mode for a batch of sequences of one shape: each row's top-`topk` K log-probabilities (temperature-scaled,
    normalised over the full vocabulary) for all sequences in one top-k and one readback, then each sequence's
    best-first tree (`draft_tree`)."""
    if not roots:
        return []
    lengths = [rows.shape[0] for rows in draft_logits]
    if not sum(lengths):
        return [DraftTree.chain([root]) for root in roots]
    scales = torch.cat([torch.full((n, 1), t if t > 0 else 1.0) for n, t in zip(lengths, temperatures)])
    rows = torch.cat(draft_logits).float()
    logprobs = torch.log_softmax(rows / scales.to(rows.device), dim=-1)  # (sum F - 1, V)
    k = min(topk, logprobs.shape[-1])
    top_lp, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    trees, start = [], 0
    for root, n in zip(roots, lengths):
        trees.append(_best_first(root, top_lp[start:start + n], top_ids[start:start + n], num_nodes))
        start += n
    return trees


def draft_tree(root_token_id: int, draft_logits: torch.Tensor, topk: int, num_nodes: int,
               temperature: float = 1.0) -> DraftTree:
    """Tree mode: a fixed-size tree of `num_nodes` Q nodes (the clean root included) chosen best-first over summed
    log-probabilities. Node at depth d (d >= 1 below the root) picks one of the top-`topk` K tokens of LoRA row d - 1,
    whose log-probabilities are temperature-scaled and normalised over the full vocabulary. Ties break as SGLang's
    builder does: shallower depth, lower rank, lower token id, lower parent. Nodes come out in selection order, so
    parents precede children and siblings are listed best first."""
    return draft_trees([root_token_id], [draft_logits], topk, num_nodes, [temperature])[0]


def _best_first(root_token_id: int, top_lp: list[list[float]], top_ids: list[list[int]], num_nodes: int
                ) -> DraftTree:
    """The best-first tree over per-depth top-K lists (row d: the candidates at depth d + 1, best first)."""
    depth_max, k = len(top_lp), len(top_lp[0]) if top_lp else 0
    tokens, parents, depths, masses = [root_token_id], [ROOT], [0], [0.0]
    frontier: list[tuple[float, int, int, int, int]] = []  # (-mass, child depth, rank, token, parent node)

    def expand(node: int) -> None:
        depth = depths[node]
        if depth >= depth_max:
            return
        for rank in range(k):
            mass = masses[node] + top_lp[depth][rank]
            heapq.heappush(frontier, (-mass, depth + 1, rank, top_ids[depth][rank], node))

    expand(0)
    while len(tokens) < num_nodes and frontier:
        neg_mass, depth, _, token, parent = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        masses.append(-neg_mass)
        expand(len(tokens) - 1)
    return DraftTree(tokens, parents)
