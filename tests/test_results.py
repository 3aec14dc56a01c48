"""Benchmark results as data: a results file carries kind, commit, date and machine, is named so
the newest sorts last, and ``mmcache bench --results-dir`` writes every result into one."""

from __future__ import annotations

import json
import re

from mmcache.bench import _save
from mmcache.benchmarks.common import Result
from mmcache.results import REQUIRED, record, write


def test_a_record_says_where_and_when_and_is_named_by_date_kind_commit(tmp_path):
    doc = record("load", {"runs": [1]})
    assert all(doc[k] for k in REQUIRED)
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", doc["commit"])  # the tests run in a git checkout
    assert doc["machine"]["cpus"] >= 1 and len(doc["machine"]["load_average"]) == 3
    path = write(tmp_path, doc)
    assert json.loads(path.read_text()) == doc
    stamp = doc["date"].replace("-", "").replace(":", "")
    assert path.name == f"{stamp}-load-{doc['commit'].replace('+', '-')}.json"


def test_the_builtin_benchmarks_write_every_result_with_its_status(tmp_path):
    met = Result("a.x", "x per y", 2.0, goal=1.5)
    missed = Result("a.z", "z per y", 0.5, goal=0.8, note="noisy")
    path = _save(tmp_path, [("a", 1.23, [met, missed])], failed=["b"], quick=True)
    doc = json.loads(path.read_text())
    assert (doc["kind"], doc["quick"], doc["crashed"]) == ("builtin", True, ["b"])
    assert [(r["name"], r["value"], r["status"], r["module"]) for r in doc["results"]] == [
        ("a.x", 2.0, "PASS", "a"),
        ("a.z", 0.5, "MISS", "a"),
    ]
