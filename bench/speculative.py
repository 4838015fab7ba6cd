"""Speculative decoding speed at a controlled accept length (SGLang's bench_speculative for Tandem), with SYNTHETIC
ACCEPTANCE: on dummy Llama-3.1-8B weights no real draft agrees with the target, so the draft is the SYNTHETIC
proposer (draft_service/synthetic.py): the target's own greedy continuation (an oracle from a reference AR run)
corrupted at a set rate, spending the real compute of a random EAGLE-3-sized head. Accept lengths here are synthetic.

Per batch size: (1) a reference AR run (target-only steps) gives AR tok/s and the oracle; (2) every speculative
config `STEPS/TOPK/NDT@TAU` (the accept rate is solved so the expected accept length is TAU) runs on the same prompts.
Reported per (config, batch): accept length (measured and expected), tok/s, speedup over AR, t_verify and t_draft per
step, and efficiency = tok/s / (tokens per step / (t_verify + t_draft)) — how much of the engine's own step time
the loop turns into tokens. `--mode inprocess`: TargetEngine + proposer called directly (no gRPC; timings are the
calls' wall times, host readback included). `--mode services`: target, draft and gateway processes on one device
(bench/speculative_services.py), driven by gRPC Generate; timings from the services' /metrics.
Writes results.json, results.md and speculative.png under --out-dir.

    python bench/speculative.py --out-dir $OUT/spec_inproc                               # H200, 8B shapes
    python bench/speculative.py --mode services --out-dir $OUT/spec_services             # H200, 3 processes
    python bench/speculative.py --mode services --draft-device cuda:1 --gateway-args=--disable-overlap-schedule
                                                                              # 2 GPUs, the sequential loop (A/B)
    python bench/speculative.py --tiny --device cpu --batch-sizes 1 --max-new-tokens 16  # CPU smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/decode.py (model shapes)
from decode import model_config  # noqa: E402
from draft_service.synthetic import Oracle, expected_tau, rate_for_tau  # noqa: E402

# Prompt ids: ids every tokenizer the gateway may load accepts (as bench/serve_decode.py). Both modes draw the same
# prompts, so a batch's SYNTHETIC keep stream (seeded per prompt) and with it τ are the same in-process and through
# the services: their speedups compare at equal τ.
PROMPT_VOCAB = 2048
LABEL = "SYNTHETIC ACCEPTANCE (oracle continuation corrupted at a set rate; dummy weights)"


@dataclass(frozen=True)
class SpecConfig:
    steps: int
    topk: int
    ndt: int
    tau: float

    @property
    def name(self) -> str:
        return f"{'chain' if self.topk == 1 else 'tree'} {self.steps}/{self.topk}/{self.ndt}"

    @property
    def depth(self) -> int:
        return min(self.steps, self.ndt - 1)

    def rate(self, override: float | None) -> float:
        return override if override is not None else rate_for_tau(min(self.tau, self.depth + 1), self.depth)

    @classmethod
    def parse(cls, text: str) -> SpecConfig:
        """'STEPS/TOPK/NDT@TAU', e.g. '5/1/6@3.5' or '8/8/60@6'."""
        try:
            shape, tau = text.split("@")
            steps, topk, ndt = (int(v) for v in shape.split("/"))
            config = cls(steps, topk, ndt, float(tau))
        except ValueError:
            raise argparse.ArgumentTypeError(f"config {text!r}: expected STEPS/TOPK/NDT@TAU, e.g. 8/8/60@6") from None
        if topk == 1 and ndt != steps + 1:
            raise argparse.ArgumentTypeError(f"config {text!r}: a chain (topk 1) has ndt = steps + 1")
        if min(steps, topk) < 1 or ndt < 2 or ndt - 1 > topk + (steps - 1) * topk * topk:
            raise argparse.ArgumentTypeError(f"config {text!r}: ndt - 1 must be in [1, topk + (steps-1) topk^2]")
        return config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(batch_size: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct prompts per batch size (each batch size has its own oracle entries)."""
    rng = random.Random(seed * 1000 + batch_size)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch_size)]


