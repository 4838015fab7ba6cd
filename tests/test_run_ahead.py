"""--enable-run-ahead: after answering a Verify call the target pod runs the call it expects next (the same
sequences from their new committed ends, verifying the trees its co-located draft just drafted, or the same plain
decode steps) while the answer travels; each sequence of the next call whose input is exactly that gets the stored
outputs (a hit), any other rolls its run-ahead back as after a rejected step (a miss). Output is unchanged either
way: greedy equals HF `generate` with hits and misses both occurring, sampled requests (never run ahead) and greedy
ones with logprobs equal the stack's without run-ahead, and no KV is left behind."""
from __future__ import annotations

import asyncio

import pytest

from tests.stack import generate_ids, local_stack
from tests.test_colocate import _draft, models  # noqa: F401 - the module fixture: tiny target + its drafts
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts


@pytest.mark.parametrize("algorithm,steps,topk,ndt,k", [
    ("EAGLE3", 4, 3, 10, 1), ("EAGLE3", 3, 1, 4, 3), ("STANDALONE", 3, 2, 6, 2), ("NGRAM", 0, 1, 6, 1),
    ("NONE", 0, 1, 1, 4),
])
async def test_run_ahead_greedy_matches_hf_with_hits_and_misses(models, algorithm, steps, topk, ndt, k):
    """Requests that arrive one after another change the batch between calls (misses: the pod's guess of the next
    call was another batch) and then keep it (hits). Every output equals HF greedy; a hit saves the pod's work of
    a call; the sequences' KV is all returned at the end."""
    path, _, hf = models
    async with local_stack(path, algorithm=algorithm, draft_path=_draft(models, algorithm), num_steps=steps,
                           topk=topk, num_draft_tokens=ndt, colocate=algorithm != "NONE", run_ahead=True,
                           num_continuous_decode_steps=k) as scheduler:
        servicer = scheduler.test_servers[0].servicer
        cases = list(enumerate(prompts(hf.config.vocab_size)[:3]))

        async def staggered(i, prompt):
            await asyncio.sleep(0.05 * i)
            return await generate_ids(scheduler, prompt, 24 + 6 * i, request_id=f"r{i}")

        results = await asyncio.gather(*(staggered(i, p) for i, p in cases))
        for (i, prompt), (got, _, _) in zip(cases, results):
            assert got == hf_greedy(hf, prompt, 24 + 6 * i)
        counts = servicer.run_ahead_counts
        assert counts["hit"] > 0, counts
        await _assert_no_kv_leak(scheduler)


async def test_a_miss_rolls_back_target_and_draft_and_hits_count_per_sequence(models):
    """A Verify other than the expected one (here: the same sequence one step behind, as a gateway that dropped a
    step's result would send) rolls the run-ahead back: the target and its co-located draft continue from the
    committed length the call names, and the sequence's output is still HF's."""
    from core.steps import SpecShape, VerifyInput
    from core.types import SamplingParams, StopRule

    path, _, hf = models
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                           num_draft_tokens=4, colocate=True, run_ahead=True) as scheduler:
        servicer = scheduler.test_servers[0].servicer
        prompt = prompts(hf.config.vocab_size)[0]
        want = hf_greedy(hf, prompt, 40)
        got, _, _ = await generate_ids(scheduler, prompt, 12, request_id="warm")
        assert got == want[:12]
        # Drive the pod directly: prefill, one Verify (which starts a run-ahead), then a Verify that repeats the
        # first step instead of the expected next one: a miss, rolled back.
        target = scheduler.targets.clients[0]
        from core.steps import PrefillInput

        shape = SpecShape(3, 1, 4)
        stop = StopRule(max_new_tokens=40, prompt_len=len(prompt))
        greedy = SamplingParams(temperature=0.0)
        [pre] = await target.prefill([PrefillInput("x", list(prompt), True, greedy, stop, True, prefill_draft=True,
                                                   propose_next=shape)])
        committed = [*prompt, *pre.token_ids]
        first = VerifyInput("x", len(committed), committed[-1], pre.proposal.tree, greedy, stop,
                            propose_next=shape)
        [out1] = await target.verify([first])
        misses = servicer.run_ahead_counts["miss"]
        [again] = await target.verify([first])  # not what the pod ran ahead
        assert servicer.run_ahead_counts["miss"] == misses + 1
        assert again.token_ids == out1.token_ids and again.proposal.tree == out1.proposal.tree
        committed += again.token_ids
        # and the expected next call after it is a hit that continues HF's output
        nxt = VerifyInput("x", len(committed), committed[-1], again.proposal.tree, greedy, stop, propose_next=shape)
        hits = servicer.run_ahead_counts["hit"]
        [out2] = await target.verify([nxt])
        committed += out2.token_ids
        assert servicer.run_ahead_counts["hit"] == hits + 1
        # a batch that gained a sequence: x's part of the run-ahead still serves it (hits count sequences)
        other = prompts(hf.config.vocab_size)[1]
        stop_y = StopRule(max_new_tokens=40, prompt_len=len(other))
        [pre_y] = await target.prefill([PrefillInput("y", list(other), True, greedy, stop_y, True,
                                                     prefill_draft=True, propose_next=shape)])
        nxt = VerifyInput("x", len(committed), committed[-1], out2.proposal.tree, greedy, stop, propose_next=shape)
        first_y = VerifyInput("y", len(other) + 1, pre_y.token_ids[-1], pre_y.proposal.tree, greedy, stop_y,
                              propose_next=shape)
        [out3, out_y] = await target.verify([nxt, first_y])
        assert servicer.run_ahead_counts["hit"] == hits + 2
        committed += out3.token_ids
        assert committed[len(prompt):] == want[:len(committed) - len(prompt)]
        assert [*pre_y.token_ids, *out_y.token_ids] == hf_greedy(hf, other, 1 + len(out_y.token_ids))
        await target.release(["x", "y"])  # after the run-ahead the last call started: one model call at a time
        await scheduler.drafts.clients[0].release(["x", "y"])  # the pod's DraftService (its co-located draft)
        await _assert_no_kv_leak(scheduler)


