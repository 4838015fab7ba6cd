"""Overlap scheduling (gateway/overlap.py): two halves of the running batch ping-pong between the draft and target
pods. The mode choice is measured (unit tests below); output is unchanged with the halves on — greedy equals HF
`generate` for concurrent requests of every drafting algorithm, EOS inside an accepted run, a draft pod lost
mid-stream, and seeded sampling gives the sequential loop's tokens."""
from __future__ import annotations

import asyncio

import pytest

from gateway.overlap import PINGPONG, SEQUENTIAL, OverlapSchedule
from tests.stack import generate_ids, local_stack, perturbed_copy
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts
from tests.tiny_models import load_hf_model, make_tiny_model


# ---------------------------------------------------------------------------------------------- the mode choice
def _run(schedule: OverlapSchedule, batch: int, rates: dict[str, float], iterations: int) -> list[str]:
    modes = []
    for _ in range(iterations):
        mode = schedule.mode_for(batch)
        schedule.observe(batch, mode, tokens=int(rates[mode] * 10), seconds=10.0)
        modes.append(mode)
    return modes


def test_small_batches_never_split():
    schedule = OverlapSchedule()
    assert {schedule.mode_for(1) for _ in range(50)} == {SEQUENTIAL}


def test_both_modes_are_measured_then_the_faster_is_kept_and_the_other_re_probed():
    schedule = OverlapSchedule(warm=3, probe_every=20, probe_len=4)
    modes = _run(schedule, 8, {SEQUENTIAL: 100.0, PINGPONG: 150.0}, 120)
    assert modes[:3] == [SEQUENTIAL] * 3  # warm-up: sequential first
    assert modes[3:7] == [PINGPONG] * 4  # then ping-pong (its first iteration is transitional: not counted)
    steady = modes[7:]
    assert steady.count(PINGPONG) > 0.8 * len(steady)  # the faster one wins
    assert SEQUENTIAL in steady  # and the other is probed again now and then
    assert schedule.rates()[8][PINGPONG] == pytest.approx(150.0)


def test_the_slower_split_is_dropped():
    schedule = OverlapSchedule(warm=3, probe_every=20, probe_len=4)
    steady = _run(schedule, 4, {SEQUENTIAL: 100.0, PINGPONG: 60.0}, 120)[8:]
    assert steady.count(SEQUENTIAL) > 0.8 * len(steady) and PINGPONG in steady


def test_a_split_that_is_only_slightly_faster_is_not_taken():
    """The sequential loop is the safe side: ping-pong must win by the margin (10 % by default)."""
    schedule = OverlapSchedule(warm=3, probe_every=20, probe_len=4)
    steady = _run(schedule, 8, {SEQUENTIAL: 100.0, PINGPONG: 105.0}, 100)[8:]
    assert steady.count(SEQUENTIAL) > 0.8 * len(steady)


def test_buckets_decide_separately_and_a_drifting_rate_flips_the_choice():
    schedule = OverlapSchedule(warm=2, probe_every=10, probe_len=3, alpha=0.5)
    _run(schedule, 3, {SEQUENTIAL: 100.0, PINGPONG: 50.0}, 40)  # bucket 4: sequential wins
    big = _run(schedule, 40, {SEQUENTIAL: 100.0, PINGPONG: 300.0}, 40)  # bucket 64: ping-pong wins
    assert big[-10:].count(PINGPONG) >= 7  # (one probe of 3 sequential iterations may fall in the window)
    assert _run(schedule, 4, {SEQUENTIAL: 100.0, PINGPONG: 50.0}, 5).count(SEQUENTIAL) >= 4
    later = _run(schedule, 4, {SEQUENTIAL: 100.0, PINGPONG: 400.0}, 80)  # ping-pong got faster (longer contexts)
    assert later[-10:].count(PINGPONG) >= 7


def test_forced_mode_and_bad_settings():
    assert {OverlapSchedule(force=PINGPONG).mode_for(2) for _ in range(10)} == {PINGPONG}
    with pytest.raises(ValueError):
        OverlapSchedule(min_batch=1)
    with pytest.raises(ValueError):
        OverlapSchedule(force="both")


