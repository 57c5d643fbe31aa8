"""What a person reads of the outbox agrees with itself, and a channel that cannot work
is refused where it is named, saying what is wrong (issue 32: "the people's side").

- one definition of "not yet delivered", counted alike by `notify`, `notifications ls
  --state pending`, `doctor` and `Pass.pending`;
- "waiting", never "unconfirmed", where a person reads it; the stored word stays the one
  the previous release reads;
- `notify`'s lines name the channel whose try they are about;
- a webhook secret is taken as given (`+` included) or refused, never signed with changed;
- a Retry-After longer than `backoff_max_s` is honoured, up to a bound of its own;
- Slack shows every argument of a call of 60, long values collapsed.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from crewai_idempotent import (
    InMemoryCacheBackend,
    Ledger,
    LedgerConfigurationError,
    SQLiteCacheBackend,
)
from crewai_idempotent.cli import main
from crewai_idempotent.gates._approvals import Approvals
from crewai_idempotent.ledger._results import encode
from crewai_idempotent.notifications import (
    Channel,
    Dispatcher,
    Message,
    Outbox,
    alert,
    channel_from_url,
)
from crewai_idempotent.notifications._outbox import OUTBOX, Note, doc_of, of_document
from crewai_idempotent.notifications._slack import payload
from tests.notifications.test_notifications import _ask
from tests.notifications.test_notify_channels import _approval_message, _check_limits
from tests.support.clock import ClockedBackend, ManualClock
from tests.support.notify import SECRET, Receiver

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def _cli(url: str, *args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, ["--ledger", url, *args], env=env)


def _waiting_entry(backend: Any, key: str = "crewai-idempotent/approval/ap_never") -> str:
    """An entry written before a document's change that has not happened (yet): stored
    as the previous release writes it, `"state": "unconfirmed"`."""
    (entry,) = of_document(key, None, [Note("alert.test", {"title": "later"})], backend.now())
    backend.insert(entry)
    return entry.key[len(OUTBOX) :]


# -- one definition of "not yet delivered" -----------------------------------------------


def test_notify_ls_and_doctor_count_the_same_undelivered_entries(
    tmp_path: Path, receiver: Receiver
) -> None:
    """An approval delivered everywhere but kept in the outbox until its grant ends is
    delivered; an entry waiting for its transition is waiting; only a due one is "not yet
    delivered", and every count says so."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    url = f"sqlite:///{path}"
    rid = _ask(Ledger(backend), "inv-1")
    Approvals(backend).approve(rid, by="ops", ttl_s=3600)  # its grant ends in an hour
    hook = receiver.webhook()
    first = _cli(url, "notify", "--channel", hook)
    assert first.exit_code == 0, first.output
    assert "2 delivered, 0 failed, 0 not yet delivered" in first.output
    _waiting_entry(backend)
    receiver.status = 503
    alert(backend, "alert.test", "the one not yet delivered")
    second = _cli(url, "notify", "--channel", hook)
    assert "0 delivered, 1 failed, 1 not yet delivered, 1 waiting" in second.output
    pending = _cli(url, "notifications", "ls", "--state", "pending", "--json")
    assert [e["type"] for e in json.loads(pending.output)] == ["alert.test"]
    doctor = _cli(url, "doctor")
    assert "1 notification(s) not yet delivered" in doctor.output, doctor.output
    assert "1 failing" in doctor.output
    assert [e.type for e in Outbox(backend).undelivered()] == ["alert.test"]
    done = Dispatcher(backend, [hook]).run_once()
    assert (done.pending, done.waiting) == (1, 1)


# -- "waiting", read in both forms -------------------------------------------------------


