"""Wire ↔ engine conversion for the target service (the only place besides the servicer that sees *_pb2).

Every per-sequence field is checked here against the domain the engine accepts (vocabulary, tree size, sampling
ranges, logprobs); a sequence that fails becomes an INVALID `StepOutput` of its own, so one bad sequence never fails
the other sequences of its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.steps import PrefillInput, SpecShape, StepOutput, VerifyInput
from core.types import DraftTree, FinishReason, SamplingParams, StopRule
from draft_service.convert import propose_result  # a co-located draft's proposal rides in the VerifyResult
from protos.tandem.v1 import tandem_pb2 as pb
from protos.wire import tensor_from_pb, tensor_to_pb
from target_service.engine import MAX_DECODE_STEPS, MAX_TOP_LOGPROBS, Status

DEFAULT_MAX_TREE_NODES = 512  # draft nodes one Verify may carry per sequence (--max-verify-tree-nodes)

FINISH_TO_PB = {None: pb.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: pb.FINISH_REASON_STOP,
                FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.ABORT: pb.FINISH_REASON_ABORT}


@dataclass(frozen=True)
class Limits:
    """Per-call bounds of the target service: token ids below `vocab_size`, trees of at most `max_tree_nodes`."""

    vocab_size: int
    max_tree_nodes: int = DEFAULT_MAX_TREE_NODES


def sampling_from_pb(msg: pb.SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """ValueError for values outside the engine's domain (0 is 'unset' for top_p, top_k and repetition_penalty)."""
    if msg.top_k < -1:
        raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {msg.top_k}")
    if msg.top_p != 0.0 and not 0.0 < msg.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (0 = unset), got {msg.top_p}")
    if vocab_size is not None and any(t >= vocab_size for t in msg.logit_bias):
        raise ValueError(f"logit_bias names a token id outside the vocabulary ({vocab_size})")
    top_k = msg.top_k if msg.top_k > 0 else -1
    top_p = msg.top_p if msg.top_p != 0.0 else 1.0
    seed = msg.seed if msg.HasField("seed") else None
    return SamplingParams(temperature=msg.temperature, top_p=top_p, top_k=top_k, seed=seed,
                          presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                          repetition_penalty=msg.repetition_penalty or 1.0,
                          logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())))


def stop_from_pb(msg: pb.StopParams) -> StopRule:
    return StopRule(max_new_tokens=msg.max_new_tokens, stop_token_ids=frozenset(msg.stop_token_ids),
                    ignore_eos=msg.ignore_eos, prompt_len=msg.prompt_len)


def tree_from_pb(msg: pb.DraftTree, limits: Limits | None = None) -> DraftTree:
    if limits is not None and len(msg.token_ids) > limits.max_tree_nodes:
        raise ValueError(f"draft tree of {len(msg.token_ids)} nodes exceeds {limits.max_tree_nodes}")
    tree = DraftTree(list(msg.token_ids), list(msg.parents), _draft_probs(msg, limits))
    tree.validate(limits.vocab_size if limits is not None else None)
    return tree


def _draft_probs(msg: pb.DraftTree, limits: Limits | None):
    """The draft's sampling distributions q (num_nodes, vocab) float32 for p/q rejection sampling, or None. Checked so
    that the verify cannot fail on them: a chain, one row per node, finite, >= 0, and q > 0 at each drafted token."""
    if not msg.HasField("draft_probs") or not msg.draft_probs.dtype:
        return None
    q = tensor_from_pb(msg.draft_probs)
    n = len(msg.token_ids)
    if q.dtype != torch.float32 or q.dim() != 2 or q.shape[0] != n:
        raise ValueError(f"draft_probs must be float32 (num_nodes={n}, vocab), got {msg.draft_probs.dtype} "
                         f"{tuple(q.shape)}")
    if limits is not None and q.shape[1] != limits.vocab_size:
        raise ValueError(f"draft_probs cover {q.shape[1]} tokens, the target's vocabulary has {limits.vocab_size}")
    if list(msg.parents) != list(range(-1, n - 1)):
        raise ValueError("draft_probs come with chains only (rejection sampling needs --speculative-eagle-topk 1)")
    if n and (not bool(q.isfinite().all()) or bool((q < 0).any())):
        raise ValueError("draft_probs must be finite and >= 0")
    if any(t >= q.shape[1] or float(q[i, t]) <= 0.0 for i, t in enumerate(msg.token_ids)):
        raise ValueError("a drafted token has draft probability 0: it was not sampled from draft_probs")
    return q


def logprobs_from_pb(msg) -> int:
    """-1 (none) or the number of alternatives to list; ValueError beyond MAX_TOP_LOGPROBS."""
    if msg.top_logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs {msg.top_logprobs} exceeds {MAX_TOP_LOGPROBS}")
    return msg.top_logprobs if msg.return_logprobs else -1


