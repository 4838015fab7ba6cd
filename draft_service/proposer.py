"""Proposer interface of the draft service and the per-sequence bookkeeping every proposer shares.

A proposer keeps, per sequence, the committed tokens it has been told. Each Propose names the committed length and
the newly committed tail; the proposer rolls back to where the tail starts (dropping its own speculative state) and
answers STALE when it knows too little to do so. It never decides what is committed.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field

from runtime.speculative.tree import DraftTree


class Status(enum.IntEnum):  # values equal tandem.v1.SeqStatus
    OK = 0
    STALE = 1
    OUT_OF_MEMORY = 2
    INVALID = 3


@dataclass(frozen=True)
class SpecShape:
    num_steps: int
    topk: int
    num_draft_tokens: int


@dataclass
class ProposeInput:
    seq_id: str
    committed_len: int
    new_token_ids: list[int]
    spec: SpecShape


@dataclass
class ProposeOutput:
    seq_id: str
    status: Status = Status.OK
    tree: DraftTree = field(default_factory=lambda: DraftTree([], []))
    base_committed_len: int = 0
    error: str = ""


class Proposer(abc.ABC):
    """Base class: tracks committed tokens per sequence; subclasses draft."""

    algorithm: str = ""

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}

    def prefill(self, seq_id: str, token_ids: list[int]) -> Status:
        self.release([seq_id])
        self._tokens[seq_id] = list(token_ids)
        self._on_prefill(seq_id)
        return Status.OK

    def propose(self, inputs: list[ProposeInput]) -> list[ProposeOutput]:
        outputs: list[ProposeOutput] = []
        ready: list[ProposeInput] = []
        for inp in inputs:
            out = ProposeOutput(inp.seq_id, base_committed_len=inp.committed_len)
            outputs.append(out)
            tokens = self._tokens.get(inp.seq_id)
            start = inp.committed_len - len(inp.new_token_ids)
            if tokens is None or start < 0 or start > len(tokens):
                out.status, out.error = Status.STALE, "unknown sequence or committed tokens missing"
                continue
            del tokens[start:]
            tokens.extend(inp.new_token_ids)
            self._on_rollback(inp.seq_id, start)
            ready.append(inp)
        trees = self._draft(ready) if ready else []
        by_id = {o.seq_id: o for o in outputs}
        for inp, tree in zip(ready, trees):
            by_id[inp.seq_id].tree = tree
        return outputs

    def release(self, seq_ids: list[str]) -> int:
        released = 0
        for seq_id in seq_ids:
            if self._tokens.pop(seq_id, None) is not None:
                released += 1
            self._on_release(seq_id)
        return released

    @property
    def num_seqs(self) -> int:
        return len(self._tokens)

    def memory(self) -> tuple[int, int]:
        """(free, total) KV tokens; proposers without KV report zeros."""
        return 0, 0

    # Hooks for subclasses.
    def _on_prefill(self, seq_id: str) -> None:
        pass

    def _on_rollback(self, seq_id: str, kept_len: int) -> None:
        """Committed tokens past `kept_len` were replaced; drop state derived from them."""

    def _on_release(self, seq_id: str) -> None:
        pass

    @abc.abstractmethod
    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        """One tree per input, rooted at the last committed token (`self._tokens[seq_id][-1]`)."""
