"""Greedy decode steps back to back on CUDA graphs with the next input token fed on the device — the overlap idea of
SGLang's scheduler applied to plain decoding: the host builds and enqueues step j+1 (KV slots, block tables,
positions: all known in advance) while the GPU still runs step j, each replay takes its input token from the previous
replay's argmax by a device copy, and the host reads every step's tokens back once at the end. Used by TargetEngine
for `--num-continuous-decode-steps` when every sequence is greedy and no features are asked for.

Works on any runner whose graph runner captured decode graphs (CPU tests use the fake graphs of tests/graphs).
Nothing here samples or checks stops: the caller cuts the run at a stop token or length and drops the rest.
"""
from __future__ import annotations

import torch

from runtime.forward_batch import ForwardMode
from runtime.model_runner import ModelRunner, SeqForward


def can_pipeline(runner: ModelRunner, seq_ids: list[str]) -> bool:
    """Decode graphs exist and every sequence is in plain decode state (no open tree region); not under TP (the
    other ranks mirror host-fed forwards only)."""
    if runner.graph_runner is None or not runner.use_cuda_graph or runner._mirror is not None:
        return False
    return all(runner.has_seq(s) and runner.region_start(s) is None for s in seq_ids)


@torch.inference_mode()
def greedy_decode_steps(runner: ModelRunner, seq_ids: list[str], first_tokens: list[int],
                        num_steps: int) -> list[list[int]]:
    """Per sequence, the greedy tokens of up to num_steps decode steps: step 0 feeds first_tokens, step j the token
    step j-1 produced. Each sequence's KV gains one token per step run. Returns fewer steps (possibly none) when a
    step cannot replay a graph (e.g. a block table outgrew the captured width): the caller continues another way."""
    if len(seq_ids) != len(first_tokens) or num_steps < 1:
        raise ValueError("one first token per sequence and num_steps >= 1")
    b = len(seq_ids)
    produced: list[torch.Tensor] = []
    prev: torch.Tensor | None = None
    for step in range(num_steps):
        # Placeholder ids after the first step: the device copy below overwrites them before the replay.
        batch = [SeqForward(s, [t if step == 0 else 0]) for s, t in zip(seq_ids, first_tokens)]
        runner._validate(batch)
        runner._reserve_kv(batch)
        fb, _, key = runner._build_forward_batch(batch, ForwardMode.DECODE, allow_graph=True)
        if key is None:
            break  # KV capacity reserved above stays with the sequences; nothing ran for this step
        gr = runner.graph_runner
        if prev is not None:
            gr.inputs[0, :b].copy_(prev, non_blocking=True)  # stream-ordered after load_inputs' host copy
        outputs = gr.replay(key, fb)
        prev = outputs.argmax[:b].clone()  # the next replay overwrites the static output
        produced.append(prev)
        for s in seq_ids:
            runner._seqs[s].kv_len += 1
    if not produced:
        return [[] for _ in seq_ids]
    return torch.stack(produced, dim=1).tolist()  # the one readback: (B, steps run)
