"""Target-only decode speed of the in-process ModelRunner (CUDA graphs on and off) against HF transformers `generate`
and the bandwidth ceiling, on random weights of Llama-3.1-8B shape (or a tiny config with --tiny, for CPU smoke runs).

Per batch size: prefill `--prompt-len` random tokens per sequence, then time `--steps` greedy decode steps (argmax
read back to the host every step, as serving does). Also times one verify forward of `--num-draft-tokens` tree
tokens at batch 1 against a decode step. The ceiling is measured copy bandwidth (bytes read + written by a large
device copy) over the bytes one step must read (weights + the batch's KV). Prints JSON and a markdown table, writes
results.json, results.md and decode.png under --out-dir.

    python bench/decode.py --out-dir bench/results/decode_h200          # GPU, 8B shapes
    python bench/decode.py --tiny --device cpu --steps 8                # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.config import EngineConfig, ModelConfig  # noqa: E402
from runtime.memory import kv_bytes_per_block  # noqa: E402
from runtime.model_runner import ModelRunner, SeqForward  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def model_config(tiny: bool) -> ModelConfig:
    if tiny:
        return ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                           max_position_embeddings=4096, rope_theta=500000.0,
                           rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 1024})
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5,
                       max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting read + write; median of 10 after a warm-up."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    return 2 * src.numel() * src.element_size() / times[len(times) // 2]


def decode_steps(runner: ModelRunner, seqs: list[str], next_ids: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds for `steps` greedy decode steps of all sequences (host readback included): the engine's greedy path,
    lm_head and argmax on device (inside the graph when one runs), one small readback per step."""
    sync(runner.device)
    start = time.perf_counter()
    for _ in range(steps):
        out = runner.forward([SeqForward(s, [t]) for s, t in zip(seqs, next_ids)], outputs="argmax")
        next_ids = [row[-1] for row in out.argmax]
    sync(runner.device)
    return time.perf_counter() - start, next_ids


