"""Process lifecycle of ``mmcache serve``: clean stops, dying with the launcher, concurrent streams."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests import media
from tests.e2e.server import Server, descendants
from tests.e2e.server import alive as is_alive

pytestmark = pytest.mark.e2e

GRACE_SECONDS = 10.0  # the launcher's SIGTERM → SIGKILL grace period for its children


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def run_dir(server: Server) -> Path:
    """The launcher's ipc socket directory, read from its children's command lines."""
    dirs = {
        Path(arg.removeprefix("ipc://")).parent
        for pid in server.children
        for arg in cmdline(pid)
        if arg.startswith("ipc://")
    }
    assert len(dirs) == 1, dirs
    (path,) = dirs
    assert path.name.startswith("mmcache-") and path.is_dir()
    return path


def stage_pids(server: Server) -> dict[str, int]:
    """Stage name → pid of the launcher's direct children (``python -m mmcache <stage> ...``)."""
    out = {}
    for pid in server.children:
        args = cmdline(pid)
        if "mmcache" in args and args.index("mmcache") + 1 < len(args):
            out[args[args.index("mmcache") + 1]] = pid
    return out


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def chat_body(server: Server, content, max_tokens: int, **extra) -> dict:
    return {
        "model": server.model.name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def stream(server: Server, body: dict, events: list | None = None) -> tuple[str, list[dict]]:
    """POST a streaming request; the concatenated content and every SSE payload."""
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(
        server.url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    payloads: list[dict] = []
    done = False
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                break
            payloads.append(json.loads(line.removeprefix("data: ")))
            if events is not None:
                events.append(time.monotonic())
    assert done, "the stream did not end with data: [DONE]"
    assert not any("error" in p for p in payloads), payloads
    text = "".join(c["delta"].get("content") or "" for p in payloads for c in p["choices"])
    return text, payloads


def _stop(server: Server, signum: int) -> tuple[int, float]:
    """Signal the launcher; its exit code and how long it took to exit."""
    start = time.monotonic()
    server.proc.send_signal(signum)
    code = server.proc.wait(timeout=GRACE_SECONDS + 20)
    return code, time.monotonic() - start


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_stop_leaves_nothing_behind(tiny_model, signame: str) -> None:
    server = Server(tiny_model)
    try:
        assert set(stage_pids(server)) == {"encoder", "llm", "processor"}
        rundir = run_dir(server)
        assert {p.name for p in rundir.iterdir()} >= {"encoder.sock", "llm.sock"}
        code, elapsed = _stop(server, getattr(signal, signame))
    finally:
        alive = server.stop()
    assert alive == set()
    assert code == 0
    # The stages stopped on their own SIGTERM, well within the grace period (no SIGKILL needed).
    assert elapsed < GRACE_SECONDS - 2, f"stopping took {elapsed:.1f}s"
    assert not rundir.exists(), f"{rundir} was left behind"
    assert port_is_free(server.port)


def test_stop_with_a_stream_in_flight(tiny_model) -> None:
    """SIGTERM while a long stream is running: nothing is left behind, and the stop is prompt."""
    server = Server(tiny_model)
    try:
        rundir = run_dir(server)
        body = chat_body(server, "Tell me a long story.", 1000, ignore_eos=True)
        events: list[float] = []
        thread = threading.Thread(target=_swallow, args=(stream, server, body, events), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert events, "the stream never started"
        code, elapsed = _stop(server, signal.SIGTERM)
        thread.join(timeout=5)
    finally:
        alive = server.stop()
    assert alive == set()
    assert not rundir.exists(), f"{rundir} was left behind"
    assert not thread.is_alive(), "the client's stream never ended"
    assert code == 0
    # No stage may need the launcher's SIGKILL (sent after GRACE_SECONDS): an in-flight
    # request must not hold the processor's shutdown hostage.
    assert elapsed < GRACE_SECONDS - 1, f"stopping took {elapsed:.1f}s: a stage had to be SIGKILLed"


def _swallow(fn, *args) -> None:
    with contextlib.suppress(Exception):  # the server goes away mid-stream: that is the point
        fn(*args)


def test_children_die_with_a_killed_launcher(tiny_model) -> None:
    server = Server(tiny_model)
    try:
        children = set(stage_pids(server).values())
        assert len(children) == 3
        rundir = run_dir(server)
        server.proc.kill()  # SIGKILL: the launcher cannot clean up; PR_SET_PDEATHSIG must
        server.proc.wait()
        deadline = time.monotonic() + 10
        alive = {pid for pid in server.children if is_alive(pid)}
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = {pid for pid in alive if is_alive(pid)}
        assert alive == set(), {pid: cmdline(pid) for pid in alive}
        assert port_is_free(server.port)
    finally:
        assert server.stop() == set()
        shutil.rmtree(rundir, ignore_errors=True)


def test_concurrent_streams_equal_sequential_answers(server: Server) -> None:
    png = media.image_bytes(448, 448, seed=11)
    jpeg = media.image_bytes(300, 200, seed=12, fmt="JPEG")
    clip = media.video_bytes(8, 224, 224, fps=2, seed=13)
    contents = [
        "Write a poem about autumn leaves.",
        [
            {"type": "image_url", "image_url": {"url": media.data_url(png, "image/png")}},
            {"type": "text", "text": "Describe it."},
        ],
        [
            {"type": "text", "text": "Caption:"},
            {"type": "image_url", "image_url": {"url": media.data_url(jpeg, "image/jpeg")}},
        ],
        [
            {"type": "video_url", "video_url": {"url": media.data_url(clip, "video/mp4")}},
            {"type": "text", "text": "Summarise the clip."},
        ],
    ]
    bodies = [chat_body(server, c, 48, ignore_eos=True) for c in contents]
    sequential = []
    for body in bodies:
        status, reply = server.post("/v1/chat/completions", body)
        assert status == 200, reply
        sequential.append(reply)
    assert len({r["choices"][0]["message"]["content"] for r in sequential}) == 4

    results: list = [None] * 4
    events: list[list[float]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stream(server, bodies[i], events[i])
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for i, result in enumerate(results):
        assert not isinstance(result, BaseException) and result is not None, result
        text, payloads = result
        assert text == sequential[i]["choices"][0]["message"]["content"], i
        usage = payloads[-1]["usage"]
        assert usage["completion_tokens"] == sequential[i]["usage"]["completion_tokens"] == 48
        assert usage["prompt_tokens"] == sequential[i]["usage"]["prompt_tokens"]
    # The four streams really overlapped: each one was still running when another had started.
    starts = [e[0] for e in events]
    ends = [e[-1] for e in events]
    assert max(starts) < min(ends)
    assert descendants(server.proc.pid) >= server.children  # nothing crashed along the way
