"""Every kernel compiles for an H100/H200 (sm_90) at Llama-3.1-8B shapes, without a GPU. Triton's ahead-of-time
path (ttir -> ptx -> cubin) catches what the interpreter lets through: non-constexpr globals, loop-carried type
changes, tl.dot shapes the hardware cannot do, shared memory overflow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile_all(module: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", module], cwd=_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.stdout.startswith("skip:"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_all_kernels_compile_for_sm90():
    assert _compile_all("tests.kernels.sm90_compile").count(": ok") == 10


def test_the_step_kernels_compile_for_sm90():
    """The speculative steps' own kernels (topk, tree levels and selection, region mask, packed walk, chain glue)."""
    assert _compile_all("tests.kernels.sm90_compile_steps").count(": ok") == 18
