"""Where the time of one draft Propose goes, for the demo family's feature and model drafts (in-process engine loop of
tools/spec_eval, batch 1, greedy, held-out prompts): wall time per Propose and per Verify, torch ops dispatched per
Propose (each one a kernel launch or at least a dispatcher trip from Python), and on CUDA the kernels launched and
their GPU time per Propose (torch.profiler/CUPTI), so host overhead = wall - GPU time (#11's measure), and the
device's span per Propose (first kernel's start to last one's end: inside a CUDA graph the gaps between kernels are
the device's launch latency) with the wall outside that span (both of the profiled Propose, which the profiler slows:
an upper bound of what the host adds). Draft CUDA graphs on and off
side by side.

Why: on the H200 the EAGLE-3 tree draft of an 8 M demo model took 4-8 ms per Propose while its GPU work is well under
a millisecond, and the SYNTHETIC 8B-sized head 77-196 ms per step (bench/results/speculative_h200/NOTES.md). This
says whether the time is op count (launches), syncs, or kernels.

    python bench/profile_draft.py --device cuda --out-dir /tmp/prof_draft          # GPU (graphs on and off)
    python bench/profile_draft.py --device cpu --prompts 2 --new-tokens 24         # CPU smoke run: op counts
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from protos.profiler import device_intervals  # noqa: E402
from tandem.args import DEFAULT_MODEL  # noqa: E402
from target_service.engine import TargetEngine  # noqa: E402
from tools.spec_eval import EngineBench, Method, load_prompts  # noqa: E402

# Ops that only make views or metadata: no kernel on CUDA (they still cost a dispatcher trip).
VIEW_OPS = ("view", "select", "slice", "unsqueeze", "squeeze", "expand", "transpose", "permute", "t.default",
            "alias", "detach", "split", "unbind", "as_strided", "lift_fresh", "_unsafe_view", "reshape")


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def summary(self, top: int = 12) -> dict:
        views = sum(n for op, n in self.ops.items() if any(v in op for v in VIEW_OPS))
        total = sum(self.ops.values())
        return {"aten_ops": total, "compute_ops": total - views, "view_ops": views,
                "top": self.ops.most_common(top)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed:
    """Wraps proposer.propose and engine.verify: wall time per call (device-synchronised), one Propose op-counted,
    a few Proposes under torch.profiler on CUDA."""

    def __init__(self, device: torch.device, count_at: int = 4, profile_calls: int = 5) -> None:
        self.device, self.count_at, self.profile_calls = device, count_at, profile_calls
        self.propose_s: list[float] = []
        self.verify_s: list[float] = []
        self.ops: dict | None = None
        self.kernels: dict | None = None

    def propose(self, fn, inputs):
        n = len(self.propose_s)
        _sync(self.device)
        start = time.perf_counter()
        if n == self.count_at:
            counter = OpCounter()
            with counter:
                out = fn(inputs)
            self.ops = counter.summary()
        elif n == self.count_at + 1 and self.device.type == "cuda":
            out = self._profiled(fn, inputs)
        else:
            out = fn(inputs)
        _sync(self.device)
        if n not in (self.count_at, self.count_at + 1):  # instrumented calls are not timed
            self.propose_s.append(time.perf_counter() - start)
        else:
            self.propose_s.append(float("nan"))
        return out

    def _profiled(self, fn, inputs):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            out = fn(inputs)
            _sync(self.device)
            wall_s = time.perf_counter() - start  # this Propose's own wall, the profiler's overhead included
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        gpu_us = sum(e.device_time for e in kernels)
        names = collections.Counter(e.name[:60] for e in kernels)
        # the device's span (first event's start to last one's end): kernel time plus the gaps between kernels, which
        # inside a CUDA graph are the device's own launch latency, not host work
        intervals = device_intervals(prof)
        span_us = max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else 0.0
        self.kernels = {"kernels": len(kernels), "gpu_ms": gpu_us / 1e3, "span_ms": span_us / 1e3,
                        "profiled_wall_ms": wall_s * 1e3, "top": names.most_common(10)}
        return out

    def verify(self, fn, inputs):
        _sync(self.device)
        start = time.perf_counter()
        out = fn(inputs)
        _sync(self.device)
        self.verify_s.append(time.perf_counter() - start)
        return out


def run_config(bench: EngineBench, method: Method, prompts: list[list[int]], new_tokens: int) -> dict:
    proposer = bench.proposer(method.algorithm, method.num_draft_tokens)
    timed = Timed(bench.runner.device)
    original_propose, original_verify = proposer.propose, TargetEngine.verify
    bench.run(method, prompts[:1], 8, batch_size=1)  # warm-up: lazy inits, Triton JIT, graph capture
    proposer.propose = lambda inputs: timed.propose(original_propose, inputs)
    TargetEngine.verify = lambda self, inputs: timed.verify(lambda x: original_verify(self, x), inputs)
    try:
        result = bench.run(method, prompts, new_tokens, batch_size=1)
    finally:
        del proposer.propose
        TargetEngine.verify = original_verify
    clean = [s for s in timed.propose_s if s == s]
    row = {"method": method.name, "tau": round(result["tau"], 3), "tokens_per_s": round(result["tokens_per_s"], 1),
           "proposes": len(timed.propose_s), "propose_ms": 1e3 * sum(clean) / max(len(clean), 1),
           "verify_ms": 1e3 * sum(timed.verify_s) / max(len(timed.verify_s), 1), **(timed.ops or {})}
    if timed.kernels:
        row.update(kernels_per_propose=timed.kernels["kernels"], gpu_ms_per_propose=timed.kernels["gpu_ms"],
                   host_ms_per_propose=row["propose_ms"] - timed.kernels["gpu_ms"],
                   gpu_span_ms_per_propose=timed.kernels["span_ms"],
                   # the profiled Propose's wall outside its device span (both under the profiler: the span is
                   # only known there, and the profiler slows the host, so this bounds the host's share from above)
                   outside_span_ms_per_propose=timed.kernels["profiled_wall_ms"] - timed.kernels["span_ms"],
                   top_kernels=timed.kernels["top"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompts", type=int, default=3, help="held-out prompts, one after another at batch 1")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--methods", nargs="*", default=["EAGLE3 tree 5/4/16", "EAGLE3 chain 3/1/4", "STANDALONE chain 3/1/4"],
                   help="EAGLE ones need an EAGLE head folder next to the model (<model>-eagle; none is bundled)")
    p.add_argument("--graphs", nargs="*", default=None, choices=["all", "compiled", "target"],
                   help="CUDA graph modes to compare (default: all and target on CUDA); compiled: all, the drafts' "
                        "batch-1 graphs and static steps torch.compile'd (--enable-torch-compile)")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    m = Path(args.model)
    specs = {"EAGLE3 tree 5/4/16": ("EAGLE3", 5, 4, 16), "EAGLE3 chain 3/1/4": ("EAGLE3", 3, 1, 4),
             "EAGLE3 tree 6/8/32": ("EAGLE3", 6, 8, 32), "EAGLE tree 5/4/16": ("EAGLE", 5, 4, 16),
             "EAGLE chain 3/1/4": ("EAGLE", 3, 1, 4), "STANDALONE chain 3/1/4": ("STANDALONE", 3, 1, 4),
             "STANDALONE tree 4/2/8": ("STANDALONE", 4, 2, 8)}
    unknown = set(args.methods) - set(specs)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: {sorted(specs)}")
    prompts = load_prompts(m / "heldout_prompts.jsonl")[: args.prompts]
    graph_modes = args.graphs or (["all", "target"] if args.device.startswith("cuda") else ["none"])
    rows = []
    for mode in graph_modes:
        eagle = Path(f"{m}-eagle")
        bench = EngineBench(str(m), f"{m}-draft", f"{m}-eagle3", args.device,
                            eagle_path=str(eagle) if eagle.is_dir() else None, cuda_graphs=mode)
        for name in args.methods:
            row = run_config(bench, Method(name, *specs[name]), prompts, args.new_tokens)
            row["draft_graphs"] = {"all": "yes", "compiled": "compiled"}.get(mode, "no")
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| method | draft graphs | τ | tok/s | Propose ms | Verify ms | aten ops / Propose (compute) | "
             "kernels / Propose | GPU ms / Propose | host ms / Propose | GPU span ms (profiled) | outside the span ms "
             "(profiled) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['draft_graphs']} | {r['tau']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['propose_ms']:.2f} | {r['verify_ms']:.2f} | "
                     f"{r.get('aten_ops', '-')} ({r.get('compute_ops', '-')}) | {r.get('kernels_per_propose', '-')} | "
                     + (f"{r['gpu_ms_per_propose']:.2f} | {r['host_ms_per_propose']:.2f} | "
                        f"{r['gpu_span_ms_per_propose']:.2f} | {r['outside_span_ms_per_propose']:.2f} |"
                        if "gpu_ms_per_propose" in r else "- | - | - | - |"))
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_draft.json").write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
        (out / "profile_draft.md").write_text(table)


if __name__ == "__main__":
    main()
