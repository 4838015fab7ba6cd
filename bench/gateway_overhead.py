"""What the gateway costs per sequence and per step at batch N, with no model in the way.

#11's batch-64 numbers: plain decoding through the services ran at half the in-process rate (8B, H200: 4,004 vs
7,675 tok/s), ~34 ms per 4-step Verify call outside the target's handler. This bench isolates that part: the real
gateway process (`tandem gateway`, plain decoding, its default steps per call) in front of an instant target (a gRPC
TargetService in its own process that answers Prefill and Verify at once with the tokens a real target would commit,
ending each sequence at its max_new_tokens), and N concurrent gRPC Generate streams from this process. What is left is
the gateway's loop, its streams, detokenization and the transport: the ceiling the services can reach at batch N.

    python bench/gateway_overhead.py --batch-sizes 1 16 64              # table + JSON
    python bench/gateway_overhead.py --batch-sizes 64 --profile /tmp/gw.prof  # + the gateway's cProfile

Prints tok/s, Verify calls per second, gateway ms per call and per sequence per call, and the target's mean
sequences per call.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from protos.tandem.v1 import tandem_pb2 as pb  # noqa: E402
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402
from rpc_overhead import EchoTarget  # noqa: E402  (Verify and VerifyStream through _answer)
from tandem.args import DEFAULT_MODEL  # noqa: E402
from tandem.launch import free_port as _free_port  # noqa: E402

PROMPT_LEN = 64


class InstantTarget(EchoTarget):
    """A target with no model: Prefill and Verify answer at once with `num_decode_steps` tokens per sequence (ids
    cycling through `tokens`, so the gateway detokenizes real text), LENGTH at each sequence's max_new_tokens."""

    def __init__(self, vocab_size: int, eos: list[int], tokens: list[int], counts):
        self.vocab_size, self.eos, self.tokens = vocab_size, eos, tokens
        self.left: dict[str, int] = {}
        self.counts = counts  # shared: [verify calls, sequences verified, prefill calls]

    def _emit(self, seq_id: str, n: int) -> pb.VerifyResult:
        left = self.left.get(seq_id, 0)
        n = min(n, left)
        self.left[seq_id] = left - n
        done = self.left[seq_id] <= 0
        ids = [self.tokens[(left + i) % len(self.tokens)] for i in range(n)]
        return pb.VerifyResult(seq_id=seq_id, token_ids=ids, num_steps=n,
                               finish_reason=pb.FINISH_REASON_LENGTH if done else pb.FINISH_REASON_UNSPECIFIED)

    async def Prefill(self, request, context):
        self.counts[2] += 1
        results = []
        for s in request.seqs:
            self.left[s.seq_id] = s.stop.max_new_tokens
            r = self._emit(s.seq_id, 1 if s.sample_next_token else 0)
            results.append(pb.TargetPrefillResult(seq_id=s.seq_id, token_ids=r.token_ids,
                                                  finish_reason=r.finish_reason))
        return pb.TargetPrefillResponse(results=results, timings=pb.StepTimings(), memory=pb.MemoryState())

    def _answer(self, request: pb.VerifyRequest) -> pb.VerifyResponse:
        self.counts[0] += 1
        self.counts[1] += len(request.seqs)
        return pb.VerifyResponse(results=[self._emit(s.seq_id, max(1, s.num_decode_steps)) for s in request.seqs],
                                 timings=pb.StepTimings(), memory=pb.MemoryState())

    async def Release(self, request, context):
        for seq_id in request.seq_ids:
            self.left.pop(seq_id, None)
        return pb.ReleaseResponse(num_released=len(request.seq_ids), memory=pb.MemoryState())

    async def Info(self, request, context):
        return pb.ModelInfo(model_path="instant", vocab_size=self.vocab_size, max_context_len=1 << 20,
                            eos_token_ids=self.eos, algorithm="NONE", protocol="tandem.v1", device="cpu")


def _serve_target(port_queue, counts, vocab_size: int, eos: list[int], tokens: list[int]) -> None:
    async def main():
        from protos.wire import start_server

        servicer = InstantTarget(vocab_size, eos, tokens, counts)
        server, port, _ = await start_server(lambda s: pb_grpc.add_TargetServiceServicer_to_server(servicer, s),
                                             ["tandem.v1.TargetService"], "127.0.0.1", 0)
        port_queue.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


_PROFILED_GATEWAY = """
import cProfile, sys
from tandem.cli import main
profile = cProfile.Profile()
out, sys.argv = sys.argv[1], ["tandem", *sys.argv[2:]]  # python -c CODE PROFILE_FILE GATEWAY_ARGS...
profile.enable()
try:
    main()
finally:  # the gateway shuts down on SIGTERM and returns
    profile.disable()
    profile.dump_stats(out)
"""