def test_pods_on_one_device_never_split_the_batch():
    """tandem serve's gateway keeps the sequential loop when a draft pod and a target pod report the same device
    (the split halved throughput on one H200); pods on different devices, or a draft without a model, measure."""
    from types import SimpleNamespace as Info

    from tandem.services import _overlap_schedule

    on, off = Info(disable_overlap_schedule=False), Info(disable_overlap_schedule=True)
    gpu0, gpu1 = Info(accelerator="cuda:GPU-a"), Info(accelerator="cuda:GPU-b")
    assert _overlap_schedule(on, [gpu0], [gpu0]) == "off"
    assert _overlap_schedule(on, [gpu0, gpu1], [gpu1]) == "off"  # one shared pair is enough
    assert _overlap_schedule(on, [gpu0], [gpu1]) == "auto"
    assert _overlap_schedule(on, [Info(accelerator="")], [Info(accelerator="")]) == "auto"  # unknown: measure
    assert _overlap_schedule(off, [gpu0], [gpu1]) == "off"


def test_predrafting_on_one_device_warns(caplog):
    """Pre-drafts compete with the Verify on one device (0.53-0.59x on one H200): tandem says so at start-up."""
    from types import SimpleNamespace as Info

    from tandem.services import _overlap_schedule

    gpu0, gpu1 = Info(accelerator="cuda:GPU-a"), Info(accelerator="cuda:GPU-b")
    predraft = Info(disable_overlap_schedule=False, enable_overlap_drafting=True)
    with caplog.at_level("WARNING", logger="tandem"):
        _overlap_schedule(predraft, [gpu0], [gpu1])
        assert "--enable-overlap-drafting" not in caplog.text
        _overlap_schedule(predraft, [gpu0], [gpu0])
    assert "--enable-overlap-drafting with draft and target pods on one device (cuda:GPU-a)" in caplog.text


# ---------------------------------------------------------------------------------------------- through the stack
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pingpong")
    target = make_tiny_model("llama", root / "target")
    return target, perturbed_copy(target, root / "draft", noise=0.03), load_hf_model(target), root


async def test_pods_report_the_device_they_compute_on(pair):
    import socket

    target, draft, _, _ = pair
    async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=2, topk=1,
                           num_draft_tokens=3) as scheduler:
        infos = [await pod.info() for pod in [*scheduler.targets.live(), *scheduler.drafts.live()]]
    assert [i.accelerator for i in infos] == [f"cpu@{socket.gethostname()}"] * 2
    assert infos[1].device == "cpu"


async def _concurrent(scheduler, all_prompts, max_new, **kw):
    return await asyncio.gather(*(generate_ids(scheduler, p, max_new + 3 * i, request_id=f"p{i}", **kw)
                                  for i, p in enumerate(all_prompts)))


@pytest.mark.parametrize("algorithm,steps,topk,ndt", [("STANDALONE", 3, 1, 4), ("STANDALONE", 3, 2, 6),
                                                      ("NGRAM", 0, 1, 8), ("EAGLE3", 3, 2, 6)],
                         ids=["standalone-chain", "standalone-tree", "ngram", "eagle3-tree"])
async def test_pingpong_greedy_matches_hf_for_concurrent_requests(pair, algorithm, steps, topk, ndt):
    target, draft, hf, root = pair
    if algorithm == "EAGLE3":
        from tests.eagle.heads import make_eagle3_head

        draft = make_eagle3_head(target, str(root / "eagle3"))
    all_prompts = prompts(hf.config.vocab_size) * 2  # 8 sequences: halves of 4
    async with local_stack(target, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt, overlap_schedule="on") as scheduler:
        results = await _concurrent(scheduler, all_prompts, 15)
        for i, (prompt, (got, usage, _)) in enumerate(zip(all_prompts, results)):
            assert got == hf_greedy(hf, prompt, 15 + 3 * i), f"{algorithm}: request {i} diverged from HF"
        assert scheduler.overlap.iterations[PINGPONG] > 0 and scheduler.overlap.iterations[SEQUENTIAL] == 0
        assert scheduler.metrics.overlap_iterations.labels(PINGPONG)._value.get() > 0
        assert scheduler.metrics.overlap_busy._value.get() > 0  # a Propose and a Verify were in flight at once
        assert sum(u.proposed_draft_tokens for _, u, _ in results) > 0  # the halves really speculated
        if algorithm != "EAGLE3":  # (a random EAGLE-3 head is rarely right; the noisy copy and n-grams are)
            assert sum(u.accepted_draft_tokens for _, u, _ in results) > 0
        await _assert_no_kv_leak(scheduler)
        assert not scheduler._pending


