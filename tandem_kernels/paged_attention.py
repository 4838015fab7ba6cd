"""Attention of new query tokens over a paged KV cache: chain (causal) appends and speculative tree appends.

Per sequence b the queries are rows [query_start[b], query_start[b+1]) of the flattened batch (T_b of them) and the
keys are KV indices [0, kv_len[b]), found through the block table. Key j is visible to query i when
  j < prefix_len[b]                                   (the committed prefix: visible to every query), or
  tree seq:  tree_mask[row, j - prefix_len[b]]        (the open tree region: ancestors and itself), or
  chain seq: j <= kv_len[b] - T_b + i                 (causal: the T_b queries are the last T_b keys).
The tree part is a dense per-row mask of fixed width, so a captured graph only rewrites tensor contents. GQA: each
program takes one KV head and the query heads that share it. Knows nothing about models or block allocation.

Split-KV (flash-decoding): with few (sequence, KV head, query tile) programs, e.g. batch-1 decode with 8 KV heads,
the keys of each program are cut into `num_splits` chunks run by separate programs that write unnormalised partial
results (acc, running max, running sum); a second kernel merges them. The chunk length is computed in the kernel
from the loaded kv_len, so the split count is a host constant and one captured graph serves every context length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import FLOAT_DTYPES, check, check_index, interpreting, next_pow2

# Finite "minus infinity": a fully masked key block then yields finite garbage that a later alpha zeroes, not NaN.
_NEG = tl.constexpr(-1.0e30)


# Per-call integers that vary from forward to forward (batch tokens, block-table and mask widths, split count) are
# not specialised: Triton would otherwise compile a new variant for 1, for multiples of 16 and for the rest of each,
# ~0.1 s per compile on the GPU host, in the middle of serving (bench/results/gpu_step_h200/NOTES.md).
@triton.jit(do_not_specialize=["stride_bt", "stride_mask", "mask_width", "num_tokens", "num_splits"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, query_start_ptr, kv_len_ptr, prefix_len_ptr, use_tree_ptr, tree_mask_ptr,
    part_acc_ptr, part_ml_ptr,  # split-KV partials: (S, N, nh, HEAD_DIM_P2) fp32 and (S, N, nh, 2) fp32
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_mask, mask_width,
    num_tokens, num_splits,
    GROUP: tl.constexpr,  # query heads per KV head
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of the query tile: (query token, head in group) pairs
    BLOCK_N: tl.constexpr,  # keys per step
    HAS_TREE: tl.constexpr, DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr,  # write partials for the merge kernel instead of the normalised output
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * TOKENS_PER_TILE >= q_len:
        return
    kv_len = tl.load(kv_len_ptr + seq)
    prefix_len = tl.load(prefix_len_ptr + seq)
    is_tree = False
    if HAS_TREE:
        is_tree = tl.load(use_tree_ptr + seq) != 0

    m = tl.arange(0, BLOCK_M)
    qi = tile * TOKENS_PER_TILE + m // GROUP  # query index within the sequence, (BLOCK_M,)
    head = kv_head * GROUP + m % GROUP
    row_ok = (m // GROUP < TOKENS_PER_TILE) & (qi < q_len)
    row = (q_start + qi).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM_P2)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Causal rows need no key past the last query of the tile; tree rows may see the whole region.
    last_qi = tl.minimum((tile + 1) * TOKENS_PER_TILE, q_len) - 1
    kv_end = kv_len - q_len + last_qi + 1
    if is_tree:
        kv_end = kv_len
    causal_limit = kv_len - q_len + qi  # (BLOCK_M,): last key a chain query sees

    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    # This program's key chunk: whole BLOCK_N steps, so splits never share a key block.
    chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    kv_stop = tl.minimum(kv_end, start + chunk)
    # A while loop, not range(0, kv_end, ...): Triton 3.6's interpreter cannot turn a loaded bound into a Python int
    # under numpy >= 2.4; compiled, both become the same scf loop.
    while start < kv_stop:
        j = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key indices
        j_ok = j < kv_len
        page = tl.load(block_table_ptr + seq * stride_bt + j // PAGE_SIZE, mask=j_ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + j % PAGE_SIZE
        kv_off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)  # (BLOCK_N, HEAD_DIM_P2)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N) fp32
        visible = j[None, :] < prefix_len
        tail = j - prefix_len
        if HAS_TREE:
            bits = tl.load(tree_mask_ptr + row[:, None] * stride_mask + tail[None, :],
                           mask=row_ok[:, None] & (tail[None, :] >= 0) & (tail[None, :] < mask_width) & is_tree,
                           other=0)
            tail_visible = tl.where(is_tree, bits != 0, j[None, :] <= causal_limit[:, None])
        else:
            tail_visible = j[None, :] <= causal_limit[:, None]
        visible = (visible | tail_visible) & j_ok[None, :]
        s = tl.where(visible, s * qk_scale, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        start += BLOCK_N
    if SPLIT:
        # (split, row, head) of a contiguous (S, N, nh, .) buffer; an empty chunk writes m = _NEG, l = 0, acc = 0.
        part = (split * num_tokens + row) * (GROUP * NUM_KV_HEADS) + head  # (BLOCK_M,)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_tokens, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One (token, head): out = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M), M = max_s m_s."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    part = (s * num_tokens + row) * NUM_HEADS + head  # (BLOCK_S,)
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=_NEG)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    d = tl.arange(0, HEAD_DIM_P2)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + d[None, :], mask=s_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # (BLOCK_S,): empty or fully masked chunks get weight 0
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    kv_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    tree_mask: torch.Tensor | None = None,
    use_tree: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q: (N, nh, hd), head_dim contiguous; k_cache, v_cache: (num_blocks, block_size, kvh, hd) contiguous, same
    dtype as q; block_tables: (B, max_blocks); query_start: (B+1,); kv_lens, prefix_lens: (B,); tree_mask: (N, W)
    bool/uint8, column c = key prefix_len + c, rows of chain seqs ignored; use_tree: (B,) nonzero = the sequence
    uses tree_mask (required with tree_mask). max_query_len >= every T_b (host int: sizes the grid, no sync).
    num_splits: key chunks per program (split-KV); None = `default_num_splits` for this grid. Returns out
    (N, nh, hd)."""
    check(q.dim() == 3 and q.stride(2) == 1, f"q must be (N, nh, hd) contiguous in hd, got {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    check(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} unsupported")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be (num_blocks, block_size, kvh, hd)")
    num_kv_heads = k_cache.shape[2]
    check(k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    check(num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    check(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q and the caches must share a dtype")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
    device = q.device
    check(k_cache.device == device, "caches must be on q's device")
    check_index(block_tables, "block_tables", 2, device)
    num_seqs = block_tables.shape[0]
    for name, t, n in (("query_start", query_start, num_seqs + 1), ("kv_lens", kv_lens, num_seqs),
                       ("prefix_lens", prefix_lens, num_seqs)):
        check_index(t, name, 1, device)
        check(t.shape[0] == n, f"{name} must have {n} entries, got {t.shape[0]}")
    has_tree = tree_mask is not None
    if has_tree:
        check(use_tree is not None, "tree_mask needs use_tree")
        check(tree_mask.dim() == 2 and tree_mask.shape[0] == num_tokens and tree_mask.stride(1) == 1,
              f"tree_mask must be (N={num_tokens}, W) contiguous in W, got {tuple(tree_mask.shape)}")
        check(tree_mask.dtype in (torch.bool, torch.uint8, torch.int8), f"tree_mask dtype {tree_mask.dtype}")
        check(use_tree.dim() == 1 and use_tree.shape[0] == num_seqs and use_tree.is_contiguous(), "use_tree: (B,)")
        tree_mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        use_tree = use_tree.view(torch.uint8) if use_tree.dtype == torch.bool else use_tree
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out must be like q")
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out

    group = num_heads // num_kv_heads
    if block_m is None:
        block_m = max(16, next_pow2(group * min(max_query_len, 16)))
    # fp32 tiles take twice the registers; fp32 only serves small test models, so keep its key block small.
    block_n = block_n or (32 if q.dtype == torch.float32 else 64)
    check(block_m >= group and block_m == next_pow2(block_m), f"block_m {block_m}: power of 2, >= group {group}")
    tokens_per_tile = block_m // group
    num_tiles = triton.cdiv(max_query_len, tokens_per_tile)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs * num_kv_heads * num_tiles, device)
    check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    head_dim_p2 = max(16, next_pow2(head_dim))
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_splits, num_tokens, num_heads, head_dim_p2, dtype=torch.float32, device=device)
        part_ml = torch.empty(num_splits, num_tokens, num_heads, 2, dtype=torch.float32, device=device)
    else:
        part_acc = part_ml = out  # never touched without SPLIT
    grid = (num_seqs, num_kv_heads, num_tiles * num_splits)
    mask_arg = tree_mask if has_tree else q  # never read without HAS_TREE
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, query_start, kv_lens, prefix_lens, use_tree if has_tree else kv_lens, mask_arg,
        part_acc, part_ml,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        tree_mask.stride(0) if has_tree else 0, tree_mask.shape[1] if has_tree else 0,
        num_tokens, num_splits,
        GROUP=group, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2,
        PAGE_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, HAS_TREE=has_tree,
        DOT_FP32=q.dtype == torch.float32 or interpreting(), SPLIT=split,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, num_tokens, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, BLOCK_S=_MAX_SPLITS,  # one variant for every split count (masked)
        )
    return out


