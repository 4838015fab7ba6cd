#!/usr/bin/env python
"""Train a draft for ANY Llama-family target folder from a text corpus: a STANDALONE draft (a small Llama with the
target's tokenizer and vocabulary), an EAGLE-3 head or an EAGLE-2 head (tools/train_eagle3.py, online: the target's
features every step), MTP layers, or a DFLASH block-diffusion draft (tools/train_dflash.py, online), on CPU or GPU, with a progress bar. Writes an HF folder the matching proposer loads, with
training_info.json.

    python -m tools.train_draft --kind standalone --target-model-path T --corpus src/ --output-dir D --minutes 10
    python -m tools.train_draft --kind eagle3 --target-model-path T --corpus corpus.txt --output-dir H --device cuda
    python -m tools.train_draft --kind eagle --target-model-path T --corpus src/ --output-dir H --threads 2
    python -m tools.train_draft --kind mtp --num-mtp-layers 2 --target-model-path T --corpus src/ --output-dir T
    python -m tools.train_draft --kind dflash --target-model-path T --corpus src/ --output-dir D --device cuda
    python -m tools.train_draft --kind uno --lora-rank 8 --target-model-path T --corpus src/ --output-dir L

The corpus is a UTF-8 file or a folder (every *.py, *.txt, *.md, *.rst, *.json below it, sorted, less --exclude-glob
patterns and the files of --exclude-files, e.g. a target's heldout_files.txt); documents are joined with the
tokenizer's eos token.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from tools.lm_data import add_legacy_config_keys  # noqa: E402
from tools.lm_train import LMTrainConfig, log, train_lm  # noqa: E402

CORPUS_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json")


def read_corpus(path: str, max_mb: float, exclude_files: str | None = None,
                exclude_globs: list[str] | None = None) -> list[str]:
    """Documents of a file or folder. exclude_files: one path a line, relative to the folder, optionally under a label
    directory (`stdlib/json/decoder.py` excludes `json/decoder.py`, as in a target's heldout_files.txt);
    exclude_globs: fnmatch patterns of relative paths."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in CORPUS_SUFFIXES)
    skip: set[str] = set()
    if exclude_files:
        for line in Path(exclude_files).read_text().splitlines():
            if line.strip():
                skip |= {line.strip(), line.strip().partition("/")[2]}
    if not root.is_file() and (skip or exclude_globs):
        def kept(p: Path) -> bool:
            rel = p.relative_to(root).as_posix()
            return rel not in skip and not any(fnmatch.fnmatch(rel, g) for g in exclude_globs or [])

        files = [p for p in files if kept(p)]
    docs, size = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        size += len(text)
        if size >= max_mb * 1e6:
            break
    if not docs:
        raise SystemExit(f"error: no readable text under {path}")
    return docs


def encode(tokenizer, docs: list[str]) -> torch.Tensor:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    parts = []
    for s in range(0, len(docs), 1024):
        for ids in tokenizer(docs[s:s + 1024], add_special_tokens=False)["input_ids"]:
            parts.append(torch.tensor(ids + [eos], dtype=torch.int32))
    return torch.cat(parts)


def standalone_config(target_config, args):
    """A small Llama with the target's vocabulary, special ids and context length."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size, max_position_embeddings=target_config.max_position_embeddings,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=getattr(target_config, "pad_token_id", None), attn_implementation="sdpa")


def machine(device: str) -> str:
    """A short description of what trained: the GPU's name, or CPU with its core and torch thread counts."""
    import os
    import platform

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return (f"CPU ({platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
            f"{platform.platform()})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=["standalone", "eagle3", "eagle", "mtp", "dflash", "uno"], required=True,
                   help="what to train (mtp: one MTP layer appended to the target checkpoint itself, --output-dir "
                        "must be the target's folder; dflash: a DFLASH block-diffusion draft; uno: UNO's draft LoRA "
                        "of the target, a PEFT adapter folder)")
    p.add_argument("--target-model-path", required=True, help="Llama-family HF target folder (with tokenizer)")
    p.add_argument("--corpus", required=True, help="UTF-8 text file or folder of text files")
    p.add_argument("--output-dir", required=True, help="where the draft folder is written")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=None, help="also stop after this many steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--max-corpus-mb", type=float, default=200, help="cap on corpus text read")
    p.add_argument("--exclude-files", default=None,
                   help="file listing corpus files to leave out (e.g. the target's heldout_files.txt)")
    p.add_argument("--exclude-glob", action="append", default=[], help="fnmatch pattern of corpus paths to leave out")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="saved weights")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    g = p.add_argument_group("STANDALONE draft shape")
    g.add_argument("--hidden-size", type=int, default=256, help="draft hidden size")
    g.add_argument("--num-layers", type=int, default=2, help="draft decoder layers")
    g.add_argument("--num-heads", type=int, default=4, help="draft attention heads")
    g.add_argument("--num-kv-heads", type=int, default=2, help="draft KV heads")
    g.add_argument("--intermediate-size", type=int, default=768, help="draft FFN width")
    g = p.add_argument_group("EAGLE-3 / EAGLE-2 head")
    g.add_argument("--draft-vocab-size", type=int, default=None,
                   help="EAGLE-3: head lm_head rows; EAGLE-2: training softmax vocabulary only (default: full vocab)")
    g.add_argument("--head-intermediate-size", type=int, default=None, help="head FFN width (default: target's)")
    g.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll")
    g.add_argument("--num-mtp-layers", type=int, default=1,
                   help="mtp: MTP layers trained jointly as DeepSeek's chain (layer k predicts token t+k+2, unrolled "
                        "as multi-layer EAGLE serves them; the unroll is then this many steps, not --ttt-steps) and "
                        "appended as model.layers.{L..L+K-1} with num_nextn_predict_layers K")
    g.add_argument("--aux-layer-ids", type=int, nargs=3, default=None,
                   help="target layer outputs fed to fc (default: SGLang's [1, L//2-1, L-4]; EAGLE-3 only)")
    g.add_argument("--feature-loss-weight", type=float, default=1.0,
                   help="EAGLE-2 only: weight of the smooth-L1 regression of the target's next feature")
    g = p.add_argument_group("DFLASH draft (compact defaults)")
    g.add_argument("--dflash-num-layers", type=int, default=1, help="draft decoder layers")
    g.add_argument("--dflash-num-heads", type=int, default=4, help="draft attention heads")
    g.add_argument("--dflash-num-kv-heads", type=int, default=1, help="draft KV heads (GQA)")
    g.add_argument("--dflash-head-dim", type=int, default=None,
                   help="draft attention head size (default: the target's hidden size / --dflash-num-heads)")
    g.add_argument("--dflash-intermediate-size", type=int, default=None,
                   help="draft FFN width (default: the target's hidden size)")
    g.add_argument("--dflash-block-size", type=int, default=8,
                   help="block size written to the draft config (the served --speculative-num-draft-tokens default)")
    g.add_argument("--dflash-num-blocks", type=int, default=8, help="training blocks (random anchors) per window")
    g.add_argument("--dflash-target-layer-ids", type=int, nargs="+", default=None,
                   help="target layers whose outputs are the context features (default: evenly spaced over "
                        "[1, L-3], up to 3)")
    g.add_argument("--dflash-mask-token-id", type=int, default=None,
                   help="target-vocabulary id filling the block after the bonus token (default: the target's pad "
                        "token, else its last id)")
    g = p.add_argument_group("UNO LoRA (--kind uno)")
    g.add_argument("--lora-rank", type=int, default=8, help="LoRA rank r")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 r)")
    g.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="projections the LoRA adapts (default: q/k/v/o_proj and gate/up/down_proj)")
    g.add_argument("--uno-width", type=int, default=8,
                   help="draft forward width F trained: rows 1..F-1 learn tokens t+2..t+F (serve any F up to it)")
    g.add_argument("--uno-anchors", type=int, default=16, help="noise blocks per training window")
    args = p.parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.target_model_path)
    stream = encode(tokenizer, read_corpus(args.corpus, args.max_corpus_mb, args.exclude_files, args.exclude_glob))
    log(f"corpus: {stream.numel() / 1e6:.2f} M tokens ({time.time() - start:.0f}s)")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    bf16 = device.startswith("cuda")
    if args.kind == "standalone":
        from transformers import LlamaForCausalLM

        target_config = AutoConfig.from_pretrained(args.target_model_path)
        model = LlamaForCausalLM(standalone_config(target_config, args))
        cfg = LMTrainConfig(batch_size=args.batch_size, context_len=args.seq_len, peak_lr=args.lr,
                            max_steps=args.steps, time_budget_s=args.minutes * 60, bf16_autocast=bf16,
                            log_every=20, progress_bar=True, seed=args.seed, device=device)
        info = train_lm(model, stream, cfg, "draft")
        model.to(getattr(torch, args.save_dtype)).save_pretrained(out, safe_serialization=True)
        add_legacy_config_keys(out)
        tokenizer.save_pretrained(out)
    elif args.kind == "uno":
        from runtime.lora import LoRAConfig, save_adapter
        from tools.train_uno import MODULES, UnoTrainConfig, train_uno_online

        target = AutoModelForCausalLM.from_pretrained(args.target_model_path, dtype=torch.float32).to(device)
        modules = tuple(args.lora_target_modules or MODULES)
        alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
        cfg = UnoTrainConfig(rank=args.lora_rank, alpha=alpha, target_modules=modules, width=args.uno_width,
                             anchors=args.uno_anchors, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                             steps=args.steps or 10**9, time_budget_s=args.minutes * 60, seed=args.seed,
                             device=device)
        lora, info = train_uno_online(target, stream, cfg, log=log)
        save_adapter(out, LoRAConfig(args.lora_rank, alpha, modules), lora.export(),
                     dtype=getattr(torch, args.save_dtype),
                     extra_config={"base_model_name_or_path": str(args.target_model_path)})
    else:
        from tools.train_eagle3 import TrainConfig, train_eagle3_online, train_eagle_online, train_mtp_online

        target = AutoModelForCausalLM.from_pretrained(args.target_model_path, dtype=torch.float32).to(device)
        cfg = TrainConfig(steps=args.steps or 10**9, lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len,
                          ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size,
                          aux_layer_ids=args.aux_layer_ids if args.kind == "eagle3" else None,
                          intermediate_size=args.head_intermediate_size, feature_loss_weight=args.feature_loss_weight,
                          time_budget_s=args.minutes * 60, bf16_autocast=bf16, log_every=20, progress_bar=True,
                          save_dtype=args.save_dtype, seed=args.seed, device=device,
                          num_mtp_layers=args.num_mtp_layers if args.kind == "mtp" else 1)
        if args.kind == "dflash":
            from tools.train_dflash import DFlashTrainConfig, train_dflash_online

            shape = DFlashTrainConfig(num_layers=args.dflash_num_layers, num_heads=args.dflash_num_heads,
                                      num_kv_heads=args.dflash_num_kv_heads, head_dim=args.dflash_head_dim,
                                      intermediate_size=args.dflash_intermediate_size,
                                      block_size=args.dflash_block_size, num_blocks=args.dflash_num_blocks,
                                      target_layer_ids=args.dflash_target_layer_ids,
                                      mask_token_id=args.dflash_mask_token_id)
            info = train_dflash_online(target, stream, str(out), cfg, shape)
        else:
            train = {"eagle3": train_eagle3_online, "eagle": train_eagle_online, "mtp": train_mtp_online}[args.kind]
            info = train(target, stream, str(out), cfg, args.kind)
    info = dict(kind=args.kind, target=str(args.target_model_path), corpus=str(args.corpus),
                corpus_tokens=stream.numel(), tokens_seen=info["steps"] * args.batch_size * args.seq_len,
                device=device, machine=machine(device), training=info, total_wall_time_s=time.time() - start,
                command="python -m tools.train_draft " + " ".join(sys.argv[1:] if argv is None else argv))
    # An MTP layer is written into the target's own folder: its training_info.json stays the target's.
    (out / ("mtp_training_info.json" if args.kind == "mtp" else "training_info.json")).write_text(
        json.dumps(info, indent=2) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
