"""--colocate-draft: the draft's proposer runs in the target's process, served as that pod's DraftService, and every
Verify drafts the next tree in the same call (VerifyInput.propose_next; one round trip per step). Greedy output equals
HF `generate`, sampled output equals the separate-pods stack's for the same seeds, the Propose RPCs stop after each
sequence's first step, and a draft that loses a sequence is re-synced."""
from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from core.steps import SpecShape, VerifyInput
from core.types import DraftTree, SamplingParams, SeqStatus, StopRule
from tests.eagle.heads import make_eagle3_head
from tests.stack import generate_ids, local_stack, perturbed_copy
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts
from tests.tiny_models import make_tiny_dflash_draft, make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("colocate")
    path = make_tiny_model("llama", root / "target", num_hidden_layers=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, root, hf


def _draft(models, algorithm):
    path, root, _ = models
    if algorithm == "EAGLE3":
        return make_eagle3_head(path, str(root / "eagle3"))
    if algorithm == "STANDALONE":
        return perturbed_copy(path, root / "standalone", noise=0.05)
    if algorithm == "DFLASH":
        return make_tiny_dflash_draft(path, root / "dflash", block_size=4, target_layer_ids=[0, 2])
    return None


def _count_target_prefills(scheduler) -> list[int]:
    """Sequences the target prefilled (a fused step that failed would re-prefill to get the features back)."""
    engine, count = scheduler.test_engine, [0]
    prefill = engine.prefill

    def counted(inputs):
        count[0] += len(inputs)
        return prefill(inputs)

    engine.prefill = counted
    return count


def _count_feature_rows_on_the_wire(scheduler) -> list[int]:
    """Feature rows the target pod sends the gateway (Prefill and Verify results)."""
    target, rows = scheduler.targets.clients[0], [0]
    for name in ("prefill", "verify"):
        call = getattr(target, name)

        async def counted(items, call=call, **kwargs):
            outs = await call(items, **kwargs)
            rows[0] += sum(o.features.num_rows for o in outs if o.features is not None)
            return outs

        setattr(target, name, counted)
    return rows


def _count_calls(obj, name: str) -> list[int]:
    """How many times the async method `name` of `obj` is called from now on."""
    calls, method = [0], getattr(obj, name)

    async def counted(*args, **kwargs):
        calls[0] += 1
        return await method(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


def _count_wire_proposes(scheduler) -> list[int]:
    """How many Propose RPCs reach the target pod's DraftService (the fused proposals are not RPCs)."""
    return _count_calls(scheduler.test_servers[0].drafter, "_propose")


@pytest.mark.parametrize("algorithm,steps,topk,ndt", [
    ("EAGLE3", 3, 1, 4), ("EAGLE3", 4, 3, 10), ("STANDALONE", 3, 2, 6), ("NGRAM", 0, 1, 6), ("DFLASH", 1, 1, 4),
])
async def test_colocated_draft_greedy_matches_hf_with_one_call_per_step(models, algorithm, steps, topk, ndt):
    path, _, hf = models
    async with local_stack(path, algorithm=algorithm, draft_path=_draft(models, algorithm), num_steps=steps,
                           topk=topk, num_draft_tokens=ndt, colocate=True) as scheduler:
        assert scheduler.drafting.on_target
        proposes, prefills = _count_wire_proposes(scheduler), _count_target_prefills(scheduler)
        rows = _count_feature_rows_on_the_wire(scheduler)
        cases = list(enumerate(prompts(hf.config.vocab_size)[:3]))
        results = await asyncio.gather(*(generate_ids(scheduler, p, 16 + 4 * i, request_id=f"c{i}")
                                         for i, p in cases))
        for (i, prompt), (got, usage, _) in zip(cases, results):
            assert got == hf_greedy(hf, prompt, 16 + 4 * i)
            assert usage.verify_steps > 3
        if algorithm != "NGRAM":
            assert sum(u.proposed_draft_tokens for _, u, _ in results) > 0
        # the first tree came with the Prefill, every later one with a Verify: no Propose on the wire
        assert proposes[0] == 0, proposes[0]
        assert prefills[0] == len(cases)  # no re-prefill: every fused proposal was good
        assert rows[0] == 0  # a feature draft's features stay on the pod: prefilled and fed there
        await _assert_no_kv_leak(scheduler)


def _count_verify_calls(scheduler) -> list[int]:
    return _count_calls(scheduler.test_servers[0].servicer, "_verify")


async def _run(scheduler, prompt, max_new, request_id, **sampling):
    """(tokens, logprobs, usage) of one request, with each token's logprob and 2 alternatives."""
    from gateway.types import GenerateParams, request_sampling

    params = GenerateParams(request_id=request_id, prompt_token_ids=prompt, max_new_tokens=max_new,
                            sampling=request_sampling(**sampling), detokenize=False, logprobs=2)
    tokens, logprobs, usage = [], [], None
    async for chunk in scheduler.generate(params):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs or []
        usage = chunk.usage or usage
    return tokens, logprobs, usage


@pytest.mark.parametrize("algorithm,steps,topk,ndt", [("EAGLE3", 3, 2, 6), ("STANDALONE", 3, 1, 4), ("DFLASH", 1, 1, 4),
                                                     ("NGRAM", 0, 1, 6)])
async def test_continuous_speculative_steps_in_the_target_pod(models, algorithm, steps, topk, ndt):
    """--num-continuous-decode-steps 3 with the draft in the target's process: one Verify call runs up to three
    speculative steps (verify, draft, verify, ...). Tokens and logprobs equal one step per call's, greedy equals HF,
    seeded sampled requests are unchanged, and the calls are about a third of the steps."""
    path, _, hf = models
    cases = list(enumerate(prompts(hf.config.vocab_size)[:3]))
    runs = {}
    for k in (1, 3):
        async with local_stack(path, algorithm=algorithm, draft_path=_draft(models, algorithm), num_steps=steps,
                               topk=topk, num_draft_tokens=ndt, colocate=True,
                               num_continuous_decode_steps=k) as scheduler:
            calls = _count_verify_calls(scheduler)
            greedy = await asyncio.gather(*(_run(scheduler, p, 18 + 3 * i, f"g{i}", temperature=0.0)
                                            for i, p in cases))
            sampled = await asyncio.gather(*(_run(scheduler, p, 18, f"s{i}", temperature=0.9, seed=11 + i)
                                             for i, p in cases))
            runs[k] = greedy, sampled, calls[0]
            await _assert_no_kv_leak(scheduler)
    for (i, prompt), (tokens, logprobs, usage) in zip(cases, runs[3][0]):
        assert tokens == hf_greedy(hf, prompt, 18 + 3 * i)
        assert len(logprobs) == len(tokens)
    for k1, k3 in zip([*runs[1][0], *runs[1][1]], [*runs[3][0], *runs[3][1]]):
        assert k1[0] == k3[0]  # tokens
        assert [lp for lp, _, _ in k1[1]] == pytest.approx([lp for lp, _, _ in k3[1]], abs=1e-4)
        assert k1[2].verify_steps == k3[2].verify_steps
    steps_run = sum(u.verify_steps for _, _, u in [*runs[3][0], *runs[3][1]])
    assert runs[3][2] < 0.6 * runs[1][2] and runs[3][2] < 0.6 * steps_run, (runs[1][2], runs[3][2], steps_run)


async def test_colocated_sampled_output_equals_the_separate_pods(models):
    """Same proposer, same inputs: the fused proposals are the trees a Propose would have drafted, so seeded sampled
    requests give the same tokens with the draft in the target's process as with a draft pod of its own."""
    path, _, hf = models
    outputs = []
    for colocate in (False, True):
        async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=2,
                               num_draft_tokens=6, colocate=colocate) as scheduler:
            runs = await asyncio.gather(*(generate_ids(scheduler, p, 20, temperature=0.8, seed=7 + i,
                                                       request_id=f"s{i}")
                                          for i, p in enumerate(prompts(hf.config.vocab_size)[:3])))
            outputs.append([got for got, _, _ in runs])
    assert outputs[0] == outputs[1]


async def test_a_draft_that_loses_its_sequences_is_resynced(models):
    """The co-located draft forgets every sequence mid-stream (as after an idle sweep): its fused proposal answers
    STALE, the gateway re-prefills the draft from its committed list, and the output is unchanged."""
    path, _, hf = models
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                           num_draft_tokens=4, colocate=True) as scheduler:
        proposer = scheduler.test_proposer
        propose, calls = proposer.propose, [0]

        def forgetful(inputs):
            calls[0] += 1
            if calls[0] in (3, 6):
                proposer.release([inp.seq_id for inp in inputs])
            return propose(inputs)

        proposer.propose = forgetful
        prefills = _count_target_prefills(scheduler)
        prompt = prompts(hf.config.vocab_size)[0]
        got, usage, _ = await generate_ids(scheduler, prompt, 24)
        assert got == hf_greedy(hf, prompt, 24)
        assert calls[0] > 6 and usage.proposed_draft_tokens > 0
        # the features of fused steps stayed on the pod: each re-sync re-prefilled the target to get them back
        assert prefills[0] == 3
        await _assert_no_kv_leak(scheduler)


