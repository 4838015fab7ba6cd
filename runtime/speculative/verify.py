"""Tree verification: which draft nodes the target accepts and which token it emits after them (the bonus).

Row conventions for the target tensors: row 0 is the root's output (the token after the last committed token) and
row i+1 is draft node i's. Probabilities arrive already processed by runtime.sampling.process_logits, so this module
knows nothing about temperature/top-k/top-p. Target-only tree sampling needs no draft probabilities; chain rejection
sampling (--speculative-use-rejection-sampling) takes the distribution q each draft token was sampled from.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.types import ROOT, DraftTree
from runtime.sampling import sample_with_coins


@dataclass(frozen=True)
class AcceptThresholds:
    """SGLang's --speculative-accept-threshold-single / -acc (reference §3.2), applied by tree sampling only. Both at
    1.0 (the default) is exact sampling from the target; below 1 is lossy: a draft token is accepted outright when
    its target probability is >= single, and the siblings' cumulative acceptance probability rises from P to
    min(1, P / acc). Greedy verification ignores them (a greedy target is one-hot: nothing more to accept)."""

    single: float = 1.0
    acc: float = 1.0

    def __post_init__(self) -> None:
        for name, value in (("single", self.single), ("acc", self.acc)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 < value <= 1.0):
                raise ValueError(f"--speculative-accept-threshold-{name} must be in (0, 1], got {value!r}")

    @property
    def exact(self) -> bool:
        return self.single == 1.0 and self.acc == 1.0


EXACT = AcceptThresholds()


@dataclass
class VerifyOutcome:
    """accepted_nodes: tree node indices along the accepted path (root excluded); tokens: accepted drafts + bonus."""

    accepted_nodes: list[int]
    tokens: list[int]
    num_accepted_drafts: int

    @property
    def bonus_token(self) -> int:
        return self.tokens[-1]

    @property
    def accept_length(self) -> int:
        """Tokens emitted this step, bonus included (the SGLang accept_length metric)."""
        return len(self.tokens)


def verify_greedy(tree: DraftTree, target_argmax: torch.Tensor | Sequence[int]) -> VerifyOutcome:
    """Accept the longest path whose every token equals the target argmax at its parent; siblings in node order.

    target_argmax: (n+1,). The output equals target-only greedy decoding token for token, since each accepted token
    is exactly what the target would have produced next, and the bonus is the target's choice after the last one."""
    argmax = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else list(target_argmax)  # one sync
    _check_rows(tree, len(argmax))
    children = tree.children()
    node, accepted = ROOT, []
    while True:
        want = argmax[node + 1]
        match = next((c for c in children[node] if tree.token_ids[c] == want), None)
        if match is None:
            break
        accepted.append(match)
        node = match
    tokens = [tree.token_ids[i] for i in accepted] + [argmax[node + 1]]
    return VerifyOutcome(accepted, tokens, len(accepted))


def verify_tree_sampling(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None,
    thresholds: AcceptThresholds = EXACT,
) -> VerifyOutcome:
    """Target-only tree sampling (SGLang tree_speculative_sampling_target_only): exact at the default thresholds,
    lossy (accepts more) below 1.

    target_probs: (n+1, V) processed target distributions; the generator must live on their device. The random
    stream consumed is fixed per call (n+2 coins), so a seeded generator reproduces the same outputs whatever was
    accepted. Host syncs: two small ones per sequence, plus one more only in a rounding corner case."""
    num_rows, vocab_size = target_probs.shape
    _check_rows(tree, num_rows)
    device = target_probs.device
    # One coin per tree row (used when that node's children are tested) plus one for the final residual sample.
    coins = torch.rand(num_rows + 1, generator=generator, device=device, dtype=torch.float64)  # (n+2,)
    level_coins = coins.tolist()
    # p(token_i | parent_i) for every node, gathered flat: row (parent_i + 1), column token_i. One sync.
    flat = [(p + 1) * vocab_size + t for p, t in zip(tree.parents, tree.token_ids)]
    node_probs = torch.take(target_probs, torch.tensor(flat, device=device)).tolist() if flat else []  # (n,)

    children = tree.children()
    node, accepted = ROOT, []
    rejected: list[int] = []  # distinct tokens tried and rejected at the current level
    while True:
        # Siblings share one coin u. Testing u < p(x_1) + ... + p(x_i) in order selects sibling i with probability
        # p(x_i): the inverse CDF of p restricted to the candidates. If u falls past all of them, the remaining mass
        # is p with the candidates removed, so sampling the residual completes an exact draw from p. A repeated
        # token must be skipped: counting p(x) twice would give x twice its mass. Strict '<' keeps p = 0 tokens out.
        coin, mass, rejected, chosen = level_coins[node + 1], 0.0, [], None
        for child in children[node]:
            token = tree.token_ids[child]
            if token in rejected:
                continue
            mass += node_probs[child]
            if coin < mass or (not thresholds.exact and _lossy_accept(coin, mass, node_probs[child], thresholds)):
                chosen = child
                break
            rejected.append(token)
        if chosen is None:
            break
        accepted.append(chosen)
        node = chosen  # descend with a fresh coin; the new level's candidates are conditioned on the accepted token

    # A leaf has no candidates, so its "residual" is the plain target distribution, as the rule requires.
    row = target_probs[node + 1]  # (V,)
    if rejected:
        residual = row.index_fill(0, torch.tensor(rejected, device=device), 0.0)
        # The candidates can hold all the mass only up to rounding; then fall back to the row (a sync, but rare).
        if mass < 1.0 - 1e-6 or bool(residual.sum() > 0):
            row = residual
    bonus = int(sample_with_coins(row.unsqueeze(0), coins[-1:]).item())
    tokens = [tree.token_ids[i] for i in accepted] + [bonus]
    return VerifyOutcome(accepted, tokens, len(accepted))


