#!/usr/bin/env python
"""Train Tandem's demo model family from text every machine has offline: a Llama code target, a STANDALONE draft and
an EAGLE-3 head for the target, then measure speculative acceptance on held-out files.

Steps (deterministic for a given Python installation and --seed, except where training stops on wall time):
  1. corpus: every `*.py` under sysconfig's stdlib and purelib (site-packages) paths, files < 400 KB, in the order
     of sha1(name); the first --heldout-files of that order are held out, the rest are training text up to
     --max-corpus-mb; the sha256 of the sorted training file list is recorded (installed packages differ);
  2. a byte-level BPE tokenizer (--vocab-size) with the ChatML template and the tiny default's special tokens
     (<|endoftext|>=0 bos/eos/pad, <|im_start|>=1, <|im_end|>=2; eos_token_id [0, 2]), plus ChatML samples;
  3. the target and the draft (HF LlamaForCausalLM, tied embeddings, GQA), bf16 autocast on GPU, wall-clock budgets;
  4. the EAGLE-3 head (tools/train_eagle3.py, online: the target's features every step, TTT unroll);
  5. held-out loss, 40 held-out prompts (heldout_prompts.jsonl), and tau / tokens/s per algorithm through the
     engine (tools/spec_eval.py) next to HF assisted generation and prompt lookup.
Writes HF folders <out>/tandem-demo-code{,-draft,-eagle3} (bf16 safetensors, each with training_info.json) and
<out>/eval.json + eval.md.

    PYTHONPATH=. python3 tools/train_demo_pair.py --out-dir out/demo          # GPU: about 8 minutes
    python tools/train_demo_pair.py --tiny --out-dir /tmp/demo-tiny            # CPU smoke run at toy sizes
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)  # appended: a PYTHONPATH entry (e.g. a snapshot of runtime/) keeps precedence

from tools.lm_data import (  # noqa: E402
    collect_py_files,
    encode_docs,
    list_hash,
    llama_config,
    make_chat_examples,
    name_hash,
    python_roots,
    read_source,
    save_model,
    train_tokenizer,
)
from tools.lm_train import LMTrainConfig, heldout_loss, log, train_lm  # noqa: E402

TARGET_NAME = "tandem-demo-code"
DRAFT_NAME = "tandem-demo-code-draft"
EAGLE3_NAME = "tandem-demo-code-eagle3"

# Sizes are bound by the repository budget: everything under models/ ~25 MB in bf16.
TARGET_SHAPE = dict(hidden_size=384, num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=2,
                    intermediate_size=576)
DRAFT_SHAPE = dict(hidden_size=160, num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
                   intermediate_size=480)
EAGLE3_HEAD = dict(intermediate_size=384, draft_vocab_size=2048, aux_layer_ids=[1, 2, 3])
TINY_TARGET = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128)
TINY_DRAFT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64)
TARGET_SHARD = "12MB"  # keeps every committed file well under 16 MB


def main() -> None:
    args = parse_args()
    t_start = time.time()
    deadline = t_start + args.deadline_s if args.deadline_s else None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out_dir)
    tdir, ddir, edir = out / TARGET_NAME, out / DRAFT_NAME, out / EAGLE3_NAME
    tdir.mkdir(parents=True, exist_ok=True)
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=_version("transformers"),
               tokenizers=_version("tokenizers"), device=device,
               device_name=torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor())
    log(f"device {env['device_name']} ({device}); python {env['python']}, torch {env['torch']}")

    # 1. corpus
    t0 = time.time()
    data = build_corpus(args)
    log(f"corpus: {data['num_files']} files seen, train {len(data['train_names'])} files "
        f"({data['train_bytes'] / 1e6:.1f} MB), held out {len(data['heldout_names'])}; "
        f"train list sha256 {data['train_list_sha256'][:16]} ({time.time() - t0:.0f}s)")

    # 2. tokenizer + token streams
    t0 = time.time()
    rng = random.Random(args.seed)
    chats = make_chat_examples(data["train_texts"], args.chat_samples, rng)
    tok_docs, size = [], 0
    for text in data["train_texts"]:  # already in sha1 order: a fair sample of the corpus
        tok_docs.append(text)
        size += len(text)
        if size >= args.tokenizer_mb * 1e6:
            break
    tok = train_tokenizer(tok_docs + chats, args.vocab_size, tdir)
    log(f"tokenizer: vocab {len(tok)} trained on {size / 1e6:.1f} MB ({time.time() - t0:.0f}s)")
    t0 = time.time()
    docs = data["train_texts"] + chats
    rng.shuffle(docs)
    stream = encode_docs(tok, docs)
    del docs
    held_ids = [torch.tensor(ids, dtype=torch.int32) for ids in
                (e.ids for e in tok.backend_tokenizer.encode_batch(data["heldout_texts"], add_special_tokens=False))]
    log(f"encoded {stream.numel() / 1e6:.1f} M training tokens ({data['train_bytes'] / stream.numel():.2f} "
        f"bytes/token, {len(chats)} chat samples) ({time.time() - t0:.0f}s)")
    prompts = make_prompts(data["heldout_names"], held_ids, tok, args)
    with open(tdir / "heldout_prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    (tdir / "heldout_files.txt").write_text("\n".join(data["heldout_names"]) + "\n")
    common = dict(
        data=f"*.py under sysconfig stdlib + purelib of Python {env['python']} (files < {args.max_file_kb} KB, "
             f"sha1(name) order, first {args.heldout_files} held out, training text capped at {args.max_corpus_mb} MB)",
        train_files=len(data["train_names"]), train_bytes=data["train_bytes"],
        train_file_list_sha256=data["train_list_sha256"], heldout_files=len(data["heldout_names"]),
        train_tokens_in_stream=stream.numel(), chat_samples=len(chats), vocab_size=len(tok),
        tokenizer_trained_on_mb=round(size / 1e6, 1), environment=env, seed=args.seed,
        command="PYTHONPATH=. python3 tools/train_demo_pair.py " + " ".join(sys.argv[1:]))

    # 3. target and draft
    vocab = len(tok)
    tshape, dshape = (TINY_TARGET, TINY_DRAFT) if args.tiny else (TARGET_SHAPE, DRAFT_SHAPE)
    infos = {}
    target = _new_model(tshape, vocab, args.seed)
    infos["target"] = train_lm(target, stream, _lm_config(args, device, args.target_seconds, args.lr_target,
                                                          args.seed), "target")
    save_model(target, tok, tdir, torch.bfloat16, max_shard_size=TARGET_SHARD)
    target.float()  # bf16-rounded weights from here on: the head learns the features serving computes
    draft = _new_model(dshape, vocab, args.seed + 1)
    infos["draft"] = train_lm(draft, stream, _lm_config(args, device, args.draft_seconds, args.lr_draft,
                                                        args.seed + 1), "draft")
    save_model(draft, None, ddir, torch.bfloat16)  # the target's tokenizer serves it (models/ stays under 30 MB)
    draft.float()

    # 4. EAGLE-3 head
    from tools.train_eagle3 import TrainConfig, train_eagle3_online

    head = dict(EAGLE3_HEAD, intermediate_size=64, draft_vocab_size=256) if args.tiny else EAGLE3_HEAD
    ecfg = TrainConfig(steps=10**9, lr=args.lr_eagle3, batch_size=args.batch, seq_len=args.eagle3_seq_len,
                       ttt_steps=args.ttt_steps, time_budget_s=args.eagle3_seconds,
                       bf16_autocast=device.startswith("cuda"), log_every=args.log_every, seed=args.seed + 2,
                       device=device, save_dtype="bfloat16", **head)
    infos["eagle3"] = train_eagle3_online(target, stream, str(edir), ecfg)
    log(f"eagle3: loss {infos['eagle3']['final_loss']:.3f}, step-0 accuracy {infos['eagle3']['step0_accuracy']:.3f}")
    del stream

    # 5. evaluation
    t0 = time.time()
    evals = {"heldout_loss_tokens": args.eval_tokens}
    for role, model in (("target", target), ("draft", draft)):
        evals[f"heldout_loss_{role}"] = round(heldout_loss(model, held_ids, args.context, args.eval_tokens, device,
                                                           device.startswith("cuda")), 4)
    log(f"held-out loss: target {evals['heldout_loss_target']}, draft {evals['heldout_loss_draft']} "
        f"({time.time() - t0:.0f}s)")
    evals["sample"] = sample_completion(target, tok, device)
    log("greedy sample:\n" + evals["sample"])
    write_infos(tdir, ddir, edir, infos, common, evals, tshape, dshape, head, t_start)
    del target, draft
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if not args.no_spec_eval:
        run_spec_eval(out, tdir, ddir, edir, [p["prompt_ids"] for p in prompts], device, args, deadline)
    write_infos(tdir, ddir, edir, infos, common, evals, tshape, dshape, head, t_start)
    log(f"done in {time.time() - t_start:.0f}s")


def build_corpus(args) -> dict:
    roots = python_roots(include_purelib=not args.stdlib_only)
    files = collect_py_files(roots, args.max_file_kb * 1000)
    files.sort(key=lambda f: name_hash(f.name))  # a deterministic shuffle, the same on every run
    heldout, held_texts, train, train_texts, train_bytes = [], [], [], [], 0
    cap = args.max_corpus_mb * 1e6
    for f in files:
        if len(heldout) < args.heldout_files:
            text = read_source(roots, f)
            if text is not None and len(text) >= 2000:  # long enough for a 192-token prompt window
                heldout.append(f.name)
                held_texts.append(text)
                continue
        if train_bytes >= cap:
            continue  # keep scanning: the held-out quota may still be open
        text = read_source(roots, f)
        if text is None:
            continue
        train.append(f.name)
        train_texts.append(text)
        train_bytes += len(text.encode())
        if len(heldout) >= args.heldout_files and train_bytes >= cap:
            break
    return dict(num_files=len(files), train_names=train, train_texts=train_texts, train_bytes=train_bytes,
                heldout_names=heldout, heldout_texts=held_texts, train_list_sha256=list_hash(sorted(train)))


def make_prompts(names: list[str], held_ids: list[torch.Tensor], tok, args) -> list[dict]:
    """One code-completion prompt per held-out file (in held-out order) with room for the continuation: a window
    of prompt_len tokens at a seeded random position."""
    rng = random.Random(args.seed)
    prompts = []
    for name, ids in zip(names, held_ids):
        if ids.numel() < args.prompt_len + args.new_tokens + 1:
            continue
        start = rng.randint(0, ids.numel() - args.prompt_len - args.new_tokens)
        window = ids[start:start + args.prompt_len].tolist()
        prompts.append({"file": name, "start": start, "prompt_ids": window})
        if len(prompts) == args.eval_prompts:
            break
    return prompts


@torch.no_grad()
def sample_completion(model, tok, device: str) -> str:
    prompt = 'def read_config(path: str) -> dict:\n    """'
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False,
                         pad_token_id=0)
    return prompt + tok.decode(out[0, ids.shape[1]:].tolist())