async def test_a_colocated_draft_marked_down_mid_stream_is_resynced_once_it_is_back(models):
    """The co-located draft's client is marked down for a while (a failed call): those steps verify target-only (their
    features are not stored after the gap the fused steps left); once the pod is back the draft is re-synced by one
    target re-prefill (which returns every feature), drafts again, and the output is unchanged."""
    path, _, hf = models
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                           num_draft_tokens=4, colocate=True) as scheduler:
        engine, calls = scheduler.test_engine, [0]
        verify = engine.verify
        pool = scheduler.drafts
        draft = pool.clients[0]

        def flaky(inputs):
            calls[0] += 1
            if calls[0] == 4:
                pool.mark_down(draft, "probe failed (test)")
            elif calls[0] == 7:
                pool.mark_up(draft)
            return verify(inputs)

        engine.verify = flaky
        prefills = _count_target_prefills(scheduler)
        prompt = prompts(hf.config.vocab_size)[1]
        got, usage, _ = await generate_ids(scheduler, prompt, 30)
        assert got == hf_greedy(hf, prompt, 30)
        assert prefills[0] == 2 and usage.proposed_draft_tokens > 0  # the prompt, then one re-sync
        await _assert_no_kv_leak(scheduler)


async def test_propose_next_to_a_target_without_a_draft_is_invalid_for_the_proposal_only(models):
    """Prefill and Verify asking a pod with no draft of its own for the next tree: the step stands, its proposal is
    INVALID with the reason."""
    path, _, hf = models
    async with local_stack(path) as scheduler:
        target = scheduler.targets.clients[0]
        prompt = prompts(hf.config.vocab_size)[0]
        from core.steps import PrefillInput

        greedy = SamplingParams()
        stop = StopRule(8, frozenset(), True, len(prompt))
        [pre] = await target.prefill([PrefillInput("x", prompt, True, greedy, stop, prefill_draft=True,
                                                   propose_next=SpecShape(3, 1, 4))])
        assert pre.status == SeqStatus.OK and len(pre.token_ids) == 1  # the prefill itself stands
        assert pre.proposal is not None and pre.proposal.status == SeqStatus.INVALID
        assert "drafts nothing" in pre.proposal.error
        [out] = await target.verify([VerifyInput("x", len(prompt) + 1, pre.token_ids[0], DraftTree([], []), greedy,
                                                 stop, propose_next=SpecShape(3, 1, 4))])
        assert out.status == SeqStatus.OK and len(out.token_ids) == 1
        assert out.proposal is not None and out.proposal.status == SeqStatus.INVALID
        assert "drafts nothing" in out.proposal.error
        await target.release(["x"])


