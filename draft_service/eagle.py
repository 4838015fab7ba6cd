"""EAGLE-family proposer (EAGLE, alias NEXTN, and EAGLE3): a feature-based draft head over its own paged KV, fed the
target's features of committed tokens, drafting a chain (topk=1) or a top-k beam tree with faithful tree masks.

Feature protocol (one-token shift): draft KV position p holds (token t_{p+1}, target feature f_p), so with C
committed tokens the draft KV covers positions [0, C-1) and its output at C-2 (input: the root t_{C-1} and f_{C-2})
gives the first draft step. Deeper steps feed the draft's own recurrent hidden instead of the unknown target feature.
With --speculative-use-rejection-sampling, chains (topk 1) of sampled requests are sampled instead of taken greedily:
each draft token x ~ q, q = the request's temperature/top-k/top-p over the head's logits (mapped into the target
vocabulary), and the tree carries every q so that the target can verify by p/q rejection.

Multi-layer EAGLE (--enable-multi-layer-eagle, a target with K MTP layers): draft step s runs MTP layer s, all of
them at the same positions (DeepSeek's chain): layer s at position p takes (t_{p+s+1}, layer s-1's output at p), so
its KV at p is committed only while t_{p+s+1} is, i.e. on [0, kv_len - s). Each Propose runs every layer over one
window [kv_len - (S-1), C-1) (SGLang's draft extend): layer s's ids are the window's committed tokens shifted left by
s with the chain's first s draft tokens after them, its features layer s-1's outputs; the root's row of layer s
gives draft token s+1. Every layer's stale positions are rewritten before they are read. Knows nothing about how
the target produced the features or what gets committed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from core import algorithms
from core.algorithms import DraftModel, TargetFeatures
from core.steps import ProposeInput, SpecShape
from core.types import DraftTree, SamplingParams
from draft_service.drafter import ModelDrafter
from draft_service.proposer import StaleSequence
from runtime.chunked import forward_chunked
from runtime.config import EngineConfig, ModelConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.sampling import process_logits, sample_per_row
from runtime.models.eagle import load_draft_head, read_config
from runtime.models.eagle3 import eagle3_aux_layer_ids, eagle3_capture_layers
from runtime.speculative.tree import BeamTreeBuilder, host_rows



class EagleProposer(ModelDrafter):
    """Feature-based drafting. Sequences are prefilled lazily: features are kept until the next Propose runs them."""

    needs_features = True
    kv_lag = 1  # draft KV position p holds (t_{p+1}, f_p): the committed KV is [0, C-1)

    def __init__(
        self,
        target_path: str,
        draft_path: str,
        engine_config: EngineConfig,
        algorithm: str = "EAGLE",
        token_map: str | Sequence[int] | torch.Tensor | None = None,
        use_rejection_sampling: bool = False,
        multi_layer_steps: int = 0,
    ) -> None:
        """target_path: the target checkpoint (embedding and lm_head are shared from it); draft_path: the published
        EAGLE / EAGLE-3 head; token_map: FR-Spec hot target ids (EAGLE only), a torch.load-able file or the ids;
        use_rejection_sampling: sample the chains of sampled requests and return their distributions;
        multi_layer_steps: multi-layer EAGLE over the draft checkpoint's first this many MTP layers, one per draft
        step (chains of exactly this many steps; 0 = off: one MTP layer or head, autoregressively)."""
        super().__init__()
        entry = algorithms.find(algorithm)
        if entry is None or entry.draft_model is not DraftModel.HEAD:
            heads = sorted(n for a in algorithms.ALGORITHMS.values() if a.draft_model is DraftModel.HEAD
                           for n in (a.name, *a.aliases))
            raise ValueError(f"EagleProposer: algorithm must be one of {heads}, got {algorithm!r}")
        self.algorithm = entry.name
        self.multi_layer_steps = multi_layer_steps
        model, config = load_draft_head(draft_path, target_path, engine_config, self.algorithm, token_map,
                                        num_mtp_layers=max(1, multi_layer_steps))
        if multi_layer_steps:  # a decode graph replays the layer it was captured with: the static step is the graph
            engine_config = replace(engine_config, disable_cuda_graph=True)
        self.runner = ModelRunner(None, engine_config, config, model=model)
        self.model = model
        self.feature_size: int = model.feature_size  # F of every features tensor this proposer accepts
        target_config = ModelConfig.from_pretrained(target_path)
        target_layers = target_config.num_layers
        self.target_vocab_size = target_config.vocab_size
        self.use_rejection_sampling = use_rejection_sampling
        self._generators: dict[str, torch.Generator] = {}  # the draft's own random stream per sampled sequence
        # What the target must capture: aux layers (EAGLE-3) or None = the final-norm hidden state (EAGLE).
        self.target_capture_layers: list[int] | None = (
            eagle3_capture_layers(target_layers, eagle3_aux_layer_ids(read_config(draft_path)))
            if entry.target_features is TargetFeatures.AUX_LAYERS else None
        )
        self.max_context_len = config.max_position_embeddings
        self._feats: dict[str, torch.Tensor] = {}  # raw target features for draft positions [feat_start, C-1)
        self._feat_start: dict[str, int] = {}
        # Pre-drafts: draft positions whose feature is the head's own recurrent hidden (position -> (H,) on the
        # draft's device), standing in for target features of guessed tokens; their _feats rows are placeholders.
        self._own: dict[str, dict[int, torch.Tensor]] = {}
        # Features kept after a Propose: the window of the next one starts this many positions before C-1.
        self._feature_tail = max(1, multi_layer_steps)

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
        own = self._own.get(seq_id)
        if own:
            self._own[seq_id] = {p: row for p, row in own.items() if p < pos}
        start = self._feat_start[seq_id]
        keep = max(0, pos - start)
        self._feats[seq_id] = self._feats[seq_id][:keep]
        if keep == 0:
            self._feat_start[seq_id] = pos
        if self._window_start(seq_id, len(self._tokens[seq_id])) < self._feat_start[seq_id]:
            # Multi-layer: a rollback deeper than the kept features; the deeper layers' KV cannot be rebuilt.
            raise StaleSequence(f"seq {seq_id!r}: rolled back past the features the draft kept")

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
        super()._on_release(seq_id)
        self._feats.pop(seq_id, None)
        self._feat_start.pop(seq_id, None)
        self._own.pop(seq_id, None)
        self._generators.pop(seq_id, None)

    # ---- drafting: the ModelDrafter skeleton's hooks -----------------------------------------------------------------
    def _static_allowed(self, inputs: list[ProposeInput]) -> bool:
        return not any(self._samples(inp) for inp in inputs)  # sampled chains (rejection sampling) draft eagerly

    @property
    def _eager_catch_up_first(self) -> bool:
        return not self.multi_layer_steps

    def _draft_eager(self, inputs: list[ProposeInput]) -> dict[str, DraftTree]:
        if self.multi_layer_steps:
            return self._draft_layer_chain(inputs)
        return super()._draft_eager(inputs)

    def _catch_up_start(self, inp: ProposeInput) -> int:
        # The catch-up re-runs at least the root's position C-2 (its output starts the tree): KV [first, C-1).
        first = self._window_start(inp.seq_id, inp.committed_len)
        if first < self._feat_start[inp.seq_id]:
            raise RuntimeError(f"seq {inp.seq_id!r}: the feature of position {first} was dropped")
        return first

    def _catch_up_features(self, inp: ProposeInput, start: int, end: int) -> torch.Tensor:
        return self._feats[inp.seq_id][start - self._feat_start[inp.seq_id]:]  # (end - start, F)

    def _catch_up_own(self, inp: ProposeInput, start: int, end: int) -> dict[int, torch.Tensor] | None:
        own = self._own.get(inp.seq_id)
        if not own:
            return None
        return {p - start: row for p, row in own.items() if start <= p < end} or None

    def _caught_up(self, inp: ProposeInput) -> None:
        self._keep_feature_tail(inp)

    chainable = True

    def _chain_ready(self, seq_id: str) -> bool:
        # pre-drafted rows (own hiddens) and multi-layer windows are not chained
        return not self._own.get(seq_id) and not self.multi_layer_steps

    def _chain_committed(self, seq_id: str, last_feature) -> None:
        """The feature tail a static Propose keeps: f_{C-2}, the last kept row of the last verify."""
        self._feats[seq_id] = last_feature.reshape(1, -1)
        self._feat_start[seq_id] = len(self._tokens[seq_id]) - 2

    # ---- pre-drafts (overlapped drafting) -------------------------------------------------------------------------
    def _guess_next(self, inputs: list[ProposeInput]) -> dict[str, int]:
        """Pre-drafts: the committed tokens are caught up as usual; then the head runs over each sequence's guessed
        path (`_guess_tails`, tokens the target is still verifying) one position at a time, each fed the previous
        position's recurrent hidden where the target feature would be (as the tree steps do), and its top-1 after
        the path is the guessed bonus. Those hiddens stand in for the path's features (`_own`) until a rollback drops
        them. One readback for the batch. Multi-layer EAGLE and sampled chains do not pre-draft."""
        tails = {inp.seq_id: self._guess_tails.get(inp.seq_id, []) for inp in inputs}
        active = [inp for inp in inputs if tails[inp.seq_id] and not self.multi_layer_steps
                  and not self._samples(inp) and self._fits(replace(
                      inp, committed_len=inp.committed_len + len(tails[inp.seq_id]) + 1))]
        if not active:
            return {}
        roots = self._catch_up(active)  # KV [0, C-1); (logits, hidden) at the root's position C-2
        hidden = {seq_id: h.clone() for seq_id, (_, h) in roots.items()}  # kept past the next graph replay
        top = {}  # each sequence's head top-1 after its path (draft ids, on the device)
        for inp in active:  # own features of the path's positions C-1 .. C+k-1 start with the root's output
            self._own.setdefault(inp.seq_id, {})[inp.committed_len - 1] = hidden[inp.seq_id]
        for j in range(max(len(tails[inp.seq_id]) for inp in active)):
            group = [inp for inp in active if len(tails[inp.seq_id]) > j]
            forwards = [SeqForward(inp.seq_id, [tails[inp.seq_id][j]], logits="last", capture_hidden=True,
                                   input_features=hidden[inp.seq_id].unsqueeze(0)) for inp in group]
            out = self.runner.forward(forwards)  # appends position C-1+j (token p_{j+1}, the previous hidden)
            for inp, logits, h in zip(group, out.logits, out.hidden):
                hidden[inp.seq_id], top[inp.seq_id] = h[-1].clone(), logits[-1].argmax(dim=-1)
                self._own[inp.seq_id][inp.committed_len + j] = hidden[inp.seq_id]  # stands in for f of p_{j+1}
        guesses = self._to_target(torch.stack([top[inp.seq_id] for inp in active])).tolist()
        for inp in active:  # the path is now the sequence's (speculative) state, placeholders keep _feats aligned
            path = tails[inp.seq_id]
            self._tokens[inp.seq_id].extend(path)
            feats = self._feats[inp.seq_id]
            self._feats[inp.seq_id] = torch.cat([feats, feats.new_zeros(len(path) + 1, self.feature_size)])
        return {inp.seq_id: g for inp, g in zip(active, guesses)}

    def _new_static_step(self, spec: SpecShape, max_bs: int):
        if not self.multi_layer_steps:
            return super()._new_static_step(spec, max_bs)
        if spec.topk != 1 or spec.num_steps != self.multi_layer_steps:
            return None
        from runtime.speculative.draft_step import StaticMultiLayerDraftStep, StepShape

        # Window: S-1 re-run positions + up to S+1 newly committed tokens (accepted drafts + bonus).
        shape = StepShape(spec.num_steps, 1, spec.num_draft_tokens, catch_up=2 * spec.num_steps)
        return StaticMultiLayerDraftStep(self.runner, shape, max_bs, feature_head=True)

    def _window_start(self, seq_id: str, committed_len: int) -> int:
        """First draft position a Propose at committed length C re-runs: at least the root's, C-2; with S chained
        MTP layers S-1 earlier, where the deepest layer's committed KV ends (layer s's is [0, kv_len - s))."""
        kv_len = self.runner.kv_len(seq_id) if self.runner.has_seq(seq_id) else 0
        return max(0, min(kv_len, committed_len - 2) - (self._feature_tail - 1))

    def _keep_feature_tail(self, inp: ProposeInput) -> None:
        """After a Propose: keep the features the next one re-runs (the last S, or f_{C-2} alone)."""
        rows = self._feats[inp.seq_id][-self._feature_tail:]
        self._feats[inp.seq_id] = rows
        start = self._feat_start[inp.seq_id] = inp.committed_len - 1 - rows.shape[0]
        own = self._own.get(inp.seq_id)
        if own:  # no catch-up starts before the kept features: own hiddens there are never read again
            self._own[inp.seq_id] = {p: row for p, row in own.items() if p >= start}

    def _draft_layer_chain(self, inputs: list[ProposeInput]) -> dict[str, DraftTree]:
        """Multi-layer EAGLE, eagerly: MTP layer s over each sequence's window [W, C-1) for s = 0..S-1, one forward
        per layer for the batch (the runner rewinds to W between layers, keeping the blocks the others wrote)."""
        if not inputs:
            return {}
        runner, steps = self.runner, self.multi_layer_steps
        plans = []
        for inp in inputs:
            seq_id, committed_len = inp.seq_id, inp.committed_len
            first, start = self._window_start(seq_id, committed_len), self._feat_start[seq_id]
            if first < start:
                raise RuntimeError(f"seq {seq_id!r}: the feature of position {first} was dropped")
            if first < runner.kv_len(seq_id):
                runner.truncate(seq_id, first)
            plans.append((inp, first))
        ids = [self._tokens[inp.seq_id][first + 1:inp.committed_len] for inp, first in plans]  # layer 0's ids
        feats = [self.model.project_features(
            self._feats[inp.seq_id][first - self._feat_start[inp.seq_id]:].to(runner.device, runner.dtype))
            for inp, first in plans]  # (T_i, H): f_W..f_{C-2}
        sampled = [i for i, inp in enumerate(inputs) if self._samples(inp)]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in inputs]
        chains: list[list[int]] = [[] for _ in inputs]
        try:
            for s in range(steps):
                self.model.active_layer = s
                for inp, first in plans if s else ():
                    runner.rewind(inp.seq_id, first)
                forwards = [SeqForward(inp.seq_id, ids[i], logits="last", input_features=feats[i])
                            for i, (inp, _) in enumerate(plans)]
                out = forward_chunked(runner, forwards, runner.engine_config.chunked_prefill_size, capture_layers=[s])
                logits = torch.stack([rows[-1] for rows in out.logits])  # (b, V): the root's row, position C-2
                top = self._to_target(self._pick(inputs, sampled, logits, draft_probs).argmax(dim=-1)).tolist()
                feats = out.features  # layer s's outputs: the next layer's features
                for i, token in enumerate(top):
                    chains[i].append(token)
                    ids[i] = ids[i][1:] + [token]  # rotated left by one, the new draft token at the root's row
        finally:
            self.model.active_layer = 0
        for inp in inputs:
            self._keep_feature_tail(inp)
        return {inp.seq_id: DraftTree(chains[i], list(range(-1, steps - 1)),
                                      torch.stack(draft_probs[i]).float().cpu() if draft_probs[i] else None)
                for i, inp in enumerate(inputs)}

    def _samples(self, inp: ProposeInput) -> bool:
        """Whether this sequence's chain is sampled (p/q rejection sampling) rather than taken greedily."""
        return (self.use_rejection_sampling and inp.spec.topk == 1 and inp.sampling is not None
                and not inp.sampling.is_greedy)

    def _fits(self, inp: ProposeInput) -> bool:
        """Too close to the context limit, out of KV, or no root feature yet: no proposal. Multi-layer EAGLE drafts
        the served chain only (one MTP layer per step)."""
        spec, committed_len = inp.spec, inp.committed_len
        if spec.num_steps < 1 or spec.num_draft_tokens < 2 or committed_len < 2:
            return False
        if self.multi_layer_steps and (spec.topk != 1 or spec.num_steps != self.multi_layer_steps):
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
        projected = list(self.model.project_features(raw).split([len(rows) for _, _, rows in plans]))  # (T_i, H)
        for i, inp in enumerate(inputs):  # a pre-draft's guessed positions: the head's own hidden, as it is
            first = inp.committed_len - 1 - len(plans[i][2])
            own = self._catch_up_own(inp, first, inp.committed_len - 1)
            if own:
                projected[i] = projected[i].clone()
                for r, row in own.items():
                    projected[i][r] = row
        forwards = [
            SeqForward(seq_id, tokens, logits="last", capture_hidden=True, input_features=feats)
            for (seq_id, tokens, _), feats in zip(plans, projected)
        ]
        out = forward_chunked(self.runner, forwards, self.runner.engine_config.chunked_prefill_size)
        for inp in inputs:  # keep only f_{C-2}: enough to re-run the root's position if nothing new arrives
            self._keep_feature_tail(inp)
        return {f.seq_id: (logits[-1], hidden[-1]) for f, logits, hidden in zip(forwards, out.logits, out.hidden)}

    def _expand(self, group: list[ProposeInput], spec: SpecShape,
                roots: list[tuple[torch.Tensor, torch.Tensor]]) -> list[DraftTree]:
        """Beam expansion from each sequence's (logits, recurrent hidden) at the root: the nodes of step s (depth s+1
        below the root) sit at draft position C-1+s, take their parent's recurrent hidden as feature, and attend to
        the prefix plus their region ancestors."""
        root_logits = torch.stack([logits for logits, _ in roots])  # (b, draft_vocab)
        root_hidden = torch.stack([hidden for _, hidden in roots])  # (b, H)
        b, k = len(group), spec.topk
        builder = BeamTreeBuilder(b, spec.num_steps, k, spec.num_draft_tokens)
        sampled = [i for i, inp in enumerate(group) if self._samples(inp)]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in group]  # per sequence, q of each step (sampled only)
        nodes = builder.first(self._pick(group, sampled, root_logits, draft_probs))
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
            logits = torch.stack(out.logits)  # (b, k, draft_vocab)
            parent_hidden = torch.stack(out.hidden)  # (b, k, H), beam-rank order
            nodes = builder.next(self._pick(group, sampled, logits, draft_probs))
        trees = builder.finalize()
        ids = torch.tensor([t for tree in trees for t in tree.token_ids], dtype=torch.int64)
        flat = self._to_target(ids).tolist()
        out, start = [], 0
        for tree, probs in zip(trees, draft_probs):  # one mapping + readback for the whole batch
            # A sampled chain's node s was drawn at step s; its q travels with it (target vocabulary, float32).
            q = torch.stack(probs[:len(tree)]).float().cpu() if probs and len(tree) else None
            out.append(DraftTree(flat[start:start + len(tree)], tree.parents, q))
            start += len(tree)
        return out

    def _pick(self, group: list[ProposeInput], sampled: list[int], logits: torch.Tensor,
              draft_probs: list[list[torch.Tensor]]) -> torch.Tensor:
        """Log-probabilities the beam builder ranks: the head's log-softmax, except for sampled chains (topk 1),
        whose row is 0 at a token drawn from q and -inf elsewhere, so the builder takes exactly the sampled token.
        logits: (b, V_draft) or (b, 1, V_draft); q of each sampled row is appended to draft_probs."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if not sampled:
            return logprobs
        rows = logits.float().reshape(len(group), -1)[sampled]  # (s, V_draft): topk 1, one beam node per sequence
        params = [SamplingParams(temperature=group[i].sampling.temperature, top_p=group[i].sampling.top_p,
                                 top_k=group[i].sampling.top_k) for i in sampled]
        q = process_logits(rows, params)  # (s, V_draft): the request's temperature/top-k/top-p, no penalties
        tokens = sample_per_row(q, [self._generator(group[i]) for i in sampled])  # (s,)
        forced = torch.full_like(rows, -torch.inf).scatter_(1, tokens.unsqueeze(1), 0.0)
        logprobs = logprobs.clone()
        logprobs.view(len(group), -1)[sampled] = forced
        for j, i in enumerate(sampled):
            draft_probs[i].append(self._q_in_target_vocab(q[j]))
        return logprobs

    def _q_in_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """(V_draft,) -> (V_target,): an FR-Spec / d2t head samples only its hot tokens, so q is 0 elsewhere (still
        exactly the distribution the token was drawn from)."""
        out = torch.zeros(self.target_vocab_size, device=q.device, dtype=torch.float32)
        ids = torch.arange(q.shape[0], device=q.device)
        return out.index_add_(0, self._to_target(ids).to(q.device), q.float())

    def _generator(self, inp: ProposeInput) -> torch.Generator:
        """The draft's random stream of a sequence. A seeded request gets a stream of its own derived from the seed:
        the target seeds its coins with the seed itself, and a draft token drawn from the same stream as the coin
        that tests it would not be independent of it (the p/q rule needs that)."""
        gen = self._generators.get(inp.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.runner.device)
            if inp.sampling.seed is not None:
                gen.manual_seed((inp.sampling.seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % (1 << 63))
            else:
                gen.seed()
            self._generators[inp.seq_id] = gen
        return gen

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
    multi_layer = getattr(args, "enable_multi_layer_eagle", None)
    return EagleProposer(build.target_path, path, engine_config, args.speculative_algorithm,
                         token_map=args.speculative_token_map,
                         use_rejection_sampling=getattr(args, "speculative_use_rejection_sampling", False),
                         multi_layer_steps=args.speculative_num_steps if multi_layer else 0), path
