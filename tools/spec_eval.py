"""In-process speculative decoding measurements: mean accept length (tokens per target step, bonus included) and
batch-1 tokens/s of Tandem's engine pieces (ModelRunner + TargetEngine + the draft_service proposers, no gRPC), and
tokens/s of HF `generate` peers (plain, assisted generation with a draft, prompt lookup) on the same prompts.

The engine loop is the gateway's step loop without the wire: prefill, then propose -> verify until every sequence has
its new tokens (ignore_eos). Knows nothing about training; tools/train_demo_pair.py and tests call it.

    python -m tools.spec_eval --model models/tandem-demo-code --prompts models/tandem-demo-code/heldout_prompts.jsonl
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Method:
    name: str
    algorithm: str  # NONE | STANDALONE | EAGLE3 | EAGLE | NGRAM | DFLASH | UNO
    num_steps: int = 0
    topk: int = 1
    num_draft_tokens: int = 1


def default_methods(has_draft: bool, has_eagle3: bool, has_eagle: bool = False,
                    dflash_block: int | None = None, has_uno: bool = False) -> list[Method]:
    methods = [Method("AR", "NONE")]
    if has_draft:
        methods += [Method("STANDALONE chain 3/1/4", "STANDALONE", 3, 1, 4),
                    Method("STANDALONE tree 4/2/8", "STANDALONE", 4, 2, 8)]
    if has_eagle3:
        methods += [Method("EAGLE3 chain 3/1/4", "EAGLE3", 3, 1, 4),
                    Method("EAGLE3 tree 5/4/16", "EAGLE3", 5, 4, 16),
                    Method("EAGLE3 tree 6/8/32", "EAGLE3", 6, 8, 32)]
    if has_eagle:
        methods += [Method("EAGLE chain 3/1/4", "EAGLE", 3, 1, 4), Method("EAGLE tree 5/4/16", "EAGLE", 5, 4, 16)]
    if dflash_block:  # one block per step: steps = topk = 1, num_draft_tokens = the draft's block size
        methods.append(Method(f"DFLASH block {dflash_block}", "DFLASH", 1, 1, dflash_block))
    if has_uno:  # UNO: F/K/Q = 4/1/4 linear, 4/4/8 tree (steps/topk/ndt 1/1/4, 3/4/8)
        methods += [Method("UNO linear 1/1/4", "UNO", 1, 1, 4), Method("UNO tree 3/4/8", "UNO", 3, 4, 8)]
    methods.append(Method("NGRAM (prompt lookup) 8", "NGRAM", 0, 1, 8))
    return methods


def load_prompts(path: str | Path) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["prompt_ids"] for line in f if line.strip()]


class EngineBench:
    """One target engine per feature mode, proposers built once (NGRAM fresh per batch: its trie is global)."""

    def __init__(self, target_path: str, draft_path: str | None, eagle3_path: str | None, device: str,
                 eagle_path: str | None = None, max_total_tokens: int = 65536, cuda_graphs: str = "all",
                 dflash_path: str | None = None, uno_path: str | None = None) -> None:
        """cuda_graphs: "all" (target and drafts capture CUDA graphs, as the services do), "compiled" (the same, the
        drafts' graphs and static steps of batch 1 capturing torch.compile'd code: --enable-torch-compile),
        "target" (drafts eager) or "none"."""
        import dataclasses

        from runtime.config import EngineConfig
        from runtime.model_runner import ModelRunner

        self.engine_config = EngineConfig(device=device, dtype="auto", max_total_tokens=max_total_tokens,
                                          disable_cuda_graph=cuda_graphs == "none")
        self.draft_engine_config = dataclasses.replace(self.engine_config,
                                                       disable_cuda_graph=cuda_graphs not in ("all", "compiled"),
                                                       enable_torch_compile=cuda_graphs == "compiled",
                                                       torch_compile_max_bs=1)
        self.target_path, self.draft_path = target_path, draft_path
        self.head_paths = {"EAGLE3": eagle3_path, "EAGLE": eagle_path, "DFLASH": dflash_path}
        self.runner = ModelRunner(target_path, self.engine_config)
        self._proposers: dict[str, object] = {}
        self.static_draft_step = cuda_graphs in ("all", "compiled")  # as tandem serve: a graph per Propose
        self.uno_lora = None  # UNO: the LoRA wrappers on the target (plain forwards are unchanged by them)
        if uno_path:
            from runtime.lora import apply_adapter, load_adapter

            self.uno_lora = apply_adapter(self.runner.model, load_adapter(uno_path))

    def state(self) -> dict:
        """The backend and graph state this bench runs (printed with its results)."""
        return {"attention_backend": type(self.runner.attn_backend).__name__,
                "target_graphs": self.runner.graph_runner is not None,
                "draft_graphs": not self.draft_engine_config.disable_cuda_graph and self.runner.device.type == "cuda",
                "static_draft_step": self.static_draft_step and self.runner.device.type == "cuda"}

    def proposer(self, algorithm: str, num_draft_tokens: int):
        if algorithm == "NGRAM":
            from draft_service.ngram import NgramConfig
            from draft_service.ngram_draft import NgramDraft

            return NgramDraft(NgramConfig(num_draft_tokens=num_draft_tokens))
        if algorithm not in self._proposers:
            if algorithm == "STANDALONE":
                from draft_service.standalone import StandaloneProposer
                from runtime.model_runner import ModelRunner

                self._proposers[algorithm] = StandaloneProposer(ModelRunner(self.draft_path, self.draft_engine_config))
            elif algorithm == "DFLASH":
                from draft_service.dflash import DFlashProposer

                self._proposers[algorithm] = DFlashProposer(self.target_path, self.head_paths[algorithm],
                                                            self.draft_engine_config)
            else:
                from draft_service.eagle import EagleProposer

                self._proposers[algorithm] = EagleProposer(self.target_path, self.head_paths[algorithm],
                                                           self.draft_engine_config, algorithm)
        return self._proposers[algorithm]

    def run(self, method: Method, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
            batch_size: int = 64, stop_at_eos: bool = False) -> dict:
        """Generate max_new_tokens for every prompt (fewer where a sequence emits the target's EOS, when
        stop_at_eos); returns tau, steps, tokens, seconds, tokens/s."""
        from target_service.engine import TargetEngine

        proposer = None
        capture: dict = {}
        if method.algorithm in ("EAGLE3", "EAGLE", "DFLASH"):
            proposer = self.proposer(method.algorithm, method.num_draft_tokens)
            capture = ({"feature_layers": proposer.target_capture_layers} if method.algorithm != "EAGLE"
                       else {"final_norm_features": True})
        if method.algorithm in ("EAGLE3", "EAGLE", "STANDALONE") and self.state()["static_draft_step"]:
            from core.steps import SpecShape

            spec = SpecShape(method.num_steps, method.topk, method.num_draft_tokens)
            draft = self.proposer(method.algorithm, method.num_draft_tokens)
            if spec not in draft._static_steps:
                draft.enable_static_step(spec, max_bs=self.engine_config.cuda_graph_max_bs)
        engine = TargetEngine(self.runner, **capture)
        if method.algorithm == "UNO":  # the target drafts for itself
            from target_service.uno import UnoProposer

            engine.draft_lora = self.uno_lora
            proposer = UnoProposer(engine)
        steps = tokens = 0
        _sync(self.runner.device)
        start = time.perf_counter()
        for b in range(0, len(prompts), batch_size):
            if method.algorithm in ("STANDALONE", "NGRAM"):
                proposer = self.proposer(method.algorithm, method.num_draft_tokens)
            eos = self.runner.model_config.eos_token_ids if stop_at_eos else None
            s, t = _generate(engine, proposer, method, prompts[b:b + batch_size], max_new_tokens, temperature, b,
                             eos)
            steps, tokens = steps + s, tokens + t
        _sync(self.runner.device)
        seconds = time.perf_counter() - start
        # UNO's draft pass is a target forward too: each verify step costs two (SGLang counts TPF over 2 x verifies)
        forwards = steps + (steps - len(prompts) if method.algorithm == "UNO" else 0)
        return {"method": method.name, "algorithm": method.algorithm, "temperature": temperature,
                "batch_size": min(batch_size, len(prompts)), "prompts": len(prompts), "tau": tokens / max(steps, 1),
                "tokens_per_target_forward": tokens / max(forwards, 1),
                "target_steps": steps, "tokens": tokens, "seconds": round(seconds, 3),
                "tokens_per_s": tokens / seconds}


def _generate(engine, proposer, method: Method, prompts: list[list[int]], max_new_tokens: int, temperature: float,
              offset: int, eos_token_ids=None, outputs: dict | None = None) -> tuple[int, int]:
    """(verify steps, generated tokens) over one batch; the prefill's first token is not a speculative step.
    eos_token_ids: stop a sequence at these (None: ignore EOS, always max_new_tokens). outputs: filled with each
    sequence's committed tokens (prompt included), keyed by its id."""
    from core.steps import PrefillInput, ProposeInput, SpecShape, VerifyInput
    from core.types import DraftTree, SamplingParams, StopRule

    feats = proposer is not None and proposer.needs_features
    spec = SpecShape(method.num_steps, method.topk, method.num_draft_tokens)
    ids = [f"p{offset + i}" for i in range(len(prompts))]
    sampling = {s: SamplingParams(temperature=temperature, seed=offset + i) for i, s in enumerate(ids)}
    stops = {s: StopRule(max_new_tokens, frozenset(eos_token_ids or ()), ignore_eos=eos_token_ids is None,
                         prompt_len=len(p)) for s, p in zip(ids, prompts)}
    outs = engine.prefill([PrefillInput(s, list(p), True, sampling[s], stops[s], return_features=feats)
                           for s, p in zip(ids, prompts)])
    committed = {o.seq_id: list(p) + o.token_ids for o, p in zip(outs, prompts)}
    new: dict[str, tuple[list[int], torch.Tensor | None]] = {}
    for o in outs:
        if proposer is not None:
            proposer.prefill(o.seq_id, committed[o.seq_id], o.features[: len(committed[o.seq_id]) - 1] if feats
                             else None)
        new[o.seq_id] = ([], o.features[:0] if feats else None)
    active = [o.seq_id for o in outs if o.finish_reason is None]
    steps = 0
    tokens = len(outs)
    while active:
        trees = {s: DraftTree([], []) for s in active}
        if proposer is not None:
            for res in proposer.propose([ProposeInput(s, len(committed[s]), new[s][0], spec, new[s][1])
                                         for s in active]):
                trees[res.seq_id] = res.tree
        outs = engine.verify([VerifyInput(s, len(committed[s]), committed[s][-1], trees[s], sampling[s], stops[s],
                                          return_features=feats) for s in active])
        done = []
        for o in outs:
            committed[o.seq_id] += o.token_ids
            new[o.seq_id] = (o.token_ids, o.features if feats else None)
            tokens += len(o.token_ids)
            if o.finish_reason is not None:
                done.append(o.seq_id)
        steps += len(outs)
        active = [s for s in active if s not in done]
        if proposer is not None and done:
            proposer.release(done)
    if outputs is not None:
        outputs.update(committed)
    # The prefill token costs a target forward too, so count it as a step of one token.
    return steps + len(prompts), tokens


