"""Device-memory sizing: how many KV blocks fit under `--mem-fraction-static` (SGLang-style: weights + KV pool take
that fraction of the GPU; activations, CUDA graphs and the allocator's slack live in the rest), and the typed error
raised when a model, a batch or a tree does not fit.

Pure arithmetic plus one probe of the device; knows nothing about sequences. The measured plan is returned to the
caller (the ModelRunner keeps it as `memory_plan`), never written back into the config.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from runtime.config import ModelConfig
from runtime.kv_cache import OutOfKVBlocks

GiB = 1 << 30
# Kept free beyond the measured activation peak: CUDA graph pools, cuBLAS workspaces, fragmentation.
DEFAULT_RESERVE_BYTES = 1 * GiB


class OutOfDeviceMemory(OutOfKVBlocks):
    """A model, batch or tree does not fit in device memory. Raised before or instead of a CUDA crash, leaving every
    sequence as it was; a subclass of OutOfKVBlocks so callers that fail a batch on KV exhaustion (the target engine
    answers OUT_OF_MEMORY) treat it the same way."""

    def __init__(self, message: str, num_needed: int = 0, num_free: int = 0) -> None:
        RuntimeError.__init__(self, message)
        self.num_needed = num_needed
        self.num_free = num_free


def accelerator_id(device: torch.device | str) -> str:
    """The physical device a service computes on, the same string in every process that uses it: "cuda:<GPU UUID>"
    (CUDA_VISIBLE_DEVICES renumbers GPUs per process, the UUID does not) or "cpu@<host>"."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_properties(device).uuid}"
    return f"{device.type}@{socket.gethostname()}"


@dataclass(frozen=True)
class MemoryPlan:
    """What profiling measured and decided, in bytes unless named otherwise."""

    total_bytes: int  # the device's memory
    weights_bytes: int  # allocated after loading the model
    activation_peak_bytes: int  # peak extra allocation of the warm-up forward
    free_bytes: int  # free on the device after the warm-up (other processes included)
    kv_bytes_per_block: int
    num_kv_blocks: int
    mem_fraction_static: float

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block


def auto_mem_fraction_static(total_bytes: int) -> float:
    """--mem-fraction-static when omitted on CUDA, as SGLang chooses it: what the GPU leaves after a reserve for
    activations, CUDA graphs and workspaces (2 GiB + 10%, at least 10 GiB on GPUs over 60 GiB): 0.82 of a 24 GiB
    GPU, 0.88 of an 80 GiB one, 0.89 of an H200."""
    reserve = 2 * GiB + total_bytes // 10
    if total_bytes > 60 * GiB:
        reserve = max(reserve, 10 * GiB)
    return round(max(0.1, min(0.9, (total_bytes - reserve) / total_bytes)), 3)


def draft_memory_part(draft_bytes: float, target_bytes: float) -> float:
    """The part of a GPU's static memory a draft model gets beside its target: in proportion to the checkpoint sizes,
    within 10%..50% (both in one process with --colocate-draft, or two processes sharing the GPU)."""
    return min(0.5, max(0.1, draft_bytes / (draft_bytes + target_bytes)))


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * element


def plan_kv_blocks(
    *, total_bytes: int, free_bytes: int, weights_bytes: int, activation_peak_bytes: int, bytes_per_block: int,
    mem_fraction_static: float, reserve_bytes: int = DEFAULT_RESERVE_BYTES,
) -> MemoryPlan:
    """KV blocks = min(what the static fraction leaves after the weights, what is free after keeping room for the
    activation peak and the reserve). Raises OutOfDeviceMemory when not even one block fits."""
    static_budget = int(total_bytes * mem_fraction_static) - weights_bytes
    free_budget = free_bytes - activation_peak_bytes - reserve_bytes
    num_blocks = min(static_budget, free_budget) // bytes_per_block
    if num_blocks < 1:
        raise OutOfDeviceMemory(
            f"no room for the KV cache: --mem-fraction-static {mem_fraction_static} of {total_bytes / GiB:.1f} GiB "
            f"with {weights_bytes / GiB:.2f} GiB of weights leaves {static_budget / GiB:.2f} GiB; "
            f"{free_bytes / GiB:.2f} GiB free minus {activation_peak_bytes / GiB:.2f} GiB activation peak and "
            f"{reserve_bytes / GiB:.2f} GiB reserve leaves {free_budget / GiB:.2f} GiB. Raise --mem-fraction-static, "
            "free the GPU, or use a smaller model"
        )
    return MemoryPlan(total_bytes=total_bytes, weights_bytes=weights_bytes,
                      activation_peak_bytes=activation_peak_bytes, free_bytes=free_bytes,
                      kv_bytes_per_block=bytes_per_block, num_kv_blocks=int(num_blocks),
                      mem_fraction_static=mem_fraction_static)


class DeviceMemoryProbe:
    """Reads the allocator around a warm-up: bytes allocated before it, its peak, and the device's free memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        self.allocated_before = torch.cuda.memory_allocated(device)

    def finish(self) -> tuple[int, int, int]:
        """(activation peak, free bytes, total bytes) after the warm-up."""
        torch.cuda.synchronize(device=self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self.allocated_before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return peak, free, total
