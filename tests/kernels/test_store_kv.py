"""store_kv (Triton) against store_kv_ref: strided inputs, paged and flat caches, padding slots, dtype casts."""

from __future__ import annotations

import pytest
import torch

from tandem_kernels.store_kv import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kvh,hd,block_size", [(1, 16, 4), (2, 24, 8), (4, 32, 16)])
def test_store_kv_matches_ref(dtype, kvh, hd, block_size, device):
    num_blocks, num_tokens = 6, 9
    gen = torch.Generator().manual_seed(kvh * hd)
    # k and v as views of a fused projection: strided over tokens, like the model hands them over.
    fused = torch.randn(num_tokens, 3 * kvh * hd, generator=gen).to(dtype).to(device)
    k = fused[:, kvh * hd:2 * kvh * hd].view(num_tokens, kvh, hd)
    v = fused[:, 2 * kvh * hd:].view(num_tokens, kvh, hd)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    slots[3] = -1  # padding row
    caches = [torch.zeros(num_blocks, block_size, kvh, hd, dtype=dtype, device=device) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0)
    assert caches[0].abs().sum() > 0


def test_store_kv_accepts_flat_cache(device):
    k = torch.randn(3, 2, 16, device=device)
    v = torch.randn(3, 2, 16, device=device)
    slots = torch.tensor([5, 0, 2], dtype=torch.int32, device=device)
    k_cache = torch.zeros(8, 2, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[slots.long()], k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache[slots.long()], v, atol=0, rtol=0)
    assert k_cache[[1, 3, 4, 6, 7]].abs().sum() == 0


def test_store_kv_asserts_layout(device):
    k = torch.randn(3, 2, 16, device=device)
    cache = torch.zeros(8, 2, 16, device=device)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        strided_k = k.transpose(0, 2).contiguous().transpose(0, 2)
        store_kv(strided_k, k, cache, cache, torch.zeros(3, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, cache, cache, torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="cache dtype"):
        store_kv(k, k, cache.half(), cache.half(), torch.zeros(3, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="caches must be contiguous"):
        strided = torch.zeros(16, 2, 16, device=device)[::2]
        store_kv(k, k, strided, strided, torch.zeros(3, dtype=torch.long, device=device))