def hf_tokens_per_s(target, prompts: list[list[int]], max_new_tokens: int, assistant=None,
                    prompt_lookup_num_tokens: int | None = None, eos_token_ids=None) -> dict:
    """Batch-1 greedy HF generate over the prompts: plain, assisted or prompt lookup; ignoring EOS unless
    eos_token_ids are given."""
    device = next(target.parameters()).device
    kwargs: dict = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    if eos_token_ids:
        kwargs["eos_token_id"] = list(eos_token_ids)
    else:
        kwargs.update(min_new_tokens=max_new_tokens, eos_token_id=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    ids0 = torch.tensor([prompts[0]], device=device)
    with torch.no_grad():
        target.generate(ids0, attention_mask=torch.ones_like(ids0), **dict(kwargs, max_new_tokens=8))  # warm-up
        _sync(device)
        start, tokens = time.perf_counter(), 0
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            tokens += out.shape[1] - ids.shape[1]
        _sync(device)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds}


def evaluate(target_path: str, draft_path: str | None, eagle3_path: str | None, prompts: list[list[int]],
             device: str, max_new_tokens: int = 64, speed_prompts: int = 10, temperatures=(0.0, 1.0),
             eagle_path: str | None = None, log: Callable[[str], None] = print, deadline: float | None = None,
             only: list[str] | None = None, cuda_graphs: str = "all", stop_at_eos: bool = False,
             dflash_path: str | None = None, uno_path: str | None = None) -> dict:
    """Every method: tau over all prompts (batched) per temperature, and batch-1 greedy tokens/s over the first
    speed_prompts; then the HF peers' batch-1 tokens/s on the same prompts. Past `deadline` (time.time()), the
    remaining measurements are skipped and listed under "skipped". `only`: measure just these method names.
    stop_at_eos: sequences (and the HF peers) stop at the target's EOS ids (chat prompts) instead of ignoring them."""
    from transformers import AutoModelForCausalLM

    bench = EngineBench(target_path, draft_path, eagle3_path, device, eagle_path, cuda_graphs=cuda_graphs,
                        dflash_path=dflash_path, uno_path=uno_path)
    dflash_block = None
    if dflash_path:
        from runtime.models.dflash import DEFAULT_BLOCK_SIZE, read_block_size

        dflash_block = read_block_size(dflash_path) or DEFAULT_BLOCK_SIZE
    methods = default_methods(draft_path is not None, eagle3_path is not None, eagle_path is not None, dflash_block,
                              uno_path is not None)
    if only:
        unknown = set(only) - {m.name for m in methods}
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; these exist: {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in only]
    rows, skipped = [], []
    late = lambda: deadline is not None and time.time() > deadline  # noqa: E731
    for m in methods:
        row = {"method": m.name}
        if late():
            skipped.append(m.name)
            continue
        for temp in temperatures:
            batch = 1 if m.algorithm == "NGRAM" else 64  # the NGRAM trie is global: one prompt per trie
            r = bench.run(m, prompts, max_new_tokens, temp, batch_size=batch, stop_at_eos=stop_at_eos)
            row[f"tau_t{temp:g}"] = round(r["tau"], 3)
            if m.algorithm == "UNO":
                row[f"tokens_per_target_forward_t{temp:g}"] = round(r["tokens_per_target_forward"], 3)
            log(f"{m.name} T={temp:g}: tau {r['tau']:.3f} ({r['tokens']} tokens, {r['target_steps']} target steps, "
                f"{r['seconds']:.1f}s at batch {r['batch_size']})")
        if speed_prompts and not late():
            r = bench.run(m, prompts[:speed_prompts], max_new_tokens, 0.0, batch_size=1, stop_at_eos=stop_at_eos)
            row["tokens_per_s_b1"] = round(r["tokens_per_s"], 1)
            log(f"{m.name}: {r['tokens_per_s']:.1f} tok/s at batch 1 (greedy)")
        rows.append(row)
    peers = []
    if speed_prompts and not late():
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device).eval()
        draft = (AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).to(device).eval()
                 if draft_path else None)
        sp = prompts[:speed_prompts]
        for name, kw in (("HF generate", {}), ("HF assisted (draft)", {"assistant": draft}),
                         ("HF prompt lookup (4)", {"prompt_lookup_num_tokens": 4}),
                         ("HF prompt lookup (10)", {"prompt_lookup_num_tokens": 10})):
            if "assistant" in kw and draft is None:
                continue
            if late():
                skipped.append(name)
                continue
            eos = bench.runner.model_config.eos_token_ids if stop_at_eos else None
            r = hf_tokens_per_s(target, sp, max_new_tokens, eos_token_ids=eos, **kw)
            peers.append({"method": name, "tokens_per_s_b1": round(r["tokens_per_s"], 1)})
            log(f"{name}: {r['tokens_per_s']:.1f} tok/s at batch 1 (greedy)")
    return {"device": device, **bench.state(), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "stop_at_eos": stop_at_eos,
            "speed_prompts": speed_prompts, "engine": rows, "hf": peers, "skipped": skipped}


