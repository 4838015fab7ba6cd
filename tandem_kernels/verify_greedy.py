"""Greedy tree verification on device: per sequence, walk from the root along the children whose token equals the
target's argmax at their parent, and emit the accepted drafts plus the target's token after the last one (bonus).

Node layout per sequence (root-inclusive, as the target's logits rows): node 0 is the root (the last committed
token), node m >= 1 is draft node m - 1. Siblings are tried in increasing node index, like
runtime.speculative.verify.verify_greedy. Everything stays on device: no host sync, fixed output shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import check, next_pow2


@triton.jit
def _verify_greedy_kernel(
    candidates_ptr, parents_ptr, target_ptr, accept_index_ptr, emitted_ptr, accept_len_ptr,
    slots_ptr, src_ptr, dst_ptr, rows_ptr,
    stride_c, stride_p, stride_t, stride_a, stride_e, stride_l, stride_s,
    NUM_NODES: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, BLOCK)
    in_row = m < NUM_NODES
    # the outputs' rows start as [0, -1, ...] (accept_index) and [-1, ...] (emitted)
    tl.store(accept_index_ptr + seq * stride_a + m, tl.where(m == 0, 0, -1), mask=in_row)
    tl.store(emitted_ptr + seq * stride_e + m, tl.full((BLOCK,), -1, tl.int32), mask=in_row)
    tl.debug_barrier()
    exists = (m >= 1) & in_row
    tokens = tl.load(candidates_ptr + seq * stride_c + m, mask=exists, other=-1)
    parents = tl.load(parents_ptr + seq * stride_p + m, mask=exists, other=-1)  # -1 on padding nodes
    cur = tl.full([], 0, tl.int32)  # last accepted node
    count = tl.full([], 0, tl.int32)  # accepted drafts so far
    live = tl.full([], 1, tl.int32)  # 0 once a level had no match
    for _ in range(NUM_NODES - 1):  # a path can hold at most every draft node
        want = tl.load(target_ptr + seq * stride_t + cur)
        hit = exists & (parents == cur) & (tokens == want)
        node = tl.min(tl.where(hit, m, BLOCK), 0)  # the lowest-index matching child
        found = (node < BLOCK) & (live != 0)
        tl.store(accept_index_ptr + seq * stride_a + 1 + count, node, mask=found)
        tl.store(emitted_ptr + seq * stride_e + count, want, mask=found)
        count += found.to(tl.int32)
        cur = tl.where(found, node, cur)
        live = found.to(tl.int32)
    bonus = tl.load(target_ptr + seq * stride_t + cur)
    tl.store(emitted_ptr + seq * stride_e + count, bonus)
    tl.store(accept_len_ptr + seq * stride_l, count + 1)
    if PACK:  # the KV compaction's moves (path node -> region index j, j in [1, len)) and the feature rows
        tl.debug_barrier()
        path = tl.load(accept_index_ptr + seq * stride_a + m, mask=in_row, other=-1).to(tl.int64)
        safe = tl.maximum(path, 0)
        slot = tl.load(slots_ptr + seq * stride_s + m, mask=in_row, other=-1)
        moves = (m >= 1) & (m < count + 1) & (path != m)
        src = tl.load(slots_ptr + seq * stride_s + safe, mask=in_row & moves, other=-1)
        tl.store(src_ptr + seq * NUM_NODES + m, tl.where(moves, src, -1), mask=in_row)
        tl.store(dst_ptr + seq * NUM_NODES + m, slot, mask=in_row)
        tl.store(rows_ptr + seq * NUM_NODES + m, seq * NUM_NODES + safe, mask=in_row)


def _check_walk_inputs(candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor) -> None:
    check(candidates.dim() == 2, f"candidates must be (B, n+1), got {tuple(candidates.shape)}")
    for name, t in (("candidates", candidates), ("parents", parents), ("target_predict", target_predict)):
        check(t.dtype in (torch.int32, torch.int64), f"{name} must be int32/int64, got {t.dtype}")
        check(t.device == candidates.device, f"{name} is on {t.device}, expected {candidates.device}")
        check(t.shape == candidates.shape, f"{name} shape {tuple(t.shape)} != {tuple(candidates.shape)}")
        check(t.stride(1) == 1, f"{name} rows must be contiguous")


def verify_tree_greedy(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidates: (B, n+1) token of each node (column 0, the root, is not read); parents: (B, n+1) parent node of
    each node, in [0, m) for node m >= 1, -1 for a padding node (column 0 not read); target_predict: (B, n+1) the
    target's argmax after each node. All int32/int64, rows contiguous, on one device.

    Returns (accept_index, emitted, accept_lens):
      accept_index (B, n+1) int32: [0, path nodes..., -1 ...] (root first, as compaction wants it);
      emitted (B, n+1) int32: [accepted draft tokens..., bonus, -1 ...];
      accept_lens (B,) int32: tokens emitted = accepted drafts + 1."""
    _check_walk_inputs(candidates, parents, target_predict)
    device = candidates.device
    num_seqs, num_nodes = candidates.shape
    accept_index = torch.empty((num_seqs, num_nodes), dtype=torch.int32, device=device)
    emitted = torch.empty((num_seqs, num_nodes), dtype=torch.int32, device=device)
    accept_lens = torch.empty(num_seqs, dtype=torch.int32, device=device)
    if num_seqs:
        _verify_greedy_kernel[(num_seqs,)](
            candidates, parents, target_predict, accept_index, emitted, accept_lens, accept_lens, accept_lens,
            accept_lens, accept_lens, candidates.stride(0), parents.stride(0), target_predict.stride(0),
            accept_index.stride(0), emitted.stride(0), 1, 0, NUM_NODES=num_nodes, BLOCK=next_pow2(num_nodes),
            PACK=False,
        )
    return accept_index, emitted, accept_lens


