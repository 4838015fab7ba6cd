"""What the static steps (draft_step.StaticDraftStep, verify_step.StaticVerifyStep) share: a packed int64 input
buffer per batch bucket filled by one host->device copy, one CUDA graph per bucket (captured largest first into one
memory pool, warmed up outside the capture), and the same device code run eagerly where there is no graph (CPU).
A subclass defines the device code (`run`) and the padding rows (`_pad_inputs`).

Under --enable-torch-compile the graphs of at most --torch-compile-max-bs sequences capture the device code compiled
by torch.compile (the whole step: model forwards, top-k, tree selection, compaction; the attention kernels stay as
they are), so a replay launches fewer, fused kernels (a graph's host replay cost grows with its node count)."""
from __future__ import annotations

import logging
import time

import torch

from runtime import pinned

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
        ec = runner.engine_config
        self.compile_max_bs = ec.torch_compile_max_bs if ec.enable_torch_compile else 0
        self._compiled = None  # torch.compile of `run`, made on first use
        self.compiled_sizes: list[int] = []  # buckets whose graph captured the compiled code
        # On CUDA the packed inputs are built in pinned host memory kept across steps (no allocation or pinning per
        # step) and the readback lands in another: both copies are asynchronous DMA.
        self._staging: torch.Tensor | None = None
        self._pad_row: torch.Tensor | None = None  # one padding row (_pad_host), copied into every new host block
        self._staged: torch.cuda.Event | None = None  # the last copy out of _staging
        self._readback = pinned.Readback()

    def run(self, num_seqs: int) -> torch.Tensor:
        raise NotImplementedError

    def _pad_inputs(self, bs: int) -> None:
        """Padding rows in the device inputs (before a capture)."""
        self.inputs[:bs].copy_(self.new_host_rows(bs))

    def code_for(self, bs: int):
        """The device code a bucket's graph captures: `run`, or under --enable-torch-compile (buckets up to
        --torch-compile-max-bs) its torch.compile."""
        if bs > self.compile_max_bs:
            return self.run
        if self._compiled is None:
            from runtime import cuda_graph

            self._untraced_kernels()
            cuda_graph.configure_dynamo()  # one compilation per bucket (a Python int the code specialises on)
            self._compiled = torch.compile(self.run, backend=cuda_graph.COMPILE_BACKEND, dynamic=False)
        return self._compiled

    def _untraced_kernels(self) -> None:
        """Keep torch.compile out of the step's Triton kernels (they launch as they are, between compiled regions):
        the runner's attention backend; a subclass adds the other ones its device code calls."""
        from runtime import cuda_graph

        cuda_graph.untraced_attention(self.runner)

    def capture(self, label: str) -> None:
        """One CUDA graph per batch bucket; nothing on CPU (the device code then runs eagerly)."""
        from runtime.models.llama import graph_capture_mode

        if self.runner.device.type != "cuda":
            return
        t0 = time.perf_counter()
        with torch.inference_mode(), graph_capture_mode():
            for bs in reversed(self.sizes):
                self._pad_inputs(bs)
                code = self.code_for(bs)
                try:
                    for _ in range(2):  # warm-up outside the capture: torch.compile, Triton JIT, cuBLAS heuristics
                        code(bs)
                except Exception as exc:  # noqa: BLE001 - a failed compilation is not fatal: capture the plain code
                    if code == self.run:
                        raise
                    logger.warning("%s: torch.compile of the static step failed (%s: %s); its graphs capture the "
                                   "plain device code", label, type(exc).__name__, exc)
                    self.compile_max_bs, code = 0, self.run
                    for _ in range(2):
                        code(bs)
                if code != self.run:
                    self.compiled_sizes.append(bs)
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[bs] = code(bs)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize(self.runner.device)
        compiled = f", torch.compile'd for {sorted(self.compiled_sizes)}" if self.compiled_sizes else ""
        logger.info("%s: captured %d CUDA graphs (batch sizes %s%s) in %.1f s", label, len(self.graphs), self.sizes,
                    compiled, time.perf_counter() - t0)

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
        if self._pad_row is None:
            with torch.inference_mode(False):
                self._pad_row = torch.zeros(1, self.cols, dtype=torch.int64)
                self._pad_host(self._pad_row)
        padding = self._pad_row[:, :width].expand(bs, width)
        if self.inputs.device.type != "cuda":
            return padding.clone()
        if self._staging is None:
            with torch.inference_mode(False):  # a normal tensor: steps run in and out of inference mode
                self._staging = torch.empty(self.max_bs * self.cols, dtype=torch.int64, pin_memory=True)
        if self._staged is not None:
            self._staged.synchronize()  # the last step's copy out of the buffer is done (it normally is)
        host = self._staging[:bs * width].view(bs, width)
        host.copy_(padding)  # one copy of the padding rows (was a zero fill and _pad_host's writes per step)
        return host

    def _pad_host(self, host: torch.Tensor) -> None:
        """Fill `host` (bs, cols) with padding rows (the values _pad_inputs writes on the device)."""
        raise NotImplementedError

    def put_table(self, row, block_table: list[int]) -> None:
        """A block table into a packed row (a row of `new_host_rows(...).numpy()`)."""
        row[self.table_col:self.table_col + len(block_table)] = block_table

    @staticmethod
    def put_rows(dst: torch.Tensor, placed: list[tuple[int, int, torch.Tensor]]) -> None:
        """Feature rows into a (bs, n, F) static input buffer: each (sequence, first row, rows) at its place. Rows
        already on the buffer's device (a target's features handed over in process) are copied in directly, one
        copy per sequence (was a zero fill, the copies and a whole-buffer copy: three launches at batch 1); the rows
        not named keep earlier values, finite (zeros or earlier features) and never read: they are padding whose
        outputs are dropped and which write no KV. Rows elsewhere (the wire's, on the host) go into a block built
        there, the rest zero, and cross in one pinned copy."""
        if all(rows.device == dst.device for _, _, rows in placed):
            for i, first, rows in placed:
                dst[i, first:first + rows.shape[0]].copy_(rows)
            return
        src = placed[0][2].device
        block = torch.zeros(dst.shape, dtype=dst.dtype, device=src)
        for i, first, rows in placed:
            block[i, first:first + rows.shape[0]] = rows.to(src, dst.dtype)
        pinned = src.type == "cpu" and dst.device.type == "cuda"
        dst.copy_(block.pin_memory() if pinned else block, non_blocking=pinned)

    def execute(self, host: torch.Tensor) -> torch.Tensor:
        """One host->device copy of the packed inputs (as many table columns as the host rows hold), then the
        bucket's graph (or the device code, eager)."""
        self.load(host)
        return self.replay(host.shape[0])

    def load(self, host: torch.Tensor) -> None:
        """The packed inputs of a bucket (rows of `new_host_rows`) into the device inputs: one copy, asynchronous
        from the pinned staging buffer on CUDA."""
        bs, width = host.shape
        if self.inputs.device.type == "cuda":
            self.inputs[:bs, :width].copy_(host, non_blocking=host.is_pinned())
            if self._staged is None:
                self._staged = torch.cuda.Event()
            self._staged.record()
        else:
            self.inputs[:bs, :width].copy_(host)

    def read_back(self, out: torch.Tensor) -> torch.Tensor:
        """The step's one device->host copy of `out` (contiguous), into pinned memory kept across steps: the result
        is valid until this step's next read_back (clone what must outlive it)."""
        if out.device.type != "cuda":
            return out
        host = self._readback.copy(out)
        torch.cuda.current_stream(out.device).synchronize()
        return host

    def replay(self, bs: int) -> torch.Tensor:
        self.num_replays += 1
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs]
        with torch.inference_mode():  # CPU (and buckets without a graph): the same device code, eager
            return self.run(bs)
