"""Train an EAGLE-3 head for any Llama-family target from token sequences (or a text corpus), with the training-time
test (TTT): each position is unrolled a few draft steps, where step j feeds the head's own hidden of step j-1 and
attends to the committed prefix plus its own earlier steps, exactly as tree drafting does at serve time.

Labels are the target's own greedy predictions (hard self-distillation). Writes the published checkpoint format
(config.json + model.safetensors with midlayer.*, fc, norm, lm_head, d2t offsets, t2d) that runtime/models/eagle3.py
loads. Plain torch on any device; knows nothing about serving.

Two ways to get the target's features: `train_eagle3` runs the serving engine over fixed token sequences once
(features bit-for-bit what serving captures; small corpora, CPU), `train_eagle3_online` runs an HF target over fresh
random windows of a token stream every step (large corpora, GPU, bf16 autocast; hidden_states[i] is the input of
layer i, which is what the engine captures for i < num_layers).

    python -m tools.train_eagle3 --target-model-path T --corpus corpus.txt --output-dir out [--steps 2000]

The EAGLE-2 head (`LlamaForCausalLMEagle`, runtime/models/eagle.py) shares this machinery: `train_eagle_online` takes
the target's final-norm hidden states as features and unrolls the head's own output as the next feature
(`python -m tools.train_draft --kind eagle ...`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 3e-3
    batch_size: int = 8
    seq_len: int = 128  # corpus chunk length (tokens)
    ttt_steps: int = 3  # unrolled draft steps per position
    ttt_decay: float = 0.8  # loss weight of step j: decay ** j
    # MTP only: layers trained jointly as DeepSeek's chain (step j = layer j, which predicts t_{p+j+2}); > 1 sets the
    # unroll to this many steps (ttt_steps is then ignored)
    num_mtp_layers: int = 1
    feature_loss_weight: float = 1.0  # EAGLE-2 only: weight of the smooth-L1 regression of the target's feature
    draft_vocab_size: int | None = None  # None = the whole target vocabulary; else the most frequent labels
    aux_layer_ids: list[int] | None = None  # None = SGLang's default capture [2, L//2, L-3]
    intermediate_size: int | None = None  # the head's FFN width; None = the target's
    time_budget_s: float | None = None  # also stop after this much wall time (the LR decay follows it)
    bf16_autocast: bool = False  # bf16 autocast of the target and head forwards (GPU)
    log_every: int = 0  # progress line every this many steps (0 = silent)
    save_dtype: str = "float32"  # dtype of the saved weights (float32 or bfloat16)
    progress_bar: bool = False  # with log_every: a progress bar (stderr) instead of log lines
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "ttt_steps", "num_mtp_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.seq_len < self.ttt_steps + 2:
            raise ValueError("seq_len must exceed ttt_steps + 1")


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Namespace(nn.Module):
    """A plain container so that state_dict names come out as the published ones (midlayer.self_attn.q_proj...)."""


class Eagle3TrainHead(nn.Module):
    """The EAGLE-3 head as a batched full-sequence module with published parameter names (training only)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 draft_vocab: int, eps: float, rope_theta: float) -> None:
        super().__init__()
        self.nh, self.kvh, self.hd, self.rope_theta = num_heads, num_kv_heads, head_dim, rope_theta
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        mid = self.midlayer = _Namespace()
        mid.input_layernorm, mid.hidden_norm = _RMSNorm(hidden, eps), _RMSNorm(hidden, eps)
        mid.post_attention_layernorm = _RMSNorm(hidden, eps)
        attn = mid.self_attn = _Namespace()
        attn.q_proj = nn.Linear(2 * hidden, num_heads * head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * hidden, num_kv_heads * head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * hidden, num_kv_heads * head_dim, bias=False)
        attn.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        mlp = mid.mlp = _Namespace()
        mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
        mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.norm = _RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)

    def unrolled_logits(self, embeds: torch.Tensor, aux: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """embeds (B, T+num_steps, H): embeddings of t_1.. (shifted by one); aux (B, T, 3H_t): target aux at 0..T-1.
        Returns per step j (B, T, draft_vocab): the head's logits at base position p after j own steps."""
        t = aux.shape[1]
        mid, attn = self.midlayer, self.midlayer.self_attn
        h = self.fc(aux)  # (B, T, H)
        keys, values, out = [], [], []
        for j in range(num_steps):
            x = torch.cat([mid.input_layernorm(embeds[:, j:j + t]), mid.hidden_norm(h)], dim=-1)  # (B, T, 2H)
            h = h + _ttt_attention(attn, x, j, keys, values, self.nh, self.kvh, self.hd, self.rope_theta)
            y = mid.post_attention_layernorm(h)
            h = h + mid.mlp.down_proj(F.silu(mid.mlp.gate_proj(y)) * mid.mlp.up_proj(y))
            out.append(self.lm_head(self.norm(h)))
        return out


class EagleTrainHead(nn.Module):
    """The EAGLE-2 head (`LlamaForCausalLMEagle`) as a batched full-sequence module with published parameter names:
    fc.{weight,bias} over cat(embed(t_{p+1}), f_p), then Llama decoder layers, layer 0 without input_layernorm, no
    final norm. The output is the next step's feature and the input of the TARGET's lm_head, which is held here as a
    frozen, non-persistent buffer (rows of the training softmax vocabulary) and never saved (training only)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 rope_theta: float, lm_head: torch.Tensor, num_layers: int = 1) -> None:
        super().__init__()
        self.nh, self.kvh, self.hd, self.rope_theta = num_heads, num_kv_heads, head_dim, rope_theta
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            layer = _Namespace()
            if i > 0:  # EAGLE-2: the fc output enters layer 0 un-normed
                layer.input_layernorm = _RMSNorm(hidden, eps)
            attn = layer.self_attn = _Namespace()
            attn.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
            attn.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
            attn.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
            attn.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
            layer.post_attention_layernorm = _RMSNorm(hidden, eps)
            mlp = layer.mlp = _Namespace()
            mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
            mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
            mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
            self.layers.append(layer)
        self.register_buffer("lm_head_weight", lm_head.detach().clone(), persistent=False)

    def unrolled_hidden(self, embeds: torch.Tensor, feats: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """embeds (B, T+num_steps, H): embeddings of t_1.. (shifted by one); feats (B, T, H): the target's final-norm
        hidden states at 0..T-1. Returns per step j (B, T, H): the head's output at base position p after j own steps
        (step j >= 1 is fed the head's own output of step j-1 as its feature, as at serve time)."""
        t = feats.shape[1]
        f, out = feats, []
        kv = [([], []) for _ in self.layers]
        for j in range(num_steps):
            h = self.fc(torch.cat([embeds[:, j:j + t], f], dim=-1))  # (B, T, H)
            for layer, (keys, values) in zip(self.layers, kv):
                x = layer.input_layernorm(h) if hasattr(layer, "input_layernorm") else h
                h = h + _ttt_attention(layer.self_attn, x, j, keys, values, self.nh, self.kvh, self.hd,
                                       self.rope_theta)
                y = layer.post_attention_layernorm(h)
                h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y))
            out.append(h)
            f = h
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)


