"""What the target does with the logits rows of one sequence: penalties, sampling of a plain decode row, acceptance of
a draft tree (greedy walk, tree sampling — exact, or lossy under accept thresholds < 1 —, or chain p/q rejection
sampling when the draft sent the distributions it sampled from), and the log-probabilities it reports. Every path applies the same
processing (runtime.sampling), so a verify step can never drift from plain decoding. Knows nothing about batching, KV
or the wire; target_service.engine.TargetEngine owns the sequences these functions read (the verify step of the
runtime: the servicers only convert).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.types import DraftTree, SamplingParams, StopRule
from runtime.sampling import make_generator, penalize_logits, process_logits
from runtime.speculative.verify import (EXACT, AcceptThresholds, VerifyOutcome, verify_chain_rejection, verify_greedy,
                                        verify_tree_sampling)


@dataclass
class TargetSeq:
    token_ids: list[int]  # committed tokens; KV holds all but the last
    sampling: SamplingParams
    stop: StopRule
    generator: torch.Generator | None


class GreedyRows(list):
    """The argmax token of each logits row (read back from the device), and the device's greedy tree walk when a CUDA
    graph verified the tree: (accepted region nodes, root 0 first; emitted tokens)."""

    walk: tuple[list[int], list[int]] | None = None


def new_generator(sampling: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The sequence's private generator (seeded when asked); None for greedy sequences."""
    return None if sampling.is_greedy else make_generator(sampling, device)


def penalized(rows: torch.Tensor, seq: TargetSeq, tree: DraftTree | None = None) -> torch.Tensor:
    """Logits rows (R, V) with the sequence's penalties / logit bias applied, as plain decoding would see them: row 0
    follows the committed tokens, row i + 1 also the tree path ending at draft node i (its drafts count as
    generated)."""
    if not seq.sampling.has_penalties:
        return rows
    row_tokens = None
    if tree is not None and tree.token_ids:
        paths: list[list[int]] = []
        for token, parent in zip(tree.token_ids, tree.parents):
            paths.append([*(paths[parent] if parent >= 0 else ()), token])
        row_tokens = [[], *paths]
    n = seq.stop.prompt_len
    return penalize_logits(rows, seq.sampling, seq.token_ids[:n], seq.token_ids[n:], row_tokens)


def sample_rows(rows: torch.Tensor | list[int], seq: TargetSeq) -> list[int]:
    """One token per logits row with exactly the processing used in verification (rows: logits, or the argmax tokens
    already taken on the device)."""
    if isinstance(rows, list):
        return rows
    rows = penalized(rows, seq)
    if seq.sampling.is_greedy:
        return rows.argmax(dim=-1).tolist()
    probs = process_logits(rows.float(), seq.sampling)  # (rows, vocab)
    return torch.multinomial(probs, 1, generator=seq.generator).squeeze(-1).tolist()


def accept(tree: DraftTree, rows: torch.Tensor | list[int], seq: TargetSeq,
           thresholds: AcceptThresholds = EXACT) -> VerifyOutcome:
    """rows: (num_nodes + 1, vocab) logits or the (num_nodes + 1) argmax tokens; row 0 predicts the token after the
    root, row i+1 the token after draft node i. A sampled sequence whose tree carries draft_probs (a chain sampled by
    the draft, --speculative-use-rejection-sampling) is verified by p/q rejection; other sampled trees by tree
    sampling under `thresholds`. Greedy sequences ignore both (the argmax walk)."""
    if isinstance(rows, GreedyRows) and rows.walk is not None:  # walked on the device, in the graph
        path, tokens = rows.walk
        return VerifyOutcome([node - 1 for node in path[1:]], tokens, len(path) - 1)
    if isinstance(rows, list):  # greedy batch: the walk over the argmax the device already took (no sync)
        return verify_greedy(tree, rows)
    rows = penalized(rows, seq, tree)
    if seq.sampling.is_greedy:
        return verify_greedy(tree, rows.argmax(dim=-1))
    probs = process_logits(rows.float(), seq.sampling)  # (num_nodes + 1, vocab): the target distribution p
    if tree.draft_probs is not None and len(tree):
        return verify_chain_rejection(tree, probs, tree.draft_probs, seq.generator)
    return verify_tree_sampling(tree, probs, seq.generator, thresholds)


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[int], list[float]]]:
    """(logprob of tokens[j] under row j, top-`top` ids, their logprobs) per row: log-softmax of the raw logits."""
    if not tokens:
        return []
    lp = torch.log_softmax(rows[: len(tokens)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    if top > 0:
        values, ids = lp.topk(top, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    else:
        values, ids = [[] for _ in tokens], [[] for _ in tokens]
    return [(c, i, v) for c, i, v in zip(chosen, ids, values)]
