"""A multi-node Swarm on one machine: each node a docker-in-docker container on a bridge network
the test creates (the recipe and kernel settings this machine needs are in tests/deploy/node)."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid

from tests.deploy.docker import ROOT, sh, wait_for

NODE_IMAGE = "mmcache-swarm-node:test"
# Everything --privileged would give except CAP_SYS_RESOURCE, which this machine's bounding set lacks.
NODE_FLAGS = (
    "--cap-add", "ALL", "--cap-drop", "SYS_RESOURCE",
    "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
    "--security-opt", "systempaths=unconfined", "--device-cgroup-rule", "a *:* rwm",
)  # fmt: skip


class Swarm:
    def __init__(self, size: int, port: int = 8000):
        self.tag = uuid.uuid4().hex[:8]
        self.network = f"mmcache-swarm-{self.tag}"
        self.nodes = [f"mmcache-node{i}-{self.tag}" for i in range(size)]
        self.port = port
        node_dir = str(ROOT / "tests/deploy/node")
        sh("docker", "build", "-q", "-t", NODE_IMAGE, node_dir, env={"DOCKER_BUILDKIT": "0"})
        sh("docker", "network", "create", self.network)
        for node in self.nodes:
            sh(
                "docker", "run", "-d", "--name", node, "--hostname", node, "--network", self.network,
                *NODE_FLAGS, "-v", f"{node}:/var/lib/docker", NODE_IMAGE,
            )  # fmt: skip
        for node in self.nodes:
            wait_for(f"the engine in {node}", lambda n=node: self.run(n, "docker", "info", check=False), 60)
        manager = self.nodes[0]
        self.run(manager, "docker", "swarm", "init", "--advertise-addr", self.ip(manager))
        token = self.run(manager, "docker", "swarm", "join-token", "-q", "worker").strip()
        for node in self.nodes[1:]:
            self.run(node, "docker", "swarm", "join", "--token", token, f"{self.ip(manager)}:2377")
        wait_for("every node Ready", lambda: self.ready() == len(self.nodes), 60)

    def run(self, node: str, *cmd: str, check: bool = True, **kw) -> str:
        return sh("docker", "exec", *kw.pop("exec_args", ()), node, *cmd, check=check, **kw)

    def manage(self, *cmd: str, **kw) -> str:
        return self.run(self.nodes[0], "docker", *cmd, **kw)

    def ip(self, node: str) -> str:
        info = json.loads(sh("docker", "inspect", node))
        return info[0]["NetworkSettings"]["Networks"][self.network]["IPAddress"]

    def ready(self) -> int:
        return self.manage("node", "ls", "--format", "{{.Status}}").split().count("Ready")

    def load(self, image: str) -> None:
        """``docker save | docker load`` into every node (no registry), one node at a time: a load
        unpacks the whole archive to a temporary folder before it stores the layers, so loads at
        once would need an image's size on disk per node twice over."""
        size = int(sh("docker", "image", "inspect", "-f", "{{.Size}}", image).strip())
        root = docker_root()
        for node in self.nodes:
            # NOTE: fail before the load, naming the need, rather than in the middle of it.
            need = f"loading {size / 1e9:.1f} GB into {node} needs twice that free"
            assert shutil.disk_usage(root).free > 2 * size, f"{need}: {disk_free(root)}"
            save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
            try:
                sh("docker", "exec", "-i", node, "docker", "load", "-q", stdin=save.stdout, timeout=900)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{disk_free(root)}") from None
            finally:
                save.stdout.close()
                assert save.wait() == 0

    def deploy(self, stack: str, files: list[str], env: dict[str, str]) -> None:
        """``docker stack deploy`` of compose ``files`` (each overriding the ones before)."""
        args = []
        for i, file in enumerate(files):
            sh("docker", "cp", file, f"{self.nodes[0]}:/compose{i}.yaml")
            args += ["-c", f"/compose{i}.yaml"]
        flags = [x for k, v in env.items() for x in ("-e", f"{k}={v}")]
        self.run(self.nodes[0], "docker", "stack", "deploy", *args, stack, exec_args=flags)

    def tasks(self, service: str) -> list[tuple[str, str]]:
        """(node, current state) of each task of ``service`` meant to run."""
        out = self.manage("service", "ps", service, "--filter", "desired-state=running",
                          "--format", "{{.Node}} {{.CurrentState}}")  # fmt: skip
        return [(line.split()[0], line.split(" ", 1)[1]) for line in out.splitlines() if line.strip()]

    def containers(self, node: str, service: str) -> list[str]:
        """Short ids (a task container's host name) of ``service``'s containers running on ``node``."""
        label = f"label=com.docker.swarm.service.name={service}"
        return self.run(node, "docker", "ps", "-q", "--filter", label).split()

    def status(self, node: str) -> str:
        """The manager's view of ``node``: Ready, Down, ..."""
        return self.manage("node", "inspect", "-f", "{{.Status.State}}", node).strip()

    def cut(self, node: str) -> None:
        """Take ``node`` off the network: its peers' connections hang (no RST), as when a cable
        or a switch port goes."""
        sh("docker", "network", "disconnect", self.network, node)

    def close(self) -> None:
        for node in self.nodes:
            sh("docker", "rm", "-f", "-v", node, check=False)
            sh("docker", "volume", "rm", "-f", node, check=False)
        sh("docker", "network", "rm", self.network, check=False)


def docker_root() -> str:
    """Where the engine keeps its data (the nodes' volumes and layers live there)."""
    return sh("docker", "info", "-f", "{{.DockerRootDir}}").strip()


def disk_free(root: str | None = None) -> str:
    """The free space under ``root`` (the engine's data folder unless given), in words."""
    root = root or docker_root()
    return f"{shutil.disk_usage(root).free / 1e9:.1f} GB free under {root}"
