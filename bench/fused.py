"""Per-kernel GPU time of the fused elementwise kernels (tandem_kernels/norm.py, rope.py, activation.py) against the torch
path of runtime/models/llama.py, at Llama-3.1-8B shapes (hidden 4096, 32/8 heads, head_dim 128, MLP 14336, bf16).

Each op runs `--reps` times inside one captured CUDA graph (as in the decode replay, so launch gaps count but host
work does not); the graph is replayed `--replays` times and the time per op call is reported. "layer" is one
decoder layer's elementwise work in model order (add + input norm, RoPE, add + post-attention norm, SiLU-mul);
"x32 layers" scales it to the 8B stack. Writes results.json and results.md under --out-dir.

    python bench/fused.py --out-dir $OUT/fused
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tandem_kernels.activation import silu_and_mul  # noqa: E402
from tandem_kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from tandem_kernels.rope import rotary  # noqa: E402
from runtime.config import ModelConfig  # noqa: E402
from runtime.models.llama import RotaryEmbedding, _rotate_half  # noqa: E402

H, NH, KVH, HD, INTER, EPS = 4096, 32, 8, 128, 14336, 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def torch_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch path of llama.RMSNorm.forward."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return w * x32.to(x.dtype)


def make_ops(bs: int) -> dict[str, dict[str, object]]:
    dev, dt = "cuda", torch.bfloat16
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=H, num_layers=1, num_heads=NH,
                      num_kv_heads=KVH, head_dim=HD, intermediate_size=INTER, rms_norm_eps=EPS,
                      max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    cos, sin = RotaryEmbedding(cfg).cos_sin(torch.randint(0, 8192, (bs,), device=dev), dt)
    h = torch.randn(bs, H, device=dev, dtype=dt)
    delta = torch.randn(bs, H, device=dev, dtype=dt)
    w = torch.randn(H, device=dev, dtype=dt)
    qkv = torch.randn(bs, (NH + 2 * KVH) * HD, device=dev, dtype=dt)
    q = qkv[:, :NH * HD].view(bs, NH, HD)
    k = qkv[:, NH * HD:(NH + KVH) * HD].view(bs, KVH, HD)
    gate_up = torch.randn(bs, 2 * INTER, device=dev, dtype=dt)

    def t_rope():
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def t_silu():
        gate, up = gate_up.split(INTER, dim=-1)
        return F.silu(gate) * up

    def t_layer():
        s = h + delta
        torch_norm(s, w)
        t_rope()
        torch_norm(s + delta, w)
        t_silu()

    def f_layer():
        # In place into delta, as the model adds into the sublayer's fresh output (delta only grows: no overflow
        # in bf16 over the timed calls).
        fused_add_rms_norm(delta, h, w, EPS)
        rotary(q, k, cos, sin)
        fused_add_rms_norm(delta, h, w, EPS)
        silu_and_mul(gate_up)

    return {
        "rms_norm": {"torch": lambda: torch_norm(h, w), "fused": lambda: rms_norm(h, w, EPS)},
        "add+rms_norm": {"torch": lambda: torch_norm(h + delta, w),
                         "fused": lambda: fused_add_rms_norm(delta, h, w, EPS)},
        "rope q+k": {"torch": t_rope, "fused": lambda: rotary(q, k, cos, sin)},
        "silu_and_mul": {"torch": t_silu, "fused": lambda: silu_and_mul(gate_up)},
        "layer": {"torch": t_layer, "fused": f_layer},
    }


def time_op(fn, reps: int, replays: int) -> float:
    """Microseconds per call of fn, replayed from a CUDA graph holding reps calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile (Triton) and pick kernels outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (replays * reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--reps", type=int, default=64, help="op calls per captured graph")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out-dir", default="bench/results/fused")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fused.py needs a CUDA GPU")
    rows = []
    with torch.inference_mode():
        for bs in args.batch_sizes:
            for name, fns in make_ops(bs).items():
                us = {path: time_op(fn, args.reps, args.replays) for path, fn in fns.items()}
                rows.append({"batch": bs, "op": name, "torch_us": us["torch"], "fused_us": us["fused"]})
                print(json.dumps(rows[-1]), flush=True)
    lines = ["| batch | op | torch µs | fused µs | speedup |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['op']} | {r['torch_us']:.2f} | {r['fused_us']:.2f} | "
                     f"{r['torch_us'] / r['fused_us']:.2f}x |")
        if r["op"] == "layer":
            lines.append(f"| {r['batch']} | x32 layers | {32 * r['torch_us']:.1f} | {32 * r['fused_us']:.1f} | "
                         f"saves {32 * (r['torch_us'] - r['fused_us']) / 1000:.3f} ms/step |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    (out / "results.md").write_text(f"# bench/fused.py on {torch.cuda.get_device_name()}\n\n{table}\n")


if __name__ == "__main__":
    main()
