"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache, with fused qkv and gate_up
projections. Numerics follow HF transformers (fp32 RMSNorm, rotate-half RoPE) so its logits are the test oracle.

Tensor parallelism (given a `runtime.distributed.TPGroup`): qkv_proj and gate_up_proj are column-parallel (each rank
holds its query heads, KV heads and MLP slice), o_proj and down_proj row-parallel followed by an all-reduce,
lm_head vocab-parallel followed by an all-gather of the logits; embeddings and norms are replicated. Without a group
the modules are exactly the single-device ones.

Owns the weights and the math; the attention backend owns the KV layout and masks, the loader owns weight files.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention import AttentionBackend
from runtime.config import ModelConfig
from runtime.distributed import TPGroup, TPShard
from runtime.kv_pool import KVPool
from runtime.models import register_model


def _env_fused_mode() -> bool | None:
    raw = os.environ.get("TANDEM_FUSED_ELEMENTWISE", "auto").strip().lower()
    modes = {"auto": None, "": None, "1": True, "on": True, "0": False, "off": False}
    if raw not in modes:
        raise ValueError(f"TANDEM_FUSED_ELEMENTWISE={raw!r}: expected auto, 1/on or 0/off")
    return modes[raw]


# Fused Triton elementwise kernels (tandem_kernels/norm.py, rope.py, activation.py) for RMSNorm, residual add + RMSNorm,
# RoPE and SiLU-mul. None (auto): on for CUDA tensors inside CUDA-graph capture (and its warm-up), off elsewhere;
# True forces them on (on CPU only under TRITON_INTERPRET=1), False off. Why only in graphs: on the H200 host a Triton
# launch from Python cost ~0.1 ms against ~0.015 ms for a torch op, so the 4 fused launches per layer made eager
# forwards slower (8B eager decode step 22.7 -> 37.2 ms; eager EAGLE draft steps several times slower), while inside
# a graph launches are free and the fused kernels save GPU time. Off on CPU, where the torch path stays the exact
# lossless reference. Never under autograd: the kernels have no backward, and training code reuses these modules.
_FUSED_MODE: bool | None = _env_fused_mode()
_IN_GRAPH_CAPTURE = False
_kernels: dict[str, ModuleType] = {}


def use_fused(x: torch.Tensor) -> bool:
    on = (x.is_cuda and _IN_GRAPH_CAPTURE) if _FUSED_MODE is None else _FUSED_MODE
    return on and not torch.is_grad_enabled()


# The speculative steps' own kernels (tandem_kernels/topk.py, tree.py, chain_glue.py) go with use_fused; set
# TANDEM_STEP_KERNELS=0 to keep those steps on torch's ops alone. On by default: bench/gpu_session.sh fewer_kernels
# (bench/results/session19, H100, demo user path, batch 1): EAGLE3 5/4/16 3237 tok/s on vs 1767 off, STANDALONE 3/1/4
# 2897 vs 2188, identical outputs.
_STEP_KERNELS = os.environ.get("TANDEM_STEP_KERNELS", "1").strip().lower() not in ("0", "off")


def use_step_kernels(x: torch.Tensor) -> bool:
    # Under torch.compile (--enable-torch-compile) the steps keep torch's ops, which inductor fuses itself.
    return _STEP_KERNELS and use_fused(x) and not torch.compiler.is_compiling()


@contextmanager
def graph_capture_mode() -> Iterator[None]:
    """Around a CUDA graph's warm-up and capture (runtime/cuda_graph.py): auto mode uses the fused kernels there."""
    global _IN_GRAPH_CAPTURE
    old, _IN_GRAPH_CAPTURE = _IN_GRAPH_CAPTURE, True
    try:
        yield
    finally:
        _IN_GRAPH_CAPTURE = old


@contextmanager
def fused_elementwise(mode: bool | None) -> Iterator[None]:
    """Set the fused-kernel switch for a block (tests, A/B benchmarks); None = auto."""
    global _FUSED_MODE
    old, _FUSED_MODE = _FUSED_MODE, mode
    try:
        yield
    finally:
        _FUSED_MODE = old


