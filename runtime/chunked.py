"""Chunked chain appends: `forward_chunked` runs a batch of chain appends (prompts, a draft catching up on committed
tokens) as forwards of at most `limit` tokens — a long append split over several, short ones sharing one — and
returns what one forward would have: per sequence the logits rows it asked for ("last", "all" or "none"), the
captured hidden rows and the aux rows, in token order. Bounds activation memory on long prompts
(`--chunked-prefill-size`); the memory profile's warm-up prefill uses the same limit.
"""
from __future__ import annotations

import torch

from runtime.model_runner import ForwardOutput, ModelRunner, SeqForward


def plan_chunks(lengths: list[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """Passes of (sequence index, start, end) token ranges, each pass holding at most `limit` tokens and each
    sequence at most once per pass, ranges of a sequence in order."""
    passes: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for index, length in enumerate(lengths):
        start = 0
        while start < length:
            if used == limit:
                passes.append([])
                used = 0
            end = start + min(limit - used, length - start)
            passes[-1].append((index, start, end))
            used += end - start
            start = end
    return [p for p in passes if p]


def forward_chunked(runner: ModelRunner, batch: list[SeqForward], limit: int | None,
                    capture_layers: list[int] | None = None, outputs: str = "logits") -> ForwardOutput:
    """runner.forward(batch, outputs=...) in passes of at most `limit` tokens (None or <= 0: one forward). Chain
    appends only."""
    total = sum(len(sf.token_ids) for sf in batch)
    if not limit or limit <= 0 or total <= limit:
        return runner.forward(batch, capture_layers=capture_layers, outputs=outputs)
    if any(sf.parents is not None or sf.positions is not None for sf in batch):
        raise ValueError("chunked forwards take chain appends with default positions only")
    logits: list[list[torch.Tensor]] = [[] for _ in batch]
    hidden: list[list[torch.Tensor]] = [[] for _ in batch]
    aux: list[list[torch.Tensor]] = [[] for _ in batch]
    argmax: list[list[int]] = [[] for _ in batch]
    for chunk in plan_chunks([len(sf.token_ids) for sf in batch], limit):
        pieces = []
        for index, start, end in chunk:
            sf = batch[index]
            last = end == len(sf.token_ids)
            mode = sf.logits if sf.logits == "all" or last else "none"
            feats = None if sf.input_features is None else sf.input_features[start:end]
            pieces.append(SeqForward(sf.seq_id, sf.token_ids[start:end], logits=mode,
                                     capture_hidden=sf.capture_hidden, input_features=feats))
        out = runner.forward(pieces, capture_layers=capture_layers, outputs=outputs)
        for k, ((index, _, _), piece, rows, hid, ax) in enumerate(zip(chunk, pieces, out.logits, out.hidden,
                                                                    out.features)):
            if piece.logits != "none":
                logits[index].append(rows)
                if out.argmax is not None:
                    argmax[index] += out.argmax[k]
            if hid is not None:
                hidden[index].append(hid)
            if ax is not None:
                aux[index].append(ax)
    cat = lambda parts: torch.cat(parts) if parts else None  # noqa: E731
    empty = torch.empty(0, runner.model_config.vocab_size, device=runner.device)
    return ForwardOutput(logits=[cat(parts) if parts else empty for parts in logits],
                         hidden=[cat(parts) for parts in hidden], features=[cat(parts) for parts in aux],
                         argmax=argmax if outputs != "logits" else None)
