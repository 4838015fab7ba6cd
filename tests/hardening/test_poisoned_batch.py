"""Issue 15 §1/§6: one bad sequence fails alone. The services answer INVALID for that sequence and run the rest of
its batch (Prefill, Verify, Propose); the gateway refuses out-of-domain fields before they reach a batch (one check
for REST and gRPC), and when a pod still refuses a whole call it retries the sequences one by one so only the bad one
fails. Poisoned REST batches: 8 valid requests beside a bad one all finish."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from core.steps import DraftPrefillInput, PrefillInput, VerifyInput
from core.types import DraftTree
from gateway.clients import STATUS_INVALID, STATUS_OK, StopRule
from gateway.types import GenerateParams, InvalidRequest, request_sampling
from protos.tandem.v1 import tandem_pb2 as pb
from tests.ops.conftest import ops_stack
from tests.stack import generate_ids, local_stack


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("poison"), vocab_size=256, num_hidden_layers=2)


def _prefill_item(seq_id: str, tokens: list[int], **sampling) -> PrefillInput:
    return PrefillInput(seq_id, tokens, True, request_sampling(**sampling), StopRule(8, [], True, len(tokens)))


async def test_target_prefill_and_verify_fail_only_the_bad_sequence(model):
    async with local_stack(model) as scheduler:
        target = scheduler.targets.clients[0]
        vocab = 256
        good = [_prefill_item(f"g{i}", [1, 2, 3 + i], temperature=0.0) for i in range(3)]
        bad_token = _prefill_item("bad-token", [1, vocab + 5])
        # A seed past 2**63 passes the wire (uint64) but not the engine: built on the wire directly.
        results = await target.prefill([*good[:2], bad_token, good[2]])
        assert [r.status for r in results] == [STATUS_OK, STATUS_OK, STATUS_INVALID, STATUS_OK]
        request = pb.TargetPrefillRequest(seqs=[
            pb.TargetPrefillSeq(seq_id="s-ok", token_ids=[1, 2], sample_next_token=True,
                                sampling=pb.SamplingParams(temperature=1.0, seed=7), stop=pb.StopParams(max_new_tokens=4)),
            pb.TargetPrefillSeq(seq_id="s-bad", token_ids=[1, 2], sample_next_token=True,
                                sampling=pb.SamplingParams(temperature=1.0, seed=2**64 - 1),
                                stop=pb.StopParams(max_new_tokens=4)),
            pb.TargetPrefillSeq(seq_id="s-topp", token_ids=[1, 2], sample_next_token=True,
                                sampling=pb.SamplingParams(temperature=1.0, top_p=1.5),
                                stop=pb.StopParams(max_new_tokens=4)),
            pb.TargetPrefillSeq(seq_id="s-topk", token_ids=[1, 2], sample_next_token=True,
                                sampling=pb.SamplingParams(temperature=1.0, top_k=-5),
                                stop=pb.StopParams(max_new_tokens=4))])
        response = await target.stub.Prefill(request, timeout=30)
        assert [r.status for r in response.results] == [pb.SEQ_STATUS_OK] + [pb.SEQ_STATUS_INVALID] * 3
        assert "seed" in response.results[1].error and "top_p" in response.results[2].error

        roots = {r.seq_id: r.token_ids[-1] for r in results if r.status == STATUS_OK}
        sampling, stop = request_sampling(temperature=0.0), StopRule(8, [], True, 3)
        items = [VerifyInput(f"g{i}", 4, roots[f"g{i}"], DraftTree([5, 6], [-1, 0]), sampling, stop) for i in range(3)]
        items[1] = VerifyInput("g1", 4, roots["g1"], DraftTree([vocab + 1], [-1]), sampling, stop)  # out of the vocabulary
        out = await target.verify(items)
        assert [r.status for r in out] == [STATUS_OK, STATUS_INVALID, STATUS_OK]
        assert "outside" in out[1].error
        huge = VerifyInput("g0", 4 + len(out[0].token_ids), out[0].token_ids[-1],
                           DraftTree([1] * 600, list(range(-1, 599))), sampling, stop)
        assert (await target.verify([huge]))[0].status == STATUS_INVALID  # > max tree nodes (512)
        assert scheduler.targets.live() == scheduler.targets.clients  # never marked down


async def test_draft_propose_and_prefill_fail_only_the_bad_sequence(model):
    async with local_stack(model, algorithm="STANDALONE", draft_path=model, num_steps=2, topk=1,
                           num_draft_tokens=3) as scheduler:
        draft = scheduler.drafts.clients[0]
        statuses = await draft.prefill([DraftPrefillInput("a", [1, 2, 3]), DraftPrefillInput("b", [1, 999]),
                                        DraftPrefillInput("c", [4, 5])])
        assert statuses == [STATUS_OK, STATUS_INVALID, STATUS_OK]
        request = pb.ProposeRequest(seqs=[
            pb.ProposeSeq(seq_id="a", committed_len=4, new_token_ids=[7],
                          spec=pb.SpecParams(num_steps=2, topk=1, num_draft_tokens=3)),
            pb.ProposeSeq(seq_id="c", committed_len=3, new_token_ids=[300],  # out of the vocabulary
                          spec=pb.SpecParams(num_steps=2, topk=1, num_draft_tokens=3)),
            pb.ProposeSeq(seq_id="c", committed_len=3, new_token_ids=[6],
                          spec=pb.SpecParams(num_steps=10_000, topk=1000, num_draft_tokens=3))])
        response = await draft.stub.Propose(request, timeout=30, metadata=draft.metadata)
        assert [r.status for r in response.results] == [pb.SEQ_STATUS_OK, pb.SEQ_STATUS_INVALID,
                                                        pb.SEQ_STATUS_INVALID]
        assert len(response.results[0].tree.token_ids) == 2


@pytest.mark.parametrize("sampling,field", [
    (dict(seed=2**64 - 1), "seed"), (dict(seed=-2), "seed"), (dict(top_k=10**12), "top_k"),
    (dict(top_k=True), "top_k")])
def test_sampling_domain_is_checked_at_the_gateway(sampling, field):
    with pytest.raises(InvalidRequest) as info:
        request_sampling(**sampling)
    assert info.value.param == field


async def test_scheduler_isolates_a_sequence_a_pod_refuses_the_whole_call_for(model):
    """A pod (or an older one) that answers INVALID_ARGUMENT for a whole batched call: the gateway retries each
    sequence alone, so only the one it is about fails; the others finish with the text they would have alone."""
    async with local_stack(model) as scheduler:
        target = scheduler.targets.clients[0]
        real_prefill = target.prefill

        async def picky_prefill(items):
            if any(i.token_ids[0] == 13 for i in items):
                raise ValueError("token 13 refused")
            return await real_prefill(items)

        target.prefill = picky_prefill
        alone, _, _ = await generate_ids(scheduler, [1, 2, 3], 6, request_id="alone")
        prompts = [[1, 2, 3]] * 4 + [[13, 2, 3]] + [[1, 2, 3]] * 4
        outcomes = await asyncio.gather(*(generate_ids(scheduler, p, 6, request_id=f"r{i}")
                                          for i, p in enumerate(prompts)), return_exceptions=True)
        assert isinstance(outcomes[4], InvalidRequest)
        assert [o[0] for i, o in enumerate(outcomes) if i != 4] == [alone] * 8
        assert scheduler.targets.live() == scheduler.targets.clients


POISON = [{"seed": -1}, {"top_k": 1e12}, {"stop_token_ids": [1e12]}, {"seed": 2**64 + 1}, {"top_p": 7},
          {"temperature": -1}, {"logit_bias": {"999999": 1}}, {"max_tokens": True}]


@pytest.mark.slow
async def test_rest_poisoned_batch_loses_no_valid_request(tiny_model):
    """8 valid requests sent together with each bad one: all 8 finish (200), the bad one is a 400 (seed -1 is
    "no seed": a 200). Counted: requests tried, 5xx seen, valid requests lost."""
    from gateway.scheduler import SchedulerConfig

    async with ops_stack(tiny_model, serve_http=True, scheduler_config=SchedulerConfig(request_timeout_s=60)) as st:
        tried = five_xx = lost = 0
        async with httpx.AsyncClient(base_url=st.base_url, timeout=60) as client:
            for poison in POISON:
                body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
                bad = client.post("/v1/completions", json={**body, **poison})
                valid = [client.post("/v1/completions", json=body) for _ in range(8)]
                responses = await asyncio.gather(bad, *valid)
                tried += len(responses)
                five_xx += sum(r.status_code >= 500 for r in responses)
                lost += sum(r.status_code != 200 for r in responses[1:])
                expected = 200 if poison == {"seed": -1} else 400
                assert responses[0].status_code == expected, (poison, responses[0].text)
                if expected == 400:
                    assert responses[0].json()["error"]["type"] == "invalid_request_error"
        print(f"poisoned batches: requests tried {tried}, 5xx {five_xx}, valid requests lost {lost}")
        assert (five_xx, lost) == (0, 0)
