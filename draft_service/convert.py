"""Wire ↔ proposer conversion for the draft service."""
from __future__ import annotations

from draft_service.proposer import ProposeInput, ProposeOutput, SpecShape
from protos.tandem.v1 import tandem_pb2 as pb
from protos.wire import tensor_from_pb


def propose_inputs(request: pb.ProposeRequest) -> list[ProposeInput]:
    inputs = []
    for s in request.seqs:
        spec = SpecShape(s.spec.num_steps, max(1, s.spec.topk), s.spec.num_draft_tokens)
        if len(s.new_token_ids) > s.committed_len:
            raise ValueError(f"{s.seq_id}: {len(s.new_token_ids)} new tokens > committed_len {s.committed_len}")
        inputs.append(ProposeInput(s.seq_id, s.committed_len, list(s.new_token_ids), spec,
                                   features=tensor_from_pb(s.hidden), append_guess=s.append_guess))
    return inputs


def prefill_inputs(request: pb.DraftPrefillRequest) -> list[tuple[str, list[int], object]]:
    return [(s.seq_id, list(s.token_ids), tensor_from_pb(s.hidden)) for s in request.seqs]


def propose_result(out: ProposeOutput) -> pb.ProposeResult:
    tree = pb.DraftTree(token_ids=out.tree.token_ids, parents=out.tree.parents)
    return pb.ProposeResult(seq_id=out.seq_id, status=int(out.status), tree=tree,
                            base_committed_len=out.base_committed_len, error=out.error,
                            guessed_token_ids=out.guessed_token_ids)
