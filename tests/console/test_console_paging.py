"""The console's pages cost a page, and its live updates are driven by what changed.

Reads are counted at a seam, never timed: `Spy` wraps a store and counts every read the
console makes of it (keyed reads, scans, and the rows each `select` yielded), and the
change marks it gives (`changes()`, its own counter of writes, or None as a store that
cannot tell). What the wrapped store reads to answer a `select` is the store's own
business, held to its index by tests/backends/test_select.py; what is counted here is
what the console asks for.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import html
import re
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the console extra is not installed")

from starlette.testclient import TestClient

from crewai_idempotent import (
    CacheBackend,
    InMemoryCacheBackend,
    Ledger,
    Record,
    Select,
    Status,
)
from crewai_idempotent.console import Accounts, ConsoleSettings, _views, create_app
from crewai_idempotent.console._console import Console
from crewai_idempotent.console._live import LATEST, Watcher
from crewai_idempotent.gates._approvals import Approvals
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Money, SpendCap, Where
from crewai_idempotent.ledger._record import Peek
from tests.support.console import PASSWORD, ask, login

BASE = "http://127.0.0.1"
T0 = 1_700_000_000.0
LIVE = {"x-console-live": "1"}  # a page's own refresh: no session touch, reads as counted


class Spy(CacheBackend):
    """`inner`, with every read counted; `changes()` is a count of the writes when `tells`,
    else None (a store that cannot tell)."""

    def __init__(self, inner: CacheBackend, *, tells: bool) -> None:
        self.inner, self.tells = inner, tells
        self.read_first = inner.read_first
        self.host_clock = inner.host_clock
        self._lock = threading.Lock()
        self.writes = 0
        self.marks = 0  # changes() asked
        self.calls: collections.Counter[str] = collections.Counter()
        self.rows = 0  # records the console's selects yielded
        self.selects: list[Select] = []

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.rows = 0
            self.selects = []

    def reads(self) -> int:
        """Every read asked for: keyed reads, scans and selects."""
        with self._lock:
            return sum(self.calls.values())

    def _count(self, what: str) -> None:
        with self._lock:
            self.calls[what] += 1

    def _wrote(self, done: bool) -> None:
        if done:
            with self._lock:
                self.writes += 1

    def now(self) -> float:
        return self.inner.now()

    def insert(self, record: Record) -> Record | None:
        held = self.inner.insert(record)
        self._wrote(held is None)
        return held

    def replace(self, current: Record, new: Record) -> bool:
        done = self.inner.replace(current, new)
        self._wrote(done)
        return done

    def delete(self, current: Record) -> bool:
        done = self.inner.delete(current)
        self._wrote(done)
        return done

    def get(self, key: str) -> Record | None:
        self._count("get")
        return self.inner.get(key)

    def peek(self, key: str) -> Peek | None:
        self._count("peek")
        return self.inner.peek(key)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        self._count("scan")
        return self.inner.scan(status)

    def scan_prefix(self, prefix: str) -> Iterator[Record]:
        self._count("scan_prefix")
        return self.inner.scan_prefix(prefix)

    def select(self, query: Select) -> Iterator[Record]:
        with self._lock:
            self.calls["select"] += 1
            self.selects.append(query)
        for record in self.inner.select(query):
            with self._lock:
                self.rows += 1
            yield record

    def changes(self) -> object | None:
        with self._lock:
            self.marks += 1
            return self.writes if self.tells else None


def _record(key: str, status: Status, at: float, **fields: Any) -> Record:
    return Record(key, status, "fp", 1, 1, None, 1, at, at, result={"t": "json", "v": key},
                  **fields)  # fmt: skip


def _accounts(backend: CacheBackend) -> None:
    accounts = Accounts(backend)
    accounts.add("olga", "operator", PASSWORD)
    accounts.add("alice", "approver", PASSWORD)


def _client(backend: CacheBackend, name: str = "olga") -> TestClient:
    client = TestClient(create_app(backend, ConsoleSettings()), base_url=BASE)
    assert login(client, name).status_code == 303
    return client


# -- a page costs a page ----------------------------------------------------------------


def _big_ledger(spy: Spy) -> None:
    """A few thousand records and 1,000 pending approval requests (each with its claim
    record and its outbox entry), decided requests, uncertain and stale records, and spend
    windows."""
    backend = spy.inner
    for i in range(2500):
        assert backend.insert(_record(f"charge:{i:05}", Status.COMMITTED, T0 + i)) is None
    for i in range(80):
        assert backend.insert(_record(f"charge:u{i:03}", Status.UNCERTAIN, T0 + 3 * i)) is None
        stale = _record(f"charge:p{i:03}", Status.PENDING, T0 + 3 * i + 1, lease_expires_at=T0)
        assert backend.insert(stale) is None
    approvals = Approvals(backend)
    for i in range(1100):
        rid = ask(backend, f"pay_invoice:{i:05}", {"invoice": f"INV-{i}", "amount_cents": i})
        if i % 11 == 0:
            approvals.deny(rid, by="bob", reason="not this one")
    cap = SpendCap(10**9, "EUR", per="kickoff")
    for i in range(70):
        plan = Plan(tool="pay", fingerprint=f"fp-{i}", amount=Money(100, "EUR"),
                    caps=[("pay", cap)], where=Where(kickoff=f"kick-{i}"))  # fmt: skip
        Ledger(backend).run(f"pay:{i}", lambda: "paid", fingerprint=f"fp-{i}", stage=plan)


#: Each page, and the most rows its selects may yield: a page (or BUDGET pages where it
#: drops what the store cannot tell apart) plus, on the approval and record pages, the
#: latest requests of each call shown.
PAGES = {
    "/approvals": 26 + 25 * _views.SAME_KEY + 3 * 51,
    "/approvals?pending_order=newest": 26 + 25 * _views.SAME_KEY + 3 * 51,
    "/uncertain": 4 * 25 + 2 * 26 + 25 * _views.SAME_KEY,
    "/records": 4 * 100 + 101,
    "/records?order=oldest&status=committed": 4 * 100 + 101,
    "/records?documents=1": 4 * 100 + 101,
    "/record?key=pay_invoice%3A00011": _views.SAME_KEY,
    "/spend": 51,
    "/notifications": 4 * 50 + 2 * 51,
    "/notifications?state=pending&type=approval.*": 4 * 50 + 51,
}


def test_each_page_reads_a_page_however_large_the_ledger() -> None:
    spy = Spy(InMemoryCacheBackend(), tells=True)
    _accounts(spy.inner)
    _big_ledger(spy)
    assert sum(1 for _ in spy.inner.scan()) > 5000
    with _client(spy) as client:
        rid = next(Approvals(spy.inner).select("pending", limit=1)).id
        for url, most in {**PAGES, f"/approvals/{rid}": _views.SAME_KEY}.items():
            spy.reset()
            page = client.get(url, headers=LIVE)
            assert page.status_code == 200, (url, page.text[:500])
            assert spy.calls["scan"] == spy.calls["scan_prefix"] == 0, url
            assert all(q.limit is not None and q.limit <= 101 for q in spy.selects), url
            assert spy.rows <= most, (url, spy.rows)
            # Keyed reads: the session and the account, the record or request asked for,
            # a window's reservations; on the notifications page, the transition each
            # waiting entry read waits for.
            keyed = spy.calls["get"] + spy.calls["peek"]
            assert keyed <= 8 + (most if url.startswith("/notifications") else 0), (url, keyed)
            assert '<nav class="pager"' in page.text or url.startswith(("/record?", "/approvals/"))
        first = client.get("/approvals", headers=LIVE).text
        assert first.count('<article class="request') == _views.PENDING_SHOWN
        assert 'rel="next"' in first


# -- pages page -------------------------------------------------------------------------


def _next(page: str, listing: str = "main") -> str | None:
    """The next-page link of `listing` on `page` (the approvals page has two)."""
    pager = re.search(rf'<nav class="pager" data-listing="{listing}".*?</nav>', page, re.S)
    found = (
        re.search(r'<a rel="next" class="next" href="([^"]+)"', pager.group(0)) if pager else None
    )
    return html.unescape(found.group(1)) if found else None


def _walk(client: TestClient, url: str, pattern: str, listing: str = "main") -> list[list[str]]:
    """Every page from `url` on, by the next-page links of `listing`: what `pattern` finds
    on each."""
    pages: list[list[str]] = []
    next_url: str | None = url
    while next_url is not None:
        page = client.get(next_url)
        assert page.status_code == 200, page.text[:300]
        pages.append([html.unescape(k) for k in re.findall(pattern, page.text)])
        next_url = _next(page.text, listing)
        assert len(pages) < 50
    return pages


RECORD_KEYS = r'<a href="/record\?key=[^"]*"><code>([^<]*)</code></a></td>'


def test_records_page_newest_or_oldest_first_filters_kept_across_pages() -> None:
    backend = InMemoryCacheBackend()
    _accounts(backend)
    for i in range(230):
        tool = "charge_card" if i % 3 else "send_mail"
        assert backend.insert(_record(f"{tool}:{i:03}", Status.COMMITTED, T0 + i)) is None
    for i in range(150):  # the gates' documents, newer than every record: not shown
        ask(backend, f"pay_invoice:{i:03}", {"invoice": i})
    gated = {r.key for r in backend.scan() if r.key.startswith("pay_invoice:")}
    with _client(backend, "alice") as client:
        newest = _walk(client, "/records", RECORD_KEYS)
        keys = [k for page in newest for k in page]
        assert len(newest) > 2 and all(len(p) <= _views.RECORDS_SHOWN for p in newest)
        assert not any(k.startswith("crewai-idempotent/") for k in keys)
        plain = sorted((r for r in backend.scan() if not r.key.startswith("crewai-idempotent/")),
                       key=lambda r: (r.updated_at, r.key), reverse=True)  # fmt: skip
        assert keys == [r.key for r in plain]  # each once, newest first
        oldest = [k for p in _walk(client, "/records?order=oldest", RECORD_KEYS) for k in p]
        assert oldest == keys[::-1]
        charges = _walk(client, "/records?tool=charge_card&order=oldest", RECORD_KEYS)
        assert len(charges) == 2 and len(charges[0]) == _views.RECORDS_SHOWN
        assert [k for p in charges for k in p] == [
            f"charge_card:{i:03}" for i in range(230) if i % 3
        ]
        link = _next(client.get("/records?tool=charge_card&order=oldest&done=purged&n=3").text)
        assert link is not None and "tool=charge_card" in link and "order=oldest" in link
        assert "done=" not in link and "n=3" not in link
        # The order toggle starts again from the first page, the filters kept.
        later = client.get(link).text
        toggle = re.search(r'<a href="([^"]+)">newest first</a>', later)
        assert toggle and "after" not in toggle.group(1) and "tool=charge_card" in toggle.group(1)
        assert "First page" in later
        docs = [k for p in _walk(client, "/records?documents=1", RECORD_KEYS) for k in p]
        assert gated <= set(docs) and any(k.startswith("crewai-idempotent/approval/") for k in docs)
        assert not any(k.startswith("crewai-idempotent/console/") for k in docs)


def _cursor(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


BAD_CURSORS = [
    "!!!",
    "a b",
    "abc",  # base64 of bytes that are not JSON
    _cursor(b'{"a": 1}'),
    _cursor(b"[1]"),
    _cursor(b'["x", "k"]'),
    _cursor(b'[true, "k"]'),
    _cursor(b'[NaN, "k"]'),
    _cursor(b'[1e400, "k"]'),
    _cursor(b"[1, 2]"),
    _cursor(b"[1" + b"0" * 400 + b', "k"]'),  # an integer no float holds
    _cursor(b"[1" + b"0" * 5000 + b', "k"]'),  # past Python's digits limit
    _cursor(b'[1, "k"]') + "%0A",  # a trailing newline
    _cursor(b"[" * 5000 + b"]" * 5000),
    _cursor('[1, "\u00e9"]'.encode()),  # not ASCII: never what the console writes
    _cursor(b'"a key"'),  # a key position: the console's pages go by time
    "A" * 20_000,
]


@pytest.mark.parametrize(
    "url",
    ["/records?after=", "/uncertain?after=", "/spend?after=", "/notifications?after=",
     "/approvals?pending_after=", "/approvals?decided_after="],
)  # fmt: skip
def test_a_damaged_page_link_is_a_clear_400(url: str) -> None:
    backend = InMemoryCacheBackend()
    _accounts(backend)
    with _client(backend) as client:
        for bad in BAD_CURSORS:
            page = client.get(url + bad)
            assert page.status_code == 400, (bad, page.status_code)
            assert "page link is damaged" in page.text
        good = _views.cursor((T0, 'a "key" & <more>\udcff'))
        assert client.get(url + good).status_code == 200
        order = url.split("?")[0] + "?" + url.split("?")[1].replace("after=", "order=sideways")
        sideways = client.get(order)
        assert sideways.status_code == 400 and "No order" in sideways.text


def test_a_cursor_is_the_position_it_was_made_from() -> None:
    for where in [(T0, "k"), (0.1 + 0.2, "\udcff é \u202e"), (1e-300, ""), (T0, "x" * 5000)]:
        text = _views.cursor(where)
        assert re.fullmatch(r"[A-Za-z0-9_-]+", text)
        assert _views.position(text) == where


def test_approvals_pages_pending_and_decided_apart() -> None:
    backend = InMemoryCacheBackend()
    _accounts(backend)
    approvals = Approvals(backend)
    asked = [ask(backend, f"pay_invoice:{i:03}", {"invoice": i}) for i in range(120)]
    denied = asked[::2]
    for rid in denied:
        approvals.deny(rid, by="bob", reason="no")
    pending_ids = asked[1::2]
    cards = r'<article class="request state-pending" id="(ap_[0-9a-f]+)"'
    rows = r'<tr><td><a href="/approvals/(ap_[0-9a-f]+)">'
    with _client(backend, "alice") as client:
        pending = _walk(client, "/approvals", cards, "pending")
        assert [len(p) for p in pending] == [25, 25, 10]
        assert [r for p in pending for r in p] == pending_ids  # oldest first
        first = client.get("/approvals").text
        assert '<span class="count">25+</span>' in first
        newest = _walk(client, "/approvals?pending_order=newest", cards, "pending")
        assert [r for p in newest for r in p] == pending_ids[::-1]
        decided = _walk(client, "/approvals", rows, "decided")
        assert [len(p) for p in decided] == [50, 10]
        assert [r for p in decided for r in p] == denied[::-1]  # the last decided first
        # Each listing pages on its own: the next decided page keeps the pending page.
        second = _next(first, "pending")
        assert second is not None
        later = _next(client.get(second).text, "decided")
        assert later is not None and "pending_after=" in later
        both = client.get(later).text
        assert re.findall(cards, both) == pending_ids[25:50]
        assert re.findall(rows, both) == denied[::-1][50:]


def test_uncertain_pages_show_what_waits_for_a_person_only() -> None:
    backend = InMemoryCacheBackend()
    _accounts(backend)
    waiting = []
    for i in range(40):
        waiting.append(f"charge:u{i:02}")
        assert backend.insert(_record(waiting[-1], Status.UNCERTAIN, T0 + 2 * i)) is None
        live = _record(f"charge:live{i:02}", Status.PENDING, T0 + 2 * i + 1,
                       lease_expires_at=backend.now() + 3600)  # fmt: skip
        assert backend.insert(live) is None
    for i in range(6):
        waiting.append(f"charge:stale{i}")
        stale = _record(waiting[-1], Status.PENDING, T0 + 100 + i, lease_expires_at=T0)
        assert backend.insert(stale) is None
    shown = r'<article class="record" aria-label="record ([^"]+)">'
    with _client(backend) as client:
        pages = _walk(client, "/uncertain", shown)
        assert [k for p in pages for k in p] == waiting
        assert all(len(p) <= _views.UNCERTAIN_SHOWN for p in pages)
        newest = [k for p in _walk(client, "/uncertain?order=newest", shown) for k in p]
        assert newest == waiting[::-1]


def test_spend_and_notifications_page() -> None:
    backend = InMemoryCacheBackend()
    _accounts(backend)
    cap = SpendCap(10**9, "EUR", per="kickoff")
    for i in range(55):
        plan = Plan(tool="pay", fingerprint=f"fp-{i}", amount=Money(100 + i, "EUR"),
                    caps=[("pay", cap)], where=Where(kickoff=f"kick-{i:02}"))  # fmt: skip
        Ledger(backend).run(f"pay:{i}", lambda: "paid", fingerprint=f"fp-{i}", stage=plan)
    for i in range(60):
        ask(backend, f"pay_invoice:{i:03}", {"invoice": i})
    with _client(backend, "alice") as client:
        windows = _walk(client, "/spend", r'<span class="window">window ([^ ]+) ')
        assert [len(p) for p in windows] == [50, 5]
        assert [w for p in windows for w in p] == [f"kickoff-kick-{i:02}" for i in range(55)][::-1]
        entries = _walk(client, "/notifications?type=approval.*",
                        r'<span class="summary">pay_invoice (ap_[0-9a-f]+)')  # fmt: skip
        assert [len(p) for p in entries] == [50, 10]
        ids = [r.id for r in Approvals(backend).list("pending")]
        assert [e for p in entries for e in p] == ids[::-1]  # newest first
        oldest = _walk(client, "/notifications?order=oldest&state=pending",
                       r'<span class="summary">pay_invoice (ap_[0-9a-f]+)')  # fmt: skip
        assert [e for p in oldest for e in p] == ids


def test_a_record_page_lists_the_latest_requests_of_its_call() -> None:
    backend = InMemoryCacheBackend()
    _accounts(backend)
    approvals = Approvals(backend)
    asked = []
    for i in range(13):  # denied, then asked again with other arguments
        asked.append(ask(backend, "pay_invoice:again", {"invoice": "INV-1", "try": i}))
        if i < 12:
            approvals.deny(asked[-1], by="bob", reason=f"not yet {i}")
    ask(backend, "pay_invoice:other", {"invoice": "INV-2"})
    with _client(backend) as client:
        page = client.get("/record?key=pay_invoice%3Aagain").text
        listed = re.findall(r'<a href="/approvals/(ap_[0-9a-f]+)">', page)
        assert len(listed) == _views.SAME_KEY and set(listed) <= set(asked)
        assert asked[-1] in listed and "(the latest 10)" in page
        request = client.get(f"/approvals/{asked[-1]}").text
        assert "Changed since the earlier request for this key" in request
        assert asked[-2] in request and "not yet 11" in request


# -- live updates: driven by what changed ------------------------------------------------


async def _until(condition: Any, what: str) -> None:
    """Wait (a hang guard, not a time bound) until `condition()` holds."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.002)

    try:
        await asyncio.wait_for(poll(), 120)
    except TimeoutError:
        raise AssertionError(f"never: {what}") from None


