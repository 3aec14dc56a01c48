"""Bad input gets a 4xx JSON error naming the problem, and the server keeps serving.

One server with small limits (pixels, request bytes, context) and one allowed
media directory. A local HTTP server serves a valid PNG on loopback: the SSRF
guard must refuse it without ever connecting.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import io
import json
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from tests import media
from tests.e2e.server import Server, serving

pytestmark = pytest.mark.e2e

MAX_IMAGE_PIXELS = 1_000_000
MAX_REQUEST_BYTES = 2_000_000
MAX_MODEL_LEN = 256

PNG = media.image_bytes(112, 112, seed=5)  # valid, small: 16 image tokens
VIDEO = media.video_bytes(4, 112, 112, fps=2, seed=6)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(side: int = 20000) -> bytes:
    """A valid 1-bit single-colour PNG of side x side pixels that compresses to ~50 KB.

    Fully decoded it is ``side**2`` pixels (400 MB as 8-bit, 1.2 GB as RGB).
    """
    row = bytes(1 + (side + 7) // 8)  # filter byte 0, then all-black pixels
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row * 1000) for _ in range(side // 1000)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1 bit, greyscale
    chunks = _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def big_png(side: int = 2000) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


class _PNGHandler(http.server.BaseHTTPRequestHandler):
    hits: list[str]

    def do_GET(self) -> None:
        self.hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args) -> None:
        pass


@dataclass
class Env:
    server: Server
    allowed: Path  # the server's --allowed-local-media-path
    outside: Path  # a directory next to it, not allowed
    http_port: int  # a loopback HTTP server with a valid PNG at /img.png
    http_hits: list[str]


@pytest.fixture(scope="module")
def env(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ok.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside / "secret.png")

    hits: list[str] = []
    handler = type("Handler", (_PNGHandler,), {"hits": hits})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    with serving(
        tiny_model,
        "--max-image-pixels",
        str(MAX_IMAGE_PIXELS),
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        media_dir=allowed,
    ) as server:
        yield Env(server, allowed, outside, httpd.server_address[1], hits)
        httpd.shutdown()
        httpd.server_close()


def post_raw(server: Server, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    """POST with http.client so a 413 sent before the body is fully read still comes back."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        # The server may answer early and close; the response is still readable.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.send(body)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw or b"{}")
        except ValueError:
            return resp.status, {"not_json": raw[:300].decode(errors="replace")}
    finally:
        conn.close()


def chat(*parts: dict | str, **extra) -> Callable[[Env], dict]:
    """A request body builder: one user message with ``parts`` (str = text part)."""

    def build(env: Env) -> dict:
        content = [
            {"type": "text", "text": p} if isinstance(p, str) else p(env) if callable(p) else p for p in parts
        ]
        return {"model": env.server.model.name, "messages": [{"role": "user", "content": content}]} | {
            "max_tokens": 4,
            **extra,
        }

    return build


def img(url: str | Callable[[Env], str]) -> Callable[[Env], dict]:
    return lambda env: {"type": "image_url", "image_url": {"url": url(env) if callable(url) else url}}


