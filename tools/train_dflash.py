"""Train a DFlash block-diffusion draft (runtime/models/dflash.py) for any Llama-family target, online: every step an
HF target runs over fresh windows of a token stream, its hidden states at the draft's target layers are the context
features, and the draft learns to fill blocks [t_a, MASK x (B-1)] at random anchors a with the target's own greedy
predictions (hard self-distillation: row i of the block at a is labelled argmax p_target(. | t_0..t_{a+i-1})).

Many blocks per window in one forward: each block attends to the context features of positions < a (the committed
tokens at serve time) and to its whole block, never to other blocks. Row i's loss weight decays as decay^(i-1) (early
rows decide the accept length). Writes the checkpoint the DFLASH proposer loads (config.json + model.safetensors, no
embedding or lm_head). Plain torch on any device; `python -m tools.train_draft --kind dflash ...` is the CLI.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DFlashTrainConfig:
    """The draft's shape (compact defaults: bundled drafts are size-limited) and its training blocks."""

    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int | None = None  # None = target hidden / num_heads
    intermediate_size: int | None = None  # None = the target's hidden size (a small FFN)
    block_size: int = 8
    num_blocks: int = 8  # training blocks (anchors) per window
    target_layer_ids: list[int] | None = None  # None: evenly spaced over [1, L-3], up to 3 layers
    mask_token_id: int | None = None  # None: the target's pad token, else its last vocabulary id
    row_decay: float = 0.9  # loss weight of block row i: decay ** (i - 1)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    from runtime.models.dflash import dflash_target_layer_ids

    return sorted(set(dflash_target_layer_ids(num_target_layers, min(3, num_target_layers))))


def train_dflash_online(target: torch.nn.Module, stream: torch.Tensor, output_dir: str, config, shape: DFlashTrainConfig
                        ) -> dict:
    """config: tools.train_eagle3.TrainConfig (steps, lr, batch, seq_len, time budget, device, save dtype, logging)."""
    from runtime.config import ModelConfig
    from runtime.models.dflash import DFlashConfig, DFlashDraftModel, build_raw_config, save_dflash_draft
    from tools.lm_train import StreamSampler
    from tools.train_eagle3 import _train_loop

    torch.manual_seed(config.seed)
    tcfg = ModelConfig.from_hf_config(target.config, eos_token_ids=[])
    ids = shape.target_layer_ids or default_target_layer_ids(tcfg.num_layers)
    if any(not 0 <= i < tcfg.num_layers - 1 for i in ids):  # HF's last hidden_states entry is after the final norm
        raise ValueError(f"target_layer_ids must be in [0, {tcfg.num_layers - 2}] for online training, got {ids}")
    if config.seq_len < shape.block_size + 2:
        raise ValueError(f"seq_len {config.seq_len} must exceed the block size {shape.block_size} + 1")
    mask_id = shape.mask_token_id
    if mask_id is None:
        pad = getattr(target.config, "pad_token_id", None)
        mask_id = pad if isinstance(pad, int) and 0 <= pad < tcfg.vocab_size else tcfg.vocab_size - 1
    raw = build_raw_config(tcfg, num_layers=shape.num_layers, num_heads=shape.num_heads,
                           num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                           intermediate_size=shape.intermediate_size or tcfg.hidden_size,
                           block_size=shape.block_size, target_layer_ids=ids, mask_token_id=mask_id)
    device = torch.device(config.device)
    model = DFlashDraftModel(DFlashConfig.from_raw(raw, tcfg)).to(device)
    _init_weights(model)
    target.eval().requires_grad_(False)
    embed = target.get_input_embeddings().weight.detach().float()  # (V, H)
    model.set_target_tensors(embed, target.get_output_embeddings().weight.detach().float())
    sampler = StreamSampler(stream, config.seq_len - 1, config.device, config.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16_autocast)

    def next_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = sampler.sample(config.batch_size)  # (B, seq_len)
        with torch.no_grad(), autocast:
            out = target(input_ids=tokens, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in ids], dim=-1).float()  # (B, L, K*H): outputs of ids
        return tokens, feats, out.logits.argmax(-1)

    loss_fn = functools.partial(dflash_block_loss, shape=shape)
    stats = _train_loop(model, embed, torch.arange(tcfg.vocab_size, device=device), next_batch, config, "dflash",
                        loss_fn)
    save_dflash_draft(model, raw, output_dir, getattr(torch, config.save_dtype))
    return {**stats, "target_layer_ids": ids, "block_size": shape.block_size, "mask_token_id": mask_id}


def dflash_block_loss(model, embed: torch.Tensor, tokens: torch.Tensor, feats: torch.Tensor, labels: torch.Tensor,
                      config, *, shape: DFlashTrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, L), feats (B, L, K*H) the target features of every position, labels (B, L) its greedy next token
    after each position; num_blocks random anchors a in [1, L - block] per window. Row i of the block at a (position
    a+i) is labelled with the target's choice after position a+i-1. Returns (loss, row-1 accuracy)."""
    b, length = tokens.shape
    block = shape.block_size
    anchors = torch.randint(1, length - block + 1, (b, shape.num_blocks), device=tokens.device)  # (B, nb)
    logits = block_logits(model, tokens, feats, anchors, block)  # (B, nb, block-1, V)
    rows = anchors.unsqueeze(-1) + torch.arange(block - 1, device=tokens.device)  # (B, nb, block-1): a+i-1
    want = labels.gather(1, rows.flatten(1)).view_as(rows)
    weights = shape.row_decay ** torch.arange(block - 1, device=tokens.device, dtype=torch.float32)
    losses = F.cross_entropy(logits.flatten(0, 2), want.flatten(), reduction="none").view_as(rows)
    loss = (losses * weights).sum(-1).mean() / weights.sum()
    with torch.no_grad():
        acc = (logits[:, :, 0].argmax(-1) == want[:, :, 0]).float().mean()
    return loss, acc


def block_logits(model, tokens: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """Draft logits of rows 1..block-1 of a block at each anchor, all blocks of a window in one forward: the block
    [t_a, MASK...] at positions a..a+block-1 attends to the context features of positions < a and to its own block
    (what the proposer computes at committed length a+1). tokens (B, L), feats (B, L, K*H), anchors (B, nb)
    -> (B, nb, block-1, V)."""
    b, length = tokens.shape
    nb, device = anchors.shape[1], tokens.device
    positions = (anchors.unsqueeze(-1) + torch.arange(block, device=device)).flatten(1)  # (B, nb*block)
    ids = torch.full_like(positions, model.dflash.mask_token_id)
    ids.view(b, nb, block)[:, :, 0] = tokens.gather(1, anchors)
    q = nb * block
    ctx_cols = torch.arange(length, device=device)
    sees_ctx = (ctx_cols.view(1, 1, 1, length) < anchors.view(b, nb, 1, 1)).expand(b, nb, block, length)
    query_block = torch.arange(q, device=device) // block
    sees_block = (query_block.view(q, 1) == query_block.view(1, q)).expand(b, q, q)
    mask = torch.cat([sees_ctx.reshape(b, q, length), sees_block], dim=-1).unsqueeze(1)  # (B, 1, Q, L + Q)
    context = model.context_kv(feats, ctx_cols.expand(b, length))
    hidden = model(ids, positions, context, mask).view(b, nb, block, -1)[:, :, 1:]  # (B, nb, block-1, H)
    return model.compute_logits(hidden)


def _init_weights(model, std: float = 0.02) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)
