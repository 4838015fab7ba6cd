"""Tiny random EAGLE / EAGLE-3 heads written exactly as published checkpoints lay them out (safetensors under the
published names, config.json in the published key style), and a plain-torch reference of their formulas that reads
those same published tensors (no runtime code), used as the oracle of the draft forward.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file


def _target_config(target_path: str) -> dict:
    with open(os.path.join(target_path, "config.json")) as f:
        return json.load(f)


def _decoder_tensors(prefix: str, cfg: dict, gen: torch.Generator, std: float, attn_in: int, with_ln: bool) -> dict:
    h, nh, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    inter = cfg["intermediate_size"]

    def rnd(*shape):
        return std * torch.randn(*shape, generator=gen)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    t = {
        f"{prefix}self_attn.q_proj.weight": rnd(nh * hd, attn_in),
        f"{prefix}self_attn.k_proj.weight": rnd(kvh * hd, attn_in),
        f"{prefix}self_attn.v_proj.weight": rnd(kvh * hd, attn_in),
        f"{prefix}self_attn.o_proj.weight": rnd(h, nh * hd),
        f"{prefix}mlp.gate_proj.weight": rnd(inter, h),
        f"{prefix}mlp.up_proj.weight": rnd(inter, h),
        f"{prefix}mlp.down_proj.weight": rnd(h, inter),
        f"{prefix}post_attention_layernorm.weight": norm(h),
    }
    if with_ln:
        t[f"{prefix}input_layernorm.weight"] = norm(h)
    return t


def _head_config(cfg: dict, arch: str, num_layers: int, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    out = {k: cfg[k] for k in keys if k in cfg}
    out.update(architectures=[arch], model_type="llama", num_hidden_layers=num_layers, hidden_act="silu",
               max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")
    out.update(extra)
    return out


def make_eagle_head(target_path: str, out_dir: str, num_layers: int = 1, seed: int = 1, std: float = 0.2,
                    with_embed: bool = True) -> str:
    """EAGLE-2 head (`LlamaForCausalLMEagle`): fc.{weight,bias}, layers.N.*, no input_layernorm in layer 0, no norm,
    no lm_head; published EAGLE releases also carry an embed_tokens.weight copy (ignored: the target's is used)."""
    cfg = _target_config(target_path)
    gen = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    t = {"fc.weight": std * torch.randn(h, 2 * h, generator=gen), "fc.bias": 0.1 * torch.randn(h, generator=gen)}
    for i in range(num_layers):
        t.update(_decoder_tensors(f"layers.{i}.", cfg, gen, std, h, with_ln=i > 0))
    if with_embed:
        t["embed_tokens.weight"] = torch.randn(cfg["vocab_size"], h, generator=gen)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_head_config(cfg, "LlamaForCausalLMEagle", num_layers), f)
    return out_dir


def make_eagle3_head(target_path: str, out_dir: str, draft_vocab_size: int | None = 96, seed: int = 2,
                     std: float = 0.2, aux_layer_ids: list[int] | None = None, fc_norm: bool = False,
                     norm_output: bool = False, with_lm_head: bool = True, legacy_aux_norm: bool = False) -> str:
    """EAGLE-3 head as EAGLE-3 / SpecForge publish it: midlayer.*, fc, norm, lm_head (draft vocab), d2t offsets and
    the t2d membership mask."""
    cfg = _target_config(target_path)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    t = _decoder_tensors("midlayer.", cfg, gen, std, 2 * h, with_ln=True)
    t["midlayer.hidden_norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    t["fc.weight"] = std * torch.randn(h, 3 * h, generator=gen) / math.sqrt(3)
    t["norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    if fc_norm:
        names = ["aux_norm_low", "aux_norm_mid", "aux_norm_high"] if legacy_aux_norm else [f"fc_norm.{i}" for i in
                                                                                          range(3)]
        for name in names:
            t[f"{name}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    rows = draft_vocab_size or vocab
    if with_lm_head:
        t["lm_head.weight"] = std * torch.randn(rows, h, generator=gen)
    if draft_vocab_size is not None:
        hot = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values  # target ids, ascending
        t["d2t"] = hot - torch.arange(draft_vocab_size)  # offsets
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        t["t2d"] = t2d
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out_dir, "model.safetensors"))
    extra = dict(draft_vocab_size=draft_vocab_size, target_hidden_size=h,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True})
    if aux_layer_ids is None:
        extra["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    if fc_norm:
        extra["use_aux_norm" if legacy_aux_norm else "fc_norm"] = True
    if norm_output:
        extra["norm_output"] = True
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_head_config(cfg, "LlamaForCausalLMEagle3", 1, **extra), f)
    return out_dir


