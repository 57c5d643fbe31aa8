"""The stores every backend test runs on: which kinds there are, and how a test opens one.

A kind is a `store_<kind>` fixture (tests/conftest.py; a plugin such as
patches/conformance_core.py adds its own), so a test parametrized over `backend_kind`
asks for the store it needs and a server is started only when a test names it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from crewai_idempotent import CacheBackend, backend_from_url

# Backends that persist across processes; the in-memory one joins only in-process tests.
DURABLE_BACKENDS = ["sqlite", "sqlite-normal", "filelock", "postgres", "redis"]
ALL_BACKENDS = ["memory", *DURABLE_BACKENDS]
if os.environ.get("CONFORMANCE_BACKENDS"):  # patches/verify.sh: crewAI core's store alone
    ALL_BACKENDS = os.environ["CONFORMANCE_BACKENDS"].split(",")


class BackendFactory:
    """Opens (or re-opens) one store. `url` reopens the same store in another process."""

    def __init__(self, url: str, open_: Callable[[], CacheBackend] | None = None) -> None:
        self.url = url
        self._open = open_ or (lambda: backend_from_url(url))

    def __call__(self) -> CacheBackend:
        return self._open()

    def __repr__(self) -> str:
        return f"BackendFactory({self.url!r})"


def backend_factory(kind: str, request: pytest.FixtureRequest) -> BackendFactory:
    """The store of `kind` for this test: the `store_<kind>` fixture (a plugin such as
    patches/conformance_core.py can add kinds by defining one)."""
    return request.getfixturevalue(f"store_{kind.replace('-', '_')}")  # type: ignore[no-any-return]
