"""A DFLASH Propose as static-shape device code: one block-diffusion forward of the draft over every sequence's block
[t_{C-1}, MASK x (B-1)], attending to its injected context K/V through the paged attention kernel, then the argmax of
rows 1..B-1. On CUDA each batch bucket is captured as one CUDA graph at start-up, so a Propose is one host->device
copy of the packed inputs, one replay and one readback of the chains.

The eager path (draft_service/dflash.py `_draft_blocks`) gathers the context densely and runs SDPA; this step runs the
same draft layers with the block's own K/V written into the draft's paged KV just past the context (KV indices
[L, L + B), scratch that the next context injection overwrites) and a full B x B mask over them: the paged kernel's
"tree" region with every block row seeing every block key (bidirectional within the block, as DFlash attends), the
context [0, L) visible to all. RoPE positions are the block's own (C-1 ..), independent of the KV indices; the keys
carry theirs, so a draft window's ring (position p at KV index p % W, L = min(context, W)) attends the same way.

Context KV injection rides along: a sequence's new target feature rows (at most B: one step's accepted tokens) are
projected (fc, hidden_norm, each layer's k/v with RoPE) and written at their context positions first, inside the same
step; longer ones (a prompt's) are injected eagerly before.

Packed int64 row of sequence b: [last committed token, first RoPE position (C-1), context length L (after the
injection), first injected position, KV slots of [L, L + B) (B), KV slots of the injected rows (B, -1 = none),
block table]; the injected feature rows (B, K*H_t) in a float buffer beside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from runtime.models.llama import _rotate_half
from runtime.speculative.static_step import StaticStep


@dataclass
class BlockItem:
    """One sequence of a static DFLASH Propose."""

    last_token: int  # the last committed token t_{C-1}: the block's first row
    position: int  # its position C-1 (RoPE of the block rows: C-1 ..)
    context_len: int  # L: context KV indices [0, L) after the injection
    block_slots: list[int]  # KV slots of [L, L + B): the block's scratch K/V
    block_table: list[int]
    inject_start: int = 0  # context position of the first injected row
    inject_slots: list[int] | None = None  # KV slots of the injected rows (at most B)
    features: torch.Tensor | None = None  # (n <= B, K*H_t) target feature rows to inject, any device


class StaticBlockDraftStep(StaticStep):
    def __init__(self, model, kv_pool, block_manager, engine_config, max_context_len: int, block: int,
                 mask_token_id: int, max_bs: int) -> None:
        """model: runtime.models.dflash.DFlashDraftModel; kv_pool / block_manager: the proposer's context KV."""
        device = kv_pool.kv.device
        # StaticStep reads these of a runner: the context limit, the block manager, the device, the compile flags
        runner = SimpleNamespace(model_config=SimpleNamespace(max_position_embeddings=max_context_len),
                                 block_manager=block_manager, device=device, engine_config=engine_config)
        super().__init__(runner, max_bs, extra_tokens=block, cols_before_table=4 + 2 * block)
        self.model, self.kv_pool, self.block, self.mask_token_id = model, kv_pool, block, mask_token_id
        self.features = torch.zeros(self.max_bs, block, model.dflash.feature_size, dtype=model.fc.weight.dtype,
                                    device=device)
        cfg = model.dflash.model
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        from tandem_kernels.paged_attention import paged_attention
        from tandem_kernels.store_kv import store_kv

        self._attend, self._store = paged_attention, store_kv

    # ---- the static computation ----------------------------------------------------------------------------------
    def run(self, num_seqs: int) -> torch.Tensor:
        """Device code of one Propose over a bucket: (num_seqs, B - 1) int64 draft tokens (the chains)."""
        model, b, n = self.model, num_seqs, self.block
        x = self.inputs[:b]
        dev = x.device
        last, first_pos, ctx_len, inject_start = x[:, 0], x[:, 1], x[:, 2], x[:, 3]
        slots, inject_slots = x[:, 4:4 + n], x[:, 4 + n:4 + 2 * n]
        tables = x[:, self.table_col:].to(torch.int32)
        # context KV injection of the new feature rows (rows past a sequence's count write nothing: slot -1)
        ctx = model.hidden_norm(model.fc(self.features[:b]))  # (b, B, H)
        cos_i, sin_i = model._cos_sin(inject_start.unsqueeze(1) + torch.arange(n, device=dev), ctx.dtype)
        flat_inject = inject_slots.reshape(-1)
        for index, layer in enumerate(model.layers):
            k, v = layer.self_attn.kv(ctx, cos_i, sin_i)  # (b, B, kvh, hd)
            k_cache, v_cache = self.kv_pool.paged(index)
            self._store(k.reshape(b * n, *k.shape[2:]).contiguous(), v.reshape(b * n, *v.shape[2:]).contiguous(),
                        k_cache, v_cache, flat_inject)
        ids = torch.cat([last.unsqueeze(1), torch.full((b, n - 1), self.mask_token_id, dtype=torch.int64,
                                                       device=dev)], dim=1)  # (b, B)
        positions = first_pos.unsqueeze(1) + torch.arange(n, device=dev)  # (b, B)
        h = F.embedding(ids, model.embed_tokens).to(model.fc.weight.dtype)  # (b, B, H)
        cos, sin = model._cos_sin(positions, h.dtype)
        query_start = torch.arange(b + 1, device=dev, dtype=torch.int32) * n
        prefix = ctx_len.to(torch.int32)
        kv_lens = prefix + n
        visible = torch.ones(b * n, n, dtype=torch.bool, device=dev)  # the block: every row sees every block key
        use_block = torch.ones(b, dtype=torch.int32, device=dev)
        flat_slots = slots.reshape(-1)
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        for index, layer in enumerate(model.layers):
            attn, hn = layer.self_attn, layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(hn).unflatten(-1, (nh, hd)))
            q = q * cos + _rotate_half(q) * sin  # (b, B, nh, hd)
            k, v = attn.kv(hn, cos, sin)  # (b, B, kvh, hd)
            k_cache, v_cache = self.kv_pool.paged(index)
            self._store(k.reshape(b * n, kvh, hd).contiguous(), v.reshape(b * n, kvh, hd).contiguous(), k_cache,
                        v_cache, flat_slots)
            out = self._attend(q.reshape(b * n, nh, hd).contiguous(), k_cache, v_cache, tables, query_start, kv_lens,
                               prefix, self.scale, n, tree_mask=visible, use_tree=use_block)
            h = h + attn.o_proj(out.reshape(b, n, nh * hd))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = model.norm(h)
        return model.compute_logits(h[:, 1:], upcast=False).argmax(dim=-1)  # (b, B - 1)

    # ---- capture / replay ----------------------------------------------------------------------------------------
    def capture(self) -> None:
        super().capture(f"DFLASH block step (block {self.block})")

    def _untraced_kernels(self) -> None:  # no attention backend here: the two kernels it calls itself
        self._attend = torch.compiler.disable(self._attend)
        self._store = torch.compiler.disable(self._store)

    def _pad_host(self, host: torch.Tensor) -> None:
        """Padding sequences: no KV writes (slots -1), no context, the block over block 0's first keys."""
        host[:, 4:4 + 2 * self.block] = -1

    def _pad_inputs(self, bs: int) -> None:
        super()._pad_inputs(bs)
        self.features[:bs].zero_()  # finite rows

    def fits(self, ctx_len: int) -> bool:
        """A sequence with this much context (and its block after it) fits the step's block tables."""
        return self.runner.block_manager.blocks_for(ctx_len + self.block) <= self.max_blocks

    def propose(self, items: list[BlockItem]) -> list[list[int]]:
        """The chains of B - 1 draft tokens of these sequences (at most max_bs), one readback."""
        bs, n = self.bucket_for(len(items)), self.block
        host = self.new_host_rows(bs, max(len(item.block_table) for item in items))
        packed = host.numpy()
        for i, item in enumerate(items):
            inject = item.inject_slots or []
            packed[i, :4 + n + len(inject)] = [item.last_token, item.position, item.context_len, item.inject_start,
                                               *item.block_slots, *inject]
            self.put_table(packed[i], item.block_table)
        rows = [(i, 0, item.features) for i, item in enumerate(items)
                if item.features is not None and item.inject_slots]
        if rows:  # the context rows to inject, one copy
            self.put_rows(self.features[:bs], rows)
        return self.read_back(self.execute(host)[:len(items)]).tolist()