async def _refreshes(spy: Spy, count: int) -> None:
    """`count` more looks at the ledger (with a mark, a look is one `changes()`)."""
    start = spy.marks
    await _until(lambda: spy.marks >= start + count, f"{count} refreshes")


def _watcher(spy: Spy) -> Watcher:
    console = Console(spy, ConsoleSettings())
    return Watcher(spy, refresh_s=0.005, shown=console.shown)


def test_an_idle_open_page_reads_no_record_between_changes() -> None:
    spy = Spy(InMemoryCacheBackend(), tells=True)
    _accounts(spy.inner)
    for i in range(300):
        spy.insert(_record(f"charge:{i}", Status.COMMITTED, T0 + i))
    ask(spy.inner, "pay_invoice:1", {"invoice": 1})
    watcher = _watcher(spy)

    async def main() -> list[bytes]:
        runner = asyncio.create_task(watcher.run())
        pages = [watcher.stream(lambda: True, url) for url in ("/approvals", "/records", "/spend")]
        heard = [await anext(p) for p in pages]
        spy.reset()
        await _refreshes(spy, 8)
        assert spy.reads() == 0, spy.calls  # eight refreshes, three pages: not one read
        await asyncio.to_thread(Ledger(spy).run, "charge:new", lambda: "r")
        heard += [await asyncio.wait_for(anext(p), 120) for p in pages]
        spy.reset()
        await _refreshes(spy, 8)
        assert spy.reads() == 0, spy.calls
        for p in pages:
            await p.aclose()
        runner.cancel()
        return heard

    heard = asyncio.run(main())
    assert all(h.startswith(b"retry:") for h in heard[:3])
    assert all(h.startswith(b"event: changed\n") for h in heard[3:])
    assert watcher.listeners == 0 and not watcher.pages


