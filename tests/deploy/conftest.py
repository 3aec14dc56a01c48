"""The Docker Engine for the deployment tests: set up by scripts/docker-engine, or the tests fail
(they never skip); stopped again, with nothing left, when the session ends."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.deploy.docker import ROOT, build_image, image_size


@pytest.fixture(scope="session")
def engine():
    out = subprocess.run(
        [str(ROOT / "scripts" / "docker-engine"), "start"], capture_output=True, text=True, timeout=1200
    )
    if out.returncode != 0:
        pytest.fail(f"cannot set up the Docker Engine:\n{out.stderr[-3000:]}", pytrace=False)
    yield
    subprocess.run([str(ROOT / "scripts" / "docker-engine"), "stop"], timeout=300, check=True)


@pytest.fixture(scope="session")
def image(engine) -> str:
    started = time.monotonic()
    build_image()
    print(f"\nimage built in {time.monotonic() - started:.0f} s, {image_size() / 1e9:.2f} GB")
    from tests.deploy.docker import IMAGE

    return IMAGE