# ---------------------------------------------------------------- flags and the launcher
def _serve(*flags: str):
    from tandem.cli import build_parser

    args = build_parser().parse_args(["serve", *flags])
    args.speculative_algorithm = args.speculative_algorithm or "NONE"
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
    return args


class _Props:
    total_memory = 80 * 2**30


def test_serve_colocate_starts_no_draft_process_and_splits_the_target_processes_memory(monkeypatch):
    from tandem.launch import commands
    from tandem.services import _colocated_memory

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props())
    args = _serve("--device", "cuda", "--speculative-algorithm", "STANDALONE", "--colocate-draft")
    cmds = commands(args)
    assert not [n for n in cmds if n.startswith("draft-")]
    target, gateway = cmds["target-0"], cmds["gateway"]
    assert "--colocate-draft" in target
    address = target[target.index("--service-host") + 1] + ":" + target[target.index("--service-port") + 1]
    assert gateway[gateway.index("--draft-address") + 1] == address
    whole = float(target[target.index("--mem-fraction-static") + 1])
    assert whole == pytest.approx(0.875)  # the only process on the GPU: the whole budget ...
    from tandem.cli import build_parser

    child = build_parser().parse_args(target[3:])
    child.speculative_algorithm = "STANDALONE"
    target_args, draft_args = _colocated_memory(child)
    # ... which the process splits between its two models as serve splits a GPU between two processes
    assert target_args.mem_fraction_static + draft_args.mem_fraction_static == pytest.approx(whole, abs=2e-3)
    assert 0.1 * whole - 1e-3 <= draft_args.mem_fraction_static <= 0.5 * whole + 1e-3
    assert child.mem_fraction_static == whole  # the caller's flags are left alone
    cpu = _serve("--device", "cpu", "--speculative-algorithm", "STANDALONE", "--colocate-draft")
    assert _colocated_memory(cpu) == (cpu, cpu)


