"""NGRAM proposer adapter: feeds committed tokens into the shared n-gram trie and asks it for trees.

The trie (draft_service/ngram.py) is global across sequences, as in SGLang; tree size comes from the trie config's
`num_draft_tokens` (per-request shapes are ignored because the trie decides breadth and depth itself).
"""
from __future__ import annotations

import logging

from core.steps import ProposeInput
from core.types import DraftTree
from draft_service.ngram import NgramConfig, NgramProposer
from core.corpus import read_corpus_documents
from draft_service.proposer import Proposer

logger = logging.getLogger(__name__)


class NgramDraft(Proposer):
    algorithm = "NGRAM"

    def __init__(self, config: NgramConfig):
        super().__init__()
        self.trie = NgramProposer(config)

    @staticmethod
    def encoder(tokenizer_path: str):
        """text -> token ids with the target's tokenizer, no special tokens (how corpus documents are read)."""
        import transformers  # only when a corpus is given as text

        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        return lambda text: tokenizer.encode(text, add_special_tokens=False)

    def _on_prefill(self, seq_id: str) -> None:
        self.trie.sync(seq_id, self._tokens[seq_id])

    def _on_release(self, seq_id: str) -> None:
        self.trie.release(seq_id)

    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        seq_ids = [inp.seq_id for inp in inputs]
        for seq_id in seq_ids:
            self.trie.sync(seq_id, self._tokens[seq_id])
        return [pad_tree(tree, self.trie.config.num_draft_tokens) for tree in self.trie.propose(seq_ids)]


def pad_tree(tree: DraftTree, num_draft_tokens: int) -> DraftTree:
    """A non-empty tree filled up to num_draft_tokens - 1 nodes with token 0 attached to the root (SGLang's
    fillResult), so the target verifies every NGRAM step at one width, the one its CUDA graphs are captured for (a
    smaller tree ran eagerly: 0.33-0.55x plain decoding on the H200, bench/results/gpu_step_h200/NOTES.md). Padding
    stays lossless: a pad is accepted only where the target's own choice is token 0 and no real sibling before it
    matched, and the tree sampler skips repeated sibling tokens. Empty trees stay empty (a plain decode step)."""
    missing = num_draft_tokens - 1 - len(tree)
    if not tree.token_ids or missing <= 0:
        return tree
    return DraftTree(tree.token_ids + [0] * missing, tree.parents + [-1] * missing)


def build(build) -> tuple[NgramDraft, str]:
    """Registry factory (core/algorithms.py): the trie from the --speculative-ngram-* flags (no model to load).
    build: tandem.services.DraftBuild."""
    args = build.args
    draft = NgramDraft(NgramConfig(
        min_bfs_breadth=args.speculative_ngram_min_bfs_breadth, max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
        match_type=args.speculative_ngram_match_type, max_trie_depth=args.speculative_ngram_max_trie_depth,
        capacity=args.speculative_ngram_capacity, num_draft_tokens=args.speculative_num_draft_tokens,
        external_sam_budget=args.speculative_ngram_external_sam_budget,
        external_corpus_max_tokens=args.speculative_ngram_external_corpus_max_tokens))
    path = args.speculative_ngram_external_corpus_path
    if path:  # SGLang names the start-up corpus by its path
        try:
            documents = read_corpus_documents(path, draft.encoder(build.target_path),
                                              args.speculative_ngram_external_corpus_max_tokens)
            tokens = draft.trie.add_corpus(str(path), documents)
        except ValueError as exc:
            raise SystemExit(f"error: --speculative-ngram-external-corpus-path: {exc}") from None
        logger.info("external ngram corpus %s: %d documents, %d tokens", path, len(documents), tokens)
    return draft, "ngram"
