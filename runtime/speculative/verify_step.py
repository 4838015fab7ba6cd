"""One greedy Verify as static-shape device code: the target forward over root + tree (tree masks built on the
device from the parents), lm_head and argmax, the greedy tree walk (tandem_kernels.verify_greedy), the compaction of the
accepted path's KV to contiguous positions, and the gather of the accepted tokens' target features (EAGLE drafts),
all on the device. On CUDA each batch bucket is one CUDA graph captured at start-up, so a Verify is one host->device
copy of the packed inputs, one replay and one device->host copy of (emitted tokens, accept lengths, features).

The eager path (TargetEngine: ModelRunner.forward + acceptance + ModelRunner.compact) stays the reference and runs
everything this does not take: sampling, penalties, logprobs, trees of another size, CPU. Owns no sequence state:
the engine checks each sequence, reserves its KV and commits what comes back.

Layout of sequence b (W = root + num_draft_tokens - 1 nodes, its tree region = KV indices [kv_b, kv_b + W)): rows
[b*W, b*W + W) hold the root then the draft nodes in tree order; node i attends to the prefix [0, kv_b) and to its
ancestors in the region (itself included).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.models.llama import _k, use_step_kernels
from runtime.speculative.static_step import StaticStep


@dataclass
class VerifyItem:
    """What one sequence's static Verify needs: the W region tokens (root first), each node's region parent (-1 for
    the root), RoPE positions, KV slots of the region, where the region starts, and the block table."""

    token_ids: list[int]
    parents: list[int]
    positions: list[int]
    slots: list[int]
    start: int
    block_table: list[int]


@dataclass
class VerifyResult:
    tokens: list[int]  # emitted: accepted drafts then the bonus token
    accepted_nodes: list[int]  # draft node indices (0-based, root excluded) of the accepted path
    features: torch.Tensor | None  # (len(tokens), F) on the host: root + accepted drafts' target features


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(b, W) region parents (-1 = none; parents precede children) -> (b, W, W) uint8, row i = i and its ancestors.
    Pointer jumping: ceil(log2(W)) rounds of static-shape gathers."""
    b, w = parents.shape
    ids = torch.arange(w, device=parents.device).expand(b, w)
    jump = torch.where(parents < 0, ids, parents)  # roots point at themselves
    anc = torch.eye(w, dtype=torch.uint8, device=parents.device).expand(b, w, w).contiguous()
    for _ in range(max(1, math.ceil(math.log2(max(w, 2))))):
        anc = anc | anc.gather(1, jump.unsqueeze(-1).expand(b, w, w))
        jump = jump.gather(1, jump)
    return anc


def region_tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """ancestor_mask, in a CUDA graph one Triton launch (tandem_kernels/tree.region_mask) instead of ~3 kernels per
    pointer-jumping round."""
    if use_step_kernels(parents):
        return _k("tree").region_mask(parents)[0]
    return ancestor_mask(parents)


