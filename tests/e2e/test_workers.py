"""``--workers N``: N processor processes on one port (SO_REUSEPORT), answering alike."""

from __future__ import annotations

import time

import pytest

from tests.e2e.server import Server, alive
from tests.e2e.util import chat, image_part, ok, tokens
from tests.media import image_bytes

pytestmark = pytest.mark.e2e


def test_two_workers_share_the_port_and_answer_alike(tiny_model):
    server = Server(tiny_model, "--workers", "2")
    try:
        # Every urllib request is a new connection: the kernel spreads them over the workers that
        # listen (the second may still be loading when the first answers).
        workers: set[int] = set()
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline:
            workers.add(server.get("/health")[1]["worker"])
        assert len(workers) == 2, workers
        assert workers <= server.children  # they are the launcher's processor's children
        body = chat("qwen2-vl", [image_part(image_bytes(224, 224, seed=5)), {"type": "text", "text": "Hi?"}])
        first = tokens(ok(server, body))
        answers = [tokens(ok(server, body)) for _ in range(4)]
        assert all(a == first for a in answers)
    finally:
        left = server.stop()
    assert not left and not any(alive(pid) for pid in workers)
