"""Overlapped drafting: tokens/s with and without --enable-overlap-drafting through the real stack (`tandem serve`,
three processes, gRPC Generate, batch 1, greedy), and how often the pre-draft was used.

`predraft_used` = steps that ran on a pre-drafted tree / all verify steps; `guess_hit_rate` = hits / (hits +
misses). On one CPU box the draft and target compete for cores, so the overlap gain is small or negative there; the
point of the mode is draft and target on separate GPUs:

    python bench/overlap.py --num-prompts 8 --max-new-tokens 64                       # CPU, bundled demo pair
    python bench/overlap.py -- --device cuda --base-gpu-id 0 --draft-base-gpu-id 1    # 2 GPUs
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accept import free_port, heldout_prompts, stub_generate  # noqa: E402

from protos.tandem.v1 import tandem_pb2 as pb  # noqa: E402
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402
from tandem.args import DEFAULT_MODEL  # noqa: E402

SHAPES = {
    "chain": ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "tree": ["--speculative-num-steps", "4", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"],
}


def run(name: str, flags: list[str], prompts, args) -> dict:
    http, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(http), "--grpc-port", str(grpc_port),
           "--log-level", "warning", "--speculative-algorithm", "STANDALONE", *flags, *args.extra]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        grpc.channel_ready_future(channel).result(timeout=300)
        stub = pb_grpc.GatewayStub(channel)
        stub.Info(pb.InfoRequest(), timeout=300, wait_for_ready=True)
        stub_generate(stub, prompts[0], 8, args)  # warm-up
        totals = dict(tokens=0, steps=0, hits=0, misses=0)
        start = time.perf_counter()
        for prompt in prompts:
            usage = stub_generate(stub, prompt, args.max_new_tokens, args)
            totals["tokens"] += usage.completion_tokens
            totals["steps"] += usage.verify_steps
            totals["hits"] += usage.predraft_hits
            totals["misses"] += usage.predraft_misses
        elapsed = time.perf_counter() - start
        channel.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    guesses = totals["hits"] + totals["misses"]
    return {"config": name, "completion_tokens": totals["tokens"], "tokens_per_s": totals["tokens"] / elapsed,
            "mean_accept_length": totals["tokens"] / (totals["steps"] + len(prompts)),
            "predraft_hits": totals["hits"], "predraft_misses": totals["misses"],
            "predraft_used": totals["hits"] / totals["steps"] if totals["steps"] else 0.0,
            "guess_hit_rate": totals["hits"] / guesses if guesses else 0.0, "seconds": elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("extra", nargs="*", help="extra flags for tandem serve (after --)")
    args = p.parse_args()
    prompts = heldout_prompts(DEFAULT_MODEL, args.num_prompts, args.prompt_chars)
    results = []
    for shape in args.shapes:
        for overlap in (False, True):
            flags = SHAPES[shape] + ["--enable-overlap-drafting"] * overlap
            results.append(run(f"{shape}{'+overlap' if overlap else ''}", flags, prompts, args))
    print(json.dumps(results, indent=2))
    print("\n| config | tok/s | mean accept length | pre-draft used (of steps) | guess hit rate |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['config']} | {r['tokens_per_s']:.1f} | {r['mean_accept_length']:.2f} | "
              f"{r['predraft_used']:.2f} | {r['guess_hit_rate']:.2f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
