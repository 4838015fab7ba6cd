"""Command-line flags, named as SGLang names them, grouped by the service that consumes them.

`resolve_spec` applies SGLang's auto-defaults and validation to the (steps, topk, num_draft_tokens) triple once, in
the launcher, so every process receives explicit values.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from core import algorithms
from core.algorithms import DraftModel
from tandem.verify_flags import add_verify_args

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "tandem-demo-code"
# The bundled drafts of DEFAULT_MODEL (registry entries name them: bundled_draft).
DEFAULT_DRAFT = REPO_ROOT / "models" / algorithms.get("STANDALONE").bundled_draft
DEFAULT_EAGLE3 = REPO_ROOT / "models" / algorithms.get("EAGLE3").bundled_draft
DEFAULT_EAGLE = DEFAULT_MODEL  # EAGLE / NEXTN: the bundled target's own MTP layer (num_nextn_predict_layers 1)


def add_model_args(p: argparse.ArgumentParser, *, draft: bool = False) -> None:
    p.add_argument("--model-path", default=None,
                   help=f"HF checkpoint folder of the target model (default: the bundled {DEFAULT_MODEL.name})")
    p.add_argument("--device", default="auto",
                   help="torch device of the model services: auto (cuda when torch sees a GPU, else cpu), cpu, cuda, "
                        "cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight/activation dtype; auto = the checkpoint's dtype on GPU, float32 on CPU")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy = random weights of the configured shape (benchmarks)")
    p.add_argument("--attention-backend", default="auto",
                   help="attention backend of the model services: torch, triton, flashinfer (CUDA only; pip install "
                        "flashinfer-python), or auto (triton on CUDA; torch on CPU)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache capacity in tokens per model service (default: sized for the device)")
    p.add_argument("--kv-block-size", "--page-size", dest="kv_block_size", type=int, default=16,
                   help="tokens per KV cache block (SGLang's page size)")
    p.add_argument("--chunked-prefill-size", type=int, default=4096,
                   help="largest prefill forward of the target in tokens: longer prompts (and batches of prompts) are "
                        "split into forwards of at most this size, which bounds activation memory; the KV-pool "
                        "profile measures a prefill of this size. -1 = no chunking")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="turn off the prefix cache of the target and of a STANDALONE draft (on by default, as in "
                        "SGLang: full KV blocks of committed tokens are reused by later requests with the same prefix; "
                        "requests for EAGLE features always compute their prompt)")
    p.add_argument("--random-seed", type=int, default=0, help="seed for dummy weights")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="CUDA: fraction of GPU memory for weights + KV pool; the KV pool is sized by profiling free "
                        "memory after loading weights and a warm-up forward (overrides --max-total-tokens). Give "
                        "target and draft services on one GPU fractions that sum below 1")
    p.add_argument("--cuda-graph-max-bs", type=int, default=64,
                   help="largest batch captured in CUDA graphs (decode and verify); bigger batches run eager")
    p.add_argument("--cuda-graph-max-bs-decode", type=int, default=None,
                   help="largest decode batch (1 token per sequence) captured in CUDA graphs; default "
                        "--cuda-graph-max-bs")
    p.add_argument("--disable-cuda-graph", action="store_true", help="run every forward eagerly (no CUDA graphs)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="torch.compile the forward that CUDA graphs of <= --torch-compile-max-bs sequences capture "
                        "(compiled at start-up, before capture; eager forwards are not compiled)")
    p.add_argument("--torch-compile-max-bs", type=int, default=32,
                   help="largest batch whose CUDA graphs capture the torch.compile'd forward")


def add_parallel_args(p: argparse.ArgumentParser, *, tp: bool, launcher: bool = False) -> None:
    """Device placement of a model service: --base-gpu-id (target and draft), --tp-size (target only).
    launcher: `tandem serve` also places the draft, on its own GPU (--draft-base-gpu-id)."""
    g = p.add_argument_group("parallelism and placement")
    g.add_argument("--base-gpu-id", type=int, default=None,
                   help="first GPU of this service: rank r of the target runs on cuda:(base+r); overrides --device "
                        "(default: --device)" + ("; `serve` applies it to the targets" if launcher else ""))
    if tp:
        g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                       help="tensor-parallel ranks of the target (one process per rank; gloo on CPU, NCCL on CUDA; "
                            "the model's heads, KV heads (or their multiple) and MLP width must divide evenly; CUDA "
                            "graphs are off when > 1)")
    if tp:
        g.add_argument("--colocate-draft", action=argparse.BooleanOptionalAction, default=None,
                       help="run the draft model inside the target's process (as SGLang does) instead of a draft "
                            "service of its own: the target pod serves DraftService too, hands the draft its features "
                            "on the device, and drafts the next tree in the same call as each Verify (one round trip "
                            "per step); the gateway finds it from the target's Info. Not with --tp-size > 1. "
                            + ("Default for `serve`: on when the draft would share the target's device (one draft "
                               "replica, no --draft-base-gpu-id, --tp-size 1, no --enable-overlap-drafting; chosen by "
                               "bench/results/colocate_h200); `serve` then starts no draft process; "
                               "--no-colocate-draft keeps a draft process" if launcher else "Default: off"))
    if tp:
        g.add_argument("--enable-run-ahead", action="store_true",
                       help="after answering a Verify call, the target pod runs the call it expects next (the same "
                            "sequences from their new committed ends, verifying the trees it drafted itself with "
                            "--colocate-draft, or the same plain decode steps) while the answer travels and the gateway "
                            "works on it; a sequence whose next input is exactly that gets its outputs at once, any other "
                            "rolls its run-ahead back (lossless either way). Greedy sequences only. Default: on for a "
                            "CUDA target (one rank) that decodes plainly or drafts in its own process (not UNO), off "
                            "elsewhere and with --disable-overlap-schedule (bench/results/session13_h200)")
        g.add_argument("--disable-run-ahead", action="store_true",
                       help="never run the next call ahead (the A/B switch of the default above)")
    if tp:
        g.add_argument("--disable-chained-speculative-steps", action="store_true",
                       help="with the draft in the target's process and several speculative steps per call, run the "
                            "steps after a call's first one step by step (a device->host readback after every verify "
                            "and every draft) instead of chained on the device (the static verify and draft steps "
                            "joined by two small CUDA graphs, one readback for all the steps): the A/B switch; same "
                            "output either way")
    if launcher:
        g.add_argument("--draft-base-gpu-id", type=int, default=None,
                       help="GPU of the draft service (cuda:N), e.g. one the target does not use (default: --device)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-algorithm", type=str.upper, default=None,
                   choices=algorithms.choices(),
                   help="STANDALONE (small draft LLM), EAGLE / NEXTN (EAGLE-2 head), EAGLE3 (EAGLE-3 head), NGRAM "
                        "(n-gram trie), DFLASH (block-diffusion draft fed by target layers), UNO (the target drafts with a LoRA on its draft rows: --uno-lora-path), SYNTHETIC (synthetic "
                        "acceptance, benchmarks only: see --synthetic-*); "
                        f"{', '.join(a.name for a in algorithms.ALGORITHMS.values() if a.unsupported)} are parsed but not supported yet; unset or NONE = plain "
                        "decoding")
    g.add_argument("--speculative-draft-model-path", "--speculative-draft-model", dest="speculative_draft_model_path",
                   default=None, help="draft model folder: a small LLM for STANDALONE (default: the bundled demo "
                                      "draft), a published EAGLE/EAGLE-3 head for EAGLE/EAGLE3, a DFlash draft for "
                                      "DFLASH (EAGLE3 and EAGLE "
                                      "default: the bundled demo target's heads, when --model-path is the bundled "
                                      "target)")
    g.add_argument("--speculative-token-map", default=None,
                   help="FR-Spec hot-token file (torch.load-able list of target ids) for EAGLE; ignored for EAGLE3")
    g.add_argument("--speculative-draft-load-format", default=None, choices=["auto", "safetensors", "dummy"],
                   help="load format of the draft model (default: --load-format)")
    g.add_argument("--speculative-draft-attention-backend", default=None,
                   help="attention backend of the draft model's runner: torch, triton, flashinfer or auto (default: "
                        "--attention-backend)")
    g.add_argument("--disable-static-draft-step", action="store_true",
                   help="draft step by step from the host (per-forward graphs, host-side tree building) instead of "
                        "one static device step per Propose (runtime/speculative/draft_step.py, one CUDA graph per "
                        "batch bucket; chosen by bench/results/gpu_step_h200); A/B benchmarks")
    g.add_argument("--disable-static-verify-step", action="store_true",
                   help="target: verify every batch eagerly instead of greedy batches of the served tree width as one "
                        "static device step (forward, tree walk, KV compaction, feature gather in one CUDA graph per "
                        "batch bucket, runtime/speculative/verify_step.py; chosen by "
                        "bench/results/speculative_h200/static_steps: 1.0-1.19x the eager verify at 8B); A/B benchmarks")
    g.add_argument("--speculative-num-steps", type=int, default=None, help="draft depth (forward passes)")
    g.add_argument("--speculative-eagle-topk", type=int, default=None, help="branching factor per draft step")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="tree size verified per step, root included")
    g.add_argument("--enable-multi-layer-eagle", action=argparse.BooleanOptionalAction, default=None,
                   help="multi-layer EAGLE (EAGLE / NEXTN on a checkpoint with K MTP layers): draft step s runs MTP "
                        "layer s (DeepSeek's chain) instead of layer 0 autoregressively; chains only "
                        "(num_draft_tokens = num_steps + 1, topk 1, num_steps <= K; unset triple: K/1/K+1). Default: "
                        "on when the draft checkpoint has K > 1 MTP layers and the triple, if set, is such a chain; "
                        "--no-enable-multi-layer-eagle: off")
    g.add_argument("--speculative-adaptive", action="store_true",
                   help="adaptive speculation (chain drafts, topk 1): draft steps per verify chosen per batch-size "
                        "slot from an EMA of accepted drafts; large batches step without drafts (gateway/adaptive.py)")
    g.add_argument("--speculative-adaptive-config", default=None,
                   help="JSON of batch-size slots, e.g. {\"1\": {\"candidate_steps\": [1, 3, 7]}, \"64\": "
                        "{\"candidate_steps\": [0]}} (default: SGLang's tiers capped at --speculative-num-steps)")
    add_verify_args(g)
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="the sequential loop (SGLang's flag name): the gateway streams a step's tokens before the "
                        "next call goes out (by default it detokenizes, stop-matches and streams them while that call "
                        "is in flight), never splits the running batch into two halves that ping-pong between the "
                        "draft and target pods (gateway/overlap.py: by default measured per batch size where the pods "
                        "are on different devices), and the target pods do not run the next call ahead (unless "
                        "--enable-run-ahead)")
    for entry in algorithms.ALGORITHMS.values():  # each algorithm's own flags (NGRAM trie, SYNTHETIC acceptance)
        for flag in entry.flags:
            if flag.type is None:
                g.add_argument(flag.flag, *flag.aliases, dest=flag.dest, action="store_true", help=flag.help)
            else:
                g.add_argument(flag.flag, *flag.aliases, dest=flag.dest, type=flag.type, default=flag.default,
                               choices=flag.choices, help=flag.help)


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway")
    g.add_argument("--host", default="127.0.0.1", help="address of the OpenAI REST front and gRPC Generate")
    g.add_argument("--port", type=int, default=30000, help="HTTP port of the OpenAI-compatible REST front")
    g.add_argument("--grpc-port", type=int, default=30001, help="port of the public gRPC Generate API")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the `model` name(s) clients use; several = aliases, the first is reported in responses "
                        "(requests may also name the model path or its folder name; default: the folder name)")
    g.add_argument("--tokenizer-path", default=None, help="tokenizer folder (default: --model-path)")
    g.add_argument("--max-running-requests", type=int, default=64, help="sequences decoded together")
    g.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests before 429")
    g.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline in seconds")
    g.add_argument("--enable-overlap-drafting", action="store_true",
                   help="while the target verifies step i, let the draft pre-draft step i+1 from its own guess of "
                        "the outcome (PEARL-style post-verify); used when the guess was right, dropped otherwise "
                        "(lossless either way). Counted in usage.predraft_hits/predraft_misses")
    g.add_argument("--num-continuous-decode-steps", type=int, default=None,
                   help="plain decode steps (no draft tree) the target runs back to back per Verify call, each fed "
                        "the token the last one emitted (fewer round trips per token; streamed in chunks of up to "
                        "this many tokens); 1..256. Default: 4 when nothing drafts (--speculative-algorithm NONE: "
                        "bench/results/serve_decode_h200, 8B through the services 151.8 -> 180.5 tok/s) or with "
                        "--speculative-adaptive (its draft-free tiers), else 1")
    g.add_argument("--disable-step-streams", action="store_true",
                   help="send every Verify/Propose step as a unary RPC instead of over one persistent bidirectional "
                        "stream per pod (streams are the default: about half the per-step RPC overhead)")
    g.add_argument("--routing-policy", default="cache_aware", choices=["cache_aware", "consistent_hash"],
                   help="how a new sequence picks its target pod: cache_aware = the pod that already holds its prompt "
                        "prefix (prefix cache), unless loads are unbalanced, else the least loaded; consistent_hash = "
                        "rendezvous hashing of the sequence id")
    g.add_argument("--cache-threshold", type=float, default=0.5,
                   help="cache_aware: fraction of the prompt's KV blocks a pod must hold to get the sequence for them")
    g.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="cache_aware: loads (running sequences per target pod) count as unbalanced when max - min "
                        "exceeds this and max > min * --balance-rel-threshold; then the least loaded pod is used")
    g.add_argument("--balance-rel-threshold", type=float, default=1.5, help="see --balance-abs-threshold")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="refuse longer prompts with 400 / INVALID_ARGUMENT (default: only the context bounds them)")
    g.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                   help="largest REST request body; bigger ones get 413")
    g.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on REST and 'authorization' metadata on gRPC Generate "
                        "(/health, /metrics and gRPC health stay open; default: $TANDEM_API_KEY)")
    t = p.add_argument_group("TLS to the model services (gateway side)")
    t.add_argument("--service-tls-ca", default=None,
                   help="PEM CA that signed the services' certificates; set = TLS on every gateway→pod channel")
    t.add_argument("--service-tls-cert", default=None, help="PEM client certificate for mTLS to the services")
    t.add_argument("--service-tls-key", default=None, help="PEM key of --service-tls-cert")


def add_service_ops_args(p: argparse.ArgumentParser, *, launcher: bool = False) -> None:
    """Flags of a model service (target/draft) beyond the model: metrics endpoint and TLS of its gRPC port.
    launcher: `tandem serve` passes them to every model service; --metrics-port is then the first of a range."""
    g = p.add_argument_group("operations (model services)")
    g.add_argument("--metrics-port", type=int, default=0,
                   help="first Prometheus /metrics port of the model services: targets, then drafts, count up "
                        "(0 = off; the gateway serves /metrics on --port)" if launcher else
                        "serve Prometheus /metrics over HTTP on this port (0 = off)")
    g.add_argument("--metrics-host", default=None,
                   help="address of the /metrics HTTP server (default: --service-host, 127.0.0.1 unless set)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate of the gRPC port (set with --tls-key = TLS)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None,
                   help="PEM CA of client certificates; set = mTLS (clients must present a certificate it signed)")


def resolve_colocation(args: argparse.Namespace) -> None:
    """`tandem serve` without --colocate-draft / --no-colocate-draft: co-locate when the draft would share the
    target's device anyway (bench/results/colocate_h200: one round trip per step instead of two on one H200)."""
    if getattr(args, "colocate_draft", False) is not None:
        return
    entry = algorithms.get(getattr(args, "speculative_algorithm", None))
    args.colocate_draft = (entry.drafts and not entry.drafts_on_target and getattr(args, "tp_size", 1) == 1
                           and getattr(args, "num_draft_replicas", 1) == 1
                           and getattr(args, "draft_base_gpu_id", None) is None
                           and not getattr(args, "enable_overlap_drafting", False))