def bench_ours(cfg: ModelConfig, args, device: torch.device) -> dict:
    max_bs = max(args.batch_sizes)
    ctx = args.prompt_len + args.warmup_steps + args.steps + args.num_draft_tokens + 16
    blocks = max_bs * (-(-ctx // 16) + 1)
    backend = args.attention_backend or ("triton" if device.type == "cuda" else "torch")
    runner = ModelRunner(None, EngineConfig(
        device=str(device), dtype=args.dtype, load_format="dummy", attention_backend=backend, num_kv_blocks=blocks,
        cuda_graph_max_bs=max_bs, cuda_graph_num_draft_tokens=args.num_draft_tokens), cfg)
    weights_bytes = runner.weight_bytes()
    rng = random.Random(0)
    results: dict = {"weights_bytes": weights_bytes, "attention_backend": backend,
                     "graphs_captured": runner.graph_runner is not None, "decode": {}, "verify": {}}
    modes = [("graphs", True), ("eager", False)] if runner.graph_runner is not None else [("eager", False)]
    for bs in args.batch_sizes:
        seqs = [f"b{bs}-{i}" for i in range(bs)]
        for s in seqs:
            runner.add_seq(s)
        for first in range(0, bs, 8):  # prefill 8 sequences at a time: bounded activations
            runner.forward([SeqForward(s, [rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len)])
                            for s in seqs[first:first + 8]])
        for name, use_graph in modes:
            runner.use_cuda_graph = use_graph
            start_ids = [rng.randrange(cfg.vocab_size) for _ in seqs]
            _, ids = decode_steps(runner, seqs, start_ids, args.warmup_steps)
            seconds, _ = decode_steps(runner, seqs, ids, args.steps)
            results["decode"].setdefault(name, {})[bs] = {"tok_s": bs * args.steps / seconds,
                                                          "step_ms": 1e3 * seconds / args.steps}
            for s in seqs:
                runner.truncate(s, args.prompt_len)
            if use_graph:
                # Greedy steps back to back with the token fed on the device (ModelRunner.greedy_decode_steps, used by
                # --num-continuous-decode-steps): host work overlapped with the GPU, one readback for all steps.
                runner.greedy_decode_steps(seqs, start_ids, args.warmup_steps)
                for s in seqs:
                    runner.truncate(s, args.prompt_len)
                sync(runner.device)
                start = time.perf_counter()
                runner.greedy_decode_steps(seqs, start_ids, args.steps)
                seconds = time.perf_counter() - start
                results["decode"].setdefault("pipelined", {})[bs] = {"tok_s": bs * args.steps / seconds,
                                                                     "step_ms": 1e3 * seconds / args.steps}
                for s in seqs:
                    runner.truncate(s, args.prompt_len)
                # Where the time goes: the captured forward alone (GPU time, no host work) for this bucket.
                results["decode"][name][bs]["replay_ms"] = replay_ms(runner, (bs, 1), args.steps)
                if bs == 1:
                    results["verify"]["replay_ms"] = replay_ms(runner, (1, args.num_draft_tokens), args.steps)
            if bs == 1:
                results["verify"][name] = verify_cost(runner, seqs[0], args, cfg, rng)
                runner.truncate(seqs[0], args.prompt_len)
        for s in seqs:
            runner.free_seq(s)
    runner.use_cuda_graph = runner.graph_runner is not None
    del runner
    return results


def replay_ms(runner: ModelRunner, key: tuple[int, int], num: int) -> float | None:
    """Milliseconds per replay of one captured graph with the inputs of the last step (rewrites those KV slots); the
    graph holds the forward, lm_head over every row and the argmax."""
    entry = runner.graph_runner.graphs.get(key)
    if entry is None:
        return None
    sync(runner.device)
    start = time.perf_counter()
    for _ in range(num):
        entry[0].replay()
    sync(runner.device)
    return 1e3 * (time.perf_counter() - start) / num


def verify_cost(runner: ModelRunner, seq: str, args, cfg: ModelConfig, rng: random.Random) -> dict:
    """Milliseconds of one verify forward (tree of num_draft_tokens, logits for all) and of one decode step, bs 1."""
    ndt = args.num_draft_tokens
    parents = [-1] + [rng.randrange(0, j) for j in range(1, ndt)]
    times = {"verify_ms": [], "decode_ms": []}
    for i in range(args.warmup_steps + args.steps):
        for key, forward in (("verify_ms", SeqForward(seq, [rng.randrange(cfg.vocab_size) for _ in range(ndt)],
                                                      parents=parents, logits="all")),
                             ("decode_ms", SeqForward(seq, [rng.randrange(cfg.vocab_size)]))):
            sync(runner.device)
            start = time.perf_counter()
            runner.forward([forward], outputs="argmax")  # greedy: argmax rows read back
            elapsed = time.perf_counter() - start
            runner.truncate(seq, args.prompt_len)
            if i >= args.warmup_steps:
                times[key].append(1e3 * elapsed)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {**med, "num_draft_tokens": ndt, "ratio": med["verify_ms"] / med["decode_ms"]}


def bench_hf(cfg: ModelConfig, args, device: torch.device) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                         rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters={**cfg.rope_scaling, "rope_theta": cfg.rope_theta},
                         tie_word_embeddings=False, attn_implementation="sdpa")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(old)
    results = {}
    for bs in args.batch_sizes:
        ids = torch.randint(0, cfg.vocab_size, (bs, args.prompt_len), device=device)

        def generate(n: int) -> float:
            sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            sync(device)
            return time.perf_counter() - start

        generate(args.warmup_steps)
        prefill = generate(1)
        total = generate(args.steps + 1)
        results[bs] = {"tok_s": bs * args.steps / (total - prefill), "step_ms": 1e3 * (total - prefill) / args.steps}
    del model
    return results


