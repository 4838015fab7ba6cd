"""Start a tensor-parallel target: rank 0 (this process) serves gRPC; ranks 1..N-1 are spawned worker processes that
load their weight shards and replay rank 0's steps (`runtime.distributed.run_worker`) until rank 0 stops them.

Owns process start-up and device placement per rank; knows nothing about the wire or about sampling.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from dataclasses import replace

import torch

from runtime.config import EngineConfig
from runtime.distributed import destroy_tp, init_tp, run_worker
from runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def rank_device(device: str, rank: int, base_gpu_id: int | None = None) -> str:
    """Device of one rank: cuda:(base_gpu_id + rank) when base_gpu_id is set; "cuda" / "cuda:K" → cuda:K+rank;
    every CPU rank runs on the CPU."""
    if base_gpu_id is not None:
        return f"cuda:{base_gpu_id + rank}"
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TPLauncher:
    """Rank 0's handle on the worker ranks: spawn them, build rank 0's runner alongside, stop them at shutdown."""

    def __init__(self, model_path: str | None, engine_config: EngineConfig, tp_size: int,
                 master_addr: str = "127.0.0.1", master_port: int | None = None) -> None:
        self.model_path = model_path
        self.engine_config = engine_config
        self.tp_size = tp_size
        self.master_addr = master_addr
        self.master_port = master_port or free_port(master_addr)
        self.procs: list[mp.Process] = []
        self.runner: ModelRunner | None = None

    def start(self) -> ModelRunner:
        """Spawn ranks 1..N-1, then build rank 0's runner (returns once every rank has loaded its shard)."""
        ctx = mp.get_context("spawn")  # fork would copy CUDA state and the event loop
        for rank in range(1, self.tp_size):
            cfg = replace(self.engine_config, device=rank_device(self.engine_config.device, rank))
            proc = ctx.Process(target=worker_main, name=f"tandem-tp-{rank}", daemon=True,
                               args=(self.model_path, cfg, rank, self.tp_size, self.master_addr, self.master_port))
            proc.start()
            self.procs.append(proc)
        cfg = replace(self.engine_config, device=rank_device(self.engine_config.device, 0))  # "cuda" -> "cuda:0"
        self.runner = build_rank_runner(self.model_path, cfg, 0, self.tp_size, self.master_addr, self.master_port)
        return self.runner

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.runner is not None:
            self.runner.stop_workers()
        for proc in self.procs:
            proc.join(timeout=timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=timeout_s)
        destroy_tp()


def build_rank_runner(model_path: str | None, engine_config: EngineConfig, rank: int, size: int, master_addr: str,
                      master_port: int) -> ModelRunner:
    tp = init_tp(rank, size, master_addr, master_port, engine_config.device)
    return ModelRunner(model_path, engine_config, tp=tp)


def worker_main(model_path: str | None, engine_config: EngineConfig, rank: int, size: int, master_addr: str,
                master_port: int) -> None:
    """Entry point of ranks > 0."""
    runner = build_rank_runner(model_path, engine_config, rank, size, master_addr, master_port)
    try:
        run_worker(runner)
    finally:
        destroy_tp()
