"""NGRAM proposer: a global token trie over every sequence's committed tokens, drafting trees without a model.

Semantics follow SGLang's ngram corpus (sglang_spec.md §6): bounded node pool with LRU eviction of leaves, per-node
frequency and recency, suffix anchors matched longest first, BFS (recency) or PROB (frequency) tree construction.
Pure Python and torch-free. Knows only committed token ids; it never decides what is committed, and it never pads a
tree (a short tree is returned instead, so verify can never accept padding).
"""
from __future__ import annotations

import heapq
import operator
from collections import deque
from itertools import compress
from dataclasses import dataclass

from core.types import ROOT, DraftTree
from draft_service.ngram_corpus import ExternalCorpus

MATCH_TYPES = ("BFS", "PROB")


@dataclass(frozen=True)
class NgramConfig:
    """SGLang's --speculative-ngram-* flags plus --speculative-num-draft-tokens (the tree has ndt - 1 draft nodes)."""

    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"
    max_trie_depth: int = 18
    capacity: int = 10_000_000
    num_draft_tokens: int = 12
    # External corpora (draft_service/ngram_corpus.py): the tree nodes they draft, split evenly between them, the
    # trie drafting the rest first (nodes it leaves unused go to the corpora too); and the tokens all may hold.
    external_sam_budget: int = 0
    external_corpus_max_tokens: int = 10_000_000

    def __post_init__(self) -> None:
        if self.min_bfs_breadth < 1:
            raise ValueError(f"min_bfs_breadth must be >= 1, got {self.min_bfs_breadth}")
        if self.max_bfs_breadth < self.min_bfs_breadth:
            raise ValueError(f"max_bfs_breadth ({self.max_bfs_breadth}) must be >= min_bfs_breadth "
                             f"({self.min_bfs_breadth})")
        if self.match_type not in MATCH_TYPES:
            raise ValueError(f"match_type must be one of {MATCH_TYPES}, got {self.match_type!r}")
        if self.max_trie_depth < 2:
            raise ValueError(f"max_trie_depth must be >= 2 (an anchor token plus a continuation), "
                             f"got {self.max_trie_depth}")
        if self.capacity < self.max_trie_depth:
            raise ValueError(f"capacity ({self.capacity}) must hold at least one path of max_trie_depth "
                             f"({self.max_trie_depth}) nodes")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.external_sam_budget < 0:
            raise ValueError(f"external_sam_budget must be >= 0, got {self.external_sam_budget}")
        if self.external_corpus_max_tokens < 1:
            raise ValueError(f"external_corpus_max_tokens must be positive, got {self.external_corpus_max_tokens}")


class _Node:
    __slots__ = ("token", "parent", "children", "freq", "last_used")

    def __init__(self, token: int, parent: _Node | None) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.freq = 0
        self.last_used = 0


_LAST_USED = operator.attrgetter("last_used")
_FREQ_LAST_USED = operator.attrgetter("freq", "last_used")


