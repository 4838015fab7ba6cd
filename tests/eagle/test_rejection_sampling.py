"""--speculative-use-rejection-sampling with EAGLE / EAGLE-3 heads: the draft samples each chain token of a sampled
request from q (and says so exactly: a χ² test of the drafted tokens against the q it returns, mapped through an
EAGLE-3 d2t table into the target vocabulary), the q reaches the target through the services, the target verifies by
p/q rejection, greedy requests stay greedy (output equals HF `generate`), and seeded sampled requests reproduce."""
from __future__ import annotations

import collections
import os

import pytest
import torch
import transformers
from scipy.stats import chisquare

import runtime.speculative.acceptance as acceptance
from draft_service.eagle import EagleProposer
from draft_service.proposer import ProposeInput, SpecShape, Status
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.sampling import SamplingParams
from tests.eagle.heads import make_eagle3_head
from tests.stack import generate_ids, local_stack
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts

ENGINE = EngineConfig(device="cpu", dtype="float32", max_total_tokens=1 << 16, block_size=4)
CHAIN = SpecShape(num_steps=3, topk=1, num_draft_tokens=4)
NUM_SEQS = 2000


@pytest.fixture(scope="module")
def head(target_path, eagle_dir) -> str:
    return make_eagle3_head(target_path, os.path.join(eagle_dir, "rejection3"), draft_vocab_size=96)


def test_draft_samples_each_chain_token_from_the_q_it_returns(target_path, head):
    proposer = EagleProposer(target_path, head, ENGINE, "EAGLE3", use_rejection_sampling=True)
    target = ModelRunner(target_path, ENGINE)
    prompt = [5, 17, 42, 9, 100, 7]
    target.add_seq("t")
    out = target.forward([SeqForward("t", prompt, logits="none")], capture_layers=proposer.target_capture_layers)
    features = out.features[0][:-1]  # row i = the feature of prompt[i]; the last token is the pending root
    sampling = [SamplingParams(temperature=1.3, top_k=12, seed=i) for i in range(NUM_SEQS)]
    for i in range(NUM_SEQS):
        assert proposer.prefill(f"s{i}", prompt, features) == Status.OK
    outputs = proposer.propose([ProposeInput(f"s{i}", len(prompt), [], CHAIN, features[:0], sampling=sampling[i])
                                for i in range(NUM_SEQS)])
    assert all(o.status == Status.OK and len(o.tree) == 3 for o in outputs)
    q = outputs[0].tree.draft_probs  # (3, target vocab): the same context, so the same q for every sequence
    assert q.shape == (3, 320) and torch.allclose(q.sum(dim=-1), torch.ones(3), atol=1e-5)
    for o in outputs:
        assert o.tree.parents == [-1, 0, 1]
        assert torch.allclose(o.tree.draft_probs[0], q[0], atol=1e-5)
        assert all(float(o.tree.draft_probs[s, t]) > 0 for s, t in enumerate(o.tree.token_ids))
    assert int((q[0] > 0).sum()) <= 12  # top-k 12 over the 96 hot tokens, mapped into the target vocabulary
    firsts = collections.Counter(o.tree.token_ids[0] for o in outputs)
    support = [t for t in range(q.shape[1]) if q[0, t] > 1e-4]
    assert set(firsts) <= set(support)
    observed = [firsts.get(t, 0) for t in support]
    mass = sum(float(q[0, t]) for t in support)  # renormalised over the support so the sums agree exactly
    expected = [float(q[0, t]) / mass * NUM_SEQS for t in support]
    assert chisquare(observed, expected).pvalue > 1e-3
    # Greedy requests (no sampling) are drafted greedily and carry no q, as without the flag.
    assert proposer.prefill("g", prompt, features) == Status.OK
    [greedy] = proposer.propose([ProposeInput("g", len(prompt), [], CHAIN, features[:0])])
    assert greedy.tree.draft_probs is None and len(greedy.tree) == 3


@pytest.fixture(scope="module")
def hf(target_path):
    return transformers.AutoModelForCausalLM.from_pretrained(target_path, torch_dtype=torch.float32).eval()


async def test_rejection_sampling_through_the_services(target_path, head, hf, monkeypatch):
    calls = []
    real = acceptance.verify_chain_rejection
    monkeypatch.setattr(acceptance, "verify_chain_rejection", lambda *a: calls.append(1) or real(*a))
    async with local_stack(target_path, algorithm="EAGLE3", draft_path=head, num_steps=3, topk=1,
                           num_draft_tokens=4, use_rejection_sampling=True) as scheduler:
        prompt = prompts(hf.config.vocab_size)[0]
        got, usage, _ = await generate_ids(scheduler, prompt, 16, request_id="greedy")
        assert got == hf_greedy(hf, prompt, 16) and not calls  # greedy: the argmax walk, never p/q
        first, usage, _ = await generate_ids(scheduler, prompt, 24, temperature=1.0, seed=3, request_id="a")
        assert calls, "no draft_probs reached the target: the q plumbing is broken"
        assert usage.proposed_draft_tokens > 0 and usage.accepted_draft_tokens > 0
        again, _, _ = await generate_ids(scheduler, prompt, 24, temperature=1.0, seed=3, request_id="b")
        assert again == first  # the draft's and the target's streams are both seeded
        await _assert_no_kv_leak(scheduler)
