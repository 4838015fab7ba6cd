"""The per-sequence items of the step RPCs, defined once for the gateway (which sends them through its clients) and
the model services (whose convert modules build them from the wire): target Prefill / Verify inputs and their
StepOutput, draft Prefill / Propose inputs and the ProposeOutput. Plain dataclasses (no torch, no protobuf).

Feature rows are opaque here: a (rows, F) torch tensor in the services, FeatureRows (bytes) in the gateway, which
never looks inside them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.types import DraftTree, FinishReason, SamplingParams, SeqStatus, StopRule

Features = Any  # (rows, F) target feature rows: torch.Tensor in the services, gateway.features.FeatureRows
Logprobs = list[tuple[float, list[int], list[float]]]  # per token: (logprob, top token ids, top logprobs)


@dataclass(frozen=True)
class SpecShape:
    """The speculation shape of one Propose: draft steps, beam width, tree nodes including the root."""

    num_steps: int
    topk: int
    num_draft_tokens: int


@dataclass
class PrefillInput:
    """Target Prefill of one sequence: its KV for token_ids (all committed tokens when re-synced)."""

    seq_id: str
    token_ids: list[int]
    sample_next_token: bool  # a new sequence samples its first token; a re-synced one keeps its pending last token
    sampling: SamplingParams
    stop: StopRule
    return_features: bool = False
    logprobs: int = -1  # -1: none; k >= 0: the sampled token's logprob and the top k alternatives
    # A target with a draft in its own process: prefill that draft too, handing it the features there (not returned)
    prefill_draft: bool = False
    # ... and have it draft the first tree of this shape (StepOutput.proposal): the first step needs no Propose
    propose_next: SpecShape | None = None


@dataclass
class VerifyInput:
    """Target Verify of one sequence: root (the last committed token) + tree in one forward, then acceptance."""

    seq_id: str
    committed_len: int
    root_token_id: int
    tree: DraftTree  # empty: a plain decode step
    sampling: SamplingParams
    stop: StopRule
    return_features: bool = False
    num_decode_steps: int = 1  # empty tree only: decode steps run back to back in this call
    logprobs: int = -1  # -1: none; k >= 0: each emitted token's logprob and the top k alternatives
    # A target with a draft in its own process: draft the next tree of this shape from the outcome right after the
    # verify (StepOutput.proposal), one round trip per step. None: verify only.
    propose_next: SpecShape | None = None


@dataclass
class StepOutput:
    """One sequence's answer to a target Prefill or Verify."""

    seq_id: str
    status: SeqStatus = SeqStatus.OK
    token_ids: list[int] = field(default_factory=list)
    num_accepted_drafts: int = 0
    num_draft_tokens: int = 0
    finish_reason: FinishReason | None = None  # None: still running
    error: str = ""
    # Target features of the tokens that gained KV in this call (feature-based drafts): prefill → one row per
    # prompt token; verify → the root and the accepted drafts. Row i is the feature of the i-th such token.
    features: Features | None = None
    num_steps: int = 1  # target forward steps this output covers (continuous decode: up to num_decode_steps)
    # per emitted token when asked, under the raw target distribution (the gateway reads None for none)
    logprobs: Logprobs | None = field(default_factory=list)
    num_cached_tokens: int = 0  # prefill: prompt tokens whose KV came from the prefix cache
    proposal: ProposeOutput | None = None  # VerifyInput.propose_next: the next tree, drafted from this outcome


@dataclass
class DraftPrefillInput:
    """Draft Prefill of one sequence: its committed tokens (+ for feature drafts, the features of all but the last)."""

    seq_id: str
    token_ids: list[int]
    features: Features | None = None  # (len(token_ids) - 1, F), row i = the target feature of token_ids[i]


@dataclass
class ProposeInput:
    """Draft Propose of one sequence: roll back to committed_len - len(new_token_ids), append them, draft."""

    seq_id: str
    committed_len: int
    new_token_ids: list[int]
    spec: SpecShape
    # (len(new_token_ids), F) for feature drafts (EAGLE): row i is the target feature of the token just before
    # new_token_ids[i]. None for proposers that need only token ids.
    features: Features | None = None
    # Pre-draft: append the proposer's greedy next token, draft from it. The new tokens then end with the guessed
    # path (tokens still being verified); a feature draft gets rows for the committed ones only (the first
    # rows(features) new tokens) and stands in its own hidden states for the guessed path's. Inside a proposer the
    # input _draft gets keeps the flag: its tokens then end with the guessed path and the appended token.
    append_guess: bool = False
    # The request's sampling (temperature/top-k/top-p; sampled requests only): a proposer doing p/q rejection
    # sampling (--speculative-use-rejection-sampling) samples its chain from it and returns the distributions.
    sampling: SamplingParams | None = None


@dataclass
class ProposeOutput:
    """One sequence's answer to a Propose: a tree rooted at the last committed token (empty: no proposal)."""

    seq_id: str
    status: SeqStatus = SeqStatus.OK
    tree: DraftTree = field(default_factory=lambda: DraftTree([], []))
    base_committed_len: int = 0  # the committed length the tree was drafted from
    error: str = ""
    guessed_token_ids: list[int] = field(default_factory=list)  # append_guess: the token appended (tree root)
