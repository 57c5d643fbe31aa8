"""IdempotencyKeyVerifier against a local server that implements the IETF draft's
Idempotency-Key semantics: the original response is the receipt; a conflicting reuse (422)
or a request in flight (409) is Unknown and never a new effect. Effects are counted at the
server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from crewai_idempotent import (
    Absent,
    Event,
    Found,
    InMemoryCacheBackend,
    Ledger,
    OutcomeUnknown,
    Owner,
    Record,
    Status,
    Unknown,
)
from crewai_idempotent.ledger._reconcile import ask
from crewai_idempotent.reconciliation import IdempotencyKeyVerifier, Sweeper
from tests.support.idempotent_http import IdempotentAPI


@pytest.fixture
def api() -> Iterator[IdempotentAPI]:
    server = IdempotentAPI()
    yield server
    server.close()


def _verifier(api: IdempotentAPI, **options: Any) -> IdempotencyKeyVerifier:
    options.setdefault("json", lambda key, args: {"amount": args["amount"], "to": args["to"]})
    return IdempotencyKeyVerifier("POST", f"{api.url}/transfers", **options)


def _claimed(key: str, seconds_ago: float = 5.0) -> Record:
    at = time.time() - seconds_ago
    owner = Owner("h", 1, "x")
    return Record(
        key, Status.UNCERTAIN, "fp", 1, 2, owner, 1, at, at,
        history=(Event(at, "claim", 1, owner.label),),
    )  # fmt: skip


def _ask(verifier: Any, key: str, args: Any, seconds_ago: float = 5.0) -> Any:
    return ask(verifier, key, args, None, None, _claimed(key, seconds_ago))


def _send(api: IdempotentAPI, key: str, body: dict[str, Any]) -> httpx.Response:
    """What the tool sends."""
    return httpx.post(f"{api.url}/transfers", json=body, headers={"Idempotency-Key": key})


ARGS = {"amount": 40, "to": "acct_9"}


def test_a_tool_that_lost_its_answer_is_committed_with_the_original_response(
    api: IdempotentAPI,
) -> None:
    ledger = Ledger(InMemoryCacheBackend(), wait_s=0)
    verifier = _verifier(api)

    def transfer() -> Any:
        _send(api, "transfer:1", ARGS)  # the effect happens ...
        raise OutcomeUnknown("the connection dropped before the answer")  # ... the answer is lost

    with contextlib.suppress(OutcomeUnknown):
        ledger.run("transfer:1", transfer, reconcile=verifier, args=ARGS)
    report = Sweeper(ledger, reconcilers={"transfer": verifier}, channels=[]).sweep()
    assert [r.outcome for r in report.results] == ["found"]
    record = ledger.get("transfer:1")
    assert record is not None and record.status is Status.COMMITTED
    assert record.value() == api.transfers[0]  # the server's own first answer
    assert len(api.transfers) == 1
    again = ledger.run("transfer:1", lambda: _send(api, "transfer:1", ARGS).json())
    assert again == api.transfers[0] and len(api.requests) == 2  # the tool's, the verifier's


def test_a_conflicting_reuse_is_unknown_and_does_nothing(api: IdempotentAPI) -> None:
    _send(api, "transfer:2", ARGS)
    verdict = _ask(_verifier(api), "transfer:2", {**ARGS, "amount": 41})
    assert isinstance(verdict, Unknown) and verdict.reason.startswith("422: the server holds")
    assert len(api.transfers) == 1


def test_a_request_in_flight_is_unknown(api: IdempotentAPI) -> None:
    api.hold()
    first = threading.Thread(target=_send, args=(api, "transfer:3", ARGS))
    first.start()
    assert api.holding.wait(30)
    verdict = _ask(_verifier(api), "transfer:3", ARGS)
    api.release()
    first.join(30)
    assert isinstance(verdict, Unknown) and verdict.reason.startswith("409 Conflict")
    assert len(api.transfers) == 1


def test_a_request_that_never_arrived_is_made_once(api: IdempotentAPI) -> None:
    verdict = _ask(_verifier(api), "transfer:4", ARGS)
    assert isinstance(verdict, Found) and verdict.result == api.transfers[0]
    assert _ask(_verifier(api), "transfer:4", ARGS) == verdict
    assert len(api.transfers) == 1


def test_a_saved_error_is_unknown_unless_it_proves_absence(api: IdempotentAPI) -> None:
    api.fail_next(500)
    assert _send(api, "transfer:5", ARGS).status_code == 500
    verdict = _ask(_verifier(api), "transfer:5", ARGS)
    assert isinstance(verdict, Unknown) and verdict.reason.startswith("500 Internal Server Error")
    api.fail_next(410)
    _send(api, "transfer:6", ARGS)
    assert isinstance(_ask(_verifier(api), "transfer:6", ARGS), Unknown)
    assert _ask(_verifier(api, absent_on=[410]), "transfer:6", ARGS) == Absent()
    assert api.transfers == []


def test_past_the_key_retention_nothing_is_sent(api: IdempotentAPI) -> None:
    verdict = _ask(_verifier(api, max_age_s=3600), "transfer:7", ARGS, seconds_ago=7200)
    assert (
        isinstance(verdict, Unknown) and "older than the server's key retention" in verdict.reason
    )
    assert api.requests == []


def test_no_server_is_unknown(api: IdempotentAPI) -> None:
    verifier = IdempotencyKeyVerifier(
        "POST", "http://127.0.0.1:9/transfers", json=lambda k, a: a, timeout_s=2
    )
    verdict = _ask(verifier, "transfer:8", ARGS)
    assert isinstance(verdict, Unknown) and "ConnectError" in verdict.reason


def test_the_request_is_built_from_the_recorded_call(api: IdempotentAPI) -> None:
    verifier = IdempotencyKeyVerifier(
        "post",
        "https://pay.example/orders/{order}/charge?key={key}",
        content=lambda key, args: f"amount={args['amount']}",
        headers={"Authorization": "Bearer t"},
        structured=True,
    )
    request = verifier.request('charge:o"1', {"order": "o1", "amount": 5})
    assert request.method == "POST"
    assert str(request.url) == "https://pay.example/orders/o1/charge?key=charge:o%221"
    assert request.headers["Idempotency-Key"] == '"charge:o\\"1"'
    assert request.headers["Authorization"] == "Bearer t" and request.content == b"amount=5"
    missing = _ask(verifier, "charge:o1", {"amount": 5})  # no "order" in what was recorded
    assert isinstance(missing, Unknown) and "cannot build the request" in missing.reason


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(TypeError, match="json= or content=, not both"):
        IdempotencyKeyVerifier("POST", "http://x", json=lambda k, a: a, content=lambda k, a: "")
    with pytest.raises(ValueError, match="must be an HTTP method"):
        IdempotencyKeyVerifier(" ", "http://x")