# Split only while the plain grid leaves the GPU idle; cap the merge cost.
_MAX_SPLITS = 32


def default_num_splits(num_programs: int, device: torch.device) -> int:
    """Key chunks per program so that about two waves of programs cover the GPU; 1 on CPU (interpreter) and once
    the plain grid already fills it. Depends only on the grid, never on kv_len: a captured graph keeps its choice."""
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device)
    if num_programs >= num_sms:
        return 1
    return max(1, min(_MAX_SPLITS, -(-2 * num_sms // num_programs)))


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    kv_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    tree_mask: torch.Tensor | None = None,
    use_tree: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as paged_attention, computed per sequence in fp32 with dense masks."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts, kv_lens_l, prefix_l = query_start.tolist(), kv_lens.tolist(), prefix_lens.tolist()
    for b in range(block_tables.shape[0]):
        q0, q1, kv_len, prefix = starts[b], starts[b + 1], kv_lens_l[b], prefix_l[b]
        t = q1 - q0
        if t == 0:
            continue
        j = torch.arange(kv_len, device=q.device)
        slots = block_tables[b].long()[j // page_size] * page_size + j % page_size
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)  # (kv, nh, hd)
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        qi = torch.arange(t, device=q.device)
        visible = j[None, :] < prefix  # (T, kv_len)
        if tree_mask is not None and bool(use_tree[b]):
            tail = torch.zeros(t, kv_len, dtype=torch.bool, device=q.device)
            width = min(kv_len - prefix, tree_mask.shape[1])
            tail[:, prefix:prefix + width] = tree_mask[q0:q1, :width].bool()
            visible = visible | tail
        else:
            visible = visible | (j[None, :] <= (kv_len - t + qi)[:, None])
        scores = torch.einsum("thd,khd->htk", q[q0:q1].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("htk,khd->thd", scores.softmax(-1), v).to(q.dtype)
    return out
