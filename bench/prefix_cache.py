"""Time to first token with and without the target's prefix cache, through the real services: `tandem serve` (bundled
demo model unless --model-path) started twice, with the cache (default) and with --disable-radix-cache, driven by
the gRPC Generate API. Each request is a long shared prefix (a "system prompt" of --prefix-len tokens) plus a short
distinct suffix, sent one after another, as a chat service with a fixed system prompt sees them.

    python bench/prefix_cache.py --out-dir /tmp/prefix                   # CPU, bundled demo model
    python bench/prefix_cache.py --device cuda --prefix-len 4000 -- --cuda-graph-max-bs 8

Prints JSON and a markdown table (TTFT mean / p50 per mode, cached prompt tokens reported by usage).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.serve_decode import free_port  # noqa: E402
from protos.tandem.v1 import tandem_pb2 as pb  # noqa: E402
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402


def ttft(stub, prompt: list[int], max_new_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    first, cached = None, 0
    request = pb.GenerateRequest(token_ids=prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                                 skip_detokenize=True)
    for response in stub.Generate(request, timeout=600):
        if first is None and response.token_ids:
            first = time.perf_counter() - start
        if response.HasField("usage"):
            cached = response.usage.cached_prompt_tokens
    return first, cached


def run_mode(args, disable: bool, prompts: list[list[int]]) -> dict:
    http, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--device", args.device, "--port", str(http),
           "--grpc-port", str(grpc_port), "--log-level", "warning", *(["--model-path", args.model_path]
                                                                      if args.model_path else []),
           *(["--disable-radix-cache"] if disable else []), *args.extra]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.GatewayStub(channel)
        stub.Info(pb.InfoRequest(), timeout=540, wait_for_ready=True)
        ttft(stub, prompts[-1][: len(prompts[-1]) // 2], 2)  # warm-up on unrelated tokens
        samples = [ttft(stub, p, args.max_new_tokens) for p in prompts]
        channel.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    times = [t for t, _ in samples[1:]]  # the first request fills the cache in both modes
    return {"prefix_cache": not disable, "first_ttft_ms": samples[0][0] * 1e3,
            "ttft_mean_ms": statistics.fmean(times) * 1e3, "ttft_p50_ms": statistics.median(times) * 1e3,
            "cached_tokens": [c for _, c in samples]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-path", default=None)
    p.add_argument("--prefix-len", type=int, default=1500)
    p.add_argument("--suffix-len", type=int, default=12)
    p.add_argument("--requests", type=int, default=9)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192, help="token ids are drawn from [3, vocab)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("extra", nargs="*", help="extra tandem serve flags (after --)")
    args = p.parse_args()
    rng = random.Random(0)
    prefix = [rng.randrange(3, args.vocab) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(3, args.vocab) for _ in range(args.suffix_len)] for _ in range(args.requests)]
    runs = [run_mode(args, disable, prompts) for disable in (False, True)]
    result = {"device": args.device, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "runs": runs}
    on, off = runs
    lines = ["| prefix cache | first request TTFT ms | later TTFT mean / p50 ms | cached prompt tokens (later) |",
             "|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {'on' if r['prefix_cache'] else 'off'} | {r['first_ttft_ms']:.1f} | "
                     f"{r['ttft_mean_ms']:.1f} / {r['ttft_p50_ms']:.1f} | {r['cached_tokens'][1]} |")
    lines.append(f"| speedup | | {off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x | |")
    table = "\n".join(lines) + "\n"
    print(json.dumps(result, indent=1))
    print(table)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "prefix_cache.json").write_text(json.dumps(result, indent=1))
        (out / "prefix_cache.md").write_text(table)


if __name__ == "__main__":
    main()
