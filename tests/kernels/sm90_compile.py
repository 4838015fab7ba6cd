"""Compile every kernel ahead of time for sm_90 (H100/H200) at Llama-3.1-8B shapes; needs no GPU. Run as a script
without TRITON_INTERPRET (the interpreter swaps triton's own jit functions, which breaks code generation); exits
non-zero on the first kernel that fails and prints 'skip: ...' when this triton cannot target CUDA."""

from __future__ import annotations

import sys


def _cases() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    from tandem_kernels.compact_kv import _compact_kv_kernel
    from tandem_kernels.paged_attention import _merge_splits_kernel, _paged_attention_kernel
    from tandem_kernels.store_kv import _store_kv_kernel
    from tandem_kernels.verify_greedy import _verify_greedy_kernel

    cases = []
    # fp32 is for tiny test models only; at 8B shapes its ptxas run alone takes ~15 s, so it is compiled small.
    for dtype, has_tree, block_m, head_dim, split in (("bf16", False, 16, 128, False), ("bf16", True, 64, 128, False),
                                                      ("bf16", False, 64, 128, False), ("fp32", True, 16, 32, False),
                                                      ("bf16", True, 16, 128, True), ("bf16", True, 64, 128, True)):
        ptr = f"*{dtype}"
        types = {"q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "out_ptr": ptr, "block_table_ptr": "*i32",
                 "query_start_ptr": "*i32", "kv_len_ptr": "*i32", "prefix_len_ptr": "*i32", "use_tree_ptr": "*u8",
                 "tree_mask_ptr": "*u8", "qk_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32",
                 "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32", "stride_mask": "i32", "mask_width": "i32",
                 "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "num_tokens": "i32", "num_splits": "i32"}
        constexprs = {"GROUP": 4, "NUM_KV_HEADS": 8, "HEAD_DIM": head_dim, "HEAD_DIM_P2": head_dim,
                      "PAGE_SIZE": 16, "BLOCK_M": block_m, "BLOCK_N": 64 if dtype == "bf16" else 32,
                      "HAS_TREE": has_tree, "DOT_FP32": dtype == "fp32", "SPLIT": split}
        cases.append((f"paged_attention[{dtype},tree={has_tree},block_m={block_m},split={split}]",
                      _paged_attention_kernel, types, constexprs))
    cases.append(("merge_splits", _merge_splits_kernel,
                  {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", "num_tokens": "i32",
                   "num_splits": "i32", "stride_ot": "i32", "stride_oh": "i32"},
                  {"NUM_HEADS": 32, "HEAD_DIM": 128, "HEAD_DIM_P2": 128, "BLOCK_S": 32}))
    cases.append(("store_kv", _store_kv_kernel,
                  {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
                   "slot_ptr": "*i64", "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32"},
                  {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK": 1024}))
    cases.append(("compact_kv", _compact_kv_kernel,
                  {"kv_ptr": "*bf16", "src_ptr": "*i32", "dst_ptr": "*i32", "num_moves": "i32", "plane_stride": "i64"},
                  {"SLOT_SIZE": 1024, "BLOCK_MOVES": 16, "BLOCK_D": 256}))
    cases.append(("verify_tree_greedy", _verify_greedy_kernel,
                  {"candidates_ptr": "*i64", "parents_ptr": "*i32", "target_ptr": "*i64", "accept_index_ptr": "*i32",
                   "emitted_ptr": "*i32", "accept_len_ptr": "*i32", "slots_ptr": "*i32", "src_ptr": "*i32",
                   "dst_ptr": "*i32", "rows_ptr": "*i32", "stride_c": "i32", "stride_p": "i32", "stride_t": "i32",
                   "stride_a": "i32", "stride_e": "i32", "stride_l": "i32", "stride_s": "i32"},
                  {"NUM_NODES": 65, "BLOCK": 128, "PACK": False}))
    return cases


def sm90_compiler():
    """`compile(kernel, types, constexprs, options=None)` targeting sm_90, or a 'skip: ...' reason string when this
    triton cannot compile for CUDA ahead of time. Shared with sm90_compile_fused.py."""
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        return "skip: this triton has no ahead-of-time compiler API"
    if "nvidia" not in triton.backends.backends:
        return "skip: triton's nvidia backend is not installed"

    def compile_sm90(kernel, types: dict[str, str], constexprs: dict[str, object], options: dict | None = None):
        signature = {**types, **{k: "constexpr" for k in constexprs}}
        return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)

    return compile_sm90


def compile_all(cases, check=None) -> int:
    """Compile (name, kernel, types, constexprs, options) cases for sm_90, printing 'name: ok' for each; 1 at the
    first failure or when check(name, compiled) returns a problem, 0 when all compile (or 'skip: ...' printed)."""
    compile_sm90 = sm90_compiler()
    if isinstance(compile_sm90, str):
        print(compile_sm90)
        return 0
    for name, kernel, types, constexprs, options in cases:
        compiled = compile_sm90(kernel, types, constexprs, options)
        problem = check(name, compiled) if check else None
        if problem:
            print(f"{name}: {problem}")
            return 1
        print(f"{name}: ok", flush=True)
    return 0


def main() -> int:
    def shared_memory(name, compiled):
        if compiled.metadata.shared > 227 * 1024:  # an H100/H200 SM's shared memory
            return f"needs {compiled.metadata.shared} bytes of shared memory"
        return None

    return compile_all(((*case, None) for case in _cases()), shared_memory)


if __name__ == "__main__":
    sys.exit(main())
