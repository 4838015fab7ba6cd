"""Fixtures for the operations tests: a tiny random Llama with the bundled tokenizer, a throwaway CA with server and
client certificates (cryptography), and an in-process stack — real target/draft gRPC servers with their metrics,
a real Scheduler and the real OpenAI REST app under uvicorn — all on one event loop, on loopback port 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import ipaddress
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tandem.args import DEFAULT_MODEL
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    path = Path(make_tiny_model("llama", tmp_path_factory.mktemp("ops-model"), vocab_size=2048,
                                max_position_embeddings=2048, num_hidden_layers=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEFAULT_MODEL / name).exists():
            shutil.copy(DEFAULT_MODEL / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_draft(tiny_model, tmp_path_factory) -> Path:
    """A draft that agrees with the target often but not always (so every acceptance position gets exercised)."""
    from tests.stack import perturbed_copy

    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("ops-draft") / "draft", noise=0.3)


# ------------------------------------------------------------------------------------------------ certificates
@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, key=None, cert=None) -> Path:
    from cryptography.hazmat.primitives import serialization

    if key is not None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    else:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, sans=None, client: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    from cryptography import x509

    d = tmp_path_factory.mktemp("certs")
    ca_key = _key()
    ca = _cert("tandem test CA", ca_key, None, None, ca=True)
    server_key, client_key, other_key = _key(), _key(), _key()
    server = _cert("tandem-target", server_key, ca.subject, ca_key, ca=False,
                   sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _cert("tandem-gateway", client_key, ca.subject, ca_key, ca=False, client=True)
    other = _cert("unrelated CA", other_key, None, None, ca=True)
    return Certs(_write(d / "ca.pem", cert=ca), _write(d / "server.pem", cert=server),
                 _write(d / "server.key", key=server_key), _write(d / "client.pem", cert=client),
                 _write(d / "client.key", key=client_key), _write(d / "other-ca.pem", cert=other))


# ------------------------------------------------------------------------------------------------ in-process stack
@dataclass
class OpsStack:
    scheduler: object
    target_metrics: object
    draft_metrics: object | None
    target_metrics_url: str
    draft_metrics_url: str | None
    base_url: str | None  # the OpenAI REST front, when started


@contextlib.asynccontextmanager
async def ops_stack(model: Path, *, draft: Path | None = None, scheduler_config=None, serve_http: bool = False,
                    api_key: str | None = None, spec=(3, 1, 4)):
    """Target (+ STANDALONE draft) gRPC servers with ServiceMetrics served over HTTP, a Scheduler, and optionally the
    OpenAI app under uvicorn on this event loop."""
    import uvicorn

    from draft_service.server import serve_draft
    from draft_service.standalone import StandaloneProposer
    from gateway.clients import DraftClient, TargetClient
    from gateway.openai_api import build_app
    from gateway.scheduler import Scheduler, SchedulerConfig, SpecConfig
    from gateway.tokenizer import Tokenizer
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target
    from tandem.observability import ServiceMetrics, start_metrics_server

    engine_config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=16384)
    closers = []
    try:
        target_metrics = ServiceMetrics("target")
        http_t = start_metrics_server(target_metrics.registry, "127.0.0.1", 0)
        closers.append(http_t.shutdown)
        target_config = dataclasses.replace(engine_config, enable_prefix_cache=True)  # as `tandem target` runs
        server, port = await serve_target(TargetEngine(ModelRunner(str(model), target_config)), str(model),
                                          "127.0.0.1", 0, metrics=target_metrics)
        closers.append(lambda: server.stop(grace=None))
        target = TargetClient(f"127.0.0.1:{port}")
        closers.append(target.close)
        drafts, draft_metrics, draft_url = [], None, None
        if draft is not None:
            draft_metrics = ServiceMetrics("draft")
            http_d = start_metrics_server(draft_metrics.registry, "127.0.0.1", 0)
            closers.append(http_d.shutdown)
            draft_url = f"http://127.0.0.1:{http_d.server_port}/metrics"
            dserver, dport = await serve_draft(StandaloneProposer(ModelRunner(str(draft), engine_config)),
                                               str(draft), "127.0.0.1", 0, metrics=draft_metrics)
            closers.append(lambda: dserver.stop(grace=None))
            drafts = [DraftClient(f"127.0.0.1:{dport}")]
            closers.append(drafts[0].close)
        info = await target.info()
        tokenizer = Tokenizer(str(model))
        spec_config = SpecConfig("STANDALONE", *spec) if drafts else SpecConfig()
        scheduler = Scheduler(targets=[target], drafts=drafts, tokenizer=tokenizer, model_name="tiny",
                              max_context_len=info.max_context_len, vocab_size=info.vocab_size,
                              eos_token_ids=tokenizer.eos_token_ids, spec=spec_config,
                              config=scheduler_config or SchedulerConfig(request_timeout_s=60))
        await scheduler.start()
        closers.append(scheduler.close)
        base_url = None
        if serve_http:
            app = build_app(scheduler, tokenizer, "tiny", max_model_len=info.max_context_len, api_key=api_key,
                            max_body_bytes=1 << 16)
            http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                 lifespan="off"))
            task = asyncio.create_task(http.serve())

            async def stop_http():
                http.should_exit = True
                await task

            closers.append(stop_http)
            deadline = time.monotonic() + 20
            while not (http.started and http.servers):
                assert time.monotonic() < deadline and not task.done(), "uvicorn did not start"
                await asyncio.sleep(0.01)
            base_url = f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}"
        yield OpsStack(scheduler, target_metrics, draft_metrics, f"http://127.0.0.1:{http_t.server_port}/metrics",
                       draft_url, base_url)
    finally:
        for close in reversed(closers):
            result = close()
            if asyncio.iscoroutine(result):
                await result


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {'name{label="v",...}': value} (labels in exposition order), summing nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def scrape(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        r = await client.get(url, timeout=10)
    assert r.status_code == 200, r.text
    return parse_metrics(r.text)
