"""Request bodies whose large data: URLs are held aside as raw bytes instead of parsed."""

from __future__ import annotations

import json

import pytest

from mmcache.processor.body import MIN_HELD_BYTES, load_body
from mmcache.processor.errors import APIError
from mmcache.processor.request import parse_chat_request
from tests.media import data_url, image_bytes

URL = data_url(image_bytes(64, 64, seed=3), "image/png")
assert len(URL) > MIN_HELD_BYTES


def chat(*parts: dict, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}], **extra}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_large_data_url_is_held_as_its_raw_bytes_and_the_rest_parses_as_json():
    body = chat(image(URL), {"type": "text", "text": 'say "hi"'}, max_tokens=3)
    parsed, held = load_body(json.dumps(body).encode())
    ((name, raw),) = held.items()
    assert bytes(raw) == URL.encode()
    assert parsed["messages"][0]["content"][0]["image_url"]["url"] == name
    parsed["messages"][0]["content"][0]["image_url"]["url"] = URL
    assert parsed == body  # nothing else changed
    req = parse_chat_request(*load_body(json.dumps(body).encode()))
    assert bytes(req.media[0].location) == URL.encode()


def test_what_is_not_a_media_url_reads_as_before():
    """A data: URL as text, as a key, inside an escaped string, with JSON escapes, or small."""
    small = data_url(b"x" * 16, "image/png")
    body = chat(
        {"type": "text", "text": URL},  # a large data: URL as text: held, then put back
        {"type": "text", "text": 'quoted "' + URL + '" inside'},  # escaped quotes: not a string start
        image(small),  # small: parsed as usual
        image(URL.replace("/", "\\/")),  # JSON escapes inside: parsed as usual
        labels={URL: 1},  # a key: never cut
    )
    raw = json.dumps(body).replace("\\\\/", "\\/").encode()  # \\/ in the text: the JSON escape \/
    assert b"\\/" in raw and json.loads(raw)["messages"][0]["content"][3]["image_url"]["url"] == URL
    parsed, held = load_body(raw)
    assert parsed == json.loads(raw)
    assert len(held) == 1  # only the text part was cut (and put back)
    req = parse_chat_request(parsed, held)
    assert [ref.raw for ref in req.media] == [None, None]


def test_placeholders_cannot_be_forged():
    """A client cannot name held bytes: placeholders carry a fresh random nonce per body."""
    _, held = load_body(json.dumps(chat(image(URL))).encode())
    ((name, _),) = held.items()
    body = chat(image(name), image(URL))
    parsed, held2 = load_body(json.dumps(body).encode())
    req = parse_chat_request(parsed, held2)
    assert name not in held2 and req.media[0].raw is None and req.media[0].url == name
    assert bytes(req.media[1].location) == URL.encode()


def test_invalid_json_around_a_held_url_is_still_refused():
    raw = json.dumps(chat(image(URL))).encode()[:-1]  # truncated
    with pytest.raises(APIError) as err:
        load_body(raw)
    assert err.value.status == 400 and err.value.code == "invalid_json"


async def test_a_held_data_url_is_the_same_media_as_the_parsed_one(tiny_model, tmp_path):
    """Held or parsed, a data: URL has one alias and one media key: the second form is a hit,
    and a held URL with bad base64 is refused like a parsed one."""
    from tests.processor.test_media_cache import pipeline

    pipe = pipeline(tiny_model, tmp_path, 64 << 20)
    url = data_url(image_bytes(300, 200, seed=9), "image/png")
    raw = json.dumps(chat(image(url))).encode()
    parsed = await pipe.prepare(parse_chat_request(json.loads(raw)))  # as a string
    held = await pipe.prepare(parse_chat_request(*load_body(raw)))  # as raw bytes
    assert parsed.report.processor_misses == 1 and held.report.processor_hits == 1
    assert held.token_ids == parsed.token_ids
    assert [c.key for c in held.media[0].chunks] == [c.key for c in parsed.media[0].chunks]

    fresh = pipeline(tiny_model, tmp_path, 64 << 20)  # held first, then parsed
    first = await fresh.prepare(parse_chat_request(*load_body(raw)))
    second = await fresh.prepare(parse_chat_request(json.loads(raw)))
    assert (first.report.processor_misses, second.report.processor_hits) == (1, 1)
    assert fresh.cache.stats.decodes == 1
    assert [c.key for c in first.media[0].chunks] == [c.key for c in parsed.media[0].chunks]

    bad = url[:-8] + "!!!!!!!!"
    with pytest.raises(APIError) as err:
        await pipe.prepare(parse_chat_request(*load_body(json.dumps(chat(image(bad))).encode())))
    assert err.value.status == 400 and err.value.code == "invalid_base64"