# ---------------------------------------------------------------------------------------------------- in-process
def run_engine(engine, proposer, spec, prompts: list[list[int]], max_new: int, tag: str) -> dict:
    """Prefill (untimed, the draft's catch-up too), then propose -> verify until every sequence has max_new tokens.
    Returns tokens (after the prefill's), steps, summed t_draft/t_verify (seconds) and the loop's wall time, and the
    tokens and seconds of the steps that ran the whole batch (full_tokens, full_wall): a static batch drains as its
    sequences finish at different steps (speculation's do, plain decoding's all end together), where a serving
    engine under load refills the slots -- the full-batch rate is that steady state."""
    from core.steps import PrefillInput, ProposeInput, VerifyInput
    from core.types import DraftTree, SamplingParams, StopRule
    from core.types import SeqStatus as Status

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0.0)
    stops = {s: StopRule(max_new, ignore_eos=True, prompt_len=len(p)) for s, p in zip(ids, prompts)}
    outs = engine.prefill([PrefillInput(s, list(p), True, greedy, stops[s]) for s, p in zip(ids, prompts)])
    committed = {o.seq_id: list(p) + o.token_ids for o, p in zip(outs, prompts)}
    if proposer is not None:
        for s in ids:
            proposer.prefill(s, committed[s])
        proposer.propose([ProposeInput(s, len(committed[s]), [], spec) for s in ids])  # head catch-up, untimed
    new = {s: [] for s in ids}
    active = [o.seq_id for o in outs if o.finish_reason is None]
    steps = tokens = seq_steps = full_tokens = 0
    t_draft = t_verify = t_verify_fwd = full_wall = 0.0
    sync(engine.device)
    start = time.perf_counter()
    while active:
        t0 = time.perf_counter()
        trees = {s: DraftTree([], []) for s in active}
        if proposer is not None:
            for res in proposer.propose([ProposeInput(s, len(committed[s]), new[s], spec) for s in active]):
                trees[res.seq_id] = res.tree
        t1 = time.perf_counter()
        outs = engine.verify([VerifyInput(s, len(committed[s]), committed[s][-1], trees[s], greedy, stops[s])
                              for s in active])
        t2 = time.perf_counter()
        t_draft, t_verify, t_verify_fwd = t_draft + t1 - t0, t_verify + t2 - t1, t_verify_fwd + engine.last_forward_ms
        steps += 1
        seq_steps += len(active)
        done = set()
        for o in outs:
            if o.status != Status.OK:  # (a bench bug, not a measurement: without this the loop would spin)
                raise RuntimeError(f"verify of {o.seq_id} failed: {o.status} {o.error}")
            committed[o.seq_id] += o.token_ids
            new[o.seq_id] = o.token_ids
            tokens += len(o.token_ids)
            if o.finish_reason is not None:
                done.add(o.seq_id)
        if proposer is not None and done:
            proposer.release(sorted(done))
        if len(active) == len(ids):
            full_tokens += sum(len(o.token_ids) for o in outs)
            full_wall += time.perf_counter() - t0
        active = [s for s in active if s not in done]
    sync(engine.device)
    wall = time.perf_counter() - start
    engine.release(ids)
    continuations = {tuple(p): committed[s][len(p):] for s, p in zip(ids, prompts)}
    return {"tokens": tokens, "steps": steps, "t_draft": t_draft, "t_verify": t_verify,
            "t_verify_forward": t_verify_fwd / 1e3, "wall": wall, "continuations": continuations,
            "seq_steps": seq_steps, "full_tokens": full_tokens, "full_wall": full_wall}


def oracle_mismatches(entries: dict, outputs: dict) -> list:
    """Prompts whose greedy output differs from the oracle's. Greedy is deterministic math, but a wide verify forward
    and a decode step round differently (bf16 on GPU), which can flip a near-tie argmax; such a sequence leaves the
    oracle (wrong drafts from there). Calibration re-runs with the speculative outputs as the oracle."""
    return [k for k, out in outputs.items() if out != entries.get(k, [])[: len(out)]]


