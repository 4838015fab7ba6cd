"""Multi-layer EAGLE (--enable-multi-layer-eagle): draft step s runs the target checkpoint's MTP layer s (DeepSeek's
chain, draft_service/eagle.py). Every Propose's chain equals a from-scratch run of every layer over all committed
tokens (each layer's KV is right after any commit pattern), greedy output equals HF `generate` of the target through
the services, a rollback past the kept features is answered STALE, and the trainer's K-layer unroll is the served
chain."""
from __future__ import annotations

import random

import pytest
import torch

from draft_service.eagle import EagleProposer
from draft_service.proposer import ProposeInput, SpecShape, Status
from runtime.config import EngineConfig, ModelConfig
from tests.tiny_models import add_mtp_layers, load_hf_model, make_tiny_model

CPU = EngineConfig(device="cpu", dtype="float32", max_total_tokens=1024, attention_backend="torch", block_size=4)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    return add_mtp_layers(make_tiny_model("llama", tmp_path_factory.mktemp("mle")), num_layers=3)


def drive(proposer: EagleProposer, spec: SpecShape, num_proposes: int, seed: int = 0, seq_id: str = "s"):
    """The gateway's side without a target: commits 1..S+1 random tokens (random features) between Proposes, sometimes
    none; yields (committed tokens, their features, the chain proposed)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    width = proposer.feature_size
    committed = [rng.randrange(3, 320) for _ in range(6)]
    feats = torch.randn(len(committed) - 1, width, generator=gen)  # row i: feature of committed[i]
    assert proposer.prefill(seq_id, committed, feats) == Status.OK
    new_ids, new_feats = [], feats[:0]
    for _ in range(num_proposes):
        [out] = proposer.propose([ProposeInput(seq_id, len(committed), new_ids, spec, new_feats)])
        assert out.status == Status.OK
        yield committed, feats, out.tree.token_ids
        n = rng.choice([0, 1, 1, 2, spec.num_steps + 1])
        new_ids = [rng.randrange(3, 320) for _ in range(n)]
        new_feats = torch.randn(n, width, generator=gen)  # features of the last committed token, then new ones
        committed = committed + new_ids
        feats = torch.cat([feats, new_feats])


@pytest.mark.parametrize("steps", [2, 3])
def test_every_chain_equals_a_fresh_run_of_every_layer(mtp_target, steps):
    """Incremental Proposes (each layer's KV caught up over the window only) propose what a fresh proposer, running
    every layer over all committed tokens, proposes: no layer reads a stale or missing KV position."""
    spec = SpecShape(steps, 1, steps + 1)
    proposer = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", multi_layer_steps=steps)
    assert [type(layer).__name__ for layer in proposer.model.layers] == ["MTPLayer"] * steps
    fresh = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", multi_layer_steps=steps)
    chains = 0
    for committed, feats, chain in drive(proposer, spec, 12, seed=steps):
        assert fresh.prefill("f", committed, feats) == Status.OK
        [want] = fresh.propose([ProposeInput("f", len(committed), [], spec, feats[:0])])
        assert len(chain) == steps and chain == want.tree.token_ids
        fresh.release(["f"])
        chains += 1
    assert chains == 12
    proposer.release(["s"])
    assert proposer.runner.num_free_tokens() == proposer.runner.num_total_tokens()


def test_multi_layer_chain_differs_from_layer_zero_run_autoregressively(mtp_target):
    """The chain uses the deeper layers: the same committed state drafts otherwise with layer 0 alone (today's NEXTN
    on this checkpoint)."""
    spec = SpecShape(3, 1, 4)
    multi = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", multi_layer_steps=3)
    single = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN")
    assert len(single.model.layers) == 1
    pairs = []
    for committed, feats, chain in drive(multi, spec, 4):
        assert single.prefill("x", committed, feats) == Status.OK
        [other] = single.propose([ProposeInput("x", len(committed), [], spec, feats[:0])])
        single.release(["x"])
        pairs.append((chain, other.tree.token_ids))
    assert all(a[0] == b[0] for a, b in pairs)  # step 0 is layer 0 either way
    assert any(a != b for a, b in pairs)


def test_other_shapes_get_no_proposal_and_a_deep_rollback_is_stale(mtp_target):
    spec = SpecShape(2, 1, 3)
    proposer = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", multi_layer_steps=2)
    committed = [3, 77, 150, 8, 299, 61, 9, 12]
    feats = torch.randn(len(committed) - 1, proposer.feature_size)
    assert proposer.prefill("s", committed, feats) == Status.OK
    [tree] = proposer.propose([ProposeInput("s", len(committed), [], SpecShape(3, 1, 4), feats[:0])])
    assert tree.status == Status.OK and tree.tree.token_ids == []  # not the served chain: no proposal
    [out] = proposer.propose([ProposeInput("s", len(committed), [], spec, feats[:0])])
    assert out.status == Status.OK and len(out.tree.token_ids) == 2
    # The gateway resends features from the kept length on; layer 1 would need one more: re-sync.
    [out] = proposer.propose([ProposeInput("s", 5, [299, 44], spec, feats[3:5])])
    assert out.status == Status.STALE and "rolled back" in out.error
    assert proposer.num_seqs == 0 and proposer.runner.num_free_tokens() == proposer.runner.num_total_tokens()


# ---------------------------------------------------------------------------------------------- through the services
@pytest.mark.parametrize("steps", [2, 3])
async def test_multi_layer_eagle_equals_hf_greedy_through_the_services(mtp_target, steps):
    import asyncio

    from tests.stack import generate_ids, local_stack
    from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts

    hf = load_hf_model(mtp_target)
    all_prompts = prompts(hf.config.vocab_size)
    async with local_stack(mtp_target, algorithm="NEXTN", draft_path=mtp_target, num_steps=steps, topk=1,
                           num_draft_tokens=steps + 1, multi_layer=True) as scheduler:
        assert len(scheduler.test_proposer.model.layers) == steps
        results = await asyncio.gather(*(generate_ids(scheduler, p, 14 + 3 * i, request_id=f"m{i}")
                                         for i, p in enumerate(all_prompts)))
        for i, (prompt, (got, usage, _)) in enumerate(zip(all_prompts, results)):
            assert got == hf_greedy(hf, prompt, 14 + 3 * i), f"prompt {i} diverged from HF"
        assert sum(u.proposed_draft_tokens for _, u, _ in results) > 0
        await _assert_no_kv_leak(scheduler)
