"""Logit processing and seeded sampling shared by plain decode and speculative verify (the parameters are
core.types.SamplingParams).

Owns the one definition of "the target distribution": penalties (repetition, then frequency and presence, as vLLM
applies them), then temperature, then top-k, then top-p renormalisation. Plain decode and tree verification both call
`penalize_logits` and `process_logits`, so a verify step can never drift from normal decoding.
Knows nothing about trees, KV caches or the wire; every function follows the device of its input tensors.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from core.types import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator private to one sequence: seeded when `params.seed` is set, otherwise from fresh entropy."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def penalize_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int], row_tokens: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Penalised logits (R, V) float32 of one sequence. Row r continues prompt_ids + output_ids + row_tokens[r] (a
    verify row follows the draft tokens on its tree path, which count as generated). vLLM's order and semantics: the
    repetition penalty divides positive / multiplies negative logits of every token seen in the prompt or output
    (HF's RepetitionPenaltyLogitsProcessor); then logit -= frequency * count + presence * [count > 0] over generated
    tokens (OpenAI); then the logit_bias is added. No host sync beyond building the index tensors."""
    out = logits.float()  # (R, V)
    if not params.has_penalties:
        return out
    num_rows, vocab = out.shape
    device = out.device
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
    counts = counts.to(device=device, dtype=torch.float32).expand(num_rows, vocab).clone()  # (R, V)
    if row_tokens:
        rows = [r for r, toks in enumerate(row_tokens) for _ in toks]
        if rows:
            toks = [t for toks in row_tokens for t in toks]
            counts.index_put_((torch.tensor(rows, device=device), torch.tensor(toks, device=device)),
                              torch.ones(len(rows), device=device), accumulate=True)
    if params.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        seen = seen.to(device).unsqueeze(0) | (counts > 0)  # (R, V)
        rp = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    if params.frequency_penalty:
        out = out - params.frequency_penalty * counts
    if params.presence_penalty:
        out = out - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:  # OpenAI adds the bias to the logit (after vLLM's penalties)
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        out = out.index_add(1, ids, bias.expand(num_rows, -1).contiguous())
    return out


def process_logits(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """Turn raw logits (R, V) into the sampling distribution (R, V) float32, one SamplingParams for all rows or one
    per row. Greedy rows become one-hot at the argmax so that sampling from them is exactly greedy decoding."""
    num_rows = logits.shape[0]
    rows = [params] * num_rows if isinstance(params, SamplingParams) else list(params)
    if len(rows) != num_rows:
        raise ValueError(f"got {len(rows)} SamplingParams for {num_rows} logits rows")
    device = logits.device
    temperatures = torch.tensor([0.0 if p.is_greedy else p.temperature for p in rows], device=device)  # (R,)
    top_ks = torch.tensor([p.top_k for p in rows], dtype=torch.long, device=device)  # (R,)
    top_ps = torch.tensor([p.top_p for p in rows], device=device)  # (R,)
    return process_logits_batched(logits, temperatures, top_ks, top_ps)


def process_logits_batched(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Tensor form of `process_logits`: logits (R, V); temperatures (R,) with 0 = greedy; top_ks (R,) long with
    -1 = disabled; top_ps (R,) in (0, 1]. Returns probs (R, V) float32 whose rows sum to 1. No host sync."""
    logits = logits.float()  # (R, V)
    vocab_size = logits.shape[-1]
    greedy = temperatures <= 0  # (R,)
    scaled = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures).unsqueeze(-1).float()
    probs = torch.softmax(scaled, dim=-1)  # (R, V)

    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)  # (R, V) each
    # top-k (HF semantics): keep every token whose probability reaches the k-th largest, so ties at the cut survive.
    k = torch.where(top_ks < 1, torch.full_like(top_ks, vocab_size), top_ks.clamp(max=vocab_size))  # (R,)
    kth = sorted_probs.gather(-1, (k - 1).unsqueeze(-1))  # (R, 1)
    keep = sorted_probs >= kth  # (R, V)
    # top-p on the top-k renormalised distribution: keep a token iff the mass strictly before it (in sorted order)
    # is < top_p; the first token is always kept. top_p == 1 keeps all, even when float cumsum reaches 1 early.
    kept = sorted_probs * keep
    kept = kept / kept.sum(dim=-1, keepdim=True)
    mass_before = kept.cumsum(dim=-1) - kept  # (R, V)
    keep &= (mass_before < top_ps.unsqueeze(-1)) | (top_ps >= 1.0).unsqueeze(-1)
    keep[:, 0] = True

    mask = torch.zeros_like(keep).scatter(-1, sorted_idx, keep)  # (R, V) back in vocab order
    out = probs * mask
    out = out / out.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(out).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)  # (R, V)
    return torch.where(greedy.unsqueeze(-1), one_hot, out)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of probs (R, V) with one generator -> (R,) long. Inverse CDF with one uniform coin per
    row, so the random stream consumed per call is fixed (R floats) and reproducible for a given seed."""
    coins = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float64)  # (R,)
    return sample_with_coins(probs, coins)


def sample_per_row(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Batched sampling where row r belongs to a sequence with its own generator -> (R,) long.

    Each sequence's stream advances by exactly one coin per row, independent of what else is in the batch."""
    if len(generators) != probs.shape[0]:
        raise ValueError(f"got {len(generators)} generators for {probs.shape[0]} rows")
    coins = torch.cat([
        torch.rand(1, generator=g, device=probs.device, dtype=torch.float64) for g in generators
    ])  # (R,)
    return sample_with_coins(probs, coins)


def sample_with_coins(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row r picks the first token whose cumulative mass exceeds coins[r] * row_total.
    probs (R, V) need not be normalised; coins (R,) in [0, 1). Zero-probability tokens are never chosen."""
    cdf = probs.double().cumsum(dim=-1)  # (R, V)
    target = coins.double().unsqueeze(-1) * cdf[:, -1:]  # (R, 1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (R,)
    # Rounding can push target onto the total; fall back to the last token that has mass, never a zero-mass one.
    last_nonzero = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # (R,)
    return torch.minimum(idx, last_nonzero)
