"""Overlap scheduling through the real stack (`tandem serve`, three processes, gRPC Generate, greedy): tokens/s of
the default loop (ping-pong halves chosen by measurement, gateway/overlap.py) against `--disable-overlap-schedule`,
at each batch size, and of pre-drafting (`--enable-overlap-drafting`: STANDALONE, the EAGLE family) at batch 1 — side by side in one
run. Reports, from the gateway's /metrics, how many loop iterations ran as ping-pong phases and how long a Propose
and a Verify were in flight at once.

On one CPU box the draft and target compete for the same cores, so the overlap gain is small or negative there
(report, don't assert); the point is draft and target on their own GPUs:

    python bench/overlap.py --batch-sizes 1 8 --num-prompts 8 --max-new-tokens 64           # CPU, bundled demo family
    python bench/overlap.py --algorithm EAGLE3 --out o.json -- --device cuda --cuda-graph-max-bs 16   # one GPU
    python bench/overlap.py -- --device cuda --base-gpu-id 0 --draft-base-gpu-id 1           # 2 GPUs
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accept import free_port, heldout_prompts, stub_generate, wait_ready  # noqa: E402

from core import algorithms  # noqa: E402
from protos.tandem.v1 import tandem_pb2 as pb  # noqa: E402
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402
from tandem.args import DEFAULT_MODEL  # noqa: E402

SHAPES = {
    "chain": ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "tree": ["--speculative-num-steps", "4", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"],
}
MODES = {"default": [], "sequential": ["--disable-overlap-schedule"], "predraft": ["--enable-overlap-drafting"]}


def _metric(text: str, name: str, label: str = "") -> float:
    pattern = rf"^tandem:{name}_total{re.escape(label)} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def run(name: str, flags: list[str], prompts, batch: int, args) -> dict:
    http, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(http), "--grpc-port", str(grpc_port),
           "--log-level", "warning", "--speculative-algorithm", args.algorithm, *flags, *args.extra]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        wait_ready(proc, channel, name)
        stub = pb_grpc.GatewayStub(channel)
        stub.Info(pb.InfoRequest(), timeout=300, wait_for_ready=True)
        stub_generate(stub, prompts[0], 8, args)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(batch) as pool:  # `batch` requests in flight at once, the prompts shared among them
            results = list(pool.map(lambda p: stub_generate(stub, p, args.max_new_tokens, args), prompts))
        elapsed = time.perf_counter() - start
        channel.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    usages = [u for u, _, _ in results]
    tokens = sum(u.completion_tokens for u in usages)
    steps = sum(u.verify_steps for u in usages)
    hits, misses = sum(u.predraft_hits for u in usages), sum(u.predraft_misses for u in usages)
    return {"config": name, "batch_size": batch, "completion_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "mean_accept_length": tokens / (steps + len(prompts)), "seconds": elapsed,
            "pingpong_iterations": _metric(text, "overlap_iterations", '{mode="pingpong"}'),
            "sequential_iterations": _metric(text, "overlap_iterations", '{mode="sequential"}'),
            "both_busy_s": _metric(text, "overlap_both_busy_seconds"),
            "predraft_hits": hits, "predraft_misses": misses, "outputs": [ids for _, ids, _ in results]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", default="STANDALONE", help="STANDALONE, EAGLE, EAGLE3 or NGRAM (bundled demo)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-prompts", type=int, default=8, help="requests per run (at least the largest batch)")
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("extra", nargs="*", help="extra flags for tandem serve (after --)")
    args = p.parse_args()
    prompts = heldout_prompts(DEFAULT_MODEL, max(args.num_prompts, *args.batch_sizes), args.prompt_chars)
    results = []
    for shape in args.shapes:
        for batch in args.batch_sizes:
            for mode, flags in MODES.items():
                if mode == "predraft" and (batch > 1 or not algorithms.get(args.algorithm).supports_overlap):
                    continue  # pre-drafting: at batch 1, where a step has nothing else to overlap
                results.append(run(f"{shape} {mode}", SHAPES[shape] + flags, prompts, batch, args))
    for r in results:
        base = next(b for b in results if b["config"].split()[0] == r["config"].split()[0]
                    and b["batch_size"] == r["batch_size"] and b["config"].endswith("sequential"))
        r["speedup_vs_sequential"] = r["tokens_per_s"] / base["tokens_per_s"]
        if args.temperature == 0:
            r["identical_to_sequential"] = r["outputs"] == base["outputs"]
    print(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in results], indent=2))
    print(f"\n{args.algorithm}, {args.num_prompts} prompts x {args.max_new_tokens} tokens\n\n| batch | config | "
          "tok/s | vs sequential | accept length | ping-pong iterations | both busy s | pre-draft hits/misses | output == "
          "sequential |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        same = {True: "yes", False: "**NO**"}.get(r.get("identical_to_sequential"), "-")
        print(f"| {r['batch_size']} | {r['config']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_sequential']:.2f}x | "
              f"{r['mean_accept_length']:.2f} | {r['pingpong_iterations']:.0f} of "
              f"{r['pingpong_iterations'] + r['sequential_iterations']:.0f} | {r['both_busy_s']:.2f} | "
              f"{r['predraft_hits']}/{r['predraft_misses']} | {same} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
