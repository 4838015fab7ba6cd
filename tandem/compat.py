"""SGLang commands as written: the SGLang flags Tandem does not act on are accepted by the parser and then refused at
start-up with one line saying why (not supported yet / not applicable), and flags that would do nothing in the chosen
configuration get one warning each instead of silence.

Knows flag names and values only (no torch beyond `resolve_device`); `docs/speculative_decoding.md` lists the same
statuses and its test checks that every flag there parses.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from core import algorithms
from core.algorithms import DraftModel
from tandem.args import colocates_draft
from tandem.verify_flags import verify_notes

@dataclass(frozen=True)
class CompatFlag:
    """One SGLang flag that Tandem parses but does not act on. `neutral` values (SGLang's default) change nothing and
    pass; any other value is refused with `reason`. A flag with `warn_only` is never refused: it is ignored with
    `reason` as the warning."""

    flag: str
    reason: str
    kind: type | None = str  # None = a store_true switch
    default: object = None
    neutral: tuple = ()
    choices: tuple | None = None
    warn_only: bool = False
    help: str = ""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


NOT_YET = "not supported yet"
NOT_HERE = "not applicable to this deployment"
COMPAT_FLAGS = (
    CompatFlag("--speculative-draft-model-revision", f"{NOT_HERE}: Tandem loads local checkpoint folders, never a "
               "hub revision; pass the downloaded folder to --speculative-draft-model-path",
               help="SGLang: hub revision of the draft model"),
    CompatFlag("--speculative-draft-model-quantization", f"{NOT_YET}: quantized weights", str, None, ("unquant",),
               help="SGLang: quantization of the draft model; only unquant here"),
    CompatFlag("--speculative-moe-runner-backend", f"{NOT_HERE}: Tandem's models (Llama, Qwen2/3, Mistral) have no "
               "MoE layers", help="SGLang: MoE runner of the draft model"),
    CompatFlag("--speculative-moe-a2a-backend", f"{NOT_HERE}: Tandem's models (Llama, Qwen2/3, Mistral) have no MoE "
               "layers", help="SGLang: MoE all-to-all backend of the draft model"),
    CompatFlag("--speculative-dsa-topk-backend", f"{NOT_HERE}: DeepSeek sparse attention models are not supported",
               help="SGLang: DSA top-k backend of the draft"),
    CompatFlag("--speculative-skip-dp-mlp-sync", f"{NOT_HERE}: there is no data-parallel attention", None, False,
               help="SGLang: skip the DP MLP sync of EAGLE drafts"),
    CompatFlag("--enable-dp-attention", f"{NOT_HERE}: data-parallel attention is for MoE/MLA models; Tandem scales "
               "data-parallel with --num-target-replicas", None, False,
               help="SGLang: data-parallel attention"),
    CompatFlag("--enable-two-batch-overlap", f"{NOT_HERE}: two-batch overlap hides MoE expert-parallel "
               "communication, and Tandem's models have no MoE layers", None, False,
               help="SGLang: overlap two micro-batches"),
    CompatFlag("--trust-remote-code", "no effect: Tandem runs its own code for the Llama family (Llama, Qwen2/3, "
               "Mistral) and never executes a checkpoint's Python", None, False, warn_only=True,
               help="SGLang: allow custom model code from the checkpoint; a no-op here"),
)
SERVICE_COMMANDS = ("serve", "target", "draft", "gateway")


def add_sglang_compat_args(p: argparse.ArgumentParser) -> None:
    """The SGLang flags of COMPAT_FLAGS, in their own help group, so SGLang commands parse."""
    g = p.add_argument_group("SGLang flags Tandem parses but does not act on (see docs/speculative_decoding.md)")
    for f in COMPAT_FLAGS:
        suffix = f" (Tandem: {f.reason})"
        if f.kind is None:
            g.add_argument(f.flag, action="store_true", help=f.help + suffix)
        else:
            g.add_argument(f.flag, type=f.kind, default=f.default, choices=f.choices, help=f.help + suffix)


def check_unsupported(args: argparse.Namespace) -> None:
    """Exit with one line when the command asks for something Tandem does not do; print the no-op notes."""
    algorithm = (getattr(args, "speculative_algorithm", None) or algorithms.NONE.name).upper()
    entry = algorithms.get(algorithm)  # the parser's choices are the registry's names
    if entry.unsupported:
        raise SystemExit(f"error: --speculative-algorithm {algorithm}: {entry.unsupported}")
    for f in COMPAT_FLAGS:
        value = getattr(args, f.dest, None)
        if value is None or value is False or value in f.neutral:
            continue
        if f.warn_only:
            _warn(args, f"{f.flag}: {f.reason}")
            continue
        shown = "" if f.kind is None else f" {value}"
        raise SystemExit(f"error: {f.flag}{shown}: {f.reason}")
    from tandem.args import model_path, mtp_layers

    given = getattr(args, "speculative_draft_model_path", None)
    target = model_path(args)
    if (entry.mtp_draft == "always" and given and mtp_layers(target)
            and Path(given).resolve() != Path(target).resolve()):
        _warn(args, f"--speculative-draft-model-path {given} is not needed: {target} has its own MTP layers "
                    f"(num_nextn_predict_layers), which draft for {entry.name}")


def resolve_device(device: str) -> str:
    """--device auto = cuda when torch sees a GPU (SGLang's behaviour), else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def startup_warnings(args: argparse.Namespace, defaults: dict[str, object]) -> list[str]:
    """One line per flag that does nothing in this configuration (call after resolve_spec and resolve_device).
    Drops the ignored values that would otherwise break a child (an FR-Spec map given to an EAGLE-3 draft).
    defaults: the parser's defaults by dest, to tell a flag the user gave from one left alone."""
    notes = []
    entry = algorithms.get(getattr(args, "speculative_algorithm", None))

    def given(dest: str) -> bool:
        return hasattr(args, dest) and getattr(args, dest) != defaults.get(dest)

    if getattr(args, "speculative_token_map", None) and entry.token_map_ignored:
        notes.append(f"--speculative-token-map is ignored for {_algo(entry)}: {entry.token_map_ignored}")
        args.speculative_token_map = None
    if getattr(args, "enable_overlap_drafting", False) and not entry.supports_overlap:
        overlap = " / ".join(algorithms.names(lambda a: a.supports_overlap))
        notes.append(f"--enable-overlap-drafting is ignored for {_algo(entry)}: only {overlap} drafts pre-draft "
                     "the next step")
    if getattr(args, "enable_multi_layer_eagle", False) and getattr(args, "enable_overlap_drafting", False):
        notes.append("--enable-overlap-drafting is ignored with multi-layer EAGLE: each MTP layer drafts one step of "
                     "a fixed-depth chain, there is no head to run over a guessed path")
        args.enable_overlap_drafting = False
    if getattr(args, "enable_multi_layer_eagle", False) and getattr(args, "speculative_adaptive", False):
        notes.append("--speculative-adaptive is disabled with multi-layer EAGLE: it drafts one MTP layer per step, "
                     "a chain of fixed depth")  # as SGLang does
        args.speculative_adaptive = False
    if (entry.name == "NGRAM" and getattr(args, "speculative_ngram_external_corpus_path", None)
            and not getattr(args, "speculative_ngram_external_sam_budget", 0)):
        notes.append("--speculative-ngram-external-corpus-path drafts nothing with --speculative-ngram-external-sam-"
                     "budget 0 (SGLang's default): give the corpora some of the tree's nodes, e.g. "
                     "--speculative-ngram-external-sam-budget 4")
    if getattr(args, "speculative_adaptive_config", None) and not getattr(args, "speculative_adaptive", False):
        notes.append("--speculative-adaptive-config is ignored without --speculative-adaptive")
    for other in algorithms.ALGORITHMS.values():  # another algorithm's own flags (e.g. --uno-lora-path for EAGLE3)
        if other is not entry:
            notes += [f"{f.flag} is ignored for {_algo(entry)}: it is {other.name}'s" for f in other.flags
                      if given(f.dest) and getattr(args, f.dest) not in (None, False)]
    if entry.drafts_on_target:  # UNO: the target pods draft; `serve` starts no draft process
        notes += [f"--{d.replace('_', '-')} is ignored for {entry.name}: the target pods draft (no draft process)"
                  for d in ("num_draft_replicas", "draft_port", "draft_base_gpu_id") if given(d)]
    if getattr(args, "colocate_draft", False):
        if not colocates_draft(args):
            notes.append(f"--colocate-draft is ignored for {_algo(entry)}: "
                         + ("its target pods draft anyway" if entry.drafts_on_target else "nothing drafts"))
        else:
            notes += [f"--{d.replace('_', '-')} is ignored with --colocate-draft: the draft runs in the target's "
                      "process (--no-colocate-draft: a draft process of its own)"
                      for d in ("num_draft_replicas", "draft_port", "draft_base_gpu_id") if given(d)]
            if getattr(args, "enable_overlap_drafting", False):
                notes.append("--enable-overlap-drafting is ignored with --colocate-draft: a pre-draft needs the draft "
                             "beside the target, not in its process (each Verify drafts the next tree instead)")
                args.enable_overlap_drafting = False
    notes += verify_notes(args)
    if entry.draft_model is DraftModel.NONE:
        for dest in ("speculative_draft_model_path", "speculative_draft_load_format",
                     "speculative_draft_attention_backend"):
            if getattr(args, dest, None):
                notes.append(f"--{dest.replace('_', '-')} is ignored for {_algo(entry)}: there is no draft model")
    device = str(getattr(args, "device", "cpu"))
    if device.startswith("cpu") and getattr(args, "base_gpu_id", None) is None \
            and getattr(args, "draft_base_gpu_id", None) is None:
        cuda_only = [d for d in ("mem_fraction_static", "cuda_graph_max_bs", "cuda_graph_max_bs_decode",
                                 "disable_cuda_graph", "enable_torch_compile", "torch_compile_max_bs") if given(d)]
        if cuda_only:
            flags = ", ".join("--" + d.replace("_", "-") for d in cuda_only)
            notes.append(f"{flags}: CUDA only, no effect on --device {device}")
    return notes


def _algo(entry: algorithms.SpeculativeAlgorithm) -> str:
    return entry.name if entry.drafts else "plain decoding (no --speculative-algorithm)"


def _warn(args: argparse.Namespace, line: str) -> None:
    if not getattr(args, "no_startup_notes", False):
        print(f"warning: {line}", file=sys.stderr, flush=True)


def print_startup_warnings(args: argparse.Namespace, defaults: dict[str, object]) -> None:
    for line in startup_warnings(args, defaults):
        _warn(args, line)
