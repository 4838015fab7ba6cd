"""SGLang's verify knobs (reference §3.2, §3.3, §3.5, appendix A): the accept thresholds, p/q rejection sampling, the
attention mode of verify and draft extend, and SGLANG_NGRAM_FORCE_GREEDY_VERIFY. Their flags, SGLang's validation
errors, and the start-up notes they call for.

Knows flag names and values only; the target (thresholds, rejection) and the EAGLE draft (rejection) act on them.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from core import algorithms

ATTENTION_MODES = ("prefill", "decode")
NGRAM_FORCE_GREEDY_ENV = "SGLANG_NGRAM_FORCE_GREEDY_VERIFY"


def add_verify_args(g: argparse._ArgumentGroup) -> None:
    """The verify flags, into the speculative-decoding group of every service command."""
    g.add_argument("--speculative-accept-threshold-single", type=float, default=1.0,
                   help="target, sampled requests: accept a draft token outright when its target probability is >= "
                        "this. LOSSY below 1 (outputs no longer follow the target distribution); 1 = exact")
    g.add_argument("--speculative-accept-threshold-acc", type=float, default=1.0,
                   help="target, sampled requests: raise each draft level's (cumulative) acceptance probability from "
                        "P to min(1, P / this). LOSSY below 1; 1 = exact")
    g.add_argument("--speculative-use-rejection-sampling", action="store_true",
                   help="EAGLE/EAGLE3 chains (topk 1, thresholds 1): the draft samples each token of sampled "
                        "requests from q (the request's temperature/top-k/top-p over the head's logits) and sends q "
                        "along; the target verifies by p/q rejection sampling (Leviathan/Chen; exact) instead of "
                        "target-only tree sampling. Greedy requests are unaffected")
    g.add_argument("--speculative-attention-mode", default="prefill", choices=ATTENTION_MODES,
                   help="SGLang: which of a hybrid setup's backends (--prefill- / --decode-attention-backend) runs "
                        "target verify and draft extend. Tandem has one backend per model service "
                        "(--attention-backend, --speculative-draft-attention-backend) that picks its kernel from the "
                        "forward's shape, so both modes run the same kernels: verify and draft extend use its "
                        "prefill-style masked kernels. Accepted; changes nothing")


def check_verify_args(args: argparse.Namespace) -> None:
    """SGLang's validation of the verify knobs (call after resolve_spec): exit with one line when they conflict."""
    single = getattr(args, "speculative_accept_threshold_single", 1.0)
    acc = getattr(args, "speculative_accept_threshold_acc", 1.0)
    for flag, value in (("single", single), ("acc", acc)):
        if not 0.0 < value <= 1.0:  # NaN fails this too
            raise SystemExit(f"error: --speculative-accept-threshold-{flag} must be in (0, 1], got {value}")
    if not getattr(args, "speculative_use_rejection_sampling", False):
        return
    algorithm = getattr(args, "speculative_algorithm", None)
    entry = algorithms.find(algorithm)
    if entry is None or not entry.supports_rejection_sampling:
        able = [a for a in algorithms.ALGORITHMS.values() if a.supports_rejection_sampling]
        names = " / ".join([a.name for a in able] + [alias for a in able for alias in a.aliases])
        raise SystemExit(f"error: --speculative-use-rejection-sampling is only supported for {names}, "
                         f"not speculative_algorithm={algorithm or 'NONE'}")
    if args.speculative_eagle_topk != 1:
        raise SystemExit("error: --speculative-use-rejection-sampling requires --speculative-eagle-topk=1 "
                         f"(got {args.speculative_eagle_topk}): p/q rejection verifies chains only")
    if single != 1.0 or acc != 1.0:
        raise SystemExit("error: --speculative-use-rejection-sampling is incompatible with "
                         "--speculative-accept-threshold-single / --speculative-accept-threshold-acc; rejection "
                         "sampling ignores the accept thresholds")


def verify_notes(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> list[str]:
    """Start-up warnings: lossy thresholds (the commands that verify), and SGLANG_NGRAM_FORCE_GREEDY_VERIFY."""
    environ = os.environ if environ is None else environ
    notes = []
    entry = algorithms.find(getattr(args, "speculative_algorithm", None))
    single = getattr(args, "speculative_accept_threshold_single", 1.0)
    acc = getattr(args, "speculative_accept_threshold_acc", 1.0)
    if (single < 1.0 or acc < 1.0) and getattr(args, "command", "serve") in ("serve", "target"):
        if entry is None or not entry.drafts:
            notes.append("--speculative-accept-threshold-single/-acc are ignored without --speculative-algorithm")
        else:
            notes.append(f"--speculative-accept-threshold-single {single} / --speculative-accept-threshold-acc {acc}: "
                         "LOSSY verification: sampled requests accept draft tokens more often than the target "
                         "distribution allows, so their outputs no longer follow it (greedy requests are unaffected; "
                         "1.0, the default, is exact)")
    if _truthy(environ.get(NGRAM_FORCE_GREEDY_ENV, "")):
        notes.append(f"{NGRAM_FORCE_GREEDY_ENV} is ignored: NGRAM verifies sampled requests by exact tree sampling "
                     "(forcing greedy verification on them would be lossy; SGLang main reads this variable nowhere "
                     "either), greedy requests greedily")
    return notes


def verify_flags(args: argparse.Namespace) -> list[str]:
    """The launcher's copy of the knobs for its children, only those not at their defaults."""
    flags = []
    for flag, dest in (("--speculative-accept-threshold-single", "speculative_accept_threshold_single"),
                       ("--speculative-accept-threshold-acc", "speculative_accept_threshold_acc")):
        if getattr(args, dest, 1.0) != 1.0:
            flags += [flag, repr(getattr(args, dest))]
    if getattr(args, "speculative_use_rejection_sampling", False):
        flags += ["--speculative-use-rejection-sampling"]
    if getattr(args, "speculative_attention_mode", "prefill") != "prefill":
        flags += ["--speculative-attention-mode", args.speculative_attention_mode]
    return flags


def _truthy(value: str) -> bool:
    # SGLang's environ booleans: "true"/"1"/"yes" (any case) are on.
    return value.strip().lower() in ("1", "true", "yes", "y", "on")
