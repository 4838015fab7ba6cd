"""Types that cross the services' wire, defined once for the gateway, the model services and the runtime: the status
of a sequence in a step, why a sequence finished, when it stops (StopRule) and how it samples (SamplingParams).
Plain enums and dataclasses (no torch, no protobuf): only the convert modules and the gateway's clients translate
them to and from tandem.v1 messages.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

MAX_SEED = 2**63 - 1  # the pods' per-sequence generators take seeds in [0, 2**63)


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
