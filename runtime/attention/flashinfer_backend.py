"""FlashInfer attention backend (optional, CUDA only: `pip install flashinfer-python`, 0.5.x).

New K/V go into the pool with our Triton `store_kv`; attention reads the pool in place through FlashInfer's paged
wrappers. Our per-layer K and V caches, (num_blocks, block_size, kvh, hd) each, are exactly FlashInfer's "NHD" page
layout (a (k_cache, v_cache) tuple; one block = one page), so nothing is copied or re-laid out.

Which kernel runs is decided once per forward:
- every sequence appends one token, no tree: `BatchDecodeWithPagedKVCacheWrapper` (tensor-core decode);
- chain appends (prefill chunks): `BatchPrefillWithPagedKVCacheWrapper`, causal (bottom-right aligned, which is
  the torch backend's chain rule: prefix visible, query i sees the tail up to itself);
- any tree in the batch (verify, draft tree steps, regions spanning several forwards): the prefill wrapper with a
  custom mask carrying exactly the torch backend's visibility (prefix all ones, tail by the tree / chain rule).
All wrappers use FlashInfer's FA2 kernels, so one JIT module serves every case.

`plan` runs once per forward, outside any CUDA graph, at the first layer's `forward` (it needs the q/KV dtypes and
the page size, which only the layer call shows) or, for graph replays, in `load_graph_metadata`. CUDA graphs use one
`use_cuda_graph=True` wrapper per (batch bucket, tokens per sequence) with its own fixed-size index buffers.

The custom mask is built packed on the device from the hidden tail bits only (`pack_mask`). FlashInfer 0.5.3
computes the byte offsets of an already packed mask (`packed_custom_mask`) as bit offsets; its kernel reads them as
byte offsets. We write the correct byte offsets after `plan` (into our own buffer for graphs, into the wrapper's
mask-indptr tensor for eager runs).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

try:
    import flashinfer
except Exception as exc:  # missing package or one of its dependencies (nvidia-ml-py, requests, apache-tvm-ffi)
    raise ImportError("attention backend 'flashinfer' needs FlashInfer on a CUDA machine: pip install "
                      f"flashinfer-python (0.5.x); importing it failed: {exc}") from exc
if not torch.cuda.is_available():
    raise ImportError("attention backend 'flashinfer' runs on CUDA GPUs only (pip install flashinfer-python on the "
                      "GPU machine); use --attention-backend torch on CPU")
try:
    from tandem_kernels.store_kv import store_kv
except ModuleNotFoundError as exc:
    if exc.name != "triton":
        raise
    raise ImportError("attention backend 'flashinfer' stores K/V with a Triton kernel: needs the triton package") from exc

from runtime.attention import AttentionBackend, register_backend  # noqa: E402
from runtime.forward_batch import ForwardBatch, SeqAttention, tree_mask_rows  # noqa: E402

logger = logging.getLogger(__name__)
if not str(getattr(flashinfer, "__version__", "")).startswith("0.5."):
    logger.warning("flashinfer %s: this backend is written against FlashInfer 0.5.x (plan/run API, custom-mask "
                   "offsets); run tests/gpu/test_flashinfer_backend_gpu.py", getattr(flashinfer, "__version__", "?"))
_MIN_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
_INT_WORKSPACE_BYTES = 8 << 20  # what FlashInfer's wrappers allocate for themselves


@dataclass
class _PageTables:
    """FlashInfer's CSR description of one forward, host int32 arrays; the mask fields only for masked plans."""

    qo_indptr: np.ndarray  # (B+1,) query rows of each sequence
    kv_indptr: np.ndarray  # (B+1,) pages of each sequence in `indices`
    indices: np.ndarray  # (kv_indptr[-1],) page (= KV block) ids
    last_page_len: np.ndarray  # (B,) valid entries in each sequence's last page, 1..page_size
    # Packed custom mask: sequence b's (T, kv_len) bits, row-major, little-endian, from byte mask_indptr[b] (the
    # kernel reads bit q * kv_len + k there). All ones except the hidden tail bits, so only those travel: byte
    # `clear_idx[i]` loses the bits `clear_val[i]` (`pack_mask` builds it on the device).
    mask_indptr: np.ndarray | None = None  # (B+1,) int32
    clear_idx: np.ndarray | None = None  # (M,) int64
    clear_val: np.ndarray | None = None  # (M,) uint8


