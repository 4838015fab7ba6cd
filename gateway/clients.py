"""gRPC clients of the model services, as the scheduler sees them: the step items of core/steps.py in and out (the
services' convert modules build the same items from the wire on their side).

Every call has a deadline. Transport failures surface as `PodUnavailable` so the scheduler can fall back (draft) or
fail over (target) without knowing about grpc. The per-step RPCs (Verify, Propose) travel on one persistent
bidirectional stream per pod (`StepStream`) unless `step_streams=False` (the gateway's --disable-step-streams).
"""
from __future__ import annotations

import asyncio
import logging
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.steps import (DraftPrefillInput, PrefillInput, ProposeInput, ProposeOutput, SpecShape, StepOutput,
                        VerifyInput)
from core.types import DraftTree, FinishReason, SamplingParams, SeqStatus, StopRule
from gateway.features import FeatureRows
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from protos.profiler import ProfileError, ProfileOptions, ProfileState
from protos.service_auth import bearer_metadata
from protos.wire import CHANNEL_OPTIONS, OWNER_METADATA

logger = logging.getLogger(__name__)


class PodUnavailable(Exception):
    """The pod could not be reached or failed the call (transport error, deadline, internal error)."""


STATUS_OK = SeqStatus.OK
STATUS_STALE = SeqStatus.STALE
STATUS_OOM = SeqStatus.OUT_OF_MEMORY
STATUS_INVALID = SeqStatus.INVALID
_FINISH_FROM_PB = {pb.FINISH_REASON_STOP: FinishReason.STOP, pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
                   pb.FINISH_REASON_ABORT: FinishReason.ABORT}  # FINISH_REASON_UNSPECIFIED: still running


def _status(value: int) -> SeqStatus:
    """A pod's tandem.v1.SeqStatus; a value this gateway does not know counts as INVALID (that sequence fails)."""
    try:
        return SeqStatus(value)
    except ValueError:
        return SeqStatus.INVALID


def _sampling(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                            repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias))
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def _features_from_pb(msg: pb.Tensor) -> FeatureRows | None:
    if not msg.dtype:
        return None
    return FeatureRows(msg.dtype, tuple(msg.shape[1:]), msg.data, msg.shape[0])


def _features_to_pb(rows: FeatureRows | None) -> pb.Tensor | None:
    if rows is None:
        return None
    return pb.Tensor(dtype=rows.dtype, shape=[rows.num_rows, *rows.row_shape], data=rows.data)


def _stop(s: StopRule) -> pb.StopParams:
    return pb.StopParams(max_new_tokens=s.max_new_tokens, stop_token_ids=sorted(s.stop_token_ids),
                         ignore_eos=s.ignore_eos, prompt_len=s.prompt_len)


class _Client:
    def __init__(self, address: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None,
                 service_api_key: str | None = None, owner: str = ""):
        """service_api_key: the pods' shared credential, sent with every call; owner: this gateway's id, which owns
        the sequences it creates on the pod (another owner's Release is refused)."""
        self.address = address
        self.timeout_s = timeout_s
        self.service_api_key = service_api_key
        self.owner = owner
        if credentials is not None:  # TLS / mTLS to the pod (protos.wire.channel_credentials)
            self.channel = grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._streams: list[StepStream] = []

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Sent with every call: the service credential and the owner id."""
        owner = ((OWNER_METADATA, self.owner),) if self.owner else ()
        return (*bearer_metadata(self.service_api_key), *owner)

    async def health_check(self, timeout_s: float = 2.0) -> bool:
        """True when the pod answers grpc.health.v1 SERVING (no credential needed) within the deadline."""
        try:
            response = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def _call(self, method, request, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        except grpc.aio.UsageError as exc:  # the channel was closed under us
            raise PodUnavailable(f"{self.address}: {exc}") from exc

    def _error(self, exc: grpc.aio.AioRpcError) -> Exception:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return ValueError(exc.details())
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            return ProfileError(exc.details())
        return PodUnavailable(f"{self.address}: {exc.code().name}: {exc.details()}")

    async def start_profile(self, options: ProfileOptions, timeout_s: float = 30.0) -> ProfileState:
        """Start profiling the pod's process (its Profiler service); ProfileError when it cannot (profiling off,
        one running)."""
        request = pb.StartProfileRequest(num_steps=options.num_steps, activities=list(options.activities),
                                         record_shapes=options.record_shapes, with_stack=options.with_stack,
                                         profile_id=options.profile_id, output_dir=options.output_dir)
        return _profile_state(await self._call(pb_grpc.ProfilerStub(self.channel).StartProfile, request, timeout_s))

    async def stop_profile(self, timeout_s: float = 120.0) -> ProfileState:
        """Stop the pod's profile; it writes its files first (a long trace takes a while)."""
        return _profile_state(await self._call(pb_grpc.ProfilerStub(self.channel).StopProfile,
                                               pb.StopProfileRequest(), timeout_s))

    def _step_stream(self, stream_method, unary_method, enabled: bool) -> StepStream:
        stream = StepStream(self, stream_method, unary_method, enabled)
        self._streams.append(stream)
        return stream

    async def close(self) -> None:
        for stream in self._streams:
            stream.reset()
        await self.channel.close()


