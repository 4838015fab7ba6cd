"""gRPC servicer of the draft service: Prefill/Propose/Release over one Proposer.

Model work is serialised by a ModelWorker (protos/model_worker.py): a Propose whose catch-up is short (at most
INLINE_MAX_CATCH_UP tokens the draft has not run yet) and Release run inline on the event loop, saving the worker-thread
round trip on every step; Prefill and long catch-ups (a feature draft's first Propose runs the whole prompt) run on the
worker thread so the loop keeps answering health checks. A sequence with out-of-range input gets an INVALID result of
its own (draft_service/convert.py); the rest of its batch runs."""
from __future__ import annotations

import asyncio
import logging
import time

from core.steps import ProposeInput, ProposeOutput
from core.types import SeqStatus as Status
from draft_service import convert
from draft_service.proposer import Proposer
from protos import leases
from protos.errors import ErrorInterceptor
from protos.leases import DEFAULT_IDLE_TTL_S, SeqLeases, caller
from protos.model_worker import ModelWorker
from protos.profiler import ProcessProfiler, ProfilerServicer, add_to_server as add_profiler
from protos.step_stream import serve_step_stream
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from protos.wire import PROTOCOL, start_server
from runtime.memory import accelerator_id

logger = logging.getLogger(__name__)
# A Propose whose draft must first run at most this many committed tokens (all sequences together) runs inline.
INLINE_MAX_CATCH_UP = 256


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, proposer: Proposer, model_path: str, info: dict | None = None, metrics=None,
                 inline_steps: bool = True, limits: convert.Limits | None = None,
                 seq_idle_ttl_s: float = DEFAULT_IDLE_TTL_S):
        """limits: per-call bounds (default: token ids below the draft model's vocabulary, default shape limits)."""
        self.proposer = proposer
        self.leases = SeqLeases(seq_idle_ttl_s)  # owner and last use of every sequence
        self.model_path = model_path
        self.info = info or {}
        self.metrics = metrics  # tandem.observability.ServiceMetrics or None
        self.worker = ModelWorker("draft-model", inline_steps)
        runner = getattr(proposer, "runner", None)
        self.limits = limits or convert.Limits(runner.model_config.vocab_size if runner is not None else None)
        self.profiling: ProfilerServicer | None = None  # counts Propose calls as profile steps (a draft pod's own)

    def _memory(self) -> pb.MemoryState:
        free, total = self.proposer.memory()
        return pb.MemoryState(free_kv_tokens=free, total_kv_tokens=total, num_seqs=self.proposer.num_seqs)

    async def Prefill(self, request: pb.DraftPrefillRequest, context) -> pb.DraftPrefillResponse:
        start = time.perf_counter()
        owner = caller(context)
        inputs = convert.prefill_inputs(request, self.limits)
        for i in inputs:
            if i.status == Status.OK and not self.leases.allows(i.seq_id, owner):
                i.status, i.error = Status.INVALID, "the sequence belongs to another gateway"
        self.leases.claim([i.seq_id for i in inputs if i.status == Status.OK], owner)

        def run():
            return [(i.seq_id, i.status if i.status != Status.OK else self.proposer.prefill(i.seq_id, i.token_ids,
                                                                                            i.features))
                    for i in inputs]

        results = await self.worker.run(run)
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
        owner = caller(context)
        items = [ProposeOutput(i.seq_id, Status.INVALID, base_committed_len=i.committed_len,
                               error="the sequence belongs to another gateway")
                 if isinstance(i, ProposeInput) and not self.leases.allows(i.seq_id, owner) else i
                 for i in convert.propose_inputs(request, self.limits)]
        inputs, slots = convert.split(items)
        outputs = convert.merge(slots, await self.propose_local(inputs) if inputs else [])
        elapsed = (time.perf_counter() - start) * 1e3
        response = pb.ProposeResponse(results=[convert.propose_result(o) for o in outputs], memory=self._memory(),
                                      timings=pb.StepTimings(forward_ms=elapsed, total_ms=elapsed))
        if self.profiling is not None:
            await self.profiling.step()
        return response

    async def prefill_local(self, items: list[tuple[str, list[int], object]], owner: str) -> list[Status]:
        """Prefill (seq_id, token ids, features) from this process (a co-located target's Prefill, whose caller it
        checked): the sequences become `owner`'s here too."""
        self.leases.claim([seq_id for seq_id, _, _ in items], owner)
        return await self.worker.run(lambda: [self.proposer.prefill(*item) for item in items])

    async def propose_local(self, inputs: list[ProposeInput]) -> list[ProposeOutput]:
        """Propose checked inputs (the wire's) on the ModelWorker; short catch-ups inline on the event loop."""
        bounded = self.proposer.catch_up_tokens(inputs) <= INLINE_MAX_CATCH_UP
        return await self.worker.run(self.propose_now, inputs, inline=bounded)

    def propose_now(self, inputs: list[ProposeInput]) -> list[ProposeOutput]:
        """Propose checked inputs in the calling thread: from propose_local, or from a co-located target's fused
        verify → propose, which runs on the ModelWorker the two share and checked its caller."""
        start = time.perf_counter()
        self.leases.touch([inp.seq_id for inp in inputs])
        outputs = self.proposer.propose(inputs)
        if self.metrics is not None:
            self.metrics.observe_forward("Propose", time.perf_counter() - start, len(inputs))
        return outputs

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        owner = caller(context)
        seq_ids = [s for s in request.seq_ids if self.leases.allows(s, owner)]  # another owner's: left alone
        released = await self.worker.run(self.proposer.release, seq_ids, inline=True)
        self.leases.forget(seq_ids)
        return pb.ReleaseResponse(num_released=released, memory=self._memory())

    async def free_idle(self) -> int:
        """Free the sequences no call has used within the idle TTL (their gateway is gone); returns how many."""
        return await leases.free_idle(self.leases, self.worker, self.proposer.release)

    # ---- NGRAM's external corpora (draft_service/ngram_corpus.py) ---------------------------------------------
    def _corpora(self):
        trie = getattr(self.proposer, "trie", None)
        if trie is None or not hasattr(trie, "add_corpus"):
            raise ValueError(f"external corpora are NGRAM's; this pod drafts {self.proposer.algorithm}")
        return trie

    async def AddExternalCorpus(self, request: pb.AddExternalCorpusRequest, context) -> pb.ExternalCorpora:
        trie = self._corpora()
        documents = [list(doc.token_ids) for doc in request.documents]
        vocab = self.limits.vocab_size
        if vocab is not None and any(t >= vocab for doc in documents for t in doc):
            raise ValueError(f"corpus token ids must be below the vocabulary size {vocab}")
        # indexing runs on the worker thread (a large corpus takes seconds): the loop keeps answering meanwhile
        loaded = await self.worker.run(trie.add_corpus, request.corpus_id, documents)
        return pb.ExternalCorpora(corpus_token_counts=trie.corpus_token_counts(), loaded_token_count=loaded)

    async def RemoveExternalCorpus(self, request: pb.RemoveExternalCorpusRequest, context) -> pb.ExternalCorpora:
        trie = self._corpora()
        try:
            await self.worker.run(trie.remove_corpus, request.corpus_id, inline=True)
        except KeyError:
            raise ValueError(f"no external corpus {request.corpus_id!r}") from None
        return pb.ExternalCorpora(corpus_token_counts=trie.corpus_token_counts())

    async def ListExternalCorpora(self, request: pb.ListExternalCorporaRequest, context) -> pb.ExternalCorpora:
        return pb.ExternalCorpora(corpus_token_counts=self._corpora().corpus_token_counts())

    async def Info(self, request: pb.InfoRequest, context) -> pb.ModelInfo:
        runner = getattr(self.proposer, "runner", None)
        device = {} if runner is None else {"device": str(runner.device), "accelerator": accelerator_id(runner.device)}
        return pb.ModelInfo(model_path=self.model_path, algorithm=self.proposer.algorithm, memory=self._memory(),
                            protocol=PROTOCOL, **{**device, **self.info})


