"""External NGRAM corpora (SGLang's --speculative-ngram-external-corpus-*): documents a deployment knows its outputs
will quote (an API's docs, a code base, a style guide), indexed once, drafted from beside the shared trie.

SGLang indexes each corpus in a suffix automaton; here it is a suffix array over the corpus tokens (numpy prefix
doubling: O(n log n) per round, a handful of rounds on text), which answers the same question -- where does the
longest suffix of the context occur, and what followed it there -- in O(d log n) per anchor. Documents are joined with
a separator that is never a token, so no match and no continuation crosses a document boundary. For each anchor
(longest match first, as the trie's) the continuations of up to MAX_OCCURRENCES occurrences, spread over all of them,
are counted into a small trie of the same node type as the shared one, so the NGRAM tree builders (BFS and PROB) draft
from it unchanged; a static corpus has no recency, so a node's frequency stands in for it.
"""
from __future__ import annotations

import numpy as np

SEPARATOR = -1  # between documents: below every token id (a shorter, never-matching suffix)
MAX_OCCURRENCES = 64  # occurrences of an anchor whose continuations are counted


class ExternalCorpus:
    """A suffix array over documents of token ids."""

    def __init__(self, documents: list[list[int]]) -> None:
        joined: list[int] = []
        for doc in documents:
            if doc:
                if joined:
                    joined.append(SEPARATOR)
                joined.extend(doc)
        self.tokens = np.asarray(joined, dtype=np.int64)
        self.num_tokens = sum(len(d) for d in documents)  # separators not counted
        self.sa = _suffix_array(self.tokens)

    def __len__(self) -> int:
        return self.num_tokens

    def occurrences(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi) of the suffix array: the suffixes that start with `pattern`."""
        m, toks, sa = len(pattern), self.tokens, self.sa

        def prefix(i: int) -> list[int]:
            s = int(sa[i])
            return toks[s:s + m].tolist()

        lo, hi = 0, len(sa)
        while lo < hi:  # first suffix whose m-prefix is >= pattern
            mid = (lo + hi) // 2
            if prefix(mid) < pattern:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, len(sa)
        while lo < hi:  # first suffix whose m-prefix is > pattern
            mid = (lo + hi) // 2
            if prefix(mid) <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def anchors(self, tokens: list[int], max_depth: int, node_type):
        """(a trie root of the continuations, match length) per suffix of `tokens` that occurs here followed by at
        least one token, longest first, d = 1 .. max_depth - 1; built lazily (a full tree stops the caller early).
        node_type: the shared trie's node class (token, parent; children, freq, last_used)."""
        longest = self._longest_match(tokens, max_depth - 1)
        for d in range(longest, 0, -1):
            lo, hi = self.occurrences(tokens[-d:])
            root = self._continuations(lo, hi, d, max_depth - d, node_type)
            if root.children:
                yield root, d

    def _longest_match(self, tokens: list[int], max_len: int) -> int:
        """The longest d <= max_len with tokens[-d:] in the corpus (occurrence is monotone in d: binary search)."""
        lo, hi = 0, min(max_len, len(tokens))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start, end = self.occurrences(tokens[-mid:])
            if end > start:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _continuations(self, lo: int, hi: int, d: int, depth: int, node_type):
        root = node_type(-1, None)
        if hi <= lo or depth < 1:
            return root
        picks = self.sa[np.unique(np.linspace(lo, hi - 1, num=min(hi - lo, MAX_OCCURRENCES)).astype(np.int64))]
        n = len(self.tokens)
        for start in picks.tolist():
            node = root
            for token in self.tokens[start + d:min(start + d + depth, n)].tolist():
                if token == SEPARATOR:
                    break
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = node_type(token, node)
                child.freq += 1
                child.last_used = child.freq  # no recency in a static corpus: the most frequent is "most recent"
                node = child
        return root


def _suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of all suffixes in lexicographic order (a suffix that ends, or meets a separator, sorts
    before its extensions), by prefix doubling: rank by the first k tokens, then by (rank, rank k ahead)."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64) + 1
    positions = np.arange(n)
    k = 1
    while True:
        ahead = np.zeros(n, dtype=np.int64)
        ahead[:n - k] = rank[k:] if k < n else ahead[:0]
        order = np.lexsort((ahead, rank))
        r, a = rank[order], ahead[order]
        new = np.empty(n, dtype=np.int64)
        new[0] = 1
        new[1:] = (r[1:] != r[:-1]) | (a[1:] != a[:-1])
        new = np.cumsum(new)
        rank = np.empty(n, dtype=np.int64)
        rank[order] = new
        if new[-1] == n or k >= n:
            return positions[order]
        k *= 2
