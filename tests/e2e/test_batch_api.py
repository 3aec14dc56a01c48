"""Batch jobs end to end: 200 image lines (20 images, each used ten times) through a processor
with ``--batch-dir``, every answer the same as the same request sent live; an interactive
request's time to first token while the batch runs stays within 1.5x of an idle server's; a
processor killed midway keeps its finished lines and, started again, completes the job. And
``mmcache batch FILE.jsonl`` with its progress bar."""

from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mmcache.harness import StageProcess
from tests import media
from tests.e2e.server import free_port, wait_healthy
from tests.e2e.util import chat, image_part, ok
from tests.openai_schema import validate

pytestmark = pytest.mark.e2e

LINES = 200
IMAGES = 20
TTFT_TRIES = 5


class Processor(StageProcess):
    """``mmcache processor`` with a batch directory, on the stages of a running ``serve``."""

    def __init__(self, stages, model: Path, batch_dir: Path, concurrency: int):
        encoder, llm = stages
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["processor", "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--encoder", encoder, "--llm", llm, "--batch-dir", str(batch_dir)]
        args += ["--batch-concurrency", str(concurrency)]
        super().__init__(args, {"OMP_NUM_THREADS": "1"})
        wait_healthy(self.url, [self.proc])

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body, headers or {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        status, raw = self.call(method, path, None if body is None else json.dumps(body).encode())
        assert status == 200, raw
        return json.loads(raw)


@pytest.fixture(scope="module")
def stages(server):
    """The addresses of the ``serve``'s encoder and LLM stages (its processor answers live)."""
    health = server.get("/health")[1]
    by_kind = {s["stage"]: s["address"] for s in health["stages"]}
    return by_kind["encoder"], by_kind["llm"]


def lines(model: str, salt: str) -> list[dict]:
    images = [media.image_bytes(96 + 16 * (i % 3), 96, seed=100 + i) for i in range(IMAGES)]
    out = []
    for i in range(LINES):
        content = [image_part(images[i % IMAGES]), {"type": "text", "text": f"Caption {i % 7}."}]
        body = chat(model, content, max_tokens=4, cache_salt=salt)
        out.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return out


def upload(proc: Processor, rows: list[dict]) -> dict:
    boundary = uuid.uuid4().hex
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    status, raw = proc.call(
        "POST", "/v1/files", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    assert status == 200, raw
    out = json.loads(raw)
    validate(out, "OpenAIFile")
    return out


def start(proc: Processor, rows: list[dict], endpoint: str = "/v1/chat/completions") -> dict:
    file = upload(proc, rows)
    batch = proc.json("POST", "/v1/batches", {"input_file_id": file["id"], "endpoint": endpoint})
    validate(batch, "Batch")
    return batch


def wait(proc: Processor, batch_id: str, until, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = proc.json("GET", f"/v1/batches/{batch_id}")
        if until(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} is still {batch}")


def finished(batch: dict) -> bool:
    return batch["status"] in ("completed", "failed", "cancelled")


def output(proc: Processor, file_id: str) -> dict[str, dict]:
    status, raw = proc.call("GET", f"/v1/files/{file_id}/content")
    assert status == 200
    rows = [json.loads(line) for line in raw.splitlines()]
    return {r["custom_id"]: r for r in rows}


def ttft(url_port: int, model: str, i: int) -> float:
    """Seconds to the first streamed token of a fresh (uncached) request with an image of its own."""
    image = media.image_bytes(224, 224, seed=1000 + i)
    content = [image_part(image), {"type": "text", "text": f"Interactive question {i}: what is here?"}]
    body = chat(model, content, max_tokens=2, stream=True)
    body["cache_salt"] = uuid.uuid4().hex
    conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=120)
    try:
        began = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        for raw in resp:
            if raw.startswith(b"data: {"):
                return time.perf_counter() - began  # the role chunk leaves with the first token
        raise AssertionError("no event")
    finally:
        conn.close()


def test_two_hundred_image_lines_answer_as_live_while_interactive_ttft_holds(
    tiny_model, server, stages, tmp_path
) -> None:
    rows = lines(server.model.name, "batch-" + uuid.uuid4().hex)
    # NOTE: one line at a time; a line running when an interactive request arrives is preempted.
    with Processor(stages, tiny_model, tmp_path / "state", concurrency=1) as proc:
        ttft(proc.port, server.model.name, -1)  # warm-up
        idle = [ttft(proc.port, server.model.name, i) for i in range(TTFT_TRIES)]
        batch = start(proc, rows)
        wait(proc, batch["id"], lambda b: b["request_counts"]["completed"] >= 10)
        busy = [ttft(proc.port, server.model.name, 100 + i) for i in range(TTFT_TRIES)]
        running = proc.json("GET", f"/v1/batches/{batch['id']}")
        done = wait(proc, batch["id"], finished)
        answers = output(proc, done["output_file_id"])
    print(f"TTFT idle {sorted(idle)} busy {sorted(busy)}")
    assert running["status"] == "in_progress"  # the batch was still running while measured
    assert statistics.median(busy) <= 1.5 * statistics.median(idle)
    validate(done, "Batch")
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert "error_file_id" not in done
    with ThreadPoolExecutor(4) as pool:
        live = list(pool.map(lambda r: ok(server, r["body"]), rows))
    for row, want in zip(rows, live, strict=True):
        got = answers[row["custom_id"]]["response"]
        assert got["status_code"] == 200
        assert got["body"]["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert got["body"]["choices"][0]["message"] == want["choices"][0]["message"]
    hits = sum(a["response"]["body"]["usage"]["mm_cache"]["processor_hits"] for a in answers.values())
    assert hits >= LINES - IMAGES - 2 * 2  # repeated images came from the cache (bar concurrent firsts)


def test_a_processor_killed_midway_keeps_finished_lines_and_completes(
    tiny_model, server, stages, tmp_path
) -> None:
    rows = lines(server.model.name, "restart-" + uuid.uuid4().hex)
    rows[5]["body"]["max_tokens"] = -1  # one bad line: it goes to the error file
    state = tmp_path / "state"
    with Processor(stages, tiny_model, state, concurrency=1) as proc:
        batch = start(proc, rows)
        wait(proc, batch["id"], lambda b: b["request_counts"]["completed"] >= 30)
        proc.proc.kill()  # no goodbye: SIGKILL
        proc.proc.wait()
    done_file = state / "batches" / f"{batch['id']}.done.jsonl"
    before = {
        json.loads(line)["out"]["custom_id"]: json.loads(line)["out"]["id"] for line in done_file.open()
    }
    assert 30 <= len(before) < LINES
    with Processor(stages, tiny_model, state, concurrency=2) as proc:
        done = wait(proc, batch["id"], finished)
        answers = output(proc, done["output_file_id"])
        errors = output(proc, done["error_file_id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": LINES, "completed": LINES - 1, "failed": 1}
    assert set(answers) | set(errors) == {r["custom_id"] for r in rows}
    assert errors["line-5"]["response"]["status_code"] == 400
    assert errors["line-5"]["response"]["body"]["error"]["param"] == "max_tokens"
    # A line finished before the kill was kept, not run again: its request id is the one it had.
    for custom_id, request_id in before.items():
        assert {**answers, **errors}[custom_id]["id"] == request_id


def test_the_cli_runs_a_file_with_a_progress_bar(tiny_model, server, stages, tmp_path) -> None:
    rows = lines(server.model.name, "cli")[:12]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with Processor(stages, tiny_model, tmp_path / "state", concurrency=4) as proc:
        run = subprocess.run(
            [sys.executable, "-m", "mmcache", "batch", str(path), "--url", proc.url, "--poll", "0.1"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        assert "12/12" in run.stderr  # tqdm's bar
        out = [json.loads(line) for line in (tmp_path / "in.output.jsonl").read_text().splitlines()]
        assert [o["custom_id"] for o in out] == [r["custom_id"] for r in rows]
        # Completions and Responses lines answer as the same requests sent live.
        for endpoint, extra in (
            ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}),
            ("/v1/responses", {"input": "Once upon a time", "max_output_tokens": 5, "temperature": 0}),
        ):
            body = {"model": server.model.name, **extra}
            job = start(proc, [{"custom_id": "x", "method": "POST", "url": endpoint, "body": body}], endpoint)
            job = wait(proc, job["id"], finished)
            got = output(proc, job["output_file_id"])["x"]["response"]["body"]
            status, want = server.post(endpoint, body)
            assert status == 200
            if endpoint == "/v1/completions":
                assert got["choices"][0]["text"] == want["choices"][0]["text"]
            else:
                validate(got, "Response")
                assert got["output"][0]["content"][0]["text"] == want["output"][0]["content"][0]["text"]
        # Cancelling a finished job changes nothing; unknown ids are 404s; bad files are 400s.
        listed = proc.json("GET", "/v1/batches")["data"]
        batch_id = next(b["id"] for b in listed if b["endpoint"] == "/v1/chat/completions")
        assert proc.json("POST", f"/v1/batches/{batch_id}/cancel")["status"] == "completed"
        assert proc.call("GET", "/v1/batches/batch_" + "0" * 32)[0] == 404
        assert proc.call("GET", "/v1/files/file-" + "0" * 32 + "/content")[0] == 404
        dup = upload(proc, [rows[0], rows[0]])
        status, raw = proc.call(
            "POST",
            "/v1/batches",
            json.dumps({"input_file_id": dup["id"], "endpoint": "/v1/chat/completions"}).encode(),
        )
        assert status == 400 and b"custom_id" in raw
