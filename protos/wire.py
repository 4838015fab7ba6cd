"""Helpers shared by every gRPC server and client: tensor <-> bytes, channel/server options, health + reflection.

Only servicers, their convert modules and the gateway's clients import this (wire types stay at the wire).
"""
from __future__ import annotations

import numpy as np

from protos.tandem.v1 import tandem_pb2

PROTOCOL = "tandem.v1"
OWNER_METADATA = "x-tandem-owner"  # call metadata: the gateway id that owns the sequences it creates on a pod
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
# Tensor payloads (hidden states) exceed gRPC's 4 MiB default; keepalive lets a dead pod show up within seconds.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # A restarted pod is used again within about a second (gRPC's default backoff grows to 120 s between attempts).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]

_NUMPY_DTYPES = {
    "float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_,
    "uint8": np.uint8,
}


def tensor_to_pb(tensor) -> tandem_pb2.Tensor:
    """A torch tensor or numpy array → Tensor (bfloat16 travels as its raw 2-byte pattern)."""
    if hasattr(tensor, "detach"):
        import torch

        t = tensor.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            return tandem_pb2.Tensor(dtype="bfloat16", shape=list(t.shape), data=t.view(torch.int16).numpy().tobytes())
        dtype = str(t.dtype).removeprefix("torch.")
        return tandem_pb2.Tensor(dtype=dtype, shape=list(t.shape), data=t.numpy().tobytes())
    arr = np.ascontiguousarray(tensor)
    return tandem_pb2.Tensor(dtype=str(arr.dtype), shape=list(arr.shape), data=arr.tobytes())


def tensor_from_pb(msg: tandem_pb2.Tensor, *, device: str = "cpu"):
    """Tensor → torch tensor on `device`; None when the message is empty."""
    import torch

    if not msg.dtype:
        return None
    shape = tuple(msg.shape)
    if msg.dtype == "bfloat16":
        arr = np.frombuffer(msg.data, dtype=np.int16).reshape(shape)
        return torch.from_numpy(arr.copy()).view(torch.bfloat16).to(device)
    if msg.dtype not in _NUMPY_DTYPES:
        raise ValueError(f"unsupported tensor dtype on the wire: {msg.dtype!r}")
    arr = np.frombuffer(msg.data, dtype=_NUMPY_DTYPES[msg.dtype])
    if arr.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"tensor bytes ({arr.size} elements) do not match shape {shape}")
    return torch.from_numpy(arr.reshape(shape).copy()).to(device)


def server_credentials(cert_file: str, key_file: str, ca_file: str | None = None):
    """TLS for a service port from PEM files; with a CA, clients must present a certificate it signed (mTLS)."""
    import grpc

    ca = _read(ca_file) if ca_file else None
    return grpc.ssl_server_credentials([(_read(key_file), _read(cert_file))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None):
    """TLS for a channel to a service: trust `ca_file` (default: the system roots); cert + key for mTLS."""
    import grpc

    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs its key and vice versa")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file) if ca_file else None,
                                        private_key=_read(key_file) if key_file else None,
                                        certificate_chain=_read(cert_file) if cert_file else None)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def start_server(register, service_names: list[str], host: str, port: int, *, interceptors=(),
                       credentials=None, service_api_key: str | None = None):
    """Start a grpc.aio server with health (SERVING) and reflection; returns (server, bound_port, health).
    credentials: `server_credentials(...)` for a TLS port, None for plaintext; service_api_key: every RPC but health
    checks needs `authorization: Bearer <key>` metadata (else UNAUTHENTICATED)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from protos.service_auth import BearerTokenInterceptor

    auth = [BearerTokenInterceptor(service_api_key, "service credential")] if service_api_key else []
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*auth, *interceptors])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer
