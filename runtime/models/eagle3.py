"""EAGLE-3 draft head (`LlamaForCausalLMEagle3`) as published by EAGLE-3 / SpecForge (`midlayer.*`, `fc`, `norm`,
`lm_head` over `draft_vocab_size`, `d2t` offsets), and which target layers feed it (`eagle3_capture_layers`).

Math: the target's aux hidden states (num_aux * target_H) go through fc (only they do); one decoder layer attends
over cat(input_layernorm(embed), hidden_norm(h)) with residual h; final norm -> own lm_head. The recurrent feature of
the next draft step is the pre-norm output (normed if `norm_output`). Knows nothing about sequences or trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.attention import AttentionBackend
from runtime.config import EngineConfig, ModelConfig
from runtime.kv_pool import KVPool
from runtime.models import register_model
from runtime.models.eagle import (
    EAGLE3_ARCH,
    _copy,
    draft_model_config,
    load_draft_weights,
    load_target_embedding_and_head,
    materialize,
)
from runtime.models.llama import MLP, Attention, ModelOutput, RMSNorm, RotaryEmbedding, _k, use_fused

_LEGACY_NAMES = {"midlayer.": "layers.0.", "aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.",
                 "aux_norm_high.": "fc_norm.2."}


def eagle3_capture_layers(num_target_layers: int, aux_layer_ids: list[int] | None) -> list[int]:
    """ModelRunner `capture_layers` for an EAGLE-3 target: inputs of these layers (= outputs of the layer before).

    Default [2, L//2, L-3]; configured `eagle_aux_hidden_state_layer_ids` [a, b, c] name layer *outputs*, so they
    are captured at the input of a+1, b+1, c+1 (index L = the last layer's output before the final norm)."""
    num = num_target_layers
    layers = [2, num // 2, num - 3] if aux_layer_ids is None else [a + 1 for a in aux_layer_ids]
    if any(not 0 <= i <= num for i in layers):
        raise ValueError(f"EAGLE-3 capture layers {layers} out of range for a {num}-layer target")
    return layers


def eagle3_aux_layer_ids(raw_config: dict) -> list[int] | None:
    """`eagle_config.eagle_aux_hidden_state_layer_ids` of a published EAGLE-3 config.json, None if unset."""
    ids = (raw_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


@dataclass(frozen=True)
class Eagle3Options:
    """The EAGLE-3 specifics of a config.json beyond the decoder shape."""

    target_hidden_size: int
    num_aux: int = 3
    aux_layer_ids: tuple[int, ...] | None = None
    draft_vocab_size: int | None = None  # None = the target's vocabulary
    fc_bias: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        if self.num_aux < 1 or self.target_hidden_size < 1:
            raise ValueError("num_aux and target_hidden_size must be positive")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux:
            raise ValueError(f"{len(self.aux_layer_ids)} aux layer ids for num_aux={self.num_aux}")

    @classmethod
    def from_config(cls, raw: dict, target_config: ModelConfig) -> Eagle3Options:
        eagle = raw.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise NotImplementedError("EAGLE-3 heads without aux hidden states (use_aux_hidden_state=false)")
        ids = eagle3_aux_layer_ids(raw)
        num_aux = raw.get("num_aux_hidden_states") or (len(ids) if ids is not None else 3)
        return cls(
            target_hidden_size=raw.get("target_hidden_size") or target_config.hidden_size,
            num_aux=num_aux,
            aux_layer_ids=None if ids is None else tuple(ids),
            draft_vocab_size=raw.get("draft_vocab_size"),
            fc_bias=bool(raw.get("bias", False)),
            fc_norm=bool(raw.get("fc_norm", False) or raw.get("use_aux_norm", False)),
            norm_output=bool(raw.get("norm_output", False)),
        )


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, 0)
        # q/k/v read the concatenated (embedding, hidden) pair: 2H wide.
        attn = self.self_attn
        attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=config.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, e, h, cos, sin, backend, kv_pool) -> torch.Tensor:
        x = self._input_pair(e, h)  # (N, 2H)
        attn = self.self_attn(x, cos, sin, backend, kv_pool)
        norm = self.post_attention_layernorm
        if use_fused(attn):  # the residual add inside the norm's launch, rounded as torch rounds `h + attn`
            normed, h = _k("norm").fused_add_rms_norm(attn, h, norm.weight, norm.eps)
            return h + self.mlp(normed)
        h = h + attn
        return h + self.mlp(norm(h))

    def _input_pair(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """cat(input_layernorm(e), hidden_norm(h)): in a graph one launch (tandem_kernels/norm.rms_norm_pair; was two
        norms and a cat, 10 of the ~140 kernels of a 5-step tree Propose), the same values."""
        a, b = self.input_layernorm, self.hidden_norm
        if (use_fused(e) and e.dim() == 2 and e.shape == h.shape and e.dtype == h.dtype and e.stride(-1) == 1
                and h.stride(-1) == 1 and a.weight.dtype == b.weight.dtype):
            return _k("norm").rms_norm_pair(e, a.weight, h, b.weight, a.eps, b.eps)
        return torch.cat([a(e), b(h)], dim=-1)


@register_model(EAGLE3_ARCH)
class LlamaEagle3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, options: Eagle3Options) -> None:
        super().__init__()
        if config.num_layers != 1:
            raise ValueError(f"EAGLE-3 heads have one decoder layer, config says {config.num_layers}")
        self.config = config
        self.options = options
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        feature = options.num_aux * options.target_hidden_size
        self.fc_norm = (
            nn.ModuleList(RMSNorm(options.target_hidden_size, config.rms_norm_eps) for _ in range(options.num_aux))
            if options.fc_norm else None
        )
        self.fc = nn.Linear(feature, h, bias=options.fc_bias)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, options.draft_vocab_size or config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        # (draft_vocab,) int64: target id of each lm_head row (arange + d2t); None = rows are target ids.
        self.draft_to_target: torch.Tensor | None = None

    @property
    def feature_size(self) -> int:
        """Width of the target feature: the concatenated aux hidden states."""
        return self.options.num_aux * self.options.target_hidden_size

    def project_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """(T, num_aux * target_H) target aux states -> (T, H). Only target features take this path: the draft's own
        recurrent hidden is already H wide and is fed to forward directly."""
        x = target_features.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            parts = x.split(self.options.target_hidden_size, dim=-1)
            x = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(x)

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (N,)
        backend: AttentionBackend,
        kv_pool: KVPool,
        capture_layers: list[int] | None = None,
        input_features: torch.Tensor | None = None,  # (N, H): projected target feature or own recurrent hidden
    ) -> ModelOutput:
        if input_features is None:
            raise ValueError("an EAGLE-3 draft head needs input_features for every token")
        e = self.embed_tokens(input_ids)  # (N, H)
        cos, sin = self.rotary.cos_sin(positions, e.dtype)
        h = self.layers[0](e, input_features.to(e.dtype), cos, sin, backend, kv_pool)  # (N, H) pre-norm
        # `hidden` is the recurrent feature; compute_logits applies the final norm unless it is already applied.
        return ModelOutput(hidden=self.norm(h) if self.options.norm_output else h)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        x = hidden if self.options.norm_output else self.norm(hidden)
        logits = self.lm_head(x)  # (rows, draft_vocab)
        return logits.float() if upcast else logits

    def tie_weights(self) -> None:
        pass


def build_eagle3(
    raw: dict, draft_path: str, target_path: str, target_config: ModelConfig, engine_config: EngineConfig
) -> tuple[nn.Module, ModelConfig]:
    """Load a published EAGLE-3 checkpoint; embedding (and lm_head, when it has none of its own) from the target."""
    config = draft_model_config(raw, target_config)
    options = Eagle3Options.from_config(raw, target_config)
    model = materialize(lambda: LlamaEagle3ForCausalLM(config, options), config, engine_config)

    def rename(name: str) -> str | None:
        for legacy, new in _LEGACY_NAMES.items():
            if name.startswith(legacy):
                name = new + name.removeprefix(legacy)
        # The embedding is always the target's; t2d (target -> draft membership) is not needed for drafting.
        return None if name in ("embed_tokens.weight", "t2d") else name

    loaded = load_draft_weights(model, draft_path, rename)
    embed, head = load_target_embedding_and_head(target_path, target_config)
    draft_vocab = options.draft_vocab_size
    with torch.no_grad():
        _copy(model.embed_tokens.weight, embed, "target embed_tokens")
        if "lm_head.weight" not in loaded:
            if draft_vocab is not None and draft_vocab != target_config.vocab_size:
                raise ValueError(f"{draft_path}: draft_vocab_size={draft_vocab} but no lm_head.weight")
            if raw.get("tie_word_embeddings", False):
                head = embed
            _copy(model.lm_head.weight, head, "target lm_head")
    d2t = model.extra_tensors.pop("d2t", None)
    unknown = sorted(model.extra_tensors)
    if unknown:
        raise ValueError(f"draft checkpoint tensors {unknown} have no place in {EAGLE3_ARCH}")
    rows = model.lm_head.weight.shape[0]
    if d2t is not None:
        # d2t holds offsets: target_id = draft_id + d2t[draft_id].
        if d2t.shape != (rows,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({rows},)")
        hot = torch.arange(rows, dtype=torch.int64) + d2t.to(torch.int64)
        if int(hot.min()) < 0 or int(hot.max()) >= target_config.vocab_size:
            raise ValueError("d2t maps draft ids outside the target vocabulary")
        model.draft_to_target = hot.to(model.lm_head.weight.device)
    elif rows != target_config.vocab_size:
        raise ValueError(f"{draft_path}: lm_head has {rows} rows (draft vocab) but the checkpoint has no d2t")
    return model.eval(), config
