"""The glue between chained speculative steps (runtime/speculative/fused_step.py) in one launch each, where the torch
path spends ~40 tiny kernels per glue (session 16's profile on the H100: two glue graphs of 46 and 40 kernels,
142 µs of a ~1.15 ms chained EAGLE3 5/4/16 step).

- `to_verify`: the chained state (root, starts, live, the tree) -> the static verify step's packed input row of each
  sequence (ids, positions from the tree depths, KV slots from the block table, region parents, start).
- `to_draft`: the verify outcome -> the step's record, the static draft step's catch-up row (the emitted tokens
  right-aligned in the window at the draft's KV end), the chained state advanced; `to_draft_features` copies the
  accepted rows' target features into the draft's catch-up window and keeps the last one.

One program per sequence (features: per row and feature chunk); the values equal the torch glue's exactly (integer
work and copies only). The layouts are fused_step.FusedSteps', spelled out at each launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import check, next_pow2


@triton.jit
def _put(dst, pad, offs, value, live, mask):
    """A packed input field: the step's value for a live row, the padding row's value otherwise."""
    tl.store(dst + offs, tl.where(live, value, tl.load(pad + offs, mask=mask, other=0)), mask=mask)


@triton.jit
def _to_verify_kernel(
    state_ptr, in_ptr, pad_ptr, stride_state, stride_in, stride_pad, table_col, max_blocks, block_size, W,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    st = state_ptr + row * stride_state
    m = W - 1
    root = tl.load(st)
    start = tl.load(st + 1)
    live = tl.load(st + 3) != 0
    j = tl.arange(0, BLOCK).to(tl.int64)
    inside = j < W
    node = inside & (j >= 1)  # region index j >= 1 is tree node j - 1
    tok = tl.load(st + 4 + j - 1, mask=node, other=0)
    par = tl.load(st + 4 + m + j - 1, mask=node, other=-1)
    ids = tl.where(j == 0, root, tl.maximum(tok, 0))  # a missing node (-1) verifies token 0: rejected
    region_parent = tl.where(j == 0, -1, tl.where(par < 0, 0, par + 1))
    # depth below the root: walk the region parents up (a node has at most W - 1 ancestors)
    depth = tl.zeros((BLOCK,), dtype=tl.int64)
    cur = tl.where(inside, region_parent, -1)
    for _ in range(BLOCK):  # BLOCK >= W (a constexpr bound: the interpreter's)
        up = (cur >= 0) & (cur < W)
        depth += up.to(tl.int64)
        above = tl.load(st + 4 + m + cur - 1, mask=up & (cur >= 1), other=-1)
        cur = tl.where(up & (cur >= 1), tl.where(above < 0, 0, above + 1), -1)
    region = start + j
    blk_col = region // block_size
    blk = tl.load(in_ptr + row * stride_in + table_col + blk_col, mask=inside & (blk_col >= 0) & (blk_col < max_blocks),
                  other=0)
    slot = blk * block_size + region % block_size
    dst = in_ptr + row * stride_in
    pad = pad_ptr + row * stride_pad
    _put(dst, pad, j, ids, live, inside)
    _put(dst, pad, W + j, start + depth, live, inside)
    _put(dst, pad, 2 * W + j, slot, live, inside)
    _put(dst, pad, 3 * W + j, region_parent, live, inside)
    _put(dst, pad, 4 * W, start, live, True)


def to_verify(state: torch.Tensor, inputs: torch.Tensor, pad: torch.Tensor, b: int, width: int, table_col: int,
              block_size: int) -> None:
    """state (>= b, 4 + 2(W-1)) int64 rows [root, target start, draft start, live, tree tokens, tree parents (node
    indices, -1 = root)]; inputs: the verify step's packed rows (>= b, table_col + max_blocks), written in columns
    [0, 4W + 1) = [ids (W), positions (W), slots (W), region parents (W), start] from the block table after them;
    pad: the padding rows' first 4W + 1 columns, written for the rows not live."""
    check(state.dtype == inputs.dtype == pad.dtype == torch.int64, "state, inputs and pad must be int64")
    check(table_col == 4 * width + 1 and state.shape[1] == 4 + 2 * (width - 1), "to_verify: layout mismatch")
    check(state.stride(1) == inputs.stride(1) == pad.stride(1) == 1, "rows must be contiguous")
    if b:
        _to_verify_kernel[(b,)](state, inputs, pad, state.stride(0), inputs.stride(0), pad.stride(0), table_col,
                                inputs.shape[1] - table_col, block_size, width,
                                BLOCK=next_pow2(max(width, 2)), num_warps=1)


