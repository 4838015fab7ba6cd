"""Acceptance and speed per speculative algorithm through the real stack (three processes, gRPC Generate).

For each configuration: start `tandem serve`, send held-out code prompts one at a time (batch 1, greedy unless
--temperature; the bundled model's committed heldout_prompts.jsonl as token ids when present), and record mean accept length (tokens per target step, bonus included), draft acceptance rate and
output tokens/s. Prints JSON and a markdown table, and saves a PNG bar chart when matplotlib is available.

    python bench/accept.py --num-prompts 8 --max-new-tokens 64 --out bench/results/accept_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from protos.tandem.v1 import tandem_pb2 as pb  # noqa: E402
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402
from tandem.args import DEFAULT_MODEL  # noqa: E402
from tandem.launch import free_port  # noqa: E402,F401 (re-exported for the other benches)

CONFIGS = {
    "AR": [],
    # Plain decoding at one decode step per Verify call (the default is 4 when nothing drafts: tandem/services.py)
    "AR-1step": ["--num-continuous-decode-steps", "1"],
    "NGRAM": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"],
    "STANDALONE-chain": ["--speculative-algorithm", "STANDALONE"],
    "STANDALONE-tree": ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "4",
                        "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"],
    # With no model flags EAGLE3 serves the bundled target's own head (tandem/args.py DEFAULT_EAGLE3).
    "EAGLE3-chain": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "EAGLE3-tree": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5",
                    "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"],
    # What a user gets with no step flags (auto shapes), and the 5/4/16 tree drafting step by step from the host.
    "EAGLE3-auto": ["--speculative-algorithm", "EAGLE3"],
    "EAGLE3-tree-eager": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5",
                          "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16",
                          "--disable-static-draft-step"],
    "NGRAM-auto": ["--speculative-algorithm", "NGRAM"],
    # EAGLE on the bundled target serves its own MTP layer with no model flags (as SGLang's EAGLE on an MTP checkpoint).
    "EAGLE-chain": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "EAGLE-tree": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "5",
                   "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"],
    # NEXTN drafts with the target's own MTP layers when --model-path has them (else the bundled EAGLE-2 head).
    "NEXTN-chain": ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "NEXTN-tree": ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
                   "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
    # Multi-layer EAGLE: step s runs MTP layer s (a target with >= 2 MTP layers).
    "NEXTN-multi": ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
                    "--enable-multi-layer-eagle"],
    # UNO: the target drafts with the bundled LoRA (models/tandem-demo-code-uno), linear F=4 and tree F=4/K=4/Q=8
    "UNO-linear": ["--speculative-algorithm", "UNO", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
                   "--speculative-num-draft-tokens", "4"],
    "UNO-tree": ["--speculative-algorithm", "UNO", "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                 "--speculative-num-draft-tokens", "8"],
    # DFLASH: the bundled draft (models/tandem-demo-code-dflash, block 8); DFLASH-tmp: one trained into
    # /tmp/demo-dflash (bench/gpu_session.sh dflash_uno / dflash_bundle)
    "DFLASH": ["--speculative-algorithm", "DFLASH"],
    "DFLASH-tmp": ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/tmp/demo-dflash"],
}
# Pre-drafting (--enable-overlap-drafting): the draft drafts step i+1 from a guess while step i verifies (A/B)
CONFIGS.update({f"{name}-predraft": [*CONFIGS[name], "--enable-overlap-drafting"]
                for name in ("EAGLE3-chain", "EAGLE3-tree", "NEXTN-chain", "STANDALONE-chain")})
# The draft in the target's process (--colocate-draft): each Verify drafts the next tree, one round trip per step (A/B)
CONFIGS.update({f"{name}-colocate": [*CONFIGS[name], "--colocate-draft"]
                for name in ("EAGLE3-chain", "EAGLE3-tree", "EAGLE3-auto", "NEXTN-chain", "NEXTN-tree",
                             "STANDALONE-chain", "STANDALONE-tree", "NGRAM", "NGRAM-auto", "EAGLE-tree")})
# A draft process of its own (serve co-locates a draft sharing the target's device by default: the A/B)
CONFIGS.update({f"{name}-apart": [*CONFIGS[name], "--no-colocate-draft"]
                for name in ("EAGLE3-chain", "EAGLE3-tree", "EAGLE3-auto", "STANDALONE-chain", "NGRAM-auto")})
# Co-located speculative steps back to back: k verify+draft steps per Verify call (--num-continuous-decode-steps)
CONFIGS.update({f"{name}-k{k}": [*CONFIGS[name], "--colocate-draft", "--num-continuous-decode-steps", str(k)]
                for name in ("EAGLE3-chain", "EAGLE3-tree", "EAGLE3-auto", "STANDALONE-chain") for k in (2, 4)})
# torch.compile'd static steps and decode graphs at batch 1 (--enable-torch-compile: fewer, fused kernels per graph;
# the graphs' host replay cost grows with their node count) against the plain ones (A/B)
CONFIGS.update({f"{name}-compile": [*CONFIGS[name], "--enable-torch-compile", "--torch-compile-max-bs", "1"]
                for name in ("AR", "EAGLE3-tree", "EAGLE3-auto", "STANDALONE-chain", "EAGLE3-tree-k4",
                             "EAGLE3-auto-k4", "STANDALONE-chain-k4")})
# The target pod runs the call it expects next while the answer travels (--enable-run-ahead; A/B)
CONFIGS.update({f"{name}-ahead": [*CONFIGS[name], "--enable-run-ahead"]
                for name in ("AR", "EAGLE3-tree", "EAGLE3-tree-k4", "EAGLE3-auto", "STANDALONE-chain",
                             "STANDALONE-chain-k4")})
# A call's speculative steps after its first one step by step instead of chained on the device
# (--disable-chained-speculative-steps; A/B), and longer chained calls (8 / 16 speculative steps per call)
CONFIGS.update({f"{name}-k{k}": [*CONFIGS[name], "--colocate-draft", "--num-continuous-decode-steps", str(k)]
                for name in ("EAGLE3-tree", "EAGLE3-auto", "STANDALONE-chain") for k in (8, 16)})
CONFIGS.update({f"{name}-unchained": [*CONFIGS[name], "--disable-chained-speculative-steps"]
                for name in ("EAGLE3-tree", "EAGLE3-auto", "EAGLE3-chain", "STANDALONE-chain", "EAGLE3-tree-k8")})
# Run-ahead off (on by default for a CUDA target that decodes plainly or drafts in its own process; A/B)
CONFIGS.update({f"{name}-noahead": [*CONFIGS[name], "--disable-run-ahead"]
                for name in ("AR", "EAGLE3-tree", "EAGLE3-auto", "STANDALONE-chain", "NGRAM-auto")})
# The same shapes verifying eagerly (the static verify step, one CUDA graph per Verify, is the default; A/B)
CONFIGS.update({f"{name}-eager-verify": [*flags, "--disable-static-verify-step"] for name, flags in list(CONFIGS.items())
                if not name.startswith("AR") and "--disable-static-draft-step" not in flags})


def heldout_prompts(model_dir: Path, n: int, prompt_chars: int) -> list[str] | list[list[int]]:
    """Held-out code never seen in training: the model's heldout_prompts.jsonl (token ids) when it has one, else
    windows of the standard-library files listed in heldout_files.txt."""
    committed = model_dir / "heldout_prompts.jsonl"
    if committed.exists():
        with open(committed) as f:
            return [json.loads(line)["prompt_ids"] for line in f if line.strip()][:n]
    listing = model_dir / "heldout_files.txt"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = listing.read_text().split() if listing.exists() else []
    prompts = []
    for name in names:
        path = stdlib / name
        if path.exists():
            text = path.read_text(errors="replace")
            if len(text) > prompt_chars * 2:
                start = len(text) // 3
                prompts.append(text[start:start + prompt_chars])
        if len(prompts) == n:
            break
    return prompts or ["def main():\n    "] * n


def wait_ready(proc: subprocess.Popen, channel: grpc.Channel, name: str, timeout_s: float = 300.0) -> None:
    """Until `tandem serve` answers on `channel`; fails at once when it exits first (a child died while starting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: tandem serve exited with {proc.returncode} before it was ready")
        try:
            grpc.channel_ready_future(channel).result(timeout=2)
            return
        except grpc.FutureTimeoutError:
            if time.monotonic() > deadline:
                raise


def run_config(name: str, flags: list[str], prompts: list[str] | list[list[int]], args) -> dict:
    http, grpc_port = free_port(), free_port()
    profile = [] if not args.profile_dir else ["--profile-dir", str(Path(args.profile_dir).resolve() / name)]
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(http), "--grpc-port", str(grpc_port),
           "--log-level", "warning", *flags, *profile, *args.extra]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        wait_ready(proc, channel, name)
        stub = pb_grpc.GatewayStub(channel)
        stub.Info(pb.InfoRequest(), timeout=300, wait_for_ready=True)
        run_prompts(stub, prompts[:args.concurrency], 8, args)  # warm-up
        tokens = steps = accepted = proposed = 0
        start = time.perf_counter()
        results = run_prompts(stub, prompts, args.max_new_tokens, args)
        elapsed = time.perf_counter() - start
        outputs = [ids for _, ids, _ in results]
        ttft = sum(first for _, _, first in results) / len(results)
        for usage, _, _ in results:
            tokens += usage.completion_tokens
            steps += usage.verify_steps + 1
            accepted += usage.accepted_draft_tokens
            proposed += usage.proposed_draft_tokens
        rpc_ms = gateway_rpc_ms(http)  # (before the profiled prompt below)
        if args.profile_dir:
            profiled = profile_prompt(http, lambda: run_prompts(stub, prompts[:args.concurrency],
                                                                args.max_new_tokens, args))
        channel.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    return {"config": name, "prompts": len(prompts), "completion_tokens": tokens,
            "mean_accept_length": tokens / steps, "accept_rate": accepted / proposed if proposed else 0.0,
            # ms per step of the batch: with `concurrency` requests in flight, `concurrency` sequence-steps at once
            "tokens_per_s": tokens / elapsed, "seconds": elapsed, "concurrency": args.concurrency,
            "ms_per_step": 1e3 * elapsed * args.concurrency / steps, **rpc_ms,
            # the time to first token (prefill, the first draft, the gateway) and the rate after it, per stream
            "ttft_ms": 1e3 * ttft, "decode_tokens_per_s": (tokens - len(prompts)) / (elapsed - ttft * len(prompts))
            if args.concurrency <= 1 else None,
            **({"profile": profiled} if args.profile_dir else {}), "outputs": outputs}


