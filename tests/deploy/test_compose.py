"""docker-compose.yml: parsed by a real Compose implementation (Debian's `docker-compose config`, and its bundled
compose-spec JSON schema through `jsonschema`), then checked for what a deployment relies on: grpc.health.v1
healthchecks on the ports the services bind, `service_healthy` ordering, GPU reservations, the model volume,
scalable services, and commands that tandem's own CLI parser accepts. No Docker engine is needed.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tandem.cli import build_parser
from tests.deploy.conftest import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"
GPU_OVERRIDE = REPO_ROOT / "docker-compose.override.yml"
CPU_OVERRIDE = REPO_ROOT / "deploy" / "docker" / "compose.cpu.yml"
SCALED = ("target", "draft", "gateway")
COMPOSE_SPEC_SCHEMA = Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")


def _interpolate(text: str) -> str:
    """Compose variable interpolation with defaults only (`${VAR:-default}`; `$$` stays a literal `$`)."""
    text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)
    return text.replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(_interpolate(COMPOSE_FILE.read_text()))


def _argv(service: dict) -> list[str]:
    """The tandem argv a container runs (entrypoint `tandem`, or `sh -c "exec tandem ..."` with $(...) stubbed)."""
    command = service["command"]
    if service.get("entrypoint") == ["sh", "-c"]:
        script = re.sub(r"\$\([^)]*\)", "10.0.0.1:1", command[0])  # command substitutions resolve pod addresses
        words = shlex.split(script.split("&&")[0])
        words = words[1:] if words[0] == "exec" else words
        assert words[0] == "tandem", words
        return words[1:]
    return list(command)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_config_accepts_the_file():
    for env in ({}, {"TANDEM_SPECULATIVE_ALGORITHM": "NGRAM", "TANDEM_MODELS_DIR": "/srv/models"}):
        result = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "config", "-q"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})
        assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("condition: service_healthy", "condition: when_ready", 1))
    result = subprocess.run(["docker-compose", "-f", str(broken), "config", "-q"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0  # proves the check above can fail


@pytest.mark.skipif(not COMPOSE_SPEC_SCHEMA.exists(), reason="compose-spec schema (docker-compose package) missing")
def test_file_matches_the_compose_spec_schema(compose):
    jsonschema = pytest.importorskip("jsonschema")
    import json

    schema = json.loads(COMPOSE_SPEC_SCHEMA.read_text())
    plain = {k: v for k, v in compose.items() if not k.startswith("x-")}  # YAML anchors already merged
    jsonschema.Draft201909Validator(schema).validate(plain)  # the spec file declares 2019-09


def test_services_and_dependency_order(compose):
    services = compose["services"]
    assert set(services) == {"envoy", "gateway", "draft", "target"}
    assert services["gateway"]["depends_on"] == {"target": {"condition": "service_healthy"},
                                                 "draft": {"condition": "service_healthy"}}
    assert services["envoy"]["depends_on"] == {"gateway": {"condition": "service_healthy"}}


def test_scaled_services_have_no_fixed_names_or_host_ports(compose):
    for name in SCALED:
        service = compose["services"][name]
        assert "container_name" not in service and "ports" not in service, name
    assert compose["services"]["envoy"]["ports"]  # the edge is the one published port


@pytest.mark.parametrize("name", ["target", "draft"])
def test_model_services_reserve_a_gpu_and_mount_models(compose, name):
    service = compose["services"][name]
    # The reservation is in docker-compose.override.yml (Compose adds it when no -f is given), so that the CPU
    # variant, which names its files, can leave it out: an override cannot delete a device reservation.
    assert "deploy" not in service
    override = yaml.safe_load(GPU_OVERRIDE.read_text())
    assert set(override["services"]) == {"target", "draft"}
    devices = override["services"][name]["deploy"]["resources"]["reservations"]["devices"]
    assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert not any("count" in d and "device_ids" in d for d in devices)  # mutually exclusive in Compose
    assert any(v.endswith(":/models:ro") for v in service["volumes"])
    assert "--device=cuda:0" in service["command"]


def test_healthchecks_probe_grpc_health_on_the_bound_port(compose):
    parser = build_parser()
    for name, port_flag in (("target", "service_port"), ("draft", "service_port"), ("gateway", "grpc_port")):
        service = compose["services"][name]
        args = parser.parse_args(_argv(service))
        test = service["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "tandem.healthcheck"]
        address = test[test.index("--address") + 1]
        assert address == f"127.0.0.1:{getattr(args, port_flag)}", name
        assert str(getattr(args, port_flag)) in service["expose"]
        host = args.host if name == "gateway" else args.service_host
        assert host == "0.0.0.0", f"{name} must bind all interfaces inside its container"


def test_commands_are_accepted_by_the_tandem_parser(compose):
    parser = build_parser()
    commands = {name: parser.parse_args(_argv(compose["services"][name])) for name in compose["services"]}
    assert [commands[n].command for n in ("target", "draft", "gateway", "envoy")] == \
        ["target", "draft", "gateway", "envoy-config"]
    assert commands["envoy"].gateway_http == ["gateway:30000"]
    assert commands["envoy"].gateway_grpc == ["gateway:30001"]
    assert commands["envoy"].listen_port == 8080
    assert compose["services"]["envoy"]["ports"] == ["8080:8080"]
    gateway = compose["services"]["gateway"]["command"][0]
    assert "--target-address=dns:///target:30010" in gateway and "--draft-address=dns:///draft:30020" in gateway
    for name in ("target", "draft", "gateway"):  # all three agree on the speculative configuration
        assert commands[name].speculative_algorithm == "STANDALONE"
        assert commands[name].model_path == "/models/tandem-demo-code"


def test_dockerfile_has_base_image_args_and_tandem_entrypoint():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.1\d-slim", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert 'ENTRYPOINT ["tandem"]' in text
    for source in ("core", "protos", "runtime", "tandem_kernels", "target_service", "draft_service", "gateway", "tandem"):
        assert re.search(rf"^COPY {source} {source}$", text, re.M), source
        assert (REPO_ROOT / source).is_dir()
    gpu_build = yaml.safe_load(COMPOSE_FILE.read_text())["x-tandem-gpu-image"]["build"]
    assert gpu_build["dockerfile"] == "deploy/docker/Dockerfile"
    assert gpu_build["args"]["BASE_IMAGE"].startswith("nvidia/cuda:")


def _compose_config(*files: Path, env: dict | None = None) -> dict:
    cmd = ["docker-compose"] + [f"-f{f}" for f in files] + ["config"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_default_files_reserve_gpus_and_the_cpu_variant_does_not():
    gpu = _compose_config(COMPOSE_FILE, GPU_OVERRIDE)  # what `docker compose up` reads (no -f)
    for name in ("target", "draft"):
        assert gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
        assert gpu["services"][name]["image"] == "tandem:cuda"
    env = {"TANDEM_BASE_IMAGE": "tandem-base:bookworm", "TANDEM_WHEELHOUSE": ".wheelhouse"}
    cpu = _compose_config(COMPOSE_FILE, CPU_OVERRIDE, env=env)
    parser = build_parser()
    builds = []
    for name, service in cpu["services"].items():
        assert "deploy" not in service, name
        assert service["image"] == "tandem:slim", name
        builds.append(service["build"])
        if name in ("target", "draft"):
            args = parser.parse_args(service["command"])
            assert args.device == "cpu" and args.model_path == "/models/tandem-demo-code"
            assert args.service_host == "0.0.0.0" and str(args.service_port) in service["expose"]
    # one image, so every service must build it identically (else the last build would win the tag)
    assert all(b == builds[0] for b in builds)
    assert builds[0]["args"]["BASE_IMAGE"] == "tandem-base:bookworm"
    assert builds[0]["args"]["WHEELHOUSE"] == ".wheelhouse"
    assert builds[0]["dockerfile"] == "deploy/docker/Dockerfile"


def test_dockerfile_builds_offline_from_a_wheelhouse():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG WHEELHOUSE=$", text, re.M)
    assert "PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse" in text
    assert "--no-index -e ." in text  # the project itself installs without an index either way
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and ".wheelhouse" not in ignored
    assert ".wheelhouse/" in (REPO_ROOT / ".gitignore").read_text().split()
def test_model_services_get_the_service_key_and_publish_nothing(compose):
    """Issue 15 §2: target, draft and gateway take TANDEM_SERVICE_API_KEY from the shell / .env; only envoy publishes
    a host port."""
    for name in ("target", "draft", "gateway"):
        assert "TANDEM_SERVICE_API_KEY" in compose["services"][name]["environment"], name
    assert [n for n, s in compose["services"].items() if "ports" in s] == ["envoy"]
