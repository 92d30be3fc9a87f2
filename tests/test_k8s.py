"""deploy/k8s: every manifest valid against Kubernetes' own schemas (kubernetes-validate, strict), and wired as the
docs/scale-out.md says: probes on the engine's health, a GPU per replica, metrics scraped, the router finding the OpenAI
replicas through a Role that lets it list them. Nothing here starts a cluster."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
VERSION = "1.33.0"


def documents() -> list[dict]:
    return [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def by(kind: str, name: str) -> dict:
    return next(d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_every_manifest_is_valid_kubernetes():
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Namespace", "Deployment", "Service", "ServiceAccount", "Role",
                                         "RoleBinding", "PersistentVolumeClaim"}
    for d in docs:
        kubernetes_validate.validate(d, VERSION, strict=True)      # raises, naming the field


def test_replicas_have_health_probes_a_gpu_and_scraped_metrics():
    for name, health, metrics_port in (("pagoda-openai", "/health", "8000"), ("pagoda-triton", "/v2/health/ready",
                                                                               "8002")):
        pod = by("Deployment", name)["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        assert c["readinessProbe"]["httpGet"]["path"] == health and c["startupProbe"] and c["livenessProbe"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1" == c["resources"]["limits"]["nvidia.com/gpu"]
        notes = pod["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == metrics_port
        assert any(v["persistentVolumeClaim"]["claimName"] == "pagoda-models" for v in pod["spec"]["volumes"])
    openai = by("Deployment", "pagoda-openai")["spec"]["template"]["spec"]["containers"][0]
    assert openai["command"][:3] == ["python3", "-m", "engine"] and "--kv-events" in openai["args"]
    env = {e["name"]: e["value"] for e in by("Deployment", "pagoda-triton")["spec"]["template"]["spec"]
           ["containers"][0]["env"]}
    assert env["PAGODA_KV_EVENTS"] == "true"                      # config.pbtxt parameters, overridden by env


def test_the_router_discovers_the_openai_replicas():
    router = by("Deployment", "pagoda-router")["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    selector = args[args.index("--selector") + 1]
    key, value = selector.split("=")
    labels = by("Deployment", "pagoda-openai")["spec"]["template"]["metadata"]["labels"]
    assert labels[key] == value
    assert args[args.index("--service-discovery-port") + 1] == "8000"
    assert router["serviceAccountName"] == "pagoda-router"
    rule = by("Role", "pagoda-router")["rules"][0]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    assert by("RoleBinding", "pagoda-router")["subjects"][0]["name"] == "pagoda-router"
