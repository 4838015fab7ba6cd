"""χ² test through the real target engine: tokens emitted by a sampled Verify of a draft tree follow the target
distribution (HF transformers' probabilities after temperature / top-k / top-p), at the first and the second position.

Many sequences with different seeds run in one batched verify; the tree holds the target's own likely tokens (so the
accept branches run) plus an unlikely one and a duplicate sibling (so the residual and dedup branches run).
"""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from runtime.sampling import SamplingParams, penalize_logits, process_logits
from runtime.speculative.tree import DraftTree
from core.types import StopRule
from target_service.engine import PrefillInput, TargetEngine, VerifyInput
from tests.tiny_models import load_hf_model, make_tiny_model

NUM_TRIALS = 3000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("chi2"), std=0.3)
    return path, load_hf_model(path)


def hf_probs(hf, ids: list[int], sampling: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1:].float()
    return process_logits(logits, sampling)[0]  # (vocab,)


def expected_counts(probs: torch.Tensor, observed: collections.Counter, total: int):
    support = [t for t in range(probs.numel()) if probs[t] > 1e-6]
    assert set(observed) <= set(support), "sampled a token outside the target's support"
    mass = sum(float(probs[t]) for t in support)  # renormalise over the support so the sums agree exactly
    return [observed.get(t, 0) for t in support], [float(probs[t]) / mass * total for t in support]


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.8, top_k=6),
    SamplingParams(temperature=1.3, top_k=8, top_p=0.8),
    SamplingParams(temperature=0.7, top_p=0.7),
], ids=["temp-topk", "temp-topk-topp", "temp-topp"])
def test_sampled_verify_follows_the_target_distribution(model, sampling):
    path, hf = model
    runner = ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=NUM_TRIALS * 48))
    engine = TargetEngine(runner)
    prompt, root = [3, 17, 42, 9, 100], 55
    first = hf_probs(hf, [*prompt, root], sampling)
    top = torch.argsort(first, descending=True).tolist()
    a, b = top[0], top[1]
    second = hf_probs(hf, [*prompt, root, a], sampling)
    a2 = int(torch.argmax(second))
    unlikely = top[-1]
    # Root children: a, b, a duplicate of a (must not double-count), an unlikely token; a has a child a2.
    tree = DraftTree([a, b, a, unlikely, a2], [-1, -1, -1, -1, 0])
    stop = StopRule(max_new_tokens=100, prompt_len=len(prompt))
    seeded = [SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=i)
              for i in range(NUM_TRIALS)]
    engine.prefill([PrefillInput(f"s{i}", [*prompt, root], False, seeded[i], stop) for i in range(NUM_TRIALS)])
    outputs = engine.verify([VerifyInput(f"s{i}", len(prompt) + 1, root, tree, seeded[i], stop)
                             for i in range(NUM_TRIALS)])
    assert all(o.status == 0 for o in outputs)
    firsts = collections.Counter(o.token_ids[0] for o in outputs)
    observed, expected = expected_counts(first, firsts, NUM_TRIALS)
    assert chisquare(observed, expected).pvalue > 1e-3
    seconds = collections.Counter(o.token_ids[1] for o in outputs if o.token_ids[0] == a)
    n = sum(seconds.values())
    assert n > 200
    observed, expected = expected_counts(second, seconds, n)
    assert chisquare(observed, expected).pvalue > 1e-3
    engine.release([f"s{i}" for i in range(NUM_TRIALS)])
    assert runner.num_free_tokens() == runner.num_total_tokens()


def test_sampled_verify_with_penalties_follows_the_penalised_target_distribution(model):
    """Penalties in a sampled tree verify: each row is penalised for the committed tokens plus its own tree path, so
    the second token (after drafted `a`) sees `a` counted once more than the first."""
    path, hf = model
    runner = ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=NUM_TRIALS * 48))
    engine = TargetEngine(runner)
    sampling = SamplingParams(temperature=0.9, top_k=10, presence_penalty=0.7, frequency_penalty=0.6,
                              repetition_penalty=1.4)
    prompt, root = [3, 17, 42, 9, 100], 241  # picked so the penalties move both positions' distributions a lot

    def reference(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1:].float()
        penalised = penalize_logits(logits, sampling, ids[:len(prompt)], ids[len(prompt):])
        return process_logits(penalised, sampling)[0]

    first = reference([*prompt, root])
    top = torch.argsort(first, descending=True).tolist()
    a, b = top[0], top[1]
    second = reference([*prompt, root, a])
    with torch.no_grad():
        logits = hf(torch.tensor([[*prompt, root, a]])).logits[0, -1:].float()
    path_blind = process_logits(penalize_logits(logits, sampling, prompt, [root]), sampling)[0]
    assert (second - path_blind).abs().max() > 0.1  # a verify that ignored the drafted `a` would be caught
    a2 = int(torch.argmax(second))
    tree = DraftTree([a, b, a, top[-1], a2], [-1, -1, -1, -1, 0])
    stop = StopRule(max_new_tokens=100, prompt_len=len(prompt))
    seeded = [dataclasses.replace(sampling, seed=i) for i in range(NUM_TRIALS)]
    engine.prefill([PrefillInput(f"s{i}", [*prompt, root], False, seeded[i], stop) for i in range(NUM_TRIALS)])
    outputs = engine.verify([VerifyInput(f"s{i}", len(prompt) + 1, root, tree, seeded[i], stop)
                             for i in range(NUM_TRIALS)])
    assert all(o.status == 0 for o in outputs)
    observed, expected = expected_counts(first, collections.Counter(o.token_ids[0] for o in outputs), NUM_TRIALS)
    assert chisquare(observed, expected).pvalue > 1e-3
    seconds = collections.Counter(o.token_ids[1] for o in outputs if o.token_ids[0] == a)
    assert sum(seconds.values()) > 200
    observed, expected = expected_counts(second, seconds, sum(seconds.values()))
    assert chisquare(observed, expected).pvalue > 1e-3


