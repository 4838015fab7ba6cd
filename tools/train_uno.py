"""Train UNO's draft LoRA (sglang_spec.md §7.4) for any Llama-family HF target, online from the frozen target: the
adapter makes the target, fed [seed, noise x (F-1)] after a clean prefix, predict with row i the token i + 1 places
after the clean root, i.e. t+1+i for a seed at position t (row 0, the clean root, is the target's own next token and
needs no training). Writes PEFT's layout (adapter_config.json + adapter_model.safetensors) that runtime/lora.py loads.

Every step: random windows of the token stream run through the frozen target once without gradients (its K/V per
layer and its next-token distributions, the teacher); then M anchors per window each get a block of F - 1 uniform-
random noise tokens at positions t+1..t+F-1 that attends to the window's clean prefix up to t and causally to its own
block (exactly the draft pass of serving), with the LoRA on. Loss: cross-entropy of row i against the teacher's
distribution of token t+1+i given the true prefix (soft self-distillation), weighted decay**(i-1).

    python -m tools.train_draft --kind uno --target-model-path T --corpus src/ --output-dir L --minutes 10
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class UnoTrainConfig:
    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = MODULES
    width: int = 8  # F: the draft forward width trained (serving may use any F <= this)
    anchors: int = 16  # M: noise blocks per window
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 2e-3
    decay: float = 0.9  # loss weight of row i: decay ** (i - 1)
    steps: int = 10**9
    time_budget_s: float | None = None
    log_every: int = 20
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.width < 2:
            raise ValueError("UNO needs a draft width F >= 2 to have draft rows to train")
        if self.seq_len < self.width + 1:
            raise ValueError("seq_len must exceed the draft width F")
        if self.rank < 1 or self.anchors < 1 or self.batch_size < 1:
            raise ValueError("rank, anchors and batch_size must be >= 1")


class LoRAWeights(nn.Module):
    """A (r, in) and B (out, r) per (layer, module); B starts at zero so the adapter starts as the base model."""

    def __init__(self, target, cfg: UnoTrainConfig) -> None:
        super().__init__()
        self.scaling = cfg.alpha / cfg.rank
        self.a, self.b = nn.ParameterDict(), nn.ParameterDict()
        for i, layer in enumerate(target.model.layers):
            for name in cfg.target_modules:
                base = _module(layer, name)
                a = torch.empty(cfg.rank, base.in_features)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's init of lora_A
                self.a[f"{i}_{name}"] = nn.Parameter(a)
                self.b[f"{i}_{name}"] = nn.Parameter(torch.zeros(base.out_features, cfg.rank))

    def project(self, layer_id: int, layer, name: str, x: torch.Tensor, lora: bool) -> torch.Tensor:
        y = _module(layer, name)(x)
        key = f"{layer_id}_{name}"
        if lora and key in self.a:
            y = y + (x @ self.a[key].T) @ self.b[key].T * self.scaling
        return y

    def export(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for key in self.a:
            layer, _, name = key.partition("_")
            out[(int(layer), name)] = (self.a[key].detach(), self.b[key].detach())
        return out


def _module(layer, name: str) -> nn.Linear:
    return getattr(layer.mlp if name in ("gate_proj", "up_proj", "down_proj") else layer.self_attn, name)


def _layer(target, lora: LoRAWeights, i: int, h: torch.Tensor, cos, sin, mask: torch.Tensor,
           past: tuple[torch.Tensor, torch.Tensor] | None, use_lora: bool):
    """One decoder layer over h (B, T, H). past: the clean prefix's (k, v), each (B, kvh, L, hd), prepended to the
    keys. Returns (h, (k, v) of these T tokens)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer = target.model.layers[i]
    attn = layer.self_attn
    cfg = target.config
    b, t, _ = h.shape
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    x = layer.input_layernorm(h)
    q = lora.project(i, layer, "q_proj", x, use_lora).view(b, t, -1, hd)
    k = lora.project(i, layer, "k_proj", x, use_lora).view(b, t, -1, hd)
    v = lora.project(i, layer, "v_proj", x, use_lora).view(b, t, -1, hd)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    new = (k, v)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (B, nh, T, hd)
    out = out.transpose(1, 2).reshape(b, t, -1)
    h = h + lora.project(i, layer, "o_proj", out, use_lora)
    x = layer.post_attention_layernorm(h)
    act = F.silu(lora.project(i, layer, "gate_proj", x, use_lora)) * lora.project(i, layer, "up_proj", x, use_lora)
    return h + lora.project(i, layer, "down_proj", act, use_lora), new


def clean_pass(target, lora: LoRAWeights, ids: torch.Tensor):
    """The frozen target over windows (B, L): per-layer (k, v) and the logits (B, L, V)."""
    b, n = ids.shape
    pos = torch.arange(n, device=ids.device).expand(b, n)
    h = target.model.embed_tokens(ids)
    cos, sin = target.model.rotary_emb(h, pos)
    mask = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    kvs = []
    for i in range(len(target.model.layers)):
        h, kv = _layer(target, lora, i, h, cos, sin, mask, None, False)
        kvs.append(kv)
    return kvs, target.lm_head(target.model.norm(h))


