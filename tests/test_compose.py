"""compose.yaml: one service per stage, the model in the image, addresses by service name, Swarm keys."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_docker_compose_accepts_the_file():
    exe = shutil.which("docker-compose")
    assert exe, (
        "docker-compose is not installed (scripts/setup installs it as root: apt-get install docker-compose)"
    )
    out = subprocess.run(
        [exe, "-f", str(ROOT / "compose.yaml"), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    services = config["services"]
    assert {"encoder", "llm", "processor"} <= set(services)
    for stage in ("encoder", "llm", "processor"):
        service = services[stage]
        assert service["command"][0] == stage
        assert service["command"][service["command"].index("--model") + 1] == "/model"  # baked in
        assert "volumes" not in service  # no shared volume: every node has the model
        assert service["build"]["args"]["BASE_IMAGE"]
        assert service["healthcheck"]["test"][0] == "CMD"
        assert service["init"] is True  # SIGTERM reaches the stage at once
        # Swarm without IPVS: names resolve to every task (compose ignores the key).
        assert service["deploy"]["endpoint_mode"] == "dnsrr"
    assert services["processor"]["ports"][0]["mode"] == "host"
    proc = services["processor"]["command"]
    assert proc[proc.index("--encoder") + 1] == "tcp://encoder:5556"
    assert proc[proc.index("--llm") + 1] == "tcp://llm:5557"
    assert "tcp://0.0.0.0:5556" in services["encoder"]["command"]
    assert "tcp://0.0.0.0:5557" in services["llm"]["command"]


def test_model_override_mounts_a_checkpoint_over_every_stage():
    out = subprocess.run(
        [shutil.which("docker-compose"), "-f", "compose.yaml", "-f", "compose.model.yaml", "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={"MODEL_DIR": "/models/real", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    for stage in ("encoder", "llm", "processor"):
        assert any(str(v).startswith("/models/real:/model") for v in services[stage]["volumes"])


def test_dockerfile_takes_its_base_image_as_a_build_argument():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE" in text and "FROM ${BASE_IMAGE}" in text
    for package in ("shared", "processor", "encoder_stage", "llm_stage", "benchmarks", "mmcache"):
        assert f"COPY {package} ./{package}" in text
