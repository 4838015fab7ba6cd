"""χ² tests of UNO's sampled paths through the real target engine and the UNO proposer: a sampled linear chain (the
clean root, then LoRA drafts drawn from q and verified by exact p/q rejection) and a sampled best-first tree (exact
target-only tree sampling below the clean root) emit tokens that follow HF transformers' target distribution at the
first and second position (the second: an accepted LoRA draft or the target's correction). Thousands of sequences
with their own seeds run as one batched Propose + Verify."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from core.steps import ProposeInput, SpecShape
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from runtime.sampling import SamplingParams, process_logits
from core.steps import PrefillInput, VerifyInput
from core.types import StopRule
from target_service.engine import TargetEngine
from target_service.uno import UnoProposer, attach_adapter
from tests.tiny_models import load_hf_model, make_tiny_lora, make_tiny_model

NUM_TRIALS = 2000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("uno-chi2")
    path = make_tiny_model("llama", root, std=0.3)
    return path, make_tiny_lora(path, root, std=0.2), load_hf_model(path)


def hf_probs(hf, ids: list[int], sampling: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1:].float()
    return process_logits(logits, sampling)[0]  # (vocab,)


def check(probs: torch.Tensor, observed: collections.Counter, min_total: int = 200) -> None:
    total = sum(observed.values())
    assert total > min_total, f"only {total} samples"
    support = [t for t in range(probs.numel()) if probs[t] > 1e-6]
    assert set(observed) <= set(support), "sampled a token outside the target's support"
    mass = sum(float(probs[t]) for t in support)
    counts = [observed.get(t, 0) for t in support]
    assert chisquare(counts, [float(probs[t]) / mass * total for t in support]).pvalue > 1e-3


@pytest.mark.parametrize("shape", [SpecShape(1, 1, 3), SpecShape(3, 3, 5)], ids=["linear", "tree"])
def test_sampled_uno_follows_the_target_distribution(model, shape):
    path, lora, hf = model
    runner = ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=NUM_TRIALS * 48))
    engine = TargetEngine(runner)
    attach_adapter(engine, lora)
    proposer = UnoProposer(engine)
    sampling = SamplingParams(temperature=0.9, top_k=8)
    prompt = [3, 17, 42, 9, 100, 55]
    stop = StopRule(max_new_tokens=100, prompt_len=len(prompt) - 1)
    seeded = [dataclasses.replace(sampling, seed=i) for i in range(NUM_TRIALS)]
    ids = [f"s{i}" for i in range(NUM_TRIALS)]
    engine.prefill([PrefillInput(s, prompt, False, seeded[i], stop) for i, s in enumerate(ids)])
    for s in ids:
        proposer.prefill(s, prompt)
    proposals = proposer.propose([ProposeInput(s, len(prompt), [], shape, sampling=seeded[i])
                                  for i, s in enumerate(ids)])
    assert all(p.status == 0 and p.tree.token_ids for p in proposals)
    assert all(len(p.tree) == shape.num_draft_tokens for p in proposals)
    outputs = engine.verify([VerifyInput(s, len(prompt), prompt[-1], p.tree, seeded[i], stop)
                             for i, (s, p) in enumerate(zip(ids, proposals))])
    assert all(o.status == 0 for o in outputs)
    first = hf_probs(hf, prompt, sampling)
    check(first, collections.Counter(o.token_ids[0] for o in outputs), NUM_TRIALS - 1)
    a = int(torch.argmax(first))
    second = hf_probs(hf, [*prompt, a], sampling)
    check(second, collections.Counter(o.token_ids[1] for o in outputs if o.token_ids[0] == a))
    # the clean root always, and LoRA drafts sometimes, are accepted; every step emits at least two tokens
    assert all(o.num_accepted_drafts >= 1 and len(o.token_ids) >= 2 for o in outputs)
    assert any(o.num_accepted_drafts >= 2 for o in outputs)
    engine.release(ids)
    proposer.release(ids)
    assert runner.num_free_tokens() == runner.num_total_tokens()
