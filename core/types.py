"""Types that cross the services' wire, defined once for the gateway, the model services and the runtime: the status
of a sequence in a step and why a sequence finished. Plain enums (no torch, no protobuf): only the convert modules
and the gateway's clients translate them to and from tandem.v1 messages.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


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