def markdown(result: dict) -> str:
    ar = next((r.get("tokens_per_s_b1") for r in result["engine"] if r["method"] == "AR"), None)
    temps = sorted({k for r in result["engine"] for k in r if k.startswith("tau_")})
    columns = ["method", *(f"τ (T={t[5:]})" for t in temps), "tok/s (batch 1, greedy)", "vs AR"]
    upto = "up to " if result.get("stop_at_eos") else ""
    stop = " (stop at EOS)" if upto else ""
    lines = [f"Device: {result['device']}; {result['prompts']} held-out prompts, {upto}{result['max_new_tokens']} new "
             f"tokens{stop}; tok/s over the first {result['speed_prompts']}. Ran: {result.get('attention_backend')}, "
             f"target graphs {result.get('target_graphs')}, draft graphs {result.get('draft_graphs')}, static draft "
             f"step {result.get('static_draft_step')}.", "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    for r in result["engine"] + result["hf"]:
        tps = r.get("tokens_per_s_b1")
        cells = [r["method"], *(f"{r[t]:.2f}" if t in r else "-" for t in temps),
                 str(tps) if tps is not None else "-", f"{tps / ar:.2f}x" if tps and ar else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target checkpoint folder")
    p.add_argument("--draft", default=None, help="STANDALONE draft folder")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 head folder")
    p.add_argument("--eagle", default=None, help="EAGLE (EAGLE-2) head folder")
    p.add_argument("--dflash", default=None, help="DFLASH draft folder (one block of its block_size per step)")
    p.add_argument("--uno", default=None, help="UNO draft LoRA folder (PEFT layout) of the target")
    p.add_argument("--prompts", required=True, help="jsonl with prompt_ids per line")
    p.add_argument("--num-prompts", type=int, default=40, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--speed-prompts", type=int, default=10, help="prompts of the batch-1 tokens/s runs (0 = none)")
    p.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 1.0],
                   help="temperatures of the tau runs (none = only the batch-1 tokens/s runs)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--methods", nargs="*", default=None,
                   help='measure only these methods, by name (e.g. "EAGLE chain 3/1/4"); default: all that apply')
    p.add_argument("--cuda-graphs", choices=["all", "target", "none"], default="all",
                   help="CUDA graphs for target and drafts (as served), the target only, or none")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="stop at the target's EOS ids (chat prompts: answers end at <|im_end|>); default: ignore EOS")
    p.add_argument("--out", default=None, help="write JSON here and the markdown table beside it (.md)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts)[: args.num_prompts]
    result = evaluate(args.model, args.draft, args.eagle3, prompts, args.device, args.max_new_tokens,
                      args.speed_prompts, temperatures=tuple(args.temperatures), eagle_path=args.eagle,
                      only=args.methods, cuda_graphs=args.cuda_graphs, stop_at_eos=args.stop_at_eos,
                      dflash_path=args.dflash, uno_path=args.uno)
    table = markdown(result)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
