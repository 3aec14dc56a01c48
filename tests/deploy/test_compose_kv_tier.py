"""The shared KV tier under compose: ``docker compose up --scale llm=2`` with the ``kvstore``
service (the image's redis-server), every LLM replica on it through ``MMCACHE_KV_STORE``.

Turn 1 of a conversation (a system prompt, an image and a question) is served by one LLM replica,
found from the replicas' step counters, which writes its blocks to the store; that replica is
``docker kill``ed, so turn 2 lands on the other one, which never saw the conversation. Its
``cached_tokens`` cover turn 1's full blocks, its counters show them read from the store and
loaded, the processor did not encode the image again, and the answer equals turn 2 computed from
scratch on the same replica (another ``cache_salt``: no block shared).

The contrast: the LLM service recreated with ``MMCACHE_KV_STORE=`` (the tier off), the same
conversation the same way gets ``cached_tokens == 0`` on the second replica, and the same answers.
"""

from __future__ import annotations

import time

import pytest

from tests.deploy.compose import Project, project
from tests.deploy.docker import STARTUP, get, healthy, post, replica_metrics, sh, up_replicas, wait_for
from tests.deploy.test_compose_failover import container_of
from tests.e2e.util import image_part
from tests.media import image_bytes

pytestmark = pytest.mark.deploy

BLOCK = 16  # the LLM stage's default block size
SETTLE = 60  # seconds for a replica's counters to show what it did, or a killed one to drop out
PICTURE = image_bytes(224, 224, seed=21)


def body(model: str, messages: list[dict], salt: str | None = None) -> dict:
    out = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    if salt is not None:
        out["cache_salt"] = salt
    return out


def turn1() -> list[dict]:
    return [
        {"role": "system", "content": "You describe pictures in one short sentence."},
        {
            "role": "user",
            "content": [image_part(PICTURE), {"type": "text", "text": "What is in the picture?"}],
        },
    ]


def turn2(answer: str) -> list[dict]:
    return [
        *turn1(),
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the colours?"},
    ]


