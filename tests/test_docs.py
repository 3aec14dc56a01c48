"""The README and docs/: every relative link and anchor resolves (no network), every page is
linked from the README, the README stays a short front door, the configuration page is what the
option definitions generate, and the benchmark results are data with their provenance."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import pytest

from mmcache import docs_config
from mmcache.results import REQUIRED

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS]
RESULTS = ROOT / "benchmarks" / "results"

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\n]|\][^(\n])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def test_the_link_pattern_finds_links_and_skips_code():
    text = "see [a](x.md#b) and ![i](p.png) `[not](y.md)`\n```\n[nor](z.md)\n```\n"
    assert LINK.findall(prose(text)) == ["x.md#b", "p.png"]
    assert slug("Against vLLM, SGLang and Dynamo") == "against-vllm-sglang-and-dynamo"
    assert slug("Load any deployment: `mmcache bench URL`") == "load-any-deployment-mmcache-bench-url"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s):, mailto: ... (no network here)
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert broken == []


def test_every_docs_page_and_contributing_are_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    missing = [p.name for p in [*DOCS, ROOT / "CONTRIBUTING.md"] if p.resolve() not in linked]
    assert missing == []


def test_the_readme_is_a_short_front_door_without_dated_text():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    dated = re.findall(
        r"\b20\d\d-\d\d-\d\d\b|this round|round before|rounds? ago|this session|measured today", text, re.I
    )
    assert dated == []


def test_the_configuration_page_is_what_the_option_definitions_generate():
    """After changing shared/config.py: ``python -m mmcache.docs_config``."""
    assert (ROOT / docs_config.PAGE).read_text() == docs_config.render()


def test_the_configuration_page_generator_checks_and_writes(tmp_path):
    page = tmp_path / "configuration.md"
    assert docs_config.main(["--check", "--out", str(page)]) == 1
    assert docs_config.main(["--out", str(page)]) == 0
    assert docs_config.main(["--check", "--out", str(page)]) == 0
    assert "`--kv-cache-gb` | `MMCACHE_KV_CACHE_GB`" in page.read_text()


def results_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", results_files(), ids=lambda p: p.name)
def test_every_results_file_says_commit_date_and_machine(path):
    doc = json.loads(path.read_text())
    assert all(doc.get(k) for k in REQUIRED), [k for k in REQUIRED if not doc.get(k)]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["date"])
    assert doc["machine"]["cpus"] >= 1
    # named <date>-<kind>-<commit>.json, so the newest sorts last
    assert path.name.startswith(doc["date"].replace("-", "").replace(":", "") + f"-{doc['kind']}-")


def test_the_benchmarks_page_links_the_newest_results_of_each_kind():
    newest: dict[str, Path] = {}
    for path in results_files():
        newest[json.loads(path.read_text())["kind"]] = path
    assert {"builtin", "load"} <= set(newest)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for path in newest.values():
        assert f"../benchmarks/results/{path.name}" in page, path.name
