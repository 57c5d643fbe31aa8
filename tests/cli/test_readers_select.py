"""What each command asks the store for: one `Select` naming what it shows or acts on,
never a scan of the ledger, and what it takes from the store is what it shows.

The commands run as typed (click's CliRunner, `--ledger` to a SQLite file), their store
wrapped in a `Spy` that keeps every select and scan asked of it (the seam: the CLI opens
its ledger through it). Once the stores answer a select from their indexes, what a select
reads is theirs to prove (tests/backends/test_select.py); here, that each command asks the
right one. The listings' memory is counted with `gc` against a store that answers from an
index (`JsonStore`), at two ledger sizes: never the wall clock, never RSS.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent import (
    ApprovalRequired,
    Approvals,
    CacheBackend,
    Order,
    Record,
    Select,
    SQLiteCacheBackend,
    Status,
    backend_from_url,
)
from crewai_idempotent.cli import _gates, main
from crewai_idempotent.cli import _ledger as cli_ledger
from crewai_idempotent.gates._gatestore import PREFIX
from crewai_idempotent.ledger._results import encode
from tests.cli.spying import JsonStore, Spy, opened_as, records_alive

DOC = "crewai-idempotent-document"
APPROVALS = PREFIX + "approval/"


@pytest.fixture
def path(tmp_path: Path) -> Iterator[Path]:
    file = tmp_path / "ledger.db"
    SQLiteCacheBackend(file, synchronous="NORMAL").close()
    yield file


@pytest.fixture
def url(path: Path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture
def store(path: Path) -> Iterator[SQLiteCacheBackend]:
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    yield backend
    backend.close()


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> list[Spy]:
    """The spies over every store a command opens (one per `--ledger`)."""
    made: list[Spy] = []

    def make(url: str) -> CacheBackend:
        made.append(Spy(backend_from_url(url)))
        return made[-1]

    opened_as(monkeypatch, make)
    return made


def cli(url: str, *args: str, **kw: Any) -> Result:
    return CliRunner().invoke(main, ["--ledger", url, *args], **kw)


def put(
    backend: CacheBackend,
    key: str,
    status: Status = Status.COMMITTED,
    *,
    ago: float = 0.0,
    **fields: Any,
) -> Record:
    at = backend.now() - ago
    record = Record(key, status, "fp", 1, 1, None, 1, at, at, result={"k": key}, **fields)
    assert backend.insert(record) is None
    return record


def document(backend: CacheBackend, key: str, doc: dict[str, Any], *, ago: float = 0.0) -> None:
    at = backend.now() - ago
    record = Record(key, Status.COMMITTED, DOC, 1, 1, None, 0, at, at, result=encode(doc))
    assert backend.insert(record) is None


def shown(output: str) -> list[str]:
    """The keys of an `ls` table, in order."""
    return [line.split()[0] for line in output.splitlines()[1:] if re.match(r"\S+:\S", line)]


# -- ls ------------------------------------------------------------------------------------


def test_ls_asks_one_select_made_of_its_filters_oldest_update_first(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    for i in range(30):
        put(store, f"charge:{i:02d}", ago=7200 - i)
    put(store, "charge:eu:late", Status.UNCERTAIN, ago=100, needs_operator=True)
    put(store, "charge:eu:new", Status.UNCERTAIN, ago=10)
    put(store, "mail:1", Status.PENDING, ago=5000, lease_expires_at=store.now() - 4000)

    cases = [
        ((), Select(order=Order.OLDEST)),
        (("--status", "uncertain"), Select(status=Status.UNCERTAIN, order=Order.OLDEST)),
        (("--needs-operator",), Select(needs_operator=True, order=Order.OLDEST)),
        (("--stale",), Select(status=Status.PENDING, order=Order.OLDEST)),
        (("--tool", "charge", "--prefix", "charge:eu"),
         Select(prefix="charge:eu", order=Order.OLDEST)),
        (("--prefix", "charge:", "--status", "uncertain"),
         Select(status=Status.UNCERTAIN, prefix="charge:", order=Order.OLDEST)),
    ]  # fmt: skip
    for args, query in cases:
        done = cli(url, "ls", *args)
        assert done.exit_code == 0, done.output
        (spy,) = spies[-1:]
        assert spy.selects == [query], args
        assert spy.scans == [], args  # never a scan of the ledger
        rows = shown(done.output)
        assert spy.taken == [len(rows)], args  # it took from the store what it shows
    assert shown(cli(url, "ls", "--status", "uncertain").output) == [
        "charge:eu:late", "charge:eu:new",
    ]  # fmt: skip
    assert shown(cli(url, "ls", "--stale").output) == ["mail:1"]


def test_ls_ages_are_the_selects_time_bounds_and_filters_that_exclude_read_nothing(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    put(store, "charge:old", ago=7200)
    put(store, "charge:new", ago=60)
    before = time.time()
    assert shown(cli(url, "ls", "--older-than", "1h").output) == ["charge:old"]
    assert shown(cli(url, "ls", "--newer-than", "1h").output) == ["charge:new"]
    after = time.time()
    (older,) = spies[0].selects
    (newer,) = spies[1].selects
    assert older.updated_before is not None and newer.updated_from is not None
    assert before - 3600 <= older.updated_before <= after - 3600 + 1e-6
    assert before - 3600 <= newer.updated_from <= after - 3600 + 1e-6
    assert older.updated_from is None and newer.updated_before is None
    # At least an hour ago is "at or before": the bound is the least time after it.
    assert math.nextafter(older.updated_before, -math.inf) < older.updated_before

    for args in (("--tool", "charge", "--prefix", "mail:"), ("--status", "failed", "--stale")):
        done = cli(url, "ls", *args)
        assert done.exit_code == 0 and "no records match" in done.output, args
        assert spies[-1].asked == [], args  # nothing can match: nothing is read


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_ls_holds_a_few_records_whatever_the_ledger_holds(
    monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    """Against a store that answers from an index (as the stores do), `ls` streams: the
    Record objects alive while it prints stay a few, at 600 records and at 2,400 (it
    sorted, and sized its table by, every record before)."""
    most = {count: _ls_holds(monkeypatch, count, as_json) for count in (600, 2400)}
    assert most[2400] <= 10 and most[600] <= 10, most  # a list of the ledger holds `count`


def _ls_holds(monkeypatch: pytest.MonkeyPatch, count: int, as_json: bool) -> int:
    """The most Record objects alive while `ls` printed a ledger of `count` records."""
    backend = JsonStore()
    now = backend.now()
    for i in range(count):  # keys in the reverse of the update order
        at = now - 1000 + i * 0.01
        record = Record(f"order:{count - i:05d}", Status.COMMITTED, "fp", 1, 1, None, 1, at, at,
                        result={"i": i})  # fmt: skip
        backend.insert(record)
    opened_as(monkeypatch, lambda url: backend)
    lines: list[str] = []
    baseline = records_alive()
    most = 0

    def echo(text: Any = "", *args: Any, **kwargs: Any) -> None:
        nonlocal most
        lines.append(str(text))
        if len(lines) % 97 == 1:  # the first line too: a listing that holds is whole then
            most = max(most, records_alive() - baseline)

    with monkeypatch.context() as patched:
        patched.setattr(cli_ledger.click, "echo", echo)
        done = CliRunner().invoke(main, ["--ledger", "memory://", "ls", *(["--json"] * as_json)])
    assert done.exit_code == 0, done.output
    if as_json:
        keys = [row["key"] for row in json.loads("".join(lines))]
    else:
        keys = [line.split()[0] for line in lines[1:-1]]
        assert lines[-1] == f"{count} record(s) in memory://"
    assert keys == [f"order:{count - i:05d}" for i in range(count)]  # oldest first
    return most


def test_ls_lays_its_table_out_a_chunk_at_a_time_and_widens_it_for_later_rows(
    url: str, store: SQLiteCacheBackend
) -> None:
    count = cli_ledger._CHUNK + 50
    for i in range(count):
        key = f"k:{i:04d}" + ("-a-much-longer-key-than-the-others" if i == count - 10 else "")
        put(store, key, ago=count - i)
    done = cli(url, "ls")
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert lines[0].split() == ["KEY", "STATUS", "TOKEN", "OWNER", "UPDATED", "NOTE"]
    assert lines[-1] == f"{count} record(s) in {url}"
    rows = lines[1:-1]
    assert [row.split()[0] for row in rows][:3] == ["k:0000", "k:0001", "k:0002"]
    assert len(rows) == count
    status_at = [row.index("COMMITTED") for row in rows]
    # The first chunk is laid out for its own keys, the second for the long one.
    assert set(status_at[: cli_ledger._CHUNK]) == {len("k:0000") + 2}
    assert set(status_at[cli_ledger._CHUNK :]) == {
        len("k:0190-a-much-longer-key-than-the-others") + 2
    }


def test_ls_json_is_the_same_array_written_element_by_element(
    url: str, store: SQLiteCacheBackend
) -> None:
    for i in range(3):
        put(store, f"k:{i}", ago=10 - i)
    done = cli(url, "ls", "--json")
    rows = json.loads(done.output)
    assert [r["key"] for r in rows] == ["k:0", "k:1", "k:2"]
    assert done.output == json.dumps(rows, indent=2, ensure_ascii=True, sort_keys=True) + "\n"
    empty = cli(url, "ls", "--json", "--status", "failed")
    assert empty.exit_code == 0 and empty.output == "[]\n"


# -- export and purge ----------------------------------------------------------------------


def test_export_asks_the_select_of_its_filters_in_key_order(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    put(store, "b:1", Status.UNCERTAIN)
    put(store, "a:1", Status.UNCERTAIN)
    put(store, "a:2")
    done = cli(url, "export", "--status", "uncertain")
    assert done.exit_code == 0, done.output
    assert [json.loads(line)["key"] for line in done.output.splitlines()] == ["a:1", "b:1"]
    assert spies[0].selects == [Select(status=Status.UNCERTAIN)] and spies[0].scans == []


def test_purge_reads_the_receipts_whose_expiry_passed_and_judges_each_by_the_host_clock(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    host = store.host_clock
    assert host is not None
    past = store.now() - 60
    put(store, "keep:live", expires_at=store.now() + 3600)
    put(store, "keep:uncertain", Status.UNCERTAIN)
    put(store, "gone:1", expires_at=past)
    put(store, "gone:2", expires_at=past, host_expires=(host.boot, host.elapsed() - 1))
    # The wall clock says expired, the host's clock (no step moves it) says an hour left:
    # the wall clock was set forward, and the receipt keeps replaying.
    put(store, "keep:stepped", expires_at=past, host_expires=(host.boot, host.elapsed() + 3600))
    before = time.time()
    done = cli(url, "purge")
    assert done.exit_code == 0 and "purged 2 record(s)" in done.output, done.output
    (query,) = spies[0].selects
    assert query.expired_by is not None and before - 1 <= query.expired_by <= time.time() + 1
    assert query == Select(expired_by=query.expired_by) and spies[0].scans == []
    assert spies[0].taken == [3]  # the three whose wall-clock expiry passed
    assert {r.key for r in store.scan()} == {"keep:live", "keep:uncertain", "keep:stepped"}


def test_purge_all_and_its_question_read_the_committed_and_failed_records_only(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    put(store, "a:1")
    put(store, "a:2", Status.FAILED)
    put(store, "a:3", Status.UNCERTAIN)
    put(store, "a:4", Status.PENDING, lease_expires_at=store.now() + 600)
    document(store, APPROVALS + "ap_1", {"state": "PENDING"})
    declined = cli(url, "purge", "--all", input="n\n")
    assert declined.exit_code == 1
    assert "1 COMMITTED and FAILED record(s)" not in declined.stderr
    assert "2 COMMITTED and FAILED record(s)" in declined.stderr
    assert "1 approval request(s)" in declined.stderr
    by_status = [Select(status=Status.COMMITTED), Select(status=Status.FAILED)]
    assert spies[0].selects == by_status and spies[0].scans == []
    done = cli(url, "purge", "--all", "--yes")
    assert done.exit_code == 0 and "purged 3 record(s)" in done.output
    assert spies[1].selects == by_status and spies[1].scans == []
    assert {r.key for r in store.scan()} == {"a:3", "a:4"}


# -- doctor --------------------------------------------------------------------------------


def test_doctor_counts_what_needs_someone_each_by_its_select(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    for i in range(40):
        put(store, f"done:{i}")
    put(store, "held:live", Status.PENDING, lease_expires_at=store.now() + 600)
    put(store, "held:stale", Status.PENDING, lease_expires_at=store.now() - 600)
    put(store, "lost:1", Status.UNCERTAIN)
    put(store, "twice:1", Status.UNCERTAIN, needs_operator=True)
    put(store, "twice:2", needs_operator=True)
    done = cli(url, "doctor")
    out = done.output
    reachable = next(line for line in out.splitlines() if line.startswith("reachable"))
    assert reachable.endswith("; 2 pending (1 stale), 2 uncertain, 2 flagged for an operator"), (
        reachable
    )
    assert "committed" not in reachable  # counting them would read every one
    for hint in ("ls --status uncertain", "ls --stale", "ls --needs-operator"):
        assert f"`crewai-idempotent --ledger {url} {hint}`" in out, hint
    spy = spies[0]
    assert spy.selects[:3] == [
        Select(status=Status.PENDING), Select(status=Status.UNCERTAIN), Select(needs_operator=True)
    ]  # fmt: skip
    assert all(query.prefix.startswith(PREFIX) for query in spy.selects[3:])  # the outbox
    assert spy.scans == []
    assert sum(spy.taken) == 2 + 2 + 2  # never the 40 committed


class _Indexing(JsonStore):
    def __init__(self, ready: Any) -> None:
        super().__init__()
        self.ready = ready

    def indexes_ready(self) -> bool:
        if isinstance(self.ready, Exception):
            raise self.ready
        return bool(self.ready)


@pytest.mark.parametrize(
    ("ready", "said"),
    [
        (True, "ready: listings read only what they show"),
        (False, "not built yet (this version builds them on the ledger an earlier one made)"),
        (RuntimeError("no answer"), "cannot tell: RuntimeError: no answer"),
        (None, None),
    ],
    ids=["ready", "building", "raises", "not said"],
)
def test_doctor_says_whether_the_stores_indexes_are_built(
    monkeypatch: pytest.MonkeyPatch, ready: Any, said: str | None
) -> None:
    backend = _Indexing(ready) if ready is not None else JsonStore()
    opened_as(monkeypatch, lambda url: backend)
    done = CliRunner().invoke(main, ["--ledger", "memory://", "doctor"])
    lines = [line for line in done.output.splitlines() if line.startswith("indexes")]
    if said is None:
        assert lines == []
    else:
        assert len(lines) == 1 and said in lines[0], done.output


# -- approvals and spend -------------------------------------------------------------------


def _ask(backend: CacheBackend, n: int) -> str:
    now = backend.now()
    claim = Record(f"pay:{n:03d}", Status.PENDING, "fp", 1, 1, None, 1, now, now)
    with pytest.raises(ApprovalRequired) as asked:
        Approvals(backend).authorize(claim, f"fp-{n}", tool="pay", reason="big", summary={"n": n})
    return asked.value.request_id


def test_approvals_ls_pages_through_the_requests_of_its_state(
    url: str, store: SQLiteCacheBackend, spies: list[Spy], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_gates, "_PAGE", 4)
    ids = [_ask(store, n) for n in range(10)]
    approvals = Approvals(store)
    for rid in ids[:3]:
        approvals.deny(rid, by="ops", reason="no")
    done = cli(url, "approvals", "ls", "--json")
    assert done.exit_code == 0, done.output
    assert [r["id"] for r in json.loads(done.output)] == ids[3:]  # the oldest asked first
    queries = spies[0].selects
    assert [(q.state, q.order, q.limit) for q in queries] == [("PENDING", Order.OLDEST, 4)] * 2
    assert queries[0].after is None and queries[1].after is not None
    assert all(q.prefix == APPROVALS for q in queries) and spies[0].scans == []

    everything = cli(url, "approvals", "ls", "--state", "all")
    listed = [line.split()[0] for line in everything.output.splitlines()]
    assert sorted(listed) == sorted(ids) and len(listed) == 10
    assert [q.state for q in spies[1].selects] == [None] * 3  # 4 + 4 + 2: three pages
    assert spies[1].taken == [4, 4, 2]


def _window(scope: str, per: str, window: str, **fields: Any) -> dict[str, Any]:
    doc = {
        "kind": "spend", "scope": scope, "cap": f"{per}-EUR", "per": per, "window": window,
        "currency": "EUR", "limit": 10_000, "committed": 100, "reserved": {}, "log": [],
    }  # fmt: skip
    return doc | fields


def test_spend_reads_the_windows_that_count_now(
    url: str, store: SQLiteCacheBackend, spies: list[Spy]
) -> None:
    """Held and standing windows by state, the rest by time: a past kickoff's window is not
    read (there is one per kickoff ever run), a window an earlier version wrote (no state)
    is shown while it is recent."""
    days = 3 * 86400.0
    held = {"pay:7": {"token": 1, "amount": 50, "at": 0.0}}
    windows = {
        "total": _window("pay", "total", "total", state="standing"),
        "held": _window("pay", "kickoff", "kickoff-k1", state="held", reserved=held),
        "old-kickoff": _window("pay", "kickoff", "kickoff-k0", state="settled"),
        "today": _window("pay", "day", "2026-12-04", state="settled"),
        "legacy-new": _window("pay", "kickoff", "kickoff-k9"),
        "legacy-old": _window("pay", "kickoff", "kickoff-k8"),
    }
    for name, doc in windows.items():
        old = name in ("total", "held", "old-kickoff", "legacy-old")
        key = f"{PREFIX}spend/{doc['scope']}/{doc['cap']}/{doc['window']}"
        document(store, key, doc, ago=days if old else 60)
    store.insert(Record("pay:7", Status.UNCERTAIN, "fp", 1, 1, None, 1, 0.0, 0.0))

    before = time.time()
    done = cli(url, "spend", "--json")
    after = time.time()
    assert done.exit_code == 0, done.output
    got = {row["window"] for row in json.loads(done.output)}
    assert got == {"total", "kickoff-k1", "2026-12-04", "kickoff-k9"}
    held_row = next(r for r in json.loads(done.output) if r["window"] == "kickoff-k1")
    assert held_row["reserved"] == 50  # an uncertain call's money stays held
    queries = spies[0].selects
    assert [(q.prefix, q.state) for q in queries] == [
        (PREFIX + "spend/", "held"), (PREFIX + "spend/", "standing"), (PREFIX + "spend/", None),
    ]  # fmt: skip
    recent = queries[2].updated_from
    assert recent is not None and before - 86400 <= recent <= after - 86400  # --since 1d
    assert spies[0].scans == []

    every = cli(url, "spend", "--all", "--json")
    assert len(json.loads(every.output)) == len(windows)
    assert spies[1].selects == [Select(prefix=PREFIX + "spend/")]
    week = cli(url, "spend", "--since", "7d", "--json")
    assert len(json.loads(week.output)) == len(windows)


def test_spend_with_no_window_that_counts_now_says_how_to_see_every_one(
    url: str, store: SQLiteCacheBackend
) -> None:
    key = f"{PREFIX}spend/pay/kickoff-EUR/kickoff-k0"
    document(store, key, _window("pay", "kickoff", "kickoff-k0", state="settled"), ago=9e5)
    done = cli(url, "spend")
    assert done.exit_code == 0 and "no spend cap window counts now" in done.output
    (hint,) = re.findall(r"`(crewai-idempotent [^`]+)`", done.output)
    pasted = CliRunner().invoke(main, shlex.split(hint)[1:])
    assert pasted.exit_code == 0 and "kickoff-k0" in pasted.output
