"""EAGLE-family proposer (EAGLE, alias NEXTN, and EAGLE3): a feature-based draft head over its own paged KV, fed the
target's features of committed tokens, drafting a chain (topk=1) or a top-k beam tree with faithful tree masks.

Feature protocol (one-token shift): draft KV position p holds (token t_{p+1}, target feature f_p), so with C
committed tokens the draft KV covers positions [0, C-1) and its output at C-2 (input: the root t_{C-1} and f_{C-2})
gives the first draft step. Deeper steps feed the draft's own recurrent hidden instead of the unknown target feature.
Knows nothing about how the target produced the features or what gets committed.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from core import algorithms
from core.algorithms import DraftModel, TargetFeatures
from draft_service.proposer import Proposer, ProposeInput, SpecShape
from runtime.chunked import forward_chunked
from runtime.config import EngineConfig, ModelConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.models.eagle import load_draft_head, read_config
from runtime.models.eagle3 import eagle3_aux_layer_ids, eagle3_capture_layers
from runtime.speculative.draft_step import CatchUp
from runtime.speculative.tree import BeamTreeBuilder, DraftTree, host_rows



class EagleProposer(Proposer):
    """Feature-based drafting. Sequences are prefilled lazily: features are kept until the next Propose runs them."""

    needs_features = True

    def __init__(
        self,
        target_path: str,
        draft_path: str,
        engine_config: EngineConfig,
        algorithm: str = "EAGLE",
        token_map: str | Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """target_path: the target checkpoint (embedding and lm_head are shared from it); draft_path: the published
        EAGLE / EAGLE-3 head; token_map: FR-Spec hot target ids (EAGLE only), a torch.load-able file or the ids."""
        super().__init__()
        entry = algorithms.find(algorithm)
        if entry is None or entry.draft_model is not DraftModel.HEAD:
            heads = sorted(n for a in algorithms.ALGORITHMS.values() if a.draft_model is DraftModel.HEAD
                           for n in (a.name, *a.aliases))
            raise ValueError(f"EagleProposer: algorithm must be one of {heads}, got {algorithm!r}")
        self.algorithm = entry.name
        model, config = load_draft_head(draft_path, target_path, engine_config, self.algorithm, token_map)
        self.runner = ModelRunner(None, engine_config, config, model=model)
        self.model = model
        self.feature_size: int = model.feature_size  # F of every features tensor this proposer accepts
        target_layers = ModelConfig.from_pretrained(target_path).num_layers
        # What the target must capture: aux layers (EAGLE-3) or None = the final-norm hidden state (EAGLE).
        self.target_capture_layers: list[int] | None = (
            eagle3_capture_layers(target_layers, eagle3_aux_layer_ids(read_config(draft_path)))
            if entry.target_features is TargetFeatures.AUX_LAYERS else None
        )
        self.max_context_len = config.max_position_embeddings
        self._feats: dict[str, torch.Tensor] = {}  # raw target features for draft positions [feat_start, C-1)
        self._feat_start: dict[str, int] = {}

    def memory(self) -> tuple[int, int]:
        return self.runner.num_free_tokens(), self.runner.num_total_tokens()

    # ---- committed-state hooks -------------------------------------------------------------------------------------
    def _on_prefill(self, seq_id: str) -> None:
        self.runner.add_seq(seq_id)
        self._feats[seq_id] = torch.empty(0, self.feature_size)
        self._feat_start[seq_id] = 0

    def _on_rollback(self, seq_id: str, kept_len: int) -> None:
        # Tokens from index kept_len changed, so KV positions >= kept_len - 1 (which hold t_{p+1}) are stale; the
        # features f_p of p < kept_len still hold, and the one at kept_len - 1 is resent as row 0 of the new ones.
        pos = max(kept_len - 1, 0)
        if self.runner.kv_len(seq_id) > pos:
            self.runner.truncate(seq_id, pos)
        start = self._feat_start[seq_id]
        keep = max(0, pos - start)
        self._feats[seq_id] = self._feats[seq_id][:keep]
        if keep == 0:
            self._feat_start[seq_id] = pos

    def _on_features(self, seq_id: str, features: torch.Tensor) -> None:
        if features.shape[1] != self.feature_size:
            raise ValueError(f"features of width {features.shape[1]}, this {self.algorithm} head takes "
                             f"{self.feature_size}")
        committed_len = len(self._tokens[seq_id])
        if committed_len - 1 - features.shape[0] < 0:  # the first committed token has no predecessor
            features = features[1:]
        feats = self._feats[seq_id]
        self._feats[seq_id] = torch.cat([feats.to(features.device, features.dtype), features])
        if self._feat_start[seq_id] + self._feats[seq_id].shape[0] != committed_len - 1:
            raise RuntimeError(f"seq {seq_id!r}: features do not line up with the committed tokens")

    def _on_release(self, seq_id: str) -> None:
        if self.runner.has_seq(seq_id):
            self.runner.free_seq(seq_id)
        self._feats.pop(seq_id, None)
        self._feat_start.pop(seq_id, None)

    # ---- drafting --------------------------------------------------------------------------------------------------
    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        trees: dict[str, DraftTree] = {}
        # Too close to the context limit, out of KV, or no root feature yet: no proposal, the target decodes alone.
        active = [inp for inp in inputs if self._fits(inp)]
        static = self._draft_static(active)
        if static is not None:
            return [static.get(inp.seq_id, DraftTree([], [])) for inp in inputs]
        roots = self._catch_up(active)
        groups: dict[SpecShape, list[ProposeInput]] = defaultdict(list)
        for inp in active:
            groups[inp.spec].append(inp)
        for spec, group in groups.items():
            logits = torch.stack([roots[inp.seq_id][0] for inp in group])  # (b, draft_vocab)
            hidden = torch.stack([roots[inp.seq_id][1] for inp in group])  # (b, H)
            for inp, tree in zip(group, self._expand(group, spec, logits, hidden)):
                trees[inp.seq_id] = tree
        for inp in active:  # drop the speculative nodes' KV; committed positions [0, C-1) stay
            self.runner.truncate(inp.seq_id, inp.committed_len - 1)
        return [trees.get(inp.seq_id, DraftTree([], [])) for inp in inputs]

    def _draft_static(self, inputs: list[ProposeInput]) -> dict[str, DraftTree] | None:
        """The whole Propose as one static device step (runtime/speculative/draft_step.py) when one was enabled for
        this shape and every sequence's catch-up fits it; None = draft eagerly."""
        step = self._static_step_for(inputs)
        if step is None:
            return None
        # The catch-up re-runs at least the root's position C-2 (its output starts the tree): KV [first, C-1).
        plans = [(inp, min(self.runner.kv_len(inp.seq_id), inp.committed_len - 2), inp.committed_len - 1)
                 for inp in inputs]
        for inp, first, _ in plans:
            if first < self._feat_start[inp.seq_id]:
                raise RuntimeError(f"seq {inp.seq_id!r}: the feature of position {first} was dropped")
        if not self._reserve_static(step, plans):
            return None
        bm = self.runner.block_manager
        items = []
        for inp, first, _ in plans:
            seq_id, end = inp.seq_id, inp.committed_len - 1
            rows = self._feats[seq_id][first - self._feat_start[seq_id]:]
            items.append(CatchUp(self._tokens[seq_id][first + 1:end + 1], first, bm.slots(seq_id, first, end),
                                 bm.block_table(seq_id), rows))
        trees = step.propose(items)
        for inp, _, _ in plans:  # the catch-up is committed, the tree nodes were scratch
            self.runner.written(inp.seq_id, inp.committed_len - 1)
            self._feats[inp.seq_id] = self._feats[inp.seq_id][-1:]
            self._feat_start[inp.seq_id] = inp.committed_len - 2
        return {inp.seq_id: tree for (inp, _, _), tree in zip(plans, trees)}

    def _fits(self, inp: ProposeInput) -> bool:
        spec, committed_len = inp.spec, inp.committed_len
        if spec.num_steps < 1 or spec.num_draft_tokens < 2 or committed_len < 2:
            return False
        if committed_len - 1 + spec.num_steps > self.max_context_len:
            return False
        kv_len = self.runner.kv_len(inp.seq_id)
        need = committed_len - kv_len + spec.num_steps * spec.topk + 2 * self.runner.block_manager.block_size
        return need <= self.runner.num_free_tokens()

    def _catch_up(self, inputs: list[ProposeInput]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Run the draft over committed positions it has not seen (at least the root's, C-2, whose output starts the
        draft); returns per sequence (logits (draft_vocab,), recurrent hidden (H,)) at position C-2."""
        if not inputs:
            return {}
        plans = []
        for inp in inputs:
            seq_id, committed_len = inp.seq_id, inp.committed_len
            first = min(self.runner.kv_len(seq_id), committed_len - 2)
            start = self._feat_start[seq_id]
            if first < start:
                raise RuntimeError(f"seq {seq_id!r}: the feature of position {first} was dropped")
            if first < self.runner.kv_len(seq_id):
                self.runner.truncate(seq_id, first)
            rows = self._feats[seq_id][first - start:]  # (C-1-first, F): features of positions first..C-2
            plans.append((seq_id, self._tokens[seq_id][first + 1 : committed_len], rows))
        device, dtype = self.runner.device, self.runner.dtype
        raw = torch.cat([rows.to(device, dtype) for _, _, rows in plans])
        projected = self.model.project_features(raw).split([len(rows) for _, _, rows in plans])  # (T_i, H) each
        forwards = [
            SeqForward(seq_id, tokens, logits="last", capture_hidden=True, input_features=feats)
            for (seq_id, tokens, _), feats in zip(plans, projected)
        ]
        out = forward_chunked(self.runner, forwards, self.runner.engine_config.chunked_prefill_size)
        for inp in inputs:  # keep only f_{C-2}: enough to re-run the root's position if nothing new arrives
            self._feats[inp.seq_id] = self._feats[inp.seq_id][-1:]
            self._feat_start[inp.seq_id] = inp.committed_len - 2
        return {f.seq_id: (logits[-1], hidden[-1]) for f, logits, hidden in zip(forwards, out.logits, out.hidden)}

    def _expand(
        self, group: list[ProposeInput], spec: SpecShape, root_logits: torch.Tensor, root_hidden: torch.Tensor
    ) -> list[DraftTree]:
        """Beam expansion: the nodes of step s (depth s+1 below the root) sit at draft position C-1+s, take their
        parent's recurrent hidden as feature, and attend to the prefix plus their region ancestors."""
        b, k = len(group), spec.topk
        builder = BeamTreeBuilder(b, spec.num_steps, k, spec.num_draft_tokens)
        nodes = builder.first(torch.log_softmax(root_logits.float(), dim=-1))
        parent_hidden = root_hidden.unsqueeze(1).expand(b, k, -1)  # (b, k, H): the root is every step-0 parent
        for step in range(1, spec.num_steps):
            s = step - 1  # the step whose nodes are forwarded now
            ranks = nodes.parents - (s - 1) * k if s > 0 else torch.zeros_like(nodes.parents)  # (b, k)
            feats = parent_hidden.gather(1, ranks.to(parent_hidden.device).unsqueeze(-1).expand(
                -1, -1, parent_hidden.shape[-1]))  # (b, k, H)
            tokens, parents = host_rows(self._to_target(nodes.tokens), nodes.parents)  # one readback per step
            forwards = [
                SeqForward(inp.seq_id, tokens[i], positions=[inp.committed_len - 1 + s] * k,
                           parents=parents[i], logits="all", capture_hidden=True, input_features=feats[i])
                for i, inp in enumerate(group)
            ]
            out = self.runner.forward(forwards)
            logprobs = torch.log_softmax(torch.stack(out.logits).float(), dim=-1)  # (b, k, draft_vocab)
            parent_hidden = torch.stack(out.hidden)  # (b, k, H), beam-rank order
            nodes = builder.next(logprobs)
        trees = builder.finalize()
        ids = torch.tensor([t for tree in trees for t in tree.token_ids], dtype=torch.int64)
        flat = self._to_target(ids).tolist()
        out, start = [], 0
        for tree in trees:  # one mapping + readback for the whole batch
            out.append(DraftTree(flat[start:start + len(tree)], tree.parents))
            start += len(tree)
        return out

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target ids (FR-Spec hot ids / EAGLE-3 d2t offsets applied), on the ids' device;
        identity without a mapping."""
        mapping = self.model.draft_to_target
        if mapping is None:
            return draft_ids
        return mapping[draft_ids.to(mapping.device)]


def build(build) -> tuple[EagleProposer, str]:
    """Registry factory (core/algorithms.py): the EAGLE / EAGLE-3 head of --speculative-draft-model-path.
    build: tandem.services.DraftBuild."""
    args = build.args
    path = str(args.speculative_draft_model_path)
    engine_config = build.engine_config()
    build.loading(path, engine_config)
    return EagleProposer(build.target_path, path, engine_config, args.speculative_algorithm,
                         token_map=args.speculative_token_map), path