def colocates_draft(args: argparse.Namespace) -> bool:
    """--colocate-draft in effect: an algorithm with a draft service of its own (not NONE, not UNO, whose target pods
    draft anyway) whose draft runs in the target's process."""
    entry = algorithms.get(getattr(args, "speculative_algorithm", None))
    return bool(getattr(args, "colocate_draft", False)) and entry.drafts and not entry.drafts_on_target


def run_ahead(args: argparse.Namespace) -> bool:
    """Run-ahead in effect for a target (process) with these flags: --enable-run-ahead / --disable-run-ahead, else on
    where an H200 measured it faster (bench/results/session13_h200, the demo family through `tandem serve`, batch 1:
    plain decoding 1.12x, STANDALONE co-located 1.17x, EAGLE3 5/4/16 co-located and chained 1.12x; Llama-3.1-8B plain
    decoding through the services 1.05x): a CUDA target (one rank) that decodes plainly or drafts in its own process.
    Not on CPU (the run-ahead competes with the gateway for the same cores: no gain, bench/results/session11_cpu), not
    UNO (its verify consumes a clean root its self-draft left pending), not tensor-parallel (not measured). Run-ahead
    is the target's part of the overlap schedule: --disable-overlap-schedule (the sequential loop) turns it off too,
    unless --enable-run-ahead asks for it."""
    if getattr(args, "disable_run_ahead", False):
        return False
    if getattr(args, "enable_run_ahead", False):
        return True
    if getattr(args, "disable_overlap_schedule", False):
        return False
    entry = algorithms.get(getattr(args, "speculative_algorithm", None))
    on_cuda = str(getattr(args, "device", "")).startswith("cuda") or getattr(args, "base_gpu_id", None) is not None
    single = getattr(args, "tp_size", 1) == 1  # (tensor-parallel targets: not measured)
    return on_cuda and single and (not entry.drafts or colocates_draft(args))


