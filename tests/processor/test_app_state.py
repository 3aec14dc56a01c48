"""The frame of a streamed chat or text completion (``app_state.sse_body``): a stage error after
the 200 becomes an error event and the request's code, the generation is closed however the body
ends, and a stream that ended gets its ``[DONE]``."""

from __future__ import annotations

import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mmcache.processor.app_state import sse_body, sse_response
from mmcache.processor.errors import APIError
from mmcache.processor.request_log import RequestRecord
from mmcache.processor.responses import sse


async def _events(fail: bool) -> tuple[list[str], RequestRecord, list[str]]:
    record = RequestRecord()
    closed: list[str] = []

    async def generation():
        try:
            yield 0, None
            if fail:
                raise APIError(503, "no LLM replica answers", "stage_unavailable")
            yield 1, None
        finally:
            closed.append("closed")

    async def handler(request: web.Request) -> web.StreamResponse:
        gen = generation()
        resp = await sse_response(request)
        async with sse_body(resp, gen, record):
            async for index, _ in gen:
                await sse(resp, {"chunk": index})
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/")
        assert resp.status == 200
        text = await resp.text()
    return [line.removeprefix("data: ") for line in text.splitlines() if line], record, closed


async def test_a_stream_that_ends_sends_its_chunks_then_done_and_closes_the_generation() -> None:
    events, record, closed = await _events(fail=False)
    assert [json.loads(e) for e in events[:-1]] == [{"chunk": 0}, {"chunk": 1}]
    assert events[-1] == "[DONE]" and closed == ["closed"] and record.code is None


async def test_a_stage_error_after_the_200_becomes_an_error_event_and_the_requests_code() -> None:
    events, record, closed = await _events(fail=True)
    assert json.loads(events[0]) == {"chunk": 0}
    error = json.loads(events[1])["error"]
    assert error["code"] == "stage_unavailable" and "no LLM replica answers" in error["message"]
    assert events[2:] == ["[DONE]"] and closed == ["closed"] and record.code == "stage_unavailable"
