"""Shared data and checkpoint helpers of Tandem's bundled-model trainers: the Python-source corpus, the byte-level BPE
tokenizer with its ChatML template and special tokens, token streams, and HF checkpoint folders both transformers 4.x
and 5.x read.

Used by tools/train_tiny_default.py, tools/train_demo_pair.py and tools/train_draft.py. Knows nothing about model
shapes or training loops (tools/lm_train.py owns those).
"""
from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = [EOT, IM_START, IM_END]  # ids 0, 1, 2
EOS_TOKEN_IDS = [0, 2]  # completion stops at <|endoftext|>, chat at <|im_end|>

# Qwen-style ChatML template. System message is optional (no default system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
MAX_FILE_BYTES = 400_000


@dataclass(frozen=True)
class SourceFile:
    root_name: str  # "stdlib" or "purelib"
    rel: str  # path relative to the root, posix

    @property
    def name(self) -> str:
        return f"{self.root_name}/{self.rel}"


def python_roots(include_purelib: bool = True) -> dict[str, Path]:
    """The installation's stdlib (and site-packages) folders, by sysconfig name."""
    paths = sysconfig.get_paths()
    roots = {"stdlib": Path(paths["stdlib"]).resolve()}
    if include_purelib:
        roots["purelib"] = Path(paths["purelib"]).resolve()
    return roots


def collect_py_files(roots: dict[str, Path], max_file_bytes: int = MAX_FILE_BYTES) -> list[SourceFile]:
    """Every non-empty `*.py` under the roots up to max_file_bytes, sorted by name. site-packages below stdlib is
    skipped (it is the purelib root when asked for)."""
    files = []
    for root_name, root in roots.items():
        for p in root.rglob("*.py"):
            rel = p.relative_to(root).as_posix()
            if root_name == "stdlib" and ("site-packages/" in rel or rel.startswith("dist-packages/")):
                continue
            try:
                if not p.is_file() or not 0 < p.stat().st_size <= max_file_bytes:
                    continue
            except OSError:
                continue
            files.append(SourceFile(root_name, rel))
    files.sort(key=lambda f: f.name)
    return files


def name_hash(name: str) -> int:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16)


def read_source(roots: dict[str, Path], f: SourceFile) -> str | None:
    try:
        return (roots[f.root_name] / f.rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def list_hash(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def make_chat_examples(texts: list[str], n: int, rng: random.Random) -> list[str]:
    """A few ChatML-formatted samples so the model learns the chat format and to stop at <|im_end|>.

    user: "Continue this Python code:" + a few lines; assistant: the next few lines of the same file."""
    out = []
    cands = [t for t in texts if t.count("\n") > 20]
    for _ in range(n if cands else 0):
        lines = rng.choice(cands).split("\n")
        k = rng.randint(3, 12)
        m = rng.randint(2, 8)
        i = rng.randint(0, max(0, len(lines) - k - m))
        user = "Continue this Python code:\n" + "\n".join(lines[i:i + k])
        assistant = "\n".join(lines[i + k:i + k + m]).strip("\n")
        if not assistant.strip():
            continue
        out.append(f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n")
    return out


# ---------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path | None = None):
    """Byte-level BPE with the special tokens at ids 0, 1, 2, as a HF fast tokenizer carrying the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT, eos_token=EOT, pad_token=EOT, unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        save_tokenizer(hf, out_dir)
    return hf


def save_tokenizer(tok, folder: Path) -> None:
    """save_pretrained, then make tokenizer_config.json readable by transformers 4.x as well as 5.x:
    class PreTrainedTokenizerFast (5.x writes "TokenizersBackend"), the special tokens as
    additional_special_tokens, and the chat template inline (5.x writes only chat_template.jinja)."""
    folder = Path(folder)
    tok.save_pretrained(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("extra_special_tokens", None)
    for k in ("backend", "is_local", "local_files_only"):
        cfg.pop(k, None)
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def encode_docs(tok, docs: list[str], batch: int = 2048) -> torch.Tensor:
    """Concatenate docs, each followed by <|endoftext|> (id 0), into one token stream (int32). encode_batch runs
    on every core."""
    backend = tok.backend_tokenizer
    parts = []
    for s in range(0, len(docs), batch):
        for enc in backend.encode_batch(docs[s:s + batch], add_special_tokens=False):
            parts.append(torch.tensor(enc.ids + [0], dtype=torch.int32))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


# ------------------------------------------------------------------------------------- checkpoints
def llama_config(shape: dict, vocab_size: int, max_position_embeddings: int = 2048):
    """A LlamaConfig with the bundled models' conventions: tied embeddings, eos [0, 2], rope 10000, eps 1e-5."""
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False,
        bos_token_id=0, eos_token_id=list(EOS_TOKEN_IDS), pad_token_id=0, initializer_range=0.02,
        attn_implementation="sdpa", **shape,
    )


def save_model(model, tok, folder: Path, dtype: torch.dtype, max_shard_size: str = "5GB") -> None:
    """HF checkpoint folder: safetensors in `dtype` (sharded past max_shard_size), generation_config (greedy,
    eos [0, 2]), 4.x config keys, tokenizer. Converts `model` to `dtype` in place."""
    from transformers import GenerationConfig
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype)
    model.config.torch_dtype = dtype
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=list(EOS_TOKEN_IDS), pad_token_id=0,
                                               do_sample=False, max_new_tokens=256)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    add_legacy_config_keys(folder)
    if tok is not None:
        save_tokenizer(tok, folder)


def add_legacy_config_keys(folder: Path) -> None:
    """transformers 5.x writes "dtype" and "rope_parameters"; add the 4.x spellings too ("torch_dtype",
    "rope_theta") so that either major version (the GPU host may run 4.x) reads the same model."""
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    rp = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
    cfg.setdefault("rope_scaling", None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
