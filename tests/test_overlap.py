"""Overlapped drafting (--enable-overlap-drafting): the draft pre-drafts step i+1 while step i is verified; greedy
output is the same as without overlap and as HF `generate`, for STANDALONE chains and trees; a draft that is a close
copy of the target gets pre-drafts used (hits), and a miss rolls the draft back correctly (the output proves it).
"""
from __future__ import annotations

import pytest

from draft_service.proposer import ProposeInput, SpecShape
from tests.stack import generate_ids, local_stack, perturbed_copy
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts
from tests.tiny_models import load_hf_model, make_tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    target = make_tiny_model("llama", root / "target")
    return target, perturbed_copy(target, root / "draft", noise=0.01), load_hf_model(target)


@pytest.mark.parametrize("steps,topk,ndt", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
async def test_overlap_greedy_matches_hf_and_plain_loop_with_predraft_hits(pair, steps, topk, ndt):
    target, draft, hf = pair
    outputs = {}
    for overlap in (False, True):
        async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=steps, topk=topk,
                               num_draft_tokens=ndt, enable_overlap_drafting=overlap) as scheduler:
            hits = misses = 0
            outs = []
            for i, prompt in enumerate(prompts(hf.config.vocab_size)):
                got, usage, finish = await generate_ids(scheduler, prompt, 13 + 5 * i, request_id=f"o{i}")
                assert got == hf_greedy(hf, prompt, 13 + 5 * i), f"overlap={overlap} prompt {i} diverged from HF"
                outs.append(got)
                hits, misses = hits + usage.predraft_hits, misses + usage.predraft_misses
            await _assert_no_kv_leak(scheduler)
        outputs[overlap] = outs
        if overlap:
            assert hits > 0, "a near-copy draft should guess the verify outcome right some of the time"
            assert misses > 0, "noise should make some guesses wrong (the rollback path must run)"
        else:
            assert hits == misses == 0
    assert outputs[True] == outputs[False]


def test_predraft_then_mismatched_propose_rolls_back_to_committed(pair):
    """A pre-draft extends the draft by a guessed tail; a real Propose with other tokens must give exactly the tree
    a fresh draft gives from the real committed tokens."""
    from draft_service.standalone import StandaloneProposer
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner

    _, draft, _ = pair
    cfg = EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048)
    spec = SpecShape(3, 2, 6)
    prompt = [5, 9, 33, 2, 71]
    used, fresh = StandaloneProposer(ModelRunner(str(draft), cfg)), StandaloneProposer(ModelRunner(str(draft), cfg))
    used.prefill("s", prompt)
    [pre] = used.propose([ProposeInput("s", len(prompt) + 2, [40, 41], spec, append_guess=True)])
    assert pre.status == 0 and len(pre.guessed_token_ids) == 1 and pre.base_committed_len == len(prompt) + 3
    assert used.runner.kv_len("s") == len(prompt) + 3  # the guessed tail holds KV until the next Propose
    real = [40, 50]
    [got] = used.propose([ProposeInput("s", len(prompt) + 2, real, spec)])
    fresh.prefill("s", prompt + real)
    [want] = fresh.propose([ProposeInput("s", len(prompt) + 2, [], spec)])
    assert (got.tree.token_ids, got.tree.parents) == (want.tree.token_ids, want.tree.parents)
    assert used.runner.kv_len("s") == len(prompt) + 2


