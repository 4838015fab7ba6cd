"""Per-step gRPC overhead of the gateway -> pod Verify: unary RPC vs the persistent bidi stream (VerifyStream).

Issue #3's budget: the gRPC overlay costs <= 5% of a step. Both paths go through the gateway's own client
(gateway.clients.TargetClient, step_streams on / off) with a realistic step: batch 1, a 16-token draft tree (a
topk-2 tree, as STANDALONE/EAGLE send), sampling + stop params. The server runs in a child process (gateway and pod
are separate processes in every deployment):

  * trivial: a servicer that answers at once (root+1) -> the pure round-trip cost of the transport;
  * target:  the real target service (TargetEngine on --model-path, default the bundled demo model) -> round trip,
    the handler time the service reports (StepTimings.total_ms), and the overlay = round trip - handler time, also
    as a share of the round trip; "beyond forward" = round trip - the model forward (StepTimings.forward_ms), i.e.
    everything an in-process engine would not pay plus the engine's own host bookkeeping. A second target server
    with every model call on its worker thread (the pre-inline servicer, `inline_steps=False`) runs beside it, its
    stream path alternated with the others, so the saving of inline step calls is measured side by side.

Calls alternate between the two paths in blocks so drift hits both alike. Prints a table and JSON (to --out, or
$OUT/rpc_overhead.json when $OUT is set):

    python bench/rpc_overhead.py                                   # CPU
    python bench/rpc_overhead.py --device cuda:0 --iters 2000      # GPU host
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.clients import TargetClient  # noqa: E402
from protos.tandem.v1 import tandem_pb2 as pb  # noqa: E402
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402
from tandem.args import DEFAULT_MODEL  # noqa: E402

PROMPT_LEN = 64


class EchoTarget(pb_grpc.TargetServiceServicer):
    """Answers every Verify at once with the root's successor: no model, only the transport and proto work."""

    @staticmethod
    def _answer(request: pb.VerifyRequest) -> pb.VerifyResponse:
        return pb.VerifyResponse(
            results=[pb.VerifyResult(seq_id=s.seq_id, token_ids=[s.root_token_id + 1],
                                     num_draft_tokens=len(s.tree.token_ids)) for s in request.seqs],
            timings=pb.StepTimings(), memory=pb.MemoryState())

    async def Verify(self, request, context):
        return self._answer(request)

    async def VerifyStream(self, request_iterator, context):
        async for request in request_iterator:
            yield self._answer(request)

    async def Info(self, request, context):
        return pb.ModelInfo(vocab_size=32000, max_context_len=1 << 20, protocol="tandem.v1")


def _serve(kind: str, args: argparse.Namespace, port_queue) -> None:
    """Child process: serve `kind` until killed; reports the bound port (or an error string)."""
    async def main():
        if kind == "trivial":  # target-threaded: the real target with inline_steps=False
            from protos.wire import start_server

            server, port, _ = await start_server(
                lambda s: pb_grpc.add_TargetServiceServicer_to_server(EchoTarget(), s), ["tandem.v1.TargetService"],
                "127.0.0.1", 0)
        else:
            from runtime.config import EngineConfig
            from runtime.model_runner import ModelRunner
            from target_service.engine import TargetEngine
            from target_service.server import serve_target

            config = EngineConfig(device=args.device, dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                                  attention_backend=args.attention_backend,
                                  cuda_graph_num_draft_tokens=args.tree_tokens + 1,
                                  cuda_graph_max_bs=args.cuda_graph_max_bs, disable_cuda_graph=args.disable_cuda_graph)
            engine = TargetEngine(ModelRunner(args.model_path, config))
            server, port = await serve_target(engine, args.model_path, "127.0.0.1", 0,
                                              inline_steps=kind != "target-threaded")
        port_queue.put(port)
        await server.wait_for_termination()

    try:
        asyncio.run(main())
    except Exception as exc:  # tell the parent instead of leaving it waiting for a port
        port_queue.put(f"{type(exc).__name__}: {exc}")
        raise


