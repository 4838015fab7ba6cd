"""GPU tests at real sizes (Llama-3.1-8B attention shapes, bf16). Every module skips itself at import, before it
touches triton, when there is no CUDA device or TRITON_INTERPRET is set; importing triton here first would decorate
the kernels for the GPU and break the interpreter-mode tests in tests/kernels when both run in one session."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

GPU_OK = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def skip_without_gpu() -> None:
    """Call at the top of a test module, before importing kernels."""
    if not GPU_OK:
        pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)", allow_module_level=True)
    pytest.importorskip("triton")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda")
