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

from tandem_kernels._common import check, check_index, next_pow2


@triton.jit
def _verify_greedy_kernel(
    candidates_ptr, parents_ptr, target_ptr, accept_index_ptr, emitted_ptr, accept_len_ptr,
    stride_c, stride_p, stride_t, stride_a, stride_e,
    NUM_NODES: tl.constexpr, BLOCK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, BLOCK)
    exists = (m >= 1) & (m < NUM_NODES)
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
    tl.store(accept_len_ptr + seq, count + 1)


def verify_tree_greedy(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidates: (B, n+1) token of each node (column 0, the root, is not read); parents: (B, n+1) parent node of
    each node, in [0, m) for node m >= 1, -1 for a padding node (column 0 not read); target_predict: (B, n+1) the
    target's argmax after each node. All int32/int64, contiguous, on one device.

    Returns (accept_index, emitted, accept_lens):
      accept_index (B, n+1) int32: [0, path nodes..., -1 ...] (root first, as compaction wants it);
      emitted (B, n+1) int32: [accepted draft tokens..., bonus, -1 ...];
      accept_lens (B,) int32: tokens emitted = accepted drafts + 1."""
    check(candidates.dim() == 2, f"candidates must be (B, n+1), got {tuple(candidates.shape)}")
    device = candidates.device
    for name, t in (("candidates", candidates), ("parents", parents), ("target_predict", target_predict)):
        check_index(t, name, 2, device)
        check(t.shape == candidates.shape, f"{name} shape {tuple(t.shape)} != {tuple(candidates.shape)}")
    num_seqs, num_nodes = candidates.shape
    accept_index = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32, device=device)
    accept_index[:, 0] = 0
    emitted = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32, device=device)
    accept_lens = torch.empty(num_seqs, dtype=torch.int32, device=device)
    if num_seqs == 0:
        return accept_index, emitted, accept_lens
    _verify_greedy_kernel[(num_seqs,)](
        candidates, parents, target_predict, accept_index, emitted, accept_lens,
        candidates.stride(0), parents.stride(0), target_predict.stride(0), accept_index.stride(0),
        emitted.stride(0), NUM_NODES=num_nodes, BLOCK=next_pow2(num_nodes),
    )
    return accept_index, emitted, accept_lens


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