def _tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """A topk-2 tree of n nodes (parents before children), random draft tokens."""
    parents = [-1 if i < 2 else (i - 2) // 2 for i in range(n)]
    return [rng.randrange(3, vocab) for _ in range(n)], parents


class Sequence:
    """One batch-1 sequence on the server; committed tokens advance with what the target accepts."""

    def __init__(self, seq_id: str, vocab: int, max_context: int, tree_tokens: int, seed: int = 0):
        self.seq_id, self.vocab, self.max_context, self.tree_tokens = seq_id, vocab, max_context, tree_tokens
        self.rng = random.Random(seed)
        self.committed: list[int] = []

    async def reset(self, client: TargetClient, prefill: bool) -> None:
        if prefill:
            await client._call(client.stub.Release, pb.ReleaseRequest(seq_ids=[self.seq_id]))
        prompt = [self.rng.randrange(3, self.vocab) for _ in range(PROMPT_LEN)]
        self.committed = prompt
        if prefill:
            response = await client._call(client.stub.Prefill, pb.TargetPrefillRequest(seqs=[pb.TargetPrefillSeq(
                seq_id=self.seq_id, token_ids=prompt, sample_next_token=True, sampling=pb.SamplingParams(top_p=1.0),
                stop=pb.StopParams(max_new_tokens=1 << 30, ignore_eos=True, prompt_len=PROMPT_LEN))]))
            self.committed = prompt + list(response.results[0].token_ids)

    def request(self) -> pb.VerifyRequest:
        tokens, parents = _tree(self.rng, self.tree_tokens, self.vocab)
        return pb.VerifyRequest(seqs=[pb.VerifySeq(
            seq_id=self.seq_id, committed_len=len(self.committed), root_token_id=self.committed[-1],
            tree=pb.DraftTree(token_ids=tokens, parents=parents), sampling=pb.SamplingParams(top_p=1.0),
            stop=pb.StopParams(max_new_tokens=1 << 30, ignore_eos=True, prompt_len=PROMPT_LEN))])

    def advance(self, response: pb.VerifyResponse) -> bool:
        """Commit the step; False when the sequence must be re-prefilled (status, finish or context end)."""
        result = response.results[0]
        if result.status != pb.SEQ_STATUS_OK or result.finish_reason:
            return False
        self.committed += list(result.token_ids)
        return len(self.committed) + self.tree_tokens + 2 < self.max_context


async def measure(kind: str, ports: dict[str, int], args: argparse.Namespace) -> dict:
    clients = {"unary": TargetClient(f"127.0.0.1:{ports[kind]}", 60.0, step_streams=False),
               "stream": TargetClient(f"127.0.0.1:{ports[kind]}", 60.0, step_streams=True)}
    if "target-threaded" in ports:
        clients["stream, threaded model calls"] = TargetClient(f"127.0.0.1:{ports['target-threaded']}", 60.0,
                                                                step_streams=True)
    info = await clients["unary"].info(timeout_s=300)
    real = kind == "target"
    max_context = min(info.max_context_len, 1 << 30)
    seqs = {name: Sequence(f"bench-{name}", info.vocab_size, max_context, args.tree_tokens, seed=i)
            for i, name in enumerate(clients)}
    for name, seq in seqs.items():
        await seq.reset(clients[name], real)
    samples = {name: {"round_trip_ms": [], "handler_ms": [], "forward_ms": []} for name in clients}
    block = max(1, args.block)
    total = args.warmup + args.iters
    done = {name: 0 for name in clients}
    while min(done.values()) < total:
        for name, client in clients.items():
            seq = seqs[name]
            for _ in range(min(block, total - done[name])):
                request = seq.request()
                start = time.perf_counter()
                response = await client.verify_stream(request)
                elapsed = (time.perf_counter() - start) * 1e3
                if done[name] >= args.warmup:
                    samples[name]["round_trip_ms"].append(elapsed)
                    samples[name]["handler_ms"].append(response.timings.total_ms)
                    samples[name]["forward_ms"].append(response.timings.forward_ms)
                done[name] += 1
                if not seq.advance(response):
                    await seq.reset(client, real)
    stream = clients["stream"].verify_stream
    assert stream.num_opened >= 1 and stream.num_unary == 0, "the stream path fell back to unary"
    assert clients["unary"].verify_stream.num_opened == 0
    for client in clients.values():
        await client.close()
    out = {}
    for name, s in samples.items():
        rt, handler = s["round_trip_ms"], s["handler_ms"]
        overlay = [r - h for r, h in zip(rt, handler)]
        out[name] = {"n": len(rt), "mean_ms": statistics.fmean(rt), "p50_ms": _pct(rt, 50), "p90_ms": _pct(rt, 90),
                     "p99_ms": _pct(rt, 99), "handler_mean_ms": statistics.fmean(handler),
                     "forward_mean_ms": statistics.fmean(s["forward_ms"]),
                     "beyond_forward_mean_ms": statistics.fmean(rt) - statistics.fmean(s["forward_ms"]),
                     "overlay_mean_ms": statistics.fmean(overlay), "overlay_p50_ms": _pct(overlay, 50),
                     "overlay_share_of_round_trip": statistics.fmean(overlay) / statistics.fmean(rt)}
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_kind(kind: str, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")  # a fresh interpreter: no grpc/torch state shared with the parent
    kinds = [kind, "target-threaded"] if kind == "target" else [kind]
    procs, ports = [], {}
    try:
        for k in kinds:
            queue = ctx.Queue()
            proc = ctx.Process(target=_serve, args=(k, args, queue), daemon=True)
            proc.start()
            procs.append(proc)
            port = queue.get(timeout=600)
            if isinstance(port, str):
                raise SystemExit(f"error: the {k} server failed to start: {port}")
            ports[k] = port
        return asyncio.run(measure(kind, ports, args))
    finally:
        for proc in procs:
            proc.kill()
            proc.join(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=1000, help="timed calls per path and server")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--block", type=int, default=50, help="consecutive calls of one path before switching")
    p.add_argument("--tree-tokens", type=int, default=16, help="draft tree size (root excluded)")
    p.add_argument("--servers", nargs="*", default=["trivial", "target"], choices=["trivial", "target"])
    p.add_argument("--model-path", default=str(DEFAULT_MODEL), help="target checkpoint (default: bundled demo)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--cuda-graph-max-bs", type=int, default=4, help="CUDA: graphs up to this batch (batch 1 is run)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/rpc_overhead.json when $OUT is set)")
    args = p.parse_args()
    if args.attention_backend == "auto":
        args.attention_backend = "triton" if args.device.startswith("cuda") else "torch"
    results = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "servers": {}}
    for kind in args.servers:
        results["servers"][kind] = run_kind(kind, args)
    rows = ["| server | path | round trip mean / p50 / p90 / p99 (ms) | handler (ms) | overlay (ms) | overlay share "
            "| forward (ms) | beyond forward (ms) |", "|---|---|---|---|---|---|---|---|"]
    for kind, paths in results["servers"].items():
        for name, r in paths.items():
            rows.append(f"| {kind} | {name} | {r['mean_ms']:.3f} / {r['p50_ms']:.3f} / {r['p90_ms']:.3f} / "
                        f"{r['p99_ms']:.3f} | {r['handler_mean_ms']:.3f} | {r['overlay_mean_ms']:.3f} | "
                        f"{100 * r['overlay_share_of_round_trip']:.1f}% | {r['forward_mean_ms']:.3f} | "
                        f"{r['beyond_forward_mean_ms']:.3f} |")
        if {"unary", "stream"} <= set(paths):
            saved = paths["unary"]["overlay_mean_ms"] - paths["stream"]["overlay_mean_ms"]
            results["servers"][kind]["stream_saves_ms"] = saved
            rows.append(f"| {kind} | stream saves | {saved:.3f} ms per call | | | | | |")
        threaded = paths.get("stream, threaded model calls")
        if threaded:
            saved = threaded["beyond_forward_mean_ms"] - paths["stream"]["beyond_forward_mean_ms"]
            results["servers"][kind]["inline_saves_ms"] = saved
            rows.append(f"| {kind} | inline step calls save | {saved:.3f} ms per call (beyond forward) | | | | | |")
    print(json.dumps(results, indent=1))
    print("\n".join(rows))
    out = args.out or (os.path.join(os.environ["OUT"], "rpc_overhead.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))
        print("wrote", out)


if __name__ == "__main__":
    main()