def test_a_waiting_entry_is_waiting_where_a_person_reads_it_and_stored_as_before(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    url = f"sqlite:///{path}"
    entry_id = _waiting_entry(backend)
    stored = doc_of(backend.get(OUTBOX + entry_id))  # type: ignore[arg-type]
    assert stored["state"] == "unconfirmed"  # what workers of the previous release read
    (entry,) = Outbox(backend).entries(waiting=True)
    assert entry.state == "waiting" and not entry.undelivered
    listed = _cli(url, "notifications", "ls", "--state", "waiting", "--json")
    assert [(e["id"], e["state"]) for e in json.loads(listed.output)] == [(entry_id, "waiting")]
    shown = _cli(url, "notifications", "show", entry_id)
    assert f"{entry_id}  alert.test  waiting" in shown.output
    assert "unconfirmed" not in listed.output + shown.output


def test_a_stored_waiting_entry_is_read_as_waiting_too() -> None:
    """A document whose stored state says "waiting" (the word a later release may write)
    waits the same way: void once its source moved on, never delivered as if confirmed."""
    backend = InMemoryCacheBackend()
    key = "pay:moved"
    entry_id = _waiting_entry(backend, key)
    record = backend.get(OUTBOX + entry_id)
    assert record is not None
    doc = {**doc_of(record), "state": "waiting"}
    assert backend.replace(record, record.evolve(None, result=encode(doc)))
    (entry,) = Outbox(backend).entries(waiting=True)
    assert entry.state == "waiting"
    alert(backend, "alert.other", "the source moves on")  # not the mark it waits for
    source = Ledger(backend)
    source.run(key, lambda: "something else wrote it")  # the write it waited for lost
    sent: list[str] = []
    done = Dispatcher(backend, [_Counting(sent)]).run_once()
    assert done.voided == 1 and sent == ["alert.other"]
    assert Outbox(backend).get(entry_id) is None


class _Counting(Channel):
    """A channel that delivers every entry and keeps their types in `sent`."""

    scheme = "counting"

    def __init__(self, sent: list[str]) -> None:
        super().__init__("here", {"name": "counting"})
        self.sent = sent

    def send(self, message: Message) -> None:
        self.sent.append(message.type)


# -- the docs' payload -------------------------------------------------------------------


def test_the_documented_webhook_body_is_the_shape_an_approval_s_body_has() -> None:
    text = (ROOT / "docs" / "notifications.md").read_text(encoding="utf-8")
    documented = json.loads(re.search(r"and this body.*?```json\n(.*?)```", text, re.S)[1])  # type: ignore[index]
    message = _approval_message(invoice="INV-3")
    real = message.body()
    assert set(documented) == set(real)
    assert real["subject"].startswith("crewai-idempotent/approval/ap_")
    assert documented["subject"] == f"crewai-idempotent/approval/{documented['data']['id']}"
    assert documented["type"] == real["type"] == "approval.requested"


# -- notify's lines ----------------------------------------------------------------------


def test_notify_prints_each_failed_try_under_the_channel_that_failed(
    tmp_path: Path, receiver: Receiver
) -> None:
    slack = Receiver(secret=None).start()
    try:
        path = tmp_path / "ledger.db"
        backend = SQLiteCacheBackend(path)
        url = f"sqlite:///{path}"
        alert(backend, "alert.test", "to both")
        receiver.status = 503
        hook = receiver.webhook(name="the-hook")
        chat = f"slack+http://127.0.0.1:{slack.port}/services/T/B/X#name=the-slack"
        ran = _cli(url, "notify", "--channel", hook, "--channel", chat)
        lines = ran.output.splitlines()
        (failed,) = [line for line in lines if line.startswith("failed ")]
        assert " to the-hook (try 1): HTTP 503" in failed, ran.output
        (sent,) = [line for line in lines if line.startswith("sent ")]
        assert " to the-slack: " in sent
        assert "): None" not in ran.output
    finally:
        slack.stop()


def test_the_listener_hears_each_try_with_that_try_last_in_the_log(receiver: Receiver) -> None:
    backend = InMemoryCacheBackend()
    alert(backend, "alert.test", "to both")
    receiver.status = 503
    heard: list[tuple[str, str, bool]] = []

    def listen(event: str, entry: Any) -> None:
        if event in ("sent", "failed"):
            heard.append((event, entry.log[-1]["channel"], entry.log[-1]["ok"]))

    sent: list[str] = []
    Dispatcher(
        backend, [receiver.webhook(name="hook"), _Counting(sent)], listener=listen
    ).run_once()
    assert heard == [("failed", "hook", False), ("sent", "counting", True)]


# -- a webhook's secret and URL ----------------------------------------------------------


def test_a_secret_with_a_plus_signs_with_that_secret(tmp_path: Path) -> None:
    key = b"\xfb\xef\xbe" * 8  # base64: "++++" eight times
    secret = "whsec_" + base64.b64encode(key).decode()
    assert "+" in secret
    target = Receiver(secret=secret).start()
    try:
        backend = InMemoryCacheBackend()
        alert(backend, "alert.test", "signed")
        hook = f"webhook+{target.url}#secret={secret}"
        assert Dispatcher(backend, [hook]).run_once().sent == 1
        (got,) = target.received
        assert got["verified"] is True, got["error"]
    finally:
        target.stop()


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ("secret=hunter2", "not a Standard Webhooks secret"),
        ("secret=whsec_c2VjcmV0", "24 to 64 bytes, base64 encoded; this one is 6"),
        ("secret_env=", "secret_env= names no variable"),
        ("secret_file=", "secret_file= names no file"),
    ],
)
def test_a_secret_the_format_does_not_allow_is_refused(options: str, says: str) -> None:
    with pytest.raises(LedgerConfigurationError) as refused:
        channel_from_url(f"webhook+https://hooks.example.com/h#{options}")
    assert says in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_the_hint_to_make_a_secret_runs_as_pasted_and_makes_one_that_is_taken() -> None:
    import shlex
    import subprocess
    import sys

    with pytest.raises(LedgerConfigurationError) as refused:
        channel_from_url("webhook+https://hooks.example.com/h#secret=hunter2")
    hint = str(refused.value).split("make one with: ", 1)[1]
    argv = shlex.split(hint)
    assert argv[0] == "python"
    made = subprocess.run(
        [sys.executable, *argv[1:]], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    assert channel_from_url(f"webhook+https://hooks.example.com/h#secret={made}")


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("http://127.0.0.1:notaport/hook", "has the port 'notaport': a port is a number"),
        ("http://127.0.0.1:99999/hook", "has the port '99999'"),
        ("https:///hook", "names no host"),
        ("ftp://hooks.example.com/hook", "posts to an https:// URL"),
    ],
)
def test_a_webhook_url_that_cannot_work_says_what_is_wrong(target: str, says: str) -> None:
    url = f"webhook+{target}#secret={SECRET}"
    with pytest.raises(LedgerConfigurationError) as refused:
        channel_from_url(url)
    assert says in str(refused.value)
    ran = CliRunner().invoke(main, ["--ledger", "memory://", "notify", "--channel", url])
    assert ran.exit_code == 2 and says in ran.output, ran.output
    assert ran.exception is None or isinstance(ran.exception, SystemExit)