async def test_a_sequence_finishing_in_a_call_does_not_stop_the_others_running_ahead(models):
    """Two sequences in one call, one of them finishing there (its token budget): the pod runs the other's next call
    ahead (before, one finished sequence stopped the whole batch's run-ahead: a draining batch, and a server whose
    batch loses a sequence in most calls, ran none), and that call is a hit whose output continues HF's. A call the
    gateway marks batch_may_grow (requests wait for admission) is not run ahead."""
    from core.steps import PrefillInput, SpecShape, VerifyInput
    from core.types import SamplingParams, StopRule

    path, _, hf = models
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                           num_draft_tokens=4, colocate=True, run_ahead=True) as scheduler:
        servicer = scheduler.test_servers[0].servicer
        target = scheduler.targets.clients[0]
        shape, greedy = SpecShape(3, 1, 4), SamplingParams(temperature=0.0)
        long_p, short_p = prompts(hf.config.vocab_size)[:2]
        stops = {"x": StopRule(max_new_tokens=40, prompt_len=len(long_p)),
                 "y": StopRule(max_new_tokens=2, prompt_len=len(short_p))}
        pres = await target.prefill([PrefillInput(seq_id, list(p), True, greedy, stops[seq_id], True,
                                                  prefill_draft=True, propose_next=shape)
                                     for seq_id, p in (("x", long_p), ("y", short_p))])
        committed = {seq_id: [*p, *pre.token_ids] for (seq_id, p), pre in zip((("x", long_p), ("y", short_p)), pres)}
        calls = [VerifyInput(seq_id, len(committed[seq_id]), committed[seq_id][-1], pre.proposal.tree, greedy,
                             stops[seq_id], propose_next=shape) for seq_id, pre in zip(("x", "y"), pres)]
        out_x, out_y = await target.verify(calls)
        assert out_y.finish_reason is not None and out_x.finish_reason is None
        committed["x"] += out_x.token_ids
        hits = servicer.run_ahead_counts["hit"]
        nxt = VerifyInput("x", len(committed["x"]), committed["x"][-1], out_x.proposal.tree, greedy, stops["x"],
                          propose_next=shape)
        [out2] = await target.verify([nxt], batch_may_grow=True)
        assert servicer.run_ahead_counts["hit"] == hits + 1
        committed["x"] += out2.token_ids
        # requests were waiting at the gateway when it sent that call: the pod did not run ahead after it
        counts = dict(servicer.run_ahead_counts)
        nxt = VerifyInput("x", len(committed["x"]), committed["x"][-1], out2.proposal.tree, greedy, stops["x"],
                          propose_next=shape)
        [out3] = await target.verify([nxt])
        assert servicer.run_ahead_counts == counts
        committed["x"] += out3.token_ids
        assert committed["x"][len(long_p):] == hf_greedy(hf, long_p, len(committed["x"]) - len(long_p))
        await target.release(["x", "y"])
        await scheduler.drafts.clients[0].release(["x", "y"])
        await _assert_no_kv_leak(scheduler)


