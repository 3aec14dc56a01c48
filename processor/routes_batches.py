"""``/v1/files`` and ``/v1/batches``: uploads (streamed to disk, bounded) and batch jobs, present
when the processor runs with ``--batch-dir``."""

from __future__ import annotations

from aiohttp import BodyPartReader, web

from mmcache.processor.app_state import BATCHES, CONFIG, FILES
from mmcache.processor.batch_jobs import BatchJobs
from mmcache.processor.body import load_body
from mmcache.processor.errors import APIError, bad_request
from mmcache.processor.files import FileStore

UPLOAD_CHUNK = 1 << 20


def _files(request: web.Request) -> FileStore:
    if FILES not in request.app:
        raise APIError(
            404, "batch jobs are off: start the processor with --batch-dir DIR", "batches_disabled"
        )
    return request.app[FILES]


def _jobs(request: web.Request) -> BatchJobs:
    _files(request)
    return request.app[BATCHES]


async def upload(request: web.Request) -> web.Response:
    """``multipart/form-data`` with ``purpose`` (batch) and ``file``, streamed to disk (bounded)."""
    files = _files(request)
    limit = request.app[CONFIG].max_request_bytes
    if not request.content_type.startswith("multipart/"):
        raise bad_request("send the file as multipart/form-data (purpose, file)", "invalid_content_type")
    reader = await request.multipart()
    purpose = filename = None
    file_id = files.new_id()
    part_path = files.partial(file_id)
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise bad_request("nested multipart bodies are not supported", "invalid_content_type")
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode()
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                size = 0
                with open(part_path, "wb") as out:
                    while chunk := await part.read_chunk(UPLOAD_CHUNK):
                        size += len(chunk)
                        if size > limit:
                            raise APIError(
                                413, f"file is larger than the limit of {limit} bytes", "request_too_large"
                            )
                        out.write(chunk)
        if purpose != "batch":
            raise bad_request("'purpose' must be batch", "invalid_purpose", "purpose")
        if filename is None:
            raise bad_request("'file' is required", "missing_file", "file")
        return web.json_response(files.commit(file_id, filename, purpose))
    finally:
        part_path.unlink(missing_ok=True)


async def file_info(request: web.Request) -> web.Response:
    return web.json_response(_files(request).info(request.match_info["file_id"]))


async def file_content(request: web.Request) -> web.FileResponse:
    path = _files(request).path(request.match_info["file_id"])
    return web.FileResponse(path, headers={"Content-Type": "application/jsonl"})


async def create_batch(request: web.Request) -> web.Response:
    jobs = _jobs(request)
    body, _ = load_body(await request.read())
    return web.json_response(jobs.create(body))


async def list_batches(request: web.Request) -> web.Response:
    data = _jobs(request).recent()
    return web.json_response({"object": "list", "data": data, "has_more": False})


async def batch(request: web.Request) -> web.Response:
    return web.json_response(_jobs(request).get(request.match_info["batch_id"]))


async def cancel_batch(request: web.Request) -> web.Response:
    return web.json_response(_jobs(request).cancel(request.match_info["batch_id"]))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files/{file_id}", file_info)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