@triton.jit
def _to_draft_kernel(
    head_ptr, state_ptr, rec_ptr, step_ptr, in_ptr, pad_ptr, stride_state, stride_in, stride_pad, B, S,
    table_col, max_blocks, block_size, W, Q, BLOCK_W: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = head_ptr + row * (2 * W + 1)
    st = state_ptr + row * stride_state
    w_off = tl.arange(0, BLOCK_W).to(tl.int64)
    emitted = tl.load(head + w_off, mask=w_off < W, other=0)
    count = tl.load(head + 2 * W)
    # the step's record: the emitted tokens and their count, at the run's step counter
    step = tl.load(step_ptr)
    rec = rec_ptr + (step * B + row) * (W + 1)
    tl.store(rec + w_off, emitted, mask=(w_off < W) & (step < S))
    tl.store(rec + W, count, mask=step < S)
    root = tl.load(st)
    tstart = tl.load(st + 1)
    dstart = tl.load(st + 2)
    live = tl.load(st + 3) != 0
    # catch-up window: the count emitted tokens right-aligned in Q rows at the draft's KV end
    r = tl.arange(0, BLOCK_Q).to(tl.int64)
    in_q = r < Q
    index = r - (Q - count)
    valid = index >= 0
    index = tl.minimum(tl.maximum(index, 0), W - 1)
    ids = tl.where(valid, tl.load(head + index, mask=in_q, other=0), 0)
    at = dstart + index
    blk_col = at // block_size
    blk = tl.load(in_ptr + row * stride_in + table_col + blk_col, mask=in_q & (blk_col < max_blocks), other=0)
    slot = blk * block_size + at % block_size
    dst = in_ptr + row * stride_in
    pad = pad_ptr + row * stride_pad
    _put(dst, pad, r, ids, live, in_q)
    _put(dst, pad, Q + r, tl.where(valid, at, 0), live, in_q)
    _put(dst, pad, 2 * Q + r, tl.where(valid, slot, -1), live, in_q)
    _put(dst, pad, 3 * Q, dstart, live, True)
    _put(dst, pad, 3 * Q + 1, dstart + count, live, True)
    # the state advanced past the step: the last emitted token is the next root
    last = tl.load(head + tl.maximum(count - 1, 0))
    grow = tl.where(live, count, 0)
    tl.store(st, tl.where(live, last, root))
    tl.store(st + 1, tstart + grow)
    tl.store(st + 2, dstart + grow)


def to_draft(head: torch.Tensor, state: torch.Tensor, records: torch.Tensor, step_index: torch.Tensor,
             inputs: torch.Tensor, pad: torch.Tensor, b: int, width: int, catch_up: int, table_col: int,
             block_size: int) -> None:
    """head (b, 2W + 1) int64: the verify step's [emitted (W), path (W), count]; state as to_verify's (root, target
    and draft starts advanced by the count where live); records (max_steps, b, W + 1) int64: row `step_index` gets
    [emitted, count] (the caller advances step_index after); inputs: the draft step's packed rows (>= b, table_col +
    max_blocks), written in [0, 3Q + 2) = [ids (Q), positions (Q), slots (Q), start, kv_after] from the block table
    after them; pad: the padding rows' first 3Q + 2 columns, for the rows not live."""
    check(head.dtype == state.dtype == records.dtype == inputs.dtype == pad.dtype == torch.int64,
          "to_draft: every tensor int64")
    check(head.is_contiguous() and records.is_contiguous() and head.shape == (b, 2 * width + 1),
          "head (b, 2W + 1) and records must be contiguous")
    check(records.shape[1:] == (b, width + 1) and table_col == 3 * catch_up + 2, "to_draft: layout mismatch")
    check(state.stride(1) == inputs.stride(1) == pad.stride(1) == 1, "rows must be contiguous")
    if b:
        _to_draft_kernel[(b,)](head, state, records, step_index, inputs, pad, state.stride(0), inputs.stride(0),
                               pad.stride(0), b, records.shape[0], table_col, inputs.shape[1] - table_col, block_size,
                               width, catch_up, BLOCK_W=next_pow2(max(width, 2)), BLOCK_Q=next_pow2(max(catch_up, 2)), num_warps=1)


@triton.jit
def _to_draft_features_kernel(head_ptr, feat_ptr, out_ptr, last_ptr, B, W, Q, F, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_f = f < F
    if pid < B * Q:  # catch-up row r of sequence i: the emitted token's feature, zero for a padding row
        i = pid // Q
        r = pid % Q
        count = tl.load(head_ptr + i * (2 * W + 1) + 2 * W)
        index = r - (Q - count)
        src = tl.minimum(tl.maximum(index, 0), W - 1)
        x = tl.load(feat_ptr + (i * W + src) * F + f, mask=in_f & (index >= 0), other=0.0)
        tl.store(out_ptr + pid * F + f, x, mask=in_f)
    else:  # the last kept row of sequence i
        i = pid - B * Q
        count = tl.load(head_ptr + i * (2 * W + 1) + 2 * W)
        src = tl.maximum(count - 1, 0)
        tl.store(last_ptr + i * F + f, tl.load(feat_ptr + (i * W + src) * F + f, mask=in_f), mask=in_f)


def to_draft_features(head: torch.Tensor, feats: torch.Tensor, out: torch.Tensor, last: torch.Tensor,
                      catch_up: int) -> None:
    """feats (b, W, F): the verify step's accepted rows' features; out (b * Q, F): the draft's catch-up features
    (row r of sequence i: feats[i, r - (Q - count)], zero before the window's emitted rows); last (b, F): feats[i,
    count - 1]."""
    b, w, feat = feats.shape
    check(feats.is_contiguous() and out.is_contiguous() and last.is_contiguous(), "features must be contiguous")
    check(out.shape == (b * catch_up, feat) and last.shape == (b, feat) and out.dtype == last.dtype == feats.dtype,
          "to_draft_features: shape or dtype mismatch")
    if b:
        block = min(1024, next_pow2(feat))
        _to_draft_features_kernel[(b * catch_up + b, -(-feat // block))](head, feats, out, last, b, w, catch_up,
                                                                       feat, BLOCK=block, num_warps=4)
