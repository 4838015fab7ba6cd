#!/usr/bin/env python
"""Train Tandem's tiny CPU default model pair (target + draft) from the Python stdlib sources.

The pair exists so that ``tandem serve`` can start with no download and speculative decoding shows
real (non-zero) acceptance. It is NOT an assistant: it is a tiny code-completion model trained for
minutes on 2 CPU cores. The GPU-trained demo pair replaces it later.

Steps (all deterministic for a given Python installation and --seed):
  1. collect ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (site-packages excluded), sorted; hold
     out ~5% of files chosen by a hash of their relative path; record a hash of the training list;
  2. train a byte-level BPE tokenizer (``tokenizers``), save it as a HF fast tokenizer with a ChatML
     chat template;
  3. train a Llama target and a Llama draft (HF ``LlamaForCausalLM``, CPU);
  4. save both as HF checkpoint folders (bf16 safetensors, tokenizer files, generation_config.json,
     training_info.json, heldout_files.txt);
  5. evaluate on held-out files: loss of both and greedy chain acceptance tau (draft proposes k
     tokens greedily, target verifies greedily; accepted tokens per target step incl. the bonus).

Usage:
  python tools/train_tiny_default.py --out-dir models --minutes-target 20 --minutes-draft 8
  python tools/train_tiny_default.py --bench          # measure training throughput only
  python tools/train_tiny_default.py --eval-only      # re-evaluate saved folders
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.lm_data import (  # noqa: E402
    MAX_FILE_BYTES,
    encode_docs,
    list_hash,
    llama_config,
    make_chat_examples,
    name_hash,
    save_model,
    train_tokenizer,
)
from tools.lm_train import LMTrainConfig, heldout_loss, log, train_lm  # noqa: E402

TARGET_NAME = "tandem-tiny-code"
DRAFT_NAME = "tandem-tiny-code-draft"

TARGET_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=768)
DRAFT_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=384)

HELDOUT_MOD = 20  # ~5%


# --------------------------------------------------------------------------------------------- data
def collect_files() -> tuple[Path, list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    rels = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel or rel.startswith("dist-packages/"):
            continue
        try:
            if not p.is_file() or p.stat().st_size > MAX_FILE_BYTES or p.stat().st_size == 0:
                continue
        except OSError:
            continue
        rels.append(rel)
    rels.sort()
    return root, rels


def is_heldout(rel: str) -> bool:
    return name_hash(rel) % HELDOUT_MOD == 0


def read_text(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_model(name, shape, vocab_size, stream, args, minutes, peak_lr, seed, bench_steps=0):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(shape, vocab_size))
    cfg = LMTrainConfig(batch_size=args.batch, context_len=args.context, peak_lr=peak_lr, seed=seed,
                        max_steps=bench_steps or None, time_budget_s=None if bench_steps else minutes * 60.0,
                        bf16_autocast=args.bf16_autocast, log_every=args.log_every)
    info = train_lm(model, stream, cfg, name)
    return model, dict(info, shape=shape)


@torch.no_grad()
def chain_tau(target, draft, prompts: list[torch.Tensor], k: int, new_tokens: int) -> tuple[float, int, int]:
    """Greedy chain speculative decoding (no KV cache; the models are tiny). Returns (tau, steps, tokens)."""
    steps = produced = 0
    for p in prompts:
        seq = p.long().tolist()
        n0 = len(seq)
        while len(seq) - n0 < new_tokens:
            prop = []
            ctx = list(seq)
            for _ in range(k):
                t = int(draft(input_ids=torch.tensor([ctx])).logits[0, -1].argmax())
                prop.append(t)
                ctx.append(t)
            logits = target(input_ids=torch.tensor([seq + prop])).logits[0, len(seq) - 1:]
            tgt = logits.argmax(-1).tolist()  # k+1 target predictions
            acc = 0
            while acc < k and prop[acc] == tgt[acc]:
                acc += 1
            seq.extend(prop[:acc] + [tgt[acc]])
            steps += 1
            produced += acc + 1
    return produced / max(steps, 1), steps, produced


def evaluate(out_dir: Path, args) -> dict:
    from transformers import AutoTokenizer, LlamaForCausalLM
    tdir, ddir = out_dir / TARGET_NAME, out_dir / DRAFT_NAME
    tok = AutoTokenizer.from_pretrained(tdir)
    target = LlamaForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    held = [l for l in (tdir / "heldout_files.txt").read_text().split("\n") if l]
    texts = []
    for rel in held:  # first 10 held-out files (sorted) with at least 2 KB of text
        t = read_text(root, rel)
        if t is not None and len(t) >= 2000:
            texts.append((rel, t))
        if len(texts) == 10:
            break
    ids = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for _, t in texts]
    res = {"eval_files": [r for r, _ in texts]}
    t0 = time.time()
    res["heldout_loss_target"] = round(heldout_loss(target, ids, args.context, args.eval_tokens), 4)
    res["heldout_loss_draft"] = round(heldout_loss(draft, ids, args.context, args.eval_tokens), 4)
    log(f"held-out loss target {res['heldout_loss_target']} draft {res['heldout_loss_draft']} "
        f"({time.time() - t0:.0f}s)")
    # 4 prompts per file at evenly spaced positions, prompt length 128 tokens, 48 new tokens
    rng = random.Random(args.seed)
    prompts = []
    for x in ids:
        for j in range(args.tau_per_file):
            if x.numel() < 128 + 48:
                continue
            s = rng.randint(0, x.numel() - 128 - 48)
            prompts.append(x[s:s + 128])
    t0 = time.time()
    tau, steps, produced = chain_tau(target, draft, prompts, args.k, args.tau_new_tokens)
    res.update(tau_chain=round(tau, 3), tau_k=args.k, tau_prompts=len(prompts), tau_target_steps=steps,
               tau_tokens=produced, tau_prompt_len=128, tau_new_tokens=args.tau_new_tokens)
    log(f"greedy chain tau (k={args.k}) = {tau:.3f} over {len(prompts)} prompts ({time.time() - t0:.0f}s)")
    # sanity check against HF assisted generation on one prompt
    p = prompts[0][None].long()
    ref = target.generate(p, max_new_tokens=32, do_sample=False)
    ass = target.generate(p, max_new_tokens=32, do_sample=False, assistant_model=draft)
    res["hf_assisted_matches_greedy"] = bool(torch.equal(ref, ass))
    # samples
    prompt = 'def read_config(path: str) -> dict:\n    """'
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    out = target.generate(**enc, max_new_tokens=96, do_sample=False)
    res["sample_prompt"] = prompt
    res["sample_completion"] = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    msgs = [{"role": "user", "content": "Continue this Python code:\nimport os\n\ndef list_py_files(root):"}]
    chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = tok(chat, return_tensors="pt", add_special_tokens=False)
    out = target.generate(**enc, max_new_tokens=96, do_sample=False)
    res["chat_prompt"] = chat
    res["chat_completion"] = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    log("greedy sample:\n" + prompt + res["sample_completion"])
    log("chat sample:\n" + chat + res["chat_completion"])
    return res