def vid(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def b64(data: bytes, mime: str = "image/png") -> str:
    return media.data_url(data, mime)


@dataclass
class Bad:
    body: Callable[[Env], dict | bytes] | bytes | dict
    words: tuple[str, ...]  # each must appear in error.message (case-insensitive)
    status: int = 400
    code: str | None = None


LONG_TEXT = " ".join(f"word{i} and another sentence about things" for i in range(200))

CASES: dict[str, Bad] = {
    "invalid_json": Bad(b'{"model": "m", "messages": [', ("json",), code="invalid_json"),
    "empty_body": Bad(b"", ("json",), code="invalid_json"),
    "body_not_utf8": Bad(b'\xff\xfe{"model": 1}', ("json",), code="invalid_json"),
    "body_not_object": Bad(b"[1, 2, 3]", ("object",)),
    "missing_messages": Bad(lambda e: {"model": e.server.model.name}, ("messages",)),
    "empty_messages": Bad(lambda e: {"model": e.server.model.name, "messages": []}, ("messages",)),
    "messages_not_list": Bad(lambda e: {"model": e.server.model.name, "messages": "hi"}, ("messages",)),
    "unknown_role": Bad(
        lambda e: {"model": e.server.model.name, "messages": [{"role": "robot", "content": "hi"}]},
        ("role", "robot"),
    ),
    "unknown_part_type": Bad(
        chat({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}), ("audio_url",)
    ),
    "image_part_without_url": Bad(chat({"type": "image_url", "image_url": {}}), ("url",)),
    "unknown_uuid_without_data": Bad(
        chat({"type": "image_url", "image_url": None, "uuid": "never-seen-before"}), ("never-seen-before",)
    ),
    "image_in_assistant_message": Bad(
        lambda e: {
            "model": e.server.model.name,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [img(b64(PNG))(e)]},
                {"role": "user", "content": "and?"},
            ],
        },
        ("user messages",),
    ),
    "too_many_media_items": Bad(chat(*[img(b64(PNG))] * 17), ("17", "limit")),
    "media_placeholder_in_text": Bad(chat("look: <|image_pad|>"), ("placeholder",)),
    "invalid_base64": Bad(chat(img("data:image/png;base64,@@@not*base64@@@")), ("base64",)),
    "data_url_without_base64": Bad(chat(img("data:image/png,rawbytes")), ("data url",)),
    "unsupported_url_scheme": Bad(chat(img("ftp://example.com/a.png")), ("scheme", "ftp")),
    "undecodable_image": Bad(chat(img(b64(b"this is not an image at all" * 20))), ("decode", "image")),
    "truncated_png": Bad(chat(img(b64(PNG[: len(PNG) // 2]))), ("decode", "image")),
    "garbage_video": Bad(chat(vid(b64(b"\x00\x01garbage video" * 100, "video/mp4"))), ("video",)),
    "truncated_video": Bad(chat(vid(b64(VIDEO[: len(VIDEO) // 2], "video/mp4"))), ("video",)),
    "video_as_image": Bad(chat(img(b64(VIDEO, "video/mp4"))), ("decode", "image")),
    "image_over_pixel_limit": Bad(chat(img(b64(big_png()))), ("2000x2000", str(MAX_IMAGE_PIXELS))),
    "decompression_bomb": Bad(chat(img(b64(bomb_png()))), ("20000x20000", str(MAX_IMAGE_PIXELS))),
    "file_outside_allowed": Bad(
        chat(img(lambda e: (e.outside / "secret.png").as_uri())), ("outside", "allowed-local-media-path")
    ),
    "file_dotdot_escape": Bad(
        chat(img(lambda e: f"file://{e.allowed}/../outside/secret.png")), ("outside", "secret.png")
    ),
    "file_symlink_escape": Bad(chat(img(lambda e: (e.allowed / "link.png").as_uri())), ("outside",)),
    "file_remote_host": Bad(chat(img(lambda e: f"file://example.com{e.allowed}/ok.png")), ("local",)),
    "file_missing": Bad(chat(img(lambda e: (e.allowed / "nope.png").as_uri())), ("nope.png",)),
    "prompt_over_context": Bad(chat(LONG_TEXT), ("context", str(MAX_MODEL_LEN))),
    "max_tokens_over_context": Bad(chat("hi", max_tokens=MAX_MODEL_LEN), ("max_tokens", "context")),
    "max_tokens_0": Bad(chat("hi", max_tokens=0), ("max_tokens",)),
    "max_tokens_-1": Bad(chat("hi", max_tokens=-1), ("max_tokens",)),
    "max_tokens_string": Bad(chat("hi", max_tokens="5"), ("max_tokens",)),
    "temperature_-1": Bad(chat("hi", temperature=-1), ("temperature",)),
    "temperature_3": Bad(chat("hi", temperature=3), ("temperature",)),
    "temperature_string": Bad(chat("hi", temperature="0.5"), ("temperature",)),
    "top_p_0": Bad(chat("hi", top_p=0), ("top_p",)),
    "top_p_1.5": Bad(chat("hi", top_p=1.5), ("top_p",)),
    "stream_not_bool": Bad(chat("hi", stream="yes"), ("stream",)),
    "n_17": Bad(chat("hi", n=17), ("'n'", "16")),
    "logit_bias_beyond_vocab": Bad(chat("hi", logit_bias={"99999999": 5}), ("logit_bias",)),
    "unenforceable_schema": Bad(
        chat(
            "hi", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}
        ),
        ("response_format",),
    ),
    "tool_choice_unknown_function": Bad(
        chat(
            "hi",
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        ("'g'",),
    ),
    "prediction": Bad(chat("hi", prediction={"type": "content", "content": "x"}), ("prediction",)),
    "unknown_model": Bad(lambda e: chat("hi")(e) | {"model": "no-such-model"}, ("no-such-model",), 404),
    "body_over_max_request_bytes": Bad(chat("x" * (MAX_REQUEST_BYTES + 100_000)), ("larger",), 413),
    "http_loopback_ip": Bad(
        chat(img(lambda e: f"http://127.0.0.1:{e.http_port}/img.png")), ("127.0.0.1", "public")
    ),
    "http_localhost_name": Bad(
        chat(img(lambda e: f"http://localhost:{e.http_port}/img.png")), ("localhost", "public")
    ),
}


def send(env: Env, bad: Bad) -> tuple[int, dict, float]:
    body = bad.body(env) if callable(bad.body) else bad.body
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.monotonic()
    status, reply = post_raw(env.server, data)
    return status, reply, time.monotonic() - start


def check_error(status: int, reply: dict, bad: Bad) -> None:
    assert status == bad.status, reply
    assert "error" in reply, reply
    error = reply["error"]
    assert set(error) >= {"message", "type", "code", "param"}
    assert isinstance(error["code"], str) and error["code"]
    message = error["message"].lower()
    for word in bad.words:
        assert word.lower() in message, error
    if bad.code is not None:
        assert error["code"] == bad.code


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_4xx_naming_the_problem(env: Env, case: str) -> None:
    status, reply, _ = send(env, CASES[case])
    check_error(status, reply, CASES[case])


def _processor_pid(server: Server) -> int:
    for pid in server.children:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mmcache" in args and args[args.index(b"mmcache") + 1 :][:1] == [b"processor"]:
            return pid
    raise AssertionError("no processor process")


def _memory_kib(pid: int) -> dict[str, int]:
    fields = (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: int(v.split()[0]) for k, _, v in fields if k in ("VmRSS", "VmHWM")}


def test_decompression_bomb_is_refused_before_decoding(env: Env) -> None:
    send(env, CASES["decompression_bomb"])  # warm-up (first-use costs are not what we measure)
    pid = _processor_pid(env.server)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    before = _memory_kib(pid)
    status, reply, elapsed = send(env, CASES["decompression_bomb"])
    after = _memory_kib(pid)
    check_error(status, reply, CASES["decompression_bomb"])
    assert elapsed < 2.0, f"took {elapsed:.2f}s: the bomb was decoded"
    # Decoded, the 20000x20000 image would need >= 400 MB (one byte per pixel) in the processor.
    grew_mib = (after["VmHWM"] - before["VmRSS"]) / 1024
    assert grew_mib < 100, f"the processor's peak memory grew by {grew_mib:.0f} MiB"


def test_ssrf_guard_never_connects(env: Env) -> None:
    for case in ("http_loopback_ip", "http_localhost_name"):
        check_error(*send(env, CASES[case])[:2], CASES[case])
    assert env.http_hits == []


def _good(env: Env) -> dict:
    status, body = env.server.post(
        "/v1/chat/completions",
        {
            "model": env.server.model.name,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": (env.allowed / "ok.png").as_uri()}},
                        {"type": "image_url", "image_url": {"url": b64(PNG)}},
                        {"type": "text", "text": "Same picture twice?"},
                    ],
                }
            ],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    assert body["choices"][0]["token_ids"]
    return body


def test_server_keeps_serving_after_all_bad_input(env: Env) -> None:
    before = _good(env)
    for name, bad in CASES.items():  # each one's status and message are checked above
        status, reply, _ = send(env, bad)
        assert status >= 400, (name, reply)
    after = _good(env)
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert after["prompt_token_ids"] == before["prompt_token_ids"]
    status, health = env.server.get("/health")
    assert status == 200 and health["status"] == "ok", health
    status, models = env.server.get("/v1/models")
    assert status == 200 and models["data"][0]["id"] == env.server.model.name
