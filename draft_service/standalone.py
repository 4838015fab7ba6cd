"""STANDALONE proposer: a small causal LM with the target's tokenizer drafts a chain (topk=1) or a top-k tree.

Per Propose (the ModelDrafter skeleton): catch the draft KV up with the committed tokens (one batched chain forward),
then expand the tree step by step with BeamTreeBuilder (one batched tree forward per step), then roll the draft KV
back to the committed length. The draft's KV for committed tokens is reused across steps; only speculative nodes
are thrown away.
"""
from __future__ import annotations

import dataclasses

import torch

from core.steps import ProposeInput, SpecShape
from core.types import DraftTree
from draft_service.drafter import ModelDrafter
from runtime.chunked import forward_chunked
from runtime.model_runner import ModelRunner, SeqForward
from runtime.speculative.tree import BeamTreeBuilder, host_rows


class StandaloneProposer(ModelDrafter):
    algorithm = "STANDALONE"
    kv_lag = 0  # a plain LM: KV position p holds committed token p

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        self.max_context_len = runner.model_config.max_position_embeddings

    def _on_prefill(self, seq_id: str) -> None:
        # With the runner's prefix cache, the KV of a cached prompt prefix is reused (the last token is always run).
        self.runner.add_seq(seq_id, self._tokens[seq_id][:-1])

    def _on_rollback(self, seq_id: str, kept_len: int) -> None:
        if self.runner.kv_len(seq_id) > kept_len:
            self.runner.truncate(seq_id, kept_len)

    def _caught_up(self, inp: ProposeInput) -> None:
        # Full blocks of committed tokens become reusable (no-op without the prefix cache).
        self.runner.cache_prefix(inp.seq_id, self._tokens[inp.seq_id])

    chainable = True

    def _chain_committed(self, seq_id: str, last_feature) -> None:
        self.runner.cache_prefix(seq_id, self._tokens[seq_id])

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

    def _expand(self, group: list[ProposeInput], spec: SpecShape, roots: list[torch.Tensor]) -> list[DraftTree]:
        """roots: per sequence, the draft's logits (vocab,) after its last committed token."""
        first = torch.stack(roots)  # (b, vocab)
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
