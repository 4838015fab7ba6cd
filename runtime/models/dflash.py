"""DFlash block-diffusion draft (`DFlashDraftModel`, the z-lab / SGLang layout): Qwen3-style decoder layers (per-head
q/k RMSNorm, SiLU MLP, separate q/k/v projections), `fc` over K concatenated target-layer features + `hidden_norm`,
a final `norm`; no embedding and no lm_head of its own (the target's, loaded from the target checkpoint).

Math of one draft block at positions s..s+B-1 (s = the bonus token's position): queries come from the block's
embeddings [bonus, MASK x (B-1)]; every layer attends over the context keys/values — k_proj/v_proj of
ctx = hidden_norm(fc(target features)) of the committed tokens before s, k-normed and RoPE'd at their positions
("context KV injection", the same ctx for every layer) — and over the whole block, without a causal mask inside it. Rows
1..B-1 of lm_head(norm(h)) are the B-1 draft tokens. Dense attention with an explicit mask (SDPA), so one module
serves the draft service (context K/V cached) and training (context K/V recomputed, many blocks per sequence).

Knows nothing about sequences, KV bookkeeping or the wire (draft_service/dflash.py owns those).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import EngineConfig, ModelConfig
from runtime.models import register_model
from runtime.models.llama import RMSNorm, RotaryEmbedding, _rotate_half

DFLASH_ARCH = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16  # SGLang's default when neither the flags nor the draft config say


def dflash_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default target layers (their outputs feed fc): one per draft layer, evenly spaced over [1, L-3];
    a single draft layer reads the middle layer L // 2."""
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def dflash_capture_layers(target_layer_ids: list[int], num_target_layers: int) -> list[int]:
    """ModelRunner `capture_layers` of a DFLASH target: layer id's output = the input of layer id + 1 (index L = the
    last layer's output before the final norm), as SGLang's `set_dflash_layers_to_capture`."""
    layers = [i + 1 for i in target_layer_ids]
    if any(not 1 <= i <= num_target_layers for i in layers):
        raise ValueError(f"DFLASH target_layer_ids {list(target_layer_ids)} out of range for a "
                         f"{num_target_layers}-layer target (each must be in [0, {num_target_layers - 1}])")
    return layers


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash draft's config.json: the decoder shape (as a ModelConfig: RoPE, norms, KV shape) and the DFlash keys."""

    model: ModelConfig  # vocab_size / max_position_embeddings are the target's
    block_size: int | None  # None: not in the config (the flags or SGLang's default 16 decide)
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int

    @classmethod
    def from_raw(cls, raw: dict, target: ModelConfig, source: str = "the DFLASH draft") -> DFlashConfig:
        from dataclasses import replace

        from transformers import Qwen3Config

        dflash = raw.get("dflash_config") or {}
        layer_types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{source}: layer_types {sorted(set(layer_types))}: only full_attention DFlash layers "
                             "are supported (sliding_attention is not)")
        known = {k: v for k, v in raw.items()
                 if k not in ("architectures", "auto_map", "model_type", "dflash_config", "block_size",
                              "num_target_layers", "mask_token_id", "layer_types", "sliding_window",
                              "use_sliding_window", "max_window_layers")}
        hf = Qwen3Config(**known)
        hf.architectures = ["Qwen3ForCausalLM"]  # Qwen3 decoder layers: q/k norm
        model = replace(ModelConfig.from_hf_config(hf, eos_token_ids=list(target.eos_token_ids)),
                        vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings,
                        tie_word_embeddings=False)
        if model.hidden_size != target.hidden_size:
            raise ValueError(f"{source}: hidden_size {model.hidden_size} != the target's {target.hidden_size} (a "
                             "DFlash draft embeds with the target's embedding and decodes with its lm_head)")
        block = dflash.get("block_size", raw.get("block_size"))
        num_target = int(raw.get("num_target_layers") or target.num_layers)
        if num_target != target.num_layers:
            raise ValueError(f"{source} was built for a {num_target}-layer target, this target has "
                             f"{target.num_layers} layers")
        ids = dflash.get("target_layer_ids")
        if ids is None:
            ids = dflash_target_layer_ids(target.num_layers, model.num_layers)
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise ValueError(f"{source}: config.json has no mask_token_id (dflash_config.mask_token_id): the id of "
                             "the target-vocabulary token that fills the block after the bonus token")
        if not 0 <= int(mask) < target.vocab_size:
            raise ValueError(f"{source}: mask_token_id {mask} outside the target vocabulary [0, {target.vocab_size})")
        if block is not None and int(block) < 2:
            raise ValueError(f"{source}: block_size must be >= 2, got {block}")
        dflash_capture_layers(list(ids), target.num_layers)  # range check
        return cls(model, None if block is None else int(block), tuple(int(i) for i in ids), int(mask), num_target)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features fc reads: K layers x the target's hidden size."""
        return len(self.target_layer_ids) * self.model.hidden_size


def read_block_size(draft_path: str) -> int | None:
    """block_size of a DFlash draft's config.json (dflash_config or top level); None when absent or unreadable."""
    try:
        with open(os.path.join(draft_path, "config.json")) as f:
            raw = json.load(f)
        block = (raw.get("dflash_config") or {}).get("block_size", raw.get("block_size"))
        return None if block is None else int(block)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


class DFlashAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., H) -> k, v (..., kvh, hd): k normed and rotated (cos/sin (..., 1, hd)); the context injection runs
        only this (SGLang's kv_proj_only)."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return k * cos + _rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (b, Q, H) block rows; ctx_k/ctx_v (b, L, kvh, hd); mask (b, 1, Q, L + Q) bool, True = visible."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))  # (b, Q, nh, hd)
        q = q * cos + _rotate_half(q) * sin
        k, v = self.kv(x, cos, sin)  # (b, Q, kvh, hd)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=1).transpose(1, 2)  # (b, kvh, L + Q, hd)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)  # (b, nh, Q, hd)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


@register_model(DFLASH_ARCH)
class DFlashDraftModel(nn.Module):
    """The draft. `embed_tokens` / `lm_head` are the target's tensors (set by the loader, or by the trainer), plain
    attributes, never part of the state dict."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.dflash = config
        model = config.model
        self.layers = nn.ModuleList(DFlashDecoderLayer(model) for _ in range(model.num_layers))
        self.norm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.fc = nn.Linear(config.feature_size, model.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.rotary = RotaryEmbedding(model)
        self.embed_tokens: torch.Tensor | None = None  # (V, H), the target's
        self.lm_head: torch.Tensor | None = None  # (V, H), the target's

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context KV injection: target features (..., K*H_t) of committed tokens at `positions` (...) -> per draft
        layer (k, v), each (..., kvh, hd)."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # (..., H)
        cos, sin = self._cos_sin(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                context: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (b, Q): block rows; context: per layer (k, v) (b, L, kvh, hd); mask (b, 1, Q, L + Q)
        bool. Returns the final-norm hidden states (b, Q, H)."""
        h = F.embedding(input_ids, self.embed_tokens).to(self.fc.weight.dtype)  # (b, Q, H)
        cos, sin = self._cos_sin(positions, h.dtype)
        for layer, (ctx_k, ctx_v) in zip(self.layers, context):
            h = layer(h, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(h)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., 1, hd) for positions of any shape (...): broadcast over heads."""
        cos, sin = self.rotary.cos_sin(positions.reshape(-1), dtype)  # (N, 1, hd)
        shape = (*positions.shape, 1, cos.shape[-1])
        return cos.reshape(shape), sin.reshape(shape)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = hidden @ self.lm_head.to(hidden.dtype).t()  # (..., V)
        return logits.float() if upcast else logits

    def set_target_tensors(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        self.embed_tokens = embed.to(device=device, dtype=dtype)
        self.lm_head = lm_head.to(device=device, dtype=dtype)


def build_raw_config(target: ModelConfig, *, num_layers: int = 1, num_heads: int = 4, num_kv_heads: int = 1,
                     head_dim: int | None = None, intermediate_size: int | None = None, block_size: int = 8,
                     target_layer_ids: list[int] | None = None, mask_token_id: int, rope_theta: float | None = None,
                     dtype: str = "float32") -> dict:
    """A DFlash config.json for a target (trainer and tests): the z-lab keys, full-attention layers."""
    ids = target_layer_ids or dflash_target_layer_ids(target.num_layers, num_layers)
    return {
        "architectures": [DFLASH_ARCH], "model_type": "qwen3", "hidden_size": target.hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or target.hidden_size // num_heads,
        "intermediate_size": intermediate_size or 2 * target.hidden_size, "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": rope_theta or target.rope_theta, "attention_bias": False,
        "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
        "tie_word_embeddings": False, "num_target_layers": target.num_layers, "block_size": block_size,
        "layer_types": ["full_attention"] * num_layers, "torch_dtype": dtype,
        "dflash_config": {"block_size": block_size, "target_layer_ids": list(ids), "mask_token_id": mask_token_id},
    }


def save_dflash_draft(model: DFlashDraftModel, raw_config: dict, path: str, dtype: torch.dtype | None = None) -> None:
    """config.json + model.safetensors in the published layout (no embedding, no lm_head)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous()
               for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    raw = dict(raw_config)
    if dtype is not None:
        raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)


def load_dflash_draft(draft_path: str, target_path: str, engine_config: EngineConfig) -> DFlashDraftModel:
    """A DFlash draft from its checkpoint folder, with the target checkpoint's embedding and lm_head, in eval mode on
    the engine's device (dtype: the engine's, or with auto the draft checkpoint's on GPU, float32 on CPU)."""
    from runtime.models.eagle import _safetensors_entries, load_target_embedding_and_head, read_config
    from runtime.models.loader import resolve_dtype

    if not os.path.isfile(os.path.join(draft_path, "config.json")):
        raise ValueError(f"{draft_path} has no config.json: not a DFlash draft checkpoint folder")
    raw = read_config(draft_path)
    arch = (raw.get("architectures") or [""])[0]
    if arch and arch != DFLASH_ARCH:
        raise ValueError(f"{draft_path} is a {arch} checkpoint, not a {DFLASH_ARCH} (DFLASH draft)")
    target = ModelConfig.from_pretrained(target_path)
    config = DFlashConfig.from_raw(raw, target, source=draft_path)
    model = DFlashDraftModel(config)
    params = dict(model.state_dict())
    loaded = {}
    for name, get in _safetensors_entries(draft_path):
        name = name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq") or name in ("embed_tokens.weight", "lm_head.weight"):
            continue  # the target's tensors are used, as SGLang does
        if name not in params:
            raise ValueError(f"DFLASH draft tensor {name!r} has no place in {DFLASH_ARCH}")
        tensor = get()
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model "
                             f"{tuple(params[name].shape)}")
        loaded[name] = tensor
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ValueError(f"DFLASH draft at {draft_path} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    model.load_state_dict(loaded)
    model = model.to(device=torch.device(engine_config.device), dtype=resolve_dtype(engine_config, config.model))
    embed, head = load_target_embedding_and_head(target_path, target)
    model.set_target_tensors(embed, head)
    return model.eval().requires_grad_(False)
