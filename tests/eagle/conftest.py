"""Fixtures for the EAGLE-family tests: one tiny Llama target and heads in the published layouts beside it."""
from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def eagle_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="session")
def target_path(eagle_dir) -> str:
    return make_tiny_model("llama", os.path.join(eagle_dir, "target"))
