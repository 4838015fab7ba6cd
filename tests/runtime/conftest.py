"""Fixtures for runtime tests: tiny HF checkpoints (built once per session) and their HF oracles."""

from __future__ import annotations

import os
import sys

import pytest

# `tests` is not an installed package; make `tests.tiny_models` importable however pytest was started.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.tiny_models import load_hf_model, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """family -> (checkpoint path, HF oracle model); cached per session."""
    cache: dict[str, tuple[str, object]] = {}

    def get(family: str) -> tuple[str, object]:
        if family not in cache:
            path = make_tiny_model(family, tiny_dir)
            cache[family] = (path, load_hf_model(path))
        return cache[family]

    return get
