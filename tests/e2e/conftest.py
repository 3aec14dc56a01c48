"""Servers and clients that many end-to-end modules use (module scope: each module starts its own)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e.server import serving


@pytest.fixture(scope="module")
def server(tiny_model):
    """The default tiny model served with the default flags (a module may override it)."""
    with serving(tiny_model) as srv:
        yield srv


@pytest.fixture(scope="module")
def baseline(tiny_model):
    """The same model with --no-cache: the answers no cache tier may change."""
    with serving(tiny_model, "--no-cache") as srv:
        yield srv


@pytest.fixture(scope="module")
def pressured(request, tiny_model):
    """The model served under memory pressure, with the flags the module names in ``PRESSURE``."""
    with serving(tiny_model, *request.module.PRESSURE) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    """The official ``openai`` client of the module's ``server``."""
    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c