def test_colocate_notes_where_it_does_nothing():
    from tandem.compat import startup_warnings
    from tandem.cli import build_parser

    defaults = {a.dest: a.default for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    uno = _serve("--speculative-algorithm", "UNO", "--colocate-draft")
    assert any("--colocate-draft is ignored for UNO" in n for n in startup_warnings(uno, defaults))
    plain = _serve("--colocate-draft")
    assert any("--colocate-draft is ignored" in n and "nothing drafts" in n for n in startup_warnings(plain, defaults))
    overlap = _serve("--speculative-algorithm", "EAGLE3", "--colocate-draft", "--enable-overlap-drafting",
                     "--num-draft-replicas", "2")
    notes = startup_warnings(overlap, defaults)
    assert any("--enable-overlap-drafting is ignored with --colocate-draft" in n for n in notes)
    assert any("--num-draft-replicas is ignored with --colocate-draft" in n for n in notes)
    assert overlap.enable_overlap_drafting is False


@pytest.mark.parametrize("flags,colocated", [
    (("--speculative-algorithm", "EAGLE3"), True),  # the draft would share the target's device: co-located
    (("--speculative-algorithm", "NGRAM"), True),
    (("--speculative-algorithm", "EAGLE3", "--no-colocate-draft"), False),
    (("--speculative-algorithm", "STANDALONE", "--draft-base-gpu-id", "1"), False),  # a GPU of its own
    (("--speculative-algorithm", "STANDALONE", "--num-draft-replicas", "2"), False),
    (("--speculative-algorithm", "STANDALONE", "--enable-overlap-drafting"), False),  # pre-drafts need it apart
    (("--speculative-algorithm", "UNO"), False),  # its target pods draft anyway
    ((), False),  # plain decoding
])
def test_serve_colocates_by_default_only_where_the_draft_shares_the_target_device(flags, colocated):
    from tandem.args import colocates_draft, resolve_colocation
    from tandem.cli import build_parser
    from tandem.launch import commands

    args = build_parser().parse_args(["serve", "--device", "cpu", *flags])
    args.speculative_algorithm = args.speculative_algorithm or "NONE"
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
    resolve_colocation(args)
    assert colocates_draft(args) == colocated
    cmds = commands(args)
    assert ("--colocate-draft" in cmds["target-0"]) == colocated
    if colocated:
        assert not [n for n in cmds if n.startswith("draft-")]
    # a target started on its own never loads a draft unless told to
    target = build_parser().parse_args(["target", "--speculative-algorithm", args.speculative_algorithm])
    assert not colocates_draft(target)


@pytest.mark.parametrize("k", [1, 2])
async def test_adaptive_tiers_with_the_draft_in_the_target_process(models, k):
    """--speculative-adaptive with a co-located draft: each Verify drafts the next chain at the batch size's current
    tier, so steps stay one call each; a tier that moves drafts afresh (one Propose), batches in the no-draft tier
    step target-only, and greedy output equals HF's (k speculative steps per call as well)."""
    from gateway.adaptive import AdaptiveSpec, SlotConfig

    path, _, hf = models
    adaptive = AdaptiveSpec({1: SlotConfig([1, 3], warmup_batches=2, update_interval=1, up_hysteresis=-0.4),
                             3: SlotConfig([0])}, 3)
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                           num_draft_tokens=4, colocate=True, adaptive=adaptive,
                           num_continuous_decode_steps=k) as scheduler:
        proposes, verifies = _count_wire_proposes(scheduler), _count_verify_calls(scheduler)
        cases = list(enumerate(prompts(hf.config.vocab_size)[:3]))
        solo = [await generate_ids(scheduler, p, 28, request_id=f"solo{i}") for i, p in cases[:2]]
        assert {1, 3} <= set(adaptive.slots[1].history), adaptive.slots[1].history  # the tier moved both ways
        for (i, prompt), (got, usage, _) in zip(cases, solo):
            assert got == hf_greedy(hf, prompt, 28)
            assert usage.proposed_draft_tokens > 0
        moves = sum(a != b for a, b in zip(adaptive.slots[1].history, adaptive.slots[1].history[1:]))
        assert proposes[0] <= len(solo) * moves, (proposes[0], moves)  # tier moves only (first trees: the Prefill)
        assert proposes[0] < verifies[0] / 2, (proposes[0], verifies[0])
        batch = await asyncio.gather(*(generate_ids(scheduler, p, 16, request_id=f"b{i}") for i, p in cases))
        assert [got for got, _, _ in batch] == [hf_greedy(hf, p, 16) for _, p in cases]
        assert adaptive.slots[3].batches > 0  # the batch of three stepped target-only
        await _assert_no_kv_leak(scheduler)


