"""Wire ↔ proposer conversion for the draft service.

Every per-sequence field is checked here (token ids against the draft's vocabulary, the speculation shape against
the service's per-call limits, feature tensors against their bytes); a sequence that fails becomes an INVALID result
of its own, so one bad sequence never fails the other sequences of its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.steps import DraftPrefillInput, ProposeInput, ProposeOutput, SpecShape
from core.types import SamplingParams
from core.types import SeqStatus as Status
from protos.tandem.v1 import tandem_pb2 as pb
from protos.wire import tensor_from_pb, tensor_to_pb

DEFAULT_MAX_DRAFT_TOKENS = 512  # tree nodes one Propose may ask per sequence (as the target's tree limit)
DEFAULT_MAX_STEPS_X_TOPK = 1024  # num_steps * topk: the draft forwards' candidate tokens per sequence
MAX_NUM_STEPS = 64


@dataclass(frozen=True)
class Limits:
    """Per-call bounds of the draft service. vocab_size: token ids must be below it (None = any id, for proposers
    without a model, e.g. NGRAM)."""

    vocab_size: int | None = None
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS
    max_steps_x_topk: int = DEFAULT_MAX_STEPS_X_TOPK


@dataclass
class PrefillItem(DraftPrefillInput):
    """A draft Prefill input with the outcome of its checks."""

    status: Status = Status.OK  # INVALID: refused here, not run
    error: str = ""


def propose_inputs(request: pb.ProposeRequest, limits: Limits = Limits()) -> list[ProposeInput | ProposeOutput]:
    """One ProposeInput per sequence, or an INVALID ProposeOutput for a sequence whose fields are out of range."""
    items, seen = [], set()
    for s in request.seqs:
        try:
            if s.seq_id in seen:
                raise ValueError("the sequence appears twice in one call")
            spec = SpecShape(s.spec.num_steps, max(1, s.spec.topk), s.spec.num_draft_tokens)
            check_spec(spec, limits)
            if len(s.new_token_ids) > s.committed_len:
                raise ValueError(f"{len(s.new_token_ids)} new tokens > committed_len {s.committed_len}")
            _check_tokens(s.new_token_ids, limits)
            items.append(ProposeInput(s.seq_id, s.committed_len, list(s.new_token_ids), spec,
                                      features=tensor_from_pb(s.features), append_guess=s.append_guess,
                                      sampling=_sampling(s)))
        except ValueError as exc:
            items.append(ProposeOutput(s.seq_id, Status.INVALID, base_committed_len=s.committed_len,
                                       error=f"{s.seq_id}: {exc}"))
        seen.add(s.seq_id)
    return items


def prefill_inputs(request: pb.DraftPrefillRequest, limits: Limits = Limits()) -> list[PrefillItem]:
    items = []
    for s in request.seqs:
        try:
            _check_tokens(s.token_ids, limits)
            items.append(PrefillItem(s.seq_id, list(s.token_ids), tensor_from_pb(s.features)))
        except ValueError as exc:
            items.append(PrefillItem(s.seq_id, [], None, status=Status.INVALID, error=str(exc)))
    return items


def split(items: list) -> tuple[list[ProposeInput], list[ProposeOutput | None]]:
    """(the valid inputs, a slot per item: its INVALID output, or None where the proposer's output goes)."""
    valid = [i for i in items if isinstance(i, ProposeInput)]
    return valid, [None if isinstance(i, ProposeInput) else i for i in items]


def merge(slots: list[ProposeOutput | None], outputs: list[ProposeOutput]) -> list[ProposeOutput]:
    it = iter(outputs)
    return [slot if slot is not None else next(it) for slot in slots]


def propose_result(out: ProposeOutput) -> pb.ProposeResult:
    tree = pb.DraftTree(token_ids=out.tree.token_ids, parents=out.tree.parents)
    if out.tree.draft_probs is not None:
        tree.draft_probs.CopyFrom(tensor_to_pb(out.tree.draft_probs))
    return pb.ProposeResult(seq_id=out.seq_id, status=int(out.status), tree=tree,
                            base_committed_len=out.base_committed_len, error=out.error,
                            guessed_token_ids=out.guessed_token_ids)


def _sampling(s: pb.ProposeSeq) -> SamplingParams | None:
    """The temperature/top-k/top-p a sampled request draws with (what a rejection-sampling draft samples q from);
    None when unset (greedy). ValueError outside their domain (0 = unset for top_p and top_k, as the target reads)."""
    if not s.HasField("sampling") or s.sampling.temperature == 0.0:
        return None
    msg = s.sampling
    if msg.top_k < -1:
        raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {msg.top_k}")
    if msg.top_p != 0.0 and not 0.0 < msg.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (0 = unset), got {msg.top_p}")
    return SamplingParams(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k if msg.top_k > 0 else -1,
                          seed=msg.seed if msg.HasField("seed") else None)


def check_spec(spec: SpecShape, limits: Limits) -> None:
    if not 0 <= spec.num_steps <= MAX_NUM_STEPS:
        raise ValueError(f"num_steps {spec.num_steps} outside [0, {MAX_NUM_STEPS}]")
    if spec.num_steps * spec.topk > limits.max_steps_x_topk:
        raise ValueError(f"num_steps * topk = {spec.num_steps * spec.topk} exceeds {limits.max_steps_x_topk}")
    if not 0 <= spec.num_draft_tokens <= limits.max_draft_tokens:
        raise ValueError(f"num_draft_tokens {spec.num_draft_tokens} outside [0, {limits.max_draft_tokens}]")


def _check_tokens(token_ids, limits: Limits) -> None:
    if limits.vocab_size is not None and any(t >= limits.vocab_size for t in token_ids):
        raise ValueError(f"token id {max(token_ids)} outside the vocabulary ({limits.vocab_size})")
