"""CUDA graphs of the model forward for decode-shaped (1 new token per sequence) and verify-shaped (num_draft_tokens
per sequence) batches: one graph per (batch-size bucket, tokens per sequence), captured once at start-up and
replayed with new contents in static buffers.

A batch of B sequences runs in the smallest captured bucket >= B; the extra sequences are padding that reads
block 0 and writes no KV (slot -1), and every op of the forward is row-independent, so padding can never change a
real row. Owns the static input buffers and the graphs; the attention backend owns the static metadata buffers.
Knows nothing about sequences' state: the ModelRunner decides what to run and reads the hidden states back.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from runtime.forward_batch import ForwardBatch, SeqAttention

if TYPE_CHECKING:
    from runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1..8, then 16, 24, 32, 48, 64, then every 16 to 128 and every 32 beyond, up to and including max_bs."""
    sizes = [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 48, 64]
    sizes += list(range(80, 129, 16)) + list(range(160, max(160, max_bs) + 1, 32))
    picked = [s for s in sizes if s <= max_bs]
    if max_bs > 0 and (not picked or picked[-1] != max_bs):
        picked.append(max_bs)
    return picked


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding num_seqs sequences, or None."""
    return next((s for s in sizes if s >= num_seqs), None)


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_bs: int, num_draft_tokens: int | None) -> None:
        self.runner = runner
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.query_lens = sorted({1, num_draft_tokens or 1})
        max_query_len = self.query_lens[-1]
        cfg, bm = runner.model_config, runner.block_manager
        self.block_size = bm.block_size
        # Block-table width of the graphs: the longest context a sequence can reach, bounded by the pool.
        max_context = min(cfg.max_position_embeddings + max_query_len, bm.num_blocks * bm.block_size)
        self.max_blocks = -(-max_context // bm.block_size)
        device = runner.device
        max_tokens = self.max_bs * max_query_len
        # Rows: input ids, positions, KV slots, logits rows; one host->device copy fills them all.
        self.inputs = torch.zeros(4, max_tokens, dtype=torch.int64, device=device)
        runner.attn_backend.init_graph_buffers(self.max_bs, max_query_len, self.max_blocks, device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    # ---- capture -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.runner.device)[0]
        # Largest first: later (smaller) graphs reuse the shared pool's blocks.
        for query_len in reversed(self.query_lens):
            for num_seqs in reversed(self.batch_sizes):
                self._capture_one(num_seqs, query_len)
        torch.cuda.synchronize(self.runner.device)
        used = free_before - torch.cuda.mem_get_info(self.runner.device)[0]
        logger.info("captured %d CUDA graphs (batch sizes %s x tokens per sequence %s) in %.1f s, %.2f GiB",
                    len(self.graphs), self.batch_sizes, self.query_lens, time.perf_counter() - start, used / (1 << 30))

    def _capture_one(self, num_seqs: int, query_len: int) -> None:
        runner = self.runner
        num_tokens = num_seqs * query_len
        self.inputs[:, :num_tokens] = 0
        self.inputs[2, :num_tokens] = -1  # padding writes no KV
        ids, positions, slots = self.inputs[0, :num_tokens], self.inputs[1, :num_tokens], self.inputs[2, :num_tokens]
        runner.attn_backend.load_graph_metadata(None, num_seqs, query_len, slots)
        for _ in range(2):  # warm-up: Triton compiles and cuBLAS picks its kernels outside the capture
            runner.model(ids, positions, runner.attn_backend, runner.kv_pool)
        torch.cuda.synchronize(runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = runner.model(ids, positions, runner.attn_backend, runner.kv_pool).hidden  # (num_tokens, H)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(num_seqs, query_len)] = (graph, hidden)

    # ---- replay ------------------------------------------------------------------------------------------------
    def key_for(self, seqs: list[SeqAttention]) -> tuple[int, int] | None:
        """(bucket, tokens per sequence) of the graph that can run these sequences, or None (run eager): every
        sequence adds the same captured number of tokens, a tree's tail fits the graph's mask width, the block
        table fits, and the batch fits a bucket."""
        query_len = seqs[0].query_len
        if query_len not in self.query_lens:
            return None
        for seq in seqs:
            if seq.query_len != query_len or len(seq.block_table) > self.max_blocks:
                return None
            if seq.tree_rows is not None and seq.tail_len > query_len:
                return None
        num_seqs = bucket_for(len(seqs), self.batch_sizes)
        return None if num_seqs is None else (num_seqs, query_len)

    def load_inputs(
        self, key: tuple[int, int], input_ids: list[int], positions: list[int], slot_mapping: list[int],
        logits_indices: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy the real tokens (padding rows: id 0, position 0, slot -1) into the static inputs; return views of
        (ids, positions, slots) over the padded batch and the logits rows."""
        num_seqs, query_len = key
        num_tokens = num_seqs * query_len
        pad = num_tokens - len(input_ids)
        host = torch.zeros(4, num_tokens, dtype=torch.int64)
        host[0, :len(input_ids)] = torch.tensor(input_ids)
        host[1, :len(positions)] = torch.tensor(positions)
        host[2] = torch.tensor(slot_mapping + [-1] * pad)
        host[3, :len(logits_indices)] = torch.tensor(logits_indices, dtype=torch.int64)
        self.inputs[:, :num_tokens].copy_(host.pin_memory(), non_blocking=True)
        return (self.inputs[0, :num_tokens], self.inputs[1, :num_tokens], self.inputs[2, :num_tokens],
                self.inputs[3, :len(logits_indices)])

    def replay(self, key: tuple[int, int], batch: ForwardBatch) -> torch.Tensor:
        """Fill the backend's static metadata from the batch and replay; returns the static (padded N, H) hidden
        states, valid until the next replay."""
        num_seqs, query_len = key
        graph, hidden = self.graphs[key]
        self.runner.attn_backend.load_graph_metadata(batch, num_seqs, query_len, batch.slot_mapping)
        graph.replay()
        return hidden