def test_rejection_sampled_chain_verify_follows_the_target_distribution(model):
    """--speculative-use-rejection-sampling through the real target engine: every trial's chain is drawn from a draft
    distribution q that differs from the target's (x_1 ~ q_1, x_2 ~ q_2, each trial its own draw), q travels in
    DraftTree.draft_probs, and the emitted tokens follow HF's target distribution at the first and second position."""
    path, hf = model
    runner = ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=NUM_TRIALS * 48))
    engine = TargetEngine(runner)
    sampling = SamplingParams(temperature=0.9, top_k=8)
    prompt, root = [3, 17, 42, 9, 100], 55
    first = hf_probs(hf, [*prompt, root], sampling)
    vocab = first.numel()
    gen = torch.Generator().manual_seed(5)
    # q: mass on the target's top tokens but in the wrong proportions, plus tokens the target (top-k) never emits.
    top = torch.argsort(first, descending=True).tolist()
    q1 = torch.zeros(vocab)
    q1[top[:4]] = torch.tensor([0.1, 0.4, 0.2, 0.1])
    q1[top[-2:]] = 0.1
    a = top[0]
    second = hf_probs(hf, [*prompt, root, a], sampling)
    q2 = torch.softmax(torch.randn(vocab, generator=gen) * 2, dim=-1)
    drafts = torch.stack([torch.multinomial(q1, NUM_TRIALS, replacement=True, generator=gen),
                          torch.multinomial(q2, NUM_TRIALS, replacement=True, generator=gen)], dim=1).tolist()
    draft_probs = torch.stack([q1, q2])  # (2, vocab): what each node was drawn from
    stop = StopRule(max_new_tokens=100, prompt_len=len(prompt))
    seeded = [dataclasses.replace(sampling, seed=i) for i in range(NUM_TRIALS)]
    engine.prefill([PrefillInput(f"s{i}", [*prompt, root], False, seeded[i], stop) for i in range(NUM_TRIALS)])
    outputs = engine.verify([VerifyInput(f"s{i}", len(prompt) + 1, root, DraftTree(drafts[i], [-1, 0], draft_probs),
                                         seeded[i], stop) for i in range(NUM_TRIALS)])
    assert all(o.status == 0 for o in outputs)
    observed, expected = expected_counts(first, collections.Counter(o.token_ids[0] for o in outputs), NUM_TRIALS)
    assert chisquare(observed, expected).pvalue > 1e-3
    # Emitted `a` followed by a second token means x_1 = a was accepted: the next token must follow p(. | a).
    seconds = collections.Counter(o.token_ids[1] for o in outputs if o.token_ids[0] == a and len(o.token_ids) > 1)
    assert sum(seconds.values()) > 200
    observed, expected = expected_counts(second, seconds, sum(seconds.values()))
    assert chisquare(observed, expected).pvalue > 1e-3
    assert any(o.num_accepted_drafts == 0 for o in outputs) and any(o.num_accepted_drafts == 2 for o in outputs)
    engine.release([f"s{i}" for i in range(NUM_TRIALS)])
    assert runner.num_free_tokens() == runner.num_total_tokens()


def test_accept_thresholds_at_one_are_bit_identical_and_below_one_accept_more(model):
    """The engine's AcceptThresholds: (1, 1) emits exactly today's tokens for the same seeds; (0.3, 0.3) accepts more
    drafts of the same trees (lossy, opt-in)."""
    from runtime.speculative.verify import AcceptThresholds

    path, hf = model
    sampling = SamplingParams(temperature=1.0)
    prompt, root = [3, 17, 42, 9, 100], 55
    first = hf_probs(hf, [*prompt, root], sampling)
    top = torch.argsort(first, descending=True).tolist()
    second = hf_probs(hf, [*prompt, root, top[0]], sampling)
    tree = DraftTree([top[0], top[1], int(torch.argmax(second))], [-1, -1, 0])
    stop = StopRule(max_new_tokens=100, prompt_len=len(prompt))
    n = 400

    def run(thresholds: AcceptThresholds | None):
        runner = ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=n * 48))
        engine = TargetEngine(runner) if thresholds is None else TargetEngine(runner, accept_thresholds=thresholds)
        seeded = [dataclasses.replace(sampling, seed=i) for i in range(n)]
        engine.prefill([PrefillInput(f"s{i}", [*prompt, root], False, seeded[i], stop) for i in range(n)])
        return engine.verify([VerifyInput(f"s{i}", len(prompt) + 1, root, tree, seeded[i], stop) for i in range(n)])

    today, ones, lossy = run(None), run(AcceptThresholds(1.0, 1.0)), run(AcceptThresholds(0.3, 0.3))
    assert [o.token_ids for o in ones] == [o.token_ids for o in today]
    assert sum(o.num_accepted_drafts for o in lossy) > 1.2 * sum(o.num_accepted_drafts for o in today)
