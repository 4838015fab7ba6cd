"""Entry points of the three services: build each from parsed flags and serve until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import time
from pathlib import Path

from core import algorithms
from core.algorithms import TargetFeatures
from tandem.args import colocates_draft, decode_prefetch, draft_model_path, model_path, run_ahead

logger = logging.getLogger("tandem")


def _engine_config(args: argparse.Namespace, load_format: str | None = None, *, target: bool = False,
                   draft: bool = False):
    """draft: the draft model's runner (its --speculative-draft-attention-backend, default --attention-backend)."""
    from runtime.config import EngineConfig
    from tandem.compat import resolve_device

    device = resolve_device(args.device)
    if getattr(args, "base_gpu_id", None) is not None:
        device = f"cuda:{args.base_gpu_id}"  # rank 0's GPU; the TP launcher places the other ranks after it
    kwargs = dict(device=device, dtype=args.dtype, load_format=load_format or args.load_format,
                  attention_backend=args.attention_backend, block_size=args.kv_block_size, seed=args.random_seed,
                  mem_fraction_static=getattr(args, "mem_fraction_static", None),
                  cuda_graph_max_bs=getattr(args, "cuda_graph_max_bs", 64),
                  cuda_graph_max_bs_decode=getattr(args, "cuda_graph_max_bs_decode", None),
                  disable_cuda_graph=getattr(args, "disable_cuda_graph", False),
                  enable_torch_compile=getattr(args, "enable_torch_compile", False),
                  torch_compile_max_bs=getattr(args, "torch_compile_max_bs", 32),
                  chunked_prefill_size=getattr(args, "chunked_prefill_size", 4096))
    if draft and getattr(args, "speculative_draft_attention_backend", None):
        kwargs["attention_backend"] = args.speculative_draft_attention_backend
    steps, topk = getattr(args, "speculative_num_steps", None), getattr(args, "speculative_eagle_topk", None)
    if draft and steps and topk:  # the draft's tree steps: topk tokens per sequence over tails up to steps * topk
        kwargs["cuda_graph_num_draft_tokens"] = topk if topk > 1 else None
        kwargs["cuda_graph_mask_width"] = steps * topk
    if target:  # the verify width the target's graphs are captured for; the prefix cache (off under TP)
        kwargs["enable_prefix_cache"] = (not getattr(args, "disable_radix_cache", False)
                                         and getattr(args, "tp_size", 1) == 1)
        kwargs["cuda_graph_num_draft_tokens"] = getattr(args, "speculative_num_draft_tokens", None)
        if getattr(args, "speculative_adaptive", False):  # one verify width per adaptive tier (steps + 1)
            kwargs["cuda_graph_extra_widths"] = tuple(s + 1 for s in adaptive_steps(args) if s > 0)
    if args.max_total_tokens:
        kwargs["max_total_tokens"] = args.max_total_tokens
    elif kwargs["mem_fraction_static"] is None and device.startswith("cuda"):
        kwargs["mem_fraction_static"] = _auto_mem_fraction(device)  # size the KV pool for this GPU (SGLang's way)
    return EngineConfig(**kwargs)


AUTO_CONTINUOUS_DECODE_STEPS = 4  # bench/results/serve_decode_h200: 8B through the services, k=1 151.8, k=4 180.5 tok/s


def continuous_decode_steps(args: argparse.Namespace) -> int:
    """--num-continuous-decode-steps, or its default: several plain decode steps per Verify call when nothing drafts
    (each call is a round trip through the gateway) and for the draft-free steps of --speculative-adaptive (its large
    batch tiers decode plainly: with one step per call they fell to 0.85x plain decoding at batch 64,
    bench/results/speculative_h200/adaptive), one when drafts need the step's outcome."""
    given = getattr(args, "num_continuous_decode_steps", None)
    if given is not None:
        return given
    if algorithms.get(args.speculative_algorithm).drafts and not getattr(args, "speculative_adaptive", False):
        return 1
    return AUTO_CONTINUOUS_DECODE_STEPS


