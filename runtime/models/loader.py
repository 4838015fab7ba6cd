"""Build a model from a HF checkpoint folder (config.json + safetensors, sharded or not) or with dummy random
weights. Maps HF parameter names onto the fused qkv_proj / gate_up_proj layout of `runtime.models.llama`.

Under tensor parallelism every rank reads the full files and keeps its own slice (`model.tp_slice`); the projections
of q/k/v and gate/up are sliced before they are fused.

Knows file formats and name mapping; knows nothing about KV caches or serving.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from collections.abc import Iterator

import torch
from torch import nn

from runtime.config import EngineConfig, ModelConfig
from runtime.distributed import TPGroup
from runtime.models import get_model_class

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF name suffix -> (our param name, shard index) for projections fused at load time; shard order = concat order.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def resolve_dtype(engine_config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    if engine_config.dtype != "auto":
        return _DTYPES[engine_config.dtype]
    # CPU kernels for bf16/fp16 are slow and less accurate; fp32 is the sane CPU default.
    if torch.device(engine_config.device).type == "cpu":
        return torch.float32
    return _DTYPES.get(model_config.torch_dtype or "", torch.bfloat16)


def load_model(model_path: str | None, model_config: ModelConfig, engine_config: EngineConfig,
               tp: TPGroup | None = None) -> nn.Module:
    """Return the model in eval mode on engine_config.device with resolved dtype; tp: this rank's share of a
    tensor-parallel model (Llama family only). Dummy weights under TP are random per shard, not slices of one model."""
    dtype = resolve_dtype(engine_config, model_config)
    device = torch.device(engine_config.device)
    load_format = engine_config.load_format
    if load_format == "auto":
        load_format = "safetensors" if model_path is not None else "dummy"
    if load_format == "safetensors" and model_path is None:
        raise ValueError("load_format='safetensors' needs a model_path")
    cls = get_model_class(model_config.architecture)
    # Build on the meta device, then materialize directly on the target device: no full-size CPU copy of an 8B model.
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(model_config) if tp is None else cls(model_config, tp=tp)
    model = model.to_empty(device=device)
    model.tie_weights()
    if load_format == "dummy":
        init_dummy_weights(model, engine_config.seed)
    else:
        load_safetensors_weights(model, model_path, model_config)
    return model.eval()


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights: norms at 1 (random norm scales would squash the signal), all else N(0, std)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied params are yielded once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)


@torch.no_grad()
def widen_dummy_margins(model, seed: int, embed_scale: float = 2000.0) -> None:
    """Benchmarks (bench/speculative.py, --synthetic-margin-weights): structured dummy weights (same shapes, same
    compute). The embedding is scaled up so the residual stream keeps the input token's direction through the random
    layers (each adds elements of std ~3 at 8B shapes; the scaled embedding's are ~40), and lm_head row perm[t] = the
    unit embedding of t. The greedy next token is then perm[current token] by a margin of tens of logits, so the bf16
    rounding differences between a wide verify and a decode step (different GEMM shapes) cannot flip it; with plain
    random weights they flip near-tie argmaxes of a 128k vocab every few dozen tokens, and the oracle continuation
    (from decode) stops matching what verify computes."""
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    if head.data_ptr() == embed.data_ptr():
        raise ValueError("margin weights need an untied lm_head")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(embed.shape[0], generator=gen).to(embed.device)
    head[perm] = (embed.float() / embed.float().norm(dim=1, keepdim=True)).to(head.dtype)
    embed.mul_(embed_scale)


def load_safetensors_weights(model: nn.Module, model_path: str, model_config: ModelConfig) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tp_slice = model.tp_slice if getattr(model, "tp", None) is not None else None
    loaded: set[str] = set()
    fused_parts: dict[str, dict[int, torch.Tensor]] = {}
    lm_head_seen = False
    with torch.no_grad():
        for hf_name, tensor in _iter_safetensors(model_path):
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if hf_name == "lm_head.weight":
                lm_head_seen = True
                if model_config.tie_word_embeddings:
                    continue  # some tied checkpoints store a copy; the embedding is the source of truth
            name, shard = _map_name(hf_name)
            if _is_mtp_layer(hf_name, model_config):
                continue  # the MTP layers after the decoder are a draft's (runtime/models/mtp.py)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {model_config.architecture}")
            if tp_slice is not None:
                tensor = tp_slice(name, shard, tensor)
            if shard is None:
                _copy(params[name], tensor, hf_name)
                loaded.add(name)
            else:
                fused_parts.setdefault(name, {})[shard] = tensor
        for name, parts in fused_parts.items():
            num_shards = 3 if "qkv_proj" in name else 2
            if sorted(parts) != list(range(num_shards)):
                raise ValueError(f"checkpoint lacks parts of {name!r}: has shards {sorted(parts)}")
            _copy(params[name], torch.cat([parts[i] for i in range(num_shards)], dim=0), name)
            loaded.add(name)
        if tp_slice is not None and (model_config.tie_word_embeddings or not lm_head_seen):
            # The vocab-parallel lm_head is not the (replicated) embedding parameter: fill it with its slice.
            params["lm_head.weight"].copy_(tp_slice("lm_head.weight", None, params["embed_tokens.weight"]))
            loaded.add("lm_head.weight")
        elif not model_config.tie_word_embeddings and not lm_head_seen:
            # Untied config but no lm_head in the files: HF falls back to the embedding too.
            params["lm_head.weight"].copy_(params["embed_tokens.weight"])
            loaded.add("lm_head.weight")
    if model_config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint at {model_path} lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _is_mtp_layer(hf_name: str, model_config: ModelConfig) -> bool:
    m = _LAYER_RE.match(hf_name)
    return (m is not None and model_config.num_mtp_layers > 0
            and model_config.num_layers <= int(m.group(1)) < model_config.num_layers + model_config.num_mtp_layers)


def _map_name(hf_name: str) -> tuple[str, int | None]:
    """HF name -> (our param name, fused shard index or None)."""
    m = _LAYER_RE.match(hf_name)
    if m:
        layer, module, kind = m.groups()
        if module in _FUSED:
            fused, shard = _FUSED[module]
            return f"layers.{layer}.{fused}.{kind}", shard
        return f"layers.{layer}.{module}.{kind}", None
    if hf_name.startswith("model."):
        return hf_name.removeprefix("model."), None
    return hf_name, None


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
    param.copy_(tensor.to(device=param.device, dtype=param.dtype))


def _iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_path, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        if glob.glob(os.path.join(model_path, "*.bin")) or glob.glob(os.path.join(model_path, "*.pt")):
            raise ValueError(f"{model_path} has only PyTorch .bin/.pt weights; convert them to safetensors")
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