def profile_prompt(http_port: int, generate, profile_id: str = "accept") -> list[dict]:
    """One more prompt under /start_profile ... /stop_profile (after the timed ones, which ran unprofiled): every
    process of the stack writes its trace, Python profile and summary; returns the processes' entries, each with its
    summary's busy line."""
    import urllib.request

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}{path}", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())

    post("/start_profile", {"profile_id": profile_id})
    generate()
    processes = post("/stop_profile", {})["processes"]
    for p in processes:
        summary = next((f for f in p.get("files", []) if f.endswith(".summary.txt")), None)
        if summary:
            busy = re.search(r"^Python busy: .*$", Path(summary).read_text(), re.M)
            p["busy"] = busy.group(0) if busy else None
            print(f"  profile {p['process']}: {p['num_steps']} steps; {p['busy']}; {summary}", flush=True)
    return processes


def _busy_ms(line: str | None) -> str:
    """The ms-per-step figure of a summary's "Python busy: X ms per step ..." line."""
    found = re.search(r"busy: ([0-9.]+) ms", line or "")
    return found.group(1) if found else "-"


def gateway_rpc_ms(http_port: int) -> dict:
    """Mean ms per batched Propose and Verify RPC as the gateway timed them (its Prometheus histograms; the
    warm-up request included), and the wall ms per step they add up to."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("draft_time", "verify_time"):
        total = sum(float(v) for v in re.findall(rf"^tandem:{name}_seconds_sum(?:{{[^}}]*}})? (\S+)$", text, re.M))
        count = sum(float(v) for v in re.findall(rf"^tandem:{name}_seconds_count(?:{{[^}}]*}})? (\S+)$", text, re.M))
        out[f"{name.split('_')[0]}_rpc_ms"] = 1e3 * total / count if count else 0.0
        out[f"{name.split('_')[0]}_rpcs"] = int(count)  # a co-located draft: Propose RPCs only for first steps
    return out


def hf_peers(prompts: list[str] | list[list[int]], args) -> list[dict]:
    """HF transformers peers on the same prompts (token ids), batch 1, greedy, ignore eos."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.args import DEFAULT_DRAFT
    from tools.spec_eval import hf_tokens_per_s

    if prompts and isinstance(prompts[0], str):
        tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    dtype = torch.bfloat16 if args.hf_peers.startswith("cuda") else torch.float32
    target = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=dtype).to(args.hf_peers).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(DEFAULT_DRAFT), dtype=dtype).to(args.hf_peers).eval()
    rows = []
    for name, kw in (("HF generate", {}), ("HF assisted (draft)", {"assistant": draft}),
                     ("HF prompt lookup (10)", {"prompt_lookup_num_tokens": 10})):
        r = hf_tokens_per_s(target, prompts, args.max_new_tokens, **kw)
        rows.append({"config": name, "prompts": len(prompts), "completion_tokens": r["tokens"],
                     "mean_accept_length": float("nan"), "accept_rate": float("nan"),
                     "tokens_per_s": r["tokens_per_s"], "seconds": r["seconds"]})
    return rows


