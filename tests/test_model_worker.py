"""Where model work runs in the services (protos/model_worker.py): bounded step calls inline on the event loop,
prefills and long catch-ups on the worker thread, every call serialised in arrival order.

Unit tests of ModelWorker (threads, order, errors), then the real servicers (TargetServicer, DraftServicer over a
tiny model) choosing the path per call, and greedy output through the gRPC stack identical with inline steps on and
off.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from draft_service.server import INLINE_MAX_CATCH_UP, DraftServicer
from draft_service.standalone import StandaloneProposer
from protos.model_worker import ModelWorker
from protos.tandem.v1 import tandem_pb2 as pb
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from target_service.engine import TargetEngine
from target_service.server import INLINE_MAX_DECODE_STEPS, TargetServicer
from tests.stack import generate_ids, local_stack
from tests.test_lossless_greedy import hf_greedy
from tests.tiny_models import load_hf_model, make_tiny_model


async def test_inline_calls_run_on_the_loop_thread_and_others_on_the_worker():
    worker = ModelWorker("t")
    loop_thread = threading.get_ident()
    assert await worker.run(threading.get_ident, inline=True) == loop_thread
    assert await worker.run(threading.get_ident) != loop_thread
    off = ModelWorker("t", inline_steps=False)
    assert await off.run(threading.get_ident, inline=True) != loop_thread
    assert (worker.num_inline, worker.num_threaded, off.num_inline, off.num_threaded) == (1, 1, 0, 1)


async def test_calls_are_serialised_in_arrival_order_across_both_paths():
    worker = ModelWorker("t")
    log: list[tuple[str, str]] = []

    def work(name: str, seconds: float) -> str:
        log.append((name, "start"))
        time.sleep(seconds)
        log.append((name, "end"))
        return name

    # A slow threaded call first: the inline call queued behind it must not start until it has finished.
    results = await asyncio.gather(worker.run(work, "prefill", 0.2), worker.run(work, "step", 0.0, inline=True),
                                   worker.run(work, "prefill2", 0.05))
    assert results == ["prefill", "step", "prefill2"]
    assert log == [("prefill", "start"), ("prefill", "end"), ("step", "start"), ("step", "end"),
                   ("prefill2", "start"), ("prefill2", "end")]


async def test_errors_propagate_from_both_paths_and_free_the_lock():
    worker = ModelWorker("t")

    def boom():
        raise ValueError("bad input")

    for inline in (True, False):
        with pytest.raises(ValueError, match="bad input"):
            await worker.run(boom, inline=inline)
    assert await asyncio.wait_for(worker.run(lambda: 7, inline=True), 5) == 7


async def test_the_loop_keeps_running_during_a_threaded_call():
    worker = ModelWorker("t")
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    await worker.run(time.sleep, 0.3)
    task.cancel()
    assert ticks >= 5  # health checks and new calls are answered while a prefill runs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("worker") / "m")


def _stop(prompt_len: int) -> pb.StopParams:
    return pb.StopParams(max_new_tokens=1000, ignore_eos=True, prompt_len=prompt_len)


async def test_target_servicer_runs_prefill_threaded_and_bounded_verify_inline(tiny):
    engine = TargetEngine(ModelRunner(tiny, EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096)))
    servicer = TargetServicer(engine, tiny)
    prompt = list(range(3, 40))
    response = await servicer.Prefill(pb.TargetPrefillRequest(seqs=[pb.TargetPrefillSeq(
        seq_id="a", token_ids=prompt, sample_next_token=True, sampling=pb.SamplingParams(top_p=1.0),
        stop=_stop(len(prompt)))]), None)
    committed = prompt + list(response.results[0].token_ids)
    assert (servicer.worker.num_inline, servicer.worker.num_threaded) == (0, 1)

    def verify(steps: int, tree: tuple[list[int], list[int]] = ([], [])) -> pb.VerifyRequest:
        return pb.VerifyRequest(seqs=[pb.VerifySeq(
            seq_id="a", committed_len=len(committed), root_token_id=committed[-1],
            tree=pb.DraftTree(token_ids=tree[0], parents=tree[1]), sampling=pb.SamplingParams(top_p=1.0),
            stop=_stop(len(prompt)), num_decode_steps=steps)])

    for steps, tree, inline in ((1, ([5, 6, 7], [-1, 0, 0]), True), (INLINE_MAX_DECODE_STEPS, ([], []), True),
                                (INLINE_MAX_DECODE_STEPS + 1, ([], []), False)):
        before = servicer.worker.num_inline, servicer.worker.num_threaded
        result = (await servicer.Verify(verify(steps, tree), None)).results[0]
        assert result.status == pb.SEQ_STATUS_OK and result.token_ids
        committed += list(result.token_ids)
        after = servicer.worker.num_inline, servicer.worker.num_threaded
        assert after == (before[0] + inline, before[1] + (not inline)), (steps, before, after)
    await servicer.Release(pb.ReleaseRequest(seq_ids=["a"]), None)
    assert servicer.worker.num_inline == 3 and engine.num_seqs == 0


async def test_draft_servicer_sends_a_long_catch_up_to_the_thread_and_steps_inline(tiny):
    runner = ModelRunner(tiny, EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096))
    servicer = DraftServicer(StandaloneProposer(runner), tiny)
    prompt = [3 + i % 50 for i in range(INLINE_MAX_CATCH_UP + 20)]
    await servicer.Prefill(pb.DraftPrefillRequest(seqs=[pb.DraftPrefillSeq(seq_id="d", token_ids=prompt)]), None)

    def propose(committed_len: int, new: list[int]) -> pb.ProposeRequest:
        return pb.ProposeRequest(seqs=[pb.ProposeSeq(
            seq_id="d", committed_len=committed_len, new_token_ids=new,
            spec=pb.SpecParams(num_steps=3, topk=2, num_draft_tokens=6))])

    # The draft prefills lazily: its first Propose runs the whole prompt (threaded), the next one two tokens (inline).
    first = (await servicer.Propose(propose(len(prompt), []), None)).results[0]
    assert first.status == pb.SEQ_STATUS_OK and len(first.tree.token_ids) == 5
    assert (servicer.worker.num_inline, servicer.worker.num_threaded) == (0, 2)
    second = (await servicer.Propose(propose(len(prompt) + 2, [7, 8]), None)).results[0]
    assert second.status == pb.SEQ_STATUS_OK and len(second.tree.token_ids) == 5
    assert (servicer.worker.num_inline, servicer.worker.num_threaded) == (1, 2)
    assert runner.kv_len("d") == len(prompt) + 2  # speculative nodes rolled back, committed KV kept


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "threaded"])
async def test_greedy_through_the_stack_equals_hf_with_inline_steps_on_and_off(tiny, tmp_path, inline):
    from tests.stack import perturbed_copy

    hf = load_hf_model(tiny)
    draft = perturbed_copy(tiny, tmp_path / "draft", noise=0.03)
    prompt = [5, 9, 13, 2, 7, 11, 3]
    async with local_stack(tiny, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=2, num_draft_tokens=6,
                           inline_steps=inline) as scheduler:
        got, _, _ = await generate_ids(scheduler, prompt, 24)
        workers = [s.worker for s in scheduler.test_servicers]
    assert got == hf_greedy(hf, prompt, 24)
    for worker in workers:  # the steps took the path asked for
        assert (worker.num_inline > 0) == inline
