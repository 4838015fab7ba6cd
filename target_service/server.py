"""gRPC servicer of the target service: decodes step RPCs, runs the TargetEngine off the event loop, encodes results.

Model work is serialised (one batched forward at a time) by a ModelWorker: step calls (Verify of a tree, or of up to
INLINE_MAX_DECODE_STEPS decode steps) run inline on the event loop, which saves the worker-thread round trip on every
step; Prefill and longer calls run on the worker thread so the loop stays free for health checks and new calls.
A sequence with out-of-range input (token ids past the vocabulary, an oversized tree, sampling values the engine
refuses, a sequence another gateway owns) gets an INVALID result of its own; the rest of its batch runs. Sequences
unused for the idle TTL are freed (protos/leases.py). Nothing here holds model state.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time

import torch

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
from core.steps import PrefillInput, ProposeInput, ProposeOutput, StepOutput, VerifyInput
from core.types import DraftTree, SeqStatus as Status
from draft_service.convert import check_spec
from target_service import convert
from target_service.engine import TargetEngine

logger = logging.getLogger(__name__)
# A Verify asking at most this many decode steps per sequence runs inline on the event loop (bounded work).
INLINE_MAX_DECODE_STEPS = 16
# How long a Verify waits for the run-ahead before it (the call then queues behind it on the ModelWorker anyway).
RUN_AHEAD_WAIT_S = 60.0
RUN_AHEAD_SWITCH_INTERVAL_S = 0.0005


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine, model_path: str, metrics=None, inline_steps: bool = True,
                 max_tree_nodes: int = convert.DEFAULT_MAX_TREE_NODES, seq_idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
                 run_ahead: bool = False):
        self.engine = engine
        self.leases = SeqLeases(seq_idle_ttl_s)  # owner and last use of every sequence
        self.model_path = model_path
        self.metrics = metrics  # tandem.observability.ServiceMetrics or None
        self.worker = ModelWorker("target-model", inline_steps)
        self.limits = convert.Limits(engine.runner.model_config.vocab_size, max_tree_nodes)
        self.drafter = None  # a DraftServicer in this process (UNO, --colocate-draft): answers propose_next
        self.chained = None  # target_service.chained.ChainedSteps: speculative steps chained on the device
        self.profiling: ProfilerServicer | None = None  # counts Verify calls as profile steps
        # --enable-run-ahead: the next call's inputs as this pod expects them (by sequence) and the task running them;
        # hits and misses count sequences
        self.run_ahead = run_ahead
        self._ahead: tuple[dict[str, VerifyInput], asyncio.Future] | None = None
        self.run_ahead_counts = {"hit": 0, "miss": 0}
        if run_ahead:
            # The run-ahead's host work (Python) holds the GIL on the worker thread while the event loop sends the
            # answer and takes the next call; the loop gets it back within the switch interval (5 ms by default:
            # longer than a small model's whole step).
            sys.setswitchinterval(min(sys.getswitchinterval(), RUN_AHEAD_SWITCH_INTERVAL_S))

    def _memory(self) -> pb.MemoryState:
        runner = self.engine.runner
        return pb.MemoryState(free_kv_tokens=runner.num_free_tokens(), total_kv_tokens=runner.num_total_tokens(),
                              num_seqs=self.engine.num_seqs)

    async def Prefill(self, request: pb.TargetPrefillRequest, context) -> pb.TargetPrefillResponse:
        start = time.perf_counter()
        owner = caller(context)
        inputs, slots = convert.split(self._owned(convert.prefill_inputs(request, self.limits), owner))
        self.leases.claim([inp.seq_id for inp in inputs], owner)
        self._forget_ahead([inp.seq_id for inp in inputs])
        prefilled = await self.worker.run(self.engine.prefill, inputs) if inputs else []
        if self.metrics is not None:
            self.metrics.observe_forward("Prefill", self.engine.last_forward_ms / 1e3, len(inputs))
        if self.drafter is not None and any(inp.prefill_draft for inp in inputs):
            await self._prefill_draft(inputs, prefilled, owner)
        elif any(inp.propose_next is not None for inp in inputs):  # no draft here: each such sequence is told so
            self._draft_next([(inp, out, len(inp.token_ids) + len(out.token_ids), [], None)
                              for inp, out in zip(inputs, prefilled) if inp.propose_next is not None
                              and out.status == Status.OK and out.finish_reason is None])
        outputs = convert.merge(slots, prefilled)
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
        inputs, slots = convert.split(self._owned(convert.verify_inputs(request, self.limits), caller(context)))
        self.leases.touch([inp.seq_id for inp in inputs])
        ahead, forward_ms = await self._take_ahead(inputs)
        rest = [inp for inp in inputs if inp.seq_id not in ahead]
        if rest:
            bounded = all(inp.num_decode_steps <= INLINE_MAX_DECODE_STEPS for inp in rest)
            ran, ms = await self.worker.run(self._steps, rest, inline=bounded)
            ahead.update((out.seq_id, out) for out in ran)
            forward_ms += ms
        verified = [ahead[inp.seq_id] for inp in inputs]
        self._start_ahead(inputs, verified, request.batch_may_grow)
        if self.metrics is not None:
            self.metrics.observe_forward("Verify", forward_ms / 1e3, len(inputs))
        outputs = convert.merge(slots, verified)
        response = pb.VerifyResponse(
            results=[convert.verify_result(o) for o in outputs], memory=self._memory(),
            timings=pb.StepTimings(forward_ms=forward_ms, total_ms=(time.perf_counter() - start) * 1e3))
        if self.profiling is not None:
            await self.profiling.step()
        return response

    def _steps(self, inputs: list[VerifyInput]) -> tuple[list[StepOutput], float]:
        """A Verify call's model work (on the ModelWorker): the verify forward (and plain decode steps); with
        propose_next, the next tree drafted here and num_decode_steps - 1 more speculative steps (verify, then draft)
        back to back — chained on the device for the sequences that can be (`_chain_call`), one by one for the
        others. Returns the outputs and the milliseconds of verify forwards; the inputs are left as they came (a
        run-ahead compares them with the next call's)."""
        chained, forward_ms = self._chain_call(inputs)
        rest = [inp for inp in inputs if inp.seq_id not in chained]
        if rest:
            outputs, ms = self._steps_one_by_one(rest)
            chained.update((out.seq_id, out) for out in outputs)
            forward_ms += ms
        return [chained[inp.seq_id] for inp in inputs], forward_ms

    def _steps_one_by_one(self, inputs: list[VerifyInput]) -> tuple[list[StepOutput], float]:
        # features the caller asked for; a feature draft in this process gets those of propose_next steps either way
        feeds_draft = self.drafter is not None and self.drafter.proposer.needs_features
        work = [dataclasses.replace(inp, return_features=inp.return_features or feeds_draft,
                                    num_decode_steps=1) if inp.propose_next is not None else inp for inp in inputs]
        verified = self.engine.verify(work)
        forward_ms = self.engine.last_forward_ms
        if any(inp.propose_next is not None for inp in work):
            self._propose_next(work, verified)
            forward_ms += self._speculative_steps(work, verified, [inp.num_decode_steps for inp in inputs],
                                                  [inp.return_features for inp in inputs])
        for out, inp in zip(verified, inputs):
            if not inp.return_features:  # handed to the draft here, not sent
                out.features = None
        return verified, forward_ms

    # ---- run-ahead (--enable-run-ahead) --------------------------------------------------------------------------
    def _start_ahead(self, inputs: list[VerifyInput], outputs: list[StepOutput], batch_may_grow: bool) -> None:
        """While this call's answer travels and the gateway works on it, run the call that will most likely come
        next: the same sequences, each from its new committed end, verifying the tree this pod just drafted (or the
        same plain decode steps). Only where that call is known exactly and its outcome does not depend on when it
        runs: greedy sequences (a sampled token drawn early would use the sampler's randomness out of turn; logprobs
        and features are what the call itself would compute), every output served, every step either a plain
        decode or a tree drafted here. A sequence that finished in this call is left out (the gateway does not send
        it again): one finishing no longer stops the rest of a batch from running ahead (a batch drains, and in a
        server under load some sequence finishes in most calls). Not started when the gateway says the batch may grow
        (requests wait for admission): a sequence it adds would need a forward of its own beside the run-ahead's,
        costlier at a large batch than the round trip the run-ahead hides. It runs on the worker thread, so the
        event loop stays free to send this answer and take the next call."""
        if not self.run_ahead or not inputs or self._ahead is not None or batch_may_grow:
            return
        if self.drafter is not None and self.drafter.proposer.algorithm == "UNO":
            return  # UNO's verify consumes a clean root its self-draft left pending: not run ahead
        nexts: list[VerifyInput] = []
        for inp, out in zip(inputs, outputs):
            if out.status == Status.OK and out.finish_reason is not None:
                continue
            if out.status != Status.OK or not out.token_ids or not inp.sampling.is_greedy:
                return
            if inp.propose_next is not None:
                if out.proposal is None or out.proposal.status != Status.OK or not out.proposal.tree.token_ids:
                    return
                tree = out.proposal.tree
            elif inp.tree.token_ids:
                return  # the gateway's draft chooses the next tree: unknown here
            else:
                tree = DraftTree([], [])
            nexts.append(dataclasses.replace(inp, committed_len=inp.committed_len + len(out.token_ids),
                                             root_token_id=out.token_ids[-1], tree=tree))
        if not nexts:
            return
        task = asyncio.ensure_future(self.worker.run(self._steps, nexts))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure no call takes is not an error
        self._ahead = ({inp.seq_id: inp for inp in nexts}, task)

    async def _take_ahead(self, inputs: list[VerifyInput]) -> tuple[dict[str, StepOutput], float]:
        """The run-ahead's outputs of the sequences whose input here is exactly the one it ran (hits; with the
        milliseconds of its verify forwards when there are any). A miss (another committed length, tree or step
        count; a sequence it did not run) leaves the run-ahead's steps in that sequence's state, and this call's own
        verify rolls the target back to the committed length it names (and its draft with it) as after any rejected
        step. Waits for a run-ahead still running, with a deadline."""
        if self._ahead is None:
            return {}, 0.0
        expected, task = self._ahead
        self._ahead = None
        try:
            ran, forward_ms = await asyncio.wait_for(asyncio.shield(task), RUN_AHEAD_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - a run-ahead that failed counts as a miss; the call runs itself
            logger.warning("run-ahead failed or timed out (%s: %s); verifying afresh", type(exc).__name__, exc)
            ran, forward_ms = [], 0.0
        outputs = {out.seq_id: out for out in ran if out.status == Status.OK}
        hits = {inp.seq_id: outputs[inp.seq_id] for inp in inputs
                if inp.seq_id in outputs and expected.get(inp.seq_id) == inp}
        for outcome, count in (("hit", len(hits)), ("miss", len(expected) - len(hits))):
            self.run_ahead_counts[outcome] += count
            if self.metrics is not None and count:
                self.metrics.run_ahead.labels(self.metrics.service, outcome).inc(count)
        return hits, forward_ms if hits else 0.0

    def _forget_ahead(self, seq_ids) -> None:
        """A Prefill or Release of these sequences: the run-ahead's outputs of them no longer follow their state."""
        if self._ahead is not None:
            for seq_id in seq_ids:
                self._ahead[0].pop(seq_id, None)

    async def _prefill_draft(self, inputs: list[PrefillInput], outputs: list[StepOutput], owner: str) -> None:
        """PrefillInput.prefill_draft: the draft in this process is prefilled with each sequence's committed tokens
        (the sampled first token included) and their features, handed over on the device; those features are then
        not returned. A draft prefill that fails leaves them in the output (the gateway prefills the draft itself).
        With propose_next the draft then drafts each sequence's first tree (StepOutput.proposal), as the Propose
        that would follow."""
        done = [(inp, out) for inp, out in zip(inputs, outputs)
                if inp.prefill_draft and out.status == Status.OK and out.finish_reason is None
                and (out.features is not None or not self.drafter.proposer.needs_features)]
        if not done:
            return
        statuses = await self.drafter.prefill_local(
            [(inp.seq_id, [*inp.token_ids, *out.token_ids], out.features) for inp, out in done], owner)
        asks = []
        for (inp, out), status in zip(done, statuses):
            if status == Status.OK:
                out.features = None
                if inp.propose_next is not None:  # the draft knows every committed token: nothing new to feed it
                    asks.append((inp, out, len(inp.token_ids) + len(out.token_ids), [], None))
        await self.worker.run(self._draft_next, asks, inline=True)  # the first trees: no catch-up to run

    def _speculative_steps(self, inputs: list[VerifyInput], outputs: list[StepOutput], steps: list[int],
                                 wire_features: list[bool]) -> float:
        """Continuous speculative steps (a draft in this process, propose_next with num_decode_steps k > 1): verify the
        tree the draft just returned, draft the next, and again, until a sequence has run k steps, finished, or got
        no proposal; each output then covers all its steps (tokens, counts, logprobs, features) and carries the last
        proposal. One call, one round trip, for k steps (SGLang's --num-continuous-decode-steps, speculative).
        Returns the milliseconds of the verify forwards."""
        forward_ms = 0.0
        runs = [(inp, out, k, asked) for inp, out, k, asked in zip(inputs, outputs, steps, wire_features)
                if inp.propose_next is not None and k > 1]
        forward_ms += self._chained_steps(runs)
        while True:
            runs = [(inp, out, k, asked) for inp, out, k, asked in runs
                    if out.num_steps < k and out.status == Status.OK and out.finish_reason is None
                    and out.proposal is not None and out.proposal.status == Status.OK]
            if not runs:
                return forward_ms
            nexts = [self._next_step(inp, out) for inp, out, _, _ in runs]
            results = self.engine.verify(nexts)
            forward_ms += self.engine.last_forward_ms
            self._propose_next(nexts, results)
            for (_, out, _, asked), res in zip(runs, results):
                if res.status != Status.OK:  # the steps before stand; the next call meets the problem again
                    out.proposal = None
                    continue
                self._extend(out, res, asked)

    @staticmethod
    def _next_step(inp: VerifyInput, out: StepOutput) -> VerifyInput:
        """The input of a sequence's next speculative step: from its new committed end, the tree drafted last."""
        return dataclasses.replace(inp, committed_len=inp.committed_len + len(out.token_ids),
                                   root_token_id=out.token_ids[-1], tree=out.proposal.tree)

    @staticmethod
    def _extend(out: StepOutput, res: StepOutput, features: bool) -> None:
        """A call's output `out` covers the steps of `res` too (features: the caller asked for them)."""
        out.token_ids += res.token_ids
        out.num_accepted_drafts += res.num_accepted_drafts
        out.num_draft_tokens += res.num_draft_tokens
        out.num_steps += res.num_steps
        out.finish_reason, out.proposal = res.finish_reason, res.proposal
        if out.logprobs is not None and res.logprobs:
            out.logprobs += res.logprobs
        if features and out.features is not None and res.features is not None:
            out.features = torch.cat([out.features, res.features])

    def _chained_steps(self, runs: list[tuple]) -> float:
        """The steps the runs still want, chained on the device for those that can be (target_service/chained.py:
        one readback for all the steps instead of two per step); each of their outputs then covers them, the others
        are left to the step-by-step loop. Returns the milliseconds spent."""
        runs = [(inp, out, k, asked) for inp, out, k, asked in runs
                if out.status == Status.OK and out.finish_reason is None and out.proposal is not None
                and out.proposal.status == Status.OK and out.proposal.tree.token_ids and not asked]
        if self.chained is None or not runs:
            return 0.0
        steps = min(k - out.num_steps for _, out, k, _ in runs)
        start = time.perf_counter()
        results = self._run_chained([self._next_step(inp, out) for inp, out, _, _ in runs], steps)
        if not results:
            return 0.0
        for _, out, _, _ in runs:
            if out.seq_id in results:  # (the others: the step-by-step loop runs their steps)
                self._extend(out, results[out.seq_id], False)
        return (time.perf_counter() - start) * 1e3

    def _run_chained(self, inputs: list[VerifyInput], steps: int) -> dict[str, StepOutput]:
        results = self.chained.run(inputs, steps)
        if results:  # the draft's sequences were used (its idle sweeper frees the untouched ones)
            self.drafter.leases.touch(list(results))
        return results

    def _chain_call(self, inputs: list[VerifyInput]) -> tuple[dict[str, StepOutput], float]:
        """The sequences of the call that verify a full tree of the served shape (drafted here as the last call's
        proposal) with target and draft exactly where that proposal left them, all their steps chained on the
        device, the first one too: one host->device copy and one readback for them (target_service/chained.py).
        Returns their outputs by sequence (the rest run as usual) and the milliseconds spent."""
        if self.chained is None:
            return {}, 0.0
        candidates = [inp for inp in inputs if inp.propose_next is not None and not inp.return_features
                      and inp.tree.token_ids]
        if not candidates:
            return {}, 0.0
        k = candidates[0].num_decode_steps
        start = time.perf_counter()
        results = self._run_chained([inp for inp in candidates if inp.num_decode_steps == k], k)
        return results, (time.perf_counter() - start) * 1e3 if results else 0.0

    def _propose_next(self, inputs: list[VerifyInput], outputs: list[StepOutput]) -> None:
        """VerifyInput.propose_next: this process's draft drafts the next tree of every sequence still running, from
        this verify's outcome — the accepted tokens and, for feature drafts, their target features, handed over on
        the device — as the Propose that would follow this Verify (one round trip per step instead of two)."""
        asks = []
        for inp, out in zip(inputs, outputs):
            if inp.propose_next is None or out.status != Status.OK or out.finish_reason is not None:
                continue
            # a copy: the rows of a static verify step live in its graph's output buffer, which the next replay
            # overwrites, and the draft may keep them
            features = out.features.clone() if out.features is not None else None
            asks.append((inp, out, inp.committed_len + len(out.token_ids), list(out.token_ids), features))
        self._draft_next(asks)

    def _draft_next(self, asks: list[tuple]) -> None:
        """The Proposes that follow a Prefill or Verify in this process: each ask is (input with propose_next and
        sampling, its output, the committed length after it, the tokens and features the draft has not seen); the
        trees (or why none) land in the outputs' proposal."""
        items: list[tuple[StepOutput, ProposeInput]] = []
        for inp, out, committed_len, new_tokens, features in asks:
            error = "this target pod drafts nothing itself (ModelInfo.algorithm)" if self.drafter is None else None
            if error is None:
                try:
                    check_spec(inp.propose_next, self.drafter.limits)
                except ValueError as exc:
                    error = f"propose_next: {exc}"
            if error is not None:
                out.proposal = ProposeOutput(out.seq_id, Status.INVALID, base_committed_len=committed_len, error=error)
                continue
            items.append((out, ProposeInput(out.seq_id, committed_len, new_tokens, inp.propose_next, features,
                                            sampling=None if inp.sampling.is_greedy else inp.sampling)))
        if items:
            for (out, _), proposal in zip(items, self.drafter.propose_now([item for _, item in items])):
                out.proposal = proposal

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        owner = caller(context)
        seq_ids = [s for s in request.seq_ids if self.leases.allows(s, owner)]  # another owner's: left alone
        self._forget_ahead(seq_ids)
        released = await self.worker.run(self.engine.release, seq_ids, inline=True)
        self.leases.forget(seq_ids)
        return pb.ReleaseResponse(num_released=released, memory=self._memory())

    def _owned(self, items: list, owner: str) -> list:
        """Inputs naming a sequence another gateway owns become INVALID outputs."""
        return [convert.StepOutput(i.seq_id, status=Status.INVALID, error="the sequence belongs to another "
                                   "gateway") if not isinstance(i, convert.StepOutput)
                and not self.leases.allows(i.seq_id, owner) else i for i in items]

    async def free_idle(self) -> int:
        """Free the sequences no call has used within the idle TTL (their gateway is gone); returns how many."""
        return await leases.free_idle(self.leases, self.worker, self.engine.release)

    async def Info(self, request: pb.InfoRequest, context) -> pb.ModelInfo:
        cfg = self.engine.runner.model_config
        return pb.ModelInfo(
            model_path=self.model_path, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_context_len=self.engine.max_context_len, eos_token_ids=list(cfg.eos_token_ids),
            memory=self._memory(), device=str(self.engine.device), dtype=str(self.engine.runner.dtype),
            protocol=PROTOCOL, hidden_size=cfg.hidden_size, accelerator=accelerator_id(self.engine.device),
            algorithm=self.drafter.proposer.algorithm if self.drafter is not None else "")


async def serve_target(engine: TargetEngine, model_path: str, host: str, port: int, *, metrics=None,
                       credentials=None, inline_steps: bool = True,
                       max_tree_nodes: int = convert.DEFAULT_MAX_TREE_NODES, service_api_key: str | None = None,
                       seq_idle_ttl_s: float = DEFAULT_IDLE_TTL_S, proposer=None,
                       profiler: ProcessProfiler | None = None, run_ahead: bool = False,
                       chain_steps: bool = True):
    """Start the target gRPC server; returns (server, bound_port). service_api_key: the credential every RPC but
    health checks must carry (None = open).
    metrics: a tandem.observability.ServiceMetrics to fill; credentials: protos.wire.server_credentials for TLS;
    inline_steps=False runs every model call on the worker thread. proposer: a draft_service Proposer over this
    engine (UNO: the target drafts for itself) served as DraftService on the same port; its calls share the
    target's ModelWorker, so one model call runs at a time. profiler: this process's ProcessProfiler (--profile-dir),
    served as the Profiler service (without one, StartProfile answers that profiling is off). run_ahead
    (--enable-run-ahead): after each Verify, run the call expected next while the answer travels
    (TargetServicer._start_ahead). chain_steps (default; --disable-chained-speculative-steps): a call's speculative
    steps after its first run chained on the device where the static verify and draft steps take them
    (target_service/chained.py)."""
    from draft_service.server import DraftServicer

    servicer = TargetServicer(engine, model_path, metrics, inline_steps, max_tree_nodes, seq_idle_ttl_s, run_ahead)
    drafter = None
    if proposer is not None:
        drafter = DraftServicer(proposer, model_path, metrics=metrics, inline_steps=inline_steps,
                                seq_idle_ttl_s=seq_idle_ttl_s)
        drafter.worker = servicer.worker
        servicer.drafter = drafter
        if chain_steps and getattr(proposer, "chainable", False):
            from target_service.chained import ChainedSteps

            chained = ChainedSteps(engine, proposer)
            if chained.enable():
                servicer.chained = chained
    servicer.profiling = ProfilerServicer(profiler or ProcessProfiler("target", None), servicer.worker)
    if metrics is not None:
        runner = engine.runner
        metrics.bind_memory(lambda: (runner.num_free_tokens(), runner.num_total_tokens(), engine.num_seqs))
        bm = runner.block_manager
        if bm.prefix_cache:
            metrics.bind_prefix_cache(lambda: (bm.num_cache_queries, bm.num_cache_hits,
                                               bm.num_cached_blocks() * bm.block_size))
    def register(server) -> None:
        pb_grpc.add_TargetServiceServicer_to_server(servicer, server)
        if drafter is not None:
            pb_grpc.add_DraftServiceServicer_to_server(drafter, server)
        add_profiler(servicer.profiling, server)

    names = ["TargetService", *(["DraftService"] if drafter is not None else []), "Profiler"]
    server, bound, _ = await start_server(
        register, [pb.DESCRIPTOR.services_by_name[n].full_name for n in names], host, port,
        interceptors=[*([metrics.interceptor()] if metrics is not None else ()), ErrorInterceptor()],
        credentials=credentials,
        service_api_key=service_api_key)
    server.servicer = servicer  # tests and benchmarks read its ModelWorker counters
    server.drafter = drafter
    server.idle_sweeper = asyncio.create_task(  # ends with the event loop
        leases.free_idle_forever(servicer.free_idle, servicer.leases.idle_ttl_s))
    if drafter is not None:
        server.draft_idle_sweeper = asyncio.create_task(
            leases.free_idle_forever(drafter.free_idle, drafter.leases.idle_ttl_s))
    logger.info("target service listening on %s:%d", host, bound)
    return server, bound
