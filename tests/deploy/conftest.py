"""Fixtures for the deployment tests: a tiny model folder with a real tokenizer, free ports, deadline polling."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tandem.args import DEFAULT_MODEL
from tandem.launch import free_port  # noqa: F401 (the tests' port helper)

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll `predicate` until it returns a truthy value (returned) or the deadline passes (TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # not up yet
            last_error = exc
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached within {timeout_s:.0f}s (last error: {last_error!r})")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The bundled model when its weights exist, else a random tiny Llama with the bundled tokenizer (vocab 8192)."""
    if (DEFAULT_MODEL / "config.json").exists() and any(DEFAULT_MODEL.glob("*.safetensors")):
        return DEFAULT_MODEL
    if not (DEFAULT_MODEL / "tokenizer.json").exists():
        pytest.skip(f"{DEFAULT_MODEL} has no tokenizer yet")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("model") / "tandem-tiny-random"
    cfg = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (DEFAULT_MODEL / name).exists():
            shutil.copy(DEFAULT_MODEL / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return folder
