"""tandem_kernels/topk.py (log-softmax + top-k of each row in one launch, the draft step's beam expansion) against
torch: values and indices over one and several row chunks, half dtypes, ties to the lower index, NaN and -inf rows,
leading dims, bad arguments."""

from __future__ import annotations

import pytest
import torch

from tandem_kernels import topk as topk_mod
from tandem_kernels.topk import logsoftmax_topk, logsoftmax_topk_ref


def _rows(rows: int, vocab: int, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 4).to(dtype).to(device)


@pytest.mark.parametrize("vocab,k", [(2048, 4), (320, 1), (10, 10), (5000, 8)])
def test_matches_torch_log_softmax_topk(vocab, k, device):
    x = _rows(3, vocab, torch.float32, device, vocab + k)
    values, indices = logsoftmax_topk(x, k)
    want_v, want_i = logsoftmax_topk_ref(x, k)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64
    assert torch.equal(indices, want_i)
    torch.testing.assert_close(values, want_v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits_rank_as_their_fp32_values(dtype, device):
    # bf16 logits tie often: compare the set of values and the stable order on the fp32 upcast
    x = _rows(4, 700, dtype, device, 7)
    values, indices = logsoftmax_topk(x, 6)
    lp = torch.log_softmax(x.float(), dim=-1)
    order = torch.sort(lp, dim=-1, descending=True, stable=True)
    assert torch.equal(indices, order.indices[:, :6])
    torch.testing.assert_close(values, order.values[:, :6], atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_lower_index_across_chunks(device, monkeypatch):
    monkeypatch.setattr(topk_mod, "BLOCK_MAX", 16)  # 3 chunks of 16 over 40 entries
    x = torch.zeros(1, 40, device=device)
    x[0, [3, 17, 35]] = 2.0
    x[0, [1, 20]] = 1.0
    values, indices = logsoftmax_topk(x, 6)
    assert indices.tolist() == [[3, 17, 35, 1, 20, 0]]
    assert values[0, 0] == values[0, 2] and values[0, 3] == values[0, 4] and values[0, 4] > values[0, 5]


def test_nan_and_infinite_rows(device):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, 5.0, -inf, 2.0, -inf],  # fewer finite entries than k: -inf ones fill, in index order
                      [nan, 1.0, 2.0, 3.0, 4.0],  # a NaN makes torch's whole row NaN: all -inf here
                      [-inf, -inf, -inf, -inf, -inf]], device=device)
    values, indices = logsoftmax_topk(x, 4)
    assert indices.tolist() == [[1, 3, 0, 2], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert torch.isfinite(values[0, :3]).all() and values[0, 3] == -inf
    assert (values[1:] == -inf).all()
    assert not torch.isnan(values).any()


def test_leading_dims_and_strided_rows(device):
    x = _rows(6, 64, torch.float32, device, 3).view(2, 3, 64)
    values, indices = logsoftmax_topk(x, 3)
    assert values.shape == indices.shape == (2, 3, 3)
    want_v, want_i = logsoftmax_topk_ref(x, 3)
    assert torch.equal(indices, want_i)
    wide = _rows(3, 80, torch.float32, device, 4)[:, :64]  # row stride 80
    assert torch.equal(logsoftmax_topk(wide, 2)[1], logsoftmax_topk_ref(wide, 2)[1])


def test_bad_arguments(device):
    with pytest.raises(ValueError):
        logsoftmax_topk(torch.zeros(2, 4, device=device), 5)  # k > vocab
    with pytest.raises(ValueError):
        logsoftmax_topk(torch.zeros(2, 4, dtype=torch.int64, device=device), 1)
    with pytest.raises(ValueError):
        logsoftmax_topk(torch.zeros(4, 2, device=device).t(), 1)  # not contiguous in the last dim
