"""EAGLE-2 draft head (`LlamaForCausalLMEagle`) and the loading machinery every EAGLE-family head shares: the draft
config as a KV-shape `ModelConfig`, the embedding / lm_head borrowed from the target, FR-Spec token maps.

Math: h = fc(cat(embed(tok), feature)); N Llama decoder layers (layer 0 without input_layernorm); no final norm. The
output is both the lm_head input and the recurrent feature of the next draft step. Knows nothing about sequences,
trees or the feature protocol (draft_service/eagle.py owns those).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from core import algorithms
from core.algorithms import DraftModel, TargetFeatures
from runtime.attention import AttentionBackend
from runtime.config import EngineConfig, ModelConfig
from runtime.kv_pool import KVPool
from runtime.models import register_model
from runtime.models.llama import DecoderLayer, ModelOutput, RotaryEmbedding
from runtime.models.loader import _default_dtype, resolve_dtype

EAGLE_ARCH = "LlamaForCausalLMEagle"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
# Published HF projection names -> (our fused param, shard index); shard order = concat order.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


@register_model(EAGLE_ARCH)
class LlamaEagleForCausalLM(nn.Module):
    """EAGLE-2 head. embed and lm_head are the target's (lm_head rows restricted to the FR-Spec hot ids if any)."""

    def __init__(self, config: ModelConfig, lm_head_rows: int | None = None) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-2: the fc output enters layer 0 un-normed
        self.lm_head = nn.Linear(h, lm_head_rows or config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        # (draft_vocab,) int64: target id of each lm_head row; None = rows are target ids already.
        self.draft_to_target: torch.Tensor | None = None

    @property
    def feature_size(self) -> int:
        """Width of the target feature this head consumes: the target's final-norm hidden state."""
        return self.config.hidden_size

    def project_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features -> the (T, H) `input_features` of forward. EAGLE-2 feeds them as they are."""
        return target_features

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
            raise ValueError("an EAGLE draft head needs input_features for every token")
        e = self.embed_tokens(input_ids)  # (N, H)
        h = self.fc(torch.cat([e, input_features.to(e.dtype)], dim=-1))  # (N, H)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, backend, kv_pool)
        return ModelOutput(hidden=h)  # no final norm: logits input and recurrent feature at once

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)  # (rows, draft_vocab)
        return logits.float() if upcast else logits

    def tie_weights(self) -> None:
        pass


# The head layout of each kind of target features an EAGLE-family algorithm feeds its head.
_HEAD_ARCHS = {TargetFeatures.FINAL_HIDDEN: EAGLE_ARCH, TargetFeatures.AUX_LAYERS: EAGLE3_ARCH}


def load_draft_head(
    draft_path: str,
    target_path: str,
    engine_config: EngineConfig,
    algorithm: str,
    token_map: str | Sequence[int] | torch.Tensor | None = None,
    num_mtp_layers: int = 1,
) -> tuple[nn.Module, ModelConfig]:
    """Load an EAGLE / NEXTN or EAGLE3 head from its published checkpoint, with the target's shared tensors; for
    EAGLE / NEXTN, a checkpoint with MTP layers (num_nextn_predict_layers: the target itself) gives its first
    `num_mtp_layers` MTP layers instead (runtime/models/mtp.py): one run autoregressively, or a multi-layer chain.

    Returns (model in eval mode on the engine device, ModelConfig describing its KV shape for a ModelRunner)."""
    algorithm = algorithm.upper()
    raw = read_config(draft_path)
    arch = (raw.get("architectures") or [""])[0]
    entry = algorithms.find(algorithm)
    wanted = _HEAD_ARCHS.get(entry.target_features) if entry and entry.draft_model is DraftModel.HEAD else None
    if wanted is None:
        raise ValueError(f"load_draft_head: algorithm must be EAGLE, NEXTN or EAGLE3, got {algorithm!r}")
    # Original EAGLE-2 releases say plain "LlamaForCausalLM"; the algorithm names the head then (as SGLang does).
    if arch in (EAGLE_ARCH, EAGLE3_ARCH) and arch != wanted:
        raise ValueError(f"{draft_path} is a {arch} checkpoint, which does not fit --speculative-algorithm {algorithm}")
    target_config = ModelConfig.from_pretrained(target_path)
    if wanted == EAGLE_ARCH and int(raw.get("num_nextn_predict_layers") or 0) > 0:
        if token_map is not None:
            raise ValueError("--speculative-token-map is for EAGLE-2 heads; MTP layers use the target's whole vocab")
        from runtime.models.mtp import build_mtp_head

        return build_mtp_head(draft_path, ModelConfig.from_pretrained(draft_path), engine_config,
                              num_layers=num_mtp_layers)
    if num_mtp_layers != 1:
        raise ValueError(f"{draft_path} has no MTP layers (num_nextn_predict_layers): multi-layer EAGLE needs them")
    if wanted == EAGLE3_ARCH:
        if token_map is not None:
            raise ValueError("--speculative-token-map is for EAGLE; an EAGLE-3 head carries its own d2t map")
        from runtime.models.eagle3 import build_eagle3

        return build_eagle3(raw, draft_path, target_path, target_config, engine_config)
    return _build_eagle2(raw, draft_path, target_path, target_config, engine_config, token_map)


def _build_eagle2(
    raw: dict,
    draft_path: str,
    target_path: str,
    target_config: ModelConfig,
    engine_config: EngineConfig,
    token_map: str | Sequence[int] | torch.Tensor | None,
) -> tuple[nn.Module, ModelConfig]:
    config = draft_model_config(raw, target_config)
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(f"EAGLE head hidden_size {config.hidden_size} != target's {target_config.hidden_size}")
    hot_ids = load_token_map(token_map, target_config.vocab_size)
    model = materialize(
        lambda: LlamaEagleForCausalLM(config, None if hot_ids is None else len(hot_ids)), config, engine_config
    )
    embed, head = load_target_embedding_and_head(target_path, target_config)
    skip = {"embed_tokens.weight", "layers.0.input_layernorm.weight"}  # embed is the target's; layer 0 has no norm
    load_draft_weights(model, draft_path, lambda name: None if name in skip or name.startswith("lm_head.") else name)
    with torch.no_grad():
        _copy(model.embed_tokens.weight, embed, "target embed_tokens")
        _copy(model.lm_head.weight, head if hot_ids is None else head[hot_ids], "target lm_head")
    if hot_ids is not None:
        model.draft_to_target = hot_ids.to(model.lm_head.weight.device)
    return model.eval(), config


# ---- shared loading helpers (also used by eagle3) ------------------------------------------------------------------
def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def draft_model_config(raw: dict, target_config: ModelConfig) -> ModelConfig:
    """The draft's decoder shape as a ModelConfig (the KV pool and the llama layers read it). Input ids are target
    ids, and the context length is the target's (a draft config's own is often stale)."""
    from dataclasses import replace

    from transformers import LlamaConfig

    known = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type")}
    hf = LlamaConfig(**known)
    hf.architectures = ["LlamaForCausalLM"]  # the draft's decoder layers are Llama layers
    config = ModelConfig.from_hf_config(hf, eos_token_ids=list(target_config.eos_token_ids))
    return replace(
        config,
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        tie_word_embeddings=False,
    )


def load_token_map(
    token_map: str | Sequence[int] | torch.Tensor | None, target_vocab_size: int
) -> torch.Tensor | None:
    """FR-Spec hot vocabulary: a torch.load-able list/tensor of target ids (or the ids themselves) -> int64 (n,)."""
    if token_map is None:
        return None
    if isinstance(token_map, (str, os.PathLike)):
        if not os.path.isfile(token_map):
            raise FileNotFoundError(f"speculative token map {token_map!r} not found (download it first)")
        token_map = torch.load(token_map, map_location="cpu", weights_only=True)
    ids = torch.as_tensor(token_map, dtype=torch.int64).flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size:
        raise ValueError(f"token map ids must be non-empty and in [0, {target_vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError("token map has duplicate target ids")
    return ids


def load_target_embedding_and_head(target_path: str, target_config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed (V, H), lm_head (V, H)) read straight from the target's safetensors, without building the target."""
    wanted = {"model.embed_tokens.weight": "embed", "embed_tokens.weight": "embed", "lm_head.weight": "head"}
    found: dict[str, torch.Tensor] = {}
    for name, get in _safetensors_entries(target_path):
        if name in wanted and wanted[name] not in found:
            found[wanted[name]] = get()
    if "embed" not in found:
        raise ValueError(f"target checkpoint {target_path} has no embed_tokens.weight")
    # Tied target, or an untied config without lm_head in its files: the embedding is the head (as HF falls back).
    head = found["embed"] if target_config.tie_word_embeddings or "head" not in found else found["head"]
    return found["embed"], head


