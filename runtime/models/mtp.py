"""MTP / NextN draft layers that live inside the target's own checkpoint (DeepSeek-V3's layout, used by MiMo, GLM,
Qwen3-Next and others): after the `num_hidden_layers` decoder layers come `num_nextn_predict_layers` MTP layers,
`model.layers.{L + i}.*`, each with

    enorm, hnorm (RMSNorm), eh_proj (Linear 2H -> H, no bias), one decoder layer (input_layernorm, self_attn, mlp,
    post_attention_layernorm), shared_head.norm (RMSNorm); the embedding and lm_head are the target's.

Math of one MTP layer at position t (token x_t, feature f = the target's final-norm hidden state of the token before,
or the layer's own output of the step before): h = eh_proj(cat(enorm(embed(x_t)), hnorm(f))); h = decoder(h);
out = shared_head.norm(h). `out` is both the lm_head input and the recurrent feature of the next draft step, as in
SGLang's NextN models. The draft runs one MTP layer autoregressively `num_steps` times (chain or tree), or, with
multi-layer EAGLE (DeepSeek's chain), layer s at draft step s: layer s at position p takes the embedding of
t_{p+s+1} and layer s-1's output at p (layer 0: the target's feature f_p) and predicts t_{p+s+2}; every layer runs
at the same positions and holds its own KV layer (`active_layer` picks the layer of a forward). Knows nothing about
sequences or trees (draft_service/eagle.py drives it like an EAGLE-2 head).
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.attention import AttentionBackend
from runtime.config import EngineConfig, ModelConfig
from runtime.kv_pool import KVPool
from runtime.models.eagle import _copy, load_draft_weights, load_target_embedding_and_head, materialize
from runtime.models.llama import DecoderLayer, ModelOutput, RMSNorm, RotaryEmbedding


class MTPLayer(DecoderLayer):
    """One MTP layer: its decoder layer (the published names: input_layernorm, self_attn, mlp,
    post_attention_layernorm) plus enorm, hnorm, eh_proj and shared_head.norm."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)  # KV layer `layer_id` of the draft's pool
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, e, feature, cos, sin, backend, kv_pool) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(feature.to(e.dtype))], dim=-1))
        return self.shared_head.norm(super().forward(h, cos, sin, backend, kv_pool))


class MTPHead(nn.Module):
    """K MTP layers with the target's embedding and lm_head. `active_layer` picks the layer a forward runs (one
    layer autoregressively: always 0; multi-layer EAGLE: the draft step's)."""

    def __init__(self, config: ModelConfig, num_layers: int = 1) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.layers = nn.ModuleList(MTPLayer(config, i) for i in range(num_layers))
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.draft_to_target: torch.Tensor | None = None  # draft ids are target ids
        self.active_layer = 0

    @property
    def feature_size(self) -> int:
        """Width of the target feature: the target's final-norm hidden state."""
        return self.config.hidden_size

    def project_features(self, target_features: torch.Tensor) -> torch.Tensor:
        return target_features

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (N,)
        backend: AttentionBackend,
        kv_pool: KVPool,
        capture_layers: list[int] | None = None,
        input_features: torch.Tensor | None = None,  # (N, H): target feature or the previous layer's / step's output
    ) -> ModelOutput:
        """capture_layers given (any list): `features` = the output of every token too, (N, H): the next MTP layer's
        input features (multi-layer EAGLE: ModelRunner returns features for all tokens, hidden only for logits rows)."""
        if input_features is None:
            raise ValueError("an MTP draft layer needs input_features for every token")
        e = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, e.dtype)
        out = self.layers[self.active_layer](e, input_features, cos, sin, backend, kv_pool)  # (N, H)
        return ModelOutput(hidden=out, features=out if capture_layers is not None else None)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    def tie_weights(self) -> None:
        pass


def mtp_config(target_config: ModelConfig, num_layers: int) -> ModelConfig:
    """The draft runner's KV shape: the target's layer shape, `num_layers` KV layers."""
    from dataclasses import replace

    return replace(target_config, architecture="LlamaForCausalLM", num_layers=num_layers, num_mtp_layers=0,
                   tie_word_embeddings=False)


def build_mtp_head(target_path: str, target_config: ModelConfig, engine_config: EngineConfig,
                   num_layers: int = 1) -> tuple[MTPHead, ModelConfig]:
    """The first `num_layers` MTP layers of the target checkpoint (with its embedding and lm_head), on the engine
    device in eval mode, and the ModelConfig of their KV."""
    available = target_config.num_mtp_layers
    if available < 1:
        raise ValueError(f"{target_path} has no MTP layers (config num_nextn_predict_layers is 0 or absent)")
    if not 1 <= num_layers <= available:
        raise ValueError(f"{target_path} has {available} MTP layer(s); {num_layers} asked")
    config = mtp_config(target_config, num_layers)
    model = materialize(lambda: MTPHead(config, num_layers), config, engine_config)
    first = target_config.num_layers

    def rename(name: str) -> str | None:  # "layers.{first + i}.*" of the wanted layers -> "layers.{i}.*"
        prefix, _, rest = name.partition(".")
        index, _, inner = rest.partition(".")
        if prefix != "layers" or not index.isdigit() or not first <= int(index) < first + num_layers:
            return None
        if inner.startswith(("embed_tokens.", "shared_head.head.")):
            return None  # DeepSeek-style per-layer copies of the shared embedding / lm_head: the target's are used
        return f"layers.{int(index) - first}.{inner}"

    load_draft_weights(model, target_path, rename)
    embed, head = load_target_embedding_and_head(target_path, target_config)
    with torch.no_grad():
        _copy(model.embed_tokens.weight, embed, "target embed_tokens")
        _copy(model.lm_head.weight, head, "target lm_head")
    return model.eval(), config
