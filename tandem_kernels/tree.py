"""Draft-tree bookkeeping of the static speculative steps in one launch each, where the torch path spends a string
of tiny kernels (session 16's profile of a chained EAGLE3 5/4/16 step on the H100: ~480 kernels per step, ~1.7 µs
each, the step GPU-bound by their count).

- `region_mask`: a verify region's ancestor mask and depths from its parent pointers (the torch path: pointer jumping,
  three kernels a round, ceil(log2(W)) rounds).
- `select_tree`: the final re-rank of a beam tree's candidates to the best `budget`, in flat-index order with their
  parents as node indices (runtime/speculative/draft_step.select_tree_device: two sorts, a scatter and ~40 kernels).
- `DeviceBeam`: a beam tree level (BeamTreeBuilder.first_topk / next_topk) with the inputs of the level's forward
  (ancestor mask, KV slots, positions, kv lengths, ids): ~38 kernels a level in the torch path.

One program per sequence; values equal the torch paths' exactly (integer work, comparisons and one fp32 add per
candidate, as BeamTreeBuilder adds its scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import check, next_pow2

@triton.jit
def _next_best(score, idx, valid, last_v, last_i, NONE):
    """Of the valid entries ranked after (last_v, last_i) in the order score desc, index asc (a stable descending
    sort), the first: (its score, its index), or (-inf, NONE) when none is left."""
    later = valid & ((score < last_v) | ((score == last_v) & (idx > last_i)))
    best_v = tl.max(tl.where(later, score, float("-inf")), axis=0)
    best_i = tl.min(tl.where(later & (score == best_v), idx, NONE), axis=0)
    return best_v, best_i


@triton.jit
def _region_mask_kernel(par_ptr, mask_ptr, depth_ptr, W, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    inside = j < W
    base = par_ptr + row * W
    cur = tl.load(base + j, mask=inside, other=-1)
    mask = (j[:, None] == j[None, :]) & inside[:, None]
    depth = tl.zeros((BLOCK,), dtype=tl.int64)
    for _ in range(BLOCK):  # a node has at most W - 1 <= BLOCK ancestors (a constexpr bound: the interpreter's)
        up = inside & (cur >= 0) & (cur < W)
        mask = mask | ((j[None, :] == cur[:, None]) & up[:, None])
        depth += up.to(tl.int64)
        cur = tl.load(base + cur, mask=up, other=-1)
    out = mask_ptr + row * W * W + j[:, None] * W + j[None, :]
    tl.store(out, mask.to(tl.uint8), mask=inside[:, None] & inside[None, :])
    tl.store(depth_ptr + row * W + j, depth, mask=inside)


def region_mask(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, W) int64 region parents (-1 = none; parents precede children) -> ((b, W, W) uint8, row i True at i and its
    ancestors; (b, W) int64 depth, the number of ancestors). verify_step.ancestor_mask's values."""
    check(parents.dtype == torch.int64 and parents.dim() == 2, "parents must be (b, W) int64")
    parents = parents.contiguous()
    b, w = parents.shape
    mask = torch.empty(b, w, w, dtype=torch.uint8, device=parents.device)
    depth = torch.empty(b, w, dtype=torch.int64, device=parents.device)
    if b and w:
        _region_mask_kernel[(b,)](parents, mask, depth, w, BLOCK=next_pow2(max(w, 2)), num_warps=1)
    return mask, depth


