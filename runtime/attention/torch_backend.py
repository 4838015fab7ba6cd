"""Reference attention backend: per sequence, gather K/V from the paged pool, build the dense (causal or tree) mask
and call SDPA. Slow (a Python loop over sequences) but simple enough to be the oracle for faster backends; runs on
any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention import AttentionBackend, register_backend
from runtime.forward_batch import ForwardBatch
from runtime.kv_pool import KVPool


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._batch = batch
        # Masks depend only on the batch, not the layer: build once per forward.
        self._masks = [_dense_mask(s.query_len, s.kv_len, s.prefix_len, s.tree_mask, batch.slot_mapping.device)
                       for s in batch.seqs]

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool
    ) -> torch.Tensor:
        # q: (N, nh, hd); k, v: (N, kvh, hd)
        batch = self._batch
        kv_pool.write(layer, batch.slot_mapping, k, v)
        k_all, v_all = kv_pool.k(layer), kv_pool.v(layer)  # (slots, kvh, hd)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        for seq, mask in zip(batch.seqs, self._masks):
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            qs = q[rows].transpose(0, 1).unsqueeze(0)  # (1, nh, T, hd)
            ks = k_all[seq.kv_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)  # (1, kvh, kv_len, hd)
            vs = v_all[seq.kv_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)  # (1, kvh, kv_len, hd)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )  # (1, nh, T, hd)
            out[rows] = o[0].transpose(0, 1).reshape(seq.query_len, -1)
        return out


def _dense_mask(
    query_len: int, kv_len: int, prefix_len: int, tree_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """(T, kv_len) bool, True = may attend."""
    mask = torch.ones(query_len, kv_len, dtype=torch.bool, device=device)
    tail_len = kv_len - prefix_len
    if tree_mask is not None:
        mask[:, prefix_len:] = tree_mask.to(device)
    else:
        # Chain append: the T queries are the last T tail entries; query i sees the tail up to itself.
        rows = torch.arange(query_len, device=device).unsqueeze(1) + (tail_len - query_len)  # (T, 1)
        cols = torch.arange(tail_len, device=device).unsqueeze(0)  # (1, tail)
        mask[:, prefix_len:] = cols <= rows
    return mask