def verify_chain_rejection(
    tree: DraftTree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator | None = None
) -> VerifyOutcome:
    """Chain p/q rejection sampling (Leviathan et al. / Chen et al.; SGLang's --speculative-use-rejection-sampling).

    tree: a chain whose node i was sampled from draft_probs[i] = q_i (V,), exactly that distribution (same vocab,
    temperature); target_probs: (n+1, V) processed target distributions p. Node i is accepted with probability
    min(1, p(x)/q(x)); the first rejection emits a sample of norm(max(p - q, 0)), which makes the emitted token
    exactly p-distributed; a fully accepted chain emits a sample of p after its last node (the bonus). The random
    stream is fixed per call (n+1 coins), as in verify_tree_sampling."""
    num_rows, vocab_size = target_probs.shape
    _check_rows(tree, num_rows)
    if tree.parents != list(range(-1, len(tree) - 1)):
        raise ValueError("rejection sampling verifies chains only (--speculative-eagle-topk 1)")
    if draft_probs.shape != (len(tree), vocab_size):
        raise ValueError(f"draft_probs must be (num_nodes={len(tree)}, vocab={vocab_size}), "
                         f"got {tuple(draft_probs.shape)}")
    device = target_probs.device
    coins = torch.rand(num_rows, generator=generator, device=device, dtype=torch.float64)  # (n+1,)
    n = len(tree)
    tokens = torch.tensor(tree.token_ids, device=device, dtype=torch.int64)  # (n,)
    rows = torch.arange(n, device=device)
    p_x = target_probs[rows, tokens].double().tolist() if n else []  # p(x_i | prefix), row i predicts node i
    q_x = draft_probs.to(device)[rows, tokens].double().tolist() if n else []
    coin_list = coins.tolist()
    accepted: list[int] = []
    for i in range(n):
        if q_x[i] <= 0.0:
            raise ValueError(f"draft node {i} has draft probability 0: it cannot have been sampled from draft_probs")
        if coin_list[i] * q_x[i] < p_x[i]:  # P(accept) = min(1, p/q)
            accepted.append(i)
            continue
        # Rejected: the residual max(p - q, 0) holds exactly the mass p has beyond what acceptance already gave.
        residual = (target_probs[i].double() - draft_probs[i].to(device).double()).clamp_min(0.0)
        row = residual if bool(residual.sum() > 0) else target_probs[i].double()  # p == q up to rounding: sample p
        bonus = int(sample_with_coins(row.unsqueeze(0), coins[-1:]).item())
        return VerifyOutcome(accepted, [*tree.token_ids[:i], bonus], len(accepted))
    bonus = int(sample_with_coins(target_probs[n].unsqueeze(0), coins[-1:]).item())
    return VerifyOutcome(accepted, [*tree.token_ids, bonus], n)


def verify_batch(
    trees: Sequence[DraftTree],
    target_rows: Sequence[torch.Tensor],
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> list[VerifyOutcome]:
    """Per-sequence verify over a batch. target_rows[i] is (n_i+1, V): logits for greedy sequences (only the argmax
    is used), processed probabilities for sampling ones."""
    if not len(trees) == len(target_rows) == len(greedy) == len(generators):
        raise ValueError("trees, target_rows, greedy and generators must have the same length")
    return [
        verify_greedy(tree, rows.argmax(dim=-1)) if is_greedy else verify_tree_sampling(tree, rows, gen)
        for tree, rows, is_greedy, gen in zip(trees, target_rows, greedy, generators)
    ]


def _lossy_accept(coin: float, mass: float, prob: float, thresholds: AcceptThresholds) -> bool:
    """SGLang's threshold rule: the cumulative sibling mass is scaled by 1/acc, and a token with target probability
    >= single is accepted outright (both clamped to >= 1e-9 as SGLang does)."""
    return coin <= mass / max(thresholds.acc, 1e-9) or prob >= max(thresholds.single, 1e-9)


def _check_rows(tree: DraftTree, num_rows: int) -> None:
    if num_rows != len(tree) + 1:
        raise ValueError(f"a tree of {len(tree)} draft nodes needs {len(tree) + 1} target rows, got {num_rows}")
