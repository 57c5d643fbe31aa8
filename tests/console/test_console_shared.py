"""Two console processes on one ledger (two hosts behind a balancer) on every durable
backend: the accounts and sessions live in the ledger, so a login on one is a login on the
other, a role changed anywhere applies everywhere at the next request, and a logout ends
the session on both."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the console extra is not installed")

from starlette.testclient import TestClient

from crewai_idempotent import Approvals, ApprovalState, CacheBackend
from crewai_idempotent.console import Accounts, ConsoleSettings, create_app
from tests.support.console import PASSWORD, ask, csrf_of, login
from tests.support.stores import DURABLE_BACKENDS, BackendFactory


@pytest.fixture(params=DURABLE_BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_two_consoles_share_accounts_and_sessions(
    backend: CacheBackend, factory: BackendFactory
) -> None:
    Accounts(backend).add("alice", "approver", PASSWORD)
    rid = ask(backend, "inv-shared", {"invoice": "INV-1", "amount_cents": 90_000})
    one = TestClient(create_app(backend, ConsoleSettings()), base_url="http://127.0.0.1")
    other_store = factory()
    two = TestClient(create_app(other_store, ConsoleSettings()), base_url="http://127.0.0.1")
    try:
        assert login(one, "alice").status_code == 303
        two.cookies = one.cookies  # the balancer sends the next request to the other host
        page = two.get("/approvals")
        assert page.status_code == 200 and "alice · approver" in page.text
        Accounts(backend).set("alice", role="viewer")  # from the CLI, on a third machine
        assert "/approve" not in two.get("/approvals").text
        Accounts(backend).set("alice", role="approver")
        answer = two.post(f"/approvals/{rid}/approve", follow_redirects=False,
                          data={"csrf": csrf_of(two.get("/approvals").text), "round": "1",
                                "ttl": "1h"})  # fmt: skip
        assert answer.status_code == 303
        assert Approvals(backend).get(rid).state is ApprovalState.APPROVED
        one.post("/logout", data={"csrf": csrf_of(one.get("/approvals").text)})
        assert two.get("/approvals", follow_redirects=False).status_code == 303
    finally:
        one.close()
        two.close()
        other_store.close()
