"""CUDA-graph code paths on CPU: the graph runner's real bucketing, padding, static buffers and output gathering,
with the capture replaced by a fake that re-runs the captured computation into the same static outputs. The triton
attention backend (the one with static graph metadata) runs through the Triton interpreter, which must be switched
on before triton decorates any kernel, hence here at conftest import. Without triton every test here is skipped."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
elif os.environ.get("TRITON_INTERPRET") != "1":  # a GPU box: tests/gpu/test_graph_coverage_gpu.py runs these paths
    collect_ignore_glob = ["test_*.py"]  # with real capture (CPU-device triton needs the interpreter)
