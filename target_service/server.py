"""gRPC servicer of the target service: decodes step RPCs, runs the TargetEngine off the event loop, encodes results.

Model work is serialised (one batched forward at a time) by a ModelWorker: step calls (Verify of a tree, or of up to
INLINE_MAX_DECODE_STEPS decode steps) run inline on the event loop, which saves the worker-thread round trip on every
step; Prefill and longer calls run on the worker thread so the loop stays free for health checks and new calls.
A sequence with out-of-range input (token ids past the vocabulary, an oversized tree, sampling values the engine
refuses) gets an INVALID result of its own; the rest of its batch runs. Nothing here holds model state.
"""
from __future__ import annotations

import logging
import time

from protos.model_worker import ModelWorker
from protos.step_stream import serve_step_stream
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from protos.wire import PROTOCOL, start_server
from target_service import convert
from target_service.engine import TargetEngine

logger = logging.getLogger(__name__)
# A Verify asking at most this many decode steps per sequence runs inline on the event loop (bounded work).
INLINE_MAX_DECODE_STEPS = 16


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine, model_path: str, metrics=None, inline_steps: bool = True,
                 max_tree_nodes: int = convert.DEFAULT_MAX_TREE_NODES):
        self.engine = engine
        self.model_path = model_path
        self.metrics = metrics  # tandem.observability.ServiceMetrics or None
        self.worker = ModelWorker("target-model", inline_steps)
        self.limits = convert.Limits(engine.runner.model_config.vocab_size, max_tree_nodes)

    def _memory(self) -> pb.MemoryState:
        runner = self.engine.runner
        return pb.MemoryState(free_kv_tokens=runner.num_free_tokens(), total_kv_tokens=runner.num_total_tokens(),
                              num_seqs=self.engine.num_seqs)

    async def Prefill(self, request: pb.TargetPrefillRequest, context) -> pb.TargetPrefillResponse:
        start = time.perf_counter()
        inputs, slots = convert.split(convert.prefill_inputs(request, self.limits))
        outputs = convert.merge(slots, await self.worker.run(self.engine.prefill, inputs) if inputs else [])
        if self.metrics is not None:
            self.metrics.observe_forward("Prefill", self.engine.last_forward_ms / 1e3, len(inputs))
        return pb.TargetPrefillResponse(
            results=[convert.prefill_result(o) for o in outputs], memory=self._memory(),
            timings=pb.StepTimings(forward_ms=self.engine.last_forward_ms,
                                   total_ms=(time.perf_counter() - start) * 1e3))

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        return await self._verify(request, context)

    async def VerifyStream(self, request_iterator, context):
        """Verify over the gateway's persistent stream: one response per request, same handler as Verify."""
        async for response in serve_step_stream(request_iterator, context, self._verify, "Verify", self.metrics):
            yield response  # an async generator handler: grpc.aio streams what it yields

    async def _verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        start = time.perf_counter()
        inputs, slots = convert.split(convert.verify_inputs(request, self.limits))
        bounded = all(inp.num_decode_steps <= INLINE_MAX_DECODE_STEPS for inp in inputs)
        outputs = convert.merge(slots, await self.worker.run(self.engine.verify, inputs, inline=bounded)
                                if inputs else [])
        if self.metrics is not None:
            self.metrics.observe_forward("Verify", self.engine.last_forward_ms / 1e3, len(inputs))
        return pb.VerifyResponse(
            results=[convert.verify_result(o) for o in outputs], memory=self._memory(),
            timings=pb.StepTimings(forward_ms=self.engine.last_forward_ms,
                                   total_ms=(time.perf_counter() - start) * 1e3))

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        released = await self.worker.run(self.engine.release, list(request.seq_ids), inline=True)
        return pb.ReleaseResponse(num_released=released, memory=self._memory())

    async def Info(self, request: pb.InfoRequest, context) -> pb.ModelInfo:
        cfg = self.engine.runner.model_config
        return pb.ModelInfo(
            model_path=self.model_path, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_context_len=self.engine.max_context_len, eos_token_ids=list(cfg.eos_token_ids),
            memory=self._memory(), device=str(self.engine.device), dtype=str(self.engine.runner.dtype),
            protocol=PROTOCOL, hidden_size=cfg.hidden_size)


async def serve_target(engine: TargetEngine, model_path: str, host: str, port: int, *, metrics=None,
                       credentials=None, inline_steps: bool = True,
                       max_tree_nodes: int = convert.DEFAULT_MAX_TREE_NODES):
    """Start the target gRPC server; returns (server, bound_port).
    metrics: a tandem.observability.ServiceMetrics to fill; credentials: protos.wire.server_credentials for TLS;
    inline_steps=False runs every model call on the worker thread."""
    servicer = TargetServicer(engine, model_path, metrics, inline_steps, max_tree_nodes)
    if metrics is not None:
        runner = engine.runner
        metrics.bind_memory(lambda: (runner.num_free_tokens(), runner.num_total_tokens(), engine.num_seqs))
        bm = runner.block_manager
        if bm.prefix_cache:
            metrics.bind_prefix_cache(lambda: (bm.num_cache_queries, bm.num_cache_hits,
                                               bm.num_cached_blocks() * bm.block_size))
    server, bound, _ = await start_server(
        lambda s: pb_grpc.add_TargetServiceServicer_to_server(servicer, s),
        [pb.DESCRIPTOR.services_by_name["TargetService"].full_name], host, port,
        interceptors=[metrics.interceptor()] if metrics is not None else (), credentials=credentials)
    server.servicer = servicer  # tests and benchmarks read its ModelWorker counters
    logger.info("target service listening on %s:%d", host, bound)
    return server, bound
