"""--num-continuous-decode-steps: plain decode steps run back to back inside one Verify call. Same tokens as one step
per call (greedy == HF), stops and length limits cut a chunk short, features cover every emitted token, accept
accounting counts target forwards (not calls), and bad values are refused with INVALID_ARGUMENT / a clear error."""
from __future__ import annotations

import pytest
import torch

from core.types import FinishReason
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from runtime.sampling import SamplingParams
from runtime.speculative.tree import DraftTree
from core.types import StopRule
from target_service.engine import PrefillInput, Status, TargetEngine, VerifyInput
from tests.stack import generate_ids, local_stack
from tests.tiny_models import make_tiny_model

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("cont"))


def _engine(path, **kw) -> TargetEngine:
    return TargetEngine(ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096)), **kw)


def _start(engine: TargetEngine, max_new: int = 64, stop_ids=frozenset()) -> tuple[list[int], StopRule]:
    stop = StopRule(max_new, stop_token_ids=stop_ids, prompt_len=len(PROMPT))
    out = engine.prefill([PrefillInput("s", PROMPT, True, SamplingParams(temperature=0.0), stop, return_features=True)])
    return [*PROMPT, *out[0].token_ids], stop


def _decode(engine, committed, stop, steps):
    return engine.verify([VerifyInput("s", len(committed), committed[-1], DraftTree([], []), SamplingParams(temperature=0.0), stop,
                                      return_features=True, num_decode_steps=steps)])[0]


def test_one_call_of_k_steps_equals_k_calls_of_one(tiny):
    one, many = _engine(tiny, final_norm_features=True), _engine(tiny, final_norm_features=True)
    c1, stop = _start(one)
    c2, _ = _start(many)
    for _ in range(7):
        out = _decode(one, c1, stop, 1)
        c1 += out.token_ids
    out = _decode(many, c2, stop, 7)
    assert out.status == Status.OK and out.num_steps == 7 and len(out.token_ids) == 7
    assert [*c2, *out.token_ids] == c1
    assert out.features is not None and out.features.shape[0] == 7  # one feature row per token that gained KV


def test_length_and_stop_tokens_cut_the_chunk(tiny):
    engine = _engine(tiny)
    committed, _ = _start(engine)
    free = engine.verify([VerifyInput("s", len(committed), committed[-1], DraftTree([], []), SamplingParams(temperature=0.0),
                                      StopRule(64, prompt_len=len(PROMPT)), num_decode_steps=6)])[0]
    assert len(free.token_ids) == 6 and free.finish_reason is None
    engine = _engine(tiny)
    committed, stop = _start(engine, max_new=4)  # 1 token from prefill: 3 more fit
    out = _decode(engine, committed, stop, 10)
    assert len(out.token_ids) == 3 and out.finish_reason == FinishReason.LENGTH and out.num_steps == 3
    engine = _engine(tiny)
    stop_token = free.token_ids[2]
    committed, stop = _start(engine, stop_ids=frozenset({stop_token}))
    out = _decode(engine, committed, stop, 10)
    assert out.finish_reason == FinishReason.STOP and out.token_ids[-1] == stop_token and stop_token not in out.token_ids[:-1]


