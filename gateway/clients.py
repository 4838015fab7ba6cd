"""gRPC clients of the model services, as the scheduler sees them: plain dataclasses in, plain dataclasses out.

Every call has a deadline. Transport failures surface as `PodUnavailable` so the scheduler can fall back (draft) or
fail over (target) without knowing about grpc.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from gateway.features import FeatureRows
from gateway.types import RequestSampling
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from protos.wire import CHANNEL_OPTIONS


class PodUnavailable(Exception):
    """The pod could not be reached or failed the call (transport error, deadline, internal error)."""


@dataclass
class SeqStop:
    max_new_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    prompt_len: int


@dataclass
class TargetPrefillItem:
    seq_id: str
    token_ids: list[int]
    sample_next_token: bool
    sampling: RequestSampling
    stop: SeqStop
    return_features: bool = False


@dataclass
class VerifyItem:
    seq_id: str
    committed_len: int
    root_token_id: int
    tree_tokens: list[int]
    tree_parents: list[int]
    sampling: RequestSampling
    stop: SeqStop
    return_features: bool = False


@dataclass
class StepResult:
    """One sequence's answer to a step RPC."""

    seq_id: str
    status: int  # pb.SeqStatus value
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0  # pb.FinishReason value
    num_accepted_drafts: int = 0
    num_draft_tokens: int = 0
    error: str = ""
    features: FeatureRows | None = None  # target features of the tokens that gained KV (feature drafts)


@dataclass
class ProposeItem:
    seq_id: str
    committed_len: int
    new_token_ids: list[int]
    num_steps: int
    topk: int
    num_draft_tokens: int
    features: FeatureRows | None = None  # one row per new token: the feature of the token before it
    append_guess: bool = False  # pre-draft: new tokens end with a guess; the draft appends its own next token


@dataclass
class Proposal:
    seq_id: str
    status: int
    tree_tokens: list[int]
    tree_parents: list[int]
    base_committed_len: int
    guessed_token_ids: list[int] = field(default_factory=list)  # pre-draft: the token the draft appended


STATUS_OK = pb.SEQ_STATUS_OK
STATUS_STALE = pb.SEQ_STATUS_STALE
STATUS_OOM = pb.SEQ_STATUS_OUT_OF_MEMORY
STATUS_INVALID = pb.SEQ_STATUS_INVALID


def _sampling(s: RequestSampling) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
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


def _stop(s: SeqStop) -> pb.StopParams:
    return pb.StopParams(max_new_tokens=s.max_new_tokens, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
                         prompt_len=s.prompt_len)


class _Client:
    def __init__(self, address: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.timeout_s = timeout_s
        if credentials is not None:  # TLS / mTLS to the pod (protos.wire.channel_credentials)
            self.channel = grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)

    async def _call(self, method, request, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from exc
            raise PodUnavailable(f"{self.address}: {exc.code().name}: {exc.details()}") from exc
        except grpc.aio.UsageError as exc:  # the channel was closed under us
            raise PodUnavailable(f"{self.address}: {exc}") from exc

    async def close(self) -> None:
        await self.channel.close()


class TargetClient(_Client):
    def __init__(self, address: str, timeout_s: float = 120.0, credentials: grpc.ChannelCredentials | None = None):
        super().__init__(address, timeout_s, credentials)
        self.stub = pb_grpc.TargetServiceStub(self.channel)

    async def info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        return await self._call(self.stub.Info, pb.InfoRequest(), timeout_s)

    async def prefill(self, items: list[TargetPrefillItem]) -> list[StepResult]:
        request = pb.TargetPrefillRequest(seqs=[
            pb.TargetPrefillSeq(seq_id=i.seq_id, token_ids=i.token_ids, sample_next_token=i.sample_next_token,
                                sampling=_sampling(i.sampling), stop=_stop(i.stop), return_hidden=i.return_features)
            for i in items])
        response = await self._call(self.stub.Prefill, request)
        return [StepResult(r.seq_id, r.status, list(r.token_ids), r.finish_reason, error=r.error,
                           features=_features_from_pb(r.hidden)) for r in response.results]

    async def verify(self, items: list[VerifyItem]) -> list[StepResult]:
        request = pb.VerifyRequest(seqs=[
            pb.VerifySeq(seq_id=i.seq_id, committed_len=i.committed_len, root_token_id=i.root_token_id,
                         tree=pb.DraftTree(token_ids=i.tree_tokens, parents=i.tree_parents),
                         sampling=_sampling(i.sampling), stop=_stop(i.stop), return_hidden=i.return_features)
            for i in items])
        response = await self._call(self.stub.Verify, request)
        return [StepResult(r.seq_id, r.status, list(r.token_ids), r.finish_reason, r.num_accepted_drafts,
                           r.num_draft_tokens, r.error, _features_from_pb(r.hidden)) for r in response.results]

    async def release(self, seq_ids: list[str]) -> int:
        response = await self._call(self.stub.Release, pb.ReleaseRequest(seq_ids=seq_ids), 10.0)
        return response.num_released


class DraftClient(_Client):
    def __init__(self, address: str, timeout_s: float = 60.0, credentials: grpc.ChannelCredentials | None = None):
        super().__init__(address, timeout_s, credentials)
        self.stub = pb_grpc.DraftServiceStub(self.channel)

    async def info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        return await self._call(self.stub.Info, pb.InfoRequest(), timeout_s)

    async def prefill(self, seqs: list[tuple[str, list[int], FeatureRows | None]]) -> list[int]:
        request = pb.DraftPrefillRequest(seqs=[pb.DraftPrefillSeq(seq_id=s, token_ids=t, hidden=_features_to_pb(f))
                                               for s, t, f in seqs])
        response = await self._call(self.stub.Prefill, request)
        return [r.status for r in response.results]

    async def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        request = pb.ProposeRequest(seqs=[
            pb.ProposeSeq(seq_id=i.seq_id, committed_len=i.committed_len, new_token_ids=i.new_token_ids,
                          hidden=_features_to_pb(i.features), spec=pb.SpecParams(num_steps=i.num_steps, topk=i.topk, num_draft_tokens=i.num_draft_tokens),
                          append_guess=i.append_guess)
            for i in items])
        response = await self._call(self.stub.Propose, request)
        return [Proposal(r.seq_id, r.status, list(r.tree.token_ids), list(r.tree.parents), r.base_committed_len,
                         list(r.guessed_token_ids)) for r in response.results]

    async def release(self, seq_ids: list[str]) -> int:
        response = await self._call(self.stub.Release, pb.ReleaseRequest(seq_ids=seq_ids), 10.0)
        return response.num_released
