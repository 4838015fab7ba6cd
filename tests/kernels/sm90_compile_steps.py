"""Compile the speculative steps' own kernels (tandem_kernels/topk.py, tree.py, chain_glue.py and the packed walk of
verify_greedy.py) ahead of time for sm_90 at the shapes the steps launch them with (EAGLE3 5/4/16 and 8/8/60 trees,
a 2,048 and a 32,000 draft vocabulary); needs no GPU. Run as a script without TRITON_INTERPRET (see sm90_compile.py,
whose compiler this uses): the interpreter lets through what code generation refuses (a loop-carried value changing
type, a runtime loop bound it cannot read). Exits non-zero on the first kernel that fails."""

from __future__ import annotations

import sys


def _cases() -> list[tuple[str, object, dict[str, str], dict[str, object], int]]:
    """(name, kernel, arg types, constexprs, num_warps) as the launchers use them."""
    from tandem_kernels.chain_glue import _to_draft_features_kernel, _to_draft_kernel, _to_verify_kernel
    from tandem_kernels.topk import _logsoftmax_topk_kernel
    from tandem_kernels.tree import _beam_level_kernel, _region_mask_kernel, _select_tree_kernel
    from tandem_kernels.verify_greedy import _verify_greedy_kernel

    i64, i32 = "*i64", "i32"
    cases = []
    for dtype, vocab, k in (("fp32", 2048, 4), ("bf16", 2048, 8), ("fp32", 32000, 8)):
        block = min(4096, 1 << (vocab - 1).bit_length())
        cases.append((f"logsoftmax_topk[{dtype},V={vocab},k={k}]", _logsoftmax_topk_kernel,
                      {"x_ptr": f"*{dtype}", "val_ptr": "*fp32", "idx_ptr": i64, "stride_x": i32, "V": i32},
                      {"K": k, "BLOCK": block, "CHUNKS": -(-vocab // block)}, min(8, max(1, block // 256))))
    for width in (16, 60):
        block = 1 << (width - 1).bit_length()
        cases.append((f"region_mask[W={width}]", _region_mask_kernel,
                      {"par_ptr": i64, "mask_ptr": "*u8", "depth_ptr": i64, "W": i32}, {"BLOCK": block}, 1))
    for steps, k, ndt in ((5, 4, 16), (8, 8, 60)):
        num = k + (steps - 1) * k * k
        block = 1 << (num - 1).bit_length()
        cases.append((f"select_tree[{steps}/{k}/{ndt}]", _select_tree_kernel,
                      {"score_ptr": "*fp32", "tok_ptr": i64, "par_ptr": i64, "node_ptr": "*i32", "out_tok_ptr": i64,
                       "out_par_ptr": i64, "count_ptr": i64, "C": i32},
                      {"BUDGET": ndt - 1, "BLOCK": block}, 4 if block > 256 else 1))
        width = steps * k
        for first, forward, has_map in ((True, True, True), (False, True, False), (False, False, True)):
            types = {name: i64 for name in ("child_tok_ptr", "cand_tok_ptr", "cand_par_ptr", "beam_ptr", "tok_ptr",
                                            "rank_ptr", "in_ptr", "map_ptr", "ids_ptr", "slot_ptr", "pos_ptr")}
            types.update({"child_score_ptr": "*fp32", "cand_score_ptr": "*fp32", "anc_ptr": "*u8",
                          "kv_len_ptr": "*i32", **{name: i32 for name in ("C", "OFFSET", "LEVEL", "stride_in",
                          "live_col", "kv_col", "table_col", "max_blocks", "block_size")}})
            cases.append((f"beam_level[{steps}/{k},first={first},forward={forward},map={has_map}]",
                          _beam_level_kernel, types,
                          {"K": k, "KB": max(2, k), "KK": max(2, k * k), "WIDTH": width,
                           "WB": 1 << (width - 1).bit_length(), "FIRST": first, "FORWARD": forward,
                           "HAS_MAP": has_map}, 1 if k * max(k, width) <= 256 else 4))
    for pack in (False, True):
        cases.append((f"verify_tree_greedy[pack={pack}]", _verify_greedy_kernel,
                      {"candidates_ptr": i64, "parents_ptr": i64, "target_ptr": i64,
                       "accept_index_ptr": i64 if pack else "*i32", "emitted_ptr": i64 if pack else "*i32",
                       "accept_len_ptr": i64 if pack else "*i32", "slots_ptr": i64, "src_ptr": i64, "dst_ptr": i64,
                       "rows_ptr": i64, **{name: i32 for name in ("stride_c", "stride_p", "stride_t", "stride_a",
                                                                  "stride_e", "stride_l", "stride_s")}},
                      {"NUM_NODES": 16, "BLOCK": 16, "PACK": pack}, 4))
    glue_ints = {name: i32 for name in ("stride_state", "stride_in", "stride_pad", "table_col", "max_blocks",
                                        "block_size", "W")}
    cases.append(("chain_to_verify", _to_verify_kernel, {"state_ptr": i64, "in_ptr": i64, "pad_ptr": i64, **glue_ints},
                  {"BLOCK": 16}, 1))
    cases.append(("chain_to_draft", _to_draft_kernel,
                  {"head_ptr": i64, "state_ptr": i64, "rec_ptr": i64, "step_ptr": i64, "in_ptr": i64, "pad_ptr": i64,
                   **glue_ints, "B": i32, "S": i32, "Q": i32}, {"BLOCK_W": 16, "BLOCK_Q": 8}, 1))
    cases.append(("chain_to_draft_features", _to_draft_features_kernel,
                  {"head_ptr": i64, "feat_ptr": "*bf16", "out_ptr": "*bf16", "last_ptr": "*bf16", "B": i32, "W": i32,
                   "Q": i32, "F": i32}, {"BLOCK": 1024}, 4))
    return cases


def main() -> int:
    from tests.kernels.sm90_compile import compile_all

    return compile_all((name, kernel, types, constexprs, {"num_warps": warps})
                       for name, kernel, types, constexprs, warps in _cases())


if __name__ == "__main__":
    sys.exit(main())
