"""The `flashinfer` attention backend on a CPU box: a clear error through the registry and the ModelRunner (no
package / no CUDA), and its host-side metadata — FlashInfer's page tables and packed custom masks — checked against
the torch backend's masks and KV slots on every ForwardBatch the real ModelRunner builds (prefill, decode, verify
trees, a tree region grown over several forwards, compaction). The kernels themselves run in
tests/gpu/test_flashinfer_backend_gpu.py. Also: --speculative-draft-attention-backend reaches the draft runner."""

from __future__ import annotations

import importlib
import random
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from runtime.attention import _REGISTRY, get_backend
from runtime.attention.torch_backend import _dense_mask
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward

_MODULE = "runtime.attention.flashinfer_backend"


def _flashinfer_usable() -> bool:
    try:
        importlib.import_module("flashinfer")
    except Exception:
        return False
    return torch.cuda.is_available()


needs_no_flashinfer = pytest.mark.skipif(_flashinfer_usable(), reason="flashinfer is usable on this machine")


def test_flashinfer_is_registered_lazily():
    code = ("import sys, runtime.attention, runtime.model_runner; "
            "assert 'flashinfer' not in sys.modules and 'runtime.attention.flashinfer_backend' not in sys.modules; "
            "from runtime.attention import _LAZY; assert 'flashinfer' in _LAZY")
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_no_flashinfer
def test_registry_names_the_package_without_flashinfer_or_cuda():
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        get_backend("flashinfer")
    assert "flashinfer" not in _REGISTRY


@needs_no_flashinfer
def test_model_runner_refuses_flashinfer_clearly(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ImportError, match="flashinfer"):
        ModelRunner(path, EngineConfig(device="cpu", max_total_tokens=256, attention_backend="flashinfer"))


@pytest.fixture
def fi_module(monkeypatch):
    """The backend module imported with stand-ins for the GPU-only imports (flashinfer, the Triton store kernel):
    only its host-side metadata code is exercised. Unregistered and forgotten afterwards."""
    if _flashinfer_usable():
        yield importlib.import_module(_MODULE)
        return
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    store = types.ModuleType("tandem_kernels.store_kv")
    store.store_kv = None
    monkeypatch.setitem(sys.modules, "tandem_kernels.store_kv", store)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delitem(sys.modules, _MODULE, raising=False)
    module = importlib.import_module(_MODULE)
    try:
        yield module
    finally:
        sys.modules.pop(_MODULE, None)
        _REGISTRY.pop("flashinfer", None)


def test_no_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delitem(sys.modules, _MODULE, raising=False)
    try:
        with pytest.raises(ImportError, match="CUDA GPUs only.*pip install flashinfer-python"):
            importlib.import_module(_MODULE)
    finally:
        sys.modules.pop(_MODULE, None)
        _REGISTRY.pop("flashinfer", None)


