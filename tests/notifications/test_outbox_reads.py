"""The outbox's readers ask the store for the outbox's few entries and a page of the
delivered ones, which grow with every notification: `notifications ls` lists the last
delivered first, a page at a time with a hint for the next that runs as pasted, and a
dispatcher prunes only the delivered entries moved before its cutoff. Seen through a `Spy`
over the store (every select and scan it is asked), never the wall clock."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent import (
    CacheBackend,
    Order,
    Record,
    Select,
    SQLiteCacheBackend,
    Status,
    backend_from_url,
)
from crewai_idempotent.cli import main
from crewai_idempotent.ledger._results import encode
from crewai_idempotent.notifications import Dispatcher, Outbox, _outbox
from crewai_idempotent.notifications._kinds import Channel
from crewai_idempotent.notifications._outbox import DELIVERED, DOCUMENT, OUTBOX
from tests.cli.spying import Spy, opened_as


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteCacheBackend]:
    backend = SQLiteCacheBackend(tmp_path / "ledger.db", synchronous="NORMAL")
    backend.get("-")  # the ledger's table, made
    yield backend
    backend.close()


@pytest.fixture
def url(store: SQLiteCacheBackend) -> str:
    return f"sqlite:///{store.path}"


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> list[Spy]:
    made: list[Spy] = []

    def make(url: str) -> CacheBackend:
        made.append(Spy(backend_from_url(url)))
        return made[-1]

    opened_as(monkeypatch, make)
    return made


def cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--ledger", url, *args])


def due(backend: CacheBackend, n: int) -> str:
    return _outbox.put(backend, "alert.test", {"title": f"due {n}"}, dedupe=f"due-{n}").id


def delivered(backend: CacheBackend, n: int, ago: float) -> str:
    """An entry a dispatcher delivered and moved out of the outbox `ago` seconds ago."""
    entry = _outbox.put(backend, "alert.test", {"title": f"sent {n}"}, dedupe=f"sent-{n}")
    held = backend.get(OUTBOX + entry.id)
    assert held is not None
    at = backend.now() - ago
    doc = _outbox.doc_of(held) | {
        "state": "delivered", "delivered_at": at,
        "deliveries": {"ops": {"state": "delivered", "attempts": 1, "delivered_at": at}},
    }  # fmt: skip
    moved = Record(DELIVERED + entry.id, Status.COMMITTED, DOCUMENT, 1, 1, None, 0, at, at,
                   result=encode(doc))  # fmt: skip
    assert backend.insert(moved) is None and backend.delete(held)
    return entry.id


def ids(output: str) -> list[str]:
    return re.findall(r"^(ob_[0-9a-f]{24})  ", output, re.M)


def test_ls_lists_the_outbox_then_a_page_of_the_delivered_ones_the_last_first(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    waiting = [due(store, n) for n in range(2)]
    sent = [delivered(store, n, ago=1000 - n) for n in range(7)]  # sent[6] the last moved
    first = cli(url, "notifications", "ls", "--limit", "3")
    assert first.exit_code == 0, first.output
    assert ids(first.output) == [*waiting, sent[6], sent[5], sent[4]]
    assert f"5 notification(s) in {url}" in first.output
    assert spies[0].selects == [
        Select(prefix=OUTBOX), Select(prefix=DELIVERED, order=Order.NEWEST, limit=4)
    ]  # fmt: skip
    assert spies[0].scans == [] and spies[0].taken == [2, 4]  # one past the page: is there more?

    pages = [ids(first.output)[2:]]
    said = first.output
    while hint := re.findall(r"`(crewai-idempotent [^`]+)`", said):
        words = shlex.split(hint[0])
        assert words[0] == "crewai-idempotent"
        pasted = CliRunner().invoke(main, words[1:])
        assert pasted.exit_code == 0, pasted.output
        pages.append(ids(pasted.output))
        said = pasted.output
    assert pages == [sent[6:3:-1], sent[3:0:-1], sent[:1]]
    # A page after the first starts from the entry the hint names: a keyed read, then one
    # select from there.
    assert all(s.scans == [] for s in spies)
    assert spies[-1].selects == [
        Select(prefix=DELIVERED, order=Order.NEWEST, limit=4, after=spies[-1].selects[0].after)
    ]
    assert spies[-1].selects[0].after is not None


def test_ls_of_what_is_not_delivered_reads_the_outbox_alone(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    waiting = due(store, 1)
    for n in range(5):
        delivered(store, n, ago=100)
    for state in ("pending", "failing", "waiting"):
        done = cli(url, "notifications", "ls", "--state", state)
        assert done.exit_code == 0, done.output
        assert spies[-1].selects == [Select(prefix=OUTBOX)], state
    assert ids(cli(url, "notifications", "ls", "--state", "pending").output) == [waiting]
    assert Outbox(store).undelivered()[0].id == waiting


def test_ls_json_is_a_page_and_says_where_the_next_starts_on_stderr(
    url: str, store: SQLiteCacheBackend
) -> None:
    sent = [delivered(store, n, ago=100 - n) for n in range(4)]
    done = cli(url, "notifications", "ls", "--json", "--limit", "2")
    assert [e["id"] for e in json.loads(done.stdout)] == [sent[3], sent[2]]
    assert f"--after {sent[2]}" in done.stderr and "--limit 2" in done.stderr
    everything = cli(url, "notifications", "ls", "--json", "--limit", "0")
    assert [e["id"] for e in json.loads(everything.stdout)] == sent[::-1]
    assert everything.stderr == ""
    typed = cli(url, "notifications", "ls", "--type", "approval.*", "--json")
    assert typed.exit_code == 0 and json.loads(typed.stdout) == []


def test_ls_after_refuses_what_it_cannot_page(url: str, store: SQLiteCacheBackend) -> None:
    bad = cli(url, "notifications", "ls", "--after", "42")
    assert bad.exit_code == 2 and "not an outbox entry id" in bad.output
    unknown = cli(url, "notifications", "ls", "--after", "ob_" + "0" * 24)
    assert unknown.exit_code == 1 and "no delivered notification" in unknown.output
    wrong = cli(url, "notifications", "ls", "--state", "pending", "--after", "ob_" + "0" * 24)
    assert wrong.exit_code == 2 and "--state delivered" in wrong.output


class _Quiet(Channel):
    """A channel that wants no entry: the dispatcher here only prunes."""

    scheme = "quiet"

    def __init__(self) -> None:
        super().__init__("nowhere", {"types": "nothing.*"})

    def send(self, message: Any) -> None:
        raise AssertionError("nothing is sent")


def test_a_dispatcher_prunes_only_the_delivered_entries_moved_before_its_cutoff(
    store: SQLiteCacheBackend,
) -> None:
    day = 86400.0
    old = [delivered(store, n, ago=40 * day) for n in range(3)]
    recent = [delivered(store, n + 10, ago=day) for n in range(3)]
    spy = Spy(store)
    dispatcher = Dispatcher(spy, [_Quiet()], retain_s=30 * day)
    try:
        dispatcher.run_once()
    finally:
        dispatcher.close()
    prune = [q for q in spy.selects if q.prefix == DELIVERED]
    assert len(prune) == 1 and prune[0].updated_before is not None
    assert abs(prune[0].updated_before - (store.now() - 30 * day)) < 60
    assert spy.taken[spy.selects.index(prune[0])] == 3  # the old ones, not the recent
    assert spy.scans == []
    left = {e.id for e in Outbox(store).entries()}
    assert left == set(recent) and not left & set(old)