def run_prompts(stub, prompts: list, max_new_tokens: int, args) -> list[tuple[pb.GenerateUsage, list[int], float]]:
    """The prompts' Generates, `args.concurrency` streams in flight at once (1: one after another); in order."""
    if args.concurrency <= 1:
        return [stub_generate(stub, prompt, max_new_tokens, args) for prompt in prompts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(lambda prompt: stub_generate(stub, prompt, max_new_tokens, args), prompts))


def stub_generate(stub, prompt: str | list[int], max_new_tokens: int, args
                  ) -> tuple[pb.GenerateUsage, list[int], float]:
    """One streamed Generate: its usage, every token id it committed and the seconds to its first token."""
    source = {"text": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
    request = pb.GenerateRequest(**source, max_new_tokens=max_new_tokens, temperature=args.temperature,
                                 ignore_eos=True)
    if args.temperature > 0:
        request.seed = 1
    last, ids, first = None, [], None
    start = time.perf_counter()
    for last in stub.Generate(request, timeout=600):
        if first is None and last.token_ids:
            first = time.perf_counter() - start
        ids.extend(last.token_ids)
    return last.usage, ids, first if first is not None else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=1,
                   help="Generate streams in flight at once (the batch the services see; 1: one prompt after "
                        "another); more prompts than held-out ones repeat them")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default=None, help="JSON output path (a .png with the same stem is written too)")
    p.add_argument("--hf-peers", default=None, metavar="DEVICE",
                   help="also time HF transformers generate, assisted generation (the bundled STANDALONE draft as "
                        "assistant_model) and prompt lookup on the same prompts, batch 1, greedy, on this device "
                        "(e.g. cuda), after the services runs: peers measured in the same run")
    p.add_argument("--profile-dir", default=None,
                   help="after each configuration's timed prompts, profile one more through /start_profile and "
                        "/stop_profile: every process writes a torch trace, a Python profile and a summary into "
                        "DIR/<config> (the timed numbers are unprofiled)")
    p.add_argument("extra", nargs="*", help="extra flags for tandem serve (after --)")
    args = p.parse_args()
    prompts = heldout_prompts(DEFAULT_MODEL, args.num_prompts, args.prompt_chars)
    prompts = [prompts[i % len(prompts)] for i in range(max(args.num_prompts, args.concurrency))]
    results = []
    for name in args.configs:  # each row as it lands: a run stopped by a time limit keeps what it measured
        results.append(run_config(name, CONFIGS[name], prompts, args))
        r = results[-1]
        print(f"  {name}: {r['tokens_per_s']:.1f} tok/s, mean accept length {r['mean_accept_length']:.2f}, "
              f"{r.get('ms_per_step', float('nan')):.2f} ms per step, TTFT {r.get('ttft_ms', float('nan')):.2f} ms",
              flush=True)
        if args.out:
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps(results, indent=2))
    if args.hf_peers:
        results += hf_peers(prompts, args)
    ar = next((r for r in results if r["config"] == "AR"), None)
    for r in results:
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        if ar and "outputs" in r and args.temperature == 0:  # greedy speculation must reproduce plain decoding
            r["identical_to_ar"] = r["outputs"] == ar["outputs"]
    print(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in results], indent=2))
    print("\n| config | mean accept length | accept rate | tok/s | speedup vs AR | ms per step | TTFT ms | "
          "Propose RPCs (ms) | Verify RPCs (ms) | output == AR |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        same = {True: "yes", False: "**NO**"}.get(r.get("identical_to_ar"), "-")
        print(f"| {r['config']} | {r['mean_accept_length']:.2f} | {r['accept_rate']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {speedup} | {r.get('ms_per_step', float('nan')):.2f} | "
              f"{r.get('ttft_ms', float('nan')):.2f} | {r.get('draft_rpcs', 0)} ({r.get('draft_rpc_ms', 0):.2f}) | "
              f"{r.get('verify_rpcs', 0)} ({r.get('verify_rpc_ms', 0):.2f}) | {same} |")
    profiled = [r for r in results if r.get("profile")]
    if profiled:  # Python busy ms per step of each process (--profile-dir: the summaries' first numbers)
        print("\n| config | Python busy ms per step (process: steps) |\n|---|---|")
        for r in profiled:
            cells = [f"{p['process'].split('-')[0]} {_busy_ms(p.get('busy'))} ({p.get('num_steps', 0)})"
                     for p in r["profile"]]
            print(f"| {r['config']} | {', '.join(cells)} |")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        out.with_suffix(".partial.json").unlink(missing_ok=True)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
            names = [r["config"] for r in results]
            ax[0].bar(names, [r["mean_accept_length"] for r in results])
            ax[0].set_title("mean accept length")
            ax[1].bar(names, [r["tokens_per_s"] for r in results])
            ax[1].set_title("tokens/s (batch 1)")
            for a in ax:
                a.tick_params(axis="x", rotation=30)
            fig.tight_layout()
            fig.savefig(out.with_suffix(".png"))
        except ImportError:
            print("matplotlib not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