# --------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="models")
    ap.add_argument("--minutes-target", type=float, default=20.0)
    ap.add_argument("--minutes-draft", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr-target", type=float, default=2e-3)
    ap.add_argument("--lr-draft", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--chat-samples", type=int, default=5000,
                    help="ChatML 'continue this code' samples mixed into the stream (~5%% of tokens)")
    ap.add_argument("--bf16-autocast", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for matmuls (fp32 master weights); a large win on CPUs with AMX")
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--bench", action="store_true", help="time a few training steps of both models and exit")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tau-per-file", type=int, default=4)
    ap.add_argument("--tau-new-tokens", type=int, default=48)
    ap.add_argument("--eval-tokens", type=int, default=60000)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    cmdline = "python " + " ".join([sys.argv[0]] + sys.argv[1:])
    if args.eval_only:
        res = evaluate(out_dir, args)
        print(json.dumps(res, indent=2))
        return

    t_start = time.time()
    random.seed(args.seed)
    root, rels = collect_files()
    train_rels = [r for r in rels if not is_heldout(r)]
    held_rels = [r for r in rels if is_heldout(r)]
    texts = []
    kept = []
    for r in train_rels:
        t = read_text(root, r)
        if t is not None:
            texts.append(t)
            kept.append(r)
    train_rels = kept
    fhash = list_hash(train_rels)
    nbytes = sum(len(t.encode()) for t in texts)
    log(f"stdlib {root}: {len(rels)} files, train {len(train_rels)} ({nbytes / 1e6:.1f} MB), "
        f"held out {len(held_rels)}; train list sha256 {fhash[:16]}")

    rng = random.Random(args.seed)
    chats = make_chat_examples(texts, args.chat_samples, rng)
    tdir, ddir = out_dir / TARGET_NAME, out_dir / DRAFT_NAME
    tdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok = train_tokenizer(texts + chats, args.vocab_size, tdir)
    log(f"tokenizer trained: vocab {len(tok)} ({time.time() - t0:.0f}s)")
    docs = texts + chats
    rng.shuffle(docs)
    t0 = time.time()
    stream = encode_docs(tok, docs)
    log(f"encoded {stream.numel() / 1e6:.2f} M tokens ({nbytes / stream.numel():.2f} bytes/token, "
        f"{len(chats)} chat samples) in {time.time() - t0:.0f}s")

    if args.bench:
        for name, shape in (("target", TARGET_SHAPE), ("draft", DRAFT_SHAPE)):
            train_model(name, shape, len(tok), stream, args, 1.0, 1e-3, args.seed, bench_steps=10)
        return

    target, tinfo = train_model("target", TARGET_SHAPE, len(tok), stream, args, args.minutes_target,
                                args.lr_target, args.seed)
    dtype = getattr(torch, args.save_dtype)
    save_model(target, tok, tdir, dtype)
    del target
    draft, dinfo = train_model("draft", DRAFT_SHAPE, len(tok), stream, args, args.minutes_draft,
                               args.lr_draft, args.seed + 1)
    save_model(draft, tok, ddir, dtype)
    del draft
    for d in (tdir, ddir):
        (d / "heldout_files.txt").write_text("\n".join(held_rels) + "\n")

    res = evaluate(out_dir, args)
    common = dict(data=f"Python {sys.version.split()[0]} stdlib *.py (site-packages excluded, files <= 400 KB)",
                  train_files=len(train_rels), train_bytes=nbytes, train_tokens_in_stream=stream.numel(),
                  heldout_files=len(held_rels), train_file_list_sha256=fhash, chat_samples=len(chats),
                  vocab_size=len(tok), command=cmdline, total_wall_time_s=round(time.time() - t_start, 1),
                  torch=torch.__version__, save_dtype=args.save_dtype)
    eval_keys = ["eval_files", "heldout_loss_target", "heldout_loss_draft", "tau_chain", "tau_k", "tau_prompts",
                 "tau_target_steps", "tau_tokens", "tau_prompt_len", "tau_new_tokens", "hf_assisted_matches_greedy"]
    ev = {k: res[k] for k in eval_keys}
    for d, info, role in ((tdir, tinfo, "target"), (ddir, dinfo, "draft")):
        info = dict(role=role, shape=TARGET_SHAPE if role == "target" else DRAFT_SHAPE, **info, **common,
                    heldout_loss=res[f"heldout_loss_{role}"], eval=ev)
        (d / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({"target": tinfo, "draft": dinfo, **common, **res}, indent=2))


if __name__ == "__main__":
    main()