def verify_tree_greedy_packed(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor, slots: torch.Tensor,
    head: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verify_tree_greedy for the static verify step, in one launch with its epilogue: writes head (B, 2(n+1) + 1)
    int64 = [emitted (n+1), accept_index (n+1), accept length] per sequence, and returns (src, dst, rows), each (B,
    n+1) int64: the KV compaction's moves (slot of path node j -> slots[j] for j in [1, length) where they differ,
    src -1 elsewhere; slots (B, n+1) int64 the region's KV slots) and each accepted row's flat row index into the
    forward's (B (n+1), ...) outputs (the feature gather)."""
    _check_walk_inputs(candidates, parents, target_predict)
    num_seqs, num_nodes = candidates.shape
    check(slots.dtype == torch.int64 and slots.shape == candidates.shape and slots.stride(1) == 1,
          "slots: (B, n+1) int64 rows")
    check(head.dtype == torch.int64 and head.is_contiguous() and head.shape == (num_seqs, 2 * num_nodes + 1),
          "head: contiguous (B, 2(n+1) + 1) int64")
    device = candidates.device
    src, dst, rows = (torch.empty(num_seqs, num_nodes, dtype=torch.int64, device=device) for _ in range(3))
    if num_seqs:
        stride = head.stride(0)
        _verify_greedy_kernel[(num_seqs,)](
            candidates, parents, target_predict, head[:, num_nodes:], head, head[:, 2 * num_nodes], slots, src, dst,
            rows, candidates.stride(0), parents.stride(0), target_predict.stride(0), stride, stride, stride,
            slots.stride(0), NUM_NODES=num_nodes, BLOCK=next_pow2(num_nodes), PACK=True,
        )
    return src, dst, rows


def verify_tree_greedy_ref(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_seqs, num_nodes = candidates.shape
    accept_index = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    emitted = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    accept_lens = torch.empty(num_seqs, dtype=torch.int32)
    cand, par, pred = candidates.tolist(), parents.tolist(), target_predict.tolist()
    for b in range(num_seqs):
        path, tokens, cur = [0], [], 0
        while True:
            want = pred[b][cur]
            child = next((m for m in range(1, num_nodes) if par[b][m] == cur and cand[b][m] == want), None)
            if child is None:
                break
            path.append(child)
            tokens.append(want)
            cur = child
        tokens.append(pred[b][cur])
        accept_index[b, :len(path)] = torch.tensor(path)
        emitted[b, :len(tokens)] = torch.tensor(tokens)
        accept_lens[b] = len(tokens)
    device = candidates.device
    return accept_index.to(device), emitted.to(device), accept_lens.to(device)
