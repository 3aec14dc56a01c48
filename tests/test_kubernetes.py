"""deploy/kubernetes/: valid against the Kubernetes API schemas (kubernetes-validate, strict), and
wired the way discovery needs: headless Services for the encoder and LLM tiers, the processor
pointed at their names, probes and resources on every container. (No cluster runs here.)"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

DIR = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"


def documents() -> list[dict]:
    kustomization = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((DIR / name).read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any error


def test_every_manifest_file_is_listed():
    listed = set(yaml.safe_load((DIR / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in DIR.glob("*.yaml")} - {"kustomization.yaml"}


def test_tiers_are_wired_for_discovery():
    services, deployments = by_kind("Service"), by_kind("Deployment")
    assert services["mmcache-encoder"]["spec"]["clusterIP"] == "None"  # headless: every pod's IP
    assert services["mmcache-llm"]["spec"]["clusterIP"] == "None"
    assert services["mmcache"]["spec"].get("clusterIP") != "None"  # the processor: one address
    args = deployments["mmcache-processor"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--encoder") + 1] == "tcp://mmcache-encoder:5556"
    assert args[args.index("--llm") + 1] == "tcp://mmcache-llm:5557"
    for name, service in services.items():
        selector = service["spec"]["selector"]
        matching = [
            d
            for d in deployments.values()
            if d["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
        ]
        assert len(matching) == 1, name
    for deployment in deployments.values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert container["readinessProbe"] and container["livenessProbe"]
            assert container["resources"]["requests"] and container["resources"]["limits"]
            if container["args"][0] in ("encoder", "llm"):
                env = {e["name"]: e for e in container["env"]}
                # the pod's own name is its replica id: the same owner in every client
                assert env["MMCACHE_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
