"""Shared pieces of the real-process tests: free loopback ports and a tiny random checkpoint that carries the bundled
tokenizer (so the gateway can start) while staying cheap enough for long streams on 2 CPU cores."""
from __future__ import annotations

import shutil
from pathlib import Path

from tandem.args import DEFAULT_MODEL
from tests.tiny_models import make_tiny_model
from tandem.launch import free_port  # noqa: F401 (the tests' port helper)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_model_with_tokenizer(root: Path, **overrides) -> Path:
    """A tiny random Llama with the bundled tokenizer's vocabulary and files."""
    path = Path(make_tiny_model("llama", root, vocab_size=8192, **overrides))
    for name in TOKENIZER_FILES:
        if (DEFAULT_MODEL / name).exists():
            shutil.copy(DEFAULT_MODEL / name, path / name)
    return path