# bench/results/session11_h200 (one H200, the demo family through tandem serve, batch 1, same run): EAGLE3 5/4/16
# co-located, one speculative step per Verify call 1183.4 tok/s (3.55 ms per step), four 1812.5 (2.32 ms; 1.36x plain
# decoding's 1334.2): the gateway's work and a round trip per step were a third of the step
AUTO_SPECULATIVE_STEPS_PER_CALL = 4


def speculative_steps_per_call(args: argparse.Namespace) -> int:
    """Speculative steps (verify, then draft) per Verify call with the draft in the target's process:
    --num-continuous-decode-steps when given, else AUTO_SPECULATIVE_STEPS_PER_CALL. Adaptive speculation's
    plain-decode tiers keep their own default (continuous_decode_steps)."""
    return getattr(args, "num_continuous_decode_steps", None) or AUTO_SPECULATIVE_STEPS_PER_CALL


def _auto_mem_fraction(device: str) -> float:
    """The whole GPU's automatic --mem-fraction-static (`tandem serve` passes each process its share instead)."""
    import torch

    from runtime.memory import auto_mem_fraction_static

    return auto_mem_fraction_static(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def _loading(service: str, path: str, engine_config) -> float:
    """Say what this service is loading (start-up can take a while: weights, profiling, graph capture)."""
    device = engine_config.device
    graphs = (" and capturing CUDA graphs" if str(device).startswith("cuda") and not engine_config.disable_cuda_graph
              else "")
    print(f"tandem {service}: loading weights of {Path(path).name} on {device}{graphs}", flush=True)
    return time.monotonic()


def _runner_summary(runner) -> str:
    """KV pool and step path of a loaded ModelRunner, for the ready line."""
    tokens = runner.block_manager.num_blocks * runner.engine_config.block_size
    graphs = "CUDA graphs" if getattr(runner, "use_cuda_graph", False) else "eager"
    return f"KV cache {tokens} tokens, {runner.device}, {graphs}"


def adaptive_steps(args: argparse.Namespace) -> list[int]:
    """Every candidate draft-steps value of --speculative-adaptive's slots (exits with the config's error)."""
    from gateway.adaptive import all_candidate_steps, load_config

    try:
        return all_candidate_steps(load_config(args.speculative_adaptive_config, args.speculative_num_steps or 1))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def _build_runner(path: str | None, engine_config):
    """A ModelRunner, or exit with a message when the model or its KV pool does not fit on the device."""
    from runtime.memory import OutOfDeviceMemory
    from runtime.model_runner import ModelRunner

    try:
        return ModelRunner(path, engine_config)
    except OutOfDeviceMemory as exc:
        raise SystemExit(f"error: {exc}") from None


async def _serve_until_signal(server) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)


