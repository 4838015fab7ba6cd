"""SamplingParams validation and process_logits against a naive reference and HF's logits warpers."""
from __future__ import annotations

import pytest
import torch

from runtime.sampling import (
    SamplingParams, make_generator, process_logits, process_logits_batched, sample, sample_per_row, sample_with_coins,
)


def _naive_process(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Row by row, token by token: temperature, top-k (ties at the cut kept), top-p on the renormalised top-k."""
    out = torch.zeros_like(logits, dtype=torch.float64)
    for r, row in enumerate(logits.double()):
        if p.is_greedy:
            out[r, int(row.argmax())] = 1.0
            continue
        probs = torch.softmax(row / p.temperature, dim=-1)
        order = sorted(range(len(row)), key=lambda i: -float(probs[i]))
        keep = set(order)
        if p.top_k != -1:
            kth = float(probs[order[min(p.top_k, len(row)) - 1]])
            keep = {i for i in order if float(probs[i]) >= kth}
        total = sum(float(probs[i]) for i in keep)
        before, kept_p = 0.0, set()
        for i in order:
            if i not in keep:
                continue
            if before < p.top_p or not kept_p or p.top_p >= 1.0:
                kept_p.add(i)
            before += float(probs[i]) / total
        for i in kept_p:
            out[r, i] = probs[i]
        out[r] /= out[r].sum()
    return out.float()


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0),
    dict(top_k=-2), dict(seed=-1),
])
def test_sampling_params_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_is_greedy_for_zero_temperature_or_top_k_one():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8).is_greedy


@pytest.mark.parametrize("params", [
    SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=3), SamplingParams(top_p=0.8),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.6), SamplingParams(temperature=0), SamplingParams(top_p=0.01),
    SamplingParams(top_k=100),
])
def test_process_logits_matches_naive_reference(params):
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(3)) * 2
    got = process_logits(logits, params)
    assert torch.allclose(got, _naive_process(logits, params), atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(6))


def test_process_logits_keeps_ties_at_the_top_k_cut():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert (process_logits(logits, SamplingParams(top_k=2)) > 0).tolist() == [[True, True, True, False]]


def test_process_logits_per_row_params_equal_batched_tensors():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    rows = [SamplingParams(temperature=0.5, top_k=4), SamplingParams(top_p=0.7), SamplingParams(temperature=0)]
    batched = process_logits_batched(logits, torch.tensor([0.5, 1.0, 0.0]), torch.tensor([4, -1, -1]),
                                     torch.tensor([1.0, 0.7, 1.0]))
    assert torch.allclose(process_logits(logits, rows), batched)
    for r, p in enumerate(rows):
        assert torch.allclose(process_logits(logits[r:r + 1], p), batched[r:r + 1])


def test_process_logits_matches_hf_warpers():
    warpers = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * 3
    for temp, k, p in [(0.7, -1, 1.0), (1.0, 5, 1.0), (1.0, -1, 0.8), (0.9, 8, 0.5)]:
        hf = warpers.TemperatureLogitsWarper(temp)(None, logits.clone())
        if k != -1:
            hf = warpers.TopKLogitsWarper(k)(None, hf)
        if p < 1.0:
            hf = warpers.TopPLogitsWarper(p)(None, hf)
        ours = process_logits(logits, SamplingParams(temperature=temp, top_k=k, top_p=p))
        assert torch.allclose(ours, torch.softmax(hf, dim=-1), atol=1e-6)


def test_sample_is_reproducible_per_seed_and_never_picks_zero_mass():
    probs = process_logits(torch.randn(4, 50, generator=torch.Generator().manual_seed(2)), SamplingParams(top_k=3))
    a = sample(probs, make_generator(SamplingParams(seed=7)))
    b = sample(probs, make_generator(SamplingParams(seed=7)))
    assert torch.equal(a, b)
    for _ in range(50):
        assert bool((probs.gather(1, sample(probs).unsqueeze(1)) > 0).all())


def test_sample_per_row_streams_do_not_depend_on_batch_mates():
    probs = torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(4)), dim=-1)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    together = sample_per_row(probs, gens)
    alone = sample_per_row(probs[1:2], [torch.Generator().manual_seed(2)])
    assert together[1] == alone[0]


def test_sample_with_coins_is_the_inverse_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]] * 4)
    coins = torch.tensor([0.0, 0.2499, 0.25, 0.999999])
    assert sample_with_coins(probs, coins).tolist() == [1, 1, 3, 3]
