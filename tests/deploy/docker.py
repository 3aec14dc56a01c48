"""Helpers for the deployment tests: the engine, the image, HTTP to the stack, its metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.e2e.util import image_part, video_part
from tests.media import image_bytes, video_bytes

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "mmcache:deploy-test"
BASE_IMAGE = "mmcache-base:bookworm"  # built by scripts/docker-engine (debootstrap)
STARTUP = 300  # seconds for a stack to answer (containers loading torch on two cores)


def sh(*cmd: str, timeout: float = 600, check: bool = True, env: dict | None = None, **kw) -> str:
    """Run a command; its stdout. A failure shows the command's stderr."""
    full_env = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stdout


def build_image() -> None:
    """The repo's Dockerfile on the debootstrap base (the classic builder: no buildx needed)."""
    sh(
        "docker", "build", "-q", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", IMAGE, ".",
        env={"DOCKER_BUILDKIT": "0"}, timeout=1800,
    )  # fmt: skip


def image_size() -> int:
    return int(sh("docker", "image", "inspect", "-f", "{{.Size}}", IMAGE).strip())


def get(url: str, timeout: float = 30) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as err:
        body, status = err.read().decode(), err.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def post(url: str, body: dict, timeout: float = 180) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_for(what: str, cond, timeout: float, every: float = 1.0):
    """Poll ``cond()`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = cond()
            if last:
                return last
        except (OSError, ValueError) as exc:  # not listening yet, half-written reply
            last = exc
        time.sleep(every)
    raise AssertionError(f"{what}: not in {timeout:.0f} s (last: {last!r})")


def replica_metrics(base: str) -> dict[str, dict[str, float]]:
    """{"encoder_chunks_encoded": {address: value}, ...}: each live replica's counters as the
    processor's ``/health`` lists them (the replicas' own metrics ports are not published)."""
    _, body = get(base + "/health")
    out: dict[str, dict[str, float]] = {}
    for replica in body["stages"]:
        for name, value in (replica["counters"] or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(f"{replica['stage']}_{name}", {})[replica["address"]] = float(value)
    return out


def until_each_replica_works(base: str, model: str, seeds: range) -> int:
    """Send one distinct image at a time (at most ``len(seeds)``) until every encoder has encoded
    a chunk and every LLM replica has run a step; returns how many it sent.

    NOTE: which replica a request lands on is rendezvous hashing over replica ids that change
    from run to run (container names): a fixed handful of requests leaves one replica idle now
    and then (8 chunks on 2 encoders: 1 run in 128). Sending until each has worked creates the
    state the callers check; a replica that never gets work in 32 tries is a real fault."""
    sent = 0
    for seed in seeds:
        m = replica_metrics(base)
        worked = [v > 0 for key in ("encoder_chunks_encoded", "llm_steps") for v in m.get(key, {}).values()]
        if worked and all(worked):
            break
        answers(base, bodies(model, range(seed, seed + 1)))
        sent += 1
    return sent


def up_replicas(base: str, stage: str) -> set[str]:
    """Addresses of the ``stage`` replicas the processor reaches."""
    _, body = get(base + "/health")
    return {r["address"] for r in body["stages"] if r["stage"] == stage and r["ok"]}


def chat(model: str, content: list[dict], system: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }


def bodies(model: str, seeds: range, video: bool = False) -> list[dict]:
    """One distinct small image per seed (each its own system prompt), and maybe a video."""
    out = [
        chat(model, [image_part(image_bytes(112, 112, seed=s)), {"type": "text", "text": "What?"}], f"S{s}")
        for s in seeds
    ]
    if video:
        clip = video_bytes(4, 112, 112, seed=9)
        out.append(chat(model, [video_part(clip), {"type": "text", "text": "And this?"}], "video"))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(base: str) -> bool:
    status, _ = get(base + "/health", timeout=10)
    return status == 200


def answers(base: str, bodies: list[dict]) -> list[list[int]]:
    return [post(base + "/v1/chat/completions", b)["choices"][0]["token_ids"] for b in bodies]