class MTPTrainHead(EagleTrainHead):
    """K MTP / NextN layers (runtime/models/mtp.py) as a batched full-sequence module; layer k: h = eh_proj(cat(enorm(
    embed(x)), hnorm(f))), one Llama decoder layer (with its input_layernorm), out = shared_head.norm(h); `out` feeds
    the target's lm_head and is the next step's feature. One layer: the EAGLE-2 head's TTT unroll and loss (the layer
    fed its own output, as NEXTN serves it autoregressively). K layers: DeepSeek's chain, as multi-layer EAGLE serves
    it: step k is layer k at the same base positions p, fed t_{p+k+1} and layer k-1's output at p (layer 0: the
    target's final-norm hidden state f_p), causal over its own sequence; it predicts t_{p+k+2} (the same loss
    indexing). Saved into the target's checkpoint in DeepSeek-V3's layout by `save_mtp` (training only)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 rope_theta: float, lm_head: torch.Tensor, num_layers: int = 1) -> None:
        super().__init__(hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, rope_theta, lm_head,
                         num_layers)
        del self.fc
        for layer in self.layers:
            layer.input_layernorm = _RMSNorm(hidden, eps)
            layer.enorm, layer.hnorm = _RMSNorm(hidden, eps), _RMSNorm(hidden, eps)
            layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            layer.shared_head_norm = _RMSNorm(hidden, eps)

    def unrolled_hidden(self, embeds: torch.Tensor, feats: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """As EagleTrainHead's; with K > 1 layers num_steps <= K and step j runs layer j (its own fresh KV)."""
        t = feats.shape[1]
        chain = len(self.layers) > 1
        if chain and num_steps > len(self.layers):
            raise ValueError(f"{num_steps} chain steps for {len(self.layers)} MTP layers")
        f, out, keys, values = feats, [], [], []
        for j in range(num_steps):
            layer = self.layers[j if chain else 0]
            if chain:  # layer j sits at the base positions and attends to its own causal prefix only
                keys, values = [], []
            h = layer.eh_proj(torch.cat([layer.enorm(embeds[:, j:j + t]), layer.hnorm(f)], dim=-1))  # (B, T, H)
            h = h + _ttt_attention(layer.self_attn, layer.input_layernorm(h), 0 if chain else j, keys, values,
                                   self.nh, self.kvh, self.hd, self.rope_theta)
            y = layer.post_attention_layernorm(h)
            h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y))
            f = layer.shared_head_norm(h)
            out.append(f)
        return out