class NgramProposer:
    """One trie shared by all sequences; per sequence only the committed tokens last synced are kept."""

    # The recency log is compacted past 3 entries per node plus this many (bench: a 728-token sequence growing 3
    # tokens a step, sync 0.081 -> 0.056 ms on a 2-core CPU against a move-to-end OrderedDict).
    _log_slack = 16384

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self._root = _Node(-1, None)
        # Recency: every touch gives a node the next clock value (last_used), a path deepest-first, so a node is
        # always at least as recent as all its descendants and the least recently used node is always a leaf. The
        # touches are logged in clock order (two parallel deques, appended at C speed); an entry whose node was
        # touched again since (or evicted: last_used -1) is stale and skipped by eviction, and the log is compacted
        # once stale entries outnumber live nodes. Same order as a move-to-end LRU list, at a fraction of the cost
        # per touch (an NGRAM step touches every n-gram ending in its new tokens: O(max_trie_depth^2) nodes).
        self._log_nodes: deque[_Node] = deque()
        self._log_clocks: deque[int] = deque()
        self._num_nodes = 0
        self._clock = 0
        self._seqs: dict[str, list[int]] = {}
        self.corpora: dict[str, ExternalCorpus] = {}  # by corpus id

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    # -- external corpora ---------------------------------------------------------------------------------------

    def add_corpus(self, corpus_id: str, documents: list[list[int]]) -> int:
        """Index documents (token ids) as corpus `corpus_id` (replacing one of that id); returns its tokens. All
        corpora together hold at most external_corpus_max_tokens (ValueError, nothing changed, beyond that)."""
        if not corpus_id:
            raise ValueError("a corpus needs a non-empty id")
        corpus = ExternalCorpus(documents)
        if not len(corpus):
            raise ValueError(f"corpus {corpus_id!r} has no tokens")
        others = sum(len(c) for key, c in self.corpora.items() if key != corpus_id)
        if others + len(corpus) > self.config.external_corpus_max_tokens:
            raise ValueError(f"corpus {corpus_id!r} ({len(corpus)} tokens) does not fit: the corpora hold {others} "
                             f"of at most {self.config.external_corpus_max_tokens} tokens "
                             "(--speculative-ngram-external-corpus-max-tokens)")
        self.corpora[corpus_id] = corpus
        return len(corpus)

    def remove_corpus(self, corpus_id: str) -> None:
        if self.corpora.pop(corpus_id, None) is None:
            raise KeyError(f"no external corpus {corpus_id!r}")

    def corpus_token_counts(self) -> dict[str, int]:
        return {key: len(c) for key, c in sorted(self.corpora.items())}

    def sync(self, seq_id: str, token_ids: list[int]) -> None:
        """Record the full committed token list (prompt + output); insert the n-grams that end in new tokens.

        A list that is shorter or diverges (rollback) is accepted: the trie keeps what it learned (it was committed
        once, which makes it fair statistics), and counting restarts from the common prefix."""
        old = self._seqs.get(seq_id, [])
        common = _common_prefix_len(old, token_ids)
        self._seqs[seq_id] = list(token_ids)
        depth = self.config.max_trie_depth
        # An n-gram (start, length) ending at or after `common` is new; every suffix start that can reach the new
        # tail inserts one path, counting only the nodes whose end position is new.
        for start in range(max(0, common - depth + 1), len(token_ids)):
            path = token_ids[start:start + depth]
            self._insert(path, first_new_depth=max(1, common - start + 1))

    def propose(self, seq_ids: list[str]) -> list[DraftTree]:
        """One tree per sequence, rooted at its last committed token; empty when nothing matches."""
        return [self._propose_one(self._seqs.get(seq_id, [])) for seq_id in seq_ids]

    def release(self, seq_id: str) -> None:
        """Forget the sequence; its n-grams stay in the shared trie until evicted."""
        self._seqs.pop(seq_id, None)

    # -- trie ---------------------------------------------------------------------------------------------------

    def _insert(self, path: list[int], first_new_depth: int) -> None:
        """Walk/create the path; nodes at depth >= first_new_depth (1-based) gain one occurrence."""
        m = len(path)
        if self._num_nodes + m > self.config.capacity:  # the walk may create that many nodes
            while self._num_nodes + m - self._matched_len(path) > self.config.capacity:
                self._evict_oldest_leaf()  # may evict the end of this very path, so re-measure after each eviction
        # One pass: deepest first keeps ancestors more recent than descendants, so depth d (1-based) of m gets clock
        # + m - d + 1, and the log takes the path deepest first (clock order).
        node, touched, created = self._root, [], 0
        stamp = self._clock + m
        for depth, token in enumerate(path, start=1):
            children = node.children
            child = children.get(token)
            if child is None:
                child = children[token] = _Node(token, node)
                created += 1
                child.freq = 1
            elif depth >= first_new_depth:
                child.freq += 1
            child.last_used = stamp
            stamp -= 1
            touched.append(child)
            node = child
        self._num_nodes += created
        clock = self._clock
        self._clock = clock + m
        touched.reverse()
        self._log_nodes.extend(touched)
        self._log_clocks.extend(range(clock + 1, clock + m + 1))
        if len(self._log_nodes) > 3 * self._num_nodes + self._log_slack:
            self._compact_log()

    def _compact_log(self) -> None:
        live = list(map(operator.eq, map(_LAST_USED, self._log_nodes), self._log_clocks))  # all at C speed
        self._log_clocks = deque(compress(self._log_clocks, live))
        self._log_nodes = deque(compress(self._log_nodes, live))

    def _matched_len(self, path: list[int]) -> int:
        node = self._root
        for i, token in enumerate(path):
            node = node.children.get(token)
            if node is None:
                return i
        return len(path)

    def _evict_oldest_leaf(self) -> None:
        while True:
            node, clock = self._log_nodes.popleft(), self._log_clocks.popleft()
            if node.last_used == clock:
                break
        assert not node.children, "LRU invariant broken: the oldest trie node has children"
        del node.parent.children[node.token]
        node.last_used = -1  # its older log entries were stale already
        self._num_nodes -= 1

    def _anchors(self, tokens: list[int]) -> list[tuple[_Node, int]]:
        """Trie nodes reached by the last d tokens, d = 1..max_trie_depth-1, longest match first, with children."""
        anchors = []
        for d in range(1, min(len(tokens), self.config.max_trie_depth - 1) + 1):
            node = self._root
            for token in tokens[-d:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:  # no early exit: eviction can drop a short path but keep a long one
                anchors.append((node, d))
        return anchors[::-1]

    # -- tree construction --------------------------------------------------------------------------------------

    def _propose_one(self, tokens: list[int]) -> DraftTree:
        budget = self.config.num_draft_tokens - 1
        corpora = [self.corpora[key] for key in sorted(self.corpora)]
        per_corpus = min(self.config.external_sam_budget, budget) // len(corpora) if corpora else 0
        tree = _TreeAccumulator(budget - per_corpus * len(corpora))
        if not tokens or budget == 0:
            return tree.to_draft_tree()
        build = self._build_bfs if self.config.match_type == "BFS" else self._build_prob
        for anchor, depth in self._anchors(tokens):
            if tree.full:
                break
            build(tree, anchor, depth)
        if per_corpus:
            for corpus in corpora:  # each adds up to its share (and what the trie left unused) after the trie's
                tree.budget += per_corpus
                for anchor, depth in corpus.anchors(tokens, self.config.max_trie_depth, _Node):
                    if tree.full:
                        break
                    build(tree, anchor, depth)
        return tree.to_draft_tree()

    def _build_bfs(self, tree: _TreeAccumulator, anchor: _Node, match_len: int) -> None:
        """Recency BFS. Longer matches are more specific, so they branch less: breadth falls from max_bfs_breadth
        (1-token match) to min_bfs_breadth (longest match), then shrinks by the same step per level."""
        cfg = self.config
        scale = (cfg.max_bfs_breadth - cfg.min_bfs_breadth) / (cfg.max_trie_depth - 1)
        breadth = (cfg.max_trie_depth - match_len) * scale + cfg.min_bfs_breadth
        level = [(anchor, ROOT)]
        while level and not tree.full:
            width = max(1, int(breadth))
            next_level = []
            for trie_node, tree_node in level:
                recent = heapq.nlargest(width, trie_node.children.values(), key=_LAST_USED)
                for child in recent:
                    idx = tree.add(tree_node, child.token)
                    if idx is None:
                        return
                    next_level.append((child, idx))
            level = next_level
            breadth -= scale

    def _build_prob(self, tree: _TreeAccumulator, anchor: _Node, match_len: int) -> None:
        """Frequency best-first: a node's priority is the product of freq / sum(sibling freq) along its path, over
        each node's max_bfs_breadth most frequent children."""
        counter = 0
        heap: list[tuple[float, int, _Node, int]] = []  # (-prob, tie-break, trie node, tree parent)

        def push_children(trie_node: _Node, prob: float, tree_parent: int) -> None:
            nonlocal counter
            total = sum(c.freq for c in trie_node.children.values())
            top = heapq.nlargest(self.config.max_bfs_breadth, trie_node.children.values(),
                                 key=_FREQ_LAST_USED)
            for child in top:
                counter += 1
                heapq.heappush(heap, (-prob * child.freq / total, counter, child, tree_parent))

        push_children(anchor, 1.0, ROOT)
        while heap and not tree.full:
            neg_prob, _, trie_node, tree_parent = heapq.heappop(heap)
            idx = tree.add(tree_parent, trie_node.token)
            if idx is None:
                return
            if trie_node.children:
                push_children(trie_node, -neg_prob, idx)


class _TreeAccumulator:
    """Draft nodes deduplicated by (parent, token): merging anchors can never create duplicate siblings."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.token_ids: list[int] = []
        self.parents: list[int] = []
        self._index: dict[tuple[int, int], int] = {}

    @property
    def full(self) -> bool:
        return len(self.token_ids) >= self.budget

    def add(self, parent: int, token: int) -> int | None:
        """Index of the (parent, token) node, creating it if the budget allows; None when it cannot be added."""
        idx = self._index.get((parent, token))
        if idx is not None:
            return idx
        if self.full:
            return None
        idx = self._index[(parent, token)] = len(self.token_ids)
        self.token_ids.append(token)
        self.parents.append(parent)
        return idx

    def to_draft_tree(self) -> DraftTree:
        return DraftTree(self.token_ids, self.parents)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (append-only) at C speed
        return n
    lo, hi = 0, n  # largest prefix length that matches
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