async def test_adaptive_tier_zero_steps_keep_a_colocated_feature_draft_in_sync(models):
    """A batch size whose tier moves between no drafting (0) and drafting, with a co-located EAGLE-3 head: the plain
    decode steps return their features to the gateway, which hands them to the draft when drafting resumes — no
    target re-prefill to recover features that stayed on the pod — and greedy output equals HF's."""
    from gateway.adaptive import AdaptiveSpec, SlotConfig

    path, _, hf = models
    adaptive = AdaptiveSpec({1: SlotConfig([1, 3]), 2: SlotConfig([0, 1], warmup_batches=1, update_interval=1)}, 1)
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                           num_draft_tokens=4, colocate=True, adaptive=adaptive) as scheduler:
        prefills = _count_target_prefills(scheduler)
        cases = list(enumerate(prompts(hf.config.vocab_size)[:2]))
        results = await asyncio.gather(*(generate_ids(scheduler, p, 24, request_id=f"t{i}") for i, p in cases))
        for (i, prompt), (got, usage, _) in zip(cases, results):
            assert got == hf_greedy(hf, prompt, 24)
        history = adaptive.slots[2].history
        assert 0 in history and 1 in history, history  # the tier left 0 and came back to drafting
        assert sum(u.proposed_draft_tokens for _, u, _ in results) > 0
        assert prefills[0] == len(cases), prefills[0]  # the first prefills only
        await _assert_no_kv_leak(scheduler)


def test_serve_passes_disable_chained_speculative_steps_to_every_target_process():
    """`tandem serve --disable-chained-speculative-steps` (the A/B switch of the chained steps) reaches each target
    process, which parses it; without it the targets chain (the default)."""
    from tandem.cli import build_parser
    from tandem.launch import commands

    def targets(*flags):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--speculative-algorithm", "EAGLE3",
                                          "--colocate-draft", "--num-target-replicas", "2", *flags])
        args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
        return [cmd for name, cmd in commands(args).items() if name.startswith("target-")]

    flag = "--disable-chained-speculative-steps"
    assert len(targets(flag)) == 2 and all(flag in cmd for cmd in targets(flag))
    assert not any(flag in cmd for cmd in targets())
    assert build_parser().parse_args(targets(flag)[0][3:]).disable_chained_speculative_steps
