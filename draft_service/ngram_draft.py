"""NGRAM proposer adapter: feeds committed tokens into the shared n-gram trie and asks it for trees.

The trie (draft_service/ngram.py) is global across sequences, as in SGLang; tree size comes from the trie config's
`num_draft_tokens` (per-request shapes are ignored because the trie decides breadth and depth itself).
"""
from __future__ import annotations

from draft_service.ngram import NgramConfig, NgramProposer
from draft_service.proposer import Proposer, ProposeInput
from runtime.speculative.tree import DraftTree


class NgramDraft(Proposer):
    algorithm = "NGRAM"

    def __init__(self, config: NgramConfig):
        super().__init__()
        self.trie = NgramProposer(config)

    def _on_prefill(self, seq_id: str) -> None:
        self.trie.sync(seq_id, self._tokens[seq_id])

    def _on_release(self, seq_id: str) -> None:
        self.trie.release(seq_id)

    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        seq_ids = [inp.seq_id for inp in inputs]
        for seq_id in seq_ids:
            self.trie.sync(seq_id, self._tokens[seq_id])
        return self.trie.propose(seq_ids)
