"""ModelRunner: one model, its paged KV cache and its sequences' KV state, driven by explicit per-sequence appends
(chain or speculative tree), one batched model forward per call. The API target and draft services build on.

Owns KV memory and tree regions; knows nothing about sampling, acceptance or the wire. Sequences are opaque ids.
Under tensor parallelism (`tp`), each rank's runner holds its KV heads; rank 0's runner mirrors its KV-state changes
and forwards to the other ranks (`runtime.distributed`), whose runners are driven by `run_worker`.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runtime import pinned
from runtime.attention import get_backend
from runtime.config import EngineConfig, ModelConfig
from runtime.distributed import StepMirror, TPGroup, TPShard
from runtime.batch_builder import (LOGITS_MODES, SeqForward, SeqState, UnknownSeq, build_forward_batch,
                                   reserve_kv, seq_state, to_device_long, validate_batch)
from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.kv_cache import BlockManager, OutOfKVBlocks
from runtime.kv_pool import KVPool
from runtime.memory import GiB, DeviceMemoryProbe, MemoryPlan, OutOfDeviceMemory, kv_bytes_per_block, plan_kv_blocks
from runtime.models.loader import load_model, resolve_dtype

if TYPE_CHECKING:
    from runtime.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)
OUTPUTS = ("logits", "argmax", "both")
# Tokens of the warm-up prefill whose activation peak memory profiling keeps free (longer prompts may not fit).
_WARMUP_PREFILL_TOKENS = 4096


@dataclass
class ForwardOutput:
    logits: list[torch.Tensor]  # per SeqForward: (num_logit_rows, vocab) float32
    hidden: list[torch.Tensor | None]  # per SeqForward: (num_logit_rows, H) when capture_hidden, else None
    # per SeqForward, only when forward(capture_layers=...): (T, len(capture_layers) * H), all T tokens
    features: list[torch.Tensor | None] = field(default_factory=list)
    # per SeqForward, only when forward(outputs="argmax" | "both"): the argmax token of each logits row, read back
    # to the host in one copy for the whole batch (inside a CUDA graph the argmax is part of the graph)
    argmax: list[list[int]] | None = None
    # per SeqForward, only with outputs="argmax" | "both" when a graph with on-device greedy tree verification ran:
    # for a tree append opening a fresh region with logits "all", (accepted region nodes, root 0 first; emitted
    # tokens: the accepted nodes' tokens then the bonus), read back with the argmax; None for any other sequence
    greedy_tree: list[tuple[list[int], list[int]] | None] | None = None


@dataclass
class _Prefetch:
    """Decode steps a pipelined run enqueued past its readback (ModelRunner.greedy_decode_steps)."""

    seq_ids: tuple[str, ...]
    kv_lens: tuple[int, ...]  # where each sequence's KV stood when they started (their KV lies past it)
    tokens: list[torch.Tensor]  # per step, the (B,) greedy tokens, on the device
    fed: list[int] | None = None  # the tokens the first step was fed (the run's last ones), once read back

    def __post_init__(self) -> None:
        self.members = frozenset(self.seq_ids)


class ModelRunner:
    def __init__(
        self,
        model_path: str | None,
        engine_config: EngineConfig,
        model_config: ModelConfig | None = None,
        model: torch.nn.Module | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        """model: an already loaded module (e.g. an EAGLE draft head built by its own loader) to run instead of
        loading one from model_path; model_config then only describes its KV shape. tp: this rank's group when the
        model is tensor-parallel (every rank builds its runner with the same arguments, at the same time: the
        warm-up forwards are collectives). CUDA graphs stay off under TP."""
        if model_config is None:
            if model_path is None:
                raise ValueError("need a model_path or a model_config")
            model_config = ModelConfig.from_pretrained(model_path)
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = torch.device(engine_config.device)
        self.dtype = resolve_dtype(engine_config, model_config)
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None and model is not None:
            raise ValueError("tensor parallelism needs the runner to load the model itself")
        # Device bytes held before this runner's own weights: another runner in this process (a draft beside its
        # target, --colocate-draft) holds its weights and KV pool there; the KV sizing counts this runner's only.
        held_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        if model is not None:  # built before this runner (an EAGLE head's loader): its tensors are this runner's
            held_before -= sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                               if t.device == self.device)
        self._held_before = max(0, held_before)
        self.model = model if model is not None else load_model(model_path, model_config, engine_config, self.tp)
        shard = TPShard.of(model_config, self.tp.rank, self.tp.size) if self.tp is not None else None
        self.num_local_heads = shard.num_heads if shard else model_config.num_heads
        self.num_local_kv_heads = shard.num_kv_heads if shard else model_config.num_kv_heads
        backend_cls = get_backend(_resolve_backend(engine_config.attention_backend, self.device))
        self.attn_backend = backend_cls(
            self.num_local_heads, self.num_local_kv_heads, model_config.head_dim, model_config.head_dim**-0.5
        )
        self._mirror: StepMirror | None = None  # set last: warm-up forwards run on every rank by itself
        self._seqs: dict[str, SeqState] = {}
        self._prefetch: _Prefetch | None = None  # decode steps greedy_decode_steps ran past its readback
        self._readback = pinned.Readback()  # (CUDA) the tokens of a pipelined run with a prefetch
        self.graph_runner: CudaGraphRunner | None = None
        self.use_cuda_graph = False  # replay captured graphs for fitting batches (benchmarks may switch it off)
        # Measured by profiling when engine_config.mem_fraction_static sizes the KV pool; None otherwise.
        self.memory_plan: MemoryPlan | None = None
        num_blocks = engine_config.resolved_num_kv_blocks
        if (self.device.type == "cuda" and engine_config.num_kv_blocks is None
                and engine_config.mem_fraction_static is not None):
            self.memory_plan = self._profile_memory()
            num_blocks = self.memory_plan.num_kv_blocks
        if self.tp is not None:  # every rank's block manager must make the same decisions: the smallest pool wins
            num_blocks = self.tp.min_int(num_blocks)
        self._init_kv(num_blocks)
        # Graphs need the static-buffer backend and a forward they know the inputs of: the plain LM, or a feature
        # head (EAGLE: `feature_size`) whose per-token features get a static buffer too.
        if (self.device.type == "cuda" and not engine_config.disable_cuda_graph and self.tp is None
                and max(engine_config.cuda_graph_max_bs, engine_config.cuda_graph_max_bs_decode or 0) > 0
                and (model is None or getattr(model, "feature_size", None) is not None)
                and hasattr(self.attn_backend, "init_graph_buffers")):
            self._capture_graphs(None)
        if self.device.type == "cuda" and self.tp is None and type(self.attn_backend).__name__ == "TritonAttentionBackend":
            self._warm_up_kernels(getattr(model, "feature_size", None) is not None)
        if engine_config.enable_torch_compile and self.graph_runner is None:
            # Compilation rides on graph capture (the compiled forward is what the graphs of <= torch_compile_max_bs
            # sequences capture); eager forwards are never compiled.
            logger.warning("--enable-torch-compile has no effect without CUDA graphs (CPU, TP, a backend without "
                           "graph buffers, or --disable-cuda-graph)")
        if self.tp is not None and self.tp.is_driver:
            self._mirror = StepMirror(self.tp)

    def _capture_graphs(self, capture_layers: list[int] | None) -> None:
        from runtime.cuda_graph import CudaGraphRunner

        ec = self.engine_config
        cls = CudaGraphRunner
        if self.graph_runner is not None:  # a recapture keeps the kind of runner (CPU tests install a fake one)
            cls = type(self.graph_runner)
            self.graph_runner.release()
        self.graph_runner = cls(self, ec.cuda_graph_max_bs, ec.cuda_graph_num_draft_tokens,
                                ec.cuda_graph_max_bs_decode, ec.cuda_graph_mask_width, capture_layers,
                                ec.torch_compile_max_bs if ec.enable_torch_compile else 0,
                                extra_widths=tuple(ec.cuda_graph_extra_widths))
        self.graph_runner.capture()
        self.use_cuda_graph = True

    @torch.inference_mode()
    def _warm_up_kernels(self, feature_head: bool) -> None:
        """JIT-compile, at start-up, the attention kernel variants that eager forwards use: chain and tree appends of
        1..17 tokens (each query-tile size), on a split-KV grid (one sequence) and a full one. Triton compiles a
        variant on its first use, 0.1-0.4 s on the GPU host; without this the compiles land in the middle of serving
        (H200, NGRAM's variable-size trees through tandem serve: 18.6 ms mean Verify RPC)."""
        lengths = [1, 2, 3, 5, 9, 17]
        wide = 64
        if self.num_free_tokens() < wide * 2 * (lengths[-1] + self.block_manager.block_size):
            wide = 1
        start = time.perf_counter()
        for num_seqs in sorted({1, wide}):
            for n in lengths:
                ids = [f"__jit_{i}__" for i in range(num_seqs)]
                for seq_id in ids:
                    self.add_seq(seq_id)
                try:
                    for parents in (None, [-1] + list(range(n - 1))):
                        feats = (torch.zeros(n, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
                                 if feature_head else None)
                        self.forward([SeqForward(s, [0] * n, parents=parents, logits="last",
                                                 input_features=feats) for s in ids])
                        if parents is not None:
                            for s in ids:
                                self.truncate(s, n)
                finally:
                    for seq_id in ids:
                        self.free_seq(seq_id)
        logger.info("attention kernels warmed up in %.1f s", time.perf_counter() - start)

    def set_graph_capture_layers(self, capture_layers: list[int] | None) -> None:
        """Recapture the CUDA graphs so that they also return these layers' aux hidden states (feature capture for
        EAGLE drafts then replays graphs too). Forwards asking for other layers run eager. No-op without graphs."""
        if self.graph_runner is None or self.graph_runner.capture_layers == (list(capture_layers or []) or None):
            return
        self._capture_graphs(capture_layers)

    def _init_kv(self, num_blocks: int) -> None:
        cfg = self.model_config
        self.block_manager = BlockManager(num_blocks, self.engine_config.block_size,
                                          prefix_cache=self.engine_config.enable_prefix_cache and self.tp is None)
        self.kv_pool = KVPool(cfg.num_layers, num_blocks, self.engine_config.block_size, self.num_local_kv_heads,
                              cfg.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def _profile_memory(self) -> MemoryPlan:
        """Run warm-up forwards on a small temporary KV pool (a long prefill, and the widest decode/verify logits
        the graphs may see), then size the real pool from what the weights and the activation peak left."""
        cfg, ec = self.model_config, self.engine_config
        weights_bytes = torch.cuda.memory_allocated(self.device) - self._held_before
        chunk = ec.chunked_prefill_size
        prefill_len = min(chunk if chunk and chunk > 0 else _WARMUP_PREFILL_TOKENS, cfg.max_position_embeddings)
        wide_len = min(max(1, ec.cuda_graph_max_bs) * (ec.cuda_graph_num_draft_tokens or 1), cfg.max_position_embeddings)
        self._init_kv(-(-max(prefill_len, wide_len) // ec.block_size) + 1)
        probe = DeviceMemoryProbe(self.device)
        self._warm_up_forwards(((prefill_len, "last"), (wide_len, "all")))
        del self.kv_pool, self.block_manager
        peak, free, total = probe.finish()
        plan = plan_kv_blocks(total_bytes=total, free_bytes=free, weights_bytes=weights_bytes,
                              activation_peak_bytes=peak,
                              bytes_per_block=kv_bytes_per_block(cfg, ec.block_size, self.dtype)
                              * self.num_local_kv_heads // cfg.num_kv_heads,
                              mem_fraction_static=ec.mem_fraction_static)
        logger.info("KV pool: %d blocks (%.2f GiB); weights %.2f GiB, activation peak %.2f GiB, %.2f GiB free",
                    plan.num_kv_blocks, plan.kv_bytes / GiB, weights_bytes / GiB, peak / GiB, free / GiB)
        return plan

    def _warm_up_forwards(self, shapes) -> None:
        """One throw-away forward per (num_tokens, logits) on the current pool; a feature head (EAGLE/EAGLE-3 drafts:
        `feature_size`) gets zero (N, hidden) input features, as it needs them for every token."""
        feature_head = getattr(self.model, "feature_size", None) is not None
        for num_tokens, logits in shapes:
            feats = (torch.zeros(num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
                     if feature_head else None)
            self.add_seq("__warmup__")
            try:
                self.forward([SeqForward("__warmup__", [0] * num_tokens, logits=logits, input_features=feats)])
            finally:
                self.free_seq("__warmup__")

    # ---- sequence lifecycle ----------------------------------------------------------------------------------------
    def add_seq(self, seq_id: str, prefix_tokens: list[int] | None = None) -> int:
        """A new, empty sequence. With the prefix cache on, `prefix_tokens` (tokens the caller would write first)
        are looked up: the sequence starts with the KV of their longest cached prefix in place; returns its length
        (a multiple of the block size; 0 without a hit), the KV index the caller's first forward starts at."""
        if seq_id in self._seqs:
            raise ValueError(f"seq {seq_id!r} already exists")
        cached = self.block_manager.allocate_seq(seq_id, 0, prefix_tokens)
        self._seqs[seq_id] = SeqState(kv_len=cached)
        if self._mirror is not None:  # TP runs without the prefix cache: cached is 0 on every rank
            self._mirror.record("add_seq", seq_id)
        return cached

    def cache_prefix(self, seq_id: str, tokens: list[int]) -> None:
        """The sequence's KV holds `tokens` (its committed tokens, at least the first kv_len): make its full blocks
        reusable by later sequences with the same prefix. No-op without the prefix cache or while a tree is open."""
        state = self._state(seq_id)
        if self.block_manager.prefix_cache and state.region_start is None:
            self.block_manager.register(seq_id, tokens, state.kv_len)

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def kv_len(self, seq_id: str) -> int:
        return self._state(seq_id).kv_len

    def region_start(self, seq_id: str) -> int | None:
        """KV index of the open tree region's node 0, or None when no region is open."""
        return self._state(seq_id).region_start

    def weight_bytes(self) -> int:
        """Bytes of this rank's model parameters: what one decode step reads."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def free_seq(self, seq_id: str) -> None:
        self._drop_prefetch([seq_id])
        self._state(seq_id)
        del self._seqs[seq_id]
        self.block_manager.free_seq(seq_id)
        if self._mirror is not None:
            self._mirror.record("free_seq", seq_id)

    def num_free_tokens(self) -> int:
        """Free KV capacity in tokens (whole free blocks; slack in sequences' last blocks is not counted)."""
        return self.block_manager.num_free_blocks() * self.block_manager.block_size

    def num_total_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    # ---- KV rollback -----------------------------------------------------------------------------------------------
    def truncate(self, seq_id: str, kv_len: int) -> None:
        """Roll the sequence's KV back to [0, kv_len); closes any open tree region."""
        self._drop_prefetch([seq_id])
        state = self._state(seq_id)
        if not 0 <= kv_len <= state.kv_len:
            raise ValueError(f"truncate seq {seq_id!r} to {kv_len}: must be in [0, {state.kv_len}]")
        self._copy_blocks(self.block_manager.truncate(seq_id, kv_len))
        state.kv_len = kv_len
        state.close_region()
        if self._mirror is not None:
            self._mirror.record("truncate", seq_id, kv_len)

    def rewind(self, seq_id: str, kv_len: int) -> None:
        """Move the sequence's KV length back to kv_len keeping its blocks (truncate frees them): the next append
        rewrites [kv_len, ..) of the layers it runs and the other layers' KV there stays (the MTP layers of a
        multi-layer draft write the same positions one after another)."""
        self._drop_prefetch([seq_id])
        state = self._state(seq_id)
        if not 0 <= kv_len <= state.kv_len or state.region_start is not None or self._mirror is not None:
            raise ValueError(f"rewind seq {seq_id!r} to {kv_len}: must be in [0, {state.kv_len}], no tree region, "
                             "no TP")
        state.kv_len = kv_len

    def compact(self, seq_id: str, region_nodes: list[int]) -> None:
        """Keep only these region nodes, moved in this order to KV indices region_start..; closes the region."""
        self._drop_prefetch([seq_id])
        state = self._state(seq_id)
        if state.region_start is None:
            raise ValueError(f"compact seq {seq_id!r}: no tree region is open")
        region_len = state.kv_len - state.region_start
        if len(set(region_nodes)) != len(region_nodes) or any(not 0 <= n < region_len for n in region_nodes):
            raise ValueError(f"compact seq {seq_id!r}: nodes {region_nodes} must be distinct, in [0, {region_len})")
        start = state.region_start
        moves = [(start + n, start + i) for i, n in enumerate(region_nodes) if n != i]
        if moves:
            src = [self.block_manager.slot(seq_id, s) for s, _ in moves]
            dst = [self.block_manager.slot(seq_id, d) for _, d in moves]
            src_t, dst_t = self._long(src + dst).split(len(moves))
            self.kv_pool.copy_slots(src_t, dst_t)
        new_len = start + len(region_nodes)
        self._copy_blocks(self.block_manager.truncate(seq_id, new_len))
        state.kv_len = new_len
        state.close_region()
        if self._mirror is not None:  # the other ranks keep rank 0's accepted nodes in their own KV heads
            self._mirror.record("compact", seq_id, list(region_nodes))

    # ---- static steps (runtime/speculative/draft_step.py write the KV themselves) -----------------------------------
    def reserve(self, totals: dict[str, int]) -> None:
        """Grow each sequence's block table to hold `totals[seq_id]` KV indices, all or nothing (OutOfKVBlocks before
        any change); kv_len is unchanged until `written`."""
        self._drop_prefetch(totals)
        for seq_id, total in totals.items():
            if self._state(seq_id).region_start is not None:
                raise ValueError(f"seq {seq_id!r}: a tree region is open")
        bm = self.block_manager
        needed = sum(bm.num_blocks_needed(seq_id, total) for seq_id, total in totals.items())
        if needed > bm.num_free_blocks():
            raise OutOfKVBlocks(needed, bm.num_free_blocks())
        for seq_id, total in totals.items():
            bm.ensure_capacity(seq_id, total)

    def written(self, seq_id: str, kv_len: int) -> None:
        """A static step wrote this sequence's KV [kv_len(), kv_len) (and scratch nodes past it, now dropped): kv_len
        becomes its length and the blocks past it are freed."""
        self._drop_prefetch([seq_id])
        state = self._state(seq_id)
        if kv_len < state.kv_len or kv_len > self.block_manager.capacity(seq_id):
            raise ValueError(f"seq {seq_id!r}: written up to {kv_len}, KV holds {state.kv_len}, reserved "
                             f"{self.block_manager.capacity(seq_id)}")
        state.kv_len = kv_len
        self._copy_blocks(self.block_manager.truncate(seq_id, kv_len))

    # ---- forward ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        batch: list[SeqForward],
        capture_layers: list[int] | None = None,
        mode: ForwardMode | None = None,
        outputs: str = "logits",
    ) -> ForwardOutput:
        """One model forward over all sequences' new tokens. Validates everything and reserves KV before any state
        changes, so a raised error (ValueError, UnknownSeq, OutOfKVBlocks, OutOfDeviceMemory) leaves every sequence
        as it was. On CUDA, batches whose sequences all add the same number of tokens (decode, verify) replay a
        captured graph when one fits (lm_head and argmax inside it); everything else runs eager.

        outputs: "logits" (per-row float32 logits), "argmax" (only the greedy token of each row, in one small
        readback: no logits copied out), or "both"."""
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}")
        self._drop_prefetch(sf.seq_id for sf in batch)
        self._validate(batch)
        kv_lens = {sf.seq_id: self._seqs[sf.seq_id].kv_len for sf in batch}
        self._reserve_kv(batch)
        if self._mirror is not None:  # validated and reserved here, so the other ranks accept it too
            self._mirror.forward(batch, capture_layers, mode)
        try:
            fresh = [sf.parents is not None and sf.logits == "all" and self._seqs[sf.seq_id].region_start is None
                     for sf in batch]
            fb, new_regions, aux, rows_hidden, logits, argmax, tree = self._run_model(batch, capture_layers, mode,
                                                                                      outputs)
        except torch.cuda.OutOfMemoryError as exc:
            for seq_id, kv_len in kv_lens.items():  # give back the blocks reserved for this forward
                self.block_manager.truncate(seq_id, kv_len)
            torch.cuda.empty_cache()
            num_tokens = sum(len(sf.token_ids) for sf in batch)
            raise OutOfDeviceMemory(
                f"a forward of {len(batch)} sequences / {num_tokens} tokens does not fit in device memory; lower "
                f"--mem-fraction-static, the batch or the tree size ({exc})") from None
        result = ForwardOutput(logits=[], hidden=[], features=[])
        host_argmax = None
        if argmax is not None and tree is not None:  # the one readback of a greedy step: argmax + tree walks
            b, width = len(batch), tree[0].shape[1]
            accept_index, emitted, accept_lens = (t[:b].flatten().to(argmax.dtype) for t in tree)
            packed = torch.cat([argmax, accept_index, emitted, accept_lens]).tolist()
            host_argmax, packed = packed[:argmax.shape[0]], packed[argmax.shape[0]:]
            result.greedy_tree = []
            for i, is_fresh in enumerate(fresh):
                num = packed[2 * b * width + i]
                path = packed[i * width : i * width + num]  # root + accepted drafts = num emitted tokens
                tokens = packed[(b + i) * width : (b + i) * width + num]
                result.greedy_tree.append((path, tokens) if is_fresh else None)
        elif argmax is not None:
            host_argmax = argmax.tolist()  # the one readback of a greedy step
        if host_argmax is not None:
            result.argmax = []
        row = 0
        for sf, seq, n in zip(batch, fb.seqs, fb.num_logit_rows):
            if logits is None:
                result.logits.append(torch.empty(0, self.model_config.vocab_size, device=self.device))
            else:
                result.logits.append(logits[row : row + n])
            if host_argmax is not None:
                result.argmax.append(host_argmax[row : row + n])
            result.hidden.append(rows_hidden[row : row + n] if sf.capture_hidden else None)
            tokens = slice(seq.query_start, seq.query_start + seq.query_len)
            result.features.append(aux[tokens] if aux is not None else None)
            row += n
        # Commit state only after the forward succeeded.
        for sf in batch:
            state = self._seqs[sf.seq_id]
            if sf.parents is not None:
                start, visible, parents = new_regions[sf.seq_id]
                state.region_start, state.region_visible, state.region_parents = start, visible, parents
            state.kv_len += len(sf.token_ids)
        return result

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _run_model(
        self, batch: list[SeqForward], capture_layers: list[int] | None, mode: ForwardMode | None, outputs: str
    ):
        """(forward batch, new regions, aux hidden (N, .) or None, logits-row hidden, logits or None, argmax (rows,)
        device tensor or None, the graph's greedy tree verification or None). Everything returned is a copy, or
        read before the next graph replay."""
        features = batch[0].input_features is not None  # _validate made it all-or-none
        gr = self.graph_runner
        # A graph returns the aux states of the layers it was captured with (a forward without capture ignores them)
        # and takes input features exactly when it runs a feature head.
        allow_graph = gr is not None and (capture_layers is None or list(capture_layers) == gr.capture_layers) and (
            features == (gr.features is not None))
        fb, new_regions, graph_key = self._build_forward_batch(batch, mode, allow_graph)
        want_logits, want_argmax = outputs != "argmax", outputs != "logits"
        rows = fb.logits_indices
        extra = {}
        if features:
            extra["input_features"] = torch.cat([sf.input_features for sf in batch]).to(self.device)  # (N, F)
        if graph_key is not None:
            g = gr.replay(graph_key, fb, extra.get("input_features"))  # static outputs, overwritten by the next replay
            n = sum(seq.query_len for seq in fb.seqs)  # real rows; padding follows
            aux = g.features[:n].clone() if capture_layers and g.features is not None else None
            rows_hidden = g.hidden[rows]  # (num_logit_rows, H): gathers copy
            logits = g.logits[rows] if want_logits and rows.shape[0] else None
            argmax = g.argmax[rows] if want_argmax else None
            tree = g.tree if want_argmax else None
            return fb, new_regions, aux, rows_hidden, logits, argmax, tree
        self.attn_backend.init_forward_metadata(fb)
        out = self.model(fb.input_ids, fb.positions, self.attn_backend, self.kv_pool, capture_layers, **extra)
        rows_hidden = out.hidden[rows]  # (num_logit_rows, H)
        all_logits = self.model.compute_logits(rows_hidden) if rows_hidden.shape[0] else None
        argmax = None
        if want_argmax:
            argmax = all_logits.argmax(dim=-1) if all_logits is not None else rows.new_empty(0)
        return fb, new_regions, out.features, rows_hidden, all_logits if want_logits else None, argmax, None

    def _copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy-on-write of a shared cached block a truncation cut into: its first n slots into the private block."""
        if not copies:
            return
        bs = self.block_manager.block_size
        src = [b * bs + i for b, _, n in copies for i in range(n)]
        dst = [d * bs + i for _, d, n in copies for i in range(n)]
        src_t, dst_t = self._long(src + dst).split(len(src))
        self.kv_pool.copy_slots(src_t, dst_t)

    def _state(self, seq_id: str) -> SeqState:
        return seq_state(self._seqs, seq_id)

    def _long(self, values: list[int]) -> torch.Tensor:
        return to_device_long(values, self.device)

    # ---- continuous decode ----------------------------------------------------------------------------------------
    # Greedy decode steps back to back on CUDA graphs with the next input token fed on the device: the overlap idea of
    # SGLang's scheduler applied to plain decoding. The host builds and enqueues step j+1 (KV slots, block tables,
    # positions: all known in advance) while the GPU still runs step j; each replay takes its input token from the
    # previous replay's argmax by a device copy; every step's tokens are read back once at the end. TargetEngine uses
    # it for --num-continuous-decode-steps when every sequence is greedy and no features are asked for. Nothing here
    # samples or checks stops: the caller cuts the run at a stop token or length and drops the rest.
    def can_decode_continuously(self, seq_ids: list[str]) -> bool:
        """Decode graphs exist and every sequence is in plain decode state (no open tree region); not under TP (the
        other ranks mirror host-fed forwards only). Any graph runner with decode graphs will do (CPU tests: fakes)."""
        if self.graph_runner is None or not self.use_cuda_graph or self._mirror is not None:
            return False
        return all(self.has_seq(s) and self.region_start(s) is None for s in seq_ids)

    @torch.inference_mode()
    def greedy_decode_steps(self, seq_ids: list[str], first_tokens: list[int], num_steps: int,
                            prefetch: int = 0) -> list[list[int]]:
        """Per sequence, the greedy tokens of up to num_steps decode steps: step 0 feeds first_tokens, step j the
        token step j-1 produced. Each sequence's KV gains one token per step run. Returns fewer steps (possibly none)
        when a step cannot replay a graph (e.g. a block table outgrew the captured width): the caller continues
        another way.

        prefetch: after enqueuing the run, enqueue up to this many more steps (their KV written past each sequence's
        kv_len, which stays where the run left it) and only then wait for the run's tokens, so the device keeps
        decoding while the host answers this call and takes the next. The next call takes them as its first steps
        when it continues exactly there (the same sequences in the same order, first_tokens = this run's last
        tokens, nothing else run on this runner since, at most num_steps of them); anything else drops them (their
        KV lies past kv_len: never read, rewritten by the next append)."""
        if len(seq_ids) != len(first_tokens) or num_steps < 1 or prefetch < 0:
            raise ValueError("one first token per sequence, num_steps >= 1 and prefetch >= 0")
        b = len(seq_ids)
        produced = self._take_prefetch(seq_ids, first_tokens, num_steps)
        prev = produced[-1] if produced else None
        for step in range(len(produced), num_steps):
            prev = self._decode_step(seq_ids, first_tokens if prev is None else None, prev)
            if prev is None:
                break
            produced.append(prev)
        if not produced:
            return [[] for _ in seq_ids]
        tokens = torch.stack(produced, dim=1)  # (B, steps run)
        if not prefetch or len(produced) < num_steps:
            return tokens.tolist()  # the one readback
        if self.device.type == "cuda":
            host = self._readback.copy(tokens)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            self._prefetch_steps(seq_ids, prev, prefetch)
            ready.synchronize()  # this run's tokens only: the prefetched steps go on running
            out = host.tolist()
        else:  # (no stream to run ahead on: the same steps, one after the other)
            out = tokens.tolist()
            self._prefetch_steps(seq_ids, prev, prefetch)
        if self._prefetch is not None:
            self._prefetch.fed = [row[-1] for row in out]
        return out

    def _decode_step(self, seq_ids: list[str], tokens: list[int] | None, prev: torch.Tensor | None
                     ) -> torch.Tensor | None:
        """One graph-replayed decode step of every sequence, fed `tokens` (host) or `prev` (the last step's argmax,
        by a device copy): the (B,) argmax, or None when no graph fits (nothing ran; the KV reserved stays)."""
        b = len(seq_ids)
        # Placeholder ids when fed on the device: the copy below overwrites them before the replay.
        batch = [SeqForward(s, [t]) for s, t in zip(seq_ids, tokens or [0] * b)]
        self._validate(batch)
        self._reserve_kv(batch)
        fb, _, key = self._build_forward_batch(batch, ForwardMode.DECODE, allow_graph=True)
        if key is None:
            return None
        gr = self.graph_runner
        if prev is not None:
            gr.inputs[0, :b].copy_(prev, non_blocking=True)  # stream-ordered after load_inputs' host copy
        outputs = gr.replay(key, fb)
        for s in seq_ids:
            self._seqs[s].kv_len += 1
        return outputs.argmax[:b].clone()  # the next replay overwrites the static output

    def _prefetch_steps(self, seq_ids: list[str], prev: torch.Tensor, steps: int) -> None:
        """Enqueue up to `steps` decode steps after a run (see greedy_decode_steps) and keep them as the prefetch;
        kv_len is put back where the run ended. Fewer steps (none) when the free KV or a graph runs short."""
        bs = self.block_manager.block_size
        if self.num_free_tokens() < len(seq_ids) * (steps + bs):
            return
        kv_lens = [self._seqs[s].kv_len for s in seq_ids]
        tokens: list[torch.Tensor] = []
        try:
            for _ in range(steps):
                prev = self._decode_step(seq_ids, None, prev)
                if prev is None:
                    break
                tokens.append(prev)
        finally:
            for s, kv_len in zip(seq_ids, kv_lens):
                self._seqs[s].kv_len = kv_len
        if tokens:
            self._prefetch = _Prefetch(tuple(seq_ids), tuple(kv_lens), tokens)

    def _take_prefetch(self, seq_ids: list[str], first_tokens: list[int], num_steps: int) -> list[torch.Tensor]:
        """The prefetched steps' (B,) tokens when this run continues exactly where they started (see
        greedy_decode_steps), their KV then counted in; else none. The prefetch is used up either way."""
        found, self._prefetch = self._prefetch, None
        if (found is None or found.seq_ids != tuple(seq_ids) or found.fed != list(first_tokens)
                or len(found.tokens) > num_steps
                or any(not self.has_seq(s) or self._seqs[s].kv_len != n for s, n in zip(seq_ids, found.kv_lens))):
            return []
        for s in seq_ids:
            self._seqs[s].kv_len += len(found.tokens)
        return list(found.tokens)

    def _drop_prefetch(self, seq_ids) -> None:
        """Any change to these sequences' state ends a prefetch of theirs (other sequences' forwards and lifecycle
        leave it valid: they touch neither these sequences' KV nor the prefetched tokens)."""
        if self._prefetch is not None and not self._prefetch.members.isdisjoint(seq_ids):
            self._prefetch = None

    # Input building (runtime/batch_builder.py) over this runner's sequence states.
    def _validate(self, batch: list[SeqForward]) -> None:
        validate_batch(batch, self._seqs, self.model_config.vocab_size)

    def _reserve_kv(self, batch: list[SeqForward]) -> None:
        reserve_kv(batch, self._seqs, self.block_manager)

    def _build_forward_batch(
        self, batch: list[SeqForward], mode: ForwardMode | None, allow_graph: bool = False
    ) -> tuple[ForwardBatch, dict[str, tuple[int, list[int], list[int]]], tuple[int, int] | None]:
        graphs = self.graph_runner if allow_graph and self.use_cuda_graph else None
        return build_forward_batch(batch, self._seqs, self.block_manager, self.device, mode, graphs)

    def stop_workers(self) -> None:
        """Rank 0 of a TP group: let the other ranks' `run_worker` loops return (at shutdown)."""
        if self._mirror is not None:
            self._mirror.stop()
            self._mirror = None


def _resolve_backend(name: str, device: torch.device) -> str:
    """'auto' = triton on CUDA when it is installed (graphs need it), torch elsewhere."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