def tail_mask(query_len: int, tail_len: int, tree_rows: list[int] | None) -> np.ndarray:
    """(T, tail_len) uint8, 1 = visible: the tree rows, or the chain rule (query i sees tail[: tail - T + i + 1]).
    The prefix before the tail is visible to every query (the torch backend's `_dense_mask`)."""
    if tree_rows is not None:
        return tree_mask_rows(tree_rows, tail_len)
    return np.tri(query_len, tail_len, tail_len - query_len, dtype=np.uint8)


def page_tables(
    seqs: list[SeqAttention], page_size: int, masked: bool, num_pad: int = 0, pad_query_len: int = 1
) -> _PageTables:
    """The sequences, then `num_pad` padding sequences (CUDA graph buckets) of pad_query_len queries over one key in
    page 0, all visible: padding reads finite data and, with slot -1, writes nothing."""
    num_seqs = len(seqs) + num_pad
    qo = np.zeros(num_seqs + 1, dtype=np.int32)
    kv = np.zeros(num_seqs + 1, dtype=np.int32)
    last = np.ones(num_seqs, dtype=np.int32)
    mask_bytes = np.zeros(num_seqs, dtype=np.int64)
    tables: list[list[int]] = []
    for b, seq in enumerate(seqs):
        if seq.query_start != qo[b]:  # FlashInfer reads each sequence's rows from consecutive offsets
            raise ValueError(f"sequence queries must be contiguous and in order; got start {seq.query_start}")
        if seq.block_size != page_size:
            raise ValueError(f"sequence block size {seq.block_size} != KV cache page size {page_size}")
        pages = -(-seq.kv_len // page_size)
        if len(seq.block_table) < pages:
            raise ValueError(f"block table of {len(seq.block_table)} blocks cannot hold kv_len {seq.kv_len}")
        tables.append(seq.block_table[:pages])
        qo[b + 1] = qo[b] + seq.query_len
        kv[b + 1] = kv[b] + pages
        last[b] = seq.kv_len - (pages - 1) * page_size
        mask_bytes[b] = -(-seq.query_len * seq.kv_len // 8)
    for b in range(len(seqs), num_seqs):
        tables.append([0])
        qo[b + 1] = qo[b] + pad_query_len
        kv[b + 1] = kv[b] + 1
        mask_bytes[b] = -(-pad_query_len // 8)
    indices = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(kv[-1]))
    out = _PageTables(qo, kv, indices, last)
    if masked:
        out.mask_indptr = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(mask_bytes, out=out.mask_indptr[1:])
        out.clear_idx, out.clear_val = _cleared_bits(seqs, out.mask_indptr)
    return out


def _cleared_bits(seqs: list[SeqAttention], mask_indptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(byte index, bits to clear) of every byte holding hidden tail bits. Work ~ (query rows x tail), not the
    (query rows x kv_len) of the dense mask: long prefixes cost nothing."""
    tails = [s for s in seqs if s.tail_len > 0]
    if not tails:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    width = max(s.tail_len for s in tails)
    rows = sum(s.query_len for s in tails)
    bits = np.ones((rows, width), dtype=np.uint8)  # past a row's tail: ones, i.e. leave the next bits alone
    start = np.empty(rows, dtype=np.int64)  # global bit of each row's first tail bit
    r = 0
    for b, seq in enumerate(seqs):
        if seq.tail_len == 0:
            continue
        t = seq.query_len
        bits[r:r + t, :seq.tail_len] = tail_mask(t, seq.tail_len, seq.tree_rows)
        start[r:r + t] = 8 * int(mask_indptr[b]) + np.arange(t) * seq.kv_len + seq.prefix_len
        r += t
    # Each row's tail in a byte-aligned window of ones, at the tail's bit offset within its first byte; packed.
    shift = start & 7
    window_bytes = (7 + width + 7) // 8
    window = np.ones((rows, window_bytes * 8), dtype=np.uint8)
    for offset in range(8):
        sel = shift == offset
        window[sel, offset:offset + width] = bits[sel]
    cleared = 255 - np.packbits(window, axis=1, bitorder="little")  # (rows, window_bytes)
    byte = (start >> 3)[:, None] + np.arange(window_bytes)[None, :]
    keep = cleared != 0
    return byte[keep], cleared[keep]


def pack_mask(tables: _PageTables, device: torch.device) -> torch.Tensor:
    """The packed custom mask on the device: all ones, minus the cleared bits. Rows of one sequence may share a byte;
    their cleared bits are disjoint, so adding them per byte is their OR."""
    cleared = torch.zeros(int(tables.mask_indptr[-1]), dtype=torch.uint8, device=device)
    if tables.clear_idx.size:
        cleared.index_add_(0, _to_device(tables.clear_idx, device), _to_device(tables.clear_val, device))
    return 255 - cleared


def split_kv_workspace_bytes(num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int, batch_size: int,
                             num_rows: int, graph: bool) -> int:
    """Upper bound of the float scratch (split-KV partial outputs and LSEs) FlashInfer's FA2 plan takes: eager plans
    split only while the work fits 2 CTAs per SM; CUDA-graph plans always split over a padded grid."""
    max_split = 2 * num_sms // num_kv_heads
    group = num_heads // num_kv_heads
    worst = 0
    for tile_q in (16, 64, 128):  # FlashInfer's query tile sizes
        tiles = max(max_split, -(-num_rows * group // tile_q) + batch_size - 1) if graph else max_split
        worst = max(worst, num_heads * tiles * tile_q * (head_dim + 1) * 4)
    return worst + (1 << 20)  # alignment slack


@dataclass
class _GraphSpec:
    max_bs: int
    max_query_len: int
    max_blocks: int
    mask_width: int  # widest tree tail a graph accepts
    device: torch.device


@register_backend("flashinfer")
class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._device: torch.device | None = None
        self._float_ws: torch.Tensor | None = None
        self._int_ws: torch.Tensor | None = None
        self._eager: dict[str, object] = {}  # "decode" / "prefill" wrappers
        self._graph: _GraphSpec | None = None
        # (bucket, tokens per sequence) -> (wrapper, its mask byte-offset buffer)
        self._graph_wrappers: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self._graph_mask: torch.Tensor | None = None  # packed custom masks of every graph (uint8)
        # Learned at the first layer call: q dtype, KV dtype, page size.
        self._dtypes: tuple[torch.dtype, torch.dtype] | None = None
        self._page_size: int | None = None
        self._pending: tuple | None = None  # a plan to make at the next layer call
        self._wrapper = None  # the planned wrapper `forward` runs
        self._slots: torch.Tensor | None = None
        self._plan_done: torch.cuda.Event | None = None

    # ---- eager forwards ------------------------------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = _cuda(batch.slot_mapping.device)
        has_tree = any(s.tree_rows is not None for s in batch.seqs)
        kind = "masked" if has_tree else ("decode" if batch.max_query_len == 1 else "causal")
        self._ensure_workspace(device, 0)
        self._slots = batch.slot_mapping
        self._pending = (kind, None, list(batch.seqs), 0, 1)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool
    ) -> torch.Tensor:
        # q: (N, nh, hd); k, v: (N, kvh, hd)
        k_cache, v_cache = kv_pool.paged(layer)  # (num_blocks, block_size, kvh, hd): FlashInfer's NHD pages
        if self._pending is not None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("flashinfer: a plan is pending inside CUDA graph capture (plan must run before)")
            self._dtypes, self._page_size = (q.dtype, k_cache.dtype), k_cache.shape[1]
            pending, self._pending = self._pending, None
            with torch.cuda.device(q.device):  # FlashInfer's plan works on the current device
                self._plan(*pending)
        store_kv(k, v, k_cache, v_cache, self._slots)
        if q.device.index == torch.cuda.current_device():
            out = self._wrapper.run(q, (k_cache, v_cache))  # (N, nh, hd)
        else:  # FlashInfer launches on the current device (a draft service on another GPU)
            with torch.cuda.device(q.device):
                out = self._wrapper.run(q, (k_cache, v_cache))
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    # ---- CUDA graph support --------------------------------------------------------------------------------------
    def init_graph_buffers(
        self, max_bs: int, max_query_len: int, max_blocks: int, device: torch.device, mask_width: int | None = None
    ) -> None:
        """Remember the graph shapes; the wrappers and their shared index buffers are made at the first graph plan
        (sizes need the page size). mask_width: tree tails wider than the query (a draft's tree steps)."""
        self._graph = _GraphSpec(max_bs, max_query_len, max_blocks, max(max_query_len, mask_width or 0),
                                 _cuda(device))
        self._graph_wrappers = {}
        self._graph_mask = None
        props = torch.cuda.get_device_properties(self._graph.device)
        need = split_kv_workspace_bytes(self.num_heads, self.num_kv_heads, self.head_dim, props.multi_processor_count,
                                        max_bs, max_bs * max_query_len, graph=True)
        self._ensure_workspace(self._graph.device, need)

    def graph_max_blocks(self) -> int:
        return self._graph.max_blocks

    def load_graph_metadata(
        self, batch: ForwardBatch | None, num_seqs: int, query_len: int, slot_mapping: torch.Tensor
    ) -> None:
        """Plan the (num_seqs, query_len) graph's wrapper for `batch` (its sequences, then padding ones), or for
        padding only when batch is None (capture). Runs outside capture and replay, as FlashInfer requires."""
        seqs = list(batch.seqs) if batch is not None else []
        masked = query_len > 1 or self._graph.mask_width > 1
        self._slots = slot_mapping
        pending = ("graph-masked" if masked else "graph-decode", (num_seqs, query_len), seqs, num_seqs - len(seqs),
                   query_len)
        if self._dtypes is None:  # first capture before any forward: plan at the warm-up's first layer call
            if batch is not None:
                raise RuntimeError("flashinfer: a graph replay before its capture")
            self._pending = pending
            return
        self._pending = None
        with torch.cuda.device(self._device):
            self._plan(*pending)

    # ---- planning ------------------------------------------------------------------------------------------------
    def _plan(self, kind: str, key: tuple[int, int] | None, seqs: list[SeqAttention], num_pad: int,
              pad_query_len: int) -> None:
        device = self._device
        masked = kind in ("masked", "graph-masked")
        tables = page_tables(seqs, self._page_size, masked, num_pad, pad_query_len)
        wrapper = self._eager_wrapper(kind) if key is None else self._graph_wrapper(kind, key)
        q_dtype, kv_dtype = self._dtypes
        common = dict(q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=self.scale, non_blocking=True)
        # plan() copies the previous plan's schedule from a pinned host buffer asynchronously: wait until that copy
        # ran before overwriting the buffer (in practice the GPU is there already).
        if self._plan_done is not None:
            self._plan_done.synchronize()
        indices = _to_device(tables.indices, device)  # on the device: plan copies it without a host sync
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, self._page_size)
        if kind in ("decode", "graph-decode"):
            wrapper.plan(_pinned(tables.kv_indptr), indices, _pinned(tables.last_page_len), *heads, **common)
        else:
            mask = pack_mask(tables, device) if masked else None
            wrapper.plan(_pinned(tables.qo_indptr), _pinned(tables.kv_indptr), indices, _pinned(tables.last_page_len),
                         *heads, packed_custom_mask=mask, causal=not masked, **common)
            if masked:  # FlashInfer 0.5.3 wrote bit offsets; the kernel reads byte offsets (module docstring)
                if key is None:
                    if not hasattr(wrapper, "_mask_indptr_buf"):
                        raise RuntimeError("unsupported FlashInfer version: no mask-indptr buffer to correct")
                    wrapper._mask_indptr_buf = _to_device(tables.mask_indptr, device)
                else:
                    self._graph_wrappers[key][1].copy_(_pinned(tables.mask_indptr), non_blocking=True)
        self._plan_done = torch.cuda.Event()
        self._plan_done.record(torch.cuda.current_stream(device))
        self._wrapper = wrapper

    def _ensure_workspace(self, device: torch.device, need: int) -> None:
        """One float and one int workspace shared by every wrapper (each forward plans its own before running);
        grown (with fresh eager wrappers) when a graph shape needs more split-KV scratch."""
        if self._device is not None and self._device != device:
            raise RuntimeError(f"flashinfer backend is bound to {self._device}, got a batch on {device}")
        self._device = device
        if self._float_ws is not None and self._float_ws.numel() >= need:
            return
        props = torch.cuda.get_device_properties(device)
        need = max(need, _MIN_WORKSPACE_BYTES, split_kv_workspace_bytes(
            self.num_heads, self.num_kv_heads, self.head_dim, props.multi_processor_count, 1, 1, graph=False))
        self._float_ws = torch.zeros(need, dtype=torch.uint8, device=device)
        if self._int_ws is None:
            self._int_ws = torch.zeros(_INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager = {}
        logger.info("flashinfer: %.0f MiB float workspace", need / (1 << 20))

    def _eager_wrapper(self, kind: str):
        """The eager decode or prefill wrapper; both share one int workspace (each forward plans before it runs)."""
        name = "decode" if kind == "decode" else "prefill"
        if name not in self._eager:
            if name == "decode":
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._float_ws, "NHD", use_tensor_cores=True)
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._float_ws, "NHD", backend="fa2")
            wrapper.reset_workspace_buffer(self._float_ws, self._int_ws)
            self._eager[name] = wrapper
        return self._eager[name]

    def _graph_wrapper(self, kind: str, key: tuple[int, int]):
        """The CUDA-graph wrapper of one (bucket, tokens per sequence): its own index buffers and int workspace, so
        that replaying a graph without re-planning it (benchmarks do) still reads a consistent schedule."""
        if key in self._graph_wrappers:
            return self._graph_wrappers[key][0]
        spec, (bs, _) = self._graph, key
        if self._graph_mask is None:
            # Every sequence's (T, kv_len) bits at most; padding sequences' (T, 1). Shared: masks only hold bits.
            max_kv = spec.max_blocks * self._page_size
            mask_bytes = spec.max_bs * -(-spec.max_query_len * max_kv // 8)
            self._graph_mask = torch.zeros(mask_bytes, dtype=torch.uint8, device=spec.device)
            logger.info("flashinfer graphs: %.1f MiB custom-mask buffer", mask_bytes / (1 << 20))
        i32 = dict(dtype=torch.int32, device=spec.device)
        indptr, last = torch.zeros(bs + 1, **i32), torch.zeros(bs, **i32)
        indices, mask_indptr = torch.zeros(bs * spec.max_blocks, **i32), torch.zeros(bs + 1, **i32)
        if kind == "graph-decode":
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._float_ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._float_ws, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(bs + 1, **i32),
                paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last,
                custom_mask_buf=self._graph_mask, mask_indptr_buf=mask_indptr, backend="fa2")
        self._graph_wrappers[key] = (wrapper, mask_indptr)
        return wrapper


def _cuda(device: torch.device | str) -> torch.device:
    """The device with its index ("cuda" -> "cuda:<current>"), so that devices compare equal."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(f"the flashinfer attention backend needs a CUDA device, got {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":  # host-side checks of the metadata (tests)
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)
    # Pinned source + non_blocking: queued on the stream, no host wait.
    return _pinned(array).to(device, non_blocking=True)
