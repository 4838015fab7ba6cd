"""tandem_kernels/chain_glue.py against the torch glue it replaces inside the chained steps' CUDA graphs
(runtime/speculative/fused_step.FusedSteps.to_verify / to_draft): random chained states with live and finished rows,
missing tree nodes, verify outcomes of every accept length, and the EAGLE features; the kernels must leave every
buffer (the packed inputs of both steps, the state, the step records, the catch-up features) bit for bit as the
torch ops do."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from runtime.models import llama as llama_model
from runtime.speculative.fused_step import FusedSteps
from tests.kernels.paged import random_parents

BLOCK = 4


def _glue(device, width: int, catch_up: int, b: int, features: int, seed: int) -> FusedSteps:
    """A FusedSteps around fake steps holding only what the glue reads and writes: packed inputs with block tables,
    padding rows, the state of b sequences, the records and the feature buffers."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    m, q, max_blocks = width - 1, catch_up, 12
    verify = SimpleNamespace(inputs=torch.randint(-5, 99, (b, 4 * width + 1 + max_blocks), generator=gen),
                             table_col=4 * width + 1, block_size=BLOCK, width=width,
                             runner=SimpleNamespace(dtype=torch.float32), feature_dim=features)
    draft = SimpleNamespace(inputs=torch.randint(-5, 99, (b, 3 * q + 2 + max_blocks), generator=gen),
                            table_col=3 * q + 2, block_size=BLOCK, shape=SimpleNamespace(catch_up=q),
                            features=torch.randn(b * q, max(features, 1), generator=gen) if features else None)
    for step in (verify, draft):  # real block tables: distinct blocks
        step.inputs[:, step.table_col:] = torch.stack([torch.randperm(64, generator=gen)[:max_blocks]
                                                        for _ in range(b)])
    glue = FusedSteps.__new__(FusedSteps)
    glue.verify, glue.draft, glue.width, glue.features = verify, draft, width, bool(features)
    state = torch.zeros(b, 4 + 2 * m, dtype=torch.int64)
    for i in range(b):
        parents = random_parents(m, rng)
        tokens = [rng.randrange(3, 500) if rng.random() > 0.15 else -1 for _ in range(m)]  # some nodes missing
        start = rng.randrange(0, max_blocks * BLOCK - width - q)
        state[i] = torch.tensor([rng.randrange(3, 500), start, rng.randrange(0, start + 1), int(i % 3 != 1)]
                                + tokens + parents)
    glue.state = state
    glue.step_index = torch.tensor([1])
    glue.verify_pad = torch.randint(-3, 9, (b, verify.table_col), generator=gen)
    glue.draft_pad = torch.randint(-3, 9, (b, draft.table_col), generator=gen)
    glue.records = {b: torch.zeros(3, b, width + 1, dtype=torch.int64)}
    glue.last_features = {b: torch.zeros(b, max(features, 1))}
    return _to(glue, device)


def _to(glue: FusedSteps, device) -> FusedSteps:
    for obj in (glue, glue.verify, glue.draft):
        for name, value in vars(obj).items():
            if isinstance(value, torch.Tensor):
                setattr(obj, name, value.to(device))
    glue.records = {k: v.to(device) for k, v in glue.records.items()}
    glue.last_features = {k: v.to(device) for k, v in glue.last_features.items()}
    return glue


def _buffers(glue: FusedSteps) -> dict[str, torch.Tensor]:
    out = {"state": glue.state, "verify_inputs": glue.verify.inputs, "draft_inputs": glue.draft.inputs,
           "step_index": glue.step_index, **{f"records{k}": v for k, v in glue.records.items()}}
    if glue.features:
        out["features"] = glue.draft.features
        out.update({f"last{k}": v for k, v in glue.last_features.items()})
    return {k: v.cpu().clone() for k, v in out.items()}


def _verified(b: int, width: int, features: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The verify step's output bytes: int64 (b, 2W + 1) [emitted, path, count], then (b, W, F) features."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.full((b, 2 * width + 1), -1, dtype=torch.int64)
    for i in range(b):
        count = int(torch.randint(1, width + 1, (1,), generator=gen))
        head[i, :count] = torch.randint(3, 500, (count,), generator=gen)
        head[i, width:width + count] = torch.arange(count)
        head[i, 2 * width] = count
    parts = [head.view(torch.uint8).reshape(-1)]
    if features:
        parts.append(torch.randn(b, width, features, generator=gen).to(dtype).view(torch.uint8).reshape(-1))
    return torch.cat(parts)


@pytest.mark.parametrize("width,catch_up,b,features", [(6, 4, 5, 0), (10, 5, 3, 24), (4, 4, 1, 8), (16, 9, 7, 0)])
def test_glue_kernels_equal_the_torch_glue(width, catch_up, b, features, device, monkeypatch):
    used: list[str] = []
    real = llama_model._k
    monkeypatch.setattr("runtime.speculative.fused_step._k", lambda name: used.append(name) or real(name))
    results = []
    for fused in (False, True):
        glue = _glue(device, width, catch_up, b, features, seed=width * 7 + b)
        verified = _verified(b, width, features, seed=b).to(device)
        with llama_model.fused_elementwise(fused), torch.no_grad():
            glue.to_verify(b)
            after_verify = _buffers(glue)
            glue.to_draft(b, verified)
            after_draft = _buffers(glue)
            glue.to_verify(b)  # the next step from the advanced state
        results.append((after_verify, after_draft, _buffers(glue)))
    for torch_bufs, kernel_bufs in zip(*results):
        for name in torch_bufs:
            assert torch.equal(kernel_bufs[name], torch_bufs[name]), name
    assert used == ["chain_glue"] * 3  # the fused run took the kernels (and only it)
    assert not torch.equal(results[0][0]["state"], results[0][1]["state"])  # the state did advance


def test_a_full_record_buffer_is_left_alone(device):
    """Past the records' last row the kernel writes no record (torch's index_copy_ would fail on the device)."""
    glue = _glue(device, 6, 4, 2, 0, seed=1)
    glue.step_index.fill_(3)  # == the records' max_steps
    before = glue.records[2].clone()
    with llama_model.fused_elementwise(True), torch.no_grad():
        glue.to_draft(2, _verified(2, 6, 0, seed=2).to(device))
    assert torch.equal(glue.records[2], before) and int(glue.step_index) == 4