async def _wait_ready(address: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await pb_grpc.GatewayStub(channel).Info(pb.InfoRequest(), timeout=2)
                return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the gateway at {address} did not answer within {timeout_s} s")


async def _generate(stub, prompt: list[int], max_new_tokens: int) -> int:
    tokens = 0
    async for response in stub.Generate(pb.GenerateRequest(token_ids=prompt, max_new_tokens=max_new_tokens,
                                                           ignore_eos=True), timeout=600):
        tokens += len(response.token_ids)
    return tokens


async def _run(address: str, batch_size: int, max_new_tokens: int, tokens: list[int]) -> tuple[int, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GatewayStub(channel)
        await _generate(stub, tokens[:PROMPT_LEN], 4)  # warm-up: first-call costs out of the timed run
        prompts = [[tokens[(i * 7 + j) % len(tokens)] for j in range(PROMPT_LEN)] for i in range(batch_size)]
        start = time.perf_counter()
        counts = await asyncio.gather(*(_generate(stub, p, max_new_tokens) for p in prompts))
        return sum(counts), time.perf_counter() - start


def measure(args: argparse.Namespace, batch_size: int, vocab_size: int, eos: list[int], tokens: list[int],
            profile: str | None) -> dict:
    ctx = mp.get_context("spawn")
    counts, port_queue = ctx.Array("q", 3), ctx.Queue()
    target = ctx.Process(target=_serve_target, args=(port_queue, counts, vocab_size, eos, tokens), daemon=True)
    target.start()
    target_port = port_queue.get(timeout=60)
    grpc_port, http_port = _free_port(), _free_port()
    gateway_args = ["gateway", "--target-address", f"127.0.0.1:{target_port}", "--model-path", args.model_path,
                    "--grpc-port", str(grpc_port), "--port", str(http_port), "--host", "127.0.0.1",
                    "--max-running-requests", str(max(batch_size, 1)), *args.gateway_args]
    command = ([sys.executable, "-c", _PROFILED_GATEWAY, profile, *gateway_args] if profile
               else [sys.executable, "-m", "tandem.cli", *gateway_args])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    gateway = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{grpc_port}"
        asyncio.run(_wait_ready(address))
        before = list(counts)
        n_tokens, wall = asyncio.run(_run(address, batch_size, args.max_new_tokens, tokens))
        calls, seqs = counts[0] - before[0], counts[1] - before[1]
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gateway.kill()
        target.terminate()
    return {"batch_size": batch_size, "tokens": n_tokens, "wall_s": wall, "tok_s": n_tokens / wall,
            "verify_calls": calls, "seqs_per_call": seqs / max(calls, 1), "calls_per_s": calls / wall,
            "ms_per_call": 1e3 * wall / max(calls, 1), "ms_per_seq_call": 1e3 * wall / max(seqs, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=str(DEFAULT_MODEL), help="the gateway's tokenizer and config")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--profile", default=None, help="cProfile the gateway at the last batch size into this file")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("gateway_args", nargs="*", help="extra flags for tandem gateway (after --)")
    args = p.parse_args()

    config = json.loads((Path(args.model_path) / "config.json").read_text())
    eos = config.get("eos_token_id", [])
    eos = eos if isinstance(eos, list) else [eos]
    vocab_size = int(config["vocab_size"])
    tokens = [t for t in range(256, min(vocab_size, 4096)) if t not in eos]  # ordinary text tokens
    rows = []
    for i, bs in enumerate(args.batch_sizes):
        row = measure(args, bs, vocab_size, eos, tokens, args.profile if i == len(args.batch_sizes) - 1 else None)
        rows.append(row)
        print(f"batch {bs}: {row['tok_s']:.0f} tok/s, {row['calls_per_s']:.1f} Verify calls/s, "
              f"{row['ms_per_call']:.2f} ms per call ({row['seqs_per_call']:.1f} sequences), "
              f"{row['ms_per_seq_call']:.3f} ms per sequence per call", flush=True)
    print("\n| batch | tok/s | Verify calls/s | sequences per call | ms per call | ms per sequence per call |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['tok_s']:.0f} | {r['calls_per_s']:.1f} | {r['seqs_per_call']:.1f} | "
              f"{r['ms_per_call']:.2f} | {r['ms_per_seq_call']:.3f} |")
    out = args.out or (os.path.join(os.environ["OUT"], "gateway_overhead.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"gateway_args": args.gateway_args, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