# A target whose weights are at least this large prefetches its plain decode steps by default (decode_prefetch).
DECODE_PREFETCH_MIN_WEIGHT_BYTES = 1 << 30


def decode_prefetch(args: argparse.Namespace, weight_bytes: int) -> bool:
    """Pipelined plain decode enqueues the next call's steps before its readback (ModelRunner.greedy_decode_steps
    prefetch), with run-ahead in effect, for a target whose decode step is device-bound: weights of at least
    DECODE_PREFETCH_MIN_WEIGHT_BYTES. TANDEM_DECODE_PREFETCH=1 / 0 forces it on / off (with run-ahead). Chosen by
    bench/gpu_session.sh stage prefetch_ab (bench/results/session21, one H100, same call): Llama-3.1-8B shapes
    through `tandem serve` 145.7 -> 161.8 tok/s at batch 1 (1.11x), 1025 -> 1175 at 8 (1.15x), 6105 -> 6943 at 64
    (1.14x); the 8 M-parameter demo model (a step of ~0.1 ms of GPU: host-bound, run-ahead already hides the answer's
    trip) 1473 -> 1242 tok/s (0.84x, one run each on a noisy host), so small models keep it off."""
    forced = os.environ.get("TANDEM_DECODE_PREFETCH")
    if forced in ("0", "1"):
        return forced == "1" and run_ahead(args)
    return run_ahead(args) and weight_bytes >= DECODE_PREFETCH_MIN_WEIGHT_BYTES