def test_a_bad_channel_in_the_environment_is_reported_as_the_variable_s() -> None:
    env = {"CREWAI_IDEMPOTENCY_NOTIFY": "webhook+https://hooks.example.com/h#secret=hunter2"}
    ran = CliRunner().invoke(main, ["--ledger", "memory://", "notify"], env=env)
    assert ran.exit_code == 2
    assert "Invalid value for --channel" not in ran.output
    assert "$CREWAI_IDEMPOTENCY_NOTIFY names a channel that cannot work" in ran.output
    assert "not a Standard Webhooks secret" in ran.output


# -- Retry-After -------------------------------------------------------------------------


def test_retry_after_longer_than_the_longest_backoff_is_honoured(receiver: Receiver) -> None:
    clock = ManualClock()
    backend = ClockedBackend(InMemoryCacheBackend(), clock)
    entry = alert(backend, "alert.test", "come back in an hour")
    receiver.status = 503
    receiver.headers = {"retry-after": "3600"}
    dispatcher = Dispatcher(
        backend, [receiver.webhook()], backoff_s=1.0, backoff_max_s=60.0, clock=clock
    )
    dispatcher.run_once()
    (delivery,) = Outbox(backend).get(entry.id).deliveries  # type: ignore[union-attr]
    assert delivery.next_at is not None and delivery.next_at - backend.now() >= 3599
    clock.advance(600)  # past backoff_max_s, well before the receiver asked
    assert dispatcher.run_once().failed == 0 and len(receiver.received) == 1
    clock.advance(3000 + 1)
    receiver.status = 204
    assert dispatcher.run_once().sent == 1 and len(receiver.received) == 2


def test_retry_after_has_an_upper_bound_of_its_own(receiver: Receiver) -> None:
    from crewai_idempotent.notifications._dispatch import RETRY_AFTER_MAX_S

    clock = ManualClock()
    backend = ClockedBackend(InMemoryCacheBackend(), clock)
    entry = alert(backend, "alert.test", "come back in a year")
    receiver.status = 503
    receiver.headers = {"retry-after": str(365 * 86400)}
    dispatcher = Dispatcher(backend, [receiver.webhook()], clock=clock)
    dispatcher.run_once()
    (delivery,) = Outbox(backend).get(entry.id).deliveries  # type: ignore[union-attr]
    assert delivery.next_at is not None
    assert delivery.next_at - backend.now() == pytest.approx(RETRY_AFTER_MAX_S)
    short = Dispatcher(
        backend, [receiver.webhook()], retry_after_max_s=7200.0, clock=clock, name="short"
    )
    clock.advance(RETRY_AFTER_MAX_S + 1)
    short.run_once()
    (delivery,) = Outbox(backend).get(entry.id).deliveries  # type: ignore[union-attr]
    assert delivery.next_at - backend.now() == pytest.approx(7200.0)  # type: ignore[operator]


# -- Slack shows every argument ----------------------------------------------------------


def test_slack_shows_all_sixty_arguments_with_long_values_collapsed() -> None:
    summary = {f"argument_{i:02}": f"value {i} " + "v" * 5000 for i in range(60)}
    body = payload(_approval_message(**summary))
    _check_limits(body)
    raw = json.dumps(body)
    for name in summary:
        assert f"{name} = value {int(name[-2:])} v" in raw, name
    assert "more argument" not in raw
    assert "5,008 characters in all" in raw  # collapsed, saying how long it was


def test_slack_counts_the_arguments_of_a_call_too_big_for_one_message() -> None:
    summary = {f"argument_{i:04}": "v" * 100 for i in range(2000)}
    body = payload(_approval_message(**summary))
    _check_limits(body)
    raw = json.dumps(body, ensure_ascii=False)
    shown = sum(f"argument_{i:04} = " in raw for i in range(2000))
    assert 300 < shown < 2000
    assert f"… and {2000 - shown} more argument(s), not shown" in raw