def recapture(runner, ndt: int) -> None:
    """Re-capture the target's CUDA graphs for a verify width of ndt tokens (one width per capture)."""
    if runner.graph_runner is None or ndt in getattr(runner.graph_runner, "query_lens", []):
        return
    runner.engine_config = dataclasses.replace(runner.engine_config, cuda_graph_num_draft_tokens=ndt)
    if hasattr(runner, "_capture_graphs"):
        runner._capture_graphs(getattr(runner.graph_runner, "capture_layers", None))
        return
    from runtime.cuda_graph import CudaGraphRunner

    if hasattr(runner.graph_runner, "release"):
        runner.graph_runner.release()
    runner.graph_runner = CudaGraphRunner(runner, runner.engine_config.cuda_graph_max_bs, ndt)
    runner.graph_runner.capture()


def bench_inprocess(args, cfg, device: torch.device, configs: list[SpecConfig]) -> list[dict]:
    from core.steps import SpecShape
    from draft_service.synthetic import SyntheticHead, SyntheticProposer
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from runtime.models.loader import widen_dummy_margins
    from target_service.engine import TargetEngine

    max_bs = max(args.batch_sizes)
    max_ndt = max(c.ndt for c in configs)
    ctx = args.prompt_len + args.max_new_tokens + max(c.steps for c in configs) + max_ndt + 16
    blocks = max_bs * (-(-ctx // 16) + 2) + 8
    backend = args.attention_backend or ("triton" if device.type == "cuda" else "torch")
    engine_config = EngineConfig(device=str(device), dtype=args.dtype, load_format="dummy", attention_backend=backend,
                                 num_kv_blocks=blocks, cuda_graph_max_bs=max_bs,
                                 cuda_graph_num_draft_tokens=min(c.ndt for c in configs),
                                 disable_cuda_graph=args.disable_cuda_graph, seed=args.seed)
    runner = ModelRunner(None, engine_config, cfg)
    if args.margin_weights:
        widen_dummy_margins(runner.model, args.seed)
    engine = TargetEngine(runner)
    head = None
    if args.head_hidden != 0:
        # The served shape drafts through the static step (one CUDA graph per Propose, as tandem serve's EAGLE-3 does);
        # other shapes step eagerly unless --draft-cuda-graph lets the head's runner capture per-forward graphs.
        head_config = dataclasses.replace(engine_config, num_kv_blocks=blocks, cuda_graph_num_draft_tokens=None,
                                          disable_cuda_graph=not args.draft_cuda_graph or args.disable_cuda_graph)
        head = SyntheticHead(cfg, head_config, args.head_hidden or None, args.draft_vocab)
    rows, ar_rows, oracles = [], {}, {}
    extra = max(c.steps for c in configs) + 1  # the oracle must reach past the last draft
    for bs in args.batch_sizes:  # AR first (decode graphs exist whatever verify width is captured)
        prompts = make_prompts(bs, args.prompt_len, min(PROMPT_VOCAB, cfg.vocab_size), args.seed)
        run_engine(engine, None, None, prompts[:1], 4, f"warm-ar-{bs}")
        ar = run_engine(engine, None, None, prompts, args.max_new_tokens + extra, f"ar-{bs}")
        oracles[bs] = Oracle(ar["continuations"])
        ar_rows[bs] = _row("AR", None, bs, ar, ar["tokens"] / ar["wall"], ar["tokens"] / ar["wall"], 1.0, None)
        rows.append(ar_rows[bs])
        print(f"[bs {bs}] AR: {ar_rows[bs]['tok_s']:,.1f} tok/s ({1e3 * ar['wall'] / ar['steps']:.2f} ms/step)",
              flush=True)
    for config in sorted(configs, key=lambda c: c.ndt):  # one graph capture per verify width
        recapture(runner, config.ndt)
        spec = SpecShape(config.steps, config.topk, config.ndt)
        if (head is not None and runner.device.type == "cuda" and not args.disable_cuda_graph
                and not args.disable_static_draft_step):
            head.enable_static_step(spec, max_bs=max(args.batch_sizes))  # as tandem serve: one graph per Propose
        rate = config.rate(args.accept_rate)
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.static_verify]
        engine._static_verify, static_step = None, None  # one static verify step per width, captured once
        if True in modes and engine.enable_static_verify(config.ndt, max_bs=max(args.batch_sizes)):
            static_step = engine._static_verify
        for bs, static_verify in ((bs, sv) for bs in args.batch_sizes for sv in modes):
            if static_verify and static_step is None:
                print(f"[bs {bs}] {config.name}: no static verify step here (needs the triton backend)", flush=True)
                continue
            engine._static_verify = static_step if static_verify else None  # else the eager verify (reference)
            name = config.name + (" static-verify" if static_verify else "")
            prompts = make_prompts(bs, args.prompt_len, min(PROMPT_VOCAB, cfg.vocab_size), args.seed)
            oracle = oracles[bs]
            static_before = static_step.num_replays if static_step is not None else 0
            for run in range(args.calibration_runs + 1):
                proposer = SyntheticProposer(rate, cfg.vocab_size, oracle, seed=args.seed, head=head)
                run_engine(engine, proposer, spec, prompts[:1], 2 * config.steps, f"warm-{bs}-{run}")
                result = run_engine(engine, proposer, spec, prompts, args.max_new_tokens, f"{name}-{bs}-{run}")
                mismatched = oracle_mismatches(oracle.entries, result["continuations"])
                if not mismatched or run == args.calibration_runs:
                    break
                oracle = Oracle({**oracle.entries, **{k: result["continuations"][k] for k in mismatched}})
            row = _row(name, config, bs, result, result["tokens"] / result["wall"], ar_rows[bs]["tok_s"],
                       rate, {**proposer.stats, "calibration_runs": run, "outputs_off_oracle": len(mismatched),
                              "static_verify_batches": (static_step.num_replays - static_before
                                                                if static_verify else 0)})
            rows.append(row)
            print(f"[bs {bs}] {name}: tau {row['tau']:.2f} (expected {row['tau_expected']:.2f}), "
                  f"{row['tok_s']:,.1f} tok/s, {row['speedup']:.2f}x AR, verify {row['t_verify_ms']:.2f} ms + draft "
                  f"{row['t_draft_ms']:.2f} ms per step, efficiency {row['efficiency']:.3f}", flush=True)
    rows.sort(key=lambda r: (r["batch_size"], r["config"] != "AR"))
    return rows


def _row(name: str, config: SpecConfig | None, bs: int, r: dict, tok_s: float, ar_tok_s: float, rate: float,
         stats: dict | None) -> dict:
    """One result row; tau = committed tokens per sequence per target step (bonus included)."""
    steps = r["steps"]
    seq_steps = r.get("seq_steps") or steps * bs
    tau = r["tokens"] / seq_steps if seq_steps else 0.0
    step_s = (r["t_verify"] + r["t_draft"]) / steps if steps else 0.0
    ideal = r["tokens"] / steps / step_s if step_s else 0.0  # tokens per step / engine step time
    return {"config": name, "synthetic_acceptance": config is not None, "batch_size": bs,
            "steps": None if config is None else config.steps, "topk": None if config is None else config.topk,
            "num_draft_tokens": None if config is None else config.ndt, "accept_rate": rate,
            "tau": tau, "tau_expected": 1.0 if config is None else expected_tau(rate, config.depth),
            "tok_s": tok_s, "speedup": tok_s / ar_tok_s if ar_tok_s else None,
            # the steps that ran the whole batch (run_engine): the steady state of a server kept full
            "tok_s_full_batch": r["full_tokens"] / r["full_wall"] if r.get("full_wall") else None,
            "t_verify_ms": 1e3 * r["t_verify"] / max(steps, 1), "t_draft_ms": 1e3 * r["t_draft"] / max(steps, 1),
            "t_verify_forward_ms": 1e3 * r.get("t_verify_forward", 0.0) / max(steps, 1),
            "efficiency": tok_s / ideal if ideal else None, "target_steps": steps, "tokens": r["tokens"],
            "wall_s": r["wall"], "oracle": stats,
            # services mode: where a step's wall goes (handlers = the services' RPC handlers, model time included;
            # the rest is the transport and the gateway)
            "wall_per_step_ms": 1e3 * r["wall"] / max(steps, 1),
            "t_verify_rpc_ms": 1e3 * r.get("t_verify_rpc", 0.0) / max(steps, 1),
            "t_draft_rpc_ms": 1e3 * r.get("t_draft_rpc", 0.0) / max(steps, 1),
            "run_ahead": r.get("run_ahead")}


# ---------------------------------------------------------------------------------------------------- output
def markdown(result: dict) -> str:
    lines = [f"**{LABEL}** — {result['model']} {result['dtype']} on {result['device_name']}, mode {result['mode']}, "
             f"prompt {result['prompt_len']} + {result['max_new_tokens']} new tokens", "",
             "| batch | config | accept rate | τ (expected) | tok/s | speedup vs AR | full batch: tok/s (× AR) | "
             "t_verify ms | t_draft ms | verify ÷ AR step | bound: τ ÷ (verify ÷ AR step) | efficiency | "
             "off-oracle seqs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(f"| {r['batch_size']} | {r['config']} | {r['accept_rate']:.3f} | {r['tau']:.2f} "
                     f"({r['tau_expected']:.2f}) | {r['tok_s']:,.1f} | {fmt(r['speedup'], '.2f')}x | "
                     f"{fmt(r.get('tok_s_full_batch'), ',.1f')} ({fmt(r.get('speedup_full_batch'), '.2f')}x) | "
                     f"{r['t_verify_ms']:.2f} | {r['t_draft_ms']:.2f} | {fmt(r['verify_over_ar_step'], '.2f')} | "
                     f"{fmt(r.get('speedup_bound'), '.2f')}x | "
                     f"{fmt(r['efficiency'], '.3f')} | "
                     f"{fmt((r['oracle'] or {}).get('outputs_off_oracle'), 'd')} |")
    lines += ["", "τ = committed tokens per sequence per target step, bonus included (synthetic). efficiency = tok/s "
              "÷ (tokens per step ÷ (t_verify + t_draft)); t_* are the engine calls' (inprocess) or the services' "
              "own (services) times per step. bound: the speedup if drafting and host gaps cost nothing (τ tokens per "
              "verify against one per AR step). off-oracle seqs: outputs that left the oracle (wide-verify vs decode "
              "rounding flipped a near-tie argmax) in the reported run, after --calibration-runs re-runs. full batch: the "
              "steps that ran every sequence of the batch (a static batch drains as sequences finish at different "
              "steps; a server under load keeps it full)."]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    rows = result["rows"]
    sizes = sorted({r["batch_size"] for r in rows})
    names = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        by_bs = {r["batch_size"]: r for r in rows if r["config"] == name}
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(sizes))]
        axes[0].bar(xs, [by_bs.get(bs, {}).get("speedup") or 0 for bs in sizes], width, label=name)
        axes[1].bar(xs, [by_bs.get(bs, {}).get("efficiency") or 0 for bs in sizes], width, label=name)
    for ax, title in zip(axes, ("speedup over AR", "efficiency")):
        ax.set_xticks(range(len(sizes)), [str(bs) for bs in sizes])
        ax.set_xlabel("batch size")
        ax.set_title(title)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{LABEL}\n{result['model']} on {result['device_name']} ({result['mode']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="inprocess", choices=["inprocess", "services"])
    p.add_argument("--tiny", action="store_true", help="a tiny Llama config instead of Llama-3.1-8B shapes")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default=None, help="default: triton on CUDA, torch on CPU")
    p.add_argument("--disable-cuda-graph", action="store_true", help="run the target (and head) eagerly")
    p.add_argument("--draft-cuda-graph", action="store_true", help="let the synthetic head's runner capture graphs")
    p.add_argument("--disable-static-draft-step", action="store_true",
                   help="draft step by step from the host instead of one static graph per Propose (A/B)")
    p.add_argument("--static-verify", default="off", choices=["off", "on", "both"],
                   help="in-process: verify greedy trees as one static graph per Verify (tandem serve's default; "
                        "--disable-static-verify-step there); both = one row each, same run")
    p.add_argument("--adaptive", action="store_true",
                   help="services mode: --speculative-adaptive (chain configs only: draft steps per batch size)")
    p.add_argument("--draft-device", default=None,
                   help="services mode: the draft service's device (default: --device), e.g. cuda:1 for draft and "
                        "target on separate GPUs")
    p.add_argument("--colocate", action="store_true",
                   help="services mode: the SYNTHETIC draft runs in the target's process (--colocate-draft): each "
                        "Verify drafts the next tree, one round trip per step")
    p.add_argument("--gateway-args", default="",
                   help="services mode: extra flags of the speculative gateway, one string (e.g. "
                        "'--disable-overlap-schedule' for the overlap A/B)")
    p.add_argument("--target-args", default="",
                   help="services mode: extra flags of the target process, one string (e.g. "
                        "'--disable-chained-speculative-steps' or '--disable-run-ahead' for those A/Bs)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--configs", type=SpecConfig.parse, nargs="+", default=None,
                   help="STEPS/TOPK/NDT@TAU each (default: 5/1/6@3.5 8/8/60@6)")
    p.add_argument("--accept-rate", type=float, default=None, help="use this rate for every config instead of TAU")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--head-hidden", type=int, default=None,
                   help="hidden size of the synthetic EAGLE-3-sized head (default: the target's; 0 = no compute)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="lm_head rows of the synthetic head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin-weights", action="store_true",
                   help="structured dummy target weights (in-process and services) whose greedy continuation has wide "
                        "argmax margins (runtime/models/loader.widen_dummy_margins), so the oracle survives bf16 "
                        "verify-vs-decode rounding")
    p.add_argument("--calibration-runs", type=int, default=1,
                   help="when speculative outputs leave the AR oracle (numerics of wide verify vs decode), re-run up "
                        "to this many times with those outputs as the oracle; the last run is reported")
    p.add_argument("--profile-dir", default=None,
                   help="--mode services: profile one more speculative run per batch size into DIR (unprofiled "
                        "timings; see speculative_services.py)")
    p.add_argument("--profile-batch-sizes", type=int, nargs="+", default=None,
                   help="the batch sizes --profile-dir profiles (default: every one)")
    p.add_argument("--out-dir", default="bench/results/speculative")
    args = p.parse_args(argv)
    configs = args.configs or [SpecConfig.parse("5/1/6@3.5"), SpecConfig.parse("8/8/60@6")]
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cfg = model_config(args.tiny)
    result = {"label": LABEL, "synthetic_acceptance": True, "mode": args.mode,
              "model": "tiny-llama" if args.tiny else "Llama-3.1-8B", "dtype": args.dtype,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
              "configs": [dataclasses.asdict(c) for c in configs], "batch_sizes": args.batch_sizes,
              "draft_device": args.draft_device or args.device, "gateway_args": args.gateway_args,
              "target_args": args.target_args}
    print(LABEL, flush=True)
    if args.mode == "inprocess":
        result["rows"] = bench_inprocess(args, cfg, device, configs)
    else:
        from speculative_services import bench_services

        result["rows"] = bench_services(args, configs)
    ar_verify = {r["batch_size"]: r["t_verify_ms"] for r in result["rows"] if r["config"] == "AR"}
    for r in result["rows"]:  # the verify forward's cost in AR steps of the same batch size
        r["verify_over_ar_step"] = r["t_verify_ms"] / ar_verify[r["batch_size"]] if ar_verify.get(
            r["batch_size"]) else None
        # what the speedup would be if drafting and every host gap cost nothing: τ tokens per verify, against
        # plain decoding's one per AR step (at batch 64 a 16-token tree's verify is compute-bound: this caps it)
        r["speedup_bound"] = r["tau"] / r["verify_over_ar_step"] if r["verify_over_ar_step"] else None
    ar_full = {r["batch_size"]: r.get("tok_s_full_batch") for r in result["rows"] if r["config"] == "AR"}
    for r in result["rows"]:  # the full-batch rate against plain decoding's
        full, ar = r.get("tok_s_full_batch"), ar_full.get(r["batch_size"])
        r["speedup_full_batch"] = full / ar if full and ar else None
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(result)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "results.md").write_text(table + "\n")
    plot(result, out_dir / "speculative.png")
    print(table)
    return result


if __name__ == "__main__":
    main()