async def test_pingpong_stops_on_eos_inside_an_accepted_run(pair):
    target, draft, hf, _ = pair
    all_prompts = prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p, 20) for p in all_prompts]
    eos = want[1][6]  # a token the greedy run emits: some request stops early, mid-step, while the others go on
    async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=1,
                           num_draft_tokens=4, eos_token_ids=[eos], overlap_schedule="on") as scheduler:
        results = await asyncio.gather(*(generate_ids(scheduler, p, 20, request_id=f"e{i}")
                                         for i, p in enumerate(all_prompts)))
        for prompt, (got, _, _) in zip(all_prompts, results):
            assert got == hf_greedy(hf, prompt, 20, eos=eos)
        await _assert_no_kv_leak(scheduler)


async def test_pingpong_survives_losing_the_draft_pod_mid_stream(pair):
    target, draft, hf, _ = pair
    all_prompts = prompts(hf.config.vocab_size)
    async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=1,
                           num_draft_tokens=4, overlap_schedule="on") as scheduler:
        tasks = [asyncio.create_task(generate_ids(scheduler, p, 40, request_id=f"l{i}"))
                 for i, p in enumerate(all_prompts)]
        while scheduler.num_steps < 4:
            await asyncio.sleep(0.005)
        await scheduler.test_servers[1].stop(grace=None)  # the draft pod disappears while both halves run
        results = await asyncio.gather(*tasks)
        for prompt, (got, _, finish) in zip(all_prompts, results):
            assert got == hf_greedy(hf, prompt, 40) and finish.value == "length"


async def test_pingpong_sampling_gives_the_sequential_loops_tokens(pair):
    """Seeded sampling: each sequence draws from its own seeded stream over the same trees, so the halves must give
    exactly the sequential loop's tokens (whose distribution the χ² tests check)."""
    target, draft, hf, _ = pair
    all_prompts = prompts(hf.config.vocab_size)
    outputs = {}
    for mode in ("off", "on"):
        async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=2,
                               num_draft_tokens=6, overlap_schedule=mode) as scheduler:
            results = await _concurrent(scheduler, all_prompts, 16, temperature=0.8, seed=11)
            outputs[mode] = [got for got, _, _ in results]
            assert (scheduler.overlap is None) == (mode == "off")
    assert outputs["on"] == outputs["off"]


# ---------------------------------------------------------------------------------------------- result processing
async def _texts(scheduler, prompts_ids, stops, max_new=40):
    from gateway.types import GenerateParams, request_sampling

    async def one(i, prompt, stop):
        params = GenerateParams(request_id=f"t{i}", prompt_token_ids=prompt, max_new_tokens=max_new, stop=stop,
                                sampling=request_sampling(temperature=0.0), ignore_eos=True)
        text, finish, ids = "", None, []
        async for chunk in scheduler.generate(params):
            text, ids = text + chunk.text, ids + list(chunk.token_ids)
            finish = chunk.finish_reason or finish
        return text, finish, ids

    return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(zip(prompts_ids, stops))))


@pytest.mark.parametrize("algorithm,overlap", [("STANDALONE", "off"), ("STANDALONE", "on"), ("NONE", "off"),
                                               ("STANDALONE", "sequential"), ("NONE", "sequential"),
                                               ("EAGLE3", "predraft"), ("EAGLE3", "colocate"),
                                               ("EAGLE3", "colocate-k4")])