# ---------------------------------------------------------------- feature drafts (the EAGLE family)
@pytest.fixture(scope="module")
def demo_reference():
    """Six held-out prompts of the bundled demo target and its HF greedy continuations."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from tandem.args import DEFAULT_MODEL

    lines = (DEFAULT_MODEL / "heldout_prompts.jsonl").read_text().splitlines()[:6]
    prompts = [json.loads(line)["prompt_ids"][:48] for line in lines]
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    return prompts, want


@pytest.mark.parametrize("algorithm,steps,topk,ndt", [
    pytest.param("EAGLE3", 3, 1, 4, id="eagle3-chain"),
    pytest.param("EAGLE3", 4, 3, 8, id="eagle3-tree"),
    pytest.param("NEXTN", 3, 1, 4, id="nextn-chain"),  # the bundled target's own MTP layer
    pytest.param("EAGLE", 3, 2, 6, id="eagle-tree-mtp"),
])
async def test_feature_draft_predrafts_hit_and_miss_and_output_is_hf_greedy(demo_reference, algorithm, steps,
                                                                             topk, ndt):
    """The bundled EAGLE-3 head and MTP layer pre-draft from their own hidden states over the guessed path: some
    guesses come true (their trees are verified as drafted), some do not (the draft rolls back), the requests run
    concurrently, and every output equals HF greedy and the sequential loop's."""
    import asyncio

    from tandem.args import DEFAULT_EAGLE, DEFAULT_EAGLE3, DEFAULT_MODEL

    prompts, want = demo_reference
    draft = DEFAULT_EAGLE3 if algorithm == "EAGLE3" else DEFAULT_EAGLE
    async with local_stack(DEFAULT_MODEL, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt, max_total_tokens=8192, enable_overlap_drafting=True) as scheduler:
        results = await asyncio.gather(*(generate_ids(scheduler, p, 32, request_id=f"f{i}")
                                         for i, p in enumerate(prompts)))
        await _assert_no_kv_leak(scheduler)
        metrics = scheduler.metrics
    assert [got for got, _, _ in results] == want
    hits = sum(usage.predraft_hits for _, usage, _ in results)
    misses = sum(usage.predraft_misses for _, usage, _ in results)
    # /metrics counts what usage reports, and the time a pre-draft Propose and a Verify were in flight together
    assert metrics.predrafts.labels("hit")._value.get() == hits
    assert metrics.predrafts.labels("miss")._value.get() == misses
    assert metrics.overlap_busy._value.get() > 0
    accepted = sum(usage.accepted_draft_tokens for _, usage, _ in results)
    assert hits > 0 and misses > 0, f"hits {hits}, misses {misses}: both paths must run"
    assert accepted > len(prompts) * 8, "pre-drafted trees should be about as good as fresh ones"


async def test_sampled_output_with_predrafts_follows_the_target_distribution(tmp_path):
    """χ² through the gateway with pre-drafting on: many seeded requests of one prompt, sampled at temperature 0.45;
    the fifth token (verified from a pre-drafted tree when the guess about the step before came true) given the most
    frequent first four follows HF's target distribution, and pre-drafts were used."""
    import asyncio
    import collections

    import torch
    from scipy.stats import chisquare

    target = make_tiny_model("llama", tmp_path / "target", std=0.35)
    draft = perturbed_copy(target, tmp_path / "draft", noise=0.01)
    hf = load_hf_model(target)
    prompt, n, temperature = [3, 17, 42, 9, 100, 55], 2000, 0.45
    async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=2, topk=1,
                           num_draft_tokens=3, enable_overlap_drafting=True, max_total_tokens=64 * 1024) as scheduler:
        results = []
        for wave in range(0, n, 200):  # within the gateway's queue bound
            results += await asyncio.gather(*(generate_ids(scheduler, prompt, 6, temperature=temperature, seed=i,
                                                           request_id=f"x{i}") for i in range(wave, wave + 200)))
    assert sum(usage.predraft_hits for _, usage, _ in results) > 100

    def probs(ids):
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor([ids])).logits[0, -1].float() / temperature, dim=-1)

    outs = [got for got, _, _ in results]
    prefix = list(collections.Counter(tuple(o[:4]) for o in outs).most_common(1)[0][0])
    fifth = collections.Counter(o[4] for o in outs if o[:4] == prefix)
    p = probs([*prompt, *prefix])
    total = sum(fifth.values())
    assert total >= 150, f"only {total} samples of the conditioned fifth token"
    support = [t for t in range(p.numel()) if p[t] * total >= 1.0]  # expected count >= 1; the rest pooled
    rest = total - sum(fifth.get(t, 0) for t in support)
    observed = [fifth.get(t, 0) for t in support] + [rest]
    expected = [float(p[t]) * total for t in support]
    expected.append(total - sum(expected))
    assert chisquare(observed, expected).pvalue > 1e-3


async def test_predrafting_survives_losing_the_draft_pod_mid_stream(demo_reference):
    """The draft pod disappears while pre-drafts are in flight: its sequences step target-only from then on and every
    output is still HF greedy."""
    import asyncio

    from tandem.args import DEFAULT_EAGLE3, DEFAULT_MODEL

    prompts_, want = demo_reference
    async with local_stack(DEFAULT_MODEL, algorithm="EAGLE3", draft_path=DEFAULT_EAGLE3, num_steps=3, topk=1,
                           num_draft_tokens=4, max_total_tokens=8192, enable_overlap_drafting=True) as scheduler:
        tasks = [asyncio.create_task(generate_ids(scheduler, p, 32, request_id=f"l{i}"))
                 for i, p in enumerate(prompts_)]
        while scheduler.num_steps < 3:
            await asyncio.sleep(0.005)
        await scheduler.test_servers[1].stop(grace=None)
        results = await asyncio.gather(*tasks)
    assert [got for got, _, _ in results] == want
