"""deploy/k8s manifests: every document parses, passes the Kubernetes OpenAPI schema in strict mode (PyPI
`kubernetes-validate`, skipped if missing), and the cross-references hold: selectors match pod labels, Services and
probes point at declared container ports, volumes and ConfigMaps exist, HPAs scale real Deployments on a queue metric
with a CPU fallback, and every container command is a real `tandem` subcommand whose flags tandem's parser accepts
(after Kubernetes' `$(VAR)` expansion from the ConfigMap). No cluster is needed.
"""
from __future__ import annotations

import re
import shlex

import pytest
import yaml

from tandem.cli import build_parser
from tests.deploy.conftest import REPO_ROOT

K8S = REPO_ROOT / "deploy" / "k8s"
NOT_RESOURCES = {"kustomization.yaml", "prometheus-adapter-values.yaml"}
KUBERNETES_VERSION = "1.30.0"  # gRPC probes are GA since 1.27


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name not in NOT_RESOURCES:
            docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = _documents()


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


def _containers(deployment: dict) -> list[dict]:
    spec = deployment["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion in command/args: $(NAME) from the container env, $$ → a literal $."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _env(container: dict) -> dict[str, str]:
    env = {}
    configmaps = _by_kind("ConfigMap")
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def _tandem_argv(container: dict) -> list[str] | None:
    """The argv after `tandem`, or None for a container that does not run tandem (envoy itself)."""
    env = _env(container)
    command = [_expand(c, env) for c in container.get("command", [])]
    args = [_expand(a, env) for a in container.get("args", [])]
    if command == ["sh", "-c"]:
        script = re.sub(r"\$\([^)]*\)", "10.0.0.1:1", args[0])  # the shell's command substitutions
        words = shlex.split(script)
        assert words[0] == "exec", "the shell must exec tandem so it receives SIGTERM"
        return words[2:] if words[1] == "tandem" else None
    if command:  # an explicit binary other than the image's `tandem` entrypoint
        return None
    return args


def test_manifest_set_is_complete_and_listed_in_kustomization():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in DOCS}
    for name in ("tandem-gateway", "tandem-draft", "tandem-target"):
        assert ("Deployment", name) in kinds and ("Service", name) in kinds
    assert ("ConfigMap", "tandem-flags") in kinds
    assert sum(kind == "HorizontalPodAutoscaler" for kind, _ in kinds) >= 1
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted({f for f, _ in DOCS})


