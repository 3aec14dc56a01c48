"""``mmcache bench URL --compare URL2`` against real servers: it finishes, writes the JSON and
the PNG, and its hit rates come from the deployment's own counters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.server import serving

pytestmark = pytest.mark.e2e


def test_bench_compares_two_deployments(tiny_model, tmp_path):
    with serving(tiny_model) as cached, serving(tiny_model, "--no-cache") as uncached:
        out = tmp_path / "result"
        done = subprocess.run(
            [sys.executable, "-m", "mmcache", "bench", cached.url, "--compare", uncached.url,
             "--workload", "repeated-images", "--repeat-ratio", "0.5", "--num-requests", "8",
             "--concurrency", "2", "--max-tokens", "4", "--image-size", "112", "--out", str(out)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== ratios" in done.stdout
    doc = json.loads(out.with_suffix(".json").read_text())
    on, off = doc["runs"]
    assert on["requests"] == off["requests"] == 8 and on["failed"] == off["failed"] == 0
    assert on["completion_tokens"] == 8 * 4
    assert len(on["outcomes"]) == 8 and all(o["ttft"] > 0 for o in on["outcomes"])
    assert on["hit_rates"]["processor"] > 0 and off["hit_rates"]["processor"] == 0
    assert set(doc["ratios"]) >= {"output_throughput", "ttft_s_p50", "latency_s_p99"}
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
