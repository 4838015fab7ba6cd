"""Target-only decode through the running services: `tandem serve` (gateway + target as separate processes, gRPC
between them) on dummy weights, driven by gRPC `Generate` — the number to compare with the in-process engine
(bench/decode.py) to get the cost of the service overlay.

    python bench/serve_decode.py --out-dir bench/results/serve_decode            # Llama-3.1-8B shapes on CUDA
    python bench/serve_decode.py --tiny --device cpu --max-new-tokens 32         # smoke run here

--profile-dir DIR: after the timed runs, one more batch-1 request of --profile-tokens tokens under /start_profile and
/stop_profile: every process writes its torch trace, Python profile and summary (GPU busy vs idle per Verify call)
into DIR; the timed numbers are unprofiled.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from protos.tandem.v1 import tandem_pb2 as pb  # noqa: E402
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402
from bench.accept import profile_prompt  # noqa: E402
from tandem.args import REPO_ROOT  # noqa: E402
from tandem.launch import free_port  # noqa: E402,F401 (re-exported for the other benches)

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
TINY = {**LLAMA_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 2048, "torch_dtype": "float32"}


def model_dir(tiny: bool) -> Path:
    """A config-only checkpoint folder (weights are dummy) with a tokenizer so the gateway can start."""
    path = Path(tempfile.mkdtemp(prefix="tandem-dummy-"))
    (path / "config.json").write_text(json.dumps(TINY if tiny else LLAMA_8B))
    tokenizer_src = next(p for p in (REPO_ROOT / "models").iterdir() if (p / "tokenizer.json").exists())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, path / name)
    return path


def generate(stub, prompt: list[int], max_new_tokens: int) -> tuple[int, float]:
    first = None
    tokens = 0
    request = pb.GenerateRequest(token_ids=prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                                 skip_detokenize=True)
    for response in stub.Generate(request, timeout=600):
        if first is None and response.token_ids:
            first = time.perf_counter()
        tokens += len(response.token_ids)
    end = time.perf_counter()
    # Decode rate excludes the prefill (time to the first token), as the in-process bench does.
    return tokens, (end - first) / max(tokens - 1, 1)


def gateway_times(http_port: int) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) of the gateway's Verify RPC, Prefill RPC and loop-step histograms (tandem:*_time_seconds,
    as the gateway times them: the RPC's round trip; a step of the whole running batch, delivery included)."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("verify", "prefill", "step"):
        total = re.search(rf"^tandem:{name}_time_seconds_sum(?:{{[^}}]*}})? (\S+)$", text, re.M)
        count = re.search(rf"^tandem:{name}_time_seconds_count(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[name] = (float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0)
    return out


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache (the model services compile there): new entries during a run are kernels
    JIT-compiled in the serving path (a shape specialisation the start-up did not meet), whose seconds land in that
    run's calls."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return len(os.listdir(cache)) if cache.is_dir() else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out-dir", default="bench/results/serve_decode")
    p.add_argument("--profile-dir", default=None, help="profile one more batch-1 request into DIR (see above)")
    p.add_argument("--profile-tokens", type=int, default=64)
    p.add_argument("extra", nargs="*", help="extra tandem serve flags (after --)")
    args = p.parse_args()
    profile = ["--profile-dir", str(Path(args.profile_dir).resolve())] if args.profile_dir else []
    path = model_dir(args.tiny)
    http, grpc_port = free_port(), free_port()
    dtype = "float32" if args.tiny else "bfloat16"
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model-path", str(path), "--load-format", "dummy",
           "--device", args.device, "--dtype", dtype, "--port", str(http), "--grpc-port", str(grpc_port),
           "--log-level", "warning", *profile, *args.extra]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    results = {"config": "tiny" if args.tiny else "llama-3.1-8b-shape", "device": args.device, "runs": []}
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.GatewayStub(channel)
        stub.Info(pb.InfoRequest(), timeout=540, wait_for_ready=True)
        rng = random.Random(0)
        vocab = 2048  # ids valid for every tokenizer the gateway may have loaded
        generate(stub, [rng.randrange(3, vocab) for _ in range(args.prompt_len)], 16)  # warm-up (graphs, caches)
        for bs in args.batch_sizes:
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(bs)]
            before, kernels = gateway_times(http), triton_cache_entries()
            start = time.perf_counter()
            with ThreadPoolExecutor(bs) as pool:
                outs = list(pool.map(lambda q: generate(stub, q, args.max_new_tokens), prompts))
            elapsed = time.perf_counter() - start
            after = gateway_times(http)
            per_token_s = sum(o[1] for o in outs) / bs
            # where the wall goes, as the gateway saw it: Verify round trips, Prefill round trips, loop steps
            timed = {f"{k}_ms": 1e3 * (after[k][0] - before[k][0]) / max(after[k][1] - before[k][1], 1)
                     for k in after}
            timed.update({f"{k}_calls": after[k][1] - before[k][1] for k in after})
            results["runs"].append({"batch_size": bs, "decode_tok_s_per_seq": 1 / per_token_s,
                                    "decode_tok_s_total": bs / per_token_s, "ms_per_step": per_token_s * 1e3,
                                    "tokens": sum(o[0] for o in outs), "wall_s": elapsed,
                                    "kernels_compiled": triton_cache_entries() - kernels, **timed})
        if args.profile_dir:
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
            results["profile"] = profile_prompt(http, lambda: generate(stub, prompt, args.profile_tokens))
        channel.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = ["| batch | ms/step | tok/s per seq | tok/s total | wall s | Verify calls (ms each) | loop steps (ms each) "
             "| Prefill calls (ms each) | kernels JIT-compiled |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch_size']} | {r['ms_per_step']:.2f} | {r['decode_tok_s_per_seq']:.1f} | "
              f"{r['decode_tok_s_total']:.1f} | {r['wall_s']:.2f} | {r['verify_calls']:.0f} ({r['verify_ms']:.2f}) | "
              f"{r['step_calls']:.0f} ({r['step_ms']:.2f}) | {r['prefill_calls']:.0f} ({r['prefill_ms']:.2f}) | "
              f"{r['kernels_compiled']} |"
              for r in results["runs"]]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(results, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
