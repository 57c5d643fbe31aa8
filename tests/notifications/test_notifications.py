"""Delivering the outbox: signed webhooks verified by the library's own verifier, a
receiver that is down and comes back, backoff, claims, the channels' settings.

In process, against a local receiver on loopback (tests/support/notify.py); the
dispatcher killed mid-delivery and dispatchers in two processes (and on two "hosts") are
in test_notify_processes.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    CacheBackend,
    InMemoryCacheBackend,
    Ledger,
    LedgerConfigurationError,
    OutcomeUnknown,
    Record,
)
from crewai_idempotent._errors import ApprovalRequired
from crewai_idempotent.gates._approvals import Approvals
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Where
from crewai_idempotent.notifications import (
    Dispatcher,
    Outbox,
    alert,
    channel_from_url,
)
from tests.support.clock import ClockedBackend, ManualClock
from tests.support.notify import SECRET, Receiver
from tests.support.stores import DURABLE_BACKENDS


@pytest.fixture(params=["memory", *DURABLE_BACKENDS])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def receiver() -> Any:
    r = Receiver().start()
    yield r
    r.stop()


def _unknown() -> Any:
    raise OutcomeUnknown("the gateway timed out")


def _ask(ledger: Ledger, key: str, **summary: Any) -> str:
    plan = Plan(
        tool="pay_invoice", fingerprint=f"fp-{key}", approval=True, approval_reason="big",
        summary=summary or {"invoice": key}, where=Where(kickoff="k1", crew="c1", task="t1"),
    )  # fmt: skip
    with pytest.raises(ApprovalRequired) as asked:
        ledger.run(key, lambda: "paid", fingerprint=plan.fingerprint, stage=plan)
    return asked.value.request_id


def test_every_entry_is_delivered_signed_once(backend: CacheBackend, receiver: Receiver) -> None:
    ledger = Ledger(backend)
    memo = "x" * 1_000_000
    rid = _ask(ledger, "inv-1", invoice="INV-1", memo=memo)
    with pytest.raises(OutcomeUnknown):
        ledger.run("charge:1", _unknown)
    dispatcher = Dispatcher(backend, [receiver.webhook()])
    done = dispatcher.run_once()
    assert (done.confirmed, done.sent, done.delivered, done.failed) == (2, 2, 2, 0)
    got = receiver.received
    assert [r["verified"] for r in got] == [True, True], [r["error"] for r in got]
    by_type = {r["json"]["type"]: r for r in got}
    asked = by_type["approval.requested"]["json"]
    assert asked["data"]["id"] == rid and asked["data"]["summary"]["memo"] == memo  # whole
    assert asked["commands"]["approve"].endswith(f"approvals approve {rid}")
    assert by_type["record.uncertain"]["json"]["subject"] == "charge:1"
    ids = {e.id for e in Outbox(backend).entries()}
    assert {r["id"] for r in got} == ids  # the delivery id is the entry's id
    assert dispatcher.run_once().sent == 0  # delivered: nothing is sent again
    assert all(e.state == "delivered" for e in Outbox(backend).entries())
    (channel,) = Outbox(backend).entries()[0].deliveries
    assert channel.state == "delivered" and channel.attempts == 1


def test_a_forged_or_stale_signature_is_refused_by_the_verifier(receiver: Receiver) -> None:
    from standardwebhooks import Webhook, WebhookVerificationError

    backend = InMemoryCacheBackend()
    alert(backend, "alert.test", "hello")
    Dispatcher(backend, [receiver.webhook()]).run_once()
    (got,) = receiver.received
    assert got["verified"] is True
    tampered = got["body"].replace(b"hello", b"HELLO")
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(tampered, got["headers"])
    old = {**got["headers"], "webhook-timestamp": str(int(got["at"]) - 600)}
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(got["body"], old)


def test_a_receiver_that_is_down_gets_exactly_what_was_due_once_it_is_back(
    backend: CacheBackend, receiver: Receiver
) -> None:
    clock = ManualClock()
    clocked = ClockedBackend(backend, clock)
    ledger = Ledger(clocked, clock=clock)
    receiver.stop()  # down: the port refuses
    rid = _ask(ledger, "inv-2")
    for n in range(3):
        with pytest.raises(OutcomeUnknown):
            ledger.run(f"charge:{n}", _unknown)
    # A write that lost its race leaves an entry that must never be delivered.
    from tests.notifications.test_outbox import _LosesTheNextWrite

    racing = _LosesTheNextWrite(
        clocked, f"crewai-idempotent/approval/{rid}",
        lambda store: Approvals(store).deny(rid, by="alice", reason="no"),
    )  # fmt: skip
    with pytest.raises(Exception, match="only a PENDING request"):
        Approvals(racing).approve(rid, by="bob")
    dispatcher = Dispatcher(clocked, [receiver.webhook()], backoff_s=1.0, clock=clock)
    for _ in range(4):  # every try fails; each failure is kept
        dispatcher.run_once()
        clock.advance(3600)
    entries = Outbox(backend).entries()
    assert [e.type for e in entries] == [
        "approval.requested", "record.uncertain", "record.uncertain", "record.uncertain",
        "approval.denied",
    ]  # fmt: skip
    for entry in entries:
        (delivery,) = entry.deliveries
        assert delivery.state == "pending" and delivery.attempts == 4
        assert "ConnectError" in (delivery.last_error or "")
        assert [t["ok"] for t in entry.log] == [False] * 4 and entry.tries == 4
    receiver.start()  # back, on the same port
    done = dispatcher.run_once()
    assert (done.sent, done.delivered) == (5, 5)
    assert sorted(receiver.ids()) == sorted(e.id for e in entries)  # none lost, no extra
    assert all(r["verified"] for r in receiver.received)
    dispatcher.run_once()
    assert len(receiver.received) == 5


def test_backoff_doubles_and_honours_retry_after(receiver: Receiver) -> None:
    clock = ManualClock()
    backend = ClockedBackend(InMemoryCacheBackend(), clock)
    receiver.status = 503
    entry = alert(backend, "alert.test", "slow down")
    dispatcher = Dispatcher(backend, [receiver.webhook()], backoff_s=10.0, clock=clock)
    waits = []
    for _ in range(4):
        dispatcher.run_once()
        (delivery,) = Outbox(backend).get(entry.id).deliveries  # type: ignore[union-attr]
        assert delivery.next_at is not None
        waits.append(delivery.next_at - backend.now())
        assert dispatcher.run_once().sent + dispatcher.last.failed == 0  # not due yet
        clock.advance(waits[-1] + 0.01)
    assert [round(w / 10) for w in waits] == [1, 2, 4, 8] or all(  # 0.75-1.0 jitter
        7.5 * 2**i <= w <= 10 * 2**i for i, w in enumerate(waits)
    ), waits
    receiver.headers = {"retry-after": "900"}
    dispatcher.run_once()
    (delivery,) = Outbox(backend).get(entry.id).deliveries  # type: ignore[union-attr]
    assert delivery.next_at is not None and delivery.next_at - backend.now() >= 899
    assert "HTTP 503" in (delivery.last_error or "")


def test_a_claimed_entry_is_left_alone_until_its_claim_lapses(receiver: Receiver) -> None:
    """A dispatcher frozen mid-delivery holds its claim; the others wait for it to lapse
    and then send again, with the same delivery id."""
    clock = ManualClock()
    backend = ClockedBackend(InMemoryCacheBackend(), clock)
    entry = alert(backend, "alert.test", "once")
    hold = receiver.hold = threading.Event()
    frozen = Dispatcher(backend, [receiver.webhook()], lease_s=30, clock=clock, name="frozen")
    first = threading.Thread(target=frozen.run_once, daemon=True)
    first.start()
    receiver.holding.acquire(timeout=30)  # the frozen one is inside its try
    other = Dispatcher(backend, [receiver.webhook()], lease_s=30, clock=clock, name="other")
    assert other.run_once().busy == 1 and len(receiver.received) == 1
    assert Outbox(backend).get(entry.id).claimed_by == "frozen"  # type: ignore[union-attr]
    clock.advance(31)  # its claim lapses
    receiver.hold = None
    assert other.run_once().sent == 1
    assert receiver.ids() == [entry.id, entry.id]  # the same delivery id: deduplicable
    hold.set()
    first.join(30)


def test_the_frozen_dispatcher_s_late_result_is_kept_not_lost(receiver: Receiver) -> None:
    clock = ManualClock()
    backend = ClockedBackend(InMemoryCacheBackend(), clock)
    entry = alert(backend, "alert.test", "late")
    hold = receiver.hold = threading.Event()
    frozen = Dispatcher(backend, [receiver.webhook()], lease_s=30, clock=clock, name="frozen")
    first = threading.Thread(target=frozen.run_once, daemon=True)
    first.start()
    receiver.holding.acquire(timeout=30)
    clock.advance(31)
    receiver.status = 500  # the one that takes over fails...
    receiver.hold = None
    other = Dispatcher(backend, [receiver.webhook()], lease_s=30, clock=clock, name="other")
    assert other.run_once().failed == 1
    receiver.status = 204
    hold.set()  # ...and the frozen one's try, answered late, delivered
    first.join(30)
    found = Outbox(backend).get(entry.id)
    assert found is not None and found.deliveries[0].state == "delivered"
    assert [t["by"] for t in found.log] == ["other", "frozen"]


def test_channels_take_the_types_they_want(backend: CacheBackend) -> None:
    approvals, everything = Receiver().start(), Receiver().start()
    try:
        ledger = Ledger(backend)
        _ask(ledger, "inv-3")
        with pytest.raises(OutcomeUnknown):
            ledger.run("charge:9", _unknown)
        channels = [approvals.webhook(types="approval.*", name="approvers"), everything.webhook()]
        Dispatcher(backend, channels).run_once()
        assert [r["json"]["type"] for r in approvals.received] == ["approval.requested"]
        assert len(everything.received) == 2
        assert {d.channel for e in Outbox(backend).entries() for d in e.deliveries} >= {"approvers"}
    finally:
        approvals.stop()
        everything.stop()


def test_a_granted_approval_that_runs_out_unused_is_said(receiver: Receiver) -> None:
    clock = ManualClock()
    backend = ClockedBackend(InMemoryCacheBackend(), clock)
    ledger = Ledger(backend, clock=clock)
    rid = _ask(ledger, "inv-4")
    Approvals(backend).approve(rid, by="ops", ttl_s=600)
    dispatcher = Dispatcher(backend, [receiver.webhook()], clock=clock)
    dispatcher.run_once()
    assert [r["json"]["type"] for r in receiver.received] == [
        "approval.requested", "approval.approved",
    ]  # fmt: skip
    clock.advance(601)
    dispatcher.run_once()  # the grant ended: the request says so, and that is delivered
    dispatcher.run_once()
    assert [r["json"]["type"] for r in receiver.received][-1] == "approval.expired"
    assert Approvals(backend).get(rid).history[-1]["what"] == "expired"


def test_delivered_entries_are_kept_then_pruned(receiver: Receiver) -> None:
    clock = ManualClock()
    backend = ClockedBackend(InMemoryCacheBackend(), clock)
    alert(backend, "alert.test", "old news")
    dispatcher = Dispatcher(backend, [receiver.webhook()], retain_s=86400, clock=clock)
    dispatcher.run_once()
    assert len(Outbox(backend).entries()) == 1
    clock.advance(86400 + 3601)
    dispatcher.run_once()
    assert Outbox(backend).entries() == []


def test_a_put_with_a_dedupe_after_its_delivery_is_not_sent_again(receiver: Receiver) -> None:
    backend = InMemoryCacheBackend()
    dispatcher = Dispatcher(backend, [receiver.webhook()])
    alert(backend, "alert.test", "once", dedupe="d")
    dispatcher.run_once()
    alert(backend, "alert.test", "once", dedupe="d")
    dispatcher.run_once()
    assert len(receiver.received) == 1


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://hooks.example.com/x", "CHANNEL+TARGET"),
        ("pager+https://x.example.com", "unknown notification channel 'pager'"),
        ("webhook+https://x.example.com/h", "exactly one of #secret_env"),
        ("webhook+https://x.example.com/h#secret_env=NOT_SET_ANYWHERE", "not set"),
        (
            "webhook+http://x.example.com/h#secret=whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0",
            "https://",
        ),
        (
            "webhook+https://x.example.com/h#secret=whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0&colour=red",
            "'colour'",
        ),
        ("webhook+https://x.example.com/h#secret=!!notbase64!!", "not a Standard Webhooks secret"),
        ("slack+ftp://hooks.slack.com/services/x", "https://"),
        ("slack+https://hooks.slack.com/services/x#buttons=maybe", "true or false"),
        ("slack+https://hooks.slack.com/services/x#timeout_s=-1", "more than 0"),
        ("apprise+nosuchservice://x", "apprise does not take this URL"),
    ],
)
def test_a_channel_that_cannot_work_is_refused_where_it_is_named(url: str, says: str) -> None:
    with pytest.raises(LedgerConfigurationError, match=None) as refused:
        channel_from_url(url)
    assert says in str(refused.value)
    assert "c2VjcmV0" not in str(refused.value)  # the secret is never repeated
    assert "services/x" not in str(refused.value)  # nor a Slack webhook's path


def test_a_channel_shows_no_secret(tmp_path: Path) -> None:
    hook = channel_from_url(
        "webhook+https://u:pw@x.example.com/h?token=t#secret=whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0"
    )
    slack = channel_from_url("slack+https://hooks.slack.com/services/T1/B2/SECRET")
    assert hook.url == "webhook+https://x.example.com/…" and "pw" not in repr(hook)
    assert slack.url == "slack+https://hooks.slack.com/…" and "SECRET" not in repr(slack)
    assert hook.name.startswith("webhook-") and slack.name.startswith("slack-")
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert channel_from_url(f"webhook+https://x.example.com/h#secret_file={path}")


def test_a_dispatcher_without_channels_or_with_a_short_lease_is_refused() -> None:
    backend = InMemoryCacheBackend()
    with pytest.raises(ValueError, match="at least one channel"):
        Dispatcher(backend, [])
    hook = (
        "webhook+https://x.example.com/h#secret=whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0&timeout_s=20"
    )
    with pytest.raises(ValueError, match="lease_s=10"):
        Dispatcher(backend, [hook], lease_s=10)


def test_one_setting_may_hold_several_channels() -> None:
    from crewai_idempotent.notifications import channels_from

    hook = "webhook+https://x.example.com/h#secret=whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0&types=approval.*,record.*"
    found = channels_from(f"{hook}, slack+https://hooks.slack.com/services/x apprise+json://h")
    assert [c.scheme for c in found] == ["webhook", "slack", "apprise"]
    assert found[0].types == ("approval.*", "record.*")  # the comma inside it stays
    with pytest.raises(LedgerConfigurationError, match="named alike"):
        channels_from([hook, hook])


def test_doctor_says_what_waits_for_delivery(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from crewai_idempotent import SQLiteCacheBackend
    from crewai_idempotent.cli import main

    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    backend.get("k")  # the ledger's table is made with its first use
    url = f"sqlite:///{path}"
    quiet = CliRunner().invoke(main, ["--ledger", url, "doctor"])
    assert "outbox       nothing waits for delivery" in quiet.output
    alert(backend, "alert.test", "hello")
    told = CliRunner().invoke(main, ["--ledger", url, "doctor"])
    assert "1 notification(s) not yet delivered" in told.output and "notify --watch" in told.output


def test_an_entry_caught_between_its_two_copies_is_listed_once(
    backend: CacheBackend, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delivered everywhere, an entry is copied to the delivered ones and then deleted from
    the outbox: a reader between the two writes (or after a dispatcher died between them)
    sees it under both prefixes. It is one entry, delivered."""
    from crewai_idempotent import LedgerUnavailable

    entry = alert(backend, "alert.test", "between the copies")
    delete = backend.delete

    def outage(record: Record) -> bool:
        raise LedgerUnavailable("the ledger went away between the copy and the delete")

    monkeypatch.setattr(backend, "delete", outage)
    with pytest.raises(LedgerUnavailable):
        Dispatcher(backend, [receiver.webhook()]).run_once()
    monkeypatch.setattr(backend, "delete", delete)
    (listed,) = Outbox(backend).entries()
    assert listed.id == entry.id and listed.state == "delivered"
    assert len(receiver.received) == 1
    # The next pass finds it delivered and drops the outbox copy, sending nothing again.
    Dispatcher(backend, [receiver.webhook()]).run_once()
    assert [e.id for e in Outbox(backend).entries()] == [entry.id]
    assert len(receiver.received) == 1
