"""Device work a chained speculative step dispatches, counted on any machine: torch ops that launch a kernel (views
and metadata ops left out) and Triton launches, for one replay of the static draft step, the static verify step and
the chained glue, with the steps' own kernels (tandem_kernels/topk.py, tree.py, chain_glue.py, the packed walk)
on and off (TANDEM_STEP_KERNELS). Inside a CUDA graph each counted op is one graph node, and a chained demo step is
bound by how many it replays (session 16's H100 trace: ~480 kernels per EAGLE3 5/4/16 step at ~1.7 us each), so
this is where a change to the step shows before a GPU measures it. On CPU it runs the kernels in Triton's
interpreter with the fused elementwise kernels forced on, as the graphs run them.

    TRITON_INTERPRET=1 python bench/step_ops.py --out bench/results/step_ops.json   # the demo family's EAGLE3 head
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ:
    import torch as _t

    if not _t.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates a kernel

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.profile_draft import VIEW_OPS  # noqa: E402
from tandem.args import DEFAULT_MODEL  # noqa: E402


# Ops that launch nothing on the device: allocation (a graph's pool) and dtype arithmetic.
NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "promote_types", "result_type", "is_pinned")
_IN_TRITON = [0]  # > 0 inside a Triton launch: the interpreter's own torch calls are not the step's


class Launches(TorchDispatchMode):
    """Counts kernel-launching torch ops while active; Triton launches are counted by `triton_launches`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if not _IN_TRITON[0] and name not in NO_KERNEL and not any(name.startswith(v.split(".")[0])
                                                                  for v in VIEW_OPS):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def triton_launches(counter: collections.Counter) -> None:
    """Count each Triton kernel launch (interpreter or compiled) in `counter` by kernel name."""
    import triton

    cls = triton.runtime.interpreter.InterpretedFunction if os.environ.get("TRITON_INTERPRET") == "1" \
        else triton.runtime.jit.JITFunction
    real = cls.run

    def run(self, *args, **kwargs):
        counter[getattr(self.fn, "__name__", "triton")] += 1
        _IN_TRITON[0] += 1
        try:
            return real(self, *args, **kwargs)
        finally:
            _IN_TRITON[0] -= 1

    cls.run = run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--draft", default=None, help="EAGLE3 head (default: the demo family's)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from core.steps import SpecShape
    from draft_service.eagle import EagleProposer
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from runtime.models import llama as llama_model
    from runtime.speculative.fused_step import FusedSteps
    from runtime.speculative.verify_step import StaticVerifyStep

    device = "cuda" if torch.cuda.is_available() else "cpu"
    draft = args.draft or f"{args.model}-eagle3"
    spec = SpecShape(args.steps, args.topk, args.num_draft_tokens)
    cfg = EngineConfig(device=device, dtype="bfloat16" if device == "cuda" else "float32", max_total_tokens=4096,
                       block_size=16, attention_backend="triton")
    proposer = EagleProposer(args.model, draft, cfg, algorithm="EAGLE3")
    draft_step = proposer._new_static_step(spec, max_bs=1)
    target = ModelRunner(args.model, cfg)
    verify_step = StaticVerifyStep(target, args.num_draft_tokens, max_bs=1,
                                   capture_layers=proposer.target_capture_layers)
    glue = FusedSteps(verify_step, draft_step)
    glue._buffers(1)
    triton_counter: collections.Counter[str] = collections.Counter()
    triton_launches(triton_counter)
    results = {}
    for step_kernels in (False, True):
        llama_model._STEP_KERNELS = step_kernels
        row = {}
        with llama_model.fused_elementwise(True), torch.inference_mode():
            verified = verify_step.run(1)
            for name, code in (("draft step", lambda: draft_step.run(1)), ("verify step", lambda: verify_step.run(1)),
                               ("glue", lambda: (glue.to_verify(1), glue.to_draft(1, verified)))):
                triton_counter.clear()
                with Launches() as mode:
                    code()
                row[name] = {"torch ops": sum(mode.ops.values()), "triton launches": sum(triton_counter.values()),
                             "top torch ops": dict(mode.ops.most_common(8))}
        results["step kernels on" if step_kernels else "step kernels off"] = row
    print(json.dumps(results, indent=1))
    print(f"\n| {spec.num_steps}/{spec.topk}/{spec.num_draft_tokens} | step kernels off | step kernels on |\n|---|---|---|")
    for name in ("draft step", "verify step", "glue"):
        cells = [results[k][name] for k in ("step kernels off", "step kernels on")]
        print(f"| {name} | " + " | ".join(f"{c['torch ops'] + c['triton launches']} ({c['triton launches']} Triton)"
                                           for c in cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