async def run_target(args: argparse.Namespace) -> None:
    from target_service.engine import TargetEngine
    from target_service.server import serve_target

    path = model_path(args)
    weights = None if args.load_format == "dummy" and not Path(path).exists() else path
    tp_size = getattr(args, "tp_size", 1)
    if colocates_draft(args) and tp_size > 1:
        raise SystemExit("error: --colocate-draft needs --tp-size 1 (the draft runs beside rank 0's model)")
    args, draft_args = _colocated_memory(args)
    engine_config = _engine_config(args, target=True)
    started = _loading("target", path, engine_config)
    launcher = None
    if tp_size > 1:
        from target_service.tp import TPLauncher

        if algorithms.get(getattr(args, "speculative_algorithm", None)).needs_features:
            raise SystemExit(f"error: --tp-size > 1 does not capture features for "
                             f"{'/'.join(algorithms.names(lambda a: a.needs_features))} drafts yet")
        launcher = TPLauncher(weights, engine_config, tp_size)
        runner = launcher.start()  # spawns ranks 1..N-1; rank 0 (this process) serves gRPC
    else:
        runner = _build_runner(weights, engine_config)
    if getattr(args, "synthetic_margin_weights", False):
        if engine_config.load_format != "dummy":
            raise SystemExit("error: --synthetic-margin-weights reshapes dummy weights: it needs --load-format dummy")
        from runtime.models.loader import widen_dummy_margins

        widen_dummy_margins(runner.model, engine_config.seed)
    credentials = _server_credentials(args)
    _check_service_auth(args)
    engine = TargetEngine(runner, **_feature_capture(args, runner), accept_thresholds=_accept_thresholds(args))
    _static_verify(engine, args)
    engine.decode_prefetch = decode_prefetch(args, runner.weight_bytes())
    entry = algorithms.get(getattr(args, "speculative_algorithm", None))
    # UNO: this pod also plays the draft role (registry drafts_on_target): DraftService over the target engine.
    # --colocate-draft: the draft service's proposer, built in this process on this device.
    proposer = entry.proposer_factory()(engine, args) if entry.drafts_on_target else None
    if colocates_draft(args):
        proposer, _ = build_proposer(draft_args)
    server, port = await serve_target(engine, path,
                                      args.service_host, args.service_port, metrics=_service_metrics(args, "target"),
                                      credentials=credentials, max_tree_nodes=args.max_verify_tree_nodes,
                                      service_api_key=args.service_api_key, seq_idle_ttl_s=args.seq_idle_ttl,
                                      proposer=proposer, profiler=_profiler(args, "target", runner.device),
                                      run_ahead=run_ahead(args),
                                      chain_steps=not getattr(args, "disable_chained_speculative_steps", False))
    role = f", drafting {proposer.algorithm}" if proposer is not None else ""
    print(f"tandem target{role} ready on {args.service_host}:{port}" + (f" (tp={tp_size})" if launcher else "")
          + f" in {time.monotonic() - started:.1f} s: {_runner_summary(runner)}", flush=True)
    try:
        await _serve_until_signal(server)
    finally:
        if launcher is not None:
            launcher.stop()