async def test_through_the_services_greedy_equals_hf_and_steps_count_forwards(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=21, min_new_tokens=21,
                              do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    async with local_stack(tiny, num_continuous_decode_steps=4) as scheduler:
        out, usage, _ = await generate_ids(scheduler, PROMPT, 21)
    assert out == want
    assert usage.verify_steps + 1 == usage.completion_tokens  # tau 1: forwards counted, not calls


async def test_requests_arriving_during_a_prefill_join_the_batch_before_it_steps(tiny):
    """Prefill first: a request that arrives while the first one's Prefill is in flight is prefilled before the batch
    steps, so the first Verify call (4 decode steps) holds both — not the second a whole call behind (a burst split
    into admission waves). Both outputs equal each one run alone."""
    import asyncio

    other = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    async with local_stack(tiny, num_continuous_decode_steps=4) as scheduler:
        alone = [(await generate_ids(scheduler, p, 12, request_id=f"alone{i}"))[0] for i, p in enumerate((PROMPT, other))]
        target, calls, late = scheduler.targets.clients[0], [], []
        prefill, verify = target.prefill, target.verify

        async def slow_prefill(items):
            if not late:  # the second request arrives during the first Prefill
                late.append(asyncio.ensure_future(generate_ids(scheduler, other, 12, request_id="b")))
                while not scheduler._waiting:
                    await asyncio.sleep(0.001)
            calls.append(("prefill", sorted(i.seq_id for i in items)))
            return await prefill(items)

        async def recorded(items, **kw):
            calls.append(("verify", sorted(i.seq_id for i in items)))
            return await verify(items, **kw)

        target.prefill, target.verify = slow_prefill, recorded
        first = await generate_ids(scheduler, PROMPT, 12, request_id="a")
        second = await late[0]
    assert [first[0], second[0]] == alone
    kinds = [kind for kind, _ in calls]
    assert kinds[:2] == ["prefill", "prefill"], calls  # both admitted before any Verify
    assert len(calls[2][1]) == 2, calls  # the first Verify steps both


async def test_bad_step_counts_are_refused(tiny):
    from core.types import StopRule
    from core.steps import VerifyInput
    from core.types import DraftTree
    from gateway.scheduler import SchedulerConfig
    from gateway.types import request_sampling

    with pytest.raises(ValueError, match="num_continuous_decode_steps"):
        SchedulerConfig(num_continuous_decode_steps=0)
    async with local_stack(tiny) as scheduler:
        target = scheduler.targets.clients[0]
        item = VerifyInput("nobody", 2, 1, DraftTree([], []), request_sampling(temperature=0.0), StopRule(8, [], False, 1), num_decode_steps=1000)
        [result] = await target.verify([item])  # refused for this sequence alone (INVALID), not for the call
        assert result.status == 3 and "num_decode_steps 1000 exceeds" in result.error


def test_flag_reaches_the_gateway_only():
    from tandem.cli import build_parser
    from tandem.launch import commands

    args = build_parser().parse_args(["serve", "--num-continuous-decode-steps", "4"])
    cmds = commands(args)
    assert "--num-continuous-decode-steps" in cmds["gateway"]
    assert all("--num-continuous-decode-steps" not in c for name, c in cmds.items() if name != "gateway")


@pytest.mark.parametrize("flags,want", [([], 4), (["--speculative-algorithm", "STANDALONE"], 1),
                                        (["--num-continuous-decode-steps", "1"], 1),
                                        (["--speculative-algorithm", "NGRAM", "--num-continuous-decode-steps", "3"], 3),
                                        (["--speculative-algorithm", "STANDALONE", "--speculative-adaptive"], 4)])
def test_default_is_several_steps_per_call_only_when_nothing_drafts(flags, want):
    """Plain decoding through the gateway pays a round trip per Verify call: 4 steps per call by default
    (bench/results/serve_decode_h200); a speculative loop needs each step's outcome for the next draft, except the
    draft-free steps of adaptive speculation (its large-batch tiers decode plainly)."""
    from tandem.cli import build_parser
    from tandem.services import continuous_decode_steps

    assert continuous_decode_steps(build_parser().parse_args(["gateway", "--target-address", "h:1", *flags])) == want


@pytest.mark.parametrize("flags,want", [(["--speculative-algorithm", "EAGLE3"], 4),
                                        (["--speculative-algorithm", "STANDALONE", "--speculative-adaptive"], 4),
                                        (["--speculative-algorithm", "EAGLE3", "--num-continuous-decode-steps", "1"], 1),
                                        (["--speculative-algorithm", "EAGLE3", "--num-continuous-decode-steps", "3"], 3)])
def test_speculative_steps_per_call_follow_the_flag_else_the_measured_default(flags, want):
    """With the draft in the target's process a Verify call runs several speculative steps: as many as
    --num-continuous-decode-steps says, else AUTO_SPECULATIVE_STEPS_PER_CALL (4, chosen on the H200:
    bench/results/session11_h200)."""
    from tandem.cli import build_parser
    from tandem.services import speculative_steps_per_call

    assert speculative_steps_per_call(build_parser().parse_args(["gateway", "--target-address", "h:1", *flags])) == want