@pytest.mark.parametrize("doc", [d for _, d in DOCS], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_documents_pass_the_kubernetes_schema_strictly(doc):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_schema_check_can_fail():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    bad = yaml.safe_load(yaml.safe_dump(_by_kind("Deployment")["tandem-target"]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"  # must be a number
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_selectors_match_pod_labels_and_services_reach_declared_ports():
    deployments = _by_kind("Deployment")
    for name, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for name, svc in _by_kind("Service").items():
        selected = [d for d in deployments.values()
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} Deployments"
        ports = [p for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in (p.get("name"), p["containerPort"]) for p in ports), f"{name}: {target}"


def test_probes_use_grpc_health_on_declared_ports():
    for name in ("tandem-gateway", "tandem-draft", "tandem-target"):
        container = _by_kind("Deployment")[name]["spec"]["template"]["spec"]["containers"][0]
        declared = {p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] in declared, f"{name} {probe}"
        # the probe port is the port the service binds (flag value)
        args = build_parser().parse_args(_tandem_argv(container))
        bound = args.grpc_port if args.command == "gateway" else args.service_port
        assert container["readinessProbe"]["grpc"]["port"] == bound, name
        if args.command == "gateway":
            assert container["readinessProbe"]["grpc"]["service"] == "tandem.v1.Gateway"
            assert {p["containerPort"] for p in container["ports"]} == {args.port, args.grpc_port}
        else:
            assert args.service_host == "0.0.0.0"


def test_model_pods_request_gpus_behind_headless_services():
    for name in ("tandem-draft", "tandem-target"):
        container = _by_kind("Deployment")[name]["spec"]["template"]["spec"]["containers"][0]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert _by_kind("Service")[name]["spec"]["clusterIP"] == "None"
    gateway = _by_kind("Deployment")["tandem-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in gateway["resources"].get("limits", {})


def test_every_container_runs_a_real_tandem_command_with_real_flags():
    parser = build_parser()
    seen = {}
    for dep in _by_kind("Deployment").values():
        for container in _containers(dep):
            argv = _tandem_argv(container)
            if argv is None:
                assert container["command"][0] == "envoy"
                continue
            assert not any("$(" in a for a in argv), f"unexpanded variable in {argv}"
            args = parser.parse_args(argv)  # SystemExit (test error) on an unknown subcommand or flag
            seen[args.command] = args
    assert set(seen) == {"target", "draft", "gateway", "envoy-config"}
    algorithms = {seen[c].speculative_algorithm for c in ("target", "draft", "gateway")}
    assert len(algorithms) == 1, "the three services must agree on the speculative algorithm"
    assert seen["envoy-config"].gateway_grpc == ["tandem-gateway:30001"]


def test_gateway_resolves_the_headless_services_it_routes_over():
    container = _by_kind("Deployment")["tandem-gateway"]["spec"]["template"]["spec"]["containers"][0]
    services = _by_kind("Service")
    script = container["args"][0]
    for name in ("tandem-target", "tandem-draft"):
        port = services[name]["spec"]["ports"][0]["port"]
        assert f"=dns:///{name}:{port}" in script  # re-resolved by the gateway, so new pods join


def test_volumes_and_configmaps_referenced_exist():
    claims = set(_by_kind("PersistentVolumeClaim"))
    for name, dep in _by_kind("Deployment").items():
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes", [])}
        for container in _containers(dep):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: {mount['name']}"
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        for container in _containers(dep):
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in _by_kind("ConfigMap")


def test_hpas_scale_deployments_on_queue_depth_with_cpu_fallback():
    deployments = _by_kind("Deployment")
    hpas = _by_kind("HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} >= {"tandem-gateway", "tandem-target"}
    for name, hpa in hpas.items():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments
        metrics = hpa["spec"]["metrics"]
        queue = [m[m["type"].lower()]["metric"]["name"] for m in metrics if m["type"] in ("Pods", "External")]
        assert queue and all(q.startswith("tandem_gateway_queue_depth") for q in queue), name
        assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in metrics), name
        containers = deployments[target["name"]]["spec"]["template"]["spec"]["containers"]
        assert all("cpu" in c["resources"]["requests"] for c in containers)  # utilisation needs a CPU request
    gateway_metric = next(m for m in hpas["tandem-gateway"]["spec"]["metrics"] if m["type"] == "Pods")
    assert gateway_metric["pods"]["metric"]["name"] == "tandem_gateway_queue_depth"
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())["rules"]
    served = {r["name"]["as"] for rules in adapter.values() for r in rules}
    assert set(queue for h in hpas.values() for queue in
               [m[m["type"].lower()]["metric"]["name"] for m in h["spec"]["metrics"] if m["type"] != "Resource"]
               ) <= served


def test_adapter_rules_query_a_series_the_gateway_really_exports():
    """The HPA queue metric must come from a gauge the gateway's /metrics actually has."""
    import re

    from gateway.metrics import GatewayMetrics

    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    metrics = GatewayMetrics()
    metrics.bind(num_waiting=lambda: 0, num_running=lambda: 0, pools={})  # what the scheduler binds at start
    exported = {m.name for m in metrics.registry.collect()}
    for rule in [*values["rules"]["custom"], *values["rules"]["external"]]:
        series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
        assert series in exported, f"{series} is not exported by the gateway"


def test_model_services_need_the_service_key_and_only_gateways_reach_them():
    """Issue 15 §2: target, draft and gateway read TANDEM_SERVICE_API_KEY from one Secret; NetworkPolicies admit only
    gateway pods to the model services' gRPC ports."""
    deployments = _by_kind("Deployment")
    for name in ("tandem-target", "tandem-draft", "tandem-gateway"):
        [container] = deployments[name]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        ref = env["TANDEM_SERVICE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "tandem-service-key", "key": "TANDEM_SERVICE_API_KEY"}, name
    policies = _by_kind("NetworkPolicy")
    gateway_labels = deployments["tandem-gateway"]["spec"]["template"]["metadata"]["labels"]
    for name, port in (("tandem-target", 30010), ("tandem-draft", 30020)):
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        [policy] = [p for p in policies.values()
                    if p["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        grpc_rules = [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": port} in r["ports"]]
        assert grpc_rules and all(src["podSelector"]["matchLabels"].items() <= gateway_labels.items()
                                  for r in grpc_rules for src in r["from"])
