"""Model registry: HF architecture name -> model class. Model modules register themselves on import; `get_model_class`
imports the known ones lazily so `import runtime.models` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Callable

_REGISTRY: dict[str, type] = {}
_LAZY: dict[str, str] = {
    "LlamaForCausalLM": "runtime.models.llama",
    "MistralForCausalLM": "runtime.models.llama",
    "Qwen2ForCausalLM": "runtime.models.llama",
    "Qwen3ForCausalLM": "runtime.models.llama",
    # Feature-based draft heads: built by their own loaders (they share tensors with the target), see eagle*.py.
    "LlamaForCausalLMEagle": "runtime.models.eagle",
    "LlamaForCausalLMEagle3": "runtime.models.eagle3",
    "DFlashDraftModel": "runtime.models.dflash",  # block draft, built by load_dflash_draft (target embed/lm_head)
}


def register_model(*architectures: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        for arch in architectures:
            _REGISTRY[arch] = cls
        return cls

    return deco


def get_model_class(architecture: str) -> type:
    if architecture not in _REGISTRY and architecture in _LAZY:
        importlib.import_module(_LAZY[architecture])
    try:
        return _REGISTRY[architecture]
    except KeyError:
        known = sorted(set(_REGISTRY) | set(_LAZY))
        raise ValueError(f"no model registered for architecture {architecture!r}; known: {', '.join(known)}") from None