def cached(out: dict) -> int:
    return (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def llm_counters(base: str, address: str) -> dict[str, float]:
    """One LLM replica's counters (as /health lists them, prefixed ``llm_``)."""
    return {k: v[address] for k, v in replica_metrics(base).items() if k.startswith("llm_") and address in v}


def settled_writes(base: str, address: str) -> dict[str, float]:
    """The replica's counters once its KV writer has caught up (nothing moved between two looks)."""
    seen: list[float] = []

    def done() -> dict[str, float] | None:
        c = llm_counters(base, address)
        seen.append(c["llm_kv_store_written_blocks"] + c["llm_kv_store_dropped_blocks"])
        return c if len(seen) >= 2 and seen[-1] == seen[-2] and seen[-1] > 0 else None

    return wait_for(f"{address}'s KV writer settled", done, SETTLE, every=0.5)


def two_llms(base: str, store: int) -> dict[str, float]:
    """Wait for 2 LLM replicas up, with the KV tier on (``store=1``) or off (0); their steps."""

    def ready() -> dict[str, float] | None:
        m = replica_metrics(base)
        up = up_replicas(base, "llm")
        enabled = m.get("llm_kv_store_enabled", {})
        if len(up) == 2 and set(enabled) == up and set(enabled.values()) == {store}:
            return {a: m["llm_steps"][a] for a in up}
        return None

    return wait_for(f"2 LLM replicas up, KV store enabled={store}", ready, STARTUP)


def across_replicas(p: Project, model: str, store: int) -> dict:
    """Turn 1 on one LLM replica, that replica killed, turn 2 (and turn 2 under another salt) on
    the other; what each request got and the survivor's counters around turn 2."""
    steps = two_llms(p.base, store)
    first = post(p.base + "/v1/chat/completions", body(model, turn1()))

    def moved() -> list[str]:
        now = replica_metrics(p.base)["llm_steps"]
        return [a for a, v in now.items() if v > steps.get(a, v)]

    served = wait_for("the LLM replica that served turn 1", moved, SETTLE, every=0.5)
    assert len(served) == 1, served
    (a,) = served
    written = settled_writes(p.base, a)["llm_kv_store_written_blocks"] if store else 0
    victim = container_of(p, "llm", a)
    sh("docker", "kill", victim)
    others = wait_for(
        "the other LLM replica alone",
        lambda: (up := up_replicas(p.base, "llm")) and a not in up and up,
        SETTLE,
    )
    (b,) = others
    assert steps[b] == llm_counters(p.base, b)["llm_steps"]  # b has not worked on this conversation
    before = llm_counters(p.base, b)
    answer = first["choices"][0]["message"]["content"]
    started = time.monotonic()
    second = post(p.base + "/v1/chat/completions", body(model, turn2(answer)))
    took = time.monotonic() - started
    after = llm_counters(p.base, b)
    scratch = post(p.base + "/v1/chat/completions", body(model, turn2(answer), salt=f"scratch-{store}"))
    state = sh("docker", "inspect", "-f", "{{.State.Status}}", victim).strip()
    assert state == "exited", state  # really gone (not restarted): turn 2 had only b
    delta = {k: after[k] - before[k] for k in after if isinstance(before.get(k), float)}
    return {
        "first": first,
        "second": second,
        "scratch": scratch,
        "written": written,
        "delta": delta,
        "took": took,
        "served": (a, b),
    }


def test_compose_next_turn_on_another_llm_replica_hits_the_shared_store(image, monkeypatch):
    with project(image) as p:
        p.compose("up", "-d", "--no-build", "--scale", "llm=2")
        wait_for("the compose stack", lambda: healthy(p.base), STARTUP)
        model = get(p.base + "/v1/models")[1]["data"][0]["id"]

        on = across_replicas(p, model, store=1)
        first, second, scratch, delta = on["first"], on["second"], on["scratch"], on["delta"]
        full = (len(first["prompt_token_ids"]) - 1) // BLOCK  # turn 1's full blocks (the last token computed)
        print(
            f"\nstore on: turn 1 {len(first['prompt_token_ids'])} prompt tokens on {on['served'][0]} "
            f"({on['written']:.0f} blocks written); turn 2 {len(second['prompt_token_ids'])} prompt tokens "
            f"on {on['served'][1]} in {on['took']:.2f} s: cached_tokens {cached(second)}, "
            f"store hit blocks {delta['llm_kv_store_hit_blocks']:.0f}, "
            f"loaded {delta['llm_kv_store_loaded_blocks']:.0f}; from scratch: cached_tokens {cached(scratch)}"
        )
        assert full >= 2 and on["written"] >= full, (full, on["written"])
        assert second["prompt_token_ids"][: len(first["prompt_token_ids"])] == first["prompt_token_ids"]
        assert cached(second) >= full * BLOCK, (cached(second), full)  # turn 1 came from the store
        assert delta["llm_kv_store_hit_blocks"] >= full and delta["llm_kv_store_loaded_blocks"] >= full, delta
        assert second["usage"]["mm_cache"]["prefix_skipped"] >= 1  # its image was not encoded again
        assert cached(scratch) == 0  # another salt shares no block, local or stored
        assert second["choices"][0]["token_ids"] == scratch["choices"][0]["token_ids"]

        # The contrast: the LLM replicas recreated with the tier off, the same conversation.
        monkeypatch.setenv("MMCACHE_KV_STORE", "")  # compose.yaml: ${MMCACHE_KV_STORE-redis://...}
        p.compose("up", "-d", "--no-build", "--scale", "llm=2")
        off = across_replicas(p, model, store=0)
        print(
            f"store off: turn 2 on {off['served'][1]} in {off['took']:.2f} s: cached_tokens "
            f"{cached(off['second'])}, loaded {off['delta']['llm_kv_store_loaded_blocks']:.0f}"
        )
        assert cached(off["second"]) == 0
        assert off["delta"]["llm_kv_store_loaded_blocks"] == 0
        assert off["first"]["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert off["second"]["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
