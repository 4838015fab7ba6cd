"""Types that cross the services' wire, defined once for the gateway, the model services and the runtime: the status
of a sequence in a step, why a sequence finished, when it stops (StopRule), how it samples (SamplingParams) and the
draft tree a step verifies (DraftTree).
Plain enums and dataclasses (no torch, no protobuf): only the convert modules and the gateway's clients translate
them to and from tandem.v1 messages.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_SEED = 2**63 - 1  # the pods' per-sequence generators take seeds in [0, 2**63)
ROOT = -1  # the parent of a draft tree's top nodes: the implicit root, the last committed token


class SeqStatus(enum.IntEnum):
    """Outcome of one sequence in a batched call (values equal tandem.v1.SeqStatus)."""

    OK = 0
    STALE = 1  # the service's state disagrees with committed_len: the gateway re-syncs from its committed list
    OUT_OF_MEMORY = 2
    INVALID = 3  # this sequence's input was refused; the rest of the batch ran


class FinishReason(str, enum.Enum):
    """Why a sequence finished (None while it runs); the values are OpenAI's finish_reason strings."""

    STOP = "stop"  # a stop token (EOS / stop_token_ids) or a stop string
    LENGTH = "length"  # max_new_tokens or the context length reached
    ABORT = "abort"  # cancelled by the client or the server


@dataclass(frozen=True)
class StopRule:
    """When a sequence stops, as the target applies it token by token: after max_new_tokens output tokens, at a stop
    token (EOS and the request's stop_token_ids; ignored with ignore_eos), or at the context length. prompt_len: the
    committed tokens that are prompt, not output. (Stop strings are the gateway's: they need detokenized text.)"""

    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    prompt_len: int = 0


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one sequence, as every package reads them (the gateway's request, the target's verify,
    a rejection-sampling draft). `temperature == 0` (or `top_k == 1`) means greedy; `top_k == -1` disables. The
    checks are the domain every consumer accepts (ValueError); the gateway's fronts bound requests further
    (gateway.types.request_sampling)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    # OpenAI's presence/frequency penalties (over generated tokens) and HF/vLLM's repetition penalty (over prompt and
    # generated tokens): 0, 0 and 1 leave the logits alone.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI logit_bias: (token id, added to its logit) pairs sorted by id, biases in [-100, 100]; a mapping
    # {token id: bias} is accepted and stored as such pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        temp = self.temperature
        if not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0 or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token!r}: {bias!r}")

    @property
    def has_penalties(self) -> bool:
        """Penalties or a logit bias: the raw logits are adjusted before temperature / top-k / top-p."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        # top_k == 1 leaves one token after processing, so it is argmax sampling whatever the temperature.
        return self.temperature == 0 or self.top_k == 1


@dataclass
class DraftTree:
    """Draft nodes in topological order (a chain is a tree whose parents are i-1). parents[i] is the index of node
    i's parent, ROOT (-1) for the root. The root itself (the last committed token, whose KV verify writes) is
    implicit: it is node 0 wherever a root-inclusive view is built (runtime/speculative/)."""

    token_ids: list[int]
    parents: list[int]
    # (num_nodes, V): the distribution each node was sampled from, for p/q rejection sampling; None when the draft
    # did not sample. A torch tensor in the services and the runtime, opaque bytes (FeatureRows) in the gateway.
    draft_probs: Any = None

    @classmethod
    def chain(cls, token_ids: list[int]) -> DraftTree:
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError unless every parent precedes its child and the token ids / draft_probs are consistent."""
        if len(self.parents) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token_ids but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must be -1 (root) or an earlier node")
        for i, token in enumerate(self.token_ids):
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"node {i} has token id {token} outside [0, {vocab_size or 'vocab'})")
        shape = tuple(self.draft_probs.shape) if self.draft_probs is not None else None
        if shape is not None and (len(shape) != 2 or shape[0] != len(self)):
            raise ValueError(f"draft_probs must be (num_nodes={len(self)}, V), got {shape}")

    def depths(self) -> list[int]:
        """Per draft node, the number of draft ancestors: 0 for the root's children (their depth below the root is
        depths()[i] + 1, the position offset after the root)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent == ROOT else depths[parent] + 1)
        return depths

    def children(self) -> dict[int, list[int]]:
        """Child node indices in increasing node order, keyed by parent node index (ROOT for the root); every node
        has an entry, empty for leaves. Node order is the sibling order verification tries."""
        out: dict[int, list[int]] = {ROOT: [], **{i: [] for i in range(len(self))}}
        for i, parent in enumerate(self.parents):
            out[parent].append(i)
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
