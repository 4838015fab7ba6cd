"""runtime/pinned.py on a GPU: copies through a small arena wrap around many times without a piece being rewritten
while its DMA may still read it (each copy queued behind a long kernel), one larger than the arena, two streams."""

from __future__ import annotations

import numpy as np
import torch

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()

from runtime.pinned import PinnedArena  # noqa: E402


def test_arena_wraps_without_corrupting_queued_copies(device):
    arena = PinnedArena(device, nbytes=4096)
    rng = np.random.default_rng(0)
    sources, outs = [], []
    busy = torch.randn(4096, 4096, device=device)
    for i in range(400):  # ~25 KB through a 4 KB arena
        if i % 50 == 0:
            busy = busy @ busy  # keep the stream busy so the copies queue behind it
            busy /= busy.norm()
        src = rng.integers(-1000, 1000, size=(int(rng.integers(1, 16)),), dtype=np.int64)
        outs.append(arena.to_device(src))
        sources.append(src)
    big = rng.standard_normal((3000,)).astype(np.float32)  # 12 KB: larger than the arena
    out_big = torch.empty(3000, device=device)
    arena.copy(out_big, big)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        out_side = arena.to_device(np.arange(7))
    side.synchronize()
    torch.cuda.synchronize(device)
    for src, out in zip(sources, outs):
        assert np.array_equal(out.cpu().numpy(), src)
    assert np.array_equal(out_big.cpu().numpy(), big) and out_side.tolist() == list(range(7))