class StepStream:
    """A step RPC over one lazily opened, persistent bidi stream: each call writes one request and awaits its one
    response under the same deadline as the unary call. Why: a round trip on an open stream costs about half a unary
    call (no per-call HTTP/2 stream setup, headers and deadline bookkeeping), and a step is a few ms.

    One request is outstanding at a time; a call made while the stream is busy (the scheduler issuing two step calls
    to one pod at once) goes unary instead of queueing behind the first. A deadline or transport error cancels the
    stream and raises PodUnavailable exactly like the unary path (the next call opens a fresh stream); a pod that
    answers UNIMPLEMENTED (a server without the stream method) is served unary from then on.
    """

    def __init__(self, client: _Client, stream_method, unary_method, enabled: bool = True):
        self.client = client
        self._open = stream_method  # stub.VerifyStream / stub.ProposeStream
        self._unary = unary_method  # stub.Verify / stub.Propose
        self.enabled = enabled
        self.num_opened = 0  # streams opened so far (tests, benchmarks)
        self.num_unary = 0  # calls that went unary (disabled, busy, or UNIMPLEMENTED)
        self._call = None
        self._busy = False

    async def __call__(self, request, timeout_s: float | None = None):
        if not self.enabled or self._busy:
            self.num_unary += 1
            return await self.client._call(self._unary, request, timeout_s)
        self._busy = True
        try:
            return await self._roundtrip(request, timeout_s or self.client.timeout_s)
        finally:
            self._busy = False

    async def _roundtrip(self, request, timeout_s: float):
        address = self.client.address
        try:
            if self._call is None or self._call.done():  # first call, or the last stream ended between steps
                self._call = self._open(metadata=self.client.metadata)
                self.num_opened += 1
            call = self._call
            async with asyncio.timeout(timeout_s):  # no extra task per call, unlike wait_for (~25 us saved)
                await call.write(request)
                response = await call.read()
        except TimeoutError:
            self.reset()
            raise PodUnavailable(f"{address}: DEADLINE_EXCEEDED: no step response on the stream within "
                                 f"{timeout_s:g}s") from None
        except grpc.aio.AioRpcError as exc:
            self.reset()
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                logger.warning("pod %s has no step streams (%s); using unary step RPCs", address, exc.details())
                self.enabled = False
                self.num_unary += 1
                return await self.client._call(self._unary, request, timeout_s)
            raise self.client._error(exc) from exc
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:  # the channel or stream closed under us
            self.reset()
            raise PodUnavailable(f"{address}: {exc}") from exc
        except BaseException:  # cancelled mid-call: the stream's next response would belong to this request
            self.reset()
            raise
        if response is grpc.aio.EOF:
            self.reset()
            raise PodUnavailable(f"{address}: the step stream ended without a response")
        return response

    def reset(self) -> None:
        """Cancel the open stream, if any; the next call opens a new one."""
        call, self._call = self._call, None
        if call is not None and not call.done():
            call.cancel()


class TargetClient(_Client):
    def __init__(self, address: str, timeout_s: float = 120.0, credentials: grpc.ChannelCredentials | None = None,
                 step_streams: bool = True, service_api_key: str | None = None, owner: str = ""):
        super().__init__(address, timeout_s, credentials, service_api_key, owner)
        self.stub = pb_grpc.TargetServiceStub(self.channel)
        self.verify_stream = self._step_stream(self.stub.VerifyStream, self.stub.Verify, step_streams)

    async def info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        return await self._call(self.stub.Info, pb.InfoRequest(), timeout_s)

    async def prefill(self, items: list[PrefillInput]) -> list[StepOutput]:
        request = pb.TargetPrefillRequest(seqs=[
            pb.TargetPrefillSeq(seq_id=i.seq_id, token_ids=i.token_ids, sample_next_token=i.sample_next_token,
                                sampling=_sampling(i.sampling), stop=_stop(i.stop), return_features=i.return_features,
                                return_logprobs=i.logprobs >= 0, top_logprobs=max(i.logprobs, 0),
                                prefill_draft=i.prefill_draft,
                                propose_next=_spec(i.propose_next) if i.propose_next is not None else None)
            for i in items])
        response = await self._call(self.stub.Prefill, request)
        return [StepOutput(r.seq_id, _status(r.status), list(r.token_ids),
                           finish_reason=_FINISH_FROM_PB.get(r.finish_reason), error=r.error,
                           features=_features_from_pb(r.features), logprobs=_logprobs(r),
                           num_cached_tokens=r.num_cached_tokens,
                           proposal=_proposal(r.proposal) if r.HasField("proposal") else None)
                for r in response.results]

    async def verify(self, items: list[VerifyInput], batch_may_grow: bool = False) -> list[StepOutput]:
        """batch_may_grow: requests wait for admission, so the next call may add sequences (the pod then does not
        run this batch ahead)."""
        request = pb.VerifyRequest(batch_may_grow=batch_may_grow, seqs=[
            pb.VerifySeq(seq_id=i.seq_id, committed_len=i.committed_len, root_token_id=i.root_token_id,
                         tree=pb.DraftTree(token_ids=i.tree.token_ids, parents=i.tree.parents,
                                           draft_probs=_features_to_pb(i.tree.draft_probs)),
                         sampling=_sampling(i.sampling), stop=_stop(i.stop), return_features=i.return_features,
                         num_decode_steps=i.num_decode_steps, return_logprobs=i.logprobs >= 0,
                         top_logprobs=max(i.logprobs, 0),
                         propose_next=_spec(i.propose_next) if i.propose_next is not None else None)
            for i in items])
        response = await self.verify_stream(request)
        return [StepOutput(r.seq_id, _status(r.status), list(r.token_ids), r.num_accepted_drafts, r.num_draft_tokens,
                           _FINISH_FROM_PB.get(r.finish_reason), r.error, _features_from_pb(r.features),
                           max(1, r.num_steps), _logprobs(r),
                           proposal=_proposal(r.proposal) if r.HasField("proposal") else None)
                for r in response.results]

    async def release(self, seq_ids: list[str]) -> int:
        response = await self._call(self.stub.Release, pb.ReleaseRequest(seq_ids=seq_ids), 10.0)
        return response.num_released

