"""One draft Propose as static-shape device code: the catch-up over newly committed tokens (SGLang's draft-extend,
left-padded to a fixed width), the `num_steps - 1` tree forwards of `topk` beam nodes, the per-step top-k and beam
selection (BeamTreeBuilder's own ops), the final re-rank to `num_draft_tokens - 1` nodes with their parents, and the
draft -> target id map, all on the device. On CUDA each (batch bucket) is captured as one CUDA graph at start-up and
a Propose is: one host->device copy of the packed inputs, one replay, one device->host copy of the trees.

The eager proposers (draft_service/standalone.py, eagle.py) stay the reference and the CPU path; this step runs the
same model, the same attention kernels (the triton backend with metadata computed on the device) and the same beam
ops, so its trees equal theirs (tests/graphs/test_draft_step.py). It owns no sequence state: the proposer decides
what each sequence catches up and reserves its KV; this module reads the runner's block tables.

Layout of one sequence b (Q = catch-up width, k = topk, S = num_steps, R_b = KV length after the catch-up):
  catch-up rows  [b*Q, b*Q + Q): the last n_b rows are the new tokens at KV indices [R_b - n_b, R_b), the first
                 Q - n_b are padding (write no KV, attend to the prefix only, never read);
  tree step s    k nodes at KV indices R_b + s*k + r, RoPE position R_b + s, attending to the prefix [0, R_b) and
                 their ancestors among the earlier nodes (a dense (k, S*k) mask built from the beam parents).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.types import ROOT, DraftTree
from runtime.models.llama import _k, use_step_kernels
from runtime.speculative.static_step import StaticStep
from runtime.speculative.tree import BeamTreeBuilder, logprob_topk


@dataclass(frozen=True)
class StepShape:
    num_steps: int
    topk: int
    num_draft_tokens: int
    catch_up: int  # Q: widest catch-up the static step takes (num_steps + 1 covers every accepted path + bonus)


@dataclass
class CatchUp:
    """What one sequence's static Propose needs from the proposer: the committed tokens the draft has not seen
    (and, for feature heads, their raw target features), where they go in the KV, and the block table."""

    token_ids: list[int]  # n <= Q tokens, written at KV indices [start, start + n)
    start: int  # KV index of token_ids[0]; the prefix [0, start) is already in the draft's KV
    slots: list[int]  # n flat KV slots
    block_table: list[int]
    features: torch.Tensor | None = None  # (n, F) raw target features (EAGLE heads), any device/dtype
    # Rows whose input feature is the draft's own recurrent hidden (a pre-draft's guessed positions, whose target
    # features do not exist yet): row index -> (H,) tensor on the draft's device, used as is (not projected).
    own_features: dict[int, torch.Tensor] | None = None


def select_tree_device(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, budget: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BeamTreeBuilder.finalize on the device: the best `budget` candidates per row by cumulative log-prob (ties to
    the lower flat index), in flat-index order (parents first), with their parents as node indices (-1 = root).
    Returns (tokens (b, budget), parents (b, budget), count (b,)); slots past count are -1.

    Equals tree._select_closed: with log-prob scores a child never beats its parent and has a higher flat index, so
    the global order is a best-first order of the frontier; -inf and NaN candidates (no draft mass) and their
    subtrees are left out. tandem_kernels/tree.select_tree does this in one launch inside the CUDA graphs."""
    b, num = scores.shape
    budget = min(budget, num)
    scores = torch.nan_to_num(scores.float(), nan=-torch.inf, neginf=-torch.inf)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    top = order.indices[:, :budget]  # (b, budget)
    ok = order.values[:, :budget] > -torch.inf
    count = ok.sum(dim=-1)
    big = torch.full_like(top, num)
    chosen = torch.sort(torch.where(ok, top, big), dim=-1).values  # flat indices ascending, the left-outs last
    valid = chosen < num
    safe = torch.where(valid, chosen, torch.zeros_like(chosen))
    node_tokens = tokens.gather(1, safe)
    flat_parent = parents.gather(1, safe)  # flat candidate index of each chosen node's parent, -1 = root
    # node_of[:, num] answers the root (-1); the left-outs scatter to num + 1, out of the way
    node_of = torch.full((b, num + 2), -1, dtype=torch.long, device=scores.device)
    node_of.scatter_(1, torch.where(valid, chosen, big + 1), torch.arange(budget, device=scores.device).expand(b, -1))
    parent_node = node_of.gather(1, torch.where(flat_parent < 0, torch.full_like(flat_parent, num), flat_parent))
    minus = torch.full_like(node_tokens, -1)
    return torch.where(valid, node_tokens, minus), torch.where(valid, parent_node, minus), count


