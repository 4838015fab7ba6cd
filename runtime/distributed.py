"""Tensor parallelism: the process group of one model's ranks, its collectives, the per-rank shard shapes of a
Llama-family decoder, and the step mirroring that keeps every rank's ModelRunner in lock-step with rank 0's.

Rank 0 owns every decision (scheduling, sampling, acceptance); it records each KV-state change its runner makes
(add/free/truncate/compact) and broadcasts them, with the next forward, to the other ranks, which replay them on
their own runner and join the forward's collectives. Ranks therefore never sample and cannot disagree on accepted
tokens: they apply rank 0's accepted-node lists to their own KV heads. Knows nothing about gRPC or the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from runtime.config import ModelConfig
    from runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# Worker ranks wait in a broadcast for the next step while the server is idle; the default gloo timeout (30 min)
# would kill an idle TP target. The control group therefore waits (practically) forever.
_IDLE_TIMEOUT = timedelta(days=365)


class TPGroup:
    """One tensor-parallel group: rank, size, the collective group (nccl on CUDA, gloo on CPU) and a gloo group
    for small pickled control messages (a CPU group even under NCCL, as SGLang's cpu_group)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.group = dist.group.WORLD
        self.cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT) if device.type == "cuda" else self.group

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; x: any shape."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) per rank -> (..., size * d), rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (pickled over the gloo group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


def init_tp(rank: int, size: int, master_addr: str, master_port: int, device: torch.device | str) -> TPGroup:
    """Join the TP process group (env-style rendezvous at master_addr:master_port, chosen by the launcher)."""
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=size, timeout=_IDLE_TIMEOUT)
    return TPGroup(rank, size, device)


def destroy_tp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class TPShard:
    """This rank's share of a Llama-family decoder. Query heads, the MLP width and the vocabulary are split evenly;
    KV heads are split when num_kv_heads % size == 0, and replicated (each rank holds the one KV head its query
    heads read) when size is a multiple of num_kv_heads. lm_head rows are split over a vocabulary padded to a
    multiple of size; the padded rows are zero and cut off after the all-gather."""

    rank: int
    size: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # first global KV head this rank holds
    intermediate_size: int  # local MLP width
    vocab_per_rank: int  # lm_head rows per rank (padded vocabulary / size)

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> TPShard:
        check_tp_size(config, size)
        heads = config.num_heads // size
        if config.num_kv_heads % size == 0:
            kv_heads, kv_start = config.num_kv_heads // size, rank * (config.num_kv_heads // size)
        else:  # size % num_kv_heads == 0: the GQA group of this rank's query heads shares one KV head
            kv_heads, kv_start = 1, rank * config.num_kv_heads // size
        return cls(rank, size, heads, kv_heads, kv_start, config.intermediate_size // size,
                   -(-config.vocab_size // size))

    @property
    def q_rows(self) -> slice:
        return slice(self.rank * self.num_heads, (self.rank + 1) * self.num_heads)

    @property
    def kv_rows(self) -> slice:
        return slice(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def mlp_rows(self) -> slice:
        return slice(self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size)

    @property
    def vocab_rows(self) -> slice:
        return slice(self.rank * self.vocab_per_rank, (self.rank + 1) * self.vocab_per_rank)


def check_tp_size(config: ModelConfig, size: int) -> None:
    if size < 1:
        raise ValueError(f"tp_size must be >= 1, got {size}")
    if config.num_heads % size:
        raise ValueError(f"tp_size={size} must divide num_heads={config.num_heads}")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        raise ValueError(f"tp_size={size} must divide num_kv_heads={config.num_kv_heads} or be a multiple of it")
    if config.intermediate_size % size:
        raise ValueError(f"tp_size={size} must divide intermediate_size={config.intermediate_size}")


# ---- step mirroring ----------------------------------------------------------------------------------------------
_STOP = "stop"


class StepMirror:
    """Rank 0 side: queues the KV-state changes of its runner and ships them with each forward."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self._ops: list[tuple[str, tuple]] = []

    def record(self, op: str, *args: Any) -> None:
        self._ops.append((op, args))

    def forward(self, batch: list, capture_layers: list[int] | None, mode: Any) -> None:
        """Announce a forward (after the queued state changes); every rank then runs it with rank 0."""
        batch = [_to_cpu(sf) for sf in batch]
        ops, self._ops = self._ops, []
        self.tp.broadcast_object(("forward", ops, batch, capture_layers, mode))

    def stop(self) -> None:
        self.tp.broadcast_object((_STOP, self._ops, None, None, None))
        self._ops = []


def run_worker(runner: ModelRunner) -> None:
    """Ranks > 0: replay rank 0's state changes and forwards until rank 0 stops. A forward rank 0 refused before
    any collective (bad input, no KV) is refused here the same way, since both runners hold the same state."""
    from runtime.kv_cache import OutOfKVBlocks
    from runtime.model_runner import UnknownSeq

    tp = runner.tp
    while True:
        kind, ops, batch, capture_layers, mode = tp.broadcast_object()
        for op, args in ops:
            getattr(runner, op)(*args)
        if kind == _STOP:
            return
        try:
            runner.forward(batch, capture_layers=capture_layers, mode=mode)
        except (ValueError, UnknownSeq, OutOfKVBlocks) as exc:
            logger.debug("rank %d: forward refused as on rank 0: %s", tp.rank, exc)


def _to_cpu(sf):
    if sf.input_features is None or sf.input_features.device.type == "cpu":
        return sf
    from dataclasses import replace

    return replace(sf, input_features=sf.input_features.cpu())