class StaticVerifyStep(StaticStep):
    """Greedy Verify of trees of exactly `width` region nodes for one target ModelRunner (triton backend)."""

    def __init__(self, runner, width: int, max_bs: int, capture_layers: list[int] | None = None,
                 final_norm_features: bool = False) -> None:
        # Packed int64 inputs per sequence: [ids (W), positions (W), slots (W), parents (W), start (1), table].
        super().__init__(runner, max_bs, extra_tokens=width, cols_before_table=4 * width + 1)
        self.width = width
        self.capture_layers = list(capture_layers) if capture_layers else None
        self.final_norm = final_norm_features
        self.feature_dim = len(self.capture_layers) * runner.model_config.hidden_size if self.capture_layers else 0
        from runtime.cuda_graph import _tree_verifier

        self._walk = _tree_verifier()
        if self._walk is None:
            from tandem_kernels.verify_greedy import verify_tree_greedy_ref

            self._walk = verify_tree_greedy_ref

    # ---- the static computation ----------------------------------------------------------------------------------
    def run(self, num_seqs: int) -> torch.Tensor:
        """Device code of one Verify of a bucket of sequences over the static inputs. Returns one uint8 buffer:
        int64 (b, 2W + 1) [emitted tokens (-1 past the count), path region nodes (root first, -1 past it), accept
        length], then the features (b, W, F) bytes."""
        runner, model = self.runner, self.runner.model
        backend, kv_pool = runner.attn_backend, runner.kv_pool
        b, w = num_seqs, self.width
        dev = self.inputs.device
        x = self.inputs[:b]
        ids, pos, slots, parents = x[:, :w], x[:, w:2 * w], x[:, 2 * w:3 * w], x[:, 3 * w:4 * w]
        start = x[:, 4 * w].to(torch.int32)
        tables = x[:, self.table_col:].to(torch.int32)
        backend.use_static_metadata(
            slot_mapping=slots.reshape(-1), block_tables=tables,
            query_start=torch.arange(b + 1, device=dev, dtype=torch.int32) * w, kv_lens=start + w,
            prefix_lens=start, max_query_len=w, tree_mask=region_tree_mask(parents).reshape(b * w, w),
            use_tree=torch.ones(b, dtype=torch.int32, device=dev))
        out = model(ids.reshape(-1), pos.reshape(-1), backend, kv_pool, self.capture_layers)
        argmax = model.compute_logits(out.hidden, upcast=False).argmax(dim=-1).view(b, w)
        feats = None
        if self.capture_layers:
            feats = model.norm(out.features) if self.final_norm else out.features
        if use_step_kernels(argmax):  # in a CUDA graph: the walk with its epilogue in one launch
            head_bytes = b * (2 * w + 1) * 8
            result = torch.empty(head_bytes + (b * w * feats.shape[-1] * feats.element_size() if feats is not None
                                               else 0), dtype=torch.uint8, device=dev)
            head = result[:head_bytes].view(torch.int64).view(b, 2 * w + 1)
            src, dst, rows = _k("verify_greedy").verify_tree_greedy_packed(ids, parents, argmax, slots, head)
            self._compact(src.view(-1), dst.view(-1))
            if feats is not None:
                torch.index_select(feats, 0, rows.view(-1), out=result[head_bytes:].view(feats.dtype).view(b * w, -1))
            return result
        accept_index, emitted, accept_lens = self._walk(ids.contiguous(), parents.contiguous(), argmax)
        accept_index, emitted, lens = accept_index.long(), emitted.long(), accept_lens.long()
        # Compaction: region node accept_index[j] -> region index j, for the root's successors on the path.
        j = torch.arange(w, device=dev).expand(b, w)
        moves = (j >= 1) & (j < lens.unsqueeze(1)) & (accept_index != j)
        src = torch.where(moves, slots.gather(1, accept_index.clamp(min=0)), torch.full_like(slots, -1))
        self._compact(src.reshape(-1), slots.reshape(-1))
        result = torch.cat([emitted, accept_index, lens.unsqueeze(1)], dim=1)  # (b, 2W + 1) int64
        parts = [result.view(torch.uint8).reshape(-1)]
        if feats is not None:
            rows = (torch.arange(b, device=dev).unsqueeze(1) * w + accept_index.clamp(min=0)).reshape(-1)
            parts.append(feats[rows].contiguous().view(torch.uint8).reshape(-1))
        return torch.cat(parts)

    def _untraced_kernels(self) -> None:
        super()._untraced_kernels()
        self._walk = torch.compiler.disable(self._walk)
        self._compact = torch.compiler.disable(self._compact)

    def _compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv = self.runner.kv_pool.kv
        if kv.device.type == "cuda":
            from tandem_kernels.compact_kv import compact_kv

            compact_kv(kv, src, dst)
        else:
            from tandem_kernels.compact_kv import compact_kv_ref

            compact_kv_ref(kv, src, dst)

    # ---- capture / replay ----------------------------------------------------------------------------------------
    def capture(self) -> None:
        super().capture(f"verify step (width {self.width})")

    def _pad_host(self, host: torch.Tensor) -> None:
        """Padding sequences: a chain of W nodes over block 0 that writes no KV (slot -1) and moves nothing."""
        w = self.width
        host[:, 2 * w:3 * w] = -1
        host[:, 3 * w:4 * w] = torch.arange(-1, w - 1)

    def fits(self, item_tokens: int, block_table_len: int) -> bool:
        return item_tokens == self.width and block_table_len <= self.max_blocks

    def verify(self, items: list[VerifyItem]) -> list[VerifyResult]:
        """Greedy outcomes of these sequences (each `fits`, at most max_bs); the caller reserved the region's KV
        ([0, start + W)) and sets each sequence's KV length to start + len(tokens) after."""
        num = len(items)
        bs = self.bucket_for(num)
        w = self.width
        host = self.new_host_rows(bs, max(len(item.block_table) for item in items))
        rows = host.numpy()
        for i, item in enumerate(items):
            rows[i, :4 * w + 1] = item.token_ids + item.positions + item.slots + item.parents + [item.start]
            self.put_table(rows[i], item.block_table)
        data = self.read_back(self.execute(host))  # the one device->host copy of a Verify
        head = bs * (2 * w + 1) * 8
        result = data[:head].view(torch.int64).view(bs, 2 * w + 1).numpy().tolist()  # host memory already
        feats = None
        if self.capture_layers:
            feats = data[head:].view(self.runner.dtype).view(bs, w, self.feature_dim)
        out = []
        for i in range(num):
            count = result[i][2 * w]
            path = result[i][w + 1:w + count]  # region nodes after the root
            out.append(VerifyResult(result[i][:count], [node - 1 for node in path],
                                    feats[i, :count].clone() if feats is not None else None))
        return out
