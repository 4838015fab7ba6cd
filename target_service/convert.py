"""Wire ↔ engine conversion for the target service (the only place besides the servicer that sees *_pb2)."""
from __future__ import annotations

from protos.tandem.v1 import tandem_pb2 as pb
from protos.wire import tensor_to_pb
from runtime.sampling import SamplingParams
from runtime.speculative.tree import DraftTree
from target_service.engine import (MAX_DECODE_STEPS, MAX_TOP_LOGPROBS, PrefillInput, StepOutput, StopRule,
                                   VerifyInput)


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    top_k = msg.top_k if msg.top_k > 0 else -1
    top_p = msg.top_p if 0.0 < msg.top_p <= 1.0 else 1.0
    seed = msg.seed if msg.HasField("seed") else None
    return SamplingParams(temperature=msg.temperature, top_p=top_p, top_k=top_k, seed=seed,
                          presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                          repetition_penalty=msg.repetition_penalty or 1.0,
                          logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())))


def stop_from_pb(msg: pb.StopParams) -> StopRule:
    return StopRule(max_new_tokens=msg.max_new_tokens, stop_token_ids=frozenset(msg.stop_token_ids),
                    ignore_eos=msg.ignore_eos, prompt_len=msg.prompt_len)


def tree_from_pb(msg: pb.DraftTree) -> DraftTree:
    return DraftTree(list(msg.token_ids), list(msg.parents))


def logprobs_from_pb(msg) -> int:
    """-1 (none) or the number of alternatives to list; ValueError beyond MAX_TOP_LOGPROBS."""
    if msg.top_logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs {msg.top_logprobs} exceeds {MAX_TOP_LOGPROBS}")
    return msg.top_logprobs if msg.return_logprobs else -1


def prefill_inputs(request: pb.TargetPrefillRequest) -> list[PrefillInput]:
    return [PrefillInput(seq_id=s.seq_id, token_ids=list(s.token_ids), sample_next_token=s.sample_next_token,
                         sampling=sampling_from_pb(s.sampling), stop=stop_from_pb(s.stop),
                         return_features=s.return_hidden, logprobs=logprobs_from_pb(s)) for s in request.seqs]


def verify_inputs(request: pb.VerifyRequest) -> list[VerifyInput]:
    too_many = [s.num_decode_steps for s in request.seqs if s.num_decode_steps > MAX_DECODE_STEPS]
    if too_many:
        raise ValueError(f"num_decode_steps {max(too_many)} exceeds {MAX_DECODE_STEPS}")
    return [VerifyInput(seq_id=s.seq_id, committed_len=s.committed_len, root_token_id=s.root_token_id,
                        tree=tree_from_pb(s.tree), sampling=sampling_from_pb(s.sampling), stop=stop_from_pb(s.stop),
                        return_features=s.return_hidden, num_decode_steps=max(1, s.num_decode_steps),
                        logprobs=logprobs_from_pb(s))
            for s in request.seqs]


def prefill_result(out: StepOutput) -> pb.TargetPrefillResult:
    msg = pb.TargetPrefillResult(seq_id=out.seq_id, status=int(out.status), token_ids=out.token_ids,
                                 finish_reason=int(out.finish), error=out.error, logprobs=_logprobs_pb(out),
                                 num_cached_tokens=out.num_cached_tokens)
    if out.features is not None:
        msg.hidden.CopyFrom(tensor_to_pb(out.features))
    return msg


def verify_result(out: StepOutput) -> pb.VerifyResult:
    msg = pb.VerifyResult(seq_id=out.seq_id, status=int(out.status), token_ids=out.token_ids,
                          num_accepted_drafts=out.num_accepted_drafts, num_draft_tokens=out.num_draft_tokens,
                          finish_reason=int(out.finish), error=out.error, num_steps=out.num_steps,
                          logprobs=_logprobs_pb(out))
    if out.features is not None:
        msg.hidden.CopyFrom(tensor_to_pb(out.features))
    return msg


def _logprobs_pb(out: StepOutput) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(logprob=lp, top_token_ids=ids, top_logprobs=vals) for lp, ids, vals in out.logprobs]
