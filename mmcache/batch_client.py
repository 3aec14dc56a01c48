"""``mmcache batch FILE.jsonl``: upload a batch input file, run it as a batch job on a server,
show its progress, and save the output (and error) file next to it."""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from tqdm import tqdm

DONE = ("completed", "failed", "expired", "cancelled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="JSONL: one {custom_id, method, url, body} per line")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (processor) URL")
    parser.add_argument("--output", type=Path, help="where the answers go (default: FILE.output.jsonl)")
    parser.add_argument("--errors", type=Path, help="where failed lines go (default: FILE.errors.jsonl)")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between progress checks")


def run(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/")
    data = args.file.read_bytes()
    first = next((line for line in data.splitlines() if line.strip()), b"{}")
    endpoint = json.loads(first).get("url", "/v1/chat/completions")
    uploaded = _upload(base, args.file.name, data)
    batch = _json(base + "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": endpoint})
    total = batch["request_counts"]["total"]
    with tqdm(total=total, unit="line", desc=batch["id"]) as bar:
        while batch["status"] not in DONE:
            time.sleep(args.poll)
            batch = _json(f"{base}/v1/batches/{batch['id']}")
            counts = batch["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            bar.set_postfix(failed=counts["failed"], status=batch["status"])
    output = args.output or args.file.with_suffix(".output.jsonl")
    errors = args.errors or args.file.with_suffix(".errors.jsonl")
    for file_id, path in ((batch.get("output_file_id"), output), (batch.get("error_file_id"), errors)):
        if file_id:
            with urllib.request.urlopen(f"{base}/v1/files/{file_id}/content") as resp:
                path.write_bytes(resp.read())
            print(f"{path}")
    counts = batch["request_counts"]
    print(f"{batch['id']}: {batch['status']}, {counts['completed']} answered, {counts['failed']} failed")
    return 0 if batch["status"] == "completed" and not counts["failed"] else 1


def _upload(base: str, name: str, data: bytes) -> dict:
    boundary = uuid.uuid4().hex
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    return _send(urllib.request.Request(base + "/v1/files", data=body, headers=headers))


def _json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    return _send(urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}))


def _send(req: urllib.request.Request) -> dict:
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raise SystemExit(f"{req.full_url}: {err.code} {err.read().decode(errors='replace')}") from err