def _colocated_memory(args: argparse.Namespace) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(the target's flags, the co-located draft's): with --colocate-draft on CUDA the process's static memory
    fraction (--mem-fraction-static, or this GPU's automatic one) is split between the two models as `tandem serve`
    splits a GPU between two processes (runtime.memory.draft_memory_part). Otherwise both are `args`."""
    if not colocates_draft(args) or args.max_total_tokens:
        return args, args
    from tandem.compat import resolve_device

    gpu = getattr(args, "base_gpu_id", None)
    device = f"cuda:{gpu}" if gpu is not None else str(resolve_device(args.device))
    if not device.startswith("cuda"):
        return args, args
    from runtime.memory import draft_memory_part
    from tandem.launch import checkpoint_bytes, draft_weight

    entry = algorithms.get(args.speculative_algorithm)
    total = args.mem_fraction_static or _auto_mem_fraction(device)
    target_size = checkpoint_bytes(model_path(args)) or 1
    part = (0.0 if entry.draft_model is algorithms.DraftModel.NONE
            else draft_memory_part(draft_weight(args, target_size), target_size))
    target_args, draft_args = argparse.Namespace(**vars(args)), argparse.Namespace(**vars(args))
    target_args.mem_fraction_static = round(total * (1.0 - part), 3)
    draft_args.mem_fraction_static = round(total * part, 3) if part else None
    return target_args, draft_args


def _accept_thresholds(args: argparse.Namespace):
    """--speculative-accept-threshold-single/-acc (checked at start-up) as the engine's AcceptThresholds."""
    from runtime.speculative.verify import AcceptThresholds

    return AcceptThresholds(getattr(args, "speculative_accept_threshold_single", 1.0),
                            getattr(args, "speculative_accept_threshold_acc", 1.0))


def _feature_capture(args: argparse.Namespace, runner) -> dict:
    """Which hidden states the target returns for feature drafts: EAGLE-3 aux layers, EAGLE's final hidden, or the
    outputs of a DFLASH draft's target layers."""
    needs = algorithms.get(getattr(args, "speculative_algorithm", None)).target_features
    if needs is TargetFeatures.FINAL_HIDDEN:
        return {"final_norm_features": True}
    if needs is TargetFeatures.AUX_LAYERS:
        import json

        from runtime.models.eagle3 import eagle3_aux_layer_ids, eagle3_capture_layers

        config = json.loads((Path(args.speculative_draft_model_path) / "config.json").read_text())
        layers = eagle3_capture_layers(runner.model_config.num_layers, eagle3_aux_layer_ids(config))
        return {"feature_layers": layers}
    if needs is TargetFeatures.BLOCK_FEATURES:  # DFLASH: the outputs of the draft's target_layer_ids
        from runtime.models.dflash import DFlashConfig, dflash_capture_layers
        from runtime.models.eagle import read_config

        config = DFlashConfig.from_raw(read_config(args.speculative_draft_model_path), runner.model_config,
                                       source=args.speculative_draft_model_path)
        return {"feature_layers": dflash_capture_layers(list(config.target_layer_ids),
                                                        runner.model_config.num_layers)}
    return {}


@dataclasses.dataclass
class DraftBuild:
    """What a proposer factory (a registry entry's `proposer`, "module:function(build) -> (proposer, path)") gets to
    build its proposer from the flags: the flags themselves and the services' way to configure and load a runner."""

    args: argparse.Namespace

    @property
    def target_path(self) -> str:
        return model_path(self.args)

    @property
    def draft_path(self) -> str | None:
        """--speculative-draft-model-path, else the algorithm's bundled draft (None without one)."""
        return draft_model_path(self.args)

    def engine_config(self, load_format: str | None = None, *, draft: bool = True):
        """The EngineConfig of a draft runner (default load format: --speculative-draft-load-format)."""
        return _engine_config(self.args, load_format or self.args.speculative_draft_load_format, draft=draft)

    def loading(self, path: str, engine_config) -> None:
        _loading("draft", path, engine_config)

    def runner(self, path: str, engine_config):
        """A ModelRunner of a draft checkpoint, or exit with a message when it does not fit on the device."""
        self.loading(path, engine_config)
        return _build_runner(path, engine_config)


def build_proposer(args: argparse.Namespace):
    """The draft service's proposer for --speculative-algorithm (its registry entry's factory) and the path it
    loaded, set up for static device steps where the runner can."""
    entry = algorithms.get(args.speculative_algorithm)
    if not entry.proposer or entry.unsupported or entry.drafts_on_target:
        where = " (the target service drafts for it)" if entry.drafts_on_target else ""
        raise SystemExit(f"error: the draft service cannot run --speculative-algorithm {args.speculative_algorithm}"
                         + where)
    proposer, path = entry.proposer_factory()(DraftBuild(args))
    return _static_step(proposer, args), path


def _static_verify(engine, args: argparse.Namespace) -> None:
    """Verify greedy batches of the served tree width as one static device step (one CUDA graph per batch bucket:
    forward, tree walk, KV compaction, feature gather) where the target runner can: a GPU, the triton backend,
    graphs on, no TP. On by default (bench/results/speculative_h200/static_steps); --disable-static-verify-step: A/B."""
    ndt = getattr(args, "speculative_num_draft_tokens", None)
    runner = engine.runner
    if (getattr(args, "disable_static_verify_step", False) or not ndt or ndt < 2 or runner.device.type != "cuda"
            or getattr(args, "disable_cuda_graph", False) or runner.tp is not None):
        return
    if engine.enable_static_verify(ndt, max_bs=max(1, getattr(args, "cuda_graph_max_bs", 64))):
        logger.info("target: static verify step for trees of %d tokens", ndt)


def _static_step(proposer, args: argparse.Namespace):
    """Propose the served shape, and with --speculative-adaptive every tier's chain (steps/1/steps+1), as one static
    device step each (one CUDA graph per batch bucket) where the drafter can (a GPU, graphs on; a draft runner with
    the triton backend, or DFLASH's block forward); other shapes (pre-drafts) and other devices draft step by step."""
    from core.steps import SpecShape

    steps, topk, ndt = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    device = proposer.runner.device if proposer.runner is not None else getattr(proposer, "device", None)
    if (device is None or getattr(args, "disable_static_draft_step", False) or not steps or device.type != "cuda"
            or getattr(args, "disable_cuda_graph", False) or not hasattr(proposer, "enable_static_step")):
        return proposer
    shapes = [SpecShape(steps, topk, ndt)]
    if getattr(args, "speculative_adaptive", False):
        tiers = [SpecShape(s, 1, s + 1) for s in adaptive_steps(args) if s > 0]
        shapes += [shape for shape in tiers if shape not in shapes]
    for shape in shapes:
        if proposer.enable_static_step(shape, max_bs=max(1, getattr(args, "cuda_graph_max_bs", 64))):
            logger.info("draft: static draft step for %d/%d/%d", shape.num_steps, shape.topk, shape.num_draft_tokens)
    return proposer


async def run_draft(args: argparse.Namespace) -> None:
    from draft_service.server import serve_draft

    started = time.monotonic()
    credentials = _server_credentials(args)
    _check_service_auth(args)
    proposer, path = build_proposer(args)
    server, port = await serve_draft(proposer, path, args.service_host, args.service_port,
                                     metrics=_service_metrics(args, "draft"), credentials=credentials,
                                     service_api_key=args.service_api_key, seq_idle_ttl_s=args.seq_idle_ttl,
                                     profiler=_profiler(args, "draft", getattr(getattr(proposer, "runner", None), "device", None)
                                                        or getattr(proposer, "device", None)))
    runner = getattr(proposer, "runner", None)
    print(f"tandem draft ({proposer.algorithm}) ready on {args.service_host}:{port} in "
          f"{time.monotonic() - started:.1f} s" + (f": {_runner_summary(runner)}" if runner is not None else ""),
          flush=True)
    await _serve_until_signal(server)


def _profiler(args: argparse.Namespace, service: str, device=None):
    """This process's ProcessProfiler (protos/profiler.py): on with --profile-dir or TANDEM_TORCH_PROFILER_DIR."""
    from protos.profiler import ProcessProfiler, profile_dir

    return ProcessProfiler(service, profile_dir(getattr(args, "profile_dir", None)),
                           getattr(device, "type", None) or str(device or "cpu").split(":")[0])


async def _wait_for_pod(client, name: str, deadline_s: float):
    from gateway.clients import PodUnavailable

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return await client.info(timeout_s=5.0)
        except PodUnavailable as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: {name} at {client.address} did not come up: {exc}") from None
            await asyncio.sleep(0.5)


def _overlap_schedule(args: argparse.Namespace, target_infos, draft_infos) -> str:
    """The gateway's ping-pong halves (gateway/overlap.py): measured per batch size ("auto") unless turned off, or
    unless a draft pod computes on the same device as a target pod. One device runs one half at a time, so a phase
    costs what a whole sequential step does and the split halves the throughput (H200, demo family, EAGLE3 4/2/8:
    0.50x at batch 8, 0.52x at batch 32; bench/results/overlap_h200/NOTES.md)."""
    if args.disable_overlap_schedule or algorithms.get(getattr(args, "speculative_algorithm", None)).drafts_on_target:
        return "off"  # (drafts on the target: Propose and Verify of a sequence go to the same pod)
    shared = ({i.accelerator for i in target_infos} & {i.accelerator for i in draft_infos}) - {""}
    if shared and getattr(args, "enable_overlap_drafting", False):
        logger.warning("--enable-overlap-drafting with draft and target pods on one device (%s): pre-drafts compete "
                       "with the Verify for it (H200, demo family, EAGLE3: 0.53x chain, 0.59x tree of the sequential "
                       "loop; bench/results/dflash_uno_h200/NOTES.md)", ", ".join(sorted(shared)))
    if shared:
        logger.info("overlap schedule: draft and target pods share %s: batches are not split into ping-pong halves",
                    ", ".join(sorted(shared)))
        return "off"
    return "auto"


async def run_gateway(args: argparse.Namespace) -> None:
    import uvicorn

    from gateway.clients import DraftClient, TargetClient
    from gateway.grpc_api import GatewayServicer, follow_health, serve_gateway_grpc
    from gateway.http_server import uvicorn_config
    from gateway.openai_api import build_app
    from gateway.routing import RoutingConfig
    from gateway.scheduler import Scheduler, SchedulerConfig, SpecConfig
    from gateway.tokenizer import Tokenizer

    path = model_path(args)
    creds = _channel_credentials(args)
    target_specs, draft_specs = _addresses(args.target_address), _addresses(args.draft_address)
    streams = not args.disable_step_streams
    key = args.service_api_key
    targets = [TargetClient(a, credentials=creds, step_streams=streams, service_api_key=key)
               for a in await _resolve_all(target_specs, args.startup_timeout)]
    drafts = [DraftClient(a, credentials=creds, step_streams=streams, service_api_key=key)
              for a in (await _resolve_all(draft_specs, args.startup_timeout) if draft_specs else [])]
    print(f"tandem gateway: waiting for {len(targets)} target and {len(drafts)} draft pod(s)", flush=True)
    infos = await asyncio.gather(*(_wait_for_pod(t, "target", args.startup_timeout) for t in targets))
    draft_infos = await asyncio.gather(*(_wait_for_pod(d, "draft", args.startup_timeout) for d in drafts))
    info = infos[0]
    spec_name = algorithms.get(args.speculative_algorithm).name
    # Target pods that draft in their own process (--colocate-draft, UNO) say so in their Info: the gateway routes
    # each sequence's Propose to its target pod and has every Verify draft the next tree.
    on_target = spec_name != algorithms.NONE.name and all(i.algorithm == spec_name for i in infos)
    if on_target and not drafts:
        drafts = [DraftClient(t.address, credentials=creds, step_streams=streams, service_api_key=key)
                  for t in targets]
    elif on_target and {d.address for d in drafts} != {t.address for t in targets}:
        logger.info("the target pods draft %s themselves, but --draft-address names other pods: drafting there, "
                    "one Propose and one Verify per step", spec_name)
        on_target = False
    tokenizer = Tokenizer(args.tokenizer_path or path)
    served = list(args.served_model_name or [])
    name = served[0] if served else Path(path).name
    aliases = model_aliases(path, served)
    spec = SpecConfig(args.speculative_algorithm or algorithms.NONE.name, args.speculative_num_steps or 0,
                      args.speculative_eagle_topk or 1, args.speculative_num_draft_tokens or 1)
    eos = sorted({*info.eos_token_ids, *tokenizer.eos_token_ids})
    adaptive = None
    if getattr(args, "speculative_adaptive", False):
        from gateway.adaptive import AdaptiveSpec, load_config

        try:
            adaptive = AdaptiveSpec(load_config(args.speculative_adaptive_config, spec.num_steps), spec.num_steps)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    try:
        routing = RoutingConfig(args.routing_policy, args.kv_block_size, args.cache_threshold,
                                args.balance_abs_threshold, args.balance_rel_threshold)
        config = SchedulerConfig(args.max_running_requests, args.max_queued_requests, args.request_timeout,
                                 max_prompt_tokens=args.max_prompt_tokens,
                                 enable_overlap_drafting=args.enable_overlap_drafting,
                                 overlap_schedule=_overlap_schedule(args, infos, draft_infos),
                                 defer_delivery=not args.disable_overlap_schedule,
                                 num_continuous_decode_steps=continuous_decode_steps(args),
                                 speculative_steps_per_call=speculative_steps_per_call(args),
                                 routing=routing,
                                 drafts_on_target=on_target,
                                 pod_probe_interval_s=args.pod_probe_interval, no_target_wait_s=args.no_target_wait)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    scheduler = Scheduler(targets=targets, drafts=drafts, tokenizer=tokenizer, model_name=name,
                          max_context_len=info.max_context_len, vocab_size=info.vocab_size, eos_token_ids=eos,
                          spec=spec, config=config, adaptive=adaptive, profiler=_profiler(args, "gateway"))
    await scheduler.start()
    refresher = None
    if any(a.startswith("dns:///") for a in [*target_specs, *draft_specs]):
        refresher = asyncio.create_task(_refresh_pods(scheduler, target_specs, draft_specs, args.pod_refresh_interval,
                                                      creds, streams, key))
    gateway_info = dict(model=name, speculative_algorithm=spec.algorithm, num_steps=spec.num_steps, topk=spec.topk,
                        num_draft_tokens=spec.num_draft_tokens, max_context_len=info.max_context_len,
                        target_addresses=[t.address for t in targets], draft_addresses=[d.address for d in drafts])
    grpc_server = await serve_gateway_grpc(GatewayServicer(scheduler, tokenizer, gateway_info), args.host,
                                           args.grpc_port, api_key=args.api_key)
    health_follower = asyncio.create_task(follow_health(grpc_server, scheduler.health))
    app = build_app(scheduler, tokenizer, name, max_model_len=info.max_context_len,
                    max_body_bytes=args.max_request_body_bytes, api_key=args.api_key, metrics=scheduler.metrics,
                    served_model_names=served[1:], model_aliases=aliases, body_timeout_s=args.http_body_timeout)
    # JSON logs: let uvicorn's loggers propagate to the root handler instead of installing its own text ones.
    log_config = None if args.log_format == "json" else uvicorn.config.LOGGING_CONFIG
    config = uvicorn_config(app, args.host, args.port, header_timeout_s=args.http_header_timeout,
                            log_level="warning", lifespan="off", log_config=log_config, timeout_graceful_shutdown=5)
    http = uvicorn.Server(config)
    try:
        serving = asyncio.create_task(http.serve())  # returns on SIGINT/SIGTERM (uvicorn installs the handlers)
        while not http.started and not serving.done():  # the ready line only once the port is bound
            await asyncio.sleep(0.02)
        if http.started:
            print(f"tandem gateway ready: http://{args.host}:{args.port}/v1 grpc {args.host}:{args.grpc_port} "
                  f"model={name} speculative={spec.algorithm}", flush=True)
        await serving
    finally:
        health_follower.cancel()
        if refresher is not None:
            refresher.cancel()
        await grpc_server.stop(grace=1.0)
        await scheduler.close()


def model_aliases(path: str, served_names: list[str]) -> list[str]:
    """Every `model` value a request may name: the served names, the model path as given and resolved, its folder
    name (clients copy any of them from the launch command)."""
    names = [*served_names, path, str(Path(path).resolve()), Path(path).name]
    return list(dict.fromkeys(n for n in names if n))


def _service_metrics(args: argparse.Namespace, service: str):
    """A ServiceMetrics served on --metrics-port, or None when the port is 0."""
    if not args.metrics_port:
        return None
    from tandem.observability import ServiceMetrics, start_metrics_server

    metrics = ServiceMetrics(service)
    host = args.metrics_host or args.service_host  # never wider than the service itself
    server = start_metrics_server(metrics.registry, host, args.metrics_port)
    logger.info("%s metrics on http://%s:%d/metrics", service, host, server.server_port)
    return metrics


def _server_credentials(args: argparse.Namespace):
    """TLS (mTLS with --tls-ca) for a model service's gRPC port, or None for plaintext."""
    if not (args.tls_cert or args.tls_key):
        if args.tls_ca:
            raise SystemExit("error: --tls-ca needs --tls-cert and --tls-key")
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("error: --tls-cert and --tls-key go together")
    from protos.wire import server_credentials

    return server_credentials(args.tls_cert, args.tls_key, args.tls_ca)


def _check_service_auth(args: argparse.Namespace) -> None:
    """A model service reachable beyond this machine needs a credential: the service key or client certificates."""
    import ipaddress

    if args.service_api_key or args.tls_ca or args.allow_unauthenticated:
        return
    host = args.service_host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"error: --service-host {host} serves beyond this machine: set --service-api-key (or "
                         "$TANDEM_SERVICE_API_KEY), or mTLS with --tls-ca, or pass --allow-unauthenticated")
    if args.service_api_key is None:
        logger.warning("no --service-api-key: any local process can call this service")


