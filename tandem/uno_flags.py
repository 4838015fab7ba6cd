"""UNO's start-up checks beyond its shape (core/algorithms.uno_shape): the flags SGLang's `_handle_uno` refuses, with
its messages, and the LoRA path (--uno-lora-path, else $UNO_LORA_PATH, else the bundled adapter of the bundled target).
Torch-free; named by the UNO registry entry (`check_flags`) and run by tandem/args.resolve_spec.

Where Tandem differs: SGLang's UNO is CUDA-only with FA3; Tandem's runs on any device and attention backend.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def check(args: argparse.Namespace) -> None:
    """Raise ValueError with SGLang's message for what UNO refuses; set args.uno_lora_path to the adapter folder."""
    from core import algorithms
    from tandem.args import DEFAULT_MODEL, REPO_ROOT, model_path

    if getattr(args, "speculative_draft_model_path", None):
        raise ValueError("UNO reuses the target model and does not accept --speculative-draft-model-path.")
    if getattr(args, "tp_size", 1) != 1:
        raise ValueError("UNO requires TP=PP=1.")
    if getattr(args, "speculative_use_rejection_sampling", False):
        raise ValueError("UNO manages its own stochastic verification and does not use "
                         "--speculative-use-rejection-sampling.")
    tree_mode = (getattr(args, "speculative_eagle_topk", None) or 1) > 1
    if tree_mode and (getattr(args, "speculative_accept_threshold_single", 1.0) != 1.0
                      or getattr(args, "speculative_accept_threshold_acc", 1.0) != 1.0):
        raise ValueError("UNO tree mode reuses EAGLE target-only sampling and requires both speculative accept "
                         "thresholds to be 1.0.")
    path = getattr(args, "uno_lora_path", None) or os.environ.get("UNO_LORA_PATH") or None
    if path is None and Path(model_path(args)).resolve() == DEFAULT_MODEL.resolve():
        path = str(REPO_ROOT / "models" / algorithms.get(args.speculative_algorithm).bundled_draft)
    if path is None:
        raise ValueError("UNO requires --uno-lora-path.")
    # (the gateway never reads the adapter: it need not be mounted there)
    if getattr(args, "command", None) != "gateway" and not (Path(path) / "adapter_config.json").is_file():
        raise ValueError(f"--uno-lora-path {path}: not a PEFT LoRA adapter folder (no adapter_config.json)")
    args.uno_lora_path = path
