"""Where the GPU time of one decode (or verify) step goes: kernel time grouped by kernel name, from torch.profiler
over eager steps and over CUDA-graph replays of the in-process ModelRunner (Llama-3.1-8B shapes on dummy weights,
or --tiny on CPU for a smoke run). Prints JSON and a markdown table, writes profile.json / profile.md to --out-dir.

Kernel durations are GPU time (CUPTI), so eager numbers are not inflated by launch gaps; the gap between the sum of
kernel time and the step's wall time is launch/host overhead, which graphs remove.

    python bench/profile_step.py --out-dir /tmp/prof                    # GPU, 8B shapes, bs 1
    python bench/profile_step.py --tiny --device cpu --steps 2          # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import model_config, sync  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.model_runner import ModelRunner, SeqForward  # noqa: E402


def kernel_family(name: str) -> str:
    """A short, stable label for a kernel name (templated cuBLAS/Triton names vary by shape)."""
    low = name.lower()
    for key, label in (("gemv", "gemm/gemv (cuBLAS)"), ("gemm", "gemm/gemv (cuBLAS)"), ("cutlass", "gemm/gemv (cuBLAS)"),
                       ("nvjet", "gemm/gemv (cuBLAS)"), ("splitk", "gemm/gemv (cuBLAS)")):
        if key in low:
            return label
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:80]


def profile(runner: ModelRunner, make_batch, steps: int, use_graph: bool) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner.use_cuda_graph = use_graph
    for _ in range(3):
        make_batch()
    sync(runner.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            make_batch()
        sync(runner.device)
        wall = time.perf_counter() - start
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for evt in prof.events():
        if evt.device_type.name != "CUDA" and runner.device.type == "cuda":
            continue
        if runner.device.type != "cuda" and not evt.name.startswith("aten::"):
            continue
        us = evt.device_time if runner.device.type == "cuda" else evt.cpu_time
        family = kernel_family(evt.name)
        by_name[family][0] += us
        by_name[family][1] += 1
        total += us
    rows = sorted(((k, v[0] / steps, v[1] / steps) for k, v in by_name.items()), key=lambda r: -r[1])
    return {"graphs": use_graph, "wall_ms_per_step": 1e3 * wall / steps, "kernel_ms_per_step": total / steps / 1e3,
            "kernels": [{"name": k, "us_per_step": us, "launches_per_step": n} for k, us, n in rows]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--num-draft-tokens", type=int, default=16, help="> 0: also profile a verify of this many tree tokens")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out-dir", default="bench/results/profile")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = model_config(args.tiny)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    ndt = args.num_draft_tokens
    backend = args.attention_backend or ("triton" if device.type == "cuda" else "torch")
    ctx = args.prompt_len + max(ndt, 1) + 16
    runner = ModelRunner(None, EngineConfig(
        device=str(device), dtype=dtype, load_format="dummy", attention_backend=backend,
        num_kv_blocks=args.batch_size * (-(-ctx // 16) + 1), cuda_graph_max_bs=args.batch_size,
        cuda_graph_num_draft_tokens=ndt or None), cfg)
    seqs = [f"s{i}" for i in range(args.batch_size)]
    for s in seqs:
        runner.add_seq(s)
        runner.forward([SeqForward(s, [1 + (7 * i) % (cfg.vocab_size - 1) for i in range(args.prompt_len)])])
    results = {"model": "tiny-llama" if args.tiny else "Llama-3.1-8B", "batch_size": args.batch_size,
               "attention_backend": backend, "runs": []}
    for tokens in ([1, ndt] if ndt else [1]):  # a decode step, then (with --num-draft-tokens) a verify step
        parents = [-1] + [j // 2 for j in range(tokens - 1)]

        def one_step() -> None:
            if tokens > 1:
                out = runner.forward([SeqForward(s, [5] * tokens, parents=parents, logits="all") for s in seqs])
            else:
                out = runner.forward([SeqForward(s, [5]) for s in seqs])
            torch.stack([row[-1] for row in out.logits]).argmax(-1).tolist()
            for s in seqs:
                runner.truncate(s, args.prompt_len)

        for use_graph in ([False, True] if runner.graph_runner is not None else [False]):
            results["runs"].append({"tokens_per_seq": tokens, **profile(runner, one_step, args.steps, use_graph)})
    lines = []
    for run in results["runs"]:
        kind = "decode" if run["tokens_per_seq"] == 1 else f"verify of {run['tokens_per_seq']} tree tokens"
        lines += [f"### {kind}, {'graphs' if run['graphs'] else 'eager'}, batch {args.batch_size}: wall {run['wall_ms_per_step']:.3f} ms/step, "
                  f"kernel time {run['kernel_ms_per_step']:.3f} ms/step", "",
                  "| kernel | µs/step | launches/step | share |", "|---|---|---|---|"]
        for k in run["kernels"][:args.top]:
            share = k["us_per_step"] / 1e3 / max(run["kernel_ms_per_step"], 1e-9)
            lines.append(f"| `{k['name']}` | {k['us_per_step']:.1f} | {k['launches_per_step']:.0f} | {share:.1%} |")
        lines.append("")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(results, indent=1))
    (out / "profile.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
