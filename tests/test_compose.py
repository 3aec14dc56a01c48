"""compose.yaml: one service per stage, the model as a shared volume, addresses by service name."""

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
        assert services[stage]["command"][0] == stage
        assert any(str(v).endswith(":/model:ro") for v in services[stage]["volumes"])
        assert services[stage]["build"]["args"]["BASE_IMAGE"]
    proc = services["processor"]["command"]
    assert proc[proc.index("--encoder") + 1] == "tcp://encoder:5556"
    assert proc[proc.index("--llm") + 1] == "tcp://llm:5557"
    assert "tcp://0.0.0.0:5556" in services["encoder"]["command"]
    assert "tcp://0.0.0.0:5557" in services["llm"]["command"]


def test_dockerfile_takes_its_base_image_as_a_build_argument():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE" in text and "FROM ${BASE_IMAGE}" in text
    for package in ("shared", "processor", "encoder_stage", "llm_stage", "mmcache"):
        assert f"COPY {package} ./{package}" in text
