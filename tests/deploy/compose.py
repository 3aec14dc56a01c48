"""A project of the repo's compose.yaml on the test engine: its own name and published port, and
nothing of it left afterwards (no container, network or volume)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from tests.deploy.docker import free_port, sh


@dataclass
class Project:
    image: str
    name: str = field(default_factory=lambda: f"mmcache-test-{uuid.uuid4().hex[:8]}")
    port: int = field(default_factory=free_port)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def label(self) -> str:
        return f"label=com.docker.compose.project={self.name}"

    def compose(self, *args: str, **kw) -> str:
        env = {"MMCACHE_IMAGE": self.image, "PORT": str(self.port), "MMCACHE_TORCH_THREADS": "1"}
        return sh("docker", "compose", "-p", self.name, "-f", "compose.yaml", *args, env=env, **kw)

    def containers(self, service: str | None = None) -> list[str]:
        """Ids of this project's containers (of one service), running or not."""
        filters = ["--filter", self.label]
        if service is not None:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return sh("docker", "ps", "-aq", *filters).split()

    def ip(self, container: str) -> str:
        """The container's address on the project's network (what the processor reaches)."""
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
        return sh("docker", "inspect", "-f", fmt, container).split()[0]


@contextmanager
def project(image: str) -> Iterator[Project]:
    """A project to ``up``; ``down -v`` after, and on success, proof that nothing is left."""
    p = Project(image)
    try:
        yield p
    finally:
        p.compose("down", "-v", "--remove-orphans", "-t", "5", check=False)
    assert p.containers() == []
    assert sh("docker", "network", "ls", "-q", "--filter", p.label).strip() == ""
    assert sh("docker", "volume", "ls", "-q", "--filter", p.label).strip() == ""
