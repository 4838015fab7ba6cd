"""Draft trees on the device side: the EAGLE/SGLang-style top-k beam tree builder, a tree's ancestor mask, and the
auto-defaults for (num_steps, topk, num_draft_tokens). The DraftTree carrier itself is core.types.DraftTree (the one
tree type of the gateway, the services and the runtime).

Knows nothing about models or KV: the builder is handed log-probabilities and says which nodes must be forwarded next.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from core import algorithms
from core.algorithms import max_tree_candidates
from core.types import ROOT, DraftTree


def ancestor_mask(tree: DraftTree, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n+1, n+1) bool, root = row/col 0 and node i = i+1: row m is True at m itself and all its ancestors."""
    n = len(tree)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, parent in enumerate(tree.parents):
        mask[i + 1] = mask[parent + 1]  # parents precede children, so the parent's row is already complete
        mask[i + 1, i + 1] = True
    return mask.to(device)


@dataclass
class StepNodes:
    """The k beam nodes of one builder step, per sequence. If needs_forward, the caller runs them through the draft
    model (attending to the prefix plus their region ancestors) and passes the log-probs to `next`."""

    step: int
    tokens: torch.Tensor  # (b, k) long
    parents: torch.Tensor  # (b, k) long: region index of each node's parent, -1 = the root (last committed token)
    needs_forward: bool

    @property
    def depth(self) -> int:
        """Depth below the root (1 for the root's children); the nodes sit at position committed_len + depth - 1."""
        return self.step + 1

    @property
    def region_indices(self) -> list[int]:
        """Region index of each of the k nodes: the node forwarded at step i, beam rank r, is i*k + r."""
        k = self.tokens.shape[1]
        return list(range(self.step * k, self.step * k + k))


@dataclass
class _Level:
    scores: torch.Tensor  # (b, c): cumulative log-prob of each candidate of this level (c = k, or k*k past level 1)
    tokens: torch.Tensor  # (b, c)
    parents: torch.Tensor  # (b, c): flat candidate index of the parent, -1 = root


# The fused log-softmax + top-k reads a row k + 1 times; past this width torch's radix select is the better kernel.
TOPK_KERNEL_MAX_VOCAB = 32768