def materialize(build: Callable[[], nn.Module], config: ModelConfig, engine_config: EngineConfig) -> nn.Module:
    """Build on the meta device, then allocate (uninitialized) on the engine device in the resolved dtype."""
    dtype = resolve_dtype(engine_config, config)
    with _default_dtype(dtype), torch.device("meta"):
        model = build()
    return model.to_empty(device=torch.device(engine_config.device))


def load_draft_weights(model: nn.Module, draft_path: str, rename: Callable[[str], str | None]) -> set[str]:
    """Copy the draft checkpoint into `model`: `rename` maps a published name (without any `model.` prefix) to ours,
    None = skip; q/k/v and gate/up are fused. Every parameter except embed_tokens / lm_head (the caller fills those
    from the target when the checkpoint has none) must be in the checkpoint. Top-level plain tensors that are not
    parameters (d2t, t2d) are left in `model.extra_tensors`. Returns the names of the loaded parameters."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    fused: dict[str, dict[int, torch.Tensor]] = {}
    extra: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for hf_name, get in _safetensors_entries(draft_path):
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            name = rename(hf_name.removeprefix("model."))
            if name is None:
                continue
            stem, _, kind = name.rpartition(".")
            layer_prefix, _, module = stem.partition(".")  # "layers" / "0.self_attn.q_proj"
            layer_id, _, sub = module.partition(".")
            if layer_prefix == "layers" and sub in _FUSED:
                target, shard = _FUSED[sub]
                fused.setdefault(f"layers.{layer_id}.{target}.{kind}", {})[shard] = get()
            elif name in params:
                _copy(params[name], get(), hf_name)
                loaded.add(name)
            elif "." not in name:
                extra[name] = get()  # plain tensors such as d2t / t2d
            else:
                raise ValueError(f"draft checkpoint tensor {hf_name!r} has no place in {type(model).__name__}")
        for name, parts in fused.items():
            num_shards = 3 if "qkv_proj" in name else 2
            if sorted(parts) != list(range(num_shards)) or name not in params:
                raise ValueError(f"draft checkpoint lacks parts of {name!r} (has shards {sorted(parts)})")
            _copy(params[name], torch.cat([parts[i] for i in range(num_shards)], dim=0), name)
            loaded.add(name)
    model.extra_tensors = extra
    shared = {"embed_tokens.weight", "lm_head.weight"}
    missing = sorted(set(params) - loaded - shared)
    if missing:
        raise ValueError(f"draft checkpoint at {draft_path} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    return loaded


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
    param.copy_(tensor.to(device=param.device, dtype=param.dtype))


def _safetensors_entries(path: str) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, lazy getter) over every tensor of a checkpoint folder (sharded or not); tensors load only when asked."""
    from safetensors import safe_open

    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, (lambda h=handle, n=name: h.get_tensor(n))