# ---- plain-torch reference ------------------------------------------------------------------------------------------
@dataclass
class RefHead:
    """A head's published tensors plus the target's embedding / lm_head; `step` runs the formulas over a whole
    sequence with full causal attention (no KV cache, no paging, no fused projections)."""

    kind: str  # "eagle" | "eagle3"
    w: dict
    cfg: dict
    embed: torch.Tensor
    target_head: torch.Tensor

    @classmethod
    def load(cls, kind: str, head_path: str, target_path: str) -> RefHead:
        w = load_file(os.path.join(head_path, "model.safetensors"))
        tw = load_file(os.path.join(target_path, "model.safetensors"))
        embed = tw["model.embed_tokens.weight"]
        return cls(kind, w, json.load(open(os.path.join(head_path, "config.json"))), embed,
                   tw.get("lm_head.weight", embed))

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3 only: (T, 3H) aux states -> (T, H) through the optional aux norms and fc."""
        x = target_features
        if self.cfg.get("fc_norm") or self.cfg.get("use_aux_norm"):
            names = [n for n in ("fc_norm.0", "fc_norm.1", "fc_norm.2") if f"{n}.weight" in self.w] or \
                ["aux_norm_low", "aux_norm_mid", "aux_norm_high"]
            x = torch.cat([self._rms(p, self.w[f"{n}.weight"]) for p, n in zip(x.chunk(3, -1), names)], -1)
        out = x @ self.w["fc.weight"].T
        return out + self.w["fc.bias"] if "fc.bias" in self.w else out

    def forward(self, tokens: list[int], feats: torch.Tensor, positions: list[int], mask: torch.Tensor):
        """tokens (T,), feats (T, H) (EAGLE: fc input feature; EAGLE-3: already projected / recurrent), mask (T, T)
        bool: row i may see column j. Returns (logits over the head's vocab (T, V'), recurrent hidden (T, H))."""
        e = self.embed[torch.tensor(tokens)]
        pos = torch.tensor(positions)
        if self.kind == "eagle":
            h = torch.cat([e, feats], -1) @ self.w["fc.weight"].T + self.w["fc.bias"]
            for i in range(self.cfg["num_hidden_layers"]):
                p = f"layers.{i}."
                x = h if i == 0 else self._rms(h, self.w[p + "input_layernorm.weight"])
                h = h + self._attn(p, x, pos, mask)
                h = h + self._mlp(p, self._rms(h, self.w[p + "post_attention_layernorm.weight"]))
            return h @ self.target_head.T, h
        p = "midlayer."
        x = torch.cat([self._rms(e, self.w[p + "input_layernorm.weight"]),
                       self._rms(feats, self.w[p + "hidden_norm.weight"])], -1)
        h = feats + self._attn(p, x, pos, mask)
        h = h + self._mlp(p, self._rms(h, self.w[p + "post_attention_layernorm.weight"]))
        normed = self._rms(h, self.w["norm.weight"])
        head = self.w.get("lm_head.weight", self.target_head)
        return normed @ head.T, normed if self.cfg.get("norm_output") else h

    def to_target(self, draft_id: int) -> int:
        if self.kind == "eagle3" and "d2t" in self.w:
            return draft_id + int(self.w["d2t"][draft_id])
        return draft_id

    def _rms(self, x, w):
        eps = self.cfg.get("rms_norm_eps", 1e-6)
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def _mlp(self, p, x):
        gate = x @ self.w[p + "mlp.gate_proj.weight"].T
        up = x @ self.w[p + "mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T

    def _attn(self, p, x, pos, mask):
        nh, kvh = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        hd = self.cfg.get("head_dim") or self.cfg["hidden_size"] // nh
        t = x.shape[0]
        q = (x @ self.w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd)
        k = (x @ self.w[p + "self_attn.k_proj.weight"].T).view(t, kvh, hd)
        v = (x @ self.w[p + "self_attn.v_proj.weight"].T).view(t, kvh, hd)
        inv = 1.0 / (self.cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2).float() / hd))
        ang = pos[:, None].float() * inv
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

        def rot(z):
            return torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1)

        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(nh // kvh, 1), v.repeat_interleave(nh // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * hd)
        return out @ self.w[p + "self_attn.o_proj.weight"].T


def ref_draft_chain(ref: RefHead, committed: list[int], target_feats: torch.Tensor, num_steps: int) -> list[int]:
    """Greedy chain from the reference: positions p < C-1 hold (t_{p+1}, f_p); step s feeds (d_s, own hidden)."""
    feats = ref.project(target_feats) if ref.kind == "eagle3" else target_feats
    tokens = list(committed[1:])
    chain: list[int] = []
    for _ in range(num_steps):
        n = len(tokens)
        logits, hidden = ref.forward(tokens, feats, list(range(n)), torch.ones(n, n).tril().bool())
        d = ref.to_target(int(logits[-1].argmax()))
        chain.append(d)
        tokens.append(d)
        feats = torch.cat([feats, hidden[-1:]])
    return chain