@dataclass
class BeamTreeBuilder:
    """Top-k tree expansion, batched over b sequences (SGLang select_top_k_tokens + organize_draft_results).

    first() takes the draft's next-token log-probs after the root; each next() expands the k beam nodes into k
    children each and keeps the best k of the k*k by cumulative log-prob (the sum of log-probs ranks exactly like
    SGLang's product of probabilities). finalize() reranks every candidate and keeps num_draft_tokens - 1."""

    batch_size: int
    num_steps: int
    topk: int
    num_draft_tokens: int
    _levels: list[_Level] = field(default_factory=list, init=False, repr=False)
    _beam_flat: torch.Tensor | None = field(default=None, init=False, repr=False)  # (b, k) flat candidate index
    _beam_scores: torch.Tensor | None = field(default=None, init=False, repr=False)  # (b, k)

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_steps", "topk", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        capacity = max_tree_candidates(self.num_steps, self.topk)
        if self.num_draft_tokens - 1 > capacity:
            raise ValueError(
                f"num_draft_tokens - 1 = {self.num_draft_tokens - 1} exceeds the {capacity} candidates that "
                f"num_steps={self.num_steps}, topk={self.topk} produce (topk + (num_steps - 1) * topk^2)"
            )

    @property
    def num_candidates(self) -> int:
        return sum(level.tokens.shape[1] for level in self._levels)

    def first(self, logprobs: torch.Tensor) -> StepNodes:
        """logprobs (b, V) after the root -> the k level-1 nodes (step 0)."""
        self._check_shape(logprobs, (self.batch_size, None))
        return self.first_topk(*_safe(logprobs).topk(self.topk, dim=-1))  # a full-vocab sort would be slow

    def first_topk(self, scores: torch.Tensor, tokens: torch.Tensor) -> StepNodes:
        """first() from the root's k best (log-prob, token) pairs, (b, k) each, best first (the draft step computes
        them in one kernel: tandem_kernels/topk.py)."""
        if self._levels:
            raise RuntimeError("first() was already called on this builder")
        self._check_shape(scores, (self.batch_size, self.topk))
        parents = torch.full_like(tokens, -1)
        self._levels.append(_Level(scores, tokens, parents))
        self._beam_flat = torch.arange(self.topk, device=tokens.device).expand(self.batch_size, -1)
        self._beam_scores = scores
        return StepNodes(0, tokens, parents.clone(), needs_forward=self.num_steps > 1)

    def next(self, logprobs: torch.Tensor) -> StepNodes:
        """logprobs (b, k, V) of the k beam nodes of the previous step (in beam-rank order) -> the next k beam nodes."""
        self._check_shape(logprobs, (self.batch_size, self.topk, None))
        return self.next_topk(*_safe(logprobs).topk(self.topk, dim=-1))  # (b, k, k): k children per beam node

    def next_topk(self, child_scores: torch.Tensor, child_tokens: torch.Tensor) -> StepNodes:
        """next() from each beam node's k best (log-prob, token) children, (b, k, k) each, best first."""
        step = len(self._levels)
        if step == 0:
            raise RuntimeError("call first() before next()")
        if step >= self.num_steps:
            raise RuntimeError(f"all {self.num_steps} steps are already expanded; call finalize()")
        b, k = self.batch_size, self.topk
        self._check_shape(child_scores, (b, k, k))
        expanded = (self._beam_scores.unsqueeze(-1) + child_scores).flatten(1)  # (b, k*k), parent-major
        offset = self.num_candidates
        parents = self._beam_flat.repeat_interleave(k, dim=1)  # (b, k*k): flat index of each child's parent
        self._levels.append(_Level(expanded, child_tokens.flatten(1), parents))

        # NaN was mapped to -inf, so topk picks real scores first; ties go to the lower index (stable order).
        best_scores, best = _stable_topk(expanded, k)  # (b, k) each
        self._beam_flat = offset + best
        self._beam_scores = best_scores
        tokens = child_tokens.flatten(1).gather(1, best)  # (b, k)
        parent_regions = (step - 1) * k + best // k  # the parent is beam rank best // k of the previous step
        return StepNodes(step, tokens, parent_regions, needs_forward=step < self.num_steps - 1)

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every candidate so far in flat-index order (level by level): (cumulative scores, tokens, parents as flat
        indices, -1 = the root), each (b, C), on the device (draft_step.select_tree_device re-ranks them there)."""
        if not self._levels:
            raise RuntimeError("call first() first")
        return tuple(torch.cat([getattr(lv, name) for lv in self._levels], dim=1)
                     for name in ("scores", "tokens", "parents"))

    def finalize(self) -> list[DraftTree]:
        """Pick the best num_draft_tokens - 1 candidates per sequence with ancestor closure, parents first."""
        if not self._levels:
            raise RuntimeError("call first() before finalize()")
        scores, tokens, parents = self.candidates()
        scores = scores.tolist()  # (b, C)
        tokens, parents = host_rows(tokens, parents)  # (b, C) each
        budget = self.num_draft_tokens - 1
        return [_select_closed(s, t, p, budget) for s, t, p in zip(scores, tokens, parents)]

    def _check_shape(self, logprobs: torch.Tensor, shape: tuple[int | None, ...]) -> None:
        ok = logprobs.dim() == len(shape) and all(e is None or e == a for e, a in zip(shape, logprobs.shape))
        if not ok:
            raise ValueError(f"expected logprobs of shape {shape} (None = vocab), got {tuple(logprobs.shape)}")
        if logprobs.shape[-1] < self.topk:
            raise ValueError(f"vocab size {logprobs.shape[-1]} is smaller than topk={self.topk}")


def host_rows(*tensors: torch.Tensor) -> list[list[list[int]]]:
    """Same-shape (b, k) integer tensors -> each one's rows as host lists, read back in one device-to-host copy
    (a draft step needs its nodes' tokens and parents on the host; one readback per step, not one per sequence)."""
    k = tensors[0].shape[1]
    packed = torch.cat([t.to(torch.long) for t in tensors], dim=1).tolist()  # (b, len(tensors) * k)
    return [[row[i * k:(i + 1) * k] for row in packed] for i in range(len(tensors))]


def auto_speculative_params(
    algorithm: str,
    architecture: str | None = None,
    num_steps: int | None = None,
    topk: int | None = None,
    num_draft_tokens: int | None = None,
    *,
    max_bfs_breadth: int = 10,
) -> tuple[int, int, int]:
    """SGLang's (num_steps, topk, num_draft_tokens) defaults and fix-ups for a registered algorithm
    (core/algorithms.py: SpeculativeAlgorithm.resolve_shape)."""
    entry = algorithms.find(algorithm)
    if entry is None:
        raise algorithms.unknown_shape(algorithm)
    return entry.resolve_shape(architecture, num_steps, topk, num_draft_tokens, max_bfs_breadth=max_bfs_breadth)


def logprob_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best (log-prob, token) of each row of draft logits, as first()/next() rank log-probs: inside a CUDA
    graph one Triton kernel (tandem_kernels/topk.py; the torch path is ~5 kernels, ~24 µs a tree level on the H100),
    elsewhere the exact ops of the eager drafters' first(log_softmax(logits))."""
    from runtime.models.llama import _k, use_step_kernels

    if use_step_kernels(logits) and logits.shape[-1] <= TOPK_KERNEL_MAX_VOCAB:
        return _k("topk").logsoftmax_topk(logits, k)
    return _safe(torch.log_softmax(logits.float(), dim=-1)).topk(k, dim=-1)


def _safe(logprobs: torch.Tensor) -> torch.Tensor:
    # torch.topk ranks NaN above everything; a NaN draft score must lose, never win. -inf stays -inf (nan_to_num's
    # default would make it the float32 minimum): a token without mass is left out of the tree, as the topk kernel's
    # -inf is.
    return torch.nan_to_num(logprobs.float(), nan=-math.inf, neginf=-math.inf)


def _stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk along the last dim with ties broken by the lower index (torch.topk leaves tie order unspecified)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def _select_closed(scores: list[float], tokens: list[int], parents: list[int], budget: int) -> DraftTree:
    """Best-first over the frontier of selectable candidates (root children, then children of chosen ones).

    With log-prob scores a child never beats its parent, so this equals the global top-`budget` (ties to the lower
    flat index); the frontier only matters for ties, NaN or non-monotone scores, where it keeps ancestor closure."""
    children: dict[int, list[int]] = {}
    for idx, parent in enumerate(parents):
        children.setdefault(parent, []).append(idx)

    def push(heap: list[tuple[float, int]], idx: int) -> None:
        # A NaN or -inf score means the draft gave the token no mass: leave it (and its subtree) out of the tree.
        if not (math.isnan(scores[idx]) or scores[idx] == -math.inf):
            heapq.heappush(heap, (-scores[idx], idx))

    frontier: list[tuple[float, int]] = []
    for idx in children.get(ROOT, []):
        push(frontier, idx)
    chosen: list[int] = []
    while frontier and len(chosen) < budget:
        _, idx = heapq.heappop(frontier)
        chosen.append(idx)
        for child in children.get(idx, []):
            push(frontier, child)
    chosen.sort()  # flat indices grow level by level, so sorting puts parents before children
    node_of = {flat: node for node, flat in enumerate(chosen)}
    return DraftTree([tokens[f] for f in chosen], [ROOT if parents[f] == ROOT else node_of[parents[f]] for f in chosen])