async def test_the_gateway_marks_calls_made_while_requests_wait_for_admission(models):
    """One running request at a time (max_running_requests 1), two sent together: the first one's calls go out
    while the second waits (batch_may_grow: the pod does not run them ahead), the second's with nobody waiting (run
    ahead: hits). Both outputs equal HF greedy."""
    import dataclasses

    path, _, hf = models
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                           num_draft_tokens=4, colocate=True, run_ahead=True) as scheduler:
        scheduler.config = dataclasses.replace(scheduler.config, max_running_requests=1)
        target, flags = scheduler.targets.clients[0], []
        verify = target.verify

        async def recorded(items, batch_may_grow=False):
            flags.append((items[0].seq_id, batch_may_grow))
            return await verify(items, batch_may_grow=batch_may_grow)

        target.verify = recorded
        cases = prompts(hf.config.vocab_size)[:2]
        results = await asyncio.gather(*(generate_ids(scheduler, p, 20, request_id=f"r{i}")
                                         for i, p in enumerate(cases)))
        for prompt, (got, _, _) in zip(cases, results):
            assert got == hf_greedy(hf, prompt, 20)
        first, second = flags[0][0], next(seq for seq, _ in flags if seq != flags[0][0])
        assert all(grow for seq, grow in flags if seq == first)
        assert not any(grow for seq, grow in flags if seq == second)
        assert scheduler.test_servers[0].servicer.run_ahead_counts["hit"] > 0
        await _assert_no_kv_leak(scheduler)


async def test_sampled_requests_never_run_ahead_and_logprob_requests_do_with_the_same_logprobs(models):
    """Sampled requests are not run ahead (their draws must stay where plain decoding makes them): seeded sampled
    output equals the stack's without run-ahead. Greedy requests with logprobs are, and their tokens and logprobs
    equal the stack's without run-ahead (the run-ahead computes what the call itself would)."""
    from tests.test_colocate import _run

    path, _, hf = models
    runs = {}
    for run_ahead in (False, True):
        async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                               num_draft_tokens=4, colocate=True, run_ahead=run_ahead) as scheduler:
            servicer = scheduler.test_servers[0].servicer
            cases = prompts(hf.config.vocab_size)[:2]
            sampled = await asyncio.gather(*(generate_ids(scheduler, p, 16, request_id=f"s{i}", temperature=0.8,
                                                          seed=5 + i) for i, p in enumerate(cases)))
            assert servicer.run_ahead_counts == {"hit": 0, "miss": 0}
            with_logprobs = [await _run(scheduler, p, 20, f"l{i}", temperature=0.0) for i, p in enumerate(cases)]
            assert not run_ahead or servicer.run_ahead_counts["hit"] > 0
            runs[run_ahead] = [tokens for tokens, _, _ in sampled], with_logprobs
            await _assert_no_kv_leak(scheduler)
    assert runs[True][0] == runs[False][0]
    for (tokens, logprobs, _), (want_tokens, want_logprobs, _) in zip(runs[True][1], runs[False][1]):
        assert tokens == want_tokens and len(logprobs) == len(tokens)
        assert [lp for lp, _, _ in logprobs] == pytest.approx([lp for lp, _, _ in want_logprobs], abs=1e-5)
        assert [top for _, top, _ in logprobs] == [top for _, top, _ in want_logprobs]


def test_serve_passes_run_ahead_to_every_target_process():
    """`tandem serve --enable-run-ahead` starts each target process with the flag (off by default)."""
    from tandem.cli import build_parser
    from tandem.launch import commands

    def targets(*flags):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--speculative-algorithm", "EAGLE3",
                                          "--num-target-replicas", "2", *flags])
        args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
        return [cmd for name, cmd in commands(args).items() if name.startswith("target-")]

    assert all("--enable-run-ahead" in cmd for cmd in targets("--enable-run-ahead")) and len(targets()) == 2
    assert not any("--enable-run-ahead" in cmd for cmd in targets())
    child = build_parser().parse_args(targets("--enable-run-ahead")[0][3:])
    assert child.enable_run_ahead
    assert all("--disable-run-ahead" in cmd for cmd in targets("--disable-run-ahead"))
    # the sequential loop reaches the targets too (their run-ahead is part of the overlap schedule)
    sequential = targets("--disable-overlap-schedule")
    assert all("--disable-overlap-schedule" in cmd for cmd in sequential)
    assert build_parser().parse_args(sequential[0][3:]).disable_overlap_schedule


