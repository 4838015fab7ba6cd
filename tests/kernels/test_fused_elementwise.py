"""rms_norm, fused_add_rms_norm, rms_norm_pair, rotary and silu_and_mul (Triton) against their torch references: odd widths, strided
head views of a fused qkv output, per-token and table-indexed cos/sin at large positions, fp32 and half dtypes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem_kernels.activation import silu_and_mul, silu_and_mul_ref
from tandem_kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_pair, rms_norm_ref
from tandem_kernels.rope import rotary, rotary_ref
from runtime.config import ModelConfig
from runtime.models.llama import RotaryEmbedding

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    # fp32: only the reduction order differs. Half types: the interpreter rounds fp32 -> half its own way, so a value
    # may land one ulp away from torch's.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


def _randn(*shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 96), (5, 100), (3, 64), (7, 33)])
def test_rms_norm_matches_ref(dtype, rows, dim, device):
    x = _randn(rows, dim, dtype=dtype, device=device, seed=dim, scale=3.0)
    w = _randn(dim, dtype=dtype, device=device, seed=dim + 1)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6), **_tol(dtype))


def test_rms_norm_promotes_like_torch_and_reads_strided_head_views(device):
    # Qwen3's q/k norm: per-head norm over a (N, heads, hd) view of the fused qkv output (row stride = qkv width).
    n, heads, hd = 4, 3, 32
    qkv = _randn(n, heads * hd + 40, dtype=torch.float32, device=device, seed=3)
    q = qkv[:, :heads * hd].view(n, heads, hd)
    w = _randn(hd, dtype=torch.float32, device=device, seed=4)
    torch.testing.assert_close(rms_norm(q, w, 1e-5), rms_norm_ref(q, w, 1e-5), atol=1e-5, rtol=1e-5)
    # An fp32 weight over a bf16 input gives fp32, as `weight * x32.to(dtype)` does.
    xb = _randn(3, 64, dtype=torch.bfloat16, device=device, seed=5)
    wf = _randn(64, dtype=torch.float32, device=device, seed=6)
    got = rms_norm(xb, wf, 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_ref(xb, wf, 1e-6), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 96), (6, 100), (2, 128)])
def test_fused_add_rms_norm_matches_ref(dtype, rows, dim, device):
    x = _randn(rows, dim, dtype=dtype, device=device, seed=dim)
    res = _randn(rows, dim, dtype=dtype, device=device, seed=dim + 7, scale=4.0)
    w = _randn(dim, dtype=dtype, device=device, seed=dim + 8)
    res_before = res.clone()
    x_ref = x.clone()
    want_out, want_stream = fused_add_rms_norm_ref(x_ref, res.clone(), w, 1e-5)
    got_out, got_stream = fused_add_rms_norm(x, res, w, 1e-5)
    assert got_stream is x, "the new residual stream lives in x"
    assert torch.equal(res, res_before), "the caller's residual tensor is left untouched"
    torch.testing.assert_close(got_stream, want_stream, **_tol(dtype))
    torch.testing.assert_close(got_out, want_out, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 96), (6, 100), (3, 64)])
def test_rms_norm_pair_is_two_norms_and_a_cat(dtype, rows, dim, device):
    # EAGLE-3's decoder input: cat(input_layernorm(embedding), hidden_norm(feature)); the feature a strided view
    a = _randn(rows, dim, dtype=dtype, device=device, seed=dim, scale=3.0)
    wide = _randn(rows, dim + 24, dtype=dtype, device=device, seed=dim + 1)
    b = wide[:, 8:8 + dim]
    wa = _randn(dim, dtype=dtype, device=device, seed=dim + 2)
    wb = _randn(dim, dtype=dtype, device=device, seed=dim + 3)
    got = rms_norm_pair(a, wa, b, wb, 1e-6, 1e-5)
    assert got.shape == (rows, 2 * dim) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, torch.cat([rms_norm(a, wa, 1e-6), rms_norm(b, wb, 1e-5)], dim=-1)), \
        "the same rows as two rms_norm launches, bit for bit"
    torch.testing.assert_close(got, torch.cat([rms_norm_ref(a, wa, 1e-6), rms_norm_ref(b, wb, 1e-5)], dim=-1),
                               **_tol(dtype))


def test_rms_norm_pair_rejects_mismatched_inputs(device):
    a, w = torch.randn(4, 16, device=device), torch.ones(16, device=device)
    with pytest.raises(ValueError, match="one shape"):
        rms_norm_pair(a, w, torch.randn(3, 16, device=device), w, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="share a float dtype"):
        rms_norm_pair(a, w, a.double(), w, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="weight_b"):
        rms_norm_pair(a, w, a, torch.ones(8, device=device), 1e-6, 1e-6)
    assert rms_norm_pair(a[:0], w, a[:0], w, 1e-6, 1e-6).shape == (0, 32)


def test_norm_rejects_bad_layout(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(x.t(), torch.ones(4, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, x.half(), torch.ones(16, device=device), 1e-6)


def _qk(n, nh, kvh, hd, dtype, device, seed):
    """q and k as strided views of a fused qkv output, like the model hands them over."""
    qkv = _randn(n, (nh + 2 * kvh) * hd, dtype=dtype, device=device, seed=seed)
    q = qkv[:, :nh * hd].view(n, nh, hd)
    k = qkv[:, nh * hd:(nh + kvh) * hd].view(n, kvh, hd)
    return qkv, q, k


def _cos_sin(hd: int, positions: torch.Tensor, dtype: torch.dtype, rope_scaling=None):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=hd * 4, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=hd, intermediate_size=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rope_scaling=rope_scaling)
    return RotaryEmbedding(cfg).cos_sin(positions, dtype)  # (N, 1, hd) each, the model's layout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,kvh,hd", [(4, 2, 32), (5, 1, 64), (8, 8, 16)])
def test_rotary_matches_ref_per_token(dtype, nh, kvh, hd, device):
    positions = torch.tensor([0, 1, 7, 511, 4095, 100000, 131071], device=device)
    n = positions.shape[0]
    qkv, q, k = _qk(n, nh, kvh, hd, dtype, device, seed=hd + nh)
    cos, sin = _cos_sin(hd, positions.cpu(), dtype)
    cos, sin = cos.to(device), sin.to(device)
    want = qkv.clone()
    rotary_ref(want[:, :nh * hd].view(n, nh, hd), want[:, nh * hd:(nh + kvh) * hd].view(n, kvh, hd), cos, sin)
    v_before = qkv[:, (nh + kvh) * hd:].clone()
    rotary(q, k, cos, sin)
    torch.testing.assert_close(qkv, want, **_tol(dtype))
    assert torch.equal(qkv[:, (nh + kvh) * hd:], v_before), "v untouched"


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rotary_with_position_table_and_llama3_scaling(pos_dtype, device):
    nh, kvh, hd, n = 4, 2, 64, 6
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    table_len = 70000
    cos, sin = _cos_sin(hd, torch.arange(table_len), torch.float32, scaling)
    cos, sin = cos[:, 0].to(device), sin[:, 0].to(device)  # (table_len, hd)
    positions = torch.tensor([69999, 3, 0, 8191, 65536, 3], dtype=pos_dtype, device=device)
    qkv, q, k = _qk(n, nh, kvh, hd, torch.float32, device, seed=11)
    want = qkv.clone()
    rotary_ref(want[:, :nh * hd].view(n, nh, hd), want[:, nh * hd:(nh + kvh) * hd].view(n, kvh, hd), cos, sin,
               positions)
    rotary(q, k, cos, sin, positions)
    torch.testing.assert_close(qkv, want, atol=1e-5, rtol=1e-5)


def test_rotary_rejects_bad_input(device):
    q = torch.randn(3, 4, 32, device=device)
    k = torch.randn(3, 2, 32, device=device)
    cos = torch.randn(3, 32, device=device)
    with pytest.raises(ValueError, match="rows for 3 tokens"):
        rotary(q, k, cos[:2], cos[:2])
    with pytest.raises(ValueError, match="dtype"):
        rotary(q, k, cos.half(), cos.half())
    with pytest.raises(ValueError, match="positions"):
        rotary(q, k, cos, cos, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="does not match"):
        rotary(q, torch.randn(3, 2, 16, device=device), cos, cos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 96), (3, 100), (4, 1500)])
def test_silu_and_mul_matches_ref(dtype, rows, width, device):
    x = _randn(rows, 2 * width, dtype=dtype, device=device, seed=width, scale=3.0)
    got = silu_and_mul(x)
    assert got.shape == (rows, width) and got.dtype == dtype
    torch.testing.assert_close(got, silu_and_mul_ref(x), **_tol(dtype))


def test_fused_kernels_compile_for_sm90():
    # Ahead-of-time ttir -> ptx -> cubin for an H100/H200 without a GPU (see sm90_compile_fused.py); also checks the
    # rotary kernel keeps torch's per-product rounding (no fma contraction).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile_fused"], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.stdout.startswith("skip:"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}])
def test_rope_table_rows_are_the_computed_rows_bit_for_bit(dtype, scaling):
    """What a CUDA forward gathers from RotaryEmbedding's table (two kernels) equals what it computed per forward
    (six); positions past the table (a padding row's) are clamped into it, never out of bounds."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=256, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=64, intermediate_size=8, max_position_embeddings=4096,
                      rope_theta=500000.0, rope_scaling=scaling)
    rope = RotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 7, 2047, 4095, 4096 + rope.TABLE_MARGIN - 1, 3])
    with torch.inference_mode():
        got = rope.table_cos_sin(positions, dtype)
        want = rope.compute_cos_sin(positions, dtype)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert got[0].shape == (7, 1, 64) and got[0].dtype == dtype
        past = rope.table_cos_sin(torch.tensor([-1, 10 ** 6]), dtype)
        last = rope.compute_cos_sin(torch.tensor([0, rope.table_rows - 1]), dtype)
        assert all(torch.equal(p, w) for p, w in zip(past, last))
    assert not rope._tables[(torch.device("cpu"), dtype)].is_inference()  # usable outside inference mode too
