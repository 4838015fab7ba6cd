"""gRPC servicer of the draft service: Prefill/Propose/Release over one Proposer, model work off the event loop."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from draft_service import convert
from draft_service.proposer import Proposer
from protos.step_stream import serve_step_stream
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from protos.wire import PROTOCOL, start_server

logger = logging.getLogger(__name__)


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, proposer: Proposer, model_path: str, info: dict | None = None, metrics=None):
        self.proposer = proposer
        self.model_path = model_path
        self.info = info or {}
        self.metrics = metrics  # tandem.observability.ServiceMetrics or None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _memory(self) -> pb.MemoryState:
        free, total = self.proposer.memory()
        return pb.MemoryState(free_kv_tokens=free, total_kv_tokens=total, num_seqs=self.proposer.num_seqs)

    async def Prefill(self, request: pb.DraftPrefillRequest, context) -> pb.DraftPrefillResponse:
        start = time.perf_counter()

        try:
            inputs = convert.prefill_inputs(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        def run():
            return [(seq_id, self.proposer.prefill(seq_id, tokens, features)) for seq_id, tokens, features in inputs]

        results = await self._run(run)
        if self.metrics is not None:
            self.metrics.observe_forward("Prefill", time.perf_counter() - start, len(request.seqs))
        return pb.DraftPrefillResponse(
            results=[pb.DraftPrefillResult(seq_id=seq_id, status=int(status)) for seq_id, status in results],
            memory=self._memory(), timings=pb.StepTimings(total_ms=(time.perf_counter() - start) * 1e3))

    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        return await self._propose(request, context)

    async def ProposeStream(self, request_iterator, context):
        """Propose over the gateway's persistent stream: one response per request, same handler as Propose."""
        async for response in serve_step_stream(request_iterator, context, self._propose, "Propose", self.metrics):
            yield response  # an async generator handler: grpc.aio streams what it yields

    async def _propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        start = time.perf_counter()
        try:
            inputs = convert.propose_inputs(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        outputs = await self._run(self.proposer.propose, inputs)
        elapsed = (time.perf_counter() - start) * 1e3
        if self.metrics is not None:
            self.metrics.observe_forward("Propose", elapsed / 1e3, len(inputs))
        return pb.ProposeResponse(results=[convert.propose_result(o) for o in outputs], memory=self._memory(),
                                  timings=pb.StepTimings(forward_ms=elapsed, total_ms=elapsed))

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        released = await self._run(self.proposer.release, list(request.seq_ids))
        return pb.ReleaseResponse(num_released=released, memory=self._memory())

    async def Info(self, request: pb.InfoRequest, context) -> pb.ModelInfo:
        return pb.ModelInfo(model_path=self.model_path, algorithm=self.proposer.algorithm, memory=self._memory(),
                            protocol=PROTOCOL, **self.info)


async def serve_draft(proposer: Proposer, model_path: str, host: str, port: int, info: dict | None = None, *,
                      metrics=None, credentials=None):
    """Start the draft gRPC server; returns (server, bound_port).
    metrics: a tandem.observability.ServiceMetrics to fill; credentials: protos.wire.server_credentials for TLS."""
    servicer = DraftServicer(proposer, model_path, info, metrics)
    if metrics is not None:
        metrics.bind_memory(lambda: (*proposer.memory(), proposer.num_seqs))
    server, bound, _ = await start_server(
        lambda s: pb_grpc.add_DraftServiceServicer_to_server(servicer, s),
        [pb.DESCRIPTOR.services_by_name["DraftService"].full_name], host, port,
        interceptors=[metrics.interceptor()] if metrics is not None else (), credentials=credentials)
    logger.info("draft service (%s) listening on %s:%d", proposer.algorithm, host, bound)
    return server, bound
