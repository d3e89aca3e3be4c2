"""Checks deploy/kubernetes offline: every manifest against the Kubernetes API schemas
(``kubernetes-validate --strict``), and the manifests against each other and the daemon's flags."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
KUBE_DIR = REPO / "deploy" / "kubernetes"
BASE = KUBE_DIR / "base"
MANIFESTS = sorted(p for p in KUBE_DIR.rglob("*.yaml") if p.name != "kustomization.yaml")

# The oldest Kubernetes the manifests are for (gRPC probes are GA since 1.27) and the newest the
# installed kubernetes-validate has schemas for.
OLDEST_VERSION = "1.27.0"
VERSIONS = sorted(
    {OLDEST_VERSION, kubernetes_validate.utils.latest_version()},
    key=lambda v: tuple(int(x) for x in v.split(".")),
)

# Custom resources have no schema in kubernetes-validate (it reports "Couldn't find schema" and
# passes them). Those kinds are checked by the hand-written schemas below instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
# The part of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1) that
# servicemonitor.yaml uses: its required fields and value types, and no unknown fields (the same
# strictness as --strict). The CRD itself is not available offline.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": _LABELS,
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {
                                            "type": "array",
                                            "items": {
                                                "type": "string",
                                                "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$",
                                            },
                                        },
                                        "targetLabel": {"type": "string"},
                                        "action": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "separator": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all_docs() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in _docs(p)]


def _one(kind: str, path: Path | None = None) -> dict[str, Any]:
    docs = _docs(path) if path else _all_docs()
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _daemonset() -> dict[str, Any]:
    return _one("DaemonSet", BASE / "daemonset.yaml")


def _daemon_container() -> dict[str, Any]:
    containers = _daemonset()["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_manifests_found() -> None:
    names = {p.relative_to(KUBE_DIR).as_posix() for p in MANIFESTS}
    assert {
        "base/namespace.yaml",
        "base/daemonset.yaml",
        "base/service.yaml",
        "base/servicemonitor.yaml",
        "examples/train-job.yaml",
    } <= names


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(KUBE_DIR).as_posix())
def test_kubernetes_validate_strict(path: Path, version: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, output
    custom = {f"kind {kind} with api version {api}" for api, kind in CUSTOM_KINDS}
    for line in output.splitlines():
        if line.startswith("INFO") and " passed for resource " in line:
            continue
        # Only the custom kinds may go unchecked here; test_custom_resources checks them.
        assert "Couldn't find schema" in line and any(c in line for c in custom), line


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(KUBE_DIR).as_posix())
def test_custom_resources(path: Path) -> None:
    for doc in _docs(path):
        if (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor"):
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
        else:
            assert (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS, "add its schema"


def test_kustomization_lists_every_base_file() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    on_disk = {p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(resources) == on_disk
    namespace = kustomization["namespace"]
    for name in resources:
        for doc in _docs(BASE / name):
            if doc["kind"] == "Namespace":
                assert doc["metadata"]["name"] == namespace
            else:
                assert doc["metadata"].get("namespace", namespace) == namespace, name
    images = {image["name"] for image in kustomization["images"]}
    assert _daemon_container()["image"] in images


def test_every_resource_has_recommended_labels() -> None:
    for doc in _all_docs():
        labels = doc["metadata"].get("labels", {})
        assert "app.kubernetes.io/name" in labels, doc["metadata"]["name"]
        assert labels.get("app.kubernetes.io/part-of") == "smddp", doc["metadata"]["name"]


def test_daemonset_flags_exist_in_smddpd_help(daemon_help: str) -> None:
    container = _daemon_container()
    flags = [arg.split("=", 1)[0] for arg in container["args"] if arg.startswith("--")]
    assert flags, "the DaemonSet passes no flags"
    missing = [
        f for f in flags if not re.search(rf"(^|\s){re.escape(f)}(\s|$)", daemon_help, re.MULTILINE)
    ]
    assert missing == [], f"flags unknown to smddpd --help: {missing}"
    env_names = {e["name"] for e in container.get("env", []) if e["name"].startswith("SMDDP_")}
    unknown = {name for name in env_names if name not in daemon_help}
    assert unknown == set(), f"variables smddpd does not read: {unknown}"


def _container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_daemonset_probes_and_ports() -> None:
    container = _daemon_container()
    ports = _container_ports(container)
    assert ports == {"grpc": 7471, "peer": 7470, "data": 7472, "ucx": 7473, "metrics": 9464}
    args = container["args"]
    assert f"--grpc-bind=0.0.0.0:{ports['grpc']}" in args
    assert f"--peer-bind=0.0.0.0:{ports['peer']}" in args
    assert f"--data-port={ports['data']}" in args
    assert f"--ucx-port={ports['ucx']}" in args
    assert f"--http-bind=0.0.0.0:{ports['metrics']}" in args
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container[kind]
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"}, kind
        for handler in ("grpc", "httpGet", "tcpSocket"):
            if handler not in probe:
                continue
            port = probe[handler]["port"]
            if isinstance(port, str):
                assert port in ports, f"{kind} names port {port!r}, not a container port"
            else:
                assert port in ports.values(), f"{kind} uses port {port}, not a container port"
        if "grpc" in probe:
            # The kubelet's gRPC probe takes a number; it must be the port named grpc.
            assert probe["grpc"]["port"] == ports["grpc"], kind
    for kind in ("livenessProbe", "readinessProbe"):
        assert "grpc" in container[kind], f"{kind} should use the native gRPC probe"


def test_service_and_servicemonitor_ports_exist() -> None:
    service = _one("Service", BASE / "service.yaml")
    template = _daemonset()["spec"]["template"]
    ports = _container_ports(_daemon_container())
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert target in ports if isinstance(target, str) else target in ports.values()
    selector = service["spec"]["selector"]
    assert selector.items() <= template["metadata"]["labels"].items()
    monitor = _one("ServiceMonitor", BASE / "servicemonitor.yaml")
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )


def test_daemonset_pod_spec() -> None:
    ds = _daemonset()
    spec = ds["spec"]
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    assert spec["updateStrategy"]["rollingUpdate"]["maxUnavailable"]
    assert pod["hostIPC"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert "terminationGracePeriodSeconds" in pod
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    for container in pod["containers"] + pod.get("initContainers", []):
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, container["name"]
        assert sc["readOnlyRootFilesystem"] is True, container["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, f"{container['name']} adds capabilities"
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
        assert {"cpu", "memory"} <= container["resources"]["limits"].keys()
    daemon = _daemon_container()
    assert daemon["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e for e in daemon["env"]}
    assert env["SMDDP_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    socket_dir = next(v for v in pod["volumes"] if v["name"] == "socket-dir")
    assert socket_dir["hostPath"] == {"path": "/run/smddp", "type": "DirectoryOrCreate"}
    mount = next(m for m in daemon["volumeMounts"] if m["name"] == "socket-dir")
    assert "--socket=" + mount["mountPath"] + "/smddpd.sock" in daemon["args"]


def test_train_job_uses_the_node_daemon() -> None:
    path = KUBE_DIR / "examples" / "train-job.yaml"
    job = _one("Job", path)
    assert job["apiVersion"] == "batch/v1"
    pod = job["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True
    (container,) = pod["containers"]
    command = " ".join(container["command"] + container["args"])
    assert command.startswith("torchrun ")
    assert "train_digits.py" in command
    assert (REPO / "examples" / "train_digits.py").is_file()
    env = {e["name"]: e.get("value") for e in container["env"]}
    volume = next(v for v in pod["volumes"] if "hostPath" in v)
    assert volume["hostPath"]["path"] == "/run/smddp"
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert env["SMDDP_SOCKET"] == mount["mountPath"] + "/smddpd.sock"
    # The ranks join the daemon's group, which owns the socket directory and the socket.
    daemon_gid = _daemon_container()["securityContext"]["runAsGroup"]
    assert daemon_gid in pod["securityContext"]["supplementalGroups"]
    # The example trains with backend "smddp" unless told otherwise.
    assert "SMDDP_EXAMPLE_BACKEND" not in env
    assert 'or "smddp"' in (REPO / "examples" / "train_digits.py").read_text()
