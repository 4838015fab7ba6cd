"""Helpers shared by every gRPC server and client: tensor <-> bytes, channel/server options, health + reflection.

Only servicers, their convert modules and the gateway's clients import this (wire types stay at the wire).
"""
from __future__ import annotations

import numpy as np

from protos.tandem.v1 import tandem_pb2

PROTOCOL = "tandem.v1"
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
# Tensor payloads (hidden states) exceed gRPC's 4 MiB default; keepalive lets a dead pod show up within seconds.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
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


async def start_server(register, service_names: list[str], host: str, port: int, *, interceptors=()):
    """Start a grpc.aio server with health (SERVING) and reflection; returns (server, bound_port, health)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(interceptors))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer
