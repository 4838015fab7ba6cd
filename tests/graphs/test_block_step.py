"""The static DFLASH step (runtime/speculative/block_step.py: a Propose's block forward as static device code over
the paged context KV, one CUDA graph per batch bucket on a GPU) drafts exactly the chains of the eager proposer (dense
context gather + SDPA) and of a dense recomputation, batch 1 and 5 (padded into a bucket) and with a draft window (the
ring of its last W positions), one readback per Propose, a step's new context rows injected inside it (a prompt's
eagerly before), its scratch slots given back. On CPU the step's device code runs eagerly, its Triton kernels
through the interpreter."""
from __future__ import annotations

import pytest
import torch

from core.steps import ProposeInput, SpecShape
from core.types import SeqStatus as Status
from draft_service.dflash import DFlashProposer
from runtime.config import EngineConfig
from runtime.models.dflash import load_dflash_draft
from tests.graphs.test_draft_step import ReadbackCounter
from tests.test_dflash import dense_drafts, hf_features, pair  # noqa: F401 - pair: the tiny target + DFlash draft

ENGINE = EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096, block_size=4)
SPEC = SpecShape(1, 1, 4)


@pytest.mark.parametrize("batch,window", [(1, None), (5, None), (3, 6)], ids=["b1", "b5", "b3-window-6"])
def test_static_block_step_drafts_the_eager_chains(pair, batch, window, monkeypatch):
    target, draft, hf = pair
    static = DFlashProposer(target, draft, ENGINE, window_size=window)
    assert static.enable_static_step(SPEC, max_bs=8)
    eager = DFlashProposer(target, draft, ENGINE, window_size=window)
    model = load_dflash_draft(draft, target, ENGINE)
    gen = torch.Generator().manual_seed(batch)
    seqs = {f"s{i}": torch.randint(3, 320, (30 + 3 * i,), generator=gen).tolist() for i in range(batch)}
    feats = {s: hf_features(hf, toks, [0, 2]) for s, toks in seqs.items()}
    committed = {s: 6 + i for i, s in enumerate(seqs)}
    for p in (static, eager):
        for s, toks in seqs.items():
            assert p.prefill(s, toks[:committed[s]], feats[s][:committed[s] - 1]) == Status.OK
    synced = dict(committed)
    eager_rows, inject = [], static._inject

    def counted(seq_ids):  # rows injected eagerly (a prompt's); a step's few rows go inside the static step
        eager_rows.append(sum(static._ctx[s].pending.shape[0] for s in seq_ids if static._ctx[s].pending is not None))
        return inject(seq_ids)

    static._inject = counted
    for step in range(6):
        inputs = [ProposeInput(s, committed[s], seqs[s][synced[s]:committed[s]], SPEC,
                               features=feats[s][synced[s] - 1:committed[s] - 1]) for s in seqs]
        counter = ReadbackCounter(monkeypatch)
        got = static.propose(inputs)
        reads = counter.count
        monkeypatch.undo()
        want = eager.propose(inputs)
        for s, g, w in zip(seqs, got, want):
            assert g.status == w.status == Status.OK
            assert g.tree.token_ids == w.tree.token_ids == dense_drafts(model, seqs[s][:committed[s]], feats[s], 4,
                                                                        window)
            if window is not None:  # the ring: the draft KV never outgrows the window
                assert static.kv_slots_held(s) <= -(-window // ENGINE.block_size) * ENGINE.block_size
        assert reads == 1, reads  # the chains of the whole batch in one readback
        synced = dict(committed)
        committed = {s: min(len(seqs[s]), c + 1 + (step + i) % 3) for i, (s, c) in enumerate(committed.items())}
    assert static._block_step.num_replays == 6
    assert eager_rows[0] > 0 and not any(eager_rows[1:]), eager_rows  # after the prompt: injected in the step
    assert static.memory() == eager.memory()  # the block's scratch slots were given back
    assert static.release(list(seqs)) == batch and static.memory()[0] == static.memory()[1]


def test_other_block_sizes_keep_the_eager_path(pair):
    target, draft, _ = pair
    assert not DFlashProposer(target, draft, ENGINE).enable_static_step(SpecShape(1, 1, 8), max_bs=4)


def test_the_served_dflash_shape_drafts_through_the_static_step_on_a_gpu(pair):
    """tandem/services._static_step enables it for the served block (a DFLASH proposer has no draft runner: its own
    device decides)."""
    from types import SimpleNamespace

    from tandem.cli import build_parser
    from tandem.services import _static_step

    _, draft, _ = pair
    enabled = []
    proposer = SimpleNamespace(runner=None, device=torch.device("cuda"),
                               enable_static_step=lambda shape, max_bs: enabled.append(shape) or True)
    args = build_parser().parse_args(["draft", "--speculative-algorithm", "DFLASH", "--speculative-num-steps", "1",
                                      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                                      "--speculative-draft-model-path", str(draft)])
    _static_step(proposer, args)
    assert enabled == [SpecShape(1, 1, 4)]
    enabled.clear()
    _static_step(SimpleNamespace(**{**vars(proposer), "device": torch.device("cpu")}), args)
    assert enabled == []  # CPU: the eager path