@triton.jit
def _select_tree_kernel(
    score_ptr, tok_ptr, par_ptr, node_ptr, out_tok_ptr, out_par_ptr, count_ptr, C,
    BUDGET: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    inside = i < C
    s = tl.load(score_ptr + row * C + i, mask=inside, other=float("-inf")).to(tl.float32)
    s = tl.where(s != s, float("-inf"), s)  # NaN as -inf: no draft mass, left out
    ok = inside & (s > float("-inf"))
    # The BUDGET best (score desc, index asc: a stable descending sort) by BUDGET selection passes.
    last_v = tl.full((), float("inf"), tl.float32)
    last_i = tl.full((), -1, tl.int64)
    for _ in range(BUDGET):
        best_v, best_i = _next_best(s, i, ok, last_v, last_i, C)
        last_v = tl.where(best_i < C, best_v, last_v)  # past the last candidate: keep the bound
        last_i = tl.where(best_i < C, best_i.to(tl.int64), last_i)
    chosen = ok & ((s > last_v) | ((s == last_v) & (i <= last_i)))
    node = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # the node index of each chosen candidate (flat order)
    count = tl.sum(chosen.to(tl.int32), axis=0)
    tl.store(node_ptr + row * BLOCK + i, tl.where(chosen, node, -1))
    tl.debug_barrier()
    parent = tl.load(par_ptr + row * C + i, mask=inside, other=-1)
    parent_node = tl.load(node_ptr + row * BLOCK + parent, mask=chosen & (parent >= 0) & (parent < C), other=-1)
    tok = tl.load(tok_ptr + row * C + i, mask=inside, other=-1)
    tl.store(out_tok_ptr + row * BUDGET + node, tok, mask=chosen)
    tl.store(out_par_ptr + row * BUDGET + node, parent_node, mask=chosen)
    empty = (i >= count) & (i < BUDGET)  # the slots past count
    tl.store(out_tok_ptr + row * BUDGET + i, tl.full((BLOCK,), -1, tl.int64), mask=empty)
    tl.store(out_par_ptr + row * BUDGET + i, tl.full((BLOCK,), -1, tl.int64), mask=empty)
    tl.store(count_ptr + row, count.to(tl.int64))


def select_tree(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, budget: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """draft_step.select_tree_device in one launch: scores (b, C) float, tokens and parents (b, C) int64 (parents as
    flat candidate indices, -1 = root) -> (tokens (b, n), parents as node indices (b, n), count (b,)), n =
    min(budget, C). Ranking as torch.sort(scores, stable, descending) (ties to the lower flat index); NaN and -inf
    candidates are left out; slots past count are -1."""
    check(scores.dim() == 2 and tokens.shape == scores.shape == parents.shape, "scores, tokens, parents: (b, C)")
    check(tokens.dtype == torch.int64 and parents.dtype == torch.int64, "tokens and parents must be int64")
    check(budget >= 1, f"budget must be >= 1, got {budget}")
    b, num = scores.shape
    n = min(budget, num)
    dev = scores.device
    out_tokens = torch.empty(b, n, dtype=torch.int64, device=dev)
    out_parents = torch.empty(b, n, dtype=torch.int64, device=dev)
    count = torch.empty(b, dtype=torch.int64, device=dev)
    if b and num:
        block = next_pow2(max(num, 2))
        node_of = torch.empty(b, block, dtype=torch.int32, device=dev)  # scratch: candidate -> node index
        _select_tree_kernel[(b,)](scores.contiguous(), tokens.contiguous(), parents.contiguous(), node_of,
                                  out_tokens, out_parents, count, num, BUDGET=n, BLOCK=block,
                                  num_warps=4 if block > 256 else 1)
    return out_tokens, out_parents, count


@triton.jit
def _beam_level_kernel(
    child_score_ptr, child_tok_ptr, cand_score_ptr, cand_tok_ptr, cand_par_ptr, beam_ptr, anc_ptr, tok_ptr,
    rank_ptr, in_ptr, map_ptr, ids_ptr, slot_ptr, pos_ptr, kv_len_ptr,
    C, OFFSET, LEVEL, stride_in, live_col, kv_col, table_col, max_blocks, block_size,
    K: tl.constexpr, KB: tl.constexpr, KK: tl.constexpr, WIDTH: tl.constexpr, WB: tl.constexpr,
    FIRST: tl.constexpr, FORWARD: tl.constexpr, HAS_MAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, KB).to(tl.int64)
    in_k = r < K
    cand = row * C + OFFSET
    if FIRST:  # the root's k best children are the first beam, in their order
        best_score = tl.load(child_score_ptr + row * K + r, mask=in_k, other=0.0)
        best_tok = tl.load(child_tok_ptr + row * K + r, mask=in_k, other=0)
        tl.store(cand_score_ptr + cand + r, best_score, mask=in_k)
        tl.store(cand_tok_ptr + cand + r, best_tok, mask=in_k)
        tl.store(cand_par_ptr + cand + r, tl.full((KB,), -1, tl.int64), mask=in_k)
        new_beam = r
        rank = tl.zeros((KB,), dtype=tl.int64)
    else:  # every beam node's k children, parent-major, then the k best of them (score desc, flat index asc)
        idx = tl.arange(0, KK).to(tl.int64)
        inside = idx < K * K
        p = idx // K
        parent_flat = tl.load(beam_ptr + row * K + p, mask=inside, other=0)
        score = tl.load(cand_score_ptr + row * C + parent_flat, mask=inside, other=0.0) \
            + tl.load(child_score_ptr + (row * K + p) * K + idx % K, mask=inside, other=0.0)
        tl.store(cand_score_ptr + cand + idx, score, mask=inside)
        tl.store(cand_tok_ptr + cand + idx, tl.load(child_tok_ptr + row * K * K + idx, mask=inside), mask=inside)
        tl.store(cand_par_ptr + cand + idx, parent_flat, mask=inside)
        best = tl.zeros((KB,), dtype=tl.int64)
        last_v = tl.full((), float("inf"), tl.float32)
        last_i = tl.full((), -1, tl.int64)
        for t in range(K):
            best_v, best_i = _next_best(score, idx, inside, last_v, last_i, KK)
            best = tl.where(r == t, best_i, best)
            last_v = best_v
            last_i = best_i
        best_tok = tl.load(child_tok_ptr + row * K * K + best, mask=in_k, other=0)
        new_beam = OFFSET + best
        rank = best // K
    tl.debug_barrier()  # every read of the old beam is done
    tl.store(beam_ptr + row * K + r, new_beam, mask=in_k)
    tl.store(tok_ptr + row * K + r, best_tok, mask=in_k)
    tl.store(rank_ptr + row * K + r, rank, mask=in_k)
    if FORWARD:  # the inputs of this level's forward: ancestors, node KV slots, positions, kv lengths, ids
        w = tl.arange(0, WB).to(tl.int64)
        cell = in_k[:, None] & (w[None, :] < WIDTH)
        anc = anc_ptr + row * K * WIDTH
        if FIRST:
            seen = tl.zeros((KB, WB), dtype=tl.uint8)
        else:
            seen = tl.load(anc + rank[:, None] * WIDTH + w[None, :], mask=cell, other=0)
        tl.debug_barrier()
        seen = seen | (w[None, :] == LEVEL * K + r[:, None]).to(tl.uint8)
        tl.store(anc + r[:, None] * WIDTH + w[None, :], seen, mask=cell)
        x = in_ptr + row * stride_in
        kv_after = tl.load(x + kv_col)
        live = tl.load(x + live_col) >= 0  # a padding row writes no tree KV (its table is someone's)
        region = kv_after + LEVEL * K + r
        blk_col = region // block_size
        blk = tl.load(x + table_col + blk_col, mask=in_k & (blk_col >= 0) & (blk_col < max_blocks), other=0)
        tl.store(slot_ptr + row * K + r, tl.where(live, blk * block_size + region % block_size, -1), mask=in_k)
        tl.store(pos_ptr + row * K + r, kv_after + LEVEL + tl.zeros((KB,), dtype=tl.int64), mask=in_k)
        tl.store(kv_len_ptr + row, (kv_after + (LEVEL + 1) * K).to(tl.int32))
        if HAS_MAP:
            ids = tl.load(map_ptr + best_tok, mask=in_k, other=0)
        else:
            ids = best_tok
        tl.store(ids_ptr + row * K + r, ids, mask=in_k)


class DeviceBeam:
    """BeamTreeBuilder's first_topk / next_topk / candidates for a static draft step in one launch per tree level,
    together with the level's forward inputs (the per-level torch ops: ~38 kernels on the H100, session 16's profile).

    The candidates live in (b, C) buffers written level by level (C = k + (steps - 1) k^2, flat order); each level
    returns the draft ids to forward (mapped to the target vocabulary's ids where the draft has a map), the beam
    nodes' ranks of their parents in the previous beam, their KV slots, positions, the kv lengths and the (b, k, steps
    k) ancestor mask among the tree nodes. Ordering equals BeamTreeBuilder's: children parent-major, the k best by a
    stable descending sort of cumulative scores; the first level is the root's k best children in the given order.
    `inputs` is the static draft step's packed rows (kv_after at `kv_col`, the last catch-up slot at `live_col`, the
    block table from `table_col`)."""

    def __init__(self, b: int, steps: int, k: int, inputs: torch.Tensor, live_col: int, kv_col: int,
                 table_col: int, block_size: int, draft_to_target: torch.Tensor | None = None) -> None:
        check(inputs.dtype == torch.int64 and inputs.stride(1) == 1, "inputs: int64 rows")
        check(k <= 64, f"topk {k} > 64")
        check(draft_to_target is None or draft_to_target.dtype == torch.int64, "draft_to_target must be int64")
        self.b, self.steps, self.k = b, steps, k
        self.inputs, self.live_col, self.kv_col, self.table_col, self.block_size = (
            inputs, live_col, kv_col, table_col, block_size)
        self.map = draft_to_target
        dev = inputs.device
        self.num_candidates = k + (steps - 1) * k * k
        self.scores = torch.empty(b, self.num_candidates, dtype=torch.float32, device=dev)
        self.tokens = torch.empty(b, self.num_candidates, dtype=torch.int64, device=dev)
        self.parents = torch.empty(b, self.num_candidates, dtype=torch.int64, device=dev)
        self.beam = torch.empty(b, k, dtype=torch.int64, device=dev)
        self.ancestors = torch.empty(b, k, steps * k, dtype=torch.uint8, device=dev)
        self.kv_lens = torch.empty(b, dtype=torch.int32, device=dev)
        self.level = 0

    def expand(self, scores: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The next level from the k best (log-prob, token) children of each beam node ((b, k) for the root, (b k,
        k) after) -> (ids (b, k), ranks (b, k), slots (b, k), positions (b, k)): the forward inputs of the new
        beam, valid while a forward follows (level < steps - 1); self.kv_lens and self.ancestors with them."""
        b, k, level = self.b, self.k, self.level
        check(level < self.steps, f"all {self.steps} levels are expanded")
        first = level == 0
        rows = b if first else b * k
        check(scores.shape == (rows, k) == tokens.shape and scores.dtype == torch.float32
              and tokens.dtype == torch.int64, f"children: ({rows}, {k}) float32 scores and int64 tokens")
        offset = 0 if first else k + (level - 1) * k * k
        dev = self.inputs.device
        outs = [torch.empty(b, k, dtype=torch.int64, device=dev) for _ in range(5)]  # tokens, ranks, ids, slots, pos
        forward = level < self.steps - 1
        if b:
            width = self.steps * k
            _beam_level_kernel[(b,)](
                scores.contiguous(), tokens.contiguous(), self.scores, self.tokens, self.parents, self.beam,
                self.ancestors, outs[0], outs[1], self.inputs, self.map if self.map is not None else outs[0],
                outs[2], outs[3], outs[4], self.kv_lens, self.num_candidates, offset, level, self.inputs.stride(0),
                self.live_col, self.kv_col, self.table_col, self.inputs.shape[1] - self.table_col, self.block_size,
                K=k, KB=next_pow2(max(k, 2)), KK=next_pow2(max(k * k, 2)), WIDTH=width,
                WB=next_pow2(max(width, 2)), FIRST=first, FORWARD=forward, HAS_MAP=self.map is not None,
                num_warps=1 if k * max(k, width) <= 256 else 4)
        self.level += 1
        return outs[2], outs[1], outs[3], outs[4]

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check(self.level == self.steps, "expand every level first")
        return self.scores, self.tokens, self.parents
