"""Kernel tests run the Triton kernels at small sizes: on CUDA when there is a GPU, otherwise on CPU through the
Triton interpreter. TRITON_INTERPRET must be set before triton decorates any kernel, hence at conftest import.
Without triton installed every test here is skipped.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

try:
    import triton  # noqa: F401  (only probing that it is installed)
except ImportError:  # collect_ignore keeps pytest from importing test modules that need triton
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
