"""`bench/speculative.py --mode services`: SYNTHETIC ACCEPTANCE through real processes on one device.

Per speculative config: one target service (its CUDA graphs captured for that verify width), one SYNTHETIC draft
service and two gateways over the same target — a plain one (the reference AR run, whose outputs become the oracle
file the draft re-reads) and a speculative one. Requests are gRPC Generate streams, one per sequence of the batch, sent
together. t_verify / t_draft are the services' own per-RPC model times (`tandem:forward_time_seconds` of Verify on the
target and Propose on the draft, from their /metrics), differenced around each run. The full-batch rate counts the
tokens streamed while every sequence was decoding (full_batch), as the in-process bench's full-batch steps.

--profile-dir DIR: after the timed speculative run of each batch size in --profile-batch-sizes, the same batch once
more under the speculative gateway's /start_profile ... /stop_profile: the target (and the draft process, if apart)
and the gateway write a torch trace, a Python profile and a summary into DIR; the timed numbers are unprofiled.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_decode import free_port, model_dir  # noqa: E402

from bench.accept import profile_prompt  # noqa: E402

from draft_service.synthetic import Oracle  # noqa: E402
from protos.tandem.v1 import tandem_pb2 as pb  # noqa: E402
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402
from tandem.args import REPO_ROOT  # noqa: E402


def _run_ahead(port: int) -> dict[str, float]:
    """The target's run-ahead outcomes so far (tandem:run_ahead_total by outcome: hit / miss, in sequences)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {outcome: float(m.group(1)) if (m := re.search(
        rf'^tandem:run_ahead_total{{[^}}]*outcome="{outcome}"[^}}]*}} (\S+)$', text, re.M)) else 0.0
        for outcome in ("hit", "miss")}


