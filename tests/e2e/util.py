"""Small helpers for end-to-end tests: metrics, chat bodies, concurrent posts."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from tests.e2e.server import Server
from tests.media import data_url


def metrics(server: Server) -> dict[str, float]:
    """Every stage's /metrics → {sample name: value summed over labels and replicas}."""
    return server.metrics().by_name()


def image_part(data: bytes, mime: str = "image/png", uuid: str | None = None) -> dict:
    part: dict = {"type": "image_url", "image_url": {"url": data_url(data, mime)}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}


def chat(model: str, content, *, system: str | None = None, max_tokens: int = 12, **extra) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


def ok(server: Server, body: dict) -> dict:
    status, out = server.post("/v1/chat/completions", body)
    assert status == 200, out
    return out


def tokens(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def post_many(server: Server, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: ok(server, b), bodies))


def stream_events(server: Server, body: dict) -> list[dict]:
    """POST ``body`` streamed (the server's model unless it names one); its events, the closing
    ``[DONE]`` checked and left out."""
    data = json.dumps({"model": server.model.name, **body, "stream": True}).encode()
    req = urllib.request.Request(
        server.url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
