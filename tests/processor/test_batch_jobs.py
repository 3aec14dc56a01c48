"""Batch job state on disk: the done file survives a crash mid-write (the cut line is dropped and
cut off), and an input file is checked line by line when a batch is created."""

from __future__ import annotations

import json

import pytest

from mmcache.processor.batch_jobs import BatchJobs, _read_done
from mmcache.processor.errors import APIError
from mmcache.processor.files import FileStore
from mmcache.processor.priority import Interactive


def test_a_line_cut_short_by_a_crash_is_dropped_and_cut_off(tmp_path) -> None:
    path = tmp_path / "b.done.jsonl"
    whole = [json.dumps({"i": i, "ok": True, "out": {"custom_id": f"c{i}"}}) + "\n" for i in range(3)]
    path.write_text("".join(whole) + '{"i": 3, "ok": tr')
    done = _read_done(path)
    assert sorted(done) == [0, 1, 2]
    assert path.read_text() == "".join(whole)  # the next append starts on a line of its own
    path.write_text("".join(whole) + json.dumps({"i": 3, "ok": True, "out": {}}))  # no newline yet
    assert sorted(_read_done(path)) == [0, 1, 2]


@pytest.fixture
def jobs(tmp_path) -> BatchJobs:
    async def answer(body, held) -> dict:
        return {}

    files = FileStore(tmp_path)
    return BatchJobs(tmp_path, files, {"/v1/completions": answer}, Interactive(), 2, 3)


def stored(jobs: BatchJobs, rows: list, purpose: str = "batch") -> str:
    file_id = jobs.files.new_id()
    jobs.files.partial(file_id).write_text(
        "".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows)
    )
    jobs.files.commit(file_id, "in.jsonl", purpose)
    return file_id


def line(custom_id: str, url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": "x"}}


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ([line("a"), line("a")], "line 2: 'custom_id'"),
        ([line("a"), line("b", "/v1/chat/completions")], "line 2: each line must be a POST"),
        ([line("a"), "{not json\n"], "line 2: request body is not valid JSON"),
        ([line(c) for c in "abcd"], "4 lines; the limit is 3"),
        ([], "no lines"),
        ([{**line("a"), "body": []}], "line 1: 'body' must be an object"),
    ],
)
def test_a_bad_input_file_is_a_400_naming_the_line(jobs, rows, says) -> None:
    file_id = stored(jobs, rows)
    with pytest.raises(APIError) as err:
        jobs.create({"input_file_id": file_id, "endpoint": "/v1/completions"})
    assert err.value.status == 400 and says in err.value.message


def test_the_endpoint_file_and_purpose_are_checked(jobs) -> None:
    good = stored(jobs, [line("a")])
    for body, status in (
        ({"input_file_id": good, "endpoint": "/v1/embeddings"}, 400),
        ({"input_file_id": good, "endpoint": "/v1/completions", "completion_window": "1h"}, 400),
        ({"input_file_id": "file-" + "0" * 32, "endpoint": "/v1/completions"}, 404),
        ({"input_file_id": stored(jobs, [line("a")], "batch_output"), "endpoint": "/v1/completions"}, 400),
    ):
        with pytest.raises(APIError) as err:
            jobs.create(body)
        assert err.value.status == status