def _check_tables(fi, batch, page_size: int, masked: bool | None = None) -> None:
    """FlashInfer's view of the batch (rows, pages, mask bits as its kernel addresses them) == the torch backend's."""
    if masked is None:
        masked = any(s.tree_rows is not None for s in batch.seqs)
    t = fi.page_tables(batch.seqs, page_size, masked)
    packed = fi.pack_mask(t, torch.device("cpu")).numpy() if masked else None
    for b, seq in enumerate(batch.seqs):
        assert (t.qo_indptr[b], t.qo_indptr[b + 1]) == (seq.query_start, seq.query_start + seq.query_len)
        pages = t.indices[t.kv_indptr[b]:t.kv_indptr[b + 1]].astype(np.int64)
        kv_len = (len(pages) - 1) * page_size + int(t.last_page_len[b])
        assert kv_len == seq.kv_len and 1 <= t.last_page_len[b] <= page_size
        j = np.arange(kv_len)
        np.testing.assert_array_equal(pages[j // page_size] * page_size + j % page_size, seq.kv_slots.numpy())
        want = _dense_mask(seq.query_len, seq.kv_len, seq.prefix_len, seq.tree_mask, torch.device("cpu")).numpy()
        if masked:  # bit (row * kv_len + col) of the sequence's bytes, little-endian: the kernel's addressing
            seg = packed[t.mask_indptr[b]:t.mask_indptr[b + 1]]
            assert seg.size == -(-seq.query_len * kv_len // 8)
            got = np.unpackbits(seg, bitorder="little")[:seq.query_len * kv_len].reshape(seq.query_len, kv_len)
        else:  # FlashInfer's causal rule (bottom-right aligned) must be the chain rule
            got = np.tri(seq.query_len, kv_len, kv_len - seq.query_len, dtype=bool)
        np.testing.assert_array_equal(got.astype(bool), want)


def test_page_tables_and_masks_match_torch_backend_on_runner_batches(fi_module, tiny_model):
    path, _ = tiny_model("llama")
    runner = ModelRunner(path, EngineConfig(device="cpu", block_size=4, max_total_tokens=1024,
                                            attention_backend="torch"))
    batches = []
    original = runner.attn_backend.init_forward_metadata

    def spy(batch):
        batches.append(batch)
        return original(batch)

    runner.attn_backend.init_forward_metadata = spy
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(3, 100) for _ in range(n)]  # noqa: E731
    for s in ("a", "b", "c"):
        runner.add_seq(s)
    runner.forward([SeqForward("a", tok(13)), SeqForward("b", tok(5)), SeqForward("c", tok(1))])  # prefill
    runner.forward([SeqForward(s, tok(1)) for s in ("a", "b", "c")])  # decode
    parents = [-1, -1, 0, 1, 3, 2, 4, 4, 0, 8, 9, 2, 11, 5, 13, 6]  # 16-node verify tree next to a decode
    runner.forward([SeqForward("a", tok(16), parents=parents, logits="all"), SeqForward("b", tok(1)),
                    SeqForward("c", tok(3), logits="none")])
    runner.compact("a", [1, 3, 4, 7])
    # A draft-style region over several forwards (tail wider than the query), beside a chain extend.
    for k, step in enumerate([[-1, -1, -1], [0, 0, 2], [3, 5, 5, 4]]):
        runner.forward([SeqForward("a", tok(len(step)), parents=step, logits="all"), SeqForward("b", tok(2 + k))])
    assert len(batches) == 6
    for batch in batches:
        _check_tables(fi_module, batch, page_size=4)


def test_packed_masks_on_random_trees_and_chains(fi_module):
    """Short kv lens (rows sharing bytes), prefix 0, trees, chains and decodes mixed in one masked plan."""
    from runtime.forward_batch import SeqAttention

    rng = random.Random(1)
    for trial in range(30):
        seqs, start = [], 0
        for _ in range(rng.randrange(1, 6)):
            kind = rng.choice(["tree", "chain", "decode"])
            t = 1 if kind == "decode" else rng.randrange(1, 20)
            prefix = rng.choice([0, 1, 3, 7, 8, 9, rng.randrange(0, 300)])
            tail = t + (rng.randrange(0, 12) if kind == "tree" else 0)
            kv_len = prefix + tail
            rows = None
            if kind == "tree":  # any ancestor-closed visibility works for the layout check; random bits do too
                rows = [rng.getrandbits(tail) | (1 << (tail - t + i)) for i in range(t)]
            table = list(range(-(-kv_len // 4)))
            seqs.append(SeqAttention(start, t, kv_len, prefix, table, 4, torch.device("cpu"), tree_rows=rows))
            start += t
        fb = types.SimpleNamespace(seqs=seqs)
        _check_tables(fi_module, fb, page_size=4, masked=True)


def test_graph_padding_sequences_see_one_key_of_page_zero(fi_module):
    t = fi_module.page_tables([], 16, masked=True, num_pad=3, pad_query_len=4)
    np.testing.assert_array_equal(t.qo_indptr, [0, 4, 8, 12])
    np.testing.assert_array_equal(t.kv_indptr, [0, 1, 2, 3])
    np.testing.assert_array_equal(t.indices, [0, 0, 0])
    np.testing.assert_array_equal(t.last_page_len, [1, 1, 1])
    np.testing.assert_array_equal(t.mask_indptr, [0, 1, 2, 3])
    packed = fi_module.pack_mask(t, torch.device("cpu")).numpy()
    np.testing.assert_array_equal(np.unpackbits(packed, bitorder="little").reshape(3, 8)[:, :4], 1)


def test_split_kv_scratch_bound_grows_with_graph_rows(fi_module):
    eager = fi_module.split_kv_workspace_bytes(32, 8, 128, 132, 1, 1, graph=False)
    small = fi_module.split_kv_workspace_bytes(32, 8, 128, 132, 1, 16, graph=True)
    big = fi_module.split_kv_workspace_bytes(32, 8, 128, 132, 64, 64 * 16, graph=True)
    assert eager <= small < big
    # (2 * 132 // 8) CTAs of 128 query rows x 32 heads x (128 + 1) floats: FlashInfer's eager split-KV scratch.
    assert eager == 33 * 128 * 32 * 129 * 4 + (1 << 20)


# ---- --speculative-draft-attention-backend ----------------------------------------------------------------------
def _draft_args(*flags: str):
    from tandem.cli import build_parser
    from tandem.args import resolve_spec

    args = build_parser().parse_args(["draft", "--speculative-algorithm", "STANDALONE", "--device", "cpu",
                                      "--max-total-tokens", "256", *flags])
    (args.speculative_algorithm, args.speculative_num_steps, args.speculative_eagle_topk,
     args.speculative_num_draft_tokens) = resolve_spec(args)
    return args


def test_draft_attention_backend_flag_reaches_the_draft_runner():
    from tandem.services import build_proposer

    args = _draft_args("--attention-backend", "auto", "--speculative-draft-attention-backend", "torch")
    assert args.speculative_draft_attention_backend == "torch"
    proposer, _ = build_proposer(args)
    assert proposer.runner.engine_config.attention_backend == "torch"
    assert type(proposer.runner.attn_backend).__name__ == "TorchAttentionBackend"
    # Unset: the draft runner takes --attention-backend.
    proposer, _ = build_proposer(_draft_args("--attention-backend", "torch"))
    assert proposer.runner.engine_config.attention_backend == "torch"


@needs_no_flashinfer
def test_draft_flashinfer_on_cpu_fails_clearly_through_the_service_path():
    from tandem.services import build_proposer

    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        build_proposer(_draft_args("--speculative-draft-attention-backend", "flashinfer"))


def test_serve_forwards_the_draft_attention_backend():
    from tandem.cli import build_parser
    from tandem.launch import _spec_flags

    args = build_parser().parse_args(["serve", "--speculative-algorithm", "STANDALONE",
                                      "--speculative-draft-attention-backend", "flashinfer"])
    flags = _spec_flags(args)
    assert flags[flags.index("--speculative-draft-attention-backend") + 1] == "flashinfer"