def _channel_credentials(args: argparse.Namespace):
    """TLS credentials of the gateway's channels to the pods, or None for plaintext."""
    if not (args.service_tls_ca or args.service_tls_cert or args.service_tls_key):
        return None
    from protos.wire import channel_credentials

    try:
        return channel_credentials(args.service_tls_ca, args.service_tls_cert, args.service_tls_key)
    except ValueError as exc:
        raise SystemExit(f"error: --service-tls-cert/--service-tls-key: {exc}") from None


async def _resolve_all(specs: list[str], deadline_s: float) -> list[str]:
    """Expand dns:/// names into pod addresses, waiting (with a deadline) until at least one resolves."""
    from gateway.pods import resolve

    deadline = time.monotonic() + deadline_s
    while True:
        found = sorted({a for spec in specs for a in resolve(spec)})
        if found:
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"error: none of {specs} resolved to a pod address")
        await asyncio.sleep(1.0)


async def _refresh_pods(scheduler, target_specs: list[str], draft_specs: list[str], interval_s: float,
                        credentials=None, step_streams: bool = True, service_api_key: str | None = None) -> None:
    """Follow scaling: re-resolve dns:/// names and let the pod pools add or retire pods."""
    from gateway.clients import DraftClient, TargetClient
    from gateway.pods import resolve

    while True:
        await asyncio.sleep(interval_s)
        kwargs = dict(credentials=credentials, step_streams=step_streams, service_api_key=service_api_key,
                      owner=scheduler.gateway_id)
        for specs, pool, factory in ((target_specs, scheduler.targets, lambda a: TargetClient(a, **kwargs)),
                                     (draft_specs, scheduler.drafts, lambda a: DraftClient(a, **kwargs))):
            found = sorted({a for spec in specs for a in await asyncio.to_thread(lambda s=spec: resolve(s))})
            if found or not specs:  # an empty answer is more likely a DNS hiccup than zero pods: keep what we have
                _, removed = pool.update(found, factory)
                if pool is scheduler.targets:
                    for address in removed:  # a pod that comes back under the address starts with an empty cache
                        scheduler.router.forget(address)


def _addresses(value: str | None) -> list[str]:
    """HOST:PORT[,HOST:PORT...] → list."""
    return [a.strip() for a in (value or "").split(",") if a.strip()]


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main_async(fn, args: argparse.Namespace) -> None:
    from tandem.observability import setup_logging

    # As PID 1 of a container the kernel drops any signal that has no handler, so until _serve_until_signal (or
    # uvicorn) installs its own, while weights load, `docker stop` / a pod deletion would wait out the grace period
    # and SIGKILL. Exit like an ordinary process meanwhile (status 143).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    setup_logging(args.log_level, args.log_format)
    try:
        asyncio.run(fn(args))
    except KeyboardInterrupt:
        pass
