"""Files for batch jobs (``POST /v1/files``, ``GET /v1/files/{id}``, ``/content``), in a directory.

A file is ``<dir>/files/<id>`` (its bytes) and ``<id>.json`` (its OpenAI File object), written
through a temporary name and renamed, so a reader (another worker process, or the processor after
a restart) sees a whole file or none.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import orjson

from mmcache.processor.errors import APIError

_ID = re.compile(r"^file-[0-9a-f]{32}$")
PURPOSES = ("batch", "batch_output")


class FileStore:
    def __init__(self, root: Path):
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)

    def new_id(self) -> str:
        return "file-" + uuid.uuid4().hex

    def path(self, file_id: str) -> Path:
        """The bytes of a stored file; 404 when there is none."""
        if not _ID.match(file_id) or not (self.dir / f"{file_id}.json").exists():
            raise APIError(404, f"no file {file_id!r}", "file_not_found", "file_id")
        return self.dir / file_id

    def info(self, file_id: str) -> dict:
        self.path(file_id)
        return orjson.loads((self.dir / f"{file_id}.json").read_bytes())

    def partial(self, file_id: str) -> Path:
        """Where a file is written before :meth:`commit` makes it visible."""
        return self.dir / f".{file_id}.part"

    def commit(self, file_id: str, filename: str, purpose: str) -> dict:
        """The partial file becomes ``file_id``: its bytes, then its object (what readers look for)."""
        part = self.partial(file_id)
        os.replace(part, self.dir / file_id)
        info = {
            "id": file_id,
            "object": "file",
            "bytes": (self.dir / file_id).stat().st_size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        write_atomic(self.dir / f"{file_id}.json", orjson.dumps(info))
        return info


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
