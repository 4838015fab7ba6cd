"""CUDA-graph code paths on CPU: the graph runner's real bucketing, padding, static buffers and output gathering,
with the capture replaced by a fake that re-runs the captured computation into the same static outputs. The triton
attention backend (the one with static graph metadata) runs through the Triton interpreter, which must be switched
on before triton decorates any kernel, hence here at conftest import. Without triton every test here is skipped."""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

try:
    import triton  # noqa: F401  (only probing that it is installed)
except ImportError:
    collect_ignore_glob = ["test_*.py"]