def run_spec_eval(out: Path, tdir: Path, ddir: Path, edir: Path, prompts: list[list[int]], device: str, args,
                  deadline: float | None) -> None:
    """tools/spec_eval.py over the held-out prompts; a failure here leaves the trained folders intact."""
    from tools.spec_eval import evaluate, markdown

    t0 = time.time()
    try:
        result = evaluate(str(tdir), str(ddir), str(edir), prompts, device, args.new_tokens, args.speed_prompts,
                          log=log, deadline=deadline)
    except Exception as exc:  # noqa: BLE001 - report and keep the models
        log(f"spec eval failed: {type(exc).__name__}: {exc}")
        import traceback

        traceback.print_exc()
        return
    table = markdown(result)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "eval.md").write_text(table)
    log(f"spec eval ({time.time() - t0:.0f}s):\n{table}")


def write_infos(tdir, ddir, edir, infos, common, evals, tshape, dshape, head, t_start) -> None:
    spec = {}
    eval_path = tdir.parent / "eval.json"
    if eval_path.exists():
        spec = json.loads(eval_path.read_text())
    total = round(time.time() - t_start, 1)
    for folder, role, shape in ((tdir, "target", tshape), (ddir, "draft", dshape), (edir, "eagle3", head)):
        info = dict(role=role, shape=shape, training=infos[role], **common, evaluation=evals,
                    speculative_eval=spec, total_wall_time_s=total)
        (folder / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")


def _new_model(shape: dict, vocab: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(shape, vocab))


def _lm_config(args, device: str, seconds: float, lr: float, seed: int) -> LMTrainConfig:
    return LMTrainConfig(batch_size=args.batch, context_len=args.context, peak_lr=lr, warmup_steps=args.warmup,
                         time_budget_s=seconds, bf16_autocast=device.startswith("cuda") or args.cpu_bf16,
                         log_every=args.log_every, seed=seed, device=device)


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "absent"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out/demo", help="where the model folders and eval files are written")
    p.add_argument("--tiny", action="store_true", help="toy sizes and budgets: a CPU smoke run of every step")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=1234, help="seed of sampling, init and prompt positions")
    g = p.add_argument_group("data")
    g.add_argument("--stdlib-only", action="store_true", help="leave site-packages out (far too little text)")
    g.add_argument("--max-file-kb", type=int, default=400, help="skip larger files")
    g.add_argument("--max-corpus-mb", type=float, default=250, help="cap on training text")
    g.add_argument("--heldout-files", type=int, default=300, help="files (>= 2000 chars) kept out of training")
    g.add_argument("--tokenizer-mb", type=float, default=40, help="text the BPE tokenizer is trained on")
    g.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary (special tokens included)")
    g.add_argument("--chat-samples", type=int, default=20000, help="ChatML 'continue this code' samples mixed in")
    g = p.add_argument_group("training")
    g.add_argument("--target-seconds", type=float, default=140, help="wall-clock budget of the target")
    g.add_argument("--draft-seconds", type=float, default=50, help="wall-clock budget of the draft")
    g.add_argument("--eagle3-seconds", type=float, default=60, help="wall-clock budget of the EAGLE-3 head")
    g.add_argument("--batch", type=int, default=64, help="sequences per step")
    g.add_argument("--context", type=int, default=512, help="tokens per training window")
    g.add_argument("--lr-target", type=float, default=2e-3, help="peak LR of the target")
    g.add_argument("--lr-draft", type=float, default=3e-3, help="peak LR of the draft")
    g.add_argument("--lr-eagle3", type=float, default=3e-3, help="peak LR of the EAGLE-3 head")
    g.add_argument("--warmup", type=int, default=100, help="LR warm-up steps")
    g.add_argument("--eagle3-seq-len", type=int, default=256, help="tokens per EAGLE-3 training window")
    g.add_argument("--ttt-steps", type=int, default=3, help="EAGLE-3 training-time-test unroll")
    g.add_argument("--cpu-bf16", action="store_true", help="bf16 autocast on CPU too (fast on AMX CPUs)")
    g.add_argument("--log-every", type=int, default=200, help="progress line every N steps")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=int, default=40, help="held-out prompts (one per file)")
    g.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    g.add_argument("--new-tokens", type=int, default=64, help="generated tokens per prompt")
    g.add_argument("--speed-prompts", type=int, default=5, help="prompts of the batch-1 tokens/s runs")
    g.add_argument("--eval-tokens", type=int, default=100_000, help="held-out tokens for the loss")
    g.add_argument("--no-spec-eval", action="store_true", help="skip the speculative decoding measurements")
    g.add_argument("--deadline-s", type=float, default=0, help="skip remaining eval methods after this many "
                                                                "seconds from the start (0 = no deadline)")
    args = p.parse_args()
    if args.tiny:
        for k, v in dict(max_corpus_mb=min(args.max_corpus_mb, 3), heldout_files=min(args.heldout_files, 12),
                         tokenizer_mb=min(args.tokenizer_mb, 2), vocab_size=min(args.vocab_size, 512),
                         chat_samples=min(args.chat_samples, 200), target_seconds=min(args.target_seconds, 8),
                         draft_seconds=min(args.draft_seconds, 4), eagle3_seconds=min(args.eagle3_seconds, 6),
                         batch=min(args.batch, 8), context=min(args.context, 128), eagle3_seq_len=64, warmup=10,
                         log_every=min(args.log_every, 20), eval_prompts=min(args.eval_prompts, 4),
                         new_tokens=min(args.new_tokens, 16), speed_prompts=min(args.speed_prompts, 2),
                         eval_tokens=min(args.eval_tokens, 5000), prompt_len=min(args.prompt_len, 64)).items():
            setattr(args, k, v)
    return args


if __name__ == "__main__":
    main()
