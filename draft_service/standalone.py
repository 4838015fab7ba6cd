"""STANDALONE proposer: a small causal LM with the target's tokenizer drafts a chain (topk=1) or a top-k tree.

Per Propose: catch the draft KV up with the committed tokens (one batched chain forward), then expand the tree
step by step with BeamTreeBuilder (one batched tree forward per step), then roll the draft KV back to the committed
length. The draft's KV for committed tokens is reused across steps; only speculative nodes are thrown away.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from core.steps import ProposeInput, SpecShape
from core.types import DraftTree
from draft_service.proposer import Proposer
from runtime.chunked import forward_chunked
from runtime.model_runner import ModelRunner, SeqForward
from runtime.speculative.draft_step import CatchUp
from runtime.speculative.tree import BeamTreeBuilder, host_rows


class StandaloneProposer(Proposer):
    algorithm = "STANDALONE"

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        self.max_context_len = runner.model_config.max_position_embeddings

    def memory(self) -> tuple[int, int]:
        return self.runner.num_free_tokens(), self.runner.num_total_tokens()

    def _on_prefill(self, seq_id: str) -> None:
        # With the runner's prefix cache, the KV of a cached prompt prefix is reused (the last token is always run).
        self.runner.add_seq(seq_id, self._tokens[seq_id][:-1])

    def _on_rollback(self, seq_id: str, kept_len: int) -> None:
        if self.runner.kv_len(seq_id) > kept_len:
            self.runner.truncate(seq_id, kept_len)

    def _on_release(self, seq_id: str) -> None:
        if self.runner.has_seq(seq_id):
            self.runner.free_seq(seq_id)

    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        trees: dict[str, DraftTree] = {}
        # Sequences too close to the context limit (or out of KV) get no proposal: the target decodes alone.
        active = [inp for inp in inputs if self._fits(inp)]
        static = self._draft_static(active)
        if static is not None:
            return [static.get(inp.seq_id, DraftTree([], [])) for inp in inputs]
        last_logits = self._catch_up(active)
        groups: dict[SpecShape, list[ProposeInput]] = defaultdict(list)
        for inp in active:
            groups[inp.spec].append(inp)
        for spec, group in groups.items():
            first = torch.stack([last_logits[inp.seq_id] for inp in group])  # (b, vocab)
            for inp, tree in zip(group, self._expand(group, spec, first)):
                trees[inp.seq_id] = tree
        for inp in active:  # drop the speculative nodes' KV; committed KV stays for the next step
            self.runner.truncate(inp.seq_id, inp.committed_len)
        return [trees.get(inp.seq_id, DraftTree([], [])) for inp in inputs]

    def _draft_static(self, inputs: list[ProposeInput]) -> dict[str, DraftTree] | None:
        """The whole Propose as one static device step (runtime/speculative/draft_step.py) when one was enabled for
        this shape and every sequence's catch-up fits it; None = draft eagerly."""
        step = self._static_step_for(inputs)
        if step is None:
            return None
        # The last committed token is always re-run (its logits start the tree): KV [start, C).
        plans = [(inp, min(self.runner.kv_len(inp.seq_id), inp.committed_len - 1), inp.committed_len)
                 for inp in inputs]
        if not self._reserve_static(step, plans):
            return None
        bm = self.runner.block_manager
        items = [CatchUp(self._tokens[inp.seq_id][start:inp.committed_len], start,
                         bm.slots(inp.seq_id, start, inp.committed_len), bm.block_table(inp.seq_id))
                 for inp, start, _ in plans]
        trees = step.propose(items)
        for inp, _, _ in plans:  # the catch-up is committed, the tree nodes were scratch
            self.runner.written(inp.seq_id, inp.committed_len)
            self.runner.cache_prefix(inp.seq_id, self._tokens[inp.seq_id])
        return {inp.seq_id: tree for (inp, _, _), tree in zip(plans, trees)}

    def _guess_next(self, inputs: list[ProposeInput]) -> dict[str, int]:
        """Argmax of the draft after the guessed tail: its guess of the target's bonus token."""
        active = [inp for inp in inputs if self._fits(inp, extra=1)]
        rows = self._catch_up(active)
        if not rows:
            return {}
        guesses = torch.stack(list(rows.values())).argmax(dim=-1).tolist()  # one readback for the batch
        return dict(zip(rows, guesses))

    def _fits(self, inp: ProposeInput, extra: int = 0) -> bool:
        spec = inp.spec
        if spec.num_steps < 1 or spec.num_draft_tokens < 2:
            return False
        if inp.committed_len + extra + spec.num_steps >= self.max_context_len:
            return False
        kv_len = self.runner.kv_len(inp.seq_id)
        need = (inp.committed_len + extra - kv_len + spec.num_steps * spec.topk
                + 2 * self.runner.block_manager.block_size)
        return need <= self.runner.num_free_tokens()

    def _catch_up(self, inputs: list[ProposeInput]) -> dict[str, torch.Tensor]:
        """Forward the committed tokens the draft has not seen; returns the logits after the last one."""
        forwards = []
        for inp in inputs:
            tokens = self._tokens[inp.seq_id]
            kv_len = self.runner.kv_len(inp.seq_id)
            if kv_len == len(tokens):  # the last token must be re-run to get its logits
                self.runner.truncate(inp.seq_id, kv_len - 1)
                kv_len -= 1
            forwards.append(SeqForward(inp.seq_id, tokens[kv_len:], logits="last"))
        if not forwards:
            return {}
        out = forward_chunked(self.runner, forwards, self.runner.engine_config.chunked_prefill_size)
        for f in forwards:  # full blocks of committed (or guessed) tokens become reusable; no-op without the cache
            self.runner.cache_prefix(f.seq_id, self._tokens[f.seq_id])
        return {f.seq_id: rows[-1] for f, rows in zip(forwards, out.logits)}

    def _expand(self, group: list[ProposeInput], spec: SpecShape, first: torch.Tensor) -> list[DraftTree]:
        builder = BeamTreeBuilder(len(group), spec.num_steps, spec.topk, spec.num_draft_tokens)
        nodes = builder.first(torch.log_softmax(first.float(), dim=-1))
        for step in range(1, spec.num_steps):
            # Beam nodes of step s sit at depth s+1 after the root, i.e. position committed_len + s.
            tokens, parents = host_rows(nodes.tokens, nodes.parents)  # one readback per step, not one per seq
            forwards = [
                SeqForward(inp.seq_id, tokens[b], positions=[inp.committed_len + step - 1] * spec.topk,
                           parents=parents[b], logits="all")
                for b, inp in enumerate(group)
            ]
            out = self.runner.forward(forwards)
            logprobs = torch.log_softmax(torch.stack(out.logits).float(), dim=-1)  # (b, topk, vocab)
            nodes = builder.next(logprobs)
        return builder.finalize()



def build(build) -> tuple[StandaloneProposer, str]:
    """Registry factory (core/algorithms.py): a small LM from --speculative-draft-model-path (default: the bundled
    demo draft). build: tandem.services.DraftBuild."""
    path = str(build.draft_path)
    # A plain LM's KV depends on the tokens alone, so the draft shares prompt prefixes too (EAGLE's depends on
    # target features: no cache there).
    config = dataclasses.replace(build.engine_config(),
                                 enable_prefix_cache=not getattr(build.args, "disable_radix_cache", False))
    return StandaloneProposer(build.runner(path, config)), path