def _k(name: str) -> ModuleType:
    """tandem_kernels.<name>, imported on first use: `import runtime` must work without triton."""
    mod = _kernels.get(name)
    if mod is None:
        import importlib

        mod = _kernels[name] = importlib.import_module(f"tandem_kernels.{name}")
    return mod


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # (N, H): final-norm hidden states
    # (N, len(capture_layers) * H): residual stream at those layers' inputs (the target features of EAGLE-3 drafts)
    features: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() in (2, 3) and x.stride(-1) == 1 and use_fused(x):
            return _k("norm").rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        # fp32 statistics as HF does; in bf16 the mean of squares loses too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding:
    """cos/sin for explicit positions. inv_freq stays a plain fp32 tensor (not a buffer) so meta-device construction
    and dtype casts of the module never touch it.

    On CUDA (outside autograd) the rows come from a table over every position the model serves, computed once per
    (device, dtype) by the same ops: one clamp and one gather per forward instead of six kernels (cos, scale, cast,
    sin, scale, cast), which inside a draft step's CUDA graph run once per tree forward (session 16's profile)."""

    TABLE_MARGIN = 256  # positions past max_position_embeddings a table covers (tree nodes at the context's end)

    def __init__(self, config: ModelConfig) -> None:
        # Models are built under meta-device / low-precision defaults (see loader); inv_freq must be real fp32.
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.device("cpu"):
                self.inv_freq, self.attention_scaling = compute_inv_freq(config)  # (hd/2,)
        finally:
            torch.set_default_dtype(old_dtype)
        self.table_rows = config.max_position_embeddings + self.TABLE_MARGIN
        self._cache: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.is_cuda and not torch.is_grad_enabled():
            return self.table_cos_sin(positions, dtype)
        return self.compute_cos_sin(positions, dtype)

    def compute_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._cache.get(positions.device)
        if inv_freq is None:
            inv_freq = self._cache[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # (N, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, hd)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, hd): broadcast over heads

    def table_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """compute_cos_sin's values (bit for bit: the table is those ops over every position) gathered from the
        table; positions outside it are clamped (a padding row's)."""
        key = (positions.device, dtype)
        table = self._tables.get(key)
        if table is None:
            if positions.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the RoPE table is built on a forward before CUDA graph capture (the warm-up)")
            with torch.inference_mode(False), torch.no_grad():
                every = torch.arange(self.table_rows, device=positions.device)
                cos, sin = self.compute_cos_sin(every, dtype)
                table = self._tables[key] = torch.cat((cos[:, 0], sin[:, 0]), dim=-1)  # (P, 2 * hd)
        rows = table[positions.clamp(0, self.table_rows - 1)]
        half = table.shape[1] // 2
        return rows[:, :half].unsqueeze(1), rows[:, half:].unsqueeze(1)


def compute_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) fp32, attention scaling) for the config's RoPE type."""
    if config.rope_type == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        return 1.0 / (config.rope_theta**exponents), 1.0
    # Scaled variants: reuse transformers' reference formulas rather than re-deriving llama3/yarn/linear here.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={**config.rope_scaling, "rope_theta": config.rope_theta},
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        shard = TPShard.of(config, tp.rank, tp.size) if tp is not None else None
        self.num_heads = shard.num_heads if shard else config.num_heads
        self.num_kv_heads = shard.num_kv_heads if shard else config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # (N, H)
        cos: torch.Tensor,  # (N, 1, hd)
        sin: torch.Tensor,  # (N, 1, hd)
        backend: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # (N, nh, hd)
        k = k.view(n, self.num_kv_heads, self.head_dim)  # (N, kvh, hd)
        v = v.view(n, self.num_kv_heads, self.head_dim)  # (N, kvh, hd)
        if self.q_norm is not None:
            # Qwen3: per-head RMSNorm before RoPE.
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.dtype == q.dtype and use_fused(q):
            _k("rope").rotary(q, k, cos, sin)  # in place on the qkv output (or the q/k norm outputs)
        else:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        out = backend.forward(self.layer_id, q, k, v, kv_pool)  # (N, nh * hd)
        out = self.o_proj(out)  # (N, H); under TP a partial sum over this rank's heads
        return self.tp.all_reduce(out) if self.tp is not None else out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size // (tp.size if tp is not None else 1)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (N, 2I)
        if use_fused(gate_up):
            act = _k("activation").silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)  # (N, I) each
            act = F.silu(gate) * up
        out = self.down_proj(act)  # (N, H); under TP a partial sum over this rank's slice
        return self.tp.all_reduce(out) if self.tp is not None else out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, h, cos, sin, backend, kv_pool) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, backend, kv_pool)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, normed, h, cos, sin, backend, kv_pool) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused-kernel form: takes this layer's normed input and residual stream h, returns (mlp output, h after
        the attention add); the caller adds the mlp output inside the next norm (fused_add_rms_norm)."""
        attn = self.self_attn(normed, cos, sin, backend, kv_pool)
        norm = self.post_attention_layernorm
        normed, h = _k("norm").fused_add_rms_norm(attn, h, norm.weight, norm.eps)
        return self.mlp(normed), h


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.tp_shard = TPShard.of(config, tp.rank, tp.size) if tp is not None else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        lm_rows = self.tp_shard.vocab_per_rank if self.tp_shard else config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, lm_rows, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(config)

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so; call again after `to_empty`, which unties.
        Under TP the lm_head is a vocab-parallel shard of its own (the loader fills it from the embedding)."""
        if self.config.tie_word_embeddings and self.tp is None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (N,)
        backend: AttentionBackend,  # already given this forward's ForwardBatch via init_forward_metadata
        kv_pool: KVPool,
        capture_layers: list[int] | None = None,
    ) -> ModelOutput:
        h = self.embed_tokens(input_ids)  # (N, H)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        captured: list[torch.Tensor] = []
        capture = set(capture_layers or ())
        if use_fused(h):
            hidden = self._layers_fused(h, cos, sin, backend, kv_pool, capture, captured)
        else:
            for i, layer in enumerate(self.layers):
                if i in capture:
                    captured.append(h)
                h = layer(h, cos, sin, backend, kv_pool)
            if len(self.layers) in capture:  # index num_layers = output of the last layer, before the final norm
                captured.append(h)
            hidden = self.norm(h)
        aux = None
        if capture_layers:
            by_layer = dict(zip(sorted(capture), captured))
            aux = torch.cat([by_layer[i] for i in capture_layers], dim=-1)  # (N, len(capture_layers) * H)
        return ModelOutput(hidden=hidden, features=aux)

    def _layers_fused(self, h, cos, sin, backend, kv_pool, capture: set[int], captured: list) -> torch.Tensor:
        """The decoder stack with each residual add fused into the next RMSNorm; appends the residual stream at the
        capture indices to `captured` like the torch loop. Returns the final-norm hidden states."""
        norm_mod = _k("norm")
        delta = None  # the previous sublayer's output, not yet added to h
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
        for i, norm in enumerate(norms):
            if delta is None:
                normed = norm_mod.rms_norm(h, norm.weight, norm.eps)
            else:  # h + delta is written into delta's buffer, so tensors already in `captured` stay as they were
                normed, h = norm_mod.fused_add_rms_norm(delta, h, norm.weight, norm.eps)
            if i in capture:
                captured.append(h)
            if i < len(self.layers):
                delta, h = self.layers[i].forward_fused(normed, h, cos, sin, backend, kv_pool)
        return normed

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """(rows, vocab) logits, float32 unless upcast is False (the model's dtype: for an argmax or the top-k
        kernel, which read any float dtype and give the same answer, one cast kernel fewer per step in a graph)."""
        logits = self.lm_head(hidden)  # (rows, vocab) or, under TP, (rows, vocab_per_rank)
        if self.tp is not None:
            logits = self.tp.all_gather_last_dim(logits)[:, : self.config.vocab_size]  # drop the padded rows
        return logits.float() if upcast else logits

    def tp_slice(self, name: str, part: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's share of a full checkpoint tensor for param `name` (part = q/k/v or gate/up index of a fused
        projection, None otherwise). Only called under TP."""
        shard, hd = self.tp_shard, self.config.head_dim
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            heads = shard.q_rows if part == 0 else shard.kv_rows
            return tensor[heads.start * hd : heads.stop * hd]
        if name.endswith("gate_up_proj.weight"):
            return tensor[shard.mlp_rows]
        if name.endswith("o_proj.weight"):
            return tensor[:, shard.q_rows.start * hd : shard.q_rows.stop * hd]
        if name.endswith("down_proj.weight"):
            return tensor[:, shard.mlp_rows]
        if name == "lm_head.weight":
            rows = tensor[shard.vocab_rows]  # (<= vocab_per_rank, H): the last rank may hold padding
            padded = rows.new_zeros(shard.vocab_per_rank, rows.shape[1])
            padded[: rows.shape[0]] = rows
            return padded
        return tensor  # embeddings, norms: replicated
