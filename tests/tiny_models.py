"""Tiny random HF checkpoints for tests: real `save_pretrained` folders (config.json + model.safetensors) that the
real loader reads and HF transformers can run as the oracle. Weights are seeded and wide enough (std 0.2) that greedy
outputs vary from step to step.
"""

from __future__ import annotations

import os
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_hf_config(family: str, **overrides: Any):
    """A small transformers config of the given family; overrides go to the config constructor."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":  # GQA, untied
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
    elif family == "mistral":
        cfg = MistralConfig(**{**common, "tie_word_embeddings": False, "sliding_window": None, **overrides})
    elif family == "qwen2":  # qkv bias, tied embeddings
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": True, "use_sliding_window": False, **overrides})
    elif family == "qwen3":  # q/k norm, explicit head_dim different from hidden / heads
        cfg = Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": False, **overrides})
    else:
        raise ValueError(f"unknown tiny model family {family!r}; known: {FAMILIES}")
    return cfg


def make_tiny_model(family: str, dir: str | os.PathLike, seed: int = 0, std: float = 0.2, **overrides: Any) -> str:
    """Build, randomize and save a tiny HF model of `family` under `dir`/`family`; return the folder path."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)  # non-trivial norm scales, so a skipped norm shows up in tests
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(std * noise)
    path = os.path.join(os.fspath(dir), family)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf_model(path: str):
    """The HF oracle for a tiny checkpoint: fp32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """(len(token_ids), vocab) float32 logits of HF on one causal sequence."""
    out = hf_model(torch.tensor([token_ids]))
    return out.logits[0].float()


def add_mtp_layers(path: str, num_layers: int = 2, seed: int = 5, std: float = 0.2) -> str:
    """Append `num_layers` MTP / NextN layers to a tiny checkpoint in DeepSeek-V3's layout (`model.layers.{L + i}.*`:
    enorm, hnorm, eh_proj, a decoder layer, shared_head.norm; config num_nextn_predict_layers), in a second
    safetensors file that HF transformers does not read (its model has no such layers, as for real MTP checkpoints)."""
    import json

    from safetensors.torch import save_file

    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    h, inter, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: std * torch.randn(*shape, generator=gen)  # noqa: E731
    norm = lambda n: 1.0 + 0.1 * torch.randn(n, generator=gen)  # noqa: E731
    tensors = {}
    for i in range(num_layers):
        p = f"model.layers.{L + i}."
        tensors.update({
            p + "enorm.weight": norm(h), p + "hnorm.weight": norm(h), p + "eh_proj.weight": rand(h, 2 * h),
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.k_proj.weight": rand(kv * hd, h),
            p + "self_attn.v_proj.weight": rand(kv * hd, h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter), p + "shared_head.norm.weight": norm(h)})
        if config.get("model_type") == "qwen2":
            for proj, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
                tensors[p + f"self_attn.{proj}.bias"] = 0.1 * torch.randn(rows, generator=gen)
        if config.get("model_type") == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = norm(hd)
            tensors[p + "self_attn.k_norm.weight"] = norm(hd)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "mtp.safetensors"))
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):  # a sharded checkpoint lists its MTP tensors in the index, as real ones do
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"].update({name: "mtp.safetensors" for name in tensors})
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
    config["num_nextn_predict_layers"] = num_layers
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def make_tiny_dflash_draft(target_path: str, dir: str | os.PathLike, *, block_size: int = 4, num_layers: int = 1,
                           seed: int = 3, std: float = 0.2, **config: Any) -> str:
    """A random DFlash draft (runtime/models/dflash.py layout: no embedding, no lm_head) for a tiny target, saved as a
    real checkpoint folder (config.json + model.safetensors) under `dir`; config: build_raw_config overrides."""
    from runtime.config import ModelConfig
    from runtime.models.dflash import DFlashConfig, DFlashDraftModel, build_raw_config, save_dflash_draft

    target = ModelConfig.from_pretrained(target_path)
    raw = build_raw_config(target, num_layers=num_layers, num_heads=4, num_kv_heads=2, block_size=block_size,
                           mask_token_id=config.pop("mask_token_id", target.vocab_size - 1), **config)
    model = DFlashDraftModel(DFlashConfig.from_raw(raw, target))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else std * noise)
    path = os.path.join(os.fspath(dir), "dflash")
    save_dflash_draft(model, raw, path)
    return path


def make_tiny_lora(model_path: str, dir: str | os.PathLike, r: int = 4, seed: int = 3, std: float = 0.3,
                   modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj")) -> str:
    """A random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a tiny checkpoint; returns
    its folder. B is non-zero, so draft rows really differ from the base model's."""
    import json

    from runtime.lora import LoRAConfig, save_adapter

    cfg = json.loads(open(os.path.join(model_path, "config.json")).read())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in modules:
            n_in, n_out = shapes[m]
            weights[(layer, m)] = (std * torch.randn(r, n_in, generator=gen), std * torch.randn(n_out, r, generator=gen))
    path = os.path.join(os.fspath(dir), "lora")
    save_adapter(path, LoRAConfig(r, 2.0 * r, modules), weights, dtype=torch.float32)
    return path