def report(results: dict, args, cfg: ModelConfig) -> str:
    ctx = args.prompt_len + args.steps // 2
    kv_per_token = kv_bytes_per_block(cfg, 1, torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    bw = results["copy_bandwidth_bytes_s"]
    rows = ["| batch | ours eager tok/s | ours graphs tok/s | ours graphs pipelined tok/s | HF generate tok/s "
            "| ceiling tok/s | graphs % of ceiling | graph step ms | of it graph replay ms |",
            "|---|---|---|---|---|---|---|---|---|"]
    results["ceiling"] = {}
    for bs in args.batch_sizes:
        step_bytes = results["ours"]["weights_bytes"] + bs * ctx * kv_per_token
        ceiling = bs * bw / step_bytes
        results["ceiling"][bs] = ceiling
        get = lambda d: d.get(bs, {}).get("tok_s")  # noqa: E731
        eager, graphs = get(results["ours"]["decode"].get("eager", {})), get(results["ours"]["decode"].get("graphs", {}))
        hf = get(results.get("hf", {}))
        fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
        share = "-" if graphs is None else f"{100 * graphs / ceiling:.0f}%"
        graph_row = results["ours"]["decode"].get("graphs", {}).get(bs, {})
        step, replay = graph_row.get("step_ms"), graph_row.get("replay_ms")
        piped = get(results["ours"]["decode"].get("pipelined", {}))
        rows.append(f"| {bs} | {fmt(eager)} | {fmt(graphs)} | {fmt(piped)} | {fmt(hf)} | {fmt(ceiling)} | {share} "
                    f"| {'-' if step is None else f'{step:.2f}'} | {'-' if replay is None else f'{replay:.2f}'} |")
    verify = results["ours"]["verify"]
    lines = [f"device: {results['device_name']}; copy bandwidth {bw / 1e12:.2f} TB/s (read+write); weights "
             f"{results['ours']['weights_bytes'] / 1e9:.2f} GB; context {args.prompt_len}+{args.steps} tokens", "",
             *rows, ""]
    if verify.get("replay_ms") is not None:
        lines.append(f"verify graph replay alone: {verify['replay_ms']:.2f} ms")
    for name, v in verify.items():
        if not isinstance(v, dict):
            continue
        lines.append(f"verify ({name}): {v['num_draft_tokens']} tree tokens {v['verify_ms']:.2f} ms vs decode step "
                     f"{v['decode_ms']:.2f} ms at batch 1 = {v['ratio']:.3f}x")
    return "\n".join(lines)


def plot(results: dict, args, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    series = {"ours (graphs)": results["ours"]["decode"].get("graphs", {}),
              "ours (eager)": results["ours"]["decode"].get("eager", {}),
              "HF generate": results.get("hf", {}),
              "ceiling": {bs: {"tok_s": v} for bs, v in results["ceiling"].items()}}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.2
    for i, (name, data) in enumerate(series.items()):
        xs = [j + (i - 1.5) * width for j in range(len(args.batch_sizes))]
        ax.bar(xs, [data.get(bs, {}).get("tok_s", 0) for bs in args.batch_sizes], width, label=name)
    ax.set_xticks(range(len(args.batch_sizes)), [str(bs) for bs in args.batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s (log)")
    ax.set_yscale("log")
    ax.set_title(f"decode, {results['model']} shapes, {results['device_name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny Llama config instead of Llama-3.1-8B shapes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default=None, help="default: triton on CUDA, torch on CPU")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64], help="decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--warmup-steps", type=int, default=8, help="untimed decode steps first")
    p.add_argument("--num-draft-tokens", type=int, default=16, help="tree tokens of the verify-cost measurement")
    p.add_argument("--skip-hf", action="store_true", help="do not run the HF transformers peer")
    p.add_argument("--out-dir", default="bench/results/decode", help="where results.json/.md and decode.png go")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cfg = model_config(args.tiny)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"model": "tiny-llama" if args.tiny else "Llama-3.1-8B", "dtype": args.dtype,
                     "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "prompt_len": args.prompt_len, "steps": args.steps,
                     "copy_bandwidth_bytes_s": copy_bandwidth(device, (2 << 30) if device.type == "cuda" else 1 << 26)}
    results["ours"] = bench_ours(cfg, args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        results["hf"] = bench_hf(cfg, args, device)
    table = report(results, args, cfg)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "results.md").write_text(table + "\n")
    plot(results, args, out_dir / "decode.png")
    print(json.dumps(results, default=str))
    print(table)


if __name__ == "__main__":
    main()
