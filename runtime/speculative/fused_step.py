"""Speculative steps chained on the device: k greedy (verify, draft) steps of a target and the draft in its process
with no host round trip between them, one device->host copy for all k.

A step is five replays: the glue that turns the current tree and the sequence state (root token, target and draft KV
ends) into the static verify step's packed inputs; the verify step (runtime/speculative/verify_step.py: forward, tree
walk, KV compaction, feature gather); the glue that turns its outcome (emitted tokens, accept length, the accepted
path's features) into the static draft step's catch-up inputs (SGLang's draft-extend over the newly committed tokens),
records the step's tokens and advances the state; the draft step (runtime/speculative/draft_step.py: catch-up, tree
forwards, re-rank); the glue that takes its tree (or a tree source's) into the state. The glues are small CUDA graphs
per batch bucket on CUDA, the same device code run eagerly on CPU, so a step's host work is five graph launches that
run ahead of the GPU. The caller reserves the KV of the
worst case (every step accepting its deepest path) before and sets the lengths from the outcome after; tokens past
a stop are computed and dropped, as any draft past a stop is.

Only greedy sequences without logprobs or penalties (the verify step's argmax walk), trees of exactly the verify
step's width, a draft without pre-drafted rows (CatchUp.own_features) and a catch-up window that takes a whole path
(num_steps + 1). Owns no sequence state."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from runtime import pinned
from runtime.models.llama import _k, graph_capture_mode, use_step_kernels
from runtime.speculative.draft_step import StaticDraftStep
from runtime.speculative.verify_step import StaticVerifyStep, ancestor_mask

logger = logging.getLogger(__name__)


@dataclass
class ChainSeq:
    """One sequence's start of a chained run: the root (its last committed token), where the verify region starts in
    the target KV (committed length - 1) and the draft catch-up in the draft KV, both block tables (reserved for the
    whole run) and the first tree (target ids, parents as node indices, -1 = root)."""

    root: int
    target_start: int
    draft_start: int
    target_table: list[int]
    draft_table: list[int]
    tree_tokens: list[int]
    tree_parents: list[int]


@dataclass
class ChainResult:
    steps: list[list[int]]  # per step, the emitted tokens (accepted drafts then the bonus)
    tree_tokens: list[int]  # the tree drafted after the last step (target ids)
    tree_parents: list[int]
    last_feature: torch.Tensor | None  # (F,) on the device: the target feature of the last step's last kept row


class FusedSteps:
    """Chains a StaticVerifyStep and a StaticDraftStep of the same tree width and batch buckets."""

    def __init__(self, verify: StaticVerifyStep, draft: StaticDraftStep, max_steps: int = 16,
                 tree_source=None) -> None:
        """tree_source: where the trees of the steps after the first come from instead of the draft step's output
        (which is then computed for its cost and dropped: SYNTHETIC's oracle trees, draft_service/synthetic.py): an
        object with `trees(b, committed_len) -> (tokens (b, M), parents (b, M))`, static-shape device code."""
        shape = draft.shape
        if shape.num_draft_tokens != verify.width:
            raise ValueError(f"draft trees of {shape.num_draft_tokens} tokens, verify step of {verify.width}")
        if shape.catch_up < shape.num_steps + 1 or verify.sizes != draft.sizes:
            raise ValueError("the draft step's catch-up must take a whole path and both steps share their buckets")
        # A feature head over a target that captures no features (SYNTHETIC's head) keeps the features it has.
        self.features = draft.feature_head and verify.feature_dim > 0
        if self.features and verify.feature_dim != draft.runner.model.feature_size:
            raise ValueError(f"verify features of width {verify.feature_dim}, the draft takes "
                             f"{draft.runner.model.feature_size}")
        self.verify, self.draft = verify, draft
        self.tree_source = tree_source
        self.max_steps = max_steps
        self.sizes, self.max_bs = verify.sizes, verify.max_bs
        self.width = verify.width
        self.max_accept = min(self.width, shape.catch_up)  # emitted tokens per step: a path of the tree + bonus
        dev = verify.inputs.device
        m = self.width - 1
        # Per sequence: [root, target start, draft start, live, tree tokens (M), tree parents (M)], one host copy.
        self.state = torch.zeros(self.max_bs, 4 + 2 * m, dtype=torch.int64, device=dev)
        self.step_index = torch.zeros(1, dtype=torch.int64, device=dev)
        # The padding rows of both steps' packed inputs (what their _pad_host writes), for the rows not running.
        self.verify_pad = verify.new_host_rows(self.max_bs)[:, :verify.table_col].clone().to(dev)
        self.draft_pad = draft.new_host_rows(self.max_bs)[:, :draft.table_col].clone().to(dev)
        self.records: dict[int, torch.Tensor] = {}  # bucket -> (max_steps, b, W + 1): emitted tokens, count
        self.last_features: dict[int, torch.Tensor] = {}  # bucket -> (b, F)
        self.graphs: dict[int, tuple] = {}  # bucket -> (to_verify, to_draft, take_tree) graphs
        self.num_runs = 0

    # ---- device code ---------------------------------------------------------------------------------------------
    def _views(self, b: int):
        m = self.width - 1
        s = self.state[:b]
        return s[:, 0], s[:, 1], s[:, 2], s[:, 3].bool(), s[:, 4:4 + m], s[:, 4 + m:4 + 2 * m]

    def to_verify(self, b: int) -> None:
        """The current trees and states -> the verify step's packed inputs (ids, positions, slots, parents, start).
        In a CUDA graph one Triton launch (tandem_kernels/chain_glue.py), elsewhere these torch ops."""
        v, w = self.verify, self.width
        if use_step_kernels(self.state):
            _k("chain_glue").to_verify(self.state, v.inputs, self.verify_pad, b, w, v.table_col, v.block_size)
            return
        root, tstart, _, live, tokens, parents = self._views(b)
        ids = torch.cat([root.unsqueeze(1), tokens.clamp(min=0)], dim=1)  # a missing node verifies token 0: rejected
        region_parents = torch.cat([torch.full_like(root, -1).unsqueeze(1),
                                    torch.where(parents < 0, torch.zeros_like(parents), parents + 1)], dim=1)
        depth = ancestor_mask(region_parents).sum(dim=-1).long() - 1
        region = tstart.unsqueeze(1) + torch.arange(w, device=root.device)
        tables = v.inputs[:b, v.table_col:]
        slots = tables.gather(1, region // v.block_size) * v.block_size + region % v.block_size
        row = torch.cat([ids, tstart.unsqueeze(1) + depth, slots, region_parents, tstart.unsqueeze(1)], dim=1)
        v.inputs[:b, :v.table_col] = torch.where(live.unsqueeze(1), row, self.verify_pad[:b])

    def to_draft(self, b: int, verified: torch.Tensor) -> None:
        """The verify outcome -> the draft step's catch-up inputs (the emitted tokens at the draft's KV end, right-
        aligned in the window, with the accepted rows' features); record the step; advance root and starts."""
        v, d, w = self.verify, self.draft, self.width
        q = d.shape.catch_up
        head = verified[:b * (2 * w + 1) * 8].view(torch.int64).view(b, 2 * w + 1)
        if use_step_kernels(self.state):  # in a CUDA graph: two Triton launches (tandem_kernels/chain_glue.py)
            glue = _k("chain_glue")
            glue.to_draft(head, self.state, self.records[b], self.step_index, d.inputs, self.draft_pad, b, w, q,
                          d.table_col, d.block_size)
            self.step_index.add_(1)
            if self.features:
                feats = verified[b * (2 * w + 1) * 8:].view(v.runner.dtype).view(b, w, -1)
                glue.to_draft_features(head, feats, d.features[:b * q], self.last_features[b], q)
            return
        root, tstart, dstart, live, _, _ = self._views(b)
        emitted, count = head[:, :w], head[:, 2 * w]
        record = torch.cat([emitted, count.unsqueeze(1)], dim=1).unsqueeze(0)
        self.records[b].index_copy_(0, self.step_index, record)
        self.step_index.add_(1)
        index = torch.arange(q, device=root.device).unsqueeze(0) - (q - count).unsqueeze(1)  # (b, q)
        valid = index >= 0
        index = index.clamp(min=0, max=w - 1)
        ids = torch.where(valid, emitted.gather(1, index), torch.zeros_like(index))
        at = dstart.unsqueeze(1) + index
        tables = d.inputs[:b, d.table_col:]
        slots = tables.gather(1, at // d.block_size) * d.block_size + at % d.block_size
        row = torch.cat([ids, torch.where(valid, at, torch.zeros_like(at)),
                         torch.where(valid, slots, -torch.ones_like(at)), dstart.unsqueeze(1),
                         (dstart + count).unsqueeze(1)], dim=1)
        d.inputs[:b, :d.table_col] = torch.where(live.unsqueeze(1), row, self.draft_pad[:b])
        if self.features:
            feats = verified[b * (2 * w + 1) * 8:].view(v.runner.dtype).view(b, w, -1)
            rows = feats.gather(1, index.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
            rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))
            d.features[:b * q].copy_(rows.reshape(b * q, -1))
            last = (count - 1).clamp(min=0).view(b, 1, 1).expand(-1, 1, feats.shape[-1])
            self.last_features[b].copy_(feats.gather(1, last).squeeze(1))
        self.state[:b, 0] = torch.where(live, emitted.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1), root)
        grow = torch.where(live, count, torch.zeros_like(count))
        self.state[:b, 1] = tstart + grow
        self.state[:b, 2] = dstart + grow

    def take_tree(self, b: int, drafted: torch.Tensor) -> None:
        m = self.width - 1
        if self.tree_source is None:
            self.state[:b, 4:4 + 2 * m] = drafted[:b, :2 * m]
            return
        tokens, parents = self.tree_source.trees(b, self.state[:b, 1] + 1)  # at the committed length after the step
        self.state[:b, 4:4 + m] = tokens
        self.state[:b, 4 + m:4 + 2 * m] = parents

    # ---- capture / run -------------------------------------------------------------------------------------------
    def _buffers(self, b: int) -> None:
        if b not in self.records:
            with torch.inference_mode(False):  # normal tensors: updated in and out of inference mode
                self._new_buffers(b)

    def _new_buffers(self, b: int) -> None:
        dev = self.state.device
        self.records[b] = torch.zeros(self.max_steps, b, self.width + 1, dtype=torch.int64, device=dev)
        feature_dim = self.verify.feature_dim if self.features else 1
        self.last_features[b] = torch.zeros(b, feature_dim, dtype=self.verify.runner.dtype, device=dev)

    def capture(self) -> None:
        """The three glues of every bucket as CUDA graphs (after both steps captured theirs); nothing on CPU."""
        for b in self.sizes:
            self._buffers(b)
        if self.state.device.type != "cuda" or not self.verify.graphs or not self.draft.graphs:
            return
        t0 = time.perf_counter()
        with torch.inference_mode(), graph_capture_mode():
            for b in reversed(self.sizes):
                verified, drafted = self.verify.outputs[b], self.draft.outputs[b]
                self.warm_up(b, verified, drafted)
                torch.cuda.synchronize(self.state.device)
                graphs = []
                for code in (lambda: self.to_verify(b), lambda: self.to_draft(b, verified),
                             lambda: self.take_tree(b, drafted)):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):  # a pool of its own (a few KB): replayed in any bucket order
                        code()
                    graphs.append(graph)
                self.graphs[b] = tuple(graphs)
        torch.cuda.synchronize(self.state.device)
        logger.info("fused speculative steps: captured the glue graphs of batch sizes %s in %.1f s", self.sizes,
                    time.perf_counter() - t0)

    def warm_up(self, b: int, verified: torch.Tensor, drafted: torch.Tensor) -> None:
        """The glue code of bucket b twice outside a capture (the state rows are all padding: nothing live), the step
        counter rewound before each pass as a run rewinds it (bucket after bucket, two records each, would walk it
        past max_steps: an out-of-bounds index_copy_ at start-up)."""
        for _ in range(2):
            self.step_index.zero_()
            self.to_verify(b)
            self.to_draft(b, verified)
            self.take_tree(b, drafted)
        self.step_index.zero_()

    def run(self, seqs: list[ChainSeq], num_steps: int, tree_rows=None) -> list[ChainResult]:
        """num_steps chained (verify, draft) steps of these sequences; one host->device copy per step object before,
        one device->host copy after. tree_rows: what the tree source loads for these sequences (its `load`)."""
        num = len(seqs)
        b = self.verify.bucket_for(num)
        self._buffers(b)
        v, d, m = self.verify, self.draft, self.width - 1
        vhost = v.new_host_rows(b, max(len(s.target_table) for s in seqs))
        dhost = d.new_host_rows(b, max(len(s.draft_table) for s in seqs))
        vrows, drows = vhost.numpy(), dhost.numpy()
        state = torch.zeros(b, 4 + 2 * m, dtype=torch.int64)
        srows = state.numpy()
        for i, s in enumerate(seqs):
            v.put_table(vrows[i], s.target_table)
            d.put_table(drows[i], s.draft_table)
            srows[i, :4] = (s.root, s.target_start, s.draft_start, 1)
            srows[i, 4:4 + m] = s.tree_tokens
            srows[i, 4 + m:4 + 2 * m] = s.tree_parents
        with torch.inference_mode():
            if self.tree_source is not None:
                self.tree_source.load(b, tree_rows)
            return self._run(seqs, num_steps, b, vhost, dhost, state)

    def _run(self, seqs, num_steps, b, vhost, dhost, state) -> list[ChainResult]:
        v, d, m, num = self.verify, self.draft, self.width - 1, len(seqs)
        v.load(vhost)
        d.load(dhost)
        pinned.copy_to(self.state[:b], state)  # asynchronous through the pinned arena on CUDA
        self.step_index.zero_()
        if d.feature_head:  # the catch-up rows of a pre-draft are never chained
            d.own_mask.zero_()
            d._own_set = False
        graphs = self.graphs.get(b)
        for _ in range(num_steps):
            if graphs is not None:
                graphs[0].replay()
                verified = v.replay(b)
                graphs[1].replay()
                drafted = d.replay(b)
                graphs[2].replay()
            else:  # CPU: the same device code, eager
                self.to_verify(b)
                verified = v.replay(b)
                self.to_draft(b, verified)
                drafted = d.replay(b)
                self.take_tree(b, drafted)
        self.num_runs += 1
        out = torch.cat([self.records[b][:num_steps, :num].reshape(-1), self.state[:num, 4:4 + 2 * m].reshape(-1)])
        data = v.read_back(out).tolist()  # the one device->host copy of the run
        steps_part = num_steps * num * (self.width + 1)
        rec = [data[i:i + self.width + 1] for i in range(0, steps_part, self.width + 1)]
        trees = data[steps_part:]
        # the last kept rows' features, one copy for the batch (the buffer is overwritten by the next run)
        features = self.last_features[b][:num].clone() if self.features else None
        results = []
        for i in range(num):
            steps = []
            for j in range(num_steps):
                row = rec[j * num + i]
                steps.append(row[:row[self.width]])
            tree = trees[i * 2 * m:(i + 1) * 2 * m]
            count = sum(1 for t in tree[:m] if t >= 0)
            results.append(ChainResult(steps, tree[:count], tree[m:m + count],
                                       features[i] if features is not None else None))
        return results
