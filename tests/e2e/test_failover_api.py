"""An LLM replica lost with requests on it, beyond the plain streams of ``test_failover``.

Migration keeps every part of an answer, not only greedy text: streams that ask for logprobs,
``n`` seeded choices, penalties with a logit bias and a stop string, a ``json_schema`` grammar or
a forced tool call; the replica running the most of them is killed mid-answer. Every stream must
end exactly as in an uninterrupted run: each choice's text, tool calls, finish reason, logprob
tokens (values within float tolerance: the new replica recomputes them in a prefill), and token
counts. And requests the lost replica had not yet answered a token of are sent again, from the
start, to another one. Three LLM replicas: each test loses one."""

from __future__ import annotations

import http.client
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.streams import (
    Started,
    check_unchanged,
    failover_counters,
    failover_delta,
    run_all,
    sse_events,
    stream_bodies,
)
from tests.e2e.test_failover import llm_loads
from tests.e2e.test_replicas import Stack
from tests.e2e.util import chat, image_part
from tests.media import image_bytes

pytestmark = pytest.mark.e2e

MODEL = "qwen2-vl"
MAX_TOKENS = 96
TOL = 1e-5  # logprobs: a prefill and a decode step compute the same logits up to rounding
NOTES = {  # a grammar that keeps the model busy for dozens of tokens
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "minLength": 4, "maxLength": 12},
            "minItems": 6,
            "maxItems": 6,
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}
WRITE = {
    "type": "function",
    "function": {
        "name": "write_note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 32, "maxLength": 48}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}


def kinds(stop: str) -> dict[str, dict]:
    """One body's extra fields per feature (each streamed, each about its own image)."""
    return {
        "logprobs": {"logprobs": True, "top_logprobs": 3, "ignore_eos": True},
        "n_seeded": {"n": 2, "temperature": 0.9, "seed": 7, "ignore_eos": True},
        "penalties_stop": {
            "presence_penalty": 0.6,
            "frequency_penalty": 0.4,
            "repetition_penalty": 1.2,
            "logit_bias": {"11": -100},
            "stop": [stop],
            "ignore_eos": True,
        },
        "json_schema": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": NOTES}},
            "max_tokens": 4 * MAX_TOKENS,  # room for the whole object: it ends with "stop"
        },
        "tool_call": {"tools": [WRITE], "tool_choice": "required", "max_tokens": 4 * MAX_TOKENS},
    }


def bodies(salt: str, stop: str, copies: int = 3) -> list[dict]:
    out = []
    for i in range(copies):
        for j, (kind, extra) in enumerate(kinds(stop).items()):
            img = image_bytes(160 + 16 * j, 160, seed=4000 + 10 * i + j)
            body = chat(
                MODEL, [image_part(img), {"type": "text", "text": f"{kind} {i}?"}], max_tokens=MAX_TOKENS
            )
            body.update(extra)
            body.update(stream=True, stream_options={"include_usage": True}, cache_salt=salt)
            out.append(body)
    return out


def read(port: int, body: dict, started: Started, at: int) -> dict:
    """Stream ``body``; per choice its text, tool calls (arguments joined), finish reason and
    logprob entries, and the usage. ``started`` hears once the stream has ``at`` deltas."""
    choices: dict[int, dict] = {}
    out: dict = {"choices": choices, "usage": None, "error": None}
    deltas, told = 0, False
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        for event in sse_events(conn, body):
            if "error" in event:
                out["error"] = event["error"]
            out["usage"] = event.get("usage") or out["usage"]
            for c in event.get("choices", []):
                mine = choices.setdefault(
                    c["index"], {"text": "", "calls": {}, "finish": None, "logprobs": []}
                )
                delta = c["delta"]
                mine["text"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    slot = mine["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                    fn = call.get("function") or {}
                    slot["name"] = fn.get("name") or slot["name"]
                    slot["arguments"] += fn.get("arguments") or ""
                mine["finish"] = c.get("finish_reason") or mine["finish"]
                mine["logprobs"] += (c.get("logprobs") or {}).get("content") or []
                deltas += bool(delta.get("content") or delta.get("tool_calls"))
            if not told and deltas >= at:
                told = True
                started.one()
    except Exception as exc:  # counted as failed
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        if not told:
            started.one()
    return out


def run(stack: Stack, load: list[dict], kill=None, at: int = 6) -> list[dict]:
    started = Started()
    with ThreadPoolExecutor(len(load)) as pool:
        futures = [pool.submit(read, stack.port, b, started, at) for b in load]
        if kill is not None:
            started.wait(len(load), timeout=120)
            kill()
        return [f.result() for f in futures]


def same(got: dict, want: dict, what: str) -> None:
    assert got["error"] is None and want["error"] is None, (what, got["error"], want["error"])
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], what
    assert got["choices"].keys() == want["choices"].keys(), what
    for i, w in want["choices"].items():
        g = got["choices"][i]
        assert (g["text"], g["calls"], g["finish"]) == (w["text"], w["calls"], w["finish"]), (what, i)
        assert [e["token"] for e in g["logprobs"]] == [e["token"] for e in w["logprobs"]], (what, i)
        assert [e["logprob"] for e in g["logprobs"]] == pytest.approx(
            [e["logprob"] for e in w["logprobs"]], abs=TOL
        )
        tops = [[t["logprob"] for t in e["top_logprobs"]] for e in g["logprobs"]]
        assert tops == [
            pytest.approx([t["logprob"] for t in e["top_logprobs"]], abs=TOL) for e in w["logprobs"]
        ]


def late_piece(text: str) -> str:
    """A short piece of ``text`` that first occurs in its last third."""
    for size in range(3, 12):
        for k in range(len(text) * 2 // 3, len(text) - size + 1):
            if text.find(text[k : k + size]) == k:
                return text[k : k + size]
    raise AssertionError(f"no piece of {text!r} first occurs in its last third")


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = Stack(tiny_model, encoders=1, llms=3)
    yield s
    s.stop()


_killed: set[str] = set()  # addresses of the LLM replicas lost so far


def kill_busiest(stack: Stack, backlog: int = 1, within: float = 10.0) -> list[int]:
    """SIGKILL the live LLM replica running the most requests, once one runs ``backlog`` or more
    (asked again until then, for up to ``within`` seconds); the live replicas' loads."""
    live = [a for a in stack.llms if a not in _killed]
    deadline = time.monotonic() + within
    load = llm_loads(live)
    while max(load) < backlog and time.monotonic() < deadline:
        load = llm_loads(live)
    address = live[load.index(max(load))]
    _killed.add(address)
    stack.procs[len(stack.encoders) + stack.llms.index(address)].send_signal(signal.SIGKILL)
    return load


def test_a_killed_llm_replica_moves_logprobs_choices_grammars_and_tool_calls_intact(stack):
    # A stop string the penalised answers reach late: a piece of the uninterrupted text from
    # near its end (its first occurrence there), so the stop lands after the kill.
    probe = run(stack, bodies("probe", "\x00never", copies=1))[2]["choices"][0]["text"]
    stop = late_piece(probe)
    want = run(stack, bodies("uninterrupted", stop))
    before = failover_counters(stack.url)
    load: list[int] = []

    def kill() -> None:
        load.extend(kill_busiest(stack))

    got = run(stack, bodies("killed", stop), kill)
    delta = failover_delta(stack.url, before)
    names = list(kinds(stop)) * 3
    print(f"\nLLM load at the kill {load}; {delta}; stop string {stop!r}")
    for what, g, w in zip(names, got, want, strict=True):
        same(g, w, what)
    assert load and delta["migrated"] > 0 and delta["exhausted"] == 0, delta
    # the stop string hit
    assert any(c["finish"] == "stop" for r in want[2::5] for c in r["choices"].values())
    assert all(c["finish"] == "tool_calls" for r in want[4::5] for c in r["choices"].values())
    for r in want[3::5]:
        assert r["choices"][0]["finish"] == "stop"
        assert len(json.loads(r["choices"][0]["text"])["notes"]) == 6


def test_requests_without_a_token_yet_are_sent_again_when_their_llm_replica_is_lost(stack):
    """The busiest replica is killed as the first streams get their first tokens, once one
    replica holds several requests: those on it that had none yet (their images still being
    encoded, or prefilling) start again on another replica, the others move mid-answer; the
    answers are the uninterrupted ones."""

    def load(salt: str) -> list[dict]:
        return stream_bodies(MODEL, salt, 6000, 24, 24, side=336)

    want, _ = run_all("127.0.0.1", stack.port, load("uninterrupted-retry"))
    before = failover_counters(stack.url)
    loads: list[int] = []
    # NOTE: the client's threads send their bodies over a while; the first stream can have its
    # first tokens before the rest reach a replica (a CI run killed one at loads [0, 0], and the
    # later requests all went around it): wait until a replica holds a backlog.
    got, window = run_all(
        "127.0.0.1", stack.port, load("killed-retry"), early=lambda: loads.extend(kill_busiest(stack, 4))
    )
    delta = failover_delta(stack.url, before)
    print(f"\nLLM load at the kill {loads}")
    check_unchanged("LLM replica killed at the first token", got, want, delta, window, 24)
    assert delta["retried"] > 0 and delta["exhausted"] == 0, delta
