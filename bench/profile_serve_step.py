"""Where a speculative step's time goes in the configuration `tandem serve` runs: the target engine and the draft
proposer are built by the services' own builders (tandem/services.py) from `tandem serve` flags, so the attention
backend, CUDA graphs and their widths are the served ones; the gateway's loop runs in-process (no gRPC).

Per configuration: tokens/s and tau over held-out prompts (batch 1, greedy), wall ms per Propose and per Verify
(device-synchronised), the hottest Python functions of the Proposes (cProfile: host time), and on CUDA the kernels
and GPU ms of a few Proposes and Verifies (torch.profiler). Prints the backend and graph state each side ran.

    python bench/profile_serve_step.py --device cuda --out-dir /tmp/prof
    python bench/profile_serve_step.py --device cpu --prompts 1 --new-tokens 16 --configs "EAGLE3 5/4/16"
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tandem.args import DEFAULT_MODEL, resolve_spec  # noqa: E402
from tandem.cli import build_parser  # noqa: E402
from tools.spec_eval import Method, _generate, load_prompts  # noqa: E402

CONFIGS = {
    "NONE": [],
    "EAGLE3 5/4/16": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5",
                      "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"],
    "EAGLE3 auto": ["--speculative-algorithm", "EAGLE3"],
    "EAGLE3 3/1/4": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "STANDALONE 3/1/4": ["--speculative-algorithm", "STANDALONE"],
    "NGRAM": ["--speculative-algorithm", "NGRAM"],
}
# The target's eager verify beside the default static verify step.
CONFIGS.update({f"{name} eager-verify": [*flags, "--disable-static-verify-step"] for name, flags in list(CONFIGS.items())
                if flags})
# The same shapes drafting step by step from the host (the pre-static-step path), for the A/B in one run.
CONFIGS.update({f"{name} eager": [*flags, "--disable-static-draft-step"] for name, flags in list(CONFIGS.items())
                if flags and "NGRAM" not in flags})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Probe:
    """Wraps a callable: device-synchronised wall time per call; calls in `profile_calls` run under cProfile (all
    of them accumulate into one profile) and, on CUDA, torch.profiler."""

    def __init__(self, fn, device: torch.device, profile_from: int, profile_calls: int, kernels: bool) -> None:
        self.fn, self.device = fn, device
        self.profile_from, self.profile_calls, self.kernels = profile_from, profile_calls, kernels
        self.wall: list[float] = []
        self.cprofile = cProfile.Profile()
        self.kernel_us: list[float] = []
        self.kernel_counts: list[int] = []
        self.kernel_names: collections.Counter[str] = collections.Counter()

    def __call__(self, *args):
        n = len(self.wall)
        profiled = self.profile_from <= n < self.profile_from + self.profile_calls
        _sync(self.device)
        start = time.perf_counter()
        if profiled and self.kernels:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = self.fn(*args)
                _sync(self.device)
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            self.kernel_us.append(sum(e.device_time for e in kernels))
            self.kernel_counts.append(len(kernels))
            self.kernel_names.update(e.name[:70] for e in kernels)
            self.wall.append(float("nan"))
            return out
        if profiled:
            self.cprofile.enable()
        out = self.fn(*args)
        _sync(self.device)
        if profiled:
            self.cprofile.disable()
        self.wall.append(time.perf_counter() - start)
        return out

    def summary(self) -> dict:
        clean = sorted(w for w in self.wall if w == w)
        out = {"calls": len(self.wall), "mean_ms": 1e3 * sum(clean) / max(len(clean), 1),
               "median_ms": 1e3 * clean[len(clean) // 2] if clean else 0.0}
        if self.kernel_us:
            out.update(gpu_ms=sum(self.kernel_us) / len(self.kernel_us) / 1e3,
                       kernels=sum(self.kernel_counts) / len(self.kernel_counts),
                       top_kernels=self.kernel_names.most_common(8))
        return out

    def hot(self, n: int = 25) -> str:
        buf = io.StringIO()
        try:
            stats = pstats.Stats(self.cprofile, stream=buf)
        except TypeError:  # nothing was profiled
            return ""
        stats.sort_stats("tottime").print_stats(n)
        stats.sort_stats("cumulative").print_stats(n)
        return buf.getvalue()


def run_config(name: str, flags: list[str], device: str, prompts: list[list[int]], new_tokens: int,
               extra: list[str]) -> tuple[dict, str]:
    from tandem.services import _build_runner, _engine_config, _feature_capture, _static_verify, build_proposer
    from target_service.engine import TargetEngine

    args = build_parser().parse_args(["serve", "--device", device, *flags, *extra])
    algorithm, steps, topk, ndt = resolve_spec(args)
    args.speculative_algorithm = algorithm
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = steps, topk, ndt
    t0 = time.perf_counter()
    runner = _build_runner(str(args.model_path or DEFAULT_MODEL), _engine_config(args, target=True))
    engine = TargetEngine(runner, **_feature_capture(args, runner))
    _static_verify(engine, args)
    proposer = build_proposer(args)[0] if algorithm != "NONE" else None
    build_s = time.perf_counter() - t0
    dev = runner.device
    kernels = dev.type == "cuda"
    state = {"target_backend": type(runner.attn_backend).__name__, "target_graphs": runner.graph_runner is not None,
             "static_verify": engine._static_verify is not None,
             "build_s": round(build_s, 1)}
    if proposer is not None and getattr(proposer, "runner", None) is not None:
        dr = proposer.runner
        state.update(draft_backend=type(dr.attn_backend).__name__, draft_graphs=dr.graph_runner is not None,
                     draft_graph_keys=sorted(dr.graph_runner.graphs)[:12] if dr.graph_runner else [])
    method = Method(name, algorithm, steps, topk, ndt)
    # Warm-up (Triton JIT, lazy inits), then the measured run with probes.
    _generate(engine, proposer, method, prompts[:1], 16, 0.0, 10_000)
    verify_probe = Probe(engine.verify, dev, profile_from=20, profile_calls=40, kernels=False)
    verify_kprobe = None
    engine.verify = verify_probe
    propose_probe = None
    if proposer is not None:
        propose_probe = Probe(proposer.propose, dev, profile_from=20, profile_calls=40, kernels=False)
        proposer.propose = propose_probe
    _sync(dev)
    start = time.perf_counter()
    steps_done, tokens = _generate(engine, proposer, method, prompts, new_tokens, 0.0, 0)
    _sync(dev)
    seconds = time.perf_counter() - start
    # A second, shorter pass under torch.profiler for kernel counts and GPU ms.
    if kernels:
        verify_kprobe = Probe(verify_probe.fn, dev, profile_from=4, profile_calls=6, kernels=True)
        engine.verify = verify_kprobe
        if proposer is not None:
            propose_k = Probe(propose_probe.fn, dev, profile_from=4, profile_calls=6, kernels=True)
            proposer.propose = propose_k
        _generate(engine, proposer, method, prompts[:1], 48, 0.0, 20_000)
    row = {"config": name, "algorithm": algorithm, "shape": f"{steps}/{topk}/{ndt}", **state,
           "tokens_per_s": round(tokens / seconds, 1), "tau": round(tokens / max(steps_done, 1), 3),
           "verify": verify_probe.summary()}
    if verify_kprobe is not None:
        row["verify_kernels"] = verify_kprobe.summary()
    text = f"## {name}\n\n### verify\n{verify_probe.hot()}\n"
    if propose_probe is not None:
        row["propose"] = propose_probe.summary()
        if kernels:
            row["propose_kernels"] = proposer.propose.summary()
        text += f"### propose\n{propose_probe.hot()}\n"
    del engine, proposer, runner
    if kernels:
        torch.cuda.empty_cache()
    return row, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--configs", nargs="*", default=["NONE", "EAGLE3 5/4/16", "STANDALONE 3/1/4"])
    p.add_argument("--out-dir", default=None)
    p.add_argument("extra", nargs="*", help="more `tandem serve` flags for every config (after --)")
    args = p.parse_args()
    prompts = load_prompts(DEFAULT_MODEL / "heldout_prompts.jsonl")[: args.prompts]
    rows, texts = [], []
    for name in args.configs:
        row, text = run_config(name, CONFIGS[name], args.device, prompts, args.new_tokens, args.extra)
        print(json.dumps(row), flush=True)
        rows.append(row)
        texts.append(text)
    lines = ["| config | backend t/d | graphs t/d | tok/s | tau | propose ms | propose GPU ms | verify ms | "
             "verify GPU ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pr, pk, vk = r.get("propose", {}), r.get("propose_kernels", {}), r.get("verify_kernels", {})
        lines.append(f"| {r['config']} | {r['target_backend']}/{r.get('draft_backend', '-')} | "
                     f"{r['target_graphs']}/{r.get('draft_graphs', '-')} | {r['tokens_per_s']} | {r['tau']} | "
                     f"{pr.get('mean_ms', 0):.2f} | {pk.get('gpu_ms', 0):.2f} | {r['verify']['mean_ms']:.2f} | "
                     f"{vk.get('gpu_ms', 0):.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_serve_step.json").write_text(json.dumps(rows, indent=1))
        (out / "profile_serve_step.md").write_text(table + "\n")
        (out / "profile_serve_step_hot.txt").write_text("\n".join(texts))


if __name__ == "__main__":
    main()
