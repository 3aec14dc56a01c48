"""Batch jobs (OpenAI's Batch API): a JSONL file of requests in, a JSONL file of answers out.

Lines run through the same answers as the HTTP endpoints (:mod:`processor.answers`), at most
``concurrency`` at once, only while no interactive request is in progress: one that arrives
preempts the lines running (:mod:`processor.priority`). A line that fails with a 5xx is tried
again (``RETRIES`` times).

State lives in ``<batch dir>/batches``: ``<id>.json`` (the Batch object), ``<id>.done.jsonl``
(each finished line, appended and synced as it ends), ``<id>.cancel`` (a cancel asked for) and
``<id>.lock``, which the process running the job holds (``flock``): after a restart, or in
another worker process, a job that no live process holds is taken up again and runs only the
lines not in its done file. Output and error files are written once the job ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from mmcache.processor.answers import Answer
from mmcache.processor.body import load_body
from mmcache.processor.errors import APIError, bad_request
from mmcache.processor.files import FileStore, write_atomic
from mmcache.processor.priority import Interactive

log = logging.getLogger(__name__)

_ID = re.compile(r"^batch_[0-9a-f]{32}$")
RETRIES = 2  # more tries for a line that failed with a 5xx (a stage gone, a timeout)
RETRY_PAUSE = 1.0  # seconds before a retry, times the try's number
STATE_EVERY = 0.25  # seconds between writes of a running job's Batch object
MAX_PREEMPTIONS = 3  # times a batch line may be aborted for interactive requests before it runs through
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
MAX_METADATA = 16


class BatchJobs:
    def __init__(
        self,
        root: Path,
        files: FileStore,
        answers: Mapping[str, Answer],
        interactive: Interactive,
        concurrency: int,
        max_lines: int,
    ):
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files = files
        self.answers = answers
        self.interactive = interactive
        self.concurrency = concurrency
        self.max_lines = max_lines
        self._tasks: dict[str, asyncio.Task] = {}
        self.preempted = 0  # batch lines aborted for an interactive request (and run again)

    # --- the API ------------------------------------------------------------------------

    def create(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or endpoint not in self.answers:
            raise bad_request(
                f"'endpoint' must be one of {', '.join(self.answers)}", "invalid_endpoint", "endpoint"
            )
        if body.get("completion_window", "24h") != "24h":
            raise bad_request(
                "'completion_window' must be 24h", "invalid_completion_window", "completion_window"
            )
        metadata = body.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > MAX_METADATA
            or not all(isinstance(v, str) for v in metadata.values())
        ):
            raise bad_request(
                f"'metadata' must map at most {MAX_METADATA} keys to strings", "invalid_metadata", "metadata"
            )
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise bad_request("'input_file_id' is required", "invalid_input_file_id", "input_file_id")
        info = self.files.info(file_id)
        if info["purpose"] != "batch":
            raise bad_request(
                f"file {file_id} has purpose {info['purpose']!r}, not 'batch'",
                "invalid_input_file_id",
                "input_file_id",
            )
        total = len(self._check_lines(self.files.path(file_id).read_bytes(), endpoint))
        now = int(time.time())
        batch_id = "batch_" + uuid.uuid4().hex
        batch: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": file_id,
            "completion_window": "24h",
            "status": "in_progress",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": now,
            "expires_at": now + 24 * 3600,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        self._save(batch)
        self._start(batch_id)
        return public(batch)

    def get(self, batch_id: str) -> dict:
        """The Batch object as the API shows it."""
        return public(self._load(batch_id))

    def _load(self, batch_id: str) -> dict:
        path = self._path(batch_id, ".json")
        if not _ID.match(batch_id) or not path.exists():
            raise APIError(404, f"no batch {batch_id!r}", "batch_not_found", "batch_id")
        batch = orjson.loads(path.read_bytes())
        if batch["status"] == "in_progress" and self._path(batch_id, ".cancel").exists():
            batch["status"] = "cancelling"  # NOTE: until the process running it has stopped
        return batch

    def cancel(self, batch_id: str) -> dict:
        batch = self._load(batch_id)
        if batch["status"] in ACTIVE:
            self._path(batch_id, ".cancel").touch()
            batch["status"] = "cancelling"
            batch["cancelling_at"] = batch["cancelling_at"] or int(time.time())
        return public(batch)

    def recent(self, limit: int = 20) -> list[dict]:
        found = sorted(self.dir.glob("batch_*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        return [self.get(p.stem) for p in found[:limit]]

    # --- running ------------------------------------------------------------------------

    def resume(self) -> None:
        """Take up every job that is not finished and that no live process runs."""
        for path in self.dir.glob("batch_*.json"):
            with contextlib.suppress(OSError, orjson.JSONDecodeError):
                if orjson.loads(path.read_bytes())["status"] in ACTIVE:
                    self._start(path.stem)

    async def close(self) -> None:
        """Stop running jobs where they are (their state stays: the next start resumes them)."""
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _start(self, batch_id: str) -> None:
        if batch_id not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._run(batch_id))
            self._tasks[batch_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def _run(self, batch_id: str) -> None:
        lock = open(self._path(batch_id, ".lock"), "a")  # noqa: SIM115 (held while the job runs)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another live process runs it
            await self._run_locked(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("batch %s failed", batch_id)
            batch = self._load(batch_id)
            batch.update(status="failed", failed_at=int(time.time()))
            batch["errors"] = {"object": "list", "data": [{"code": "internal_error", "message": str(exc)}]}
            self._save(batch)
        finally:
            lock.close()

    async def _run_locked(self, batch_id: str) -> None:
        batch = self._load(batch_id)
        if batch["status"] not in ACTIVE:
            return
        lines = self._check_lines(self.files.path(batch["input_file_id"]).read_bytes(), batch["endpoint"])
        done_path = self._path(batch_id, ".done.jsonl")
        done = _read_done(done_path)
        counts = batch["request_counts"]
        counts["completed"] = sum(1 for r in done.values() if r["ok"])
        counts["failed"] = len(done) - counts["completed"]
        pending = asyncio.Queue[int]()
        for i in range(len(lines)):
            if i not in done:
                pending.put_nowait(i)
        answer = self.answers[batch["endpoint"]]
        last_save = 0.0
        cancel = self._path(batch_id, ".cancel")

        with open(done_path, "ab") as out:

            async def worker() -> None:
                nonlocal last_save
                while not pending.empty() and not cancel.exists():
                    i = pending.get_nowait()
                    record = await self._yielding(answer, lines[i], i)
                    out.write(orjson.dumps(record) + b"\n")
                    out.flush()
                    os.fsync(out.fileno())
                    done[i] = record
                    counts["completed" if record["ok"] else "failed"] += 1
                    if time.monotonic() - last_save > STATE_EVERY:
                        last_save = time.monotonic()
                        self._save(batch)

            await asyncio.gather(*(worker() for _ in range(min(self.concurrency, max(1, pending.qsize())))))
        self._save(batch)
        self._finish(batch, lines, done, cancelled=cancel.exists())

    async def _yielding(self, answer: Answer, line: bytes, index: int) -> dict:
        """One line run when no interactive request is, and aborted (to run again once none is)
        when one arrives, at most ``MAX_PREEMPTIONS`` times; then it runs to its end regardless,
        so a long line still finishes under steady interactive traffic."""
        for _ in range(MAX_PREEMPTIONS):
            await self.interactive.idle()
            run = asyncio.ensure_future(self._line(answer, line, index))
            arrived = asyncio.ensure_future(self.interactive.busy())
            try:
                await asyncio.wait((run, arrived), return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrived.cancel()
                if not run.done():
                    run.cancel()  # NOTE: closing its generation aborts it at the stages
                await asyncio.gather(run, arrived, return_exceptions=True)
            if not run.cancelled():
                return run.result()
            self.preempted += 1
        await self.interactive.idle()
        return await self._line(answer, line, index)

    async def _line(self, answer: Answer, line: bytes, index: int) -> dict:
        """One line run: ``{"i", "ok", "out"}`` (``out``: the output or error file's line)."""
        body, held = load_body(line)
        request_id = "batch_req_" + uuid.uuid4().hex
        for attempt in range(RETRIES + 1):
            try:
                out = await answer(body["body"], held)
                status = 200
                break
            except APIError as exc:
                status = exc.status
                out = {
                    "error": {
                        "message": exc.message,
                        "type": "invalid_request_error",
                        "code": exc.code,
                        "param": exc.param,
                    }
                }
                if status < 500 or attempt == RETRIES:
                    break
            except Exception as exc:  # a bug must not stop the job: the line fails, named
                log.exception("batch line %d failed", index)
                status, out = (
                    500,
                    {
                        "error": {
                            "message": str(exc),
                            "type": "server_error",
                            "code": "internal_error",
                            "param": None,
                        }
                    },
                )
                break
            await asyncio.sleep(RETRY_PAUSE * (attempt + 1))
        response = {"status_code": status, "request_id": request_id, "body": out}
        return {
            "i": index,
            "ok": status == 200,
            "out": {"id": request_id, "custom_id": body["custom_id"], "response": response, "error": None},
        }

    def _finish(self, batch: dict, lines: list[bytes], done: dict[int, dict], cancelled: bool) -> None:
        batch.update(status="finalizing", finalizing_at=int(time.time()))
        self._save(batch)
        for ok, key in ((True, "output_file_id"), (False, "error_file_id")):
            records = [done[i]["out"] for i in sorted(done) if done[i]["ok"] == ok]
            if not records and not ok:
                continue
            file_id = self.files.new_id()
            self.files.partial(file_id).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
            name = f"{batch['id']}_{'output' if ok else 'error'}.jsonl"
            self.files.commit(file_id, name, "batch_output")
            batch[key] = file_id
        now = int(time.time())
        if cancelled:
            batch.update(status="cancelled", cancelled_at=now, cancelling_at=batch["cancelling_at"] or now)
        else:
            batch.update(status="completed", completed_at=now)
        self._save(batch)

    # --- files ------------------------------------------------------------------------------

    def _check_lines(self, data: bytes, endpoint: str) -> list[bytes]:
        """The input file's lines, each checked: JSON, a unique custom_id, POST to the endpoint."""
        lines = [line for line in data.split(b"\n") if line.strip()]
        if not lines:
            raise bad_request("the input file has no lines", "invalid_input_file", "input_file_id")
        if len(lines) > self.max_lines:
            raise bad_request(
                f"the input file has {len(lines)} lines; the limit is {self.max_lines}",
                "invalid_input_file",
                "input_file_id",
            )
        seen: set[str] = set()
        for n, line in enumerate(lines, start=1):
            try:
                body, _ = load_body(line)
            except APIError as exc:
                raise bad_request(f"line {n}: {exc.message}", "invalid_input_file", "input_file_id") from exc
            custom_id = body.get("custom_id") if isinstance(body, dict) else None
            if not isinstance(custom_id, str) or not custom_id or custom_id in seen:
                raise bad_request(
                    f"line {n}: 'custom_id' must be a string unique in the file",
                    "invalid_input_file",
                    "input_file_id",
                )
            seen.add(custom_id)
            if body.get("method", "POST") != "POST" or body.get("url") != endpoint:
                raise bad_request(
                    f"line {n}: each line must be a POST to the batch's endpoint {endpoint}",
                    "invalid_input_file",
                    "input_file_id",
                )
            if not isinstance(body.get("body"), dict):
                raise bad_request(
                    f"line {n}: 'body' must be an object", "invalid_input_file", "input_file_id"
                )
        return lines

    def _path(self, batch_id: str, suffix: str) -> Path:
        return self.dir / f"{batch_id}{suffix}"

    def _save(self, batch: dict) -> None:
        write_atomic(self._path(batch["id"], ".json"), orjson.dumps(batch))


def public(batch: dict) -> dict:
    """A Batch object without its unset fields (OpenAI's schema has no null for them)."""
    return {k: v for k, v in batch.items() if v is not None}


def _read_done(path: Path) -> dict[int, dict]:
    """The lines a job finished, by index; a last line cut short by a crash is dropped (and cut off)."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    done: dict[int, dict] = {}
    good = 0
    for line in data.splitlines(keepends=True):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            break
        if not line.endswith(b"\n"):
            break
        done[record["i"]] = record
        good += len(line)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done
