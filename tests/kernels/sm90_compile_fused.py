"""Compile the fused elementwise kernels (tandem_kernels/norm.py, rope.py, activation.py) ahead of time for sm_90 at
Llama-3.1-8B shapes; needs no GPU. Run as a script without TRITON_INTERPRET (see sm90_compile.py, whose compiler this
uses); exits non-zero on the first kernel that fails, prints 'skip: ...' when this triton cannot target CUDA."""

from __future__ import annotations

import sys


def _cases() -> list[tuple[str, object, dict[str, str], dict[str, object], int, bool]]:
    """(name, kernel, arg types, constexprs, num_warps, enable_fp_fusion) as the launchers use them."""
    from tandem_kernels.activation import _silu_and_mul_kernel
    from tandem_kernels.norm import _rms_norm_kernel
    from tandem_kernels.rope import _rope_kernel

    cases = []
    for dtype in ("bf16", "fp32"):
        ptr = f"*{dtype}"
        for has_res in (False, True):
            types = {"x_ptr": ptr, "res_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "eps": "fp32", "inner": "i32",
                     "stride_xa": "i32", "stride_xb": "i32", "stride_ra": "i32", "stride_rb": "i32"}
            cases.append((f"rms_norm[{dtype},res={has_res}]", _rms_norm_kernel, types,
                          {"DIM": 4096, "BLOCK": 4096, "HAS_RES": has_res}, 8, True))
        cases.append((f"rms_norm[{dtype},q-norm]", _rms_norm_kernel,
                      {"x_ptr": ptr, "res_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "eps": "fp32", "inner": "i32",
                       "stride_xa": "i32", "stride_xb": "i32", "stride_ra": "i32", "stride_rb": "i32"},
                      {"DIM": 128, "BLOCK": 128, "HAS_RES": False}, 1, True))
        for has_pos in (False, True):
            types = {"q_ptr": ptr, "k_ptr": ptr, "cos_ptr": ptr, "sin_ptr": ptr, "pos_ptr": "*i64" if has_pos else ptr,
                     "stride_qt": "i32", "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32",
                     "stride_cos": "i32", "stride_sin": "i32", "num_q_heads": "i32", "num_k_heads": "i32",
                     "q_programs": "i32"}
            cases.append((f"rotary[{dtype},positions={has_pos}]", _rope_kernel, types,
                          {"HALF": 64, "HEADS": 4, "BLOCK_D": 64, "HAS_POS": has_pos}, 2, False))
        cases.append((f"silu_and_mul[{dtype}]", _silu_and_mul_kernel,
                      {"x_ptr": ptr, "out_ptr": ptr, "stride_x": "i32", "width": "i32"}, {"BLOCK": 1024}, 4, True))
    return cases


def main() -> int:
    from tests.kernels.sm90_compile import compile_all

    def no_bf16_fma(name, compiled):
        if name.startswith("rotary[bf16") and "fma.rn.bf16" in compiled.asm["ptx"]:
            return "contracted a product into an fma (torch rounds each product)"
        return None

    cases = ((name, kernel, types, constexprs, {"num_warps": warps, "enable_fp_fusion": fusion})
             for name, kernel, types, constexprs, warps, fusion in _cases())
    return compile_all(cases, no_bf16_fma)


if __name__ == "__main__":
    sys.exit(main())
