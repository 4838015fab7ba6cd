"""Triton kernels for the GPU engine, each with a plain-torch `*_ref` twin that is its test oracle.

Modules import triton at load time; reach them lazily (the `triton` attention backend does) so `import runtime` works
on a box without triton. Kernels: store_kv, paged_attention (chain/tree over paged KV), decode_attention,
compact_kv, verify_tree_greedy; and the decoder's fused elementwise work (runtime/models/llama.py uses them on CUDA):
norm (rms_norm, fused_add_rms_norm), rope (rotary), activation (silu_and_mul).
"""