class DraftClient(_Client):
    def __init__(self, address: str, timeout_s: float = 60.0, credentials: grpc.ChannelCredentials | None = None,
                 step_streams: bool = True, service_api_key: str | None = None, owner: str = ""):
        super().__init__(address, timeout_s, credentials, service_api_key, owner)
        self.stub = pb_grpc.DraftServiceStub(self.channel)
        self.propose_stream = self._step_stream(self.stub.ProposeStream, self.stub.Propose, step_streams)

    async def info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        return await self._call(self.stub.Info, pb.InfoRequest(), timeout_s)

    async def prefill(self, seqs: list[DraftPrefillInput]) -> list[SeqStatus]:
        request = pb.DraftPrefillRequest(seqs=[
            pb.DraftPrefillSeq(seq_id=s.seq_id, token_ids=s.token_ids, features=_features_to_pb(s.features))
            for s in seqs])
        response = await self._call(self.stub.Prefill, request)
        return [_status(r.status) for r in response.results]

    async def propose(self, items: list[ProposeInput]) -> list[ProposeOutput]:
        request = pb.ProposeRequest(seqs=[
            pb.ProposeSeq(seq_id=i.seq_id, committed_len=i.committed_len, new_token_ids=i.new_token_ids,
                          features=_features_to_pb(i.features), spec=_spec(i.spec), append_guess=i.append_guess,
                          sampling=_sampling(i.sampling) if i.sampling is not None else None)
            for i in items])
        response = await self.propose_stream(request)
        return [_proposal(r) for r in response.results]

    async def release(self, seq_ids: list[str]) -> int:
        response = await self._call(self.stub.Release, pb.ReleaseRequest(seq_ids=seq_ids), 10.0)
        return response.num_released

    async def add_external_corpus(self, corpus_id: str, documents: list[list[int]]) -> tuple[int, dict[str, int]]:
        """An NGRAM pod indexes documents (token ids) as corpus `corpus_id`: (its tokens, every corpus's tokens).
        ValueError when the pod refuses it (not NGRAM, over the token cap)."""
        request = pb.AddExternalCorpusRequest(corpus_id=corpus_id,
                                              documents=[pb.CorpusDocument(token_ids=d) for d in documents])
        response = await self._call(self.stub.AddExternalCorpus, request, max(self.timeout_s, 300.0))
        return response.loaded_token_count, dict(response.corpus_token_counts)

    async def remove_external_corpus(self, corpus_id: str) -> dict[str, int]:
        request = pb.RemoveExternalCorpusRequest(corpus_id=corpus_id)
        return dict((await self._call(self.stub.RemoveExternalCorpus, request)).corpus_token_counts)

    async def list_external_corpora(self) -> dict[str, int]:
        request = pb.ListExternalCorporaRequest()
        return dict((await self._call(self.stub.ListExternalCorpora, request)).corpus_token_counts)


def _spec(shape: SpecShape) -> pb.SpecParams:
    return pb.SpecParams(num_steps=shape.num_steps, topk=shape.topk, num_draft_tokens=shape.num_draft_tokens)


def _proposal(r: pb.ProposeResult) -> ProposeOutput:
    return ProposeOutput(r.seq_id, _status(r.status), DraftTree(list(r.tree.token_ids), list(r.tree.parents),
                                                                _features_from_pb(r.tree.draft_probs)),
                         r.base_committed_len, r.error, list(r.guessed_token_ids))


def _logprobs(result) -> list[tuple[float, list[int], list[float]]] | None:
    if not len(result.logprobs):
        return None
    return [(e.logprob, list(e.top_token_ids), list(e.top_logprobs)) for e in result.logprobs]


def _profile_state(msg: pb.ProfileState) -> ProfileState:
    return ProfileState(msg.active, list(msg.files), msg.num_steps, msg.process)
