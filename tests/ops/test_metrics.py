"""Prometheus metrics and structured logs: the gateway's series agree with what clients received (tokens, finish
reasons, per-request acceptance in usage), the model services export KV state and per-RPC counts on their own HTTP
port, and the JSON log lines carry request and sequence ids.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging

import httpx

from gateway.metrics import GatewayMetrics
from gateway.types import GenerateParams, request_sampling
from tandem.observability import JsonFormatter, TextFormatter
from tests.ops.conftest import ops_stack, parse_metrics, scrape


def test_per_position_counts_follow_the_accepted_path_length():
    m = GatewayMetrics()
    for accepted in (0, 3, 1, 3):  # four drafts of a depth-3 chain
        m.on_verify(accepted, 3)
    m.on_verify(0, 0)  # a target-only step is not a draft
    got = parse_metrics(m.render().decode())
    assert got["tandem:spec_decode_num_drafts_total"] == 4
    assert got["tandem:spec_decode_num_draft_tokens_total"] == 12
    assert got["tandem:spec_decode_num_accepted_tokens_total"] == 7
    assert [got[f'tandem:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)] == [
        3, 2, 2]
    assert got["tandem:spec_decode_num_target_only_steps_total"] == 1
    assert got["tandem:spec_decode_accept_length_count"] == 4
    assert got["tandem:spec_decode_accept_length_sum"] == 7 + 4  # bonus token counted once per draft


def test_a_result_of_several_steps_counts_each_step():
    """A Verify call runs several steps (continuous decode steps; a co-located draft's chained speculative steps):
    every step is a draft or a target-only step, so 1 + accepted / drafts stays the mean accept length per step."""
    m = GatewayMetrics()
    m.on_verify(10, 4 * 6, num_steps=4)  # four 6-token chains, 10 drafts accepted in all: paths of 3, 3, 2, 2
    m.on_verify(0, 0, num_steps=4)  # four plain decode steps
    got = parse_metrics(m.render().decode())
    assert got["tandem:spec_decode_num_drafts_total"] == 4
    assert got["tandem:spec_decode_num_draft_tokens_total"] == 24
    assert got["tandem:spec_decode_num_accepted_tokens_total"] == 10
    assert [got.get(f'tandem:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}', 0)
            for i in range(4)] == [4, 4, 2, 0]
    assert got["tandem:spec_decode_accept_length_count"] == 4
    assert got["tandem:spec_decode_accept_length_sum"] == 10 + 4
    assert got["tandem:spec_decode_num_target_only_steps_total"] == 4


async def test_continuous_decode_steps_count_one_target_only_step_each(tiny_model):
    from gateway.scheduler import SchedulerConfig

    config = SchedulerConfig(num_continuous_decode_steps=4)
    async with ops_stack(tiny_model, scheduler_config=config, serve_http=True) as stack:
        results = await asyncio.gather(*(_generate(stack.scheduler, f"c{i}", [9 + i, 4, 21], 13) for i in range(3)))
        gateway = await scrape(stack.base_url + "/metrics")
    steps = sum(last.usage.verify_steps for _, last in results)
    assert steps >= 3 * 12  # 12 tokens after the prefill's first, one per step
    assert gateway["tandem:spec_decode_num_target_only_steps_total"] == steps
    assert gateway.get("tandem:spec_decode_num_drafts_total", 0) == 0


async def _generate(scheduler, request_id: str, prompt: list[int], max_new_tokens: int):
    params = GenerateParams(request_id=request_id, prompt_token_ids=prompt, max_new_tokens=max_new_tokens,
                            sampling=request_sampling(temperature=0.0), ignore_eos=True)
    out, last = [], None
    async for chunk in scheduler.generate(params):
        out.extend(chunk.token_ids)
        last = chunk
    return out, last


async def test_gateway_and_service_metrics_agree_with_the_requests(tiny_model, tiny_draft):
    async with ops_stack(tiny_model, draft=tiny_draft, serve_http=True) as stack:
        results = await asyncio.gather(*(_generate(stack.scheduler, f"r{i}", [5 + i, 17, 99, 3], 20)
                                         for i in range(4)))
        # a client that goes away after the first chunk counts as an aborted request
        params = GenerateParams(request_id="gone", prompt_token_ids=[7, 8, 9], max_new_tokens=500,
                                sampling=request_sampling(temperature=0.0), ignore_eos=True)
        stream = stack.scheduler.generate(params)
        await anext(stream)
        await stream.aclose()

        gateway = await scrape(stack.base_url + "/metrics")
        accepted = sum(last.usage.accepted_draft_tokens for _, last in results)
        steps = sum(last.usage.verify_steps for _, last in results)
        assert gateway['tandem:request_success_total{finished_reason="length"}'] == 4
        assert gateway['tandem:request_success_total{finished_reason="abort"}'] == 1
        assert gateway["tandem:prompt_tokens_total"] == 4 * 4 + 3
        assert gateway["tandem:generation_tokens_total"] >= 4 * 20 + 1
        assert gateway["tandem:time_to_first_token_seconds_count"] == 5
        assert gateway["tandem:e2e_request_latency_seconds_count"] == 5
        assert gateway["tandem:inter_token_latency_seconds_count"] > 0
        # the first token comes from prefill; the aborted request's steps are counted too
        assert gateway["tandem:spec_decode_num_drafts_total"] >= steps > 0
        assert gateway["tandem:spec_decode_num_accepted_tokens_total"] >= accepted
        assert 0 < gateway['tandem:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] <= \
            gateway["tandem:spec_decode_num_drafts_total"]
        assert gateway["tandem:verify_time_seconds_count"] >= gateway["tandem:step_time_seconds_count"] > 0
        assert gateway["tandem:draft_time_seconds_count"] > 0
        assert gateway["tandem:num_requests_running"] <= 1 and gateway["tandem:num_requests_waiting"] == 0
        assert gateway['tandem:num_pods_up{kind="target"}'] == 1
        assert gateway['tandem:pod_up{address="%s",kind="draft"}' % stack.scheduler.drafts.clients[0].address] == 1

        shared = list(range(3, 40))  # two full KV blocks of it are reused by the second request
        for i in range(2):
            await _generate(stack.scheduler, f"p{i}", shared, 4)
        target = await scrape(stack.target_metrics_url)
        assert target['tandem:rpc_requests_total{code="OK",rpc="Verify",service="target"}'] > 0
        assert target['tandem:rpc_requests_total{code="OK",rpc="Prefill",service="target"}'] >= 1
        assert target['tandem:forward_time_seconds_count{rpc="Verify",service="target"}'] > 0
        assert target['tandem:kv_cache_total_tokens{service="target"}'] > 0
        # lookups leave the prompt's last token out: 4 * 3 + 2 ("gone") + 2 * 36 tokens, 32 found (2 blocks, 2nd ask)
        assert target['tandem:prefix_cache_queries_total{service="target"}'] == 4 * 3 + 2 + 2 * 36
        assert target['tandem:prefix_cache_hits_total{service="target"}'] == 32
        assert target['tandem:prefix_cache_tokens{service="target"}'] >= 32
        draft = await scrape(stack.draft_metrics_url)
        assert draft['tandem:rpc_requests_total{code="OK",rpc="Propose",service="draft"}'] > 0

        # every KV block returns once the aborted sequence is released (next loop iteration)
        for _ in range(200):
            target = await scrape(stack.target_metrics_url)
            if target['tandem:num_running_seqs{service="target"}'] == 0:
                break
            await asyncio.sleep(0.05)
        assert target['tandem:kv_cache_free_tokens{service="target"}'] == \
            target['tandem:kv_cache_total_tokens{service="target"}']
        assert target['tandem:kv_cache_usage_perc{service="target"}'] == 0


async def test_rest_errors_are_counted_by_status(tiny_model):
    async with ops_stack(tiny_model, serve_http=True) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})).status_code == 400
            assert (await client.get("/nope")).status_code == 404
            await client.get("/metrics")
            got = parse_metrics((await client.get("/metrics")).text)
    assert got['tandem:http_requests_total{path="/v1/completions",status="400"}'] == 1
    assert got['tandem:http_requests_total{path="other",status="404"}'] == 1
    assert got['tandem:http_requests_total{path="/metrics",status="200"}'] == 1


def test_json_formatter_emits_one_object_per_line_with_extra_fields():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("tests.ops.json")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("request finished %s", "ok", extra={"request_id": "cmpl-1", "seq_id": "g-1", "tokens": 3})
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["msg"] == "request finished ok" and first["level"] == "warning"
    assert first["logger"] == "tests.ops.json" and isinstance(first["ts"], float)
    assert (first["request_id"], first["seq_id"], first["tokens"]) == ("cmpl-1", "g-1", 3)
    assert "ValueError: boom" in second["exc"]


async def test_request_log_lines_carry_ids_tokens_and_accept_length(tiny_model, tiny_draft, caplog):
    caplog.set_level(logging.INFO, logger="gateway.requests")
    async with ops_stack(tiny_model, draft=tiny_draft) as stack:
        await _generate(stack.scheduler, "log-me", [5, 6, 7], 12)
    records = [r for r in caplog.records if r.name == "gateway.requests"]
    started = next(r for r in records if r.getMessage() == "request started")
    finished = next(r for r in records if r.getMessage() == "request finished")
    assert started.request_id == finished.request_id == "log-me"
    assert started.seq_id == finished.seq_id
    assert finished.completion_tokens == 12 and finished.finish_reason == "length"
    assert finished.accept_length >= 1.0 and finished.ttft_ms is not None
    line = json.loads(JsonFormatter().format(finished))
    assert line["request_id"] == "log-me" and line["finish_reason"] == "length"
    text = TextFormatter().format(finished)  # the default --log-format says as much as the JSON one
    assert "request finished" in text and "completion_tokens=12" in text and "finish_reason=length" in text
    assert f"accept_length={finished.accept_length}" in text and f"ttft_ms={finished.ttft_ms}" in text
    assert "request_id=log-me" in TextFormatter().format(started) and "prompt_tokens=3" in TextFormatter().format(
        started)


async def test_rpc_counts_carry_the_status_the_client_saw():
    import grpc
    from prometheus_client import generate_latest

    from protos.tandem.v1 import tandem_pb2 as pb
    from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
    from protos.wire import start_server
    from tandem.observability import ServiceMetrics

    class Failing(pb_grpc.TargetServiceServicer):  # Info stays unimplemented
        async def Verify(self, request, context):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad tree")

        async def Release(self, request, context):
            raise RuntimeError("bug")

    metrics = ServiceMetrics("target")
    server, port, _ = await start_server(lambda s: pb_grpc.add_TargetServiceServicer_to_server(Failing(), s),
                                         ["tandem.v1.TargetService"], "127.0.0.1", 0,
                                         interceptors=[metrics.interceptor()])
    seen = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TargetServiceStub(channel)
            calls = (("Verify", stub.Verify(pb.VerifyRequest())), ("Release", stub.Release(pb.ReleaseRequest())),
                     ("Info", stub.Info(pb.InfoRequest())))
            for rpc, call in calls:
                try:
                    await call
                except grpc.aio.AioRpcError as exc:
                    seen[rpc] = exc.code().name
    finally:
        await server.stop(grace=None)
    got = parse_metrics(generate_latest(metrics.registry).decode())
    assert seen == {"Verify": "INVALID_ARGUMENT", "Release": "UNKNOWN", "Info": "UNIMPLEMENTED"}
    for rpc, code in seen.items():
        assert got[f'tandem:rpc_requests_total{{code="{code}",rpc="{rpc}",service="target"}}'] == 1
