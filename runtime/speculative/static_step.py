"""What the static steps (draft_step.StaticDraftStep, verify_step.StaticVerifyStep) share: a packed int64 input
buffer per batch bucket filled by one host->device copy, one CUDA graph per bucket (captured largest first into one
memory pool, warmed up outside the capture), and the same device code run eagerly where there is no graph (CPU).
A subclass defines the device code (`run`) and the padding rows (`_pad_inputs`)."""
from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


class StaticStep:
    def __init__(self, runner, max_bs: int, extra_tokens: int, cols_before_table: int) -> None:
        """extra_tokens: KV indices a step may write past the context limit (tree nodes); cols_before_table: int64
        columns of each sequence's packed row before its block table."""
        from runtime.cuda_graph import capture_batch_sizes

        self.runner = runner
        cfg, bm = runner.model_config, runner.block_manager
        self.block_size = bm.block_size
        max_context = min(cfg.max_position_embeddings + extra_tokens, bm.num_blocks * bm.block_size)
        self.max_blocks = -(-max_context // bm.block_size)
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.table_col = cols_before_table
        self.cols = cols_before_table + self.max_blocks
        self.inputs = torch.zeros(self.max_bs, self.cols, dtype=torch.int64, device=runner.device)
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the static output of its graph
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.num_replays = 0

    def run(self, num_seqs: int) -> torch.Tensor:
        raise NotImplementedError

    def _pad_inputs(self, bs: int) -> None:
        """Padding rows in the device inputs (before a capture)."""
        self.inputs[:bs].copy_(self.new_host_rows(bs))

    def capture(self, label: str) -> None:
        """One CUDA graph per batch bucket; nothing on CPU (the device code then runs eagerly)."""
        from runtime.models.llama import graph_capture_mode

        if self.runner.device.type != "cuda":
            return
        t0 = time.perf_counter()
        with torch.inference_mode(), graph_capture_mode():
            for bs in reversed(self.sizes):
                self._pad_inputs(bs)
                for _ in range(2):  # warm-up outside the capture: Triton JIT, cuBLAS heuristics
                    self.run(bs)
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[bs] = self.run(bs)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize(self.runner.device)
        logger.info("%s: captured %d CUDA graphs (batch sizes %s) in %.1f s", label, len(self.graphs), self.sizes,
                    time.perf_counter() - t0)

    def bucket_for(self, num_seqs: int) -> int:
        bs = next((s for s in self.sizes if s >= num_seqs), None)
        if bs is None:
            raise ValueError(f"{num_seqs} sequences exceed the static step's {self.max_bs}")
        return bs

    def new_host_rows(self, bs: int, max_table_len: int | None = None) -> torch.Tensor:
        """The host side of the packed inputs for a bucket, with the padding rows' values, holding block tables of
        up to max_table_len blocks (None: the widest; the columns past it keep stale values on the device, which the
        step never reads: every sequence's KV ends before them)."""
        width = self.cols if max_table_len is None else self.table_col + max(1, max_table_len)
        host = torch.zeros(bs, width, dtype=torch.int64)
        self._pad_host(host)
        return host

    def _pad_host(self, host: torch.Tensor) -> None:
        """Fill `host` (bs, cols) with padding rows (the values _pad_inputs writes on the device)."""
        raise NotImplementedError

    def put_table(self, row: torch.Tensor, block_table: list[int]) -> None:
        row[self.table_col:self.table_col + len(block_table)] = torch.tensor(block_table)

    def execute(self, host: torch.Tensor) -> torch.Tensor:
        """One host->device copy of the packed inputs (as many table columns as the host rows hold), then the
        bucket's graph (or the device code, eager)."""
        bs, width = host.shape
        on_cuda = self.inputs.device.type == "cuda"
        self.inputs[:bs, :width].copy_(host.pin_memory() if on_cuda else host, non_blocking=on_cuda)
        return self.replay(bs)

    def replay(self, bs: int) -> torch.Tensor:
        self.num_replays += 1
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs]
        with torch.inference_mode():  # CPU (and buckets without a graph): the same device code, eager
            return self.run(bs)