def _metric(port: int, rpc: str) -> tuple[float, float, float]:
    """(model seconds, count) of tandem:forward_time_seconds and the handler wall seconds
    (tandem:rpc_duration_seconds: decode, convert, leases, model, encode) for one RPC from a service's /metrics (a
    step on the persistent stream counts under the unary name; the stream's own label times the whole stream)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for name, kind in (("forward_time", "sum"), ("forward_time", "count"), ("rpc_duration", "sum")):
        m = re.search(rf'^tandem:{name}_seconds_{kind}{{[^}}]*rpc="{rpc}"[^}}]*}} (\S+)$', text, re.M)
        values[name, kind] = float(m.group(1)) if m else 0.0
    return values["forward_time", "sum"], values["forward_time", "count"], values["rpc_duration", "sum"]


def _generate(stub, prompt: list[int], max_new: int) -> dict:
    request = pb.GenerateRequest(token_ids=prompt, max_new_tokens=max_new, ignore_eos=True, skip_detokenize=True)
    tokens, chunks, usage = [], [], None
    for response in stub.Generate(request, timeout=600):
        if response.token_ids:
            chunks.append((time.perf_counter(), len(response.token_ids)))
        tokens.extend(response.token_ids)
        if response.HasField("usage"):
            usage = response.usage
    return {"tokens": tokens, "first": chunks[0][0] if chunks else None, "end": time.perf_counter(),
            "chunks": chunks, "usage": usage}


def full_batch(outs: list[dict]) -> tuple[int, float]:
    """(tokens, seconds) while every sequence of the batch was decoding: streamed after the last sequence's first
    token (the gateway admits a batch's requests in waves) up to the first sequence's last one (from there a
    static batch drains). The steady state of a server kept full, as the in-process bench's full-batch steps;
    (0, 0.0) when the window is empty. Chunks of one Verify call reach every stream together, so the window holds
    whole calls."""
    if not outs or any(not o["chunks"] for o in outs):
        return 0, 0.0
    start = max(o["chunks"][0][0] for o in outs)
    end = min(o["chunks"][-1][0] for o in outs)
    if end <= start:
        return 0, 0.0
    return sum(n for o in outs for t, n in o["chunks"] if start < t <= end), end - start


def _run_batch(stub, prompts: list[list[int]], max_new: int) -> dict:
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda q: _generate(stub, q, max_new), prompts))
    # Decode rate after the (batched) prefill: tokens past each first one over the span from the first first token.
    tokens = sum(len(o["tokens"]) - 1 for o in outs)
    span = max(o["end"] for o in outs) - min(o["first"] for o in outs)
    steps = sum(o["usage"].verify_steps for o in outs)
    full_tokens, full_wall = full_batch(outs)
    return {"outs": outs, "tokens": tokens, "wall": span, "seq_steps": steps, "full_tokens": full_tokens,
            "full_wall": full_wall}


class Stack:
    """Target + SYNTHETIC draft + plain and speculative gateways, as child processes."""

    def __init__(self, args, path: Path, config, rate: float, oracle_path: Path, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.ports = {k: free_port() for k in ("target", "draft", "target_m", "draft_m", "ar", "ar_http", "spec",
                                                "spec_http")}
        max_bs = max(args.batch_sizes)
        kv = max_bs * (args.prompt_len + args.max_new_tokens + 2 * config.ndt + 64) + 4096
        def model_flags(device: str) -> list[str]:
            flags = ["--model-path", str(path), "--load-format", "dummy", "--device", device, "--dtype", args.dtype,
                     "--max-total-tokens", str(kv), "--cuda-graph-max-bs", str(max_bs), "--log-level", "warning"]
            return flags + (["--attention-backend", args.attention_backend] if args.attention_backend else [])

        model = model_flags(args.device)
        spec = ["--speculative-algorithm", "SYNTHETIC", "--speculative-num-steps", str(config.steps),
                "--speculative-eagle-topk", str(config.topk), "--speculative-num-draft-tokens", str(config.ndt)]
        if args.adaptive:  # draft steps per batch size (gateway), a verify graph and a static draft step per tier
            spec.append("--speculative-adaptive")
        p = self.ports
        target = ["target", *model, *spec, "--service-port", str(p["target"]), "--metrics-port", str(p["target_m"])]
        if args.disable_cuda_graph:
            target.append("--disable-cuda-graph")
        if args.margin_weights:
            target.append("--synthetic-margin-weights")
        target += shlex.split(getattr(args, "target_args", "") or "")
        synthetic = ["--synthetic-oracle", str(oracle_path), "--synthetic-accept-rate", repr(rate),
                     "--synthetic-draft-vocab", str(args.draft_vocab), "--random-seed", str(args.seed)]
        if args.head_hidden is not None:
            synthetic += ["--synthetic-head-hidden", str(args.head_hidden)]
        draft = ["draft", *model_flags(args.draft_device or args.device), *spec, "--service-port", str(p["draft"]),
                 "--metrics-port", str(p["draft_m"]), *synthetic]
        # As in-process: the served shape drafts through the static step (one CUDA graph per Propose, tandem
        # serve's default); --disable-static-draft-step steps from the host (per-forward graphs with --draft-cuda-graph)
        if args.disable_cuda_graph or (args.disable_static_draft_step and not args.draft_cuda_graph):
            draft.append("--disable-cuda-graph")
        elif args.disable_static_draft_step:
            draft.append("--disable-static-draft-step")
        gateway = ["gateway", "--model-path", str(path), "--target-address", f"127.0.0.1:{p['target']}",
                   "--max-running-requests", str(max_bs), "--log-level", "warning"]
        if getattr(args, "profile_dir", None):  # every process can profile (started by the gateway's /start_profile)
            profile = ["--profile-dir", str(Path(args.profile_dir).resolve())]
            target, draft, gateway = target + profile, draft + profile, gateway + profile
        self.colocate = args.colocate
        if args.colocate:  # the draft in the target's process (--colocate-draft): no draft process, one call a step
            target += ["--colocate-draft", *synthetic]
            if args.disable_static_draft_step:
                target.append("--disable-static-draft-step")
        drafts = [] if args.colocate else [("draft", draft)]
        draft_address = [] if args.colocate else ["--draft-address", f"127.0.0.1:{p['draft']}"]
        for name, cmd in (("target", target), *drafts,
                          ("gateway-ar", [*gateway, "--grpc-port", str(p["ar"]), "--port", str(p["ar_http"])]),
                          ("gateway-spec", [*gateway, *spec, *shlex.split(args.gateway_args or ""), *draft_address,
                                            "--grpc-port", str(p["spec"]), "--port", str(p["spec_http"])])):
            log = log_dir / f"{name}-{config.steps}-{config.topk}-{config.ndt}.log"
            self.logs.append(log)
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tandem.cli", *cmd], cwd=REPO_ROOT,
                                               stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                               env=dict(os.environ, PYTHONUNBUFFERED="1")))
        self.channels = {k: grpc.insecure_channel(f"127.0.0.1:{p[k]}") for k in ("ar", "spec")}
        self.stubs = {k: pb_grpc.GatewayStub(c) for k, c in self.channels.items()}

    def wait_ready(self, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        for key, channel in self.channels.items():
            while True:
                self._check_alive()
                try:
                    grpc.channel_ready_future(channel).result(timeout=2)
                    self.stubs[key].Info(pb.InfoRequest(), timeout=10)
                    break
                except (grpc.FutureTimeoutError, grpc.RpcError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"gateway {key} not ready after {deadline_s:.0f} s; logs: {self.logs}")

    def _check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() is not None:
                tail = log.read_text()[-3000:] if log.exists() else ""
                raise RuntimeError(f"{log.name} exited with {proc.returncode}:\n{tail}")

    def metrics(self) -> dict:
        drafts_m = self.ports["target_m" if self.colocate else "draft_m"]
        return {"verify": _metric(self.ports["target_m"], "Verify"), "propose": _metric(drafts_m, "Propose"),
                "prefill": _metric(self.ports["target_m"], "Prefill"), "run_ahead": _run_ahead(self.ports["target_m"])}

    def close(self) -> None:
        for c in self.channels.values():
            c.close()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def bench_services(args, configs) -> list[dict]:
    from speculative import PROMPT_VOCAB, _row, make_prompts, oracle_mismatches

    path = model_dir(args.tiny)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    oracle_path = out_dir / "oracle.json"
    extra = max(c.steps for c in configs) + 1
    rows = []
    for config in sorted(configs, key=lambda c: c.ndt):
        rate = config.rate(args.accept_rate)
        if oracle_path.exists():
            oracle_path.unlink()
        stack = Stack(args, path, config, rate, oracle_path, out_dir)
        try:
            start = time.perf_counter()
            stack.wait_ready(900)
            print(f"[{config.name}] services ready in {time.perf_counter() - start:.0f} s", flush=True)
            warm = make_prompts(1, args.prompt_len, PROMPT_VOCAB, args.seed + 99)
            _generate(stack.stubs["ar"], warm[0], 8)
            _generate(stack.stubs["spec"], warm[0], 2 * config.steps)
            entries: dict[tuple[int, ...], list[int]] = {}
            for bs in args.batch_sizes:
                prompts = make_prompts(bs, args.prompt_len, PROMPT_VOCAB, args.seed)
                # Both timed runs find the prompts in the target's prefix cache: the gateway admits a batch's
                # concurrent requests in waves (a Prefill between steps), and the decode span counts every later
                # wave's prefill. Without this the AR run (the prompts' first visit) paid full prefills inside its
                # span and the speculative run (cache hits) did not: session 23, H100, 8B batch 64 -- AR at 0.53 of
                # its Verify calls' rate, the tree's speedup overstated.
                _run_batch(stack.stubs["ar"], prompts, 1)
                before = stack.metrics()
                ar = _run_batch(stack.stubs["ar"], prompts, args.max_new_tokens + extra)
                ar.update(_timings(before, stack.metrics()))
                entries.update({tuple(q): o["tokens"] for q, o in zip(prompts, ar["outs"])})
                tmp = oracle_path.with_suffix(".tmp")
                Oracle(entries).save(tmp)
                os.replace(tmp, oracle_path)  # the draft re-reads it at the next Prefill
                ar_tok_s = ar["tokens"] / ar["wall"]
                ar_row = _row("AR", None, bs, ar, ar_tok_s, ar_tok_s, 1.0, None)
                if not any(r["config"] == "AR" and r["batch_size"] == bs for r in rows):
                    rows.append(ar_row)
                for run in range(args.calibration_runs + 1):
                    before = stack.metrics()
                    sp = _run_batch(stack.stubs["spec"], prompts, args.max_new_tokens)
                    sp.update(_timings(before, stack.metrics()))
                    outputs = {tuple(q): o["tokens"] for q, o in zip(prompts, sp["outs"])}
                    mismatched = oracle_mismatches(entries, outputs)
                    if not mismatched or run == args.calibration_runs:
                        break
                    entries.update({k: outputs[k] for k in mismatched})  # the verify numerics' greedy path
                    Oracle(entries).save(tmp)
                    os.replace(tmp, oracle_path)
                stats = {"accepted_draft_tokens": sum(o["usage"].accepted_draft_tokens for o in sp["outs"]),
                         "proposed_draft_tokens": sum(o["usage"].proposed_draft_tokens for o in sp["outs"]),
                         "calibration_runs": run, "outputs_off_oracle": len(mismatched)}
                row = _row(config.name, config, bs, sp, sp["tokens"] / sp["wall"], ar_tok_s, rate, stats)
                row["ar_tok_s_same_stack"] = ar_tok_s
                if args.profile_dir and bs in (args.profile_batch_sizes or args.batch_sizes):
                    row["profile"] = profile_prompt(
                        stack.ports["spec_http"],
                        lambda: _run_batch(stack.stubs["spec"], prompts, args.max_new_tokens),
                        re.sub(r"[^A-Za-z0-9_-]", "-", f"{config.name}-bs{bs}"))
                rows.append(row)
                full = (f"{row['tok_s_full_batch']:,.1f} vs AR {ar_row['tok_s_full_batch']:,.1f}"
                        if row["tok_s_full_batch"] and ar_row["tok_s_full_batch"] else "-")
                print(f"[bs {bs}] {config.name}: tau {row['tau']:.2f} (expected {row['tau_expected']:.2f}), "
                      f"{row['tok_s']:,.1f} tok/s vs AR {ar_tok_s:,.1f} ({row['speedup']:.2f}x), full batch {full}, "
                      f"verify {row['t_verify_ms']:.2f} ms + draft {row['t_draft_ms']:.2f} ms per step, efficiency "
                      f"{row['efficiency']:.3f}; per step: wall {row['wall_per_step_ms']:.2f} ms, handlers verify "
                      f"{row['t_verify_rpc_ms']:.2f} + propose {row['t_draft_rpc_ms']:.2f} ms; run-ahead (sequences) "
                      f"AR {ar['run_ahead']}, speculative {sp['run_ahead']}; Prefill calls (handler s) AR {ar['prefills']} "
                      f"({ar['t_prefill_rpc']:.3f}), speculative {sp['prefills']} ({sp['t_prefill_rpc']:.3f})", flush=True)
        finally:
            stack.close()
    rows.sort(key=lambda r: (r["batch_size"], r["config"] != "AR"))
    return rows


def _timings(before: dict, after: dict) -> dict:
    """Summed verify / propose model seconds and the number of Verify RPCs (steps) between two snapshots."""
    dv, dp = after["verify"][0] - before["verify"][0], after["propose"][0] - before["propose"][0]
    steps = int(after["verify"][1] - before["verify"][1])
    return {"t_verify": dv, "t_draft": dp, "steps": steps, "t_verify_rpc": after["verify"][2] - before["verify"][2],
            "t_draft_rpc": after["propose"][2] - before["propose"][2],
            # Prefill calls inside the run (admission waves) and their handler seconds
            "prefills": int(after["prefill"][1] - before["prefill"][1]),
            "t_prefill_rpc": after["prefill"][2] - before["prefill"][2],
            # sequences the target had run ahead (a miss runs its device work for nothing before the call's own,
            # and t_verify does not count it)
            "run_ahead": {k: after["run_ahead"][k] - before["run_ahead"][k] for k in ("hit", "miss")}}