def prefill_inputs(request: pb.TargetPrefillRequest, limits: Limits | None = None
                   ) -> list[PrefillInput | StepOutput]:
    """One PrefillInput per sequence, or an INVALID StepOutput for a sequence whose fields are out of range."""
    vocab = limits.vocab_size if limits is not None else None

    def one(s: pb.TargetPrefillSeq) -> PrefillInput:
        if vocab is not None and any(t >= vocab for t in s.token_ids):
            raise ValueError(f"token id {max(s.token_ids)} outside the vocabulary ({vocab})")
        return PrefillInput(seq_id=s.seq_id, token_ids=list(s.token_ids), sample_next_token=s.sample_next_token,
                            sampling=sampling_from_pb(s.sampling, vocab), stop=stop_from_pb(s.stop),
                            return_features=s.return_features, logprobs=logprobs_from_pb(s),
                            prefill_draft=s.prefill_draft, propose_next=_shape(s))

    return _per_seq(request.seqs, one)


def verify_inputs(request: pb.VerifyRequest, limits: Limits | None = None) -> list[VerifyInput | StepOutput]:
    """One VerifyInput per sequence, or an INVALID StepOutput for a sequence whose fields are out of range."""
    vocab = limits.vocab_size if limits is not None else None

    def one(s: pb.VerifySeq) -> VerifyInput:
        if s.num_decode_steps > MAX_DECODE_STEPS:
            raise ValueError(f"num_decode_steps {s.num_decode_steps} exceeds {MAX_DECODE_STEPS}")
        if vocab is not None and s.root_token_id >= vocab:
            raise ValueError(f"root token id {s.root_token_id} outside the vocabulary ({vocab})")
        return VerifyInput(seq_id=s.seq_id, committed_len=s.committed_len, root_token_id=s.root_token_id,
                           tree=tree_from_pb(s.tree, limits), sampling=sampling_from_pb(s.sampling, vocab),
                           stop=stop_from_pb(s.stop), return_features=s.return_features,
                           num_decode_steps=max(1, s.num_decode_steps), logprobs=logprobs_from_pb(s),
                           propose_next=_shape(s))

    return _per_seq(request.seqs, one)


def split(items: list) -> tuple[list, list[StepOutput | None]]:
    """(the valid inputs, a slot per item: its INVALID output, or None where the engine's output goes)."""
    valid = [i for i in items if not isinstance(i, StepOutput)]
    return valid, [i if isinstance(i, StepOutput) else None for i in items]


def merge(slots: list[StepOutput | None], outputs: list[StepOutput]) -> list[StepOutput]:
    """The engine's outputs put back in request order beside the INVALID ones."""
    it = iter(outputs)
    return [slot if slot is not None else next(it) for slot in slots]


def _shape(s) -> SpecShape | None:
    """A step message's propose_next, when set."""
    if not s.HasField("propose_next"):
        return None
    return SpecShape(s.propose_next.num_steps, max(1, s.propose_next.topk), s.propose_next.num_draft_tokens)


def prefill_result(out: StepOutput) -> pb.TargetPrefillResult:
    msg = pb.TargetPrefillResult(seq_id=out.seq_id, status=int(out.status), token_ids=out.token_ids,
                                 finish_reason=FINISH_TO_PB[out.finish_reason], error=out.error, logprobs=_logprobs_pb(out),
                                 num_cached_tokens=out.num_cached_tokens)
    if out.features is not None:
        msg.features.CopyFrom(tensor_to_pb(out.features))
    if out.proposal is not None:
        msg.proposal.CopyFrom(propose_result(out.proposal))
    return msg


def verify_result(out: StepOutput) -> pb.VerifyResult:
    msg = pb.VerifyResult(seq_id=out.seq_id, status=int(out.status), token_ids=out.token_ids,
                          num_accepted_drafts=out.num_accepted_drafts, num_draft_tokens=out.num_draft_tokens,
                          finish_reason=FINISH_TO_PB[out.finish_reason], error=out.error, num_steps=out.num_steps,
                          logprobs=_logprobs_pb(out))
    if out.features is not None:
        msg.features.CopyFrom(tensor_to_pb(out.features))
    if out.proposal is not None:
        msg.proposal.CopyFrom(propose_result(out.proposal))
    return msg


def _per_seq(seqs, build) -> list:
    items, seen = [], set()
    for s in seqs:
        try:
            if s.seq_id in seen:
                raise ValueError("the sequence appears twice in one call")
            items.append(build(s))
        except ValueError as exc:
            items.append(StepOutput(s.seq_id, status=Status.INVALID, error=str(exc)))
        seen.add(s.seq_id)
    return items


def _logprobs_pb(out: StepOutput) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(logprob=lp, top_token_ids=ids, top_logprobs=vals) for lp, ids, vals in out.logprobs]