@pytest.mark.parametrize("flags,want", [
    (["--device", "cuda"], True),  # plain decoding on a GPU
    (["--device", "cuda:1", "--speculative-algorithm", "EAGLE3", "--colocate-draft"], True),
    (["--device", "cuda", "--speculative-algorithm", "STANDALONE", "--colocate-draft"], True),
    (["--device", "cuda", "--speculative-algorithm", "EAGLE3"], False),  # a draft pod of its own chooses the trees
    (["--device", "cuda", "--speculative-algorithm", "UNO"], False),
    (["--device", "cpu"], False),  # no gain measured on CPU
    (["--device", "cuda", "--tp-size", "2"], False),  # not measured with tensor parallelism
    (["--device", "cuda", "--disable-run-ahead"], False),
    (["--device", "cpu", "--enable-run-ahead"], True),
    (["--device", "cuda", "--disable-overlap-schedule"], False),  # the sequential loop
    (["--device", "cuda", "--disable-overlap-schedule", "--enable-run-ahead"], True),
])
def test_run_ahead_default_follows_the_measurements(flags, want):
    """Run-ahead is on where the H200 measured it faster (bench/results/session13_h200): a CUDA target decoding
    plainly or drafting in its own process; the flags override."""
    from tandem.args import run_ahead
    from tandem.cli import build_parser

    args = build_parser().parse_args(["target", *flags])
    assert run_ahead(args) is want


async def test_a_run_ahead_that_fails_halfway_is_a_miss_and_the_output_is_unchanged(models):
    """The run-ahead fails after its verify advanced the target but before its draft drafted (an error on the
    worker thread): the next call counts a miss, rolls the target back and runs itself; the output is HF's."""
    import threading

    path, _, hf = models
    async with local_stack(path, algorithm="EAGLE3", draft_path=_draft(models, "EAGLE3"), num_steps=3, topk=1,
                           num_draft_tokens=4, colocate=True, run_ahead=True) as scheduler:
        servicer = scheduler.test_servers[0].servicer
        propose_next, failed = servicer._propose_next, []

        def flaky(inputs, outputs):
            if threading.current_thread() is not threading.main_thread() and not failed:  # the run-ahead's
                failed.append(True)
                raise RuntimeError("injected run-ahead failure")
            return propose_next(inputs, outputs)

        servicer._propose_next = flaky
        prompt = prompts(hf.config.vocab_size)[2]
        got, _, _ = await generate_ids(scheduler, prompt, 30, request_id="f")
        assert failed and got == hf_greedy(hf, prompt, 30)
        assert servicer.run_ahead_counts["miss"] >= 1 and servicer.run_ahead_counts["hit"] > 0
        await _assert_no_kv_leak(scheduler)


@pytest.mark.parametrize("flags,weight_bytes,env,want", [
    (["--device", "cuda"], 16 << 30, None, True),  # an 8B target decoding plainly: measured 1.11-1.15x
    (["--device", "cuda"], 16 << 20, None, False),  # the demo model: host-bound steps, measured 0.84x
    (["--device", "cuda", "--disable-run-ahead"], 16 << 30, None, False),  # prefetch is part of the run-ahead
    (["--device", "cpu"], 16 << 30, None, False),
    (["--device", "cuda"], 16 << 20, "1", True),
    (["--device", "cuda"], 16 << 30, "0", False),
    (["--device", "cpu"], 16 << 20, "1", False),  # forced on, but nothing runs ahead
])
def test_decode_prefetch_default_follows_the_measurements(monkeypatch, flags, weight_bytes, env, want):
    """Plain decode steps are prefetched by a target that runs ahead with a device-bound step (weights >= 1 GiB:
    bench/results/session21); TANDEM_DECODE_PREFETCH=1/0 forces it."""
    from tandem.args import decode_prefetch
    from tandem.cli import build_parser

    if env is None:
        monkeypatch.delenv("TANDEM_DECODE_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("TANDEM_DECODE_PREFETCH", env)
    assert decode_prefetch(build_parser().parse_args(["target", *flags]), weight_bytes) is want