async def serve_draft(proposer: Proposer, model_path: str, host: str, port: int, info: dict | None = None, *,
                      metrics=None, credentials=None, inline_steps: bool = True,
                      limits: convert.Limits | None = None, service_api_key: str | None = None,
                      seq_idle_ttl_s: float = DEFAULT_IDLE_TTL_S, profiler: ProcessProfiler | None = None):
    """Start the draft gRPC server; returns (server, bound_port). service_api_key: the credential every RPC but
    health checks must carry (None = open).
    metrics: a tandem.observability.ServiceMetrics to fill; credentials: protos.wire.server_credentials for TLS;
    inline_steps=False runs every model call on the worker thread; profiler: this process's ProcessProfiler
    (--profile-dir), served as the Profiler service."""
    servicer = DraftServicer(proposer, model_path, info, metrics, inline_steps, limits, seq_idle_ttl_s)
    servicer.profiling = ProfilerServicer(profiler or ProcessProfiler("draft", None), servicer.worker)
    if metrics is not None:
        metrics.bind_memory(lambda: (*proposer.memory(), proposer.num_seqs))

    def register(server) -> None:
        pb_grpc.add_DraftServiceServicer_to_server(servicer, server)
        add_profiler(servicer.profiling, server)

    server, bound, _ = await start_server(
        register, [pb.DESCRIPTOR.services_by_name[n].full_name for n in ("DraftService", "Profiler")], host, port,
        interceptors=[*([metrics.interceptor()] if metrics is not None else ()), ErrorInterceptor()],
        credentials=credentials,
        service_api_key=service_api_key)
    server.servicer = servicer  # tests and benchmarks read its ModelWorker counters
    server.idle_sweeper = asyncio.create_task(  # ends with the event loop
        leases.free_idle_forever(servicer.free_idle, servicer.leases.idle_ttl_s))
    logger.info("draft service (%s) listening on %s:%d", proposer.algorithm, host, bound)
    return server, bound
