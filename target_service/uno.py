"""UNO's draft role inside the target pod (sglang_spec.md §7.4): a Proposer served as the pod's DraftService, whose
Propose runs the target engine's draft pass (`TargetEngine.self_draft`: the target's own layers, the LoRA on the
draft rows only) and shapes its rows into a chain (linear mode, topk 1) or a best-first tree (tree mode, topk K > 1)
rooted at the clean root (runtime/speculative/uno.py).

The gateway's loop does not change: it sends Propose, then Verify, to the pod holding the sequence. The proposer
mirrors the committed tokens like every proposer; the engine's sequence is the truth, and a sequence the engine cannot
draft for gets an empty tree (its Verify is a plain decode step).
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from core import algorithms
from core.steps import ProposeInput
from draft_service.proposer import Proposer
from runtime.lora import apply_adapter, load_adapter
from core.types import DraftTree
from runtime.speculative.uno import draft_chain, draft_trees, greedy_chains
from target_service.engine import TargetEngine


class UnoProposer(Proposer):
    algorithm = "UNO"

    def __init__(self, engine: TargetEngine) -> None:
        super().__init__()
        if not engine.draft_lora:
            raise ValueError("UNO needs the target engine's draft LoRA (target_service.uno.attach_adapter)")
        self.engine = engine
        self.runner = engine.runner  # its device is the target's: the gateway never splits a batch across the two

    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        requests = []
        for inp in inputs:
            spec = inp.spec
            # Linear: F = num_draft_tokens. Tree: F = num_steps + 1 rows, Q = num_draft_tokens nodes.
            width = spec.num_draft_tokens if spec.topk == 1 else spec.num_steps + 1
            requests.append((inp.seq_id, inp.committed_len, width))
        trees: list[DraftTree] = [DraftTree([], [])] * len(inputs)  # a sequence not drafted: a plain decode step
        # Greedy chains together (one readback), trees per shape together (one readback each), sampled chains alone
        # (each draws from its sequence's own stream).
        chains, shaped = [], defaultdict(list)
        for i, (inp, drafted) in enumerate(zip(inputs, self.engine.self_draft(requests))):
            if drafted is None:
                continue
            sampling = drafted.seq.sampling
            if inp.spec.topk > 1:
                shaped[inp.spec.topk, inp.spec.num_draft_tokens].append((i, drafted))
            elif sampling.is_greedy:
                chains.append((i, drafted))
            else:
                trees[i] = draft_chain(drafted.root_token_id, drafted.draft_logits, sampling, drafted.seq.generator)
        for (i, _), tree in zip(chains, greedy_chains([d.root_token_id for _, d in chains],
                                                      [d.draft_logits for _, d in chains])):
            trees[i] = tree
        for (topk, num_nodes), group in shaped.items():
            temps = [0.0 if d.seq.sampling.is_greedy else d.seq.sampling.temperature for _, d in group]
            for (i, _), tree in zip(group, draft_trees([d.root_token_id for _, d in group],
                                                       [d.draft_logits for _, d in group], topk, num_nodes, temps)):
                trees[i] = tree
        return trees

    def memory(self) -> tuple[int, int]:
        return self.runner.num_free_tokens(), self.runner.num_total_tokens()


def attach_adapter(engine: TargetEngine, lora_path: str) -> None:
    """Load the PEFT adapter and wrap the target's projections; plain forwards stay the base model's."""
    engine.draft_lora = apply_adapter(engine.runner.model, load_adapter(lora_path))


def build(engine: TargetEngine, args: argparse.Namespace) -> UnoProposer:
    """The UNO registry entry's factory (drafts_on_target): the adapter of --uno-lora-path on this engine."""
    entry = algorithms.get(args.speculative_algorithm)
    path = getattr(args, "uno_lora_path", None)
    if not path:
        raise SystemExit(f"error: {entry.name} requires --uno-lora-path.")
    try:
        attach_adapter(engine, path)
    except ValueError as exc:
        raise SystemExit(f"error: --uno-lora-path {path}: {exc}") from None
    return UnoProposer(engine)
