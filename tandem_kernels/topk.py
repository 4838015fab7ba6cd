"""Log-softmax and top-k of each row in one launch: the per-step expansion of a draft tree (BeamTreeBuilder's
`topk` children of every beam node, ranked by log-probability).

The torch path is four to five kernels per row block (the fp32 cast, log_softmax, the NaN guard, torch.topk's radix
select and its sort), ~24 µs per draft step on the H100 where a draft vocabulary row is 2,048 wide (session 16's
profile: `gatherTopK` alone 11-15 µs). Here one program per row: an online max / sum-exp pass, then `k` selection
passes over the row, each taking the best element ranked after the previous one.

Order: by log-probability, descending; ties to the lower index (torch.topk leaves tie order unspecified); NaN ranks
as -inf (a NaN draft score must lose, never win; a row holding a NaN is NaN throughout in torch's log_softmax, so all
-inf here too). A row with fewer than k finite entries is filled with -inf entries in index order. Values are
`x - max - log(sum(exp(x - max)))` in fp32, as torch.log_softmax computes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import FLOAT_DTYPES, check, next_pow2

MAX_K = 64
BLOCK_MAX = 4096  # one row chunk per loop iteration; a draft vocabulary of up to 4,096 is read in one


@triton.jit
def _logsoftmax_topk_kernel(
    x_ptr, val_ptr, idx_ptr, stride_x, V,
    K: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    # Pass 1: the row's max and sum of exp (online over chunks), and whether it holds a NaN (then, as in torch, the
    # whole row's log-softmax is NaN: every value -inf here).
    m = tl.full((), neg_inf, tl.float32)
    s = tl.full((), 0.0, tl.float32)
    nans = tl.full((), 0, tl.int32)
    for c in range(CHUNKS):
        i = c * BLOCK + offs
        x = tl.load(base + i, mask=i < V, other=neg_inf).to(tl.float32)
        nans += tl.sum((x != x).to(tl.int32), axis=0)
        x = tl.where(x != x, neg_inf, x)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        safe_m = tl.where(new_m == neg_inf, 0.0, new_m)
        s = s * tl.exp(tl.where(m == neg_inf, neg_inf, m - safe_m)) + tl.sum(tl.exp(x - safe_m), axis=0)
        m = new_m
    shift = tl.where(m == neg_inf, 0.0, m)
    lse = tl.log(s)
    # Passes 2..K+1: the best (value desc, index asc) ranked after the previous pick.
    prev_v = tl.full((), float("inf"), tl.float32)
    prev_i = tl.full((), -1, tl.int64)
    for j in range(K):
        best_v = tl.full((), neg_inf, tl.float32)
        best_i = tl.full((), V, tl.int64)
        for c in range(CHUNKS):
            i = (c * BLOCK + offs).to(tl.int64)
            inside = i < V
            x = tl.load(base + i, mask=inside, other=neg_inf).to(tl.float32)
            lp = (x - shift) - lse
            lp = tl.where((lp != lp) | (nans > 0), neg_inf, lp)  # NaN (a NaN row, -inf - -inf, inf - inf): -inf
            later = (lp < prev_v) | ((lp == prev_v) & (i > prev_i))
            ok = inside & later
            cand_v = tl.max(tl.where(ok, lp, neg_inf), axis=0)
            cand_i = tl.min(tl.where(ok & (lp == cand_v), i, V), axis=0)
            better = (cand_i < V) & ((cand_v > best_v) | ((cand_v == best_v) & (cand_i < best_i)))
            best_v = tl.where(better, cand_v, best_v)
            best_i = tl.where(better, cand_i, best_i)
        tl.store(val_ptr + row * K + j, best_v)
        tl.store(idx_ptr + row * K + j, best_i)
        prev_v = best_v
        prev_i = best_i


def logsoftmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k best entries of log_softmax(logits) along the last dim: values fp32, indices int64,
    both (..., k). logits: any float dtype, contiguous in the last dim."""
    check(logits.dtype in FLOAT_DTYPES, f"logits dtype {logits.dtype} unsupported")
    check(logits.dim() >= 1 and logits.stride(-1) == 1, "logits must be contiguous in the last dim")
    vocab = logits.shape[-1]
    check(1 <= k <= min(MAX_K, vocab), f"k = {k} outside 1..min({MAX_K}, vocab {vocab})")
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    values = torch.empty(rows.shape[0], k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows.shape[0], k, dtype=torch.int64, device=logits.device)
    if rows.shape[0]:
        block = min(next_pow2(vocab), BLOCK_MAX)
        _logsoftmax_topk_kernel[(rows.shape[0],)](
            rows, values, indices, rows.stride(0), vocab,
            K=k, BLOCK=block, CHUNKS=-(-vocab // block), num_warps=min(8, max(1, block // 256)),
        )
    return values.view(*lead, k), indices.view(*lead, k)


def logsoftmax_topk_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: fp32 log_softmax, NaN as -inf, torch.topk (ties in torch's own order)."""
    logprobs = torch.nan_to_num(torch.log_softmax(logits.float(), dim=-1), nan=-torch.inf)
    return logprobs.topk(k, dim=-1)