def _ttt_attention(attn: nn.Module, x: torch.Tensor, j: int, keys: list, values: list, nh: int, kvh: int, hd: int,
                   rope_theta: float) -> torch.Tensor:
    """Attention of unroll step j (x: (B, T, in) at base positions p, sitting at position p + j) for both head kinds:
    step 0's keys are the committed prefix (causal); steps 1..j add one key each on the diagonal, so the query of base
    p sees its own earlier draft steps only, as tree drafting does. Appends this step's k/v to keys/values; returns
    o_proj(context) (B, T, H)."""
    b, t, _ = x.shape
    pos = torch.arange(t, device=x.device) + j
    q = _rope(attn.q_proj(x).view(b, t, nh, hd), pos, rope_theta)
    k = _rope(attn.k_proj(x).view(b, t, kvh, hd), pos, rope_theta)
    v = attn.v_proj(x).view(b, t, kvh, hd)
    keys.append(k.repeat_interleave(nh // kvh, 2))
    values.append(v.repeat_interleave(nh // kvh, 2))
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    scores = [torch.einsum("bqhd,bkhd->bhqk", q, keys[0]).masked_fill(~causal, -math.inf)]
    scores += [torch.einsum("bqhd,bqhd->bhq", q, k_i).unsqueeze(-1) for k_i in keys[1:]]
    probs = torch.cat(scores, dim=-1).div(math.sqrt(hd)).softmax(-1)  # (B, nh, T, T + j)
    ctx = torch.einsum("bhqk,bkhd->bqhd", probs[..., :t], values[0])
    for i, v_i in enumerate(values[1:]):
        ctx = ctx + probs[..., t + i].permute(0, 2, 1).unsqueeze(-1) * v_i
    return attn.o_proj(ctx.reshape(b, t, -1))


def _rope(x: torch.Tensor, pos: torch.Tensor, rope_theta: float) -> torch.Tensor:
    hd = x.shape[-1]
    inv = 1.0 / (rope_theta ** (torch.arange(0, hd, 2, device=x.device).float() / hd))
    ang = pos[:, None].float() * inv
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[None, :, None], emb.sin()[None, :, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


@dataclass
class _Example:
    tokens: torch.Tensor  # (T,)
    aux: torch.Tensor  # (T, 3H_t)
    labels: torch.Tensor  # (T,): target argmax at each position (its prediction of the next token)


def collect_examples(target_path: str, sequences: list[list[int]], capture: list[int], device: str) -> list[_Example]:
    """Run the target (the serving engine, so features are bit-for-bit what serving captures) over each sequence."""
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner, SeqForward

    max_len = max(len(s) for s in sequences)
    runner = ModelRunner(target_path, EngineConfig(device=device, dtype="float32", max_total_tokens=4 * max_len))
    examples = []
    for i, seq in enumerate(sequences):
        runner.add_seq(str(i))
        out = runner.forward([SeqForward(str(i), list(seq), logits="all")], capture_layers=capture)
        runner.free_seq(str(i))
        # Outside inference mode, so autograd may save them.
        examples.append(_Example(torch.tensor(seq), out.features[0].clone(), out.logits[0].argmax(-1).clone()))
    return examples


def train_eagle3(target_path: str, sequences: list[list[int]], output_dir: str, config: TrainConfig) -> dict:
    """Train on token sequences (each >= ttt_steps + 2 long) and write the published checkpoint; returns stats."""
    from runtime.config import ModelConfig
    from runtime.models.eagle import load_target_embedding_and_head
    from runtime.models.eagle3 import eagle3_capture_layers

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    tcfg = ModelConfig.from_pretrained(target_path)
    capture = eagle3_capture_layers(tcfg.num_layers, config.aux_layer_ids)
    sequences = [s for s in sequences if len(s) >= config.ttt_steps + 2]
    if not sequences:
        raise ValueError(f"no training sequence has the {config.ttt_steps + 2} tokens the unroll needs")
    examples = collect_examples(target_path, sequences, capture, config.device)
    embed, head = (t.to(config.device, torch.float32) for t in load_target_embedding_and_head(target_path, tcfg))

    # Draft vocabulary: the most frequent labels; d2t holds offsets to target ids.
    counts = torch.bincount(torch.cat([e.labels for e in examples]), minlength=tcfg.vocab_size)
    hot, to_draft = _draft_vocab(counts, config.draft_vocab_size or tcfg.vocab_size)
    n_draft = hot.numel()

    model = build_head(tcfg, n_draft, config)
    with torch.no_grad():
        model.lm_head.weight.copy_(head[hot.to(head.device)])  # warm start: the target's own rows

    def next_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = [_crop(rng.choice(examples), config.seq_len, rng) for _ in range(config.batch_size)]
        length = min(len(e.tokens) for e in batch)
        tokens = torch.stack([e.tokens[:length] for e in batch]).to(config.device)
        aux = torch.stack([e.aux[:length - config.ttt_steps] for e in batch]).to(config.device)
        labels = torch.stack([e.labels[:length] for e in batch]).to(config.device)
        return tokens, aux, labels

    stats = _train_loop(model, embed, to_draft.to(config.device), next_batch, config)
    save_eagle3(model, output_dir, tcfg, hot, config)
    return stats


def train_eagle3_online(target: nn.Module, stream: torch.Tensor, output_dir: str, config: TrainConfig,
                        name: str = "eagle3") -> dict:
    """Train on random seq_len windows of a token stream (int tensor), running the HF causal-LM `target` (already
    on config.device) for features and labels at every step; writes the published checkpoint, returns stats."""
    return _train_online("eagle3", target, stream, output_dir, config, name)


def train_mtp_online(target: nn.Module, stream: torch.Tensor, output_dir: str, config: TrainConfig,
                     name: str = "mtp") -> dict:
    """One MTP / NextN layer for the target by the EAGLE-2 machinery (final-norm features, own output fed back);
    `output_dir` is the target checkpoint folder: the layer is appended as model.layers.{num_hidden_layers}.* (its
    own safetensors file, listed in the index) and config.json gets num_nextn_predict_layers (`save_mtp`)."""
    return _train_online("mtp", target, stream, output_dir, config, name)


def train_eagle_online(target: nn.Module, stream: torch.Tensor, output_dir: str, config: TrainConfig,
                       name: str = "eagle") -> dict:
    """The EAGLE-2 head (`LlamaForCausalLMEagle`) by the same online machinery: features are the target's final-norm
    hidden states (HF's last hidden_states entry, what the engine hands EAGLE), labels its greedy next tokens, the
    unroll feeds the head's own output back as the next feature. `draft_vocab_size` here only narrows the training
    softmax to the most frequent tokens (cheaper on CPU); the served head scores the target's whole vocabulary.
    Writes the published EAGLE-2 layout (runtime/models/eagle.py); returns stats."""
    return _train_online("eagle", target, stream, output_dir, config, name)


def _train_online(kind: str, target: nn.Module, stream: torch.Tensor, output_dir: str, config: TrainConfig,
                  name: str) -> dict:
    from runtime.config import ModelConfig
    from runtime.models.eagle3 import eagle3_capture_layers

    torch.manual_seed(config.seed)
    tcfg = ModelConfig.from_hf_config(target.config, eos_token_ids=[])
    capture = eagle3_capture_layers(tcfg.num_layers, config.aux_layer_ids) if kind == "eagle3" else None
    if capture and max(capture) >= tcfg.num_layers:  # HF's last hidden_states entry is after the final norm
        raise ValueError(f"online EAGLE-3 training captures layer inputs < {tcfg.num_layers}, got {capture}")
    device = torch.device(config.device)
    target.eval().requires_grad_(False)
    embed = target.get_input_embeddings().weight.detach().float()  # (V, H)
    head = target.get_output_embeddings().weight.detach().float()  # (V, H)
    # Draft vocabulary: the most frequent tokens of the stream (the labels are the target's next-token guesses,
    # distributed like the tokens themselves).
    counts = torch.bincount(stream.long().flatten(), minlength=tcfg.vocab_size)[: tcfg.vocab_size]
    hot, to_draft = _draft_vocab(counts, config.draft_vocab_size or tcfg.vocab_size)
    if kind == "eagle3":
        model, loss_fn = build_head(tcfg, hot.numel(), config), ttt_loss
        with torch.no_grad():
            model.lm_head.weight.copy_(head[hot.to(head.device)])
    elif kind == "mtp":
        model = MTPTrainHead(tcfg.hidden_size, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim,
                             config.intermediate_size or tcfg.intermediate_size, tcfg.rms_norm_eps, tcfg.rope_theta,
                             head[hot.to(head.device)], config.num_mtp_layers).to(config.device)
        loss_fn = eagle_ttt_loss
        if config.num_mtp_layers > 1:  # the chain's unroll: one step per layer
            config = replace(config, ttt_steps=config.num_mtp_layers)
    else:
        model, loss_fn = build_eagle_head(tcfg, head[hot.to(head.device)], config), eagle_ttt_loss
    from tools.lm_train import StreamSampler

    sampler = StreamSampler(stream, config.seq_len - 1, config.device, config.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16_autocast)

    def next_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = sampler.sample(config.batch_size)  # (B, seq_len)
        with torch.no_grad(), autocast:
            out = target(input_ids=tokens, output_hidden_states=True)
        if capture is None:  # EAGLE-2: the final-norm hidden state of every position (B, L, H)
            return tokens, out.hidden_states[-1].float(), out.logits.argmax(-1)
        t = tokens.shape[1] - config.ttt_steps
        aux = torch.cat([out.hidden_states[i][:, :t] for i in capture], dim=-1).float()  # (B, t, 3H)
        return tokens, aux, out.logits.argmax(-1)

    stats = _train_loop(model, embed, to_draft.to(device), next_batch, config, name, loss_fn)
    if kind == "eagle3":
        save_eagle3(model, output_dir, tcfg, hot, config)
    elif kind == "mtp":
        save_mtp(model, output_dir, tcfg, config)
    else:
        save_eagle(model, output_dir, tcfg, config)
    return stats


def build_head(tcfg, draft_vocab_size: int, config: TrainConfig) -> Eagle3TrainHead:
    return Eagle3TrainHead(tcfg.hidden_size, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim,
                           config.intermediate_size or tcfg.intermediate_size, draft_vocab_size, tcfg.rms_norm_eps,
                           tcfg.rope_theta).to(config.device)


def build_eagle_head(tcfg, lm_head: torch.Tensor, config: TrainConfig) -> EagleTrainHead:
    return EagleTrainHead(tcfg.hidden_size, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim,
                          config.intermediate_size or tcfg.intermediate_size, tcfg.rms_norm_eps, tcfg.rope_theta,
                          lm_head).to(config.device)


def eagle_ttt_loss(model: EagleTrainHead, embed: torch.Tensor, tokens: torch.Tensor, feats: torch.Tensor,
                   labels: torch.Tensor, config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2 counterpart of ttt_loss: tokens (B, L), feats (B, L, H) the target's final-norm hidden states, labels
    (B, L) training-vocabulary ids of its argmax (-100 outside). Step j at base p predicts labels[p+1+j] through the
    target's lm_head and, with weight feature_loss_weight, regresses (smooth L1) the target's own feature f_{p+1+j}
    (EAGLE's feature loss). Returns (decay-weighted loss, step-0 accuracy)."""
    n = config.ttt_steps
    t = tokens.shape[1] - n
    embeds = F.pad(embed[tokens[:, 1:]], (0, 0, 0, 1))  # (B, L, H): t_1.., padded
    hiddens = model.unrolled_hidden(embeds, feats[:, :t], n)
    loss, logits0 = 0.0, None
    for j, h in enumerate(hiddens):
        lg = model.logits(h)
        logits0 = lg if j == 0 else logits0
        step = F.cross_entropy(lg.float().flatten(0, 1), labels[:, 1 + j:1 + j + t].flatten())
        if config.feature_loss_weight:
            step = step + config.feature_loss_weight * F.smooth_l1_loss(h.float(), feats[:, 1 + j:1 + j + t])
        loss = loss + config.ttt_decay**j * step
    with torch.no_grad():
        want = labels[:, 1:1 + t]
        acc = (logits0.argmax(-1) == want)[want >= 0].float().mean()
    return loss, acc


def ttt_loss(model: Eagle3TrainHead, embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor,
             labels: torch.Tensor, config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, L), aux (B, L - n, 3H) target features of positions 0.., labels (B, L) draft ids of the target's
    argmax (-100 outside the draft vocabulary). Draft position p holds (t_{p+1}, f_p) and step j predicts the target's
    choice after t_{p+1+j}, i.e. labels[p+1+j]. Returns (weighted loss, step-0 accuracy)."""
    n = config.ttt_steps
    t = tokens.shape[1] - n
    embeds = F.pad(embed[tokens[:, 1:]], (0, 0, 0, 1))  # (B, L, H): t_1.., padded
    logits = model.unrolled_logits(embeds, aux, n)
    loss = sum(config.ttt_decay**j * F.cross_entropy(lg.float().flatten(0, 1), labels[:, 1 + j:1 + j + t].flatten())
               for j, lg in enumerate(logits))
    with torch.no_grad():
        want = labels[:, 1:1 + t]
        acc = (logits[0].argmax(-1) == want)[want >= 0].float().mean()
    return loss, acc


def _draft_vocab(counts: torch.Tensor, n_draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hot target ids ascending, target id -> draft id map with -100 = not in the draft vocabulary): the most
    frequent ids, ties to the lower id."""
    vocab = counts.numel()
    n_draft = min(n_draft, vocab)
    hot = torch.sort(torch.sort(-counts.cpu(), stable=True).indices[:n_draft]).values
    to_draft = torch.full((vocab,), -100, dtype=torch.int64)  # -100: ignored by cross_entropy
    to_draft[hot] = torch.arange(n_draft)
    return hot, to_draft


def _train_loop(model: nn.Module, embed: torch.Tensor, to_draft: torch.Tensor, next_batch, config: TrainConfig,
                name: str = "eagle3", loss_fn=ttt_loss) -> dict:
    """AdamW, 20-step warm-up then linear decay to 10% over steps (or the time budget, whichever ends first)."""
    import time

    from tools.lm_train import log, progress

    device = torch.device(config.device)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16_autocast)
    losses, accs, curve = [], [], []
    start, step = time.time(), 0
    while step < config.steps:
        elapsed = time.time() - start
        frac = max(step / config.steps, elapsed / config.time_budget_s if config.time_budget_s else 0.0)
        if frac >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / 20) * max(0.1, 1 - frac)
        tokens, aux, labels = next_batch(step)
        with autocast:
            loss, acc = loss_fn(model, embed, tokens, aux, to_draft[labels], config)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.detach())
        accs.append(acc)
        if config.log_every and (step % config.log_every == 0 or step == 1):
            loss_value, acc_value = loss.item(), acc.item()
            curve.append((step, round(loss_value, 4), round(acc_value, 4)))
            ntok = step * tokens.shape[0] * tokens.shape[1]
            line = (f"step {step} loss {loss_value:.3f} step0-acc {acc_value:.3f} "
                    f"tok/s {ntok / max(time.time() - start, 1e-9):,.0f}")
            if config.progress_bar:
                progress(round(frac * 1000), 1000, start, f"{name} {line}")
            else:
                log(f"{name} {line} elapsed {time.time() - start:.0f}s")
    tail = max(1, min(10, len(losses)))
    return {"final_loss": float(torch.stack(losses[-tail:]).mean()),
            "step0_accuracy": float(torch.stack(accs[-tail:]).mean()), "steps": step,
            "wall_time_s": round(time.time() - start, 1), "loss_curve": curve}


def save_eagle3(model: Eagle3TrainHead, output_dir: str, tcfg, hot: torch.Tensor, config: TrainConfig) -> None:
    """Write config.json + model.safetensors exactly as published EAGLE-3 heads are laid out."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    dtype = getattr(torch, config.save_dtype)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    n_draft = hot.numel()
    tensors["d2t"] = hot - torch.arange(n_draft)  # offsets: target = draft + d2t[draft]
    t2d = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    tensors["t2d"] = t2d
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    eagle_config: dict = {"use_aux_hidden_state": True}
    if config.aux_layer_ids is not None:  # unset = the loader's default capture, which `capture` already is
        eagle_config["eagle_aux_hidden_state_layer_ids"] = list(config.aux_layer_ids)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": tcfg.hidden_size, "intermediate_size": model.midlayer.mlp.gate_proj.out_features,
        "num_attention_heads": tcfg.num_heads, "num_key_value_heads": tcfg.num_kv_heads, "head_dim": tcfg.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": tcfg.rms_norm_eps, "rope_theta": tcfg.rope_theta,
        "max_position_embeddings": tcfg.max_position_embeddings, "vocab_size": tcfg.vocab_size,
        "draft_vocab_size": n_draft, "target_hidden_size": tcfg.hidden_size, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": config.save_dtype, "bias": False,
        "eagle_config": eagle_config,
        "training": {k: v for k, v in asdict(config).items() if k not in ("device", "log_every", "progress_bar")},
    }
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def save_eagle(model: EagleTrainHead, output_dir: str, tcfg, config: TrainConfig) -> None:
    """Write config.json + model.safetensors in the published EAGLE-2 layout: fc.{weight,bias}, layers.N.* (layer 0
    without input_layernorm), no norm, no lm_head or embed_tokens (the loader borrows the target's)."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    dtype = getattr(torch, config.save_dtype)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLMEagle"], "model_type": "llama",
        "hidden_size": tcfg.hidden_size, "intermediate_size": model.layers[0].mlp.gate_proj.out_features,
        "num_attention_heads": tcfg.num_heads, "num_key_value_heads": tcfg.num_kv_heads, "head_dim": tcfg.head_dim,
        "num_hidden_layers": len(model.layers), "rms_norm_eps": tcfg.rms_norm_eps, "rope_theta": tcfg.rope_theta,
        "max_position_embeddings": tcfg.max_position_embeddings, "vocab_size": tcfg.vocab_size,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": config.save_dtype,
        "training": {k: v for k, v in asdict(config).items()
                     if k not in ("device", "log_every", "progress_bar", "aux_layer_ids")},
    }
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def save_mtp(model: MTPTrainHead, target_dir: str, tcfg, config: TrainConfig) -> None:
    """Append the K layers to the target checkpoint in DeepSeek-V3's MTP layout: model.layers.{L + k}.{enorm, hnorm,
    eh_proj, input_layernorm, self_attn.*, post_attention_layernorm, mlp.*, shared_head.norm} in mtp.safetensors
    (listed in model.safetensors.index.json when the checkpoint is sharded), num_nextn_predict_layers = K in
    config.json (replacing MTP layers an earlier save wrote)."""
    from safetensors.torch import save_file

    if (config.intermediate_size or tcfg.intermediate_size) != tcfg.intermediate_size:
        raise ValueError("an MTP layer is a decoder layer of the target's shape: no other intermediate_size")
    dtype = getattr(torch, config.save_dtype)
    tensors = {}
    for key, value in model.state_dict().items():  # layers.{k}.<name> -> model.layers.{L + k}.<published name>
        _, index, name = key.split(".", 2)
        name = "shared_head.norm.weight" if name == "shared_head_norm.weight" else name
        tensors[f"model.layers.{tcfg.num_layers + int(index)}.{name}"] = value.detach().to("cpu", dtype).contiguous()
    save_file(tensors, os.path.join(target_dir, "mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != "mtp.safetensors"}
        index["weight_map"].update({name: "mtp.safetensors" for name in tensors})
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
    config_path = os.path.join(target_dir, "config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = len(model.layers)
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2)


def _crop(example: _Example, seq_len: int, rng: random.Random) -> _Example:
    if len(example.tokens) <= seq_len:
        return example
    s = rng.randrange(len(example.tokens) - seq_len + 1)
    return _Example(example.tokens[s:s + seq_len], example.aux[s:s + seq_len], example.labels[s:s + seq_len])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-model-path", required=True, help="Llama-family target checkpoint (with tokenizer)")
    p.add_argument("--corpus", required=True, help="UTF-8 text file; split into --seq-len token chunks")
    p.add_argument("--output-dir", required=True, help="where the EAGLE-3 head is written")
    p.add_argument("--steps", type=int, default=TrainConfig.steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak AdamW learning rate")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len, help="tokens per training chunk")
    p.add_argument("--ttt-steps", type=int, default=TrainConfig.ttt_steps, help="unrolled draft steps (TTT)")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="draft lm_head rows (default: full vocab)")
    p.add_argument("--aux-layer-ids", type=int, nargs=3, default=None, help="target layer outputs fed to fc")
    p.add_argument("--max-chunks", type=int, default=2000, help="cap on corpus chunks used")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target_model_path)
    with open(args.corpus, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    chunks = [ids[i:i + args.seq_len] for i in range(0, len(ids) - args.seq_len + 1, args.seq_len)][:args.max_chunks]
    config = TrainConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len,
                         ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size,
                         aux_layer_ids=args.aux_layer_ids, seed=args.seed, device=args.device)
    stats = train_eagle3(args.target_model_path, chunks, args.output_dir, config)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
