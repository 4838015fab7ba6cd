"""Persistent bidi step streams (VerifyStream / ProposeStream) between the gateway clients and the model services.

Through the real path: greedy output over streams == over unary == HF; a target pod stopped mid-generation fails
over from the stream path. Against fake servicers: a hung stream response hits the call deadline (PodUnavailable)
and the next call opens a new stream; a server without the stream methods is served unary; a call made while the
pod's stream is busy goes unary; a rejected request ends the stream with INVALID_ARGUMENT (ValueError) and the
stream is reopened.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from core.steps import DraftPrefillInput, ProposeInput, SpecShape, VerifyInput
from core.types import DraftTree
from gateway.clients import PodUnavailable, StopRule, TargetClient
from gateway.types import request_sampling
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from protos.wire import start_server
from tests.stack import generate_ids, local_stack, perturbed_copy
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts
from tests.tiny_models import load_hf_model, make_tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    target = make_tiny_model("llama", root / "target")
    return target, perturbed_copy(target, root / "draft", noise=0.03), load_hf_model(target)


def _set_streams(scheduler, enabled: bool) -> None:
    for pod in [*scheduler.targets.clients, *scheduler.drafts.clients]:
        for stream in pod._streams:
            stream.enabled = enabled


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_stream_and_unary_step_paths_give_identical_greedy_output(pair, overlap):
    target, draft, hf = pair
    outputs = {}
    for streams in (True, False):
        async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=2,
                               num_draft_tokens=6, enable_overlap_drafting=overlap) as scheduler:
            _set_streams(scheduler, streams)
            outs = []
            for i, prompt in enumerate(prompts(hf.config.vocab_size)):
                got, _, _ = await generate_ids(scheduler, prompt, 11 + 6 * i, request_id=f"s{i}")
                assert got == hf_greedy(hf, prompt, 11 + 6 * i), f"streams={streams} prompt {i} diverged from HF"
                outs.append(got)
            await _assert_no_kv_leak(scheduler)
            verify = scheduler.targets.clients[0].verify_stream
            propose = scheduler.drafts.clients[0].propose_stream
            if streams:  # one stream per pod for the whole run, and no step fell back to unary
                assert (verify.num_opened, verify.num_unary) == (1, 0)
                assert (propose.num_opened, propose.num_unary) == (1, 0)
            else:
                assert verify.num_opened == propose.num_opened == 0 and verify.num_unary > 0 < propose.num_unary
        outputs[streams] = outs
    assert outputs[True] == outputs[False]


async def test_target_stopped_mid_generation_fails_over_from_the_stream_path(pair):
    """Two in-process target pods; the one holding the sequence is stopped after the first chunk: the stream call
    raises PodUnavailable, the sequence is re-prefilled on the other pod and the output is still HF greedy."""
    from gateway.scheduler import Scheduler, SchedulerConfig, SpecConfig
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target

    target, _, hf = pair
    servers, clients = {}, []
    for _ in range(2):
        engine = TargetEngine(ModelRunner(str(target), EngineConfig(device="cpu", dtype="float32",
                                                                    max_total_tokens=4096)))
        verify = engine.verify
        engine.verify = lambda inputs, verify=verify: (time.sleep(0.01), verify(inputs))[1]  # ~100 steps/s at most
        server, port = await serve_target(engine, str(target), "127.0.0.1", 0)
        client = TargetClient(f"127.0.0.1:{port}", timeout_s=10)
        servers[client.address] = server
        clients.append(client)
    info = await clients[0].info()
    scheduler = Scheduler(targets=clients, drafts=[], tokenizer=None, model_name="tiny",
                          max_context_len=info.max_context_len, vocab_size=info.vocab_size, eos_token_ids=[],
                          spec=SpecConfig(), config=SchedulerConfig(request_timeout_s=60, pod_retry_s=60))
    await scheduler.start()
    prompt = prompts(hf.config.vocab_size)[1]
    try:
        from gateway.types import GenerateParams

        params = GenerateParams(request_id="f", prompt_token_ids=prompt, max_new_tokens=60,
                                sampling=request_sampling(temperature=0.0), detokenize=False)
        out, stopped = [], None
        async for chunk in scheduler.generate(params):
            out.extend(chunk.token_ids)
            if stopped is None:
                stopped = scheduler._by_request["f"].target
                await servers[stopped.address].stop(grace=None)
        assert out == hf_greedy(hf, prompt, 60)
        assert 1 < len(out) and scheduler.targets.is_down(stopped)
        survivor = next(c for c in clients if c is not stopped)
        assert survivor.verify_stream.num_opened == 1 and survivor.verify_stream.num_unary == 0
    finally:
        await scheduler.close()
        for server in servers.values():
            await server.stop(grace=None)
        for client in clients:
            await client.close()


# ------------------------------------------------------------------------------------------------ fake servicers
def _answer(request: pb.VerifyRequest) -> pb.VerifyResponse:
    return pb.VerifyResponse(results=[pb.VerifyResult(seq_id=s.seq_id, token_ids=[s.root_token_id + 1])
                                      for s in request.seqs])


class FakeTarget(pb_grpc.TargetServiceServicer):
    """Echoes root+1 per sequence. hang_first: the first stream reads its first request and never answers;
    delay_s: every answer waits that long; seq_id "bad" is rejected with INVALID_ARGUMENT (both RPCs)."""

    def __init__(self, hang_first: bool = False, delay_s: float = 0.0):
        self.hang_first = hang_first
        self.delay_s = delay_s
        self.streams = 0
        self.unary = 0
        self.cancelled = asyncio.Event()

    async def _handle(self, request, context):
        if any(s.seq_id == "bad" for s in request.seqs):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad sequence")
        await asyncio.sleep(self.delay_s)
        return _answer(request)

    async def Verify(self, request, context):
        self.unary += 1
        return await self._handle(request, context)

    async def VerifyStream(self, request_iterator, context):
        self.streams += 1
        hang = self.hang_first and self.streams == 1
        async for request in request_iterator:
            if hang:
                try:
                    await asyncio.Event().wait()  # never answers; ends when the client cancels the stream
                finally:
                    self.cancelled.set()
            yield await self._handle(request, context)


async def _serve(servicer=None, handlers=None):
    def register(server):
        if handlers is not None:  # an older server: only the listed methods exist
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.v1.TargetService",
                                                                                  handlers),))
        else:
            pb_grpc.add_TargetServiceServicer_to_server(servicer, server)
    server, port, _ = await start_server(register, ["tandem.v1.TargetService"], "127.0.0.1", 0)
    return server, port


def _item(seq_id: str = "a", root: int = 5) -> VerifyInput:
    return VerifyInput(seq_id, 3, root, DraftTree([], []), request_sampling(), StopRule(10, [], False, 2))


async def test_hung_stream_response_hits_the_deadline_and_the_next_call_reopens():
    fake = FakeTarget(hang_first=True)
    server, port = await _serve(fake)
    client = TargetClient(f"127.0.0.1:{port}", timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(PodUnavailable, match="DEADLINE_EXCEEDED"):
            await client.verify([_item()])
        assert time.monotonic() - start < 3.0
        await asyncio.wait_for(fake.cancelled.wait(), 5)  # the hung stream was cancelled, not left open
        results = await client.verify([_item("b", 7)])
        assert [(r.seq_id, r.token_ids) for r in results] == [("b", [8])]
        assert fake.streams == 2 and fake.unary == 0 and client.verify_stream.num_opened == 2
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_server_without_stream_methods_is_served_unary_from_then_on():
    fake = FakeTarget()
    handlers = {"Verify": grpc.unary_unary_rpc_method_handler(
        fake.Verify, request_deserializer=pb.VerifyRequest.FromString,
        response_serializer=pb.VerifyResponse.SerializeToString)}
    server, port = await _serve(handlers=handlers)
    client = TargetClient(f"127.0.0.1:{port}", timeout_s=5)
    try:
        for root in (1, 2, 3):
            assert (await client.verify([_item(root=root)]))[0].token_ids == [root + 1]
        stream = client.verify_stream
        assert not stream.enabled and stream.num_opened == 1 and stream.num_unary == 3 and fake.unary == 3
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_concurrent_calls_on_one_pod_keep_their_own_responses():
    fake = FakeTarget(delay_s=0.2)
    server, port = await _serve(fake)
    client = TargetClient(f"127.0.0.1:{port}", timeout_s=5)
    try:
        got = await asyncio.gather(*(client.verify([_item(f"c{i}", 10 * i)]) for i in range(3)))
        assert [(r[0].seq_id, r[0].token_ids) for r in got] == [(f"c{i}", [10 * i + 1]) for i in range(3)]
        assert client.verify_stream.num_unary == 2 and fake.unary == 2 and fake.streams == 1  # busy stream -> unary
        assert (await client.verify([_item("d", 1)]))[0].token_ids == [2]  # the stream is reused afterwards
        assert fake.streams == 1
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_rejected_request_ends_the_stream_with_value_error_then_reopens():
    fake = FakeTarget()
    server, port = await _serve(fake)
    client = TargetClient(f"127.0.0.1:{port}", timeout_s=5)
    try:
        assert (await client.verify([_item()]))[0].token_ids == [6]
        with pytest.raises(ValueError, match="bad sequence"):
            await client.verify([_item("bad")])
        assert (await client.verify([_item(root=8)]))[0].token_ids == [9]
        assert fake.streams == 2 and client.verify_stream.enabled
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_pod_gone_between_steps_raises_pod_unavailable_and_a_restarted_pod_is_reached():
    fake = FakeTarget()
    server, port = await _serve(fake)
    client = TargetClient(f"127.0.0.1:{port}", timeout_s=5)
    try:
        assert (await client.verify([_item()]))[0].token_ids == [6]
        await server.stop(grace=None)
        with pytest.raises(PodUnavailable):
            await client.verify([_item()])
        server = grpc.aio.server()
        pb_grpc.add_TargetServiceServicer_to_server(fake, server)
        if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
            pytest.skip("the port was taken in between")
        await server.start()
        deadline = time.monotonic() + 10
        while True:  # the channel reconnects with backoff; every failed attempt is a clean PodUnavailable
            try:
                assert (await client.verify([_item(root=1)]))[0].token_ids == [2]
                break
            except PodUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
        assert client.verify_stream.enabled and fake.unary == 0
    finally:
        await client.close()
        await server.stop(grace=None)


def test_disable_step_streams_flag_reaches_only_the_gateway():
    from tandem.cli import build_parser
    from tandem.launch import commands

    def cmds(*flags):
        args = build_parser().parse_args(["serve", "--speculative-algorithm", "NGRAM", *flags])
        args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 0, 1, 8
        return commands(args)

    on, off = cmds(), cmds("--disable-step-streams")
    assert not any("--disable-step-streams" in c for c in on.values())
    assert [n for n, c in off.items() if "--disable-step-streams" in c] == ["gateway"]
    assert build_parser().parse_args(["gateway", "--target-address", "x:1", "--disable-step-streams"]).disable_step_streams


async def test_real_draft_service_stream_validates_and_counts_like_unary():
    """ProposeStream on the real DraftServicer: a sequence with bad input gets an INVALID result of its own (the
    stream and the call go on), and steps are counted like unary calls under rpc="Propose"."""
    from prometheus_client import generate_latest

    from draft_service.ngram import NgramConfig
    from draft_service.ngram_draft import NgramDraft
    from draft_service.server import serve_draft
    from gateway.clients import DraftClient
    from tandem.observability import ServiceMetrics
    from tests.ops.conftest import parse_metrics

    metrics = ServiceMetrics("draft")
    server, port = await serve_draft(NgramDraft(NgramConfig(num_draft_tokens=4)), "", "127.0.0.1", 0, metrics=metrics)
    client = DraftClient(f"127.0.0.1:{port}", timeout_s=5)
    tokens = [5, 6, 7, 8, 5, 6, 7]
    try:
        assert await client.prefill([DraftPrefillInput("n", tokens)]) == [0]
        ok = ProposeInput("n", len(tokens), [], SpecShape(3, 1, 4))
        first = await client.propose([ok])
        assert first[0].status == 0 and first[0].tree.token_ids[:1] == [8]  # the n-gram 5 6 7 -> 8
        bad = await client.propose([ProposeInput("m", 1, [1, 2], SpecShape(3, 1, 4)), ok])
        assert [p.status for p in bad] == [3, 0] and bad[1].tree.token_ids == first[0].tree.token_ids  # 3 = INVALID
        assert (await client.propose([ok]))[0].tree.token_ids == first[0].tree.token_ids
        assert client.propose_stream.num_opened == 1 and client.propose_stream.num_unary == 0
    finally:
        await client.close()
        await server.stop(grace=None)
    got = parse_metrics(generate_latest(metrics.registry).decode())
    assert got['tandem:rpc_requests_total{code="OK",rpc="Propose",service="draft"}'] == 3
    assert got['tandem:forward_time_seconds_count{rpc="Propose",service="draft"}'] == 3
    assert not any("ProposeStream" in key for key in got)  # the stream itself is not counted as one long RPC


def test_rpc_overhead_bench_runs(tmp_path):
    """CPU smoke of bench/rpc_overhead.py (trivial servicer only): both paths measured, the stream path stayed a
    stream (the bench asserts it). Timings are reported, never asserted."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "rpc.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "rpc_overhead.py"), "--servers", "trivial", "--iters", "20",
                    "--warmup", "5", "--block", "7", "--out", str(out)], check=True, timeout=120, cwd=root,
                   capture_output=True)
    result = json.loads(out.read_text())["servers"]["trivial"]
    assert result["unary"]["n"] == result["stream"]["n"] == 20
    assert result["stream"]["p50_ms"] > 0 and "stream_saves_ms" in result