def model_path(args: argparse.Namespace) -> str:
    return str(args.model_path or DEFAULT_MODEL)


def read_architecture(path: str) -> str:
    config = Path(path) / "config.json"
    if not config.exists():
        raise SystemExit(f"error: {path} has no config.json (is it an HF checkpoint folder?)")
    archs = json.loads(config.read_text()).get("architectures") or ["?"]
    return archs[0]


def mtp_layers(path: str) -> int:
    """num_nextn_predict_layers of a checkpoint's config.json: its MTP / NextN layers (0 when absent or unreadable)."""
    config = Path(path) / "config.json"
    try:
        return int(json.loads(config.read_text()).get("num_nextn_predict_layers") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def draft_model_path(args: argparse.Namespace) -> str | None:
    """The draft checkpoint the draft service loads: --speculative-draft-model-path, else the bundled one (a
    STANDALONE draft for any target; a head only for the bundled target it was trained on), else the target itself
    when its own MTP layers draft (registry `mtp_draft`); None without one."""
    entry = algorithms.get(args.speculative_algorithm)
    target = model_path(args)
    if entry.drafts_on_target:  # no draft model (UNO's bundled folder is its LoRA, --uno-lora-path)
        return args.speculative_draft_model_path
    if entry.mtp_draft and mtp_layers(target):
        given = args.speculative_draft_model_path
        if entry.mtp_draft == "always" or not (given or entry.bundled_draft and _is_bundled_target(target)):
            return target  # (a draft path given for NEXTN is not needed: tandem/compat.py says so at start-up)
    if args.speculative_draft_model_path or entry.bundled_draft is None:
        return args.speculative_draft_model_path
    if entry.draft_model is DraftModel.HEAD and Path(model_path(args)).resolve() != DEFAULT_MODEL.resolve():
        return None
    return str(REPO_ROOT / "models" / entry.bundled_draft)


def _is_bundled_target(path: str) -> bool:
    return Path(path).resolve() == DEFAULT_MODEL.resolve()


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _draft_block_size(entry: algorithms.SpeculativeAlgorithm, draft_path: str | None) -> int | None:
    """The block size a block draft's config.json names (DFLASH: dflash_config.block_size or block_size); None for
    other algorithms, or when absent or unreadable."""
    if entry.shape_rule is not algorithms.ShapeRule.BLOCK or not draft_path:
        return None
    try:
        raw = json.loads((Path(draft_path) / "config.json").read_text())
        block = (raw.get("dflash_config") or {}).get("block_size", raw.get("block_size"))
        return None if block is None else int(block)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def resolve_spec(args: argparse.Namespace) -> tuple[str, int, int, int]:
    """(algorithm, num_steps, topk, num_draft_tokens) after SGLang's auto-defaults and checks; aliases become the
    algorithm's name."""
    entry = algorithms.get(args.speculative_algorithm)
    algorithm = entry.name
    if entry.draft_model is DraftModel.HEAD:
        args.speculative_draft_model_path = draft_model_path(args)  # the bundled target's own head
        if not args.speculative_draft_model_path:
            if entry.missing_draft:
                raise SystemExit(f"error: {entry.missing_draft}")
            mtp = " or a target checkpoint with MTP layers (num_nextn_predict_layers)" if entry.mtp_draft else ""
            raise SystemExit(f"error: --speculative-algorithm {algorithm} needs --speculative-draft-model-path "
                             f"(the head){mtp}")
    if not entry.drafts:
        if getattr(args, "speculative_draft_window_size", None) is not None:
            raise SystemExit("error: --speculative-draft-window-size needs --speculative-algorithm "
                             f"{_or(algorithms.names(lambda a: a.supports_draft_window))}")
        if getattr(args, "enable_multi_layer_eagle", None):
            raise SystemExit("error: --enable-multi-layer-eagle needs --speculative-algorithm")
        args.enable_multi_layer_eagle = False
        if getattr(args, "speculative_adaptive", False):
            raise SystemExit("error: --speculative-adaptive needs --speculative-algorithm")
        if any(v is not None for v in (args.speculative_num_steps, args.speculative_eagle_topk,
                                       args.speculative_num_draft_tokens)):
            raise SystemExit("error: --speculative-num-steps/-eagle-topk/-num-draft-tokens need "
                             "--speculative-algorithm")
        return algorithm, 0, 1, 1
    draft = args.speculative_draft_model_path if entry.mtp_draft else None
    try:
        chain = entry.multi_layer_shape(
            getattr(args, "enable_multi_layer_eagle", None), mtp_layers(draft) if draft else 0,
            args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens,
            source=str(draft or "the draft checkpoint"))
        steps, topk, ndt = chain or entry.resolve_shape(
            read_architecture(model_path(args)), args.speculative_num_steps,
            args.speculative_eagle_topk, args.speculative_num_draft_tokens,
            max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
            block_size=getattr(args, "speculative_dflash_block_size", None),
            draft_block_size=_draft_block_size(entry, args.speculative_draft_model_path))
        entry.check_draft_window(getattr(args, "speculative_draft_window_size", None), ndt)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    args.enable_multi_layer_eagle = chain is not None
    checker = entry.flag_checker()
    if checker is not None:
        args.speculative_num_steps, args.speculative_eagle_topk = steps, topk  # the resolved shape is what it checks
        try:
            checker(args)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    if getattr(args, "speculative_adaptive", False):
        if not entry.supports_adaptive or topk != 1:
            adaptive = algorithms.names(lambda a: a.supports_adaptive)
            raise SystemExit("error: --speculative-adaptive needs a chain draft (--speculative-eagle-topk 1) of "
                             f"{', '.join(adaptive[:-1])} or {adaptive[-1]}")
        if getattr(args, "enable_overlap_drafting", False):
            raise SystemExit("error: --speculative-adaptive and --enable-overlap-drafting do not combine")
    return algorithm, steps, topk, ndt


def add_hardening_args(p: argparse.ArgumentParser, role: str) -> None:
    """Credentials and per-call limits (issue 15), in one block. role: serve, target, draft or gateway."""
    g = p.add_argument_group("service credential and limits")
    g.add_argument("--service-api-key", default=os.environ.get("TANDEM_SERVICE_API_KEY") or None,
                   help="shared credential of the model services: target and draft refuse every RPC but health "
                        "checks without 'authorization: Bearer KEY' metadata, the gateway sends it (default: "
                        "$TANDEM_SERVICE_API_KEY; `tandem serve` generates one per launch when unset)")
    if role in ("target", "draft"):
        g.add_argument("--allow-unauthenticated", action="store_true",
                       help="serve a non-loopback --service-host without --service-api-key or mTLS (--tls-ca); "
                            "refused otherwise")
    if role in ("serve", "target", "draft"):
        g.add_argument("--seq-idle-ttl", type=float, default=300.0,
                       help="seconds a sequence may sit on a model service unused before it is freed (its gateway "
                            "is gone)")
    if role in ("serve", "target"):
        g.add_argument("--max-verify-tree-nodes", type=int, default=512,
                       help="largest draft tree (nodes per sequence) one Verify may carry; bigger ones are refused")
    if role in ("serve", "gateway"):
        g.add_argument("--pod-probe-interval", type=float, default=1.0,
                       help="seconds between the gateway's health probes of every pod (/health is 503 and gRPC "
                            "health NOT_SERVING while no target pod answers); 0 = no probes")
        g.add_argument("--no-target-wait", type=float, default=60.0,
                       help="seconds a request waits for a target pod while none is up (e.g. all restarting) before "
                            "it fails with 503")
        g.add_argument("--http-header-timeout", type=float, default=10.0,
                       help="seconds a client may take to send a request's headers (slow clients are disconnected)")
        g.add_argument("--http-body-timeout", type=float, default=30.0,
                       help="seconds a client may take to send a request body (408 after that)")