def draft_pass(target, lora: LoRAWeights, kvs, anchors: torch.Tensor, noise: torch.Tensor, seq_len: int):
    """Noise blocks (B, M, F-1) after anchors (B, M): block m's row i sits at position t_m + i, sees the prefix
    [0, t_m] and its own rows <= i. Returns logits (B, M, F-1, V)."""
    b, m, w = noise.shape
    dev = noise.device
    rows = torch.arange(1, w + 1, device=dev)
    pos = (anchors.unsqueeze(-1) + rows).reshape(b, m * w)  # (B, N)
    h = target.model.embed_tokens(noise.reshape(b, m * w))
    cos, sin = target.model.rotary_emb(h, pos)
    prefix = torch.arange(seq_len, device=dev)
    sees_prefix = prefix.view(1, 1, 1, -1) <= anchors.view(b, m, 1, 1)  # (B, M, 1, L)
    sees_prefix = sees_prefix.expand(b, m, w, seq_len).reshape(b, m * w, seq_len)
    block = torch.arange(m * w, device=dev)
    same = (block.view(-1, 1) // w == block.view(1, -1) // w) & (block.view(1, -1) <= block.view(-1, 1))
    mask = torch.cat([sees_prefix, same.expand(b, -1, -1)], dim=-1).unsqueeze(1)  # (B, 1, N, L + N)
    for i in range(len(target.model.layers)):
        h, _ = _layer(target, lora, i, h, cos, sin, mask, kvs[i], True)
    return target.lm_head(target.model.norm(h)).view(b, m, w, -1)


def train_uno_online(target, stream: torch.Tensor, cfg: UnoTrainConfig, log=print) -> tuple[LoRAWeights, dict]:
    """Train a LoRA on a frozen HF target over random windows of `stream` (1-D token ids)."""
    dev = torch.device(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    target.eval().requires_grad_(False)
    lora = LoRAWeights(target, cfg).to(dev)
    opt = torch.optim.AdamW(lora.parameters(), lr=cfg.lr, weight_decay=0.0)
    w = cfg.width - 1
    weights = torch.tensor([cfg.decay ** i for i in range(w)], device=dev)
    vocab = target.config.vocab_size
    start, step, curve = time.time(), 0, []
    ema_loss, ema_acc = None, None
    while step < cfg.steps:
        elapsed = time.time() - start
        if cfg.time_budget_s is not None and elapsed >= cfg.time_budget_s:
            break
        frac = elapsed / cfg.time_budget_s if cfg.time_budget_s else step / cfg.steps
        for group in opt.param_groups:  # warm-up then cosine to 10% over the budget
            group["lr"] = cfg.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1))))
        starts = torch.randint(0, stream.numel() - cfg.seq_len, (cfg.batch_size,), generator=gen)
        ids = torch.stack([stream[s:s + cfg.seq_len] for s in starts.tolist()]).long().to(dev)  # (B, L)
        with torch.no_grad():
            kvs, logits = clean_pass(target, lora, ids)
        anchors = torch.randint(0, cfg.seq_len - w, (cfg.batch_size, cfg.anchors), generator=gen).to(dev)  # (B, M)
        noise = torch.randint(0, vocab, (cfg.batch_size, cfg.anchors, w), generator=gen).to(dev)
        # Row i (1-based) of block m predicts token t_m + 1 + i: the teacher row at position t_m + i.
        teach_pos = anchors.unsqueeze(-1) + torch.arange(1, w + 1, device=dev)  # (B, M, F-1)
        teacher = torch.softmax(logits.gather(1, teach_pos.reshape(cfg.batch_size, -1, 1).expand(-1, -1, vocab)),
                                dim=-1).view(cfg.batch_size, cfg.anchors, w, vocab)
        student = torch.log_softmax(draft_pass(target, lora, kvs, anchors, noise, cfg.seq_len).float(), dim=-1)
        per_row = -(teacher * student).sum(-1).mean(dim=(0, 1))  # (F-1,)
        loss = (per_row * weights).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lora.parameters(), 1.0)
        opt.step()
        step += 1
        acc = (student.argmax(-1) == teacher.argmax(-1)).float().mean(dim=(0, 1))  # (F-1,) top-1 agreement
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        if cfg.log_every and step % cfg.log_every == 0:
            curve.append({"step": step, "loss": round(ema_loss, 4), "row_acc": [round(a, 3) for a in ema_acc.tolist()],
                          "elapsed_s": round(time.time() - start, 1)})
            log(f"uno step {step}: loss {ema_loss:.3f} row top-1 agreement "
                + " ".join(f"{a:.2f}" for a in ema_acc.tolist()) + f" ({time.time() - start:.0f}s)")
    info = {"steps": step, "wall_time_s": round(time.time() - start, 1), "final_loss_ema": ema_loss,
            "final_row_agreement_ema": None if ema_acc is None else [round(a, 4) for a in ema_acc.tolist()],
            "loss_curve": curve, "config": {**asdict(cfg), "target_modules": list(cfg.target_modules)}}
    return lora, info
