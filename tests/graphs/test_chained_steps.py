"""Speculative steps chained on the device (runtime/speculative/fused_step.py, target_service/chained.py): with the
draft in the target's process and the static verify and draft steps (eager device code on CPU), the k - 1 steps of a
Verify call after its first run as one device run with one readback. Greedy output equals HF `generate` and the
step-by-step stack's, with stops and length limits inside a chained run, several sequences at once (and padding rows
in a bucket), and no KV left behind; the chained run counts one readback for all its steps."""
from __future__ import annotations

import asyncio

import pytest
import torch

from tests.stack import generate_ids, local_stack
from tests.test_colocate import _draft, models  # noqa: F401 - the module fixture: tiny target + its drafts
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts


@pytest.mark.parametrize("algorithm,steps,topk,ndt,k,num_seqs", [
    ("EAGLE3", 4, 3, 10, 4, 3), ("EAGLE3", 3, 1, 4, 3, 3), ("STANDALONE", 3, 2, 6, 5, 3), ("STANDALONE", 3, 1, 4, 2, 9),
])
async def test_chained_steps_greedy_matches_hf(models, algorithm, steps, topk, ndt, k, num_seqs):
    """Sequences of different lengths at once (9: a bucket of 16 with padding rows), each through chained runs; the
    outputs equal HF greedy, the runs happened, and the KV is all returned."""
    path, _, hf = models
    base = prompts(hf.config.vocab_size)
    cases = [(i, base[i % 3] + [3 + i] * (i // 3)) for i in range(num_seqs)]
    async with local_stack(path, algorithm=algorithm, draft_path=_draft(models, algorithm), num_steps=steps,
                           topk=topk, num_draft_tokens=ndt, colocate=True, static_steps=True, inline_steps=False,
                           static_max_bs=16, num_continuous_decode_steps=k) as scheduler:
        chained = scheduler.test_servicers[0].chained
        assert chained is not None and chained.fused
        lengths = [(20 if num_seqs <= 4 else 8) + 7 * (i % 3) for i in range(num_seqs)]  # (the interpreter is slow)
        results = await asyncio.gather(*(generate_ids(scheduler, p, n, request_id=f"r{i}")
                                         for (i, p), n in zip(cases, lengths)))
        for (_, prompt), n, (got, _, _) in zip(cases, lengths, results):
            assert got == hf_greedy(hf, prompt, n)
        assert chained.num_runs > 0 and chained.num_steps > 0
        await _assert_no_kv_leak(scheduler)


@pytest.mark.parametrize("algorithm,steps,topk,ndt", [("EAGLE3", 4, 3, 10), ("STANDALONE", 3, 1, 4)])
async def test_chained_steps_with_the_fused_kernels_match_hf(models, monkeypatch, algorithm, steps, topk, ndt):
    """What the CUDA graphs run on a GPU, forced on here (the Triton interpreter): the fused norm/RoPE/SiLU, the
    top-k, the tree levels and selection, the region mask, the packed walk and the chain glue kernels; greedy output
    still equals HF."""
    from runtime.models import llama as llama_model

    used: set[str] = set()
    real = llama_model._k

    def spy(name):
        used.add(name)
        return real(name)

    for module in ("runtime.models.llama", "runtime.speculative.fused_step", "runtime.speculative.draft_step",
                   "runtime.speculative.verify_step"):
        monkeypatch.setattr(f"{module}._k", spy)
    path, _, hf = models
    base = prompts(hf.config.vocab_size)
    cases = [base[0], base[1] + [7, 7]]
    with llama_model.fused_elementwise(True):
        async with local_stack(path, algorithm=algorithm, draft_path=_draft(models, algorithm), num_steps=steps,
                               topk=topk, num_draft_tokens=ndt, colocate=True, static_steps=True,
                               inline_steps=False, static_max_bs=4, num_continuous_decode_steps=3) as scheduler:
            chained = scheduler.test_servicers[0].chained
            results = await asyncio.gather(*(generate_ids(scheduler, p, 14, request_id=f"r{i}")
                                             for i, p in enumerate(cases)))
            for prompt, (got, _, _) in zip(cases, results):
                assert got == hf_greedy(hf, prompt, 14)
            assert chained.num_runs > 0
            await _assert_no_kv_leak(scheduler)
    assert {"chain_glue", "tree", "topk", "verify_greedy", "norm"} <= used, used


async def test_chained_equals_step_by_step_with_stop_tokens_inside_a_run(models):
    """A stop token met inside a chained run ends the sequence there (the device's later steps are dropped): the
    same tokens and finish reasons as the step-by-step stack, for stops at several depths."""
    path, _, hf = models
    prompt = prompts(hf.config.vocab_size)[0]
    reference = hf_greedy(hf, prompt, 40)
    outcomes = {}
    for chain in (True, False):
        async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=4, topk=3,
                               num_draft_tokens=10, colocate=True, static_steps=True, num_continuous_decode_steps=4,
                               inline_steps=False, chain_steps=chain) as scheduler:
            got = []
            for at in (5, 13, 27):  # the token at this index stops the request
                ids, finish, _ = await generate_ids(scheduler, prompt, 40, stop_token_ids=[reference[at]],
                                                    request_id=f"s{at}")
                got.append((ids, finish))
            if chain:
                assert scheduler.test_servicers[0].chained.num_runs > 0
            await _assert_no_kv_leak(scheduler)
        outcomes[chain] = got
    assert outcomes[True] == outcomes[False]
    for (ids, _), at in zip(outcomes[True], (5, 13, 27)):
        first = reference.index(reference[at])
        assert ids == reference[:first + 1]


@pytest.mark.parametrize("num_seqs", [1, 6])
async def test_a_chained_call_reads_the_device_back_once(models, monkeypatch, num_seqs):
    """Host reads of a chained call (ChainedSteps.run: the reservations, the device run, the commits) at batch 1 and
    6: one device->host copy for all its steps — a static step's read_back, and any .tolist / .item / .cpu of a
    tensor it did not return (host memory already on a GPU; on CPU the device's output itself). And a whole Verify
    call runs chained, its first step included."""
    import threading

    from runtime.speculative.static_step import StaticStep
    from target_service.chained import ChainedSteps

    path, _, hf = models
    active, counts, read = {}, [], set()  # active: thread id -> reads so far in its chained call
    original_read_back = StaticStep.read_back

    def read_back(step, out):
        me = threading.get_ident()
        if me in active:
            active[me] += 1
        host = original_read_back(step, out)
        read.add(host.untyped_storage().data_ptr())
        return host

    monkeypatch.setattr(StaticStep, "read_back", read_back)
    for name in ("tolist", "item", "cpu"):
        def counted(t, *a, _original=getattr(torch.Tensor, name), **kw):
            me = threading.get_ident()
            if me in active and t.untyped_storage().data_ptr() not in read:
                active[me] += 1
            return _original(t, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    run = ChainedSteps.run

    def counted_run(self, inputs, steps):
        me = threading.get_ident()
        active[me] = 0
        try:
            result = run(self, inputs, steps)
        finally:
            n = active.pop(me)
        if result:
            counts.append((len(inputs), n))
        return result

    monkeypatch.setattr(ChainedSteps, "run", counted_run)
    async with local_stack(path, algorithm="STANDALONE", draft_path=_draft(models, "STANDALONE"), num_steps=3,
                           topk=2, num_draft_tokens=6, colocate=True, static_steps=True, inline_steps=False,
                           static_max_bs=8, num_continuous_decode_steps=6) as scheduler:
        engine, plain = scheduler.test_engine, [0]
        verify = engine.verify

        def counted_verify(inputs):
            plain[0] += 1
            return verify(inputs)

        engine.verify = counted_verify
        base = prompts(hf.config.vocab_size)
        cases = [base[i % 3] + [5 + i] * (i // 3) for i in range(num_seqs)]
        results = await asyncio.gather(*(generate_ids(scheduler, p, 18, request_id=f"b{i}")
                                         for i, p in enumerate(cases)))
        for p, (got, _, _) in zip(cases, results):
            assert got == hf_greedy(hf, p, 18)
    assert counts and all(n == 1 for _, n in counts), counts
    assert max(size for size, _ in counts) == num_seqs
    # the first trees came with the Prefills, so the Verify calls ran chained from their first step (the last ones,
    # cut short by the length limit, or calls whose batch changed, may not)
    assert plain[0] <= 2, plain


def test_fused_steps_refuse_mismatched_shapes(models):
    """A draft step whose trees are not the verify step's width cannot be chained (a clear error at build)."""
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from runtime.speculative.draft_step import StaticDraftStep, StepShape
    from runtime.speculative.fused_step import FusedSteps
    from runtime.speculative.verify_step import StaticVerifyStep

    path, _, _ = models
    config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048, attention_backend="triton")
    target = ModelRunner(str(path), config)
    draft = ModelRunner(str(_draft(models, "STANDALONE")), config)
    verify = StaticVerifyStep(target, 6, 2)
    step = StaticDraftStep(draft, StepShape(3, 2, 8, catch_up=4), 2, feature_head=False)
    with pytest.raises(ValueError, match="draft trees of 8 tokens, verify step of 6"):
        FusedSteps(verify, step)


def test_glue_warm_up_over_every_bucket_of_a_large_max_bs(models):
    """Capture warms up the glue code of every bucket (largest first) before capturing it: at --cuda-graph-max-bs 64
    (serve's default, 11 buckets) the step counter must not walk past max_steps (it did: an index_copy_ assert on the
    GPU at start-up). Run here on CPU with the steps' output buffers zeroed, bucket by bucket as capture does."""
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from runtime.speculative.draft_step import StaticDraftStep, StepShape
    from runtime.speculative.fused_step import FusedSteps
    from runtime.speculative.verify_step import StaticVerifyStep

    path, _, _ = models
    config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096, attention_backend="triton")
    verify = StaticVerifyStep(ModelRunner(str(path), config), 4, 64)
    step = StaticDraftStep(ModelRunner(str(_draft(models, "STANDALONE")), config), StepShape(3, 1, 4, catch_up=4), 64,
                           feature_head=False)
    fused = FusedSteps(verify, step, max_steps=16)
    assert len(fused.sizes) * 2 > fused.max_steps  # more warm-up passes than records
    w = fused.width
    for b in reversed(fused.sizes):
        fused._buffers(b)
        verified = torch.zeros(b * (2 * w + 1) * 8, dtype=torch.uint8)
        fused.warm_up(b, verified, torch.full((b, 2 * (w - 1)), -1, dtype=torch.int64))
    assert int(fused.step_index) == 0


async def test_chained_steps_with_run_ahead_hits_and_misses(models):
    """Run-ahead (on by default on a GPU) over chained calls: the pod runs the expected next call, chained, while the
    answer travels, and the next call takes its outputs (hits). Greedy == HF, no KV left behind."""
    path, _, hf = models
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=2,
                           num_draft_tokens=6, colocate=True, static_steps=True, inline_steps=False, run_ahead=True,
                           num_continuous_decode_steps=3) as scheduler:
        servicer = scheduler.test_servicers[0]
        cases = list(enumerate(prompts(hf.config.vocab_size)[:3]))

        async def staggered(i, prompt):
            await asyncio.sleep(0.3 * i)
            return await generate_ids(scheduler, prompt, 18 + 5 * i, request_id=f"a{i}")

        results = await asyncio.gather(*(staggered(i, p) for i, p in cases))
        for (i, prompt), (got, _, _) in zip(cases, results):
            assert got == hf_greedy(hf, prompt, 18 + 5 * i)
        assert servicer.run_ahead_counts["hit"] > 0 and servicer.chained.num_runs > 0, servicer.run_ahead_counts
        await _assert_no_kv_leak(scheduler)


async def _synthetic_run(target, oracle, prompts_, rate, spec, k, chain):
    """SYNTHETIC with its head co-located and the static steps (the services' way in bench/speculative.py
    --colocate): (outputs, accepted drafts per request, chained runs)."""
    from draft_service.synthetic import SyntheticHead, SyntheticProposer
    from gateway.clients import DraftClient, TargetClient
    from gateway.scheduler import Scheduler, SchedulerConfig, SpecConfig
    from runtime.config import EngineConfig, ModelConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target

    config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=8192, attention_backend="triton")
    target_config = ModelConfig.from_pretrained(str(target))
    proposer = SyntheticProposer(rate, target_config.vocab_size, oracle, seed=0,
                                 head=SyntheticHead(target_config, config, 64, 256))
    assert proposer.enable_static_step(spec, max_bs=4)
    engine = TargetEngine(ModelRunner(str(target), config))
    assert engine.enable_static_verify(spec.num_draft_tokens, max_bs=4)
    server, port = await serve_target(engine, str(target), "127.0.0.1", 0, inline_steps=False, proposer=proposer,
                                      chain_steps=chain)
    tclient, dclient = TargetClient(f"127.0.0.1:{port}"), DraftClient(f"127.0.0.1:{port}")
    info = await tclient.info()
    scheduler = Scheduler(targets=[tclient], drafts=[dclient], tokenizer=None, model_name="tiny",
                          max_context_len=info.max_context_len, vocab_size=info.vocab_size, eos_token_ids=[],
                          spec=SpecConfig("SYNTHETIC", spec.num_steps, spec.topk, spec.num_draft_tokens),
                          config=SchedulerConfig(max_running_requests=8, request_timeout_s=120, drafts_on_target=True,
                                                 speculative_steps_per_call=k))
    await scheduler.start()
    try:
        results = await asyncio.gather(*(generate_ids(scheduler, p, 20, request_id=f"y{i}")
                                         for i, p in enumerate(prompts_)))
    finally:
        await scheduler.close()
        await tclient.close()
        await dclient.close()
        await server.stop(grace=None)
    runs = server.servicer.chained.num_runs if server.servicer.chained is not None else 0
    return [r[0] for r in results], [r[1].accepted_draft_tokens for r in results], runs


@pytest.mark.parametrize("steps,topk,ndt", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
async def test_synthetic_chained_trees_equal_the_host_oracle(tmp_path, steps, topk, ndt):
    """SYNTHETIC (benchmarks only) chains too: its head's static step runs for its cost while the trees come from
    the oracle on the device (draft_service/synthetic.py SyntheticTrees). Greedy == HF, and every request accepts
    exactly as many drafts as with the host's trees step by step (the same trees, position by position)."""
    import transformers

    from core.steps import SpecShape
    from draft_service.synthetic import Oracle
    from tests.tiny_models import make_tiny_model

    target = make_tiny_model("llama", tmp_path / "target")
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size)[:3]
    oracle = Oracle({tuple(p): hf_greedy(hf, p, 20 + steps) for p in ps[:2]})  # the third: unknown to it
    spec = SpecShape(steps, topk, ndt)
    chained = await _synthetic_run(target, oracle, ps, 0.7, spec, 3, chain=True)
    plain = await _synthetic_run(target, oracle, ps, 0.7, spec, 3, chain=False)
    for p, got in zip(ps, chained[0]):
        assert got == hf_greedy(hf, p, 20)
    assert chained[0] == plain[0] and chained[1] == plain[1], (chained[1], plain[1])
    assert chained[2] > 0 and plain[2] == 0
    assert sum(chained[1][:2]) > 0


async def test_a_failing_chained_run_falls_back_to_steps_one_by_one(models, monkeypatch):
    """A chained run that raises (a bug, not a request's fault) leaves target and draft as they were; the call runs
    its steps one by one and that shape is not chained again: the output is still HF's, no KV is left behind."""
    from runtime.speculative.fused_step import FusedSteps

    path, _, hf = models

    def broken(self, *args):
        raise RuntimeError("injected")

    monkeypatch.setattr(FusedSteps, "_run", broken)
    async with local_stack(path, algorithm="STANDALONE", draft_path=_draft(models, "STANDALONE"), num_steps=3,
                           topk=1, num_draft_tokens=4, colocate=True, static_steps=True, inline_steps=False,
                           num_continuous_decode_steps=3) as scheduler:
        chained = scheduler.test_servicers[0].chained
        assert chained.fused
        prompt = prompts(hf.config.vocab_size)[0]
        got, _, _ = await generate_ids(scheduler, prompt, 16)
        assert got == hf_greedy(hf, prompt, 16)
        assert not chained.fused and chained.num_runs == 0
        await _assert_no_kv_leak(scheduler)


async def test_a_mixed_batch_chains_its_greedy_sequences_and_steps_the_sampled_one(models):
    """A greedy request beside a longer sampled one (every call of the greedy one is in a mixed batch): the greedy
    sequence's steps are chained, the sampled one's run one by one in the same calls. Greedy == HF; the sampled
    tokens equal the stack's without chaining for the same seed."""
    path, _, hf = models
    greedy_prompt, sampled_prompt = prompts(hf.config.vocab_size)[:2]
    sampled = {}
    for chain in (True, False):
        async with local_stack(path, algorithm="STANDALONE", draft_path=_draft(models, "STANDALONE"), num_steps=3,
                               topk=1, num_draft_tokens=4, colocate=True, static_steps=True, inline_steps=False,
                               num_continuous_decode_steps=3, chain_steps=chain) as scheduler:
            (got, _, _), (tokens, _, _) = await asyncio.gather(
                generate_ids(scheduler, greedy_prompt, 16, request_id="g"),
                generate_ids(scheduler, sampled_prompt, 40, temperature=0.8, seed=5, request_id="s"))
            assert got == hf_greedy(hf, greedy_prompt, 16)
            sampled[chain] = tokens
            if chain:
                assert scheduler.test_servicers[0].chained.num_runs > 0
            await _assert_no_kv_leak(scheduler)
    assert sampled[True] == sampled[False] and len(sampled[True]) == 40


async def test_a_chained_run_stops_at_the_steps_its_length_limit_can_use(models, monkeypatch):
    """Near max_new_tokens a chained run is cut to the steps the sequence is sure to use (its limit at least that
    many whole accepted paths ahead), not the call's k: every chained step emits tokens, none is device work whose
    output the commit drops, and a shorter run happened. Greedy == HF."""
    from runtime.speculative.fused_step import FusedSteps
    from target_service.chained import ChainedSteps

    path, _, hf = models
    ran, runs = [], []  # steps of each device run; (steps the device ran, steps each sequence's output covers)
    fused_run, run = FusedSteps.run, ChainedSteps.run

    def recorded(self, inputs, steps):
        before = len(ran)
        outputs = run(self, inputs, steps)
        if len(ran) > before:
            runs.append((ran[-1], [out.num_steps for out in outputs.values() if out.finish_reason != "stop"]))
        return outputs

    monkeypatch.setattr(FusedSteps, "run",
                        lambda self, seqs, n, rows=None: ran.append(n) or fused_run(self, seqs, n, rows))
    monkeypatch.setattr(ChainedSteps, "run", recorded)
    k = 6
    async with local_stack(path, algorithm="STANDALONE", draft_path=_draft(models, "STANDALONE"), num_steps=3,
                           topk=2, num_draft_tokens=6, colocate=True, static_steps=True, inline_steps=False,
                           num_continuous_decode_steps=k) as scheduler:
        prompt = prompts(hf.config.vocab_size)[1]
        for n in (9, 23):
            got, _, _ = await generate_ids(scheduler, prompt, n, request_id=f"n{n}")
            assert got == hf_greedy(hf, prompt, n)
        await _assert_no_kv_leak(scheduler)
    assert runs and all(covered == [ran] * len(covered) for ran, covered in runs), runs
    assert any(ran < k for ran, _ in runs), runs