async def test_stop_strings_end_exactly_where_they_match_with_delivery_off_the_critical_path(algorithm, overlap):
    """Outputs are detokenized and stop-matched while the next call is in flight (Sequence.deliver): the next
    Propose, or with plain decoding (4 decode steps per call) the next Verify. A stop string found then truncates
    exactly as before, the tokens committed past it are never streamed, and concurrent neighbours are unaffected.
    The bundled demo pair (real tokenizer), STANDALONE chain, and plain decoding."""
    from gateway.tokenizer import Tokenizer
    from tandem.args import DEFAULT_DRAFT, DEFAULT_EAGLE3, DEFAULT_MODEL

    tokenizer = Tokenizer(DEFAULT_MODEL)
    texts = ["def fibonacci(n):\n    ", "import os\nimport ", "class Stack:\n    def ", "for i in range("]
    prompts_ids = [tokenizer.encode(t) for t in texts]
    shape = dict(draft_path=DEFAULT_DRAFT, num_steps=3, topk=1, num_draft_tokens=4) if algorithm != "NONE" else dict(
        num_continuous_decode_steps=4)
    if overlap == "predraft":  # pre-drafts (the bundled EAGLE-3 head): a stop inside a pre-drafted step's tokens
        shape = dict(draft_path=DEFAULT_EAGLE3, num_steps=3, topk=1, num_draft_tokens=4, enable_overlap_drafting=True)
        overlap = "auto"
    elif overlap.startswith("colocate"):  # the draft in the target's process: each Verify drafts the next tree, and
        # with k = 4 one call runs four speculative steps (a stop string may match in the first of them)
        shape = dict(draft_path=DEFAULT_EAGLE3, num_steps=3, topk=2, num_draft_tokens=6, colocate=True,
                     num_continuous_decode_steps=4 if overlap.endswith("k4") else 1)
        overlap = "auto"
    elif overlap == "sequential":  # --disable-overlap-schedule: streamed before the next call goes out
        shape["defer_delivery"], overlap = False, "off"
    async with local_stack(DEFAULT_MODEL, algorithm=algorithm, tokenizer=tokenizer, overlap_schedule=overlap,
                           **shape) as scheduler:
        assert scheduler._drafts_nothing == (algorithm == "NONE")
        full = await _texts(scheduler, prompts_ids, [[]] * len(texts))
        # Stops that match early, mid-way (inside a multi-token accepted run, usually) and never.
        stops = [[full[0][0][2:5]], [full[1][0][10:13]], [full[2][0][20:24]], ["\u2603never"]]
        got = await _texts(scheduler, prompts_ids, stops)
        for (want_text, _, _), (text, finish, _), stop in zip(full, got, stops):
            if stop[0] in want_text:
                assert text == want_text[: want_text.index(stop[0])] and finish.value == "stop"
            else:
                assert text == want_text and finish.value == "length"
        await _assert_no_kv_leak(scheduler)


@pytest.mark.parametrize("defer", [True, False])
async def test_the_sequential_loop_streams_a_steps_tokens_before_the_next_call(pair, defer):
    """--disable-overlap-schedule (defer_delivery False): every token a Verify committed has been streamed when the
    next Propose or Verify goes out; by default some are still held then (streamed while that call is in flight).
    Output is the same either way."""
    target, draft, hf, _ = pair
    held_at_calls = []
    async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=1, num_draft_tokens=4,
                           overlap_schedule="off", defer_delivery=defer) as scheduler:
        for clients, name in ((scheduler.targets.clients, "verify"), (scheduler.drafts.clients, "propose")):
            for client in clients:
                call = getattr(client, name)

                async def watched(*args, call=call, **kwargs):
                    held_at_calls.append(sum(len(s._outbox) for s in scheduler._running))
                    return await call(*args, **kwargs)

                setattr(client, name, watched)
        cases = prompts(hf.config.vocab_size)[:2]
        outs = await asyncio.gather(*(generate_ids(scheduler, p, 20, request_id=f"d{i}") for i, p in enumerate(cases)))
    for prompt, (got, _, _) in zip(cases, outs):
        assert got == hf_greedy(hf, prompt, 20)
    assert len(held_at_calls) > 10
    assert (max(held_at_calls) > 0) == defer, held_at_calls
