"""CUDA graphs of the model forward for decode-shaped (1 new token per sequence) and verify-shaped (num_draft_tokens
per sequence; for a draft, its tree steps of topk) batches: one graph per (batch-size bucket, tokens per sequence),
captured once at start-up and replayed with new contents in static buffers. Each graph holds the forward, lm_head
over every row and the argmax, so a greedy step reads back only the argmax rows; EAGLE heads' input features and
the target's aux hidden states (feature capture) are static buffers too.

A batch of B sequences runs in the smallest captured bucket >= B; the extra sequences are padding that reads
block 0 and writes no KV (slot -1), and every op of the forward is row-independent, so padding can never change a
real row. Owns the static input buffers and the graphs; the attention backend owns the static metadata buffers.
Knows nothing about sequences' state: the ModelRunner decides what to run and reads the outputs back.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import TYPE_CHECKING

import torch

from runtime import pinned
from runtime.forward_batch import ForwardBatch, SeqAttention

if TYPE_CHECKING:
    from runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# torch.compile backend of the graphs' forwards under --enable-torch-compile; CPU tests use "eager" (dynamo's
# tracing and guards without inductor's toolchain).
COMPILE_BACKEND = "inductor"


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


class GraphOutputs:
    """The static outputs of one captured graph, valid until the next replay: the final hidden states, the logits
    and greedy tokens of every row (lm_head and argmax run inside the graph), and the captured layers' states (the
    target features of EAGLE-3 drafts) when the graph was captured with capture layers."""

    def __init__(self, hidden: torch.Tensor, logits: torch.Tensor, argmax: torch.Tensor, features: torch.Tensor | None,
                 tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        self.hidden = hidden  # (padded N, H)
        self.logits = logits  # (padded N, vocab) float32
        self.argmax = argmax  # (padded N,) int64
        self.features = features  # (padded N, len(capture_layers) * H) or None: the target features (EAGLE-3)
        # Wide graphs: greedy tree verification of every sequence whose tokens open a fresh tree region (root =
        # region node 0): tandem_kernels.verify_greedy's (accept_index (B, T), emitted (B, T), accept_lens (B,)) int32.
        self.tree = tree


class CudaGraphRunner:
    def __init__(
        self, runner: ModelRunner, max_bs: int, num_draft_tokens: int | None, max_bs_decode: int | None = None,
        mask_width: int | None = None, capture_layers: list[int] | None = None, compile_max_bs: int = 0,
        extra_widths: tuple[int, ...] = (),
    ) -> None:
        """max_bs: largest batch of the wide (num_draft_tokens per sequence) graphs; max_bs_decode: of the decode
        graphs (None = max_bs). mask_width: tree-tail width the wide graphs accept (None = num_draft_tokens; a
        draft's tree steps need num_steps * topk). capture_layers: aux hidden states every graph also returns.
        compile_max_bs > 0: graphs of at most that many sequences capture a torch.compile'd forward (compiled by
        their warm-up, before the capture); larger ones the eager forward."""
        self.runner = runner
        self.compile_max_bs = compile_max_bs
        self.compiled = _compile(runner) if compile_max_bs > 0 else None
        self.query_lens = sorted({1, num_draft_tokens or 1, *extra_widths})  # extra: adaptive tiers' widths
        decode_bs = capture_batch_sizes(max_bs if max_bs_decode is None else max_bs_decode)
        wide_bs = capture_batch_sizes(max_bs)
        self.sizes = {q: decode_bs if q == 1 else wide_bs for q in self.query_lens}
        self.query_lens = [q for q in self.query_lens if self.sizes[q]]
        self.batch_sizes = sorted({s for q in self.query_lens for s in self.sizes[q]})
        self.max_bs = self.batch_sizes[-1]
        self.capture_layers = list(capture_layers) if capture_layers else None
        max_query_len = self.query_lens[-1]
        cfg, bm = runner.model_config, runner.block_manager
        self.block_size = bm.block_size
        backend = runner.attn_backend
        width = max(max_query_len, mask_width or 0)
        if width > max_query_len and "mask_width" not in inspect.signature(backend.init_graph_buffers).parameters:
            width = max_query_len  # this backend's graphs take tails up to the query length only
        # Block-table width of the graphs: the longest context a sequence can reach, bounded by the pool.
        max_context = min(cfg.max_position_embeddings + width, bm.num_blocks * bm.block_size)
        self.max_blocks = -(-max_context // bm.block_size)
        device = runner.device
        max_tokens = max(s * q for q in self.query_lens for s in self.sizes[q])
        # Rows: input ids, positions, KV slots, logits rows, tree parents (region nodes, -1 = none); one host->device
        # copy fills them all.
        self.inputs = torch.zeros(5, max_tokens, dtype=torch.int64, device=device)
        self._verify_tree = _tree_verifier()
        # Feature-based draft heads (EAGLE) take a per-token input feature: a static buffer of it.
        self.features = None
        if getattr(runner.model, "feature_size", None) is not None:
            self.features = torch.zeros(max_tokens, cfg.hidden_size, dtype=runner.dtype, device=device)
        extra = {"mask_width": width} if width > max_query_len else {}
        backend.init_graph_buffers(self.max_bs, max_query_len, self.max_blocks, device, **extra)
        # Tree-tail width each graph accepts: the wide mask in every graph, else its own query length.
        self.mask_widths = {q: width if extra else q for q in self.query_lens}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, GraphOutputs]] = {}
        self.pool = None

    # ---- capture -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        on_cuda = self.runner.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.runner.device)[0] if on_cuda else 0
        # Largest first: later (smaller) graphs reuse the shared pool's blocks.
        for query_len in reversed(self.query_lens):
            for num_seqs in reversed(self.sizes[query_len]):
                self._capture_one(num_seqs, query_len)
        if on_cuda:
            torch.cuda.synchronize(self.runner.device)
        used = free_before - torch.cuda.mem_get_info(self.runner.device)[0] if on_cuda else 0
        logger.info("captured %d CUDA graphs (batch sizes %s x tokens per sequence %s) in %.1f s, %.2f GiB",
                    len(self.graphs), self.batch_sizes, self.query_lens, time.perf_counter() - start, used / (1 << 30))

    def release(self) -> None:
        """Drop every graph and its memory pool (before capturing a new set)."""
        self.graphs.clear()
        self.pool = None
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, num_seqs: int, num_tokens: int) -> GraphOutputs:
        """The captured computation: the forward, lm_head over every row and its argmax."""
        runner = self.runner
        extra = {} if self.features is None else {"input_features": self.features[:num_tokens]}
        model = self.compiled if self.compiled is not None and num_seqs <= self.compile_max_bs else runner.model
        out = model(ids, positions, runner.attn_backend, runner.kv_pool, self.capture_layers, **extra)
        logits = runner.model.compute_logits(out.hidden)  # (N, vocab) float32
        argmax = logits.argmax(dim=-1)  # (N,)
        tree = None
        query_len = num_tokens // num_seqs
        if query_len > 1 and self._verify_tree is not None:
            shape = (num_seqs, query_len)
            tree = self._verify_tree(ids.view(shape), self.inputs[4, :num_tokens].view(shape), argmax.view(shape))
        return GraphOutputs(out.hidden, logits, argmax, out.features, tree)

    def _capture_one(self, num_seqs: int, query_len: int) -> None:
        from runtime.models.llama import graph_capture_mode

        with graph_capture_mode():  # fused elementwise kernels in graphs (warm-up compiles them outside the capture)
            self._capture_one_inner(num_seqs, query_len)

    def _capture_one_inner(self, num_seqs: int, query_len: int) -> None:
        runner = self.runner
        num_tokens = num_seqs * query_len
        self.inputs[:, :num_tokens] = 0
        self.inputs[2, :num_tokens] = -1  # padding writes no KV
        self.inputs[4, :num_tokens] = -1
        ids, positions, slots = self.inputs[0, :num_tokens], self.inputs[1, :num_tokens], self.inputs[2, :num_tokens]
        runner.attn_backend.load_graph_metadata(None, num_seqs, query_len, slots)
        # Warm-up: torch.compile and Triton compile, cuBLAS picks its kernels, all outside the capture.
        try:
            for _ in range(2):
                self._run(ids, positions, num_seqs, num_tokens)
        except Exception as exc:  # noqa: BLE001 - torch.compile failing is not fatal: fall back to the eager forward
            if self.compiled is None or num_seqs > self.compile_max_bs:
                raise
            logger.warning("torch.compile of the forward failed (%s: %s); graphs capture the eager forward",
                           type(exc).__name__, exc)
            self.compiled = None
            for _ in range(2):
                self._run(ids, positions, num_seqs, num_tokens)
        self.graphs[(num_seqs, query_len)] = self._capture_graph(
            lambda: self._run(ids, positions, num_seqs, num_tokens))

    def _capture_graph(self, run) -> tuple[torch.cuda.CUDAGraph, GraphOutputs]:
        """Capture `run` into a graph sharing this runner's memory pool (CPU tests override this with a fake)."""
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = run()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, outputs

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
            if seq.tree_rows is not None and seq.tail_len > self.mask_widths[query_len]:
                return None
        num_seqs = bucket_for(len(seqs), self.sizes[query_len])
        return None if num_seqs is None else (num_seqs, query_len)

    def load_inputs(
        self, key: tuple[int, int], input_ids: list[int], positions: list[int], slot_mapping: list[int],
        logits_indices: list[int], tree_parents: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy the real tokens (padding rows: id 0, position 0, slot -1) into the static inputs; return views of
        (ids, positions, slots) over the padded batch and the logits rows. tree_parents: per token, its region parent
        (-1 for roots and chain tokens), read by the graph's greedy tree verification."""
        num_seqs, query_len = key
        num_tokens = num_seqs * query_len
        pad = num_tokens - len(input_ids)
        host = torch.zeros(5, num_tokens, dtype=torch.int64)
        host[4] = -1
        if tree_parents is not None:
            host[4, :len(tree_parents)] = torch.tensor(tree_parents, dtype=torch.int64)
        host[0, :len(input_ids)] = torch.tensor(input_ids)
        host[1, :len(positions)] = torch.tensor(positions)
        host[2] = torch.tensor(slot_mapping + [-1] * pad)
        host[3, :len(logits_indices)] = torch.tensor(logits_indices, dtype=torch.int64)
        pinned.copy_to(self.inputs[:, :num_tokens], host)
        return (self.inputs[0, :num_tokens], self.inputs[1, :num_tokens], self.inputs[2, :num_tokens],
                self.inputs[3, :len(logits_indices)])

    def replay(self, key: tuple[int, int], batch: ForwardBatch, features: torch.Tensor | None = None) -> GraphOutputs:
        """Fill the backend's static metadata (and the input features of a feature-based head: (N, H)) from the
        batch and replay; returns the graph's static outputs, valid until the next replay."""
        num_seqs, query_len = key
        graph, outputs = self.graphs[key]
        if self.features is not None:
            if features is None:
                raise ValueError("this graph runs a feature-based head: input_features are required")
            n = features.shape[0]
            self.features[:n].copy_(features, non_blocking=self.features.device.type == "cuda")
            self.features[n:num_seqs * query_len].zero_()  # padding rows: finite, never read back
        self.runner.attn_backend.load_graph_metadata(batch, num_seqs, query_len, batch.slot_mapping)
        graph.replay()
        return outputs


def _compile(runner: ModelRunner):
    """torch.compile of the runner's model. The attention backend launches its own kernels from host-built metadata:
    it runs as it is between the compiled regions (a graph break per layer), never traced."""
    untraced_attention(runner)
    configure_dynamo()
    return torch.compile(runner.model, backend=COMPILE_BACKEND)


def configure_dynamo() -> None:
    """Dynamo's recompile limits for compiling graph code. Each captured shape is one compilation, and a decoder
    layer's frame (resumed after its attention break) compiles once per shape, per model in the process and, where
    dynamo specialises on the layer's `layer_id`, per layer; past `recompile_limit` (8) dynamo runs a frame uncompiled,
    as the later layers of the H200's compile_steps run did (11th session). Allow one compilation per captured shape
    and layer."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch's name
    setattr(config, name, max(getattr(config, name), 1024))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8192)


def untraced_attention(runner: ModelRunner) -> None:
    """Keep torch.compile out of the runner's attention backend: its kernels launch as they are, between compiled
    regions (a graph break per layer)."""
    backend = runner.attn_backend
    if not getattr(backend.forward, "_tandem_not_compiled", False):
        forward = torch.compiler.disable(backend.forward)
        forward._tandem_not_compiled = True
        backend.forward = forward  # an instance attribute: this backend object only


def _tree_verifier():
    """tandem_kernels.verify_greedy.verify_tree_greedy, or None where triton cannot run it (the graph then returns only the
    argmax and callers walk the tree on the host)."""
    try:
        from tandem_kernels.verify_greedy import verify_tree_greedy
    except ImportError:
        return None
    return verify_tree_greedy
