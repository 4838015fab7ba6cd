"""`python -m tandem.healthcheck`: a grpc.health.v1 probe for containers, plus pod discovery by DNS.

    python -m tandem.healthcheck --address 127.0.0.1:30010                 # exit 0 when SERVING, 1 otherwise
    python -m tandem.healthcheck --resolve target:30010 --wait 600          # print ip:port,ip:port of SERVING pods
    python -m tandem.healthcheck --address 127.0.0.1:30010 --tls-ca ca.pem [--tls-cert c.pem --tls-key k.pem]

Compose and Kubernetes healthchecks run the first form (no Go `grpc_health_probe` binary in the image). The second
turns a name that resolves to every replica (compose service name, Kubernetes headless Service) into the per-pod
address list the gateway routes sequences over. It knows nothing about the services beyond their health endpoint.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time


def check(address: str, service: str = "", timeout_s: float = 3.0, credentials=None,
          server_name: str | None = None) -> bool:
    """True when `address` answers grpc.health.v1 Check with SERVING for `service` ("" = the whole server).
    credentials: grpc channel credentials for a service started with --tls-cert/--tls-key (None = plaintext);
    server_name: the name its certificate was issued for, when it is not the host of `address` (e.g. a pod IP)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def resolve(host_port: str) -> list[str]:
    """Every IPv4/IPv6 address `host` resolves to, as sorted `ip:port` strings (IPv6 bracketed)."""
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {host_port!r}")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


def serving_pods(host_port: str, service: str, wait_s: float, min_pods: int, timeout_s: float,
                 credentials=None, server_name: str | None = None) -> list[str]:
    """Resolve `host_port` and health-check each address until at least `min_pods` are SERVING or `wait_s` passes."""
    deadline = time.monotonic() + wait_s
    while True:
        addresses = resolve(host_port)
        healthy = [a for a in addresses if check(a, service, timeout_s, credentials, server_name)]
        if len(healthy) >= min_pods and len(healthy) == len(addresses):
            return healthy
        if time.monotonic() >= deadline:
            return healthy  # some replicas still loading: start with the ones that serve
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.healthcheck", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--address", help="HOST:PORT to check once; exit 0 when SERVING")
    what.add_argument("--resolve", metavar="HOST:PORT",
                      help="print the comma-separated ip:port list of SERVING replicas behind a DNS name")
    parser.add_argument("--service", default="", help='grpc.health.v1 service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per Check call")
    parser.add_argument("--wait", type=float, default=0.0, help="--resolve: seconds to wait for replicas to serve")
    parser.add_argument("--min-pods", type=int, default=1, help="--resolve: replicas needed; exit 1 if fewer serve")
    parser.add_argument("--tls-ca", default=None,
                        help="PEM CA of the service's certificate: probe over TLS (services started with --tls-cert)")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate, for services that require mTLS")
    parser.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None,
                        help="name the service's certificate was issued for, when it differs from the probed host")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    credentials = None
    if args.tls_ca or args.tls_cert:
        from protos.wire import channel_credentials

        try:
            credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        except OSError as e:
            parser.error(f"cannot read TLS file: {e}")
    if args.address:
        ok = check(args.address, args.service, args.timeout, credentials, args.tls_server_name)
        if not ok:
            print(f"{args.address}: not SERVING", file=sys.stderr)
        return 0 if ok else 1
    pods = serving_pods(args.resolve, args.service, args.wait, args.min_pods, args.timeout, credentials,
                        args.tls_server_name)
    if len(pods) < args.min_pods:
        print(f"{args.resolve}: {len(pods)} SERVING replica(s), need {args.min_pods}", file=sys.stderr)
        return 1
    print(",".join(pods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
