"""deploy/kubernetes: every manifest validates offline against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields are errors), the Kustomize base lists them all (and renders
with `kubectl kustomize` where kubectl is installed), and the pieces agree with each other and with the
code: the config file the pod mounts loads with betelgeuse.settings and puts the sockets in the shared
emptyDir and the model on the read-only volume; probes and Service ports are the ports the config
listens on; the containers run the CLI's store/worker entry points; the router hashes on the session
header docs/scaling.md names, over the headless Service; the ServiceMonitor selects that Service and
keeps the job names the dashboard and the rules use."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.34.0", "1.37.0")    # pod-level resources (spec.resources) need 1.34+
SESSION_HEADER = "x-session-id"

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")


def docs() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def find(kind: str, name: str) -> dict:
    return next(d for _, d in docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def pod() -> dict:
    return find("StatefulSet", "betelgeuse")["spec"]["template"]


def container(name: str) -> dict:
    return next(c for c in pod()["spec"]["containers"] if c["name"] == name)


def settings():
    from betelgeuse.settings import load_settings
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "betelgeuse.toml"
        p.write_text(find("ConfigMap", "betelgeuse-config")["data"]["betelgeuse.toml"])
        return load_settings(p)


def mounts(c: dict) -> dict[str, dict]:
    return {m["name"]: m for m in c["volumeMounts"]}


def port_of(hostport: str) -> int:
    return int(hostport.rsplit(":", 1)[1])


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_strictly(version):
    checked = 0
    for fname, d in docs():
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked by hand in test_service_monitor
        kv.validate(d, version, strict=True)
        checked += 1
    assert checked >= 7


def test_validation_can_fail():
    sts = copy.deepcopy(find("StatefulSet", "betelgeuse"))
    sts["spec"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, VERSIONS[-1], strict=True)
    sts = copy.deepcopy(find("StatefulSet", "betelgeuse"))
    sts["spec"]["template"]["spec"]["resources"]["limits"]["memory"] = ["12Gi"]
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files and len(k["resources"]) == len(files)
    if shutil.which("kubectl"):
        r = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        rendered = [d for d in yaml.safe_load_all(r.stdout) if d]
        assert len(rendered) == len(docs())
        for d in rendered:
            if not d["apiVersion"].startswith("monitoring.coreos.com/"):
                kv.validate(d, VERSIONS[-1], strict=True)
            if d["kind"] != "Namespace":
                assert d["metadata"]["namespace"] == k["namespace"]


def test_pod_shape():
    spec = pod()["spec"]
    names = [c["name"] for c in spec["containers"]]
    assert sorted(names) == ["store", "worker"]
    assert spec["resources"]["limits"]["memory"] == "12Gi"      # the pod: both processes together
    worker, store = container("worker"), container("store")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in store.get("resources", {}).get("limits", {})
    for c in (worker, store):
        assert "memory" not in c["resources"].get("limits", {}), "the pod's limit binds their sum"
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["runAsUser"] == 10001        # the image's USER
    vols = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in vols["run"]
    claims = {t["metadata"]["name"]: t for t in find("StatefulSet", "betelgeuse")["spec"]["volumeClaimTemplates"]}
    assert "model" in claims and "model" not in vols
    assert spec["terminationGracePeriodSeconds"] >= 60


def test_config_agrees_with_the_pod():
    s = settings()
    worker, store = container("worker"), container("store")
    for c in (worker, store):
        m = mounts(c)
        run = Path(m["run"]["mountPath"])
        assert Path(s.store.socket).parent == run and Path(s.store.fd_socket).parent == run
        assert m["model"]["readOnly"] is True
        assert Path(s.model.path).parent == Path(m["model"]["mountPath"])
        assert m["config"]["readOnly"] is True
        cfg_arg = c["args"][c["args"].index("--config") + 1]
        assert Path(cfg_arg).parent == Path(m["config"]["mountPath"]) and Path(cfg_arg).name == "betelgeuse.toml"
    from services.cli import PROCESS_MAINS
    assert worker["args"][0] == "worker" and store["args"][0] == "store"
    assert set(PROCESS_MAINS) == {"worker", "store"}
    ports = {p["name"]: p["containerPort"] for c in (worker, store) for p in c["ports"]}
    tcp = [a for a in s.worker.listen if not a.startswith("unix:")]
    assert [port_of(a) for a in tcp] == [ports["grpc"]] and tcp[0].startswith("0.0.0.0:")
    assert port_of(s.worker.metrics) == ports["worker-metrics"] and s.worker.metrics.startswith("0.0.0.0:")
    assert port_of(s.store.metrics) == ports["store-metrics"]
    assert port_of(s.worker.http) == ports["http"] and s.worker.http.startswith("0.0.0.0:")    # routed by Envoy
    # probes: gRPC health on the gRPC port, HTTP on the metrics ports
    assert worker["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    assert worker["startupProbe"]["grpc"]["port"] == ports["grpc"]
    assert worker["livenessProbe"]["httpGet"]["port"] == "worker-metrics"
    assert store["livenessProbe"]["httpGet"]["port"] == "store-metrics"
    assert s.worker.device == "cuda"


def test_headless_service_and_router():
    svc = find("Service", "betelgeuse")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod()["metadata"]["labels"].items()
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    names = {p["name"] for c in pod()["spec"]["containers"] for p in c["ports"]}
    assert all(p["targetPort"] in names for p in svc_ports.values())
    envoy = yaml.safe_load(find("ConfigMap", "betelgeuse-router")["data"]["envoy.yaml"])
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    listeners = {l["name"]: l for l in envoy["static_resources"]["listeners"]}
    router_ports = {p["name"]: p["port"] for p in find("Service", "betelgeuse-router")["spec"]["ports"]}
    dep = find("Deployment", "betelgeuse-router")
    envoy_c = dep["spec"]["template"]["spec"]["containers"][0]
    envoy_ports = {p["name"]: p["containerPort"] for p in envoy_c["ports"]}
    # gRPC (HTTP/2 upstream, grpc.health.v1) and, issue 25 item 9, the HTTP API (HTTP/1.1, GET /health): each a
    # listener on its Service port, a route to its cluster hashed on the session header, upstream = the pods' port
    for name, cname, upstream in (("grpc", "betelgeuse", "grpc"), ("http", "betelgeuse-http", "http")):
        cluster, listener = clusters[cname], listeners[name]
        assert cluster["type"] == "STRICT_DNS" and cluster["lb_policy"] in ("RING_HASH", "MAGLEV")
        sock = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        assert sock["address"] == svc["metadata"]["name"] and sock["port_value"] == svc_ports[upstream]["port"]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
        assert route["route"]["cluster"] == cname
        assert route["route"]["hash_policy"] == [{"header": {"header_name": SESSION_HEADER}}]
        assert route["route"]["timeout"] == "0s"                  # streams are not cut
        assert listener["address"]["socket_address"]["port_value"] == router_ports[name] == envoy_ports[name]
    assert "http2_protocol_options" in str(clusters["betelgeuse"]["typed_extension_protocol_options"])   # gRPC
    assert "grpc_health_check" in clusters["betelgeuse"]["health_checks"][0]
    assert clusters["betelgeuse-http"]["health_checks"][0]["http_health_check"]["path"] == "/health"
    assert "typed_extension_protocol_options" not in clusters["betelgeuse-http"]             # HTTP/1.1 to uvicorn
    # item 9: the admin port is not on 0.0.0.0 (nor exposed); readiness comes from a listener of its own
    assert envoy["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert envoy["admin"]["address"]["socket_address"]["port_value"] not in envoy_ports.values()
    assert envoy_c["readinessProbe"]["httpGet"]["port"] == "ready"
    ready = listeners["ready"]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
    assert ready["name"] == "envoy.filters.http.health_check"
    assert envoy_ports["ready"] == listeners["ready"]["address"]["socket_address"]["port_value"]
    mount = envoy_c["volumeMounts"][0]["mountPath"]
    args = envoy_c["args"]
    assert args[args.index("--config-path") + 1] == f"{mount}/envoy.yaml"
    assert SESSION_HEADER in (ROOT / "docs" / "scaling.md").read_text()


def test_service_monitor():
    sm = find("ServiceMonitor", "betelgeuse")
    svc = find("Service", "betelgeuse")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in prom["scrape_configs"]}
    got = set()
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in svc_ports
        relabel = {r["targetLabel"]: r for r in ep["relabelings"]}
        got.add(relabel["job"]["replacement"])
        src = relabel["model"]["sourceLabels"][0]
        label = next(k for k in pod()["metadata"]["labels"] if k.endswith("/model"))
        assert src == "__meta_kubernetes_pod_label_" + "".join(ch if ch.isalnum() else "_" for ch in label)
    assert got == jobs


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