def test_without_a_change_mark_each_refresh_reads_a_page_for_each_open_page() -> None:
    spy = Spy(InMemoryCacheBackend(), tells=False)
    _accounts(spy.inner)
    for i in range(3000):
        spy.inner.insert(_record(f"charge:{i:05}", Status.COMMITTED, T0 + i))
    for i in range(40):
        ask(spy.inner, f"pay_invoice:{i}", {"invoice": i})
    watcher = _watcher(spy)
    ledger = Ledger(spy)

    async def changed(page: AsyncIterator[bytes]) -> bytes:
        heard = b""
        while not heard.startswith(b"event: changed"):
            heard = await asyncio.wait_for(anext(page), 120)
        return heard

    async def main() -> None:
        runner = asyncio.create_task(watcher.run())
        oldest = watcher.stream(lambda: True, "/records?order=oldest")
        await anext(oldest)
        approvals = watcher.stream(lambda: True, "/approvals")
        await anext(approvals)
        spy.reset()
        before = spy.marks
        await _refreshes(spy, 6)
        looks = spy.marks
        assert spy.calls["scan"] == spy.calls["scan_prefix"] == 0
        assert all(q.limit is not None and q.limit <= 101 for q in spy.selects)
        most = LATEST + PAGES["/records"] + PAGES["/approvals"]
        assert spy.rows <= most * (looks - before + 1), (spy.rows, looks - before)
        # A write anywhere: the latest records show it. (Looks that began after it
        # have ended once three more began: each then is seen, or not, for good.)
        seen = watcher.version
        await asyncio.to_thread(ledger.run, "charge:new", lambda: "r")
        await _refreshes(spy, 3)
        assert watcher.version > seen
        await changed(oldest)
        await changed(approvals)
        # A delete only the oldest-first page shows.
        seen = watcher.version
        first = spy.inner.get("charge:00000")
        assert first is not None
        await asyncio.to_thread(spy.delete, first)
        await _refreshes(spy, 3)
        assert watcher.version > seen
        await changed(oldest)
        # The console's own documents (a login writes a session) are not news to any page.
        seen = watcher.version
        await asyncio.to_thread(Accounts(spy).set, "alice", role="viewer")
        await _refreshes(spy, 6)
        assert watcher.version == seen
        for page in (oldest, approvals):
            await page.aclose()
        runner.cancel()

    asyncio.run(main())