def select_tree(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, budget: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """select_tree_device, in a CUDA graph one Triton launch (tandem_kernels/tree.select_tree) instead of ~40."""
    if use_step_kernels(scores):
        return _k("tree").select_tree(scores, tokens, parents, budget)
    return select_tree_device(scores, tokens, parents, budget)


class StaticDraftStep(StaticStep):
    """The static Propose of one draft ModelRunner (triton attention backend) for one StepShape, eager on CPU and
    one CUDA graph per batch bucket on CUDA."""

    def __init__(self, runner, shape: StepShape, max_bs: int, feature_head: bool) -> None:
        s, k, q = shape.num_steps, shape.topk, shape.catch_up
        # Packed int64 inputs, one host->device copy per Propose: per sequence [ids (Q), positions (Q), slots (Q),
        # start (1), kv_after (1), block table (max_blocks)].
        super().__init__(runner, max_bs, extra_tokens=q + s * k, cols_before_table=3 * q + 2)
        self.shape, self.feature_head = shape, feature_head
        self.features = None
        if feature_head:
            self.features = torch.zeros(self.max_bs * q, runner.model.feature_size, dtype=runner.dtype,
                                        device=runner.device)
            # CatchUp.own_features: the rows whose input is the draft's own hidden instead of a projected feature
            hidden = runner.model_config.hidden_size
            self.own = torch.zeros(self.max_bs * q, hidden, dtype=runner.dtype, device=runner.device)
            self.own_mask = torch.zeros(self.max_bs * q, 1, dtype=torch.bool, device=runner.device)
            self._own_set = False

    # ---- the static computation ----------------------------------------------------------------------------------
    def run(self, num_seqs: int) -> torch.Tensor:
        """The device code of one Propose of `num_seqs` (a bucket) sequences over the static inputs; returns the
        (num_seqs, 2M + 1) int64 result: tree tokens (target ids, -1 past the count), parents, node count."""
        runner, model, shape = self.runner, self.runner.model, self.shape
        backend, kv_pool = runner.attn_backend, runner.kv_pool
        b, q, k, steps = num_seqs, shape.catch_up, shape.topk, shape.num_steps
        dev = self.inputs.device
        x = self.inputs[:b]
        ids, pos, slots = x[:, :q], x[:, q:2 * q], x[:, 2 * q:3 * q]
        start, kv_after = x[:, 3 * q], x[:, 3 * q + 1]
        tables = x[:, self.table_col:].to(torch.int32)
        kv_after32 = kv_after.to(torch.int32)
        # Catch-up: causal chain appends, left-padded (kv_len - Q + i is each row's last visible key).
        backend.use_static_metadata(
            slot_mapping=slots.reshape(-1), block_tables=tables,
            query_start=torch.arange(b + 1, device=dev, dtype=torch.int32) * q, kv_lens=kv_after32,
            prefix_lens=start.to(torch.int32), max_query_len=q)
        extra = {}
        if self.feature_head:
            extra["input_features"] = torch.where(self.own_mask[:b * q], self.own[:b * q],
                                                  model.project_features(self.features[:b * q]))
        out = model(ids.reshape(-1), pos.reshape(-1), backend, kv_pool, None, **extra)
        last = torch.arange(b, device=dev) * q + (q - 1)
        hidden = out.hidden[last]  # (b, H): the root's recurrent hidden (feature heads) / last hidden
        root_logits = model.compute_logits(hidden, upcast=False)  # the top-k reads bf16 as it is (no cast kernel)
        width = steps * k
        # In a CUDA graph each tree level is one launch (tandem_kernels/tree.DeviceBeam: the beam expansion and the
        # next forward's inputs), elsewhere BeamTreeBuilder and these torch ops.
        kernels = use_step_kernels(root_logits)
        if kernels:
            beam = _k("tree").DeviceBeam(b, steps, k, x, live_col=3 * q - 1, kv_col=3 * q + 1,
                                         table_col=self.table_col, block_size=self.block_size,
                                         draft_to_target=getattr(model, "draft_to_target", None))
            ids, ranks, node_slots, positions = beam.expand(*logprob_topk(root_logits, k))
        else:
            builder = BeamTreeBuilder(b, steps, k, shape.num_draft_tokens)
            nodes = builder.first_topk(*logprob_topk(root_logits, k))
            ancestors = torch.zeros(b, k, width, dtype=torch.uint8, device=dev)
            eye = torch.eye(k, dtype=torch.uint8, device=dev)
            node_offsets = torch.arange(k, device=dev)
            # A padding row (every catch-up slot -1) writes no tree node KV either: its table is block 0's, someone's.
            live = slots[:, q - 1:q] >= 0
        parent_hidden = hidden.unsqueeze(1).expand(b, k, -1)
        # The tree steps' constant metadata, made once (each op is a node of the graph, replayed every Propose).
        query_start_k = torch.arange(b + 1, device=dev, dtype=torch.int32) * k
        all_tree = torch.ones(b, dtype=torch.int32, device=dev)
        for step in range(1, steps):
            s = step - 1  # the builder step whose nodes are forwarded now
            if kernels:
                ancestors, kv_lens = beam.ancestors, beam.kv_lens
            else:
                if s > 0:
                    ranks = nodes.parents - (s - 1) * k  # (b, k) beam rank of each node's parent in the last step
                    ancestors = ancestors.gather(1, ranks.unsqueeze(-1).expand(-1, -1, width))
                else:
                    ranks = torch.zeros_like(nodes.parents)
                ancestors[:, :, s * k:(s + 1) * k] |= eye  # each node sees itself
                region = kv_after.unsqueeze(1) + s * k + node_offsets  # (b, k) KV indices
                block = tables.gather(1, (region // self.block_size).to(torch.long)).to(torch.long)
                node_slots = torch.where(live, block * self.block_size + region % self.block_size, -1)
                positions = (kv_after + s).unsqueeze(1).expand(b, k)
                kv_lens = kv_after32 + (s + 1) * k
                ids = self._to_target(nodes.tokens)
            feats = parent_hidden.gather(1, ranks.unsqueeze(-1).expand(-1, -1, parent_hidden.shape[-1]))
            backend.use_static_metadata(
                slot_mapping=node_slots.reshape(-1), block_tables=tables,
                query_start=query_start_k, kv_lens=kv_lens, prefix_lens=kv_after32,
                max_query_len=k, tree_mask=ancestors.reshape(b * k, width), use_tree=all_tree)
            extra = {"input_features": feats.reshape(b * k, -1)} if self.feature_head else {}
            out = model(ids.reshape(-1), positions.reshape(-1), backend, kv_pool, None, **extra)
            logits = model.compute_logits(out.hidden, upcast=False)  # (b*k, V)
            parent_hidden = out.hidden.view(b, k, -1)
            values, indices = logprob_topk(logits, k)
            if kernels:
                ids, ranks, node_slots, positions = beam.expand(values, indices)
            else:
                nodes = builder.next_topk(values.view(b, k, k), indices.view(b, k, k))
        candidates = beam.candidates() if kernels else builder.candidates()
        tokens, parents, count = select_tree(*candidates, shape.num_draft_tokens - 1)
        mapped = torch.where(tokens >= 0, self._to_target(tokens.clamp(min=0)), tokens)
        return torch.cat([mapped, parents, count.unsqueeze(1)], dim=1)

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        mapping = getattr(self.runner.model, "draft_to_target", None)
        return draft_ids if mapping is None else mapping[draft_ids]

    # ---- capture / replay ----------------------------------------------------------------------------------------
    def capture(self) -> None:
        super().capture(f"draft step {self.shape}")

    def _pad_host(self, host: torch.Tensor) -> None:
        """Padding sequences: no KV writes (slot -1), one visible key of block 0."""
        q = self.shape.catch_up
        host[:, 2 * q:3 * q] = -1
        host[:, 3 * q + 1] = 1

    def _pad_inputs(self, bs: int) -> None:
        super()._pad_inputs(bs)
        if self.features is not None:
            self.features[:bs * self.shape.catch_up].zero_()  # finite features

    def fits(self, item: CatchUp) -> bool:
        return 1 <= len(item.token_ids) <= self.shape.catch_up and len(item.block_table) <= self.max_blocks

    def propose(self, items: list[CatchUp]) -> list[DraftTree]:
        """Trees for these sequences (each `fits`, at most max_bs of them); the caller reserved KV for every
        catch-up token and every tree node ([0, start + n + num_steps * topk)) and commits the catch-up after."""
        num = len(items)
        bs = self.bucket_for(num)
        q = self.shape.catch_up
        host = self.new_host_rows(bs, max(len(item.block_table) for item in items))
        rows = host.numpy()
        for i, item in enumerate(items):
            n = len(item.token_ids)
            pad = q - n
            start = item.start
            rows[i, :3 * q + 2] = ([0] * pad + item.token_ids + [0] * pad + list(range(start, start + n)) + [-1] * pad
                                   + item.slots + [start, start + n])
            self.put_table(rows[i], item.block_table)
        if self.feature_head:  # each catch-up's rows right-aligned in its window, one copy
            self.put_rows(self.features[:bs * q].view(bs, q, -1),
                          [(i, q - len(item.token_ids), item.features) for i, item in enumerate(items)])
            self._put_own(items, bs)
        rows = self.read_back(self.execute(host)[:num]).tolist()  # the one device->host copy of a Propose
        m = self.shape.num_draft_tokens - 1
        trees = []
        for row in rows:
            count = row[2 * m]
            trees.append(DraftTree(row[:count], [ROOT if p < 0 else p for p in row[m:m + count]]))
        return trees

    def _put_own(self, items: list[CatchUp], bs: int) -> None:
        """The own-hidden rows of pre-drafts (CatchUp.own_features); cleared again after a Propose that had some."""
        q = self.shape.catch_up
        own = [(i * q + q - len(item.token_ids) + r, row) for i, item in enumerate(items)
               for r, row in (item.own_features or {}).items()]
        if self._own_set:
            self.own_mask.zero_()
        self._own_set = bool(own)
        if own:
            index = torch.tensor([j for j, _ in own], device=self.own.device)
            self.own.index_copy_(0, index, torch.stack([row.to(self.own.dtype) for _, row in own]).to(self.own.device))
            self.own_mask[index] = True


class StaticMultiLayerDraftStep(StaticDraftStep):
    """The static Propose of multi-layer EAGLE (an MTP stack, runtime/models/mtp.py): no tree forwards; step s runs
    MTP layer s over the catch-up window (every layer at the same positions and slots, each writing its own KV
    layer), its ids the previous step's rotated left by one with the previous step's top-1 at the root's row appended
    (DeepSeek's chain, SGLang's rotate_input_ids), its features the previous layer's outputs (layer 0: the target's).
    The chain is the S top-1 tokens. Catch-up width 2S: the window starts S-1 positions before the draft's KV end,
    where the deepest layer's committed KV ends (draft_service/eagle.py)."""

    def run(self, num_seqs: int) -> torch.Tensor:
        runner, model, shape = self.runner, self.runner.model, self.shape
        b, q, steps = num_seqs, shape.catch_up, shape.num_steps
        dev = self.inputs.device
        x = self.inputs[:b]
        ids, pos, slots = x[:, :q], x[:, q:2 * q], x[:, 2 * q:3 * q]
        start, kv_after = x[:, 3 * q], x[:, 3 * q + 1]
        # One metadata for every layer: the same rows, positions and slots (left-padded causal appends).
        runner.attn_backend.use_static_metadata(
            slot_mapping=slots.reshape(-1), block_tables=x[:, self.table_col:].to(torch.int32),
            query_start=torch.arange(b + 1, device=dev, dtype=torch.int32) * q, kv_lens=kv_after.to(torch.int32),
            prefix_lens=start.to(torch.int32), max_query_len=q)
        feats = model.project_features(self.features[:b * q])  # (b*q, H)
        last = torch.arange(b, device=dev) * q + (q - 1)  # the root's row (position C-2) of each sequence
        tokens = []
        for s in range(steps):
            model.active_layer = s  # read while the graph is captured: each step records its own layer's kernels
            out = model(ids.reshape(-1), pos.reshape(-1), runner.attn_backend, runner.kv_pool, None,
                        input_features=feats)
            top = model.compute_logits(out.hidden[last], upcast=False).argmax(dim=-1)  # (b,) draft ids
            tokens.append(top)
            feats = out.hidden  # (b*q, H); padding rows stay in padding rows (row-wise ops, no KV written)
            ids = torch.cat([ids[:, 1:], self._to_target(top).unsqueeze(1)], dim=1)
        model.active_layer = 0
        chain = self._to_target(torch.stack(tokens, dim=1))  # (b, S)
        parents = (torch.arange(steps, device=dev) - 1).expand(b, -1)
        count = torch.full((b, 1), steps, dtype=torch.long, device=dev)
        return torch.cat([chain, parents, count], dim=1)
