"""The Redis ledger's selects beside the previous release, on ledgers it made, with content
that looks like our own fields, and while others write.

The previous release (commit 61b49de) is played here by its own scripts' text, sent to the
server as its store sent them (`OldRelease`): its writes keep the status indexes and the
documents' index, and none of this release's `x:` keys. Every answer is held to
`Select.apply` over what was written; costs are counted through `scan_stats()`.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from crewai_idempotent import Order, Record, Select, Status, backend_from_url
from crewai_idempotent.backends.redis import RedisCacheBackend
from crewai_idempotent.ledger._backend import DOCUMENTS
from crewai_idempotent.ledger._results import encode
from tests.support.servers import RedisServer

T0 = 1_700_000_000.0
APPROVALS = DOCUMENTS + "approval/"
ROOT = Path(__file__).resolve().parents[2]

# The previous release's scripts (crewai_idempotent/backends/redis/_scripts.py at 61b49de),
# with DOCUMENTS filled in as its f-string did: what its workers send.
OLD_CLAIM = """
local held = redis.call('HGET', KEYS[1], 'doc')
if held then
    if ARGV[7] == '1' and held == ARGV[6] then return false end
    return held
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'token', ARGV[3], 'revision', ARGV[4],
           'doc', ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
if string.sub(ARGV[1], 1, 18) == 'crewai-idempotent/' then
    redis.call('ZADD', KEYS[3], 0, ARGV[1])
end
return false
"""
OLD_REPLACE = """
local held = redis.call('HMGET', KEYS[1], 'status', 'token', 'revision', 'doc')
if held[2] ~= ARGV[2] or held[3] ~= ARGV[3] then
    if held[2] == ARGV[5] and held[3] == ARGV[6] and held[4] == ARGV[8] then return 1 end
    return 0
end
local index = {PENDING = KEYS[2], COMMITTED = KEYS[3], FAILED = KEYS[4], UNCERTAIN = KEYS[5]}
redis.call('HSET', KEYS[1], 'status', ARGV[4], 'token', ARGV[5], 'revision', ARGV[6],
           'doc', ARGV[8])
if held[1] ~= ARGV[4] then redis.call('ZREM', index[held[1]], ARGV[1]) end
redis.call('ZADD', index[ARGV[4]], ARGV[7], ARGV[1])
return 1
"""
OLD_DELETE = """
local held = redis.call('HMGET', KEYS[1], 'status', 'token', 'revision')
if held[2] ~= ARGV[2] or held[3] ~= ARGV[3] then return 0 end
local index = {PENDING = KEYS[2], COMMITTED = KEYS[3], FAILED = KEYS[4], UNCERTAIN = KEYS[5]}
redis.call('DEL', KEYS[1])
redis.call('ZREM', index[held[1]], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
return 1
"""
STATUSES = ("PENDING", "COMMITTED", "FAILED", "UNCERTAIN")


class OldRelease:
    """A worker of the previous release on the same ledger: its scripts, its keys and
    arguments, exactly as its store sent them."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.prefix = prefix
        self._claim = self.client.register_script(OLD_CLAIM)
        self._replace = self.client.register_script(OLD_REPLACE)
        self._delete = self.client.register_script(OLD_DELETE)
        self.indexes = [f"{prefix}i:{s}" for s in STATUSES]

    def insert(self, record: Record) -> bool:
        keys = [
            f"{self.prefix}r:{record.key}",
            f"{self.prefix}i:{record.status.value}",
            f"{self.prefix}docs",
        ]
        args = [
            record.key,
            record.status.value,
            record.token,
            record.revision,
            repr(record.updated_at),
            record.to_json(),
            0,
        ]
        return self._claim(keys=keys, args=args) is None

    def replace(self, current: Record, new: Record) -> bool:
        keys = [f"{self.prefix}r:{current.key}", *self.indexes]
        args = [
            current.key,
            current.token,
            current.revision,
            new.status.value,
            new.token,
            new.revision,
            repr(new.updated_at),
            new.to_json(),
        ]
        return bool(self._replace(keys=keys, args=args))

    def delete(self, current: Record) -> bool:
        keys = [f"{self.prefix}r:{current.key}", *self.indexes, f"{self.prefix}docs"]
        return bool(self._delete(keys=keys, args=[current.key, current.token, current.revision]))

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def url(redis_server: RedisServer) -> str:
    return redis_server.fresh_url(check_persistence=False)


@pytest.fixture
def new(url: str) -> Iterator[RedisCacheBackend]:
    backend = backend_from_url(url)
    assert isinstance(backend, RedisCacheBackend)
    yield backend
    backend.close()


@pytest.fixture
def old(url: str, new: RedisCacheBackend) -> Iterator[OldRelease]:
    writer = OldRelease(url.split("?")[0], new.prefix)
    yield writer
    writer.close()


def _record(
    key: str,
    status: Status = Status.COMMITTED,
    *,
    at: float = T0,
    expires_at: float | None = None,
    needs_operator: bool = False,
    document: Any = None,
) -> Record:
    result = encode(document) if document is not None else {"t": "json", "v": {"key": key}}
    return Record(
        key,
        status,
        "fp",
        1,
        1,
        None,
        1,
        at,
        at,
        expires_at=expires_at,
        result=result,
        needs_operator=needs_operator,
    )


def _keys(records: Any) -> list[str]:
    return [r.key for r in records]


def _random_records(rng: random.Random, count: int) -> list[Record]:
    found = []
    for i in range(count):
        at = T0 + rng.choice([0, 1, 2, 3]) * 60 + rng.random()
        if rng.random() < 0.2:
            state = rng.choice(["PENDING", "APPROVED", "DENIED", "USED"])
            document = {"id": f"r{i}", "state": state, "key": f"pay:{rng.randrange(5)}"}
            found.append(_record(f"{APPROVALS}{i:04d}", at=at, document=document))
            continue
        status = rng.choice(list(Status))
        expires = rng.choice([None, T0 + 100, T0 + 1000]) if status is Status.COMMITTED else None
        flagged = status is Status.UNCERTAIN and rng.random() < 0.3
        key = f"{rng.choice(['pay:', 'mail:', 'pay:eu:'])}{i:04d}"
        found.append(_record(key, status, at=at, expires_at=expires, needs_operator=flagged))
    return found


def _random_select(rng: random.Random) -> Select:
    fields: dict[str, Any] = {"order": rng.choice(list(Order))}
    if rng.random() < 0.35:
        fields["prefix"] = rng.choice([APPROVALS, DOCUMENTS])
        if rng.random() < 0.6:
            fields["state"] = rng.choice(["PENDING", "APPROVED", "DENIED", "USED"])
        if rng.random() < 0.4:
            fields["subject"] = f"pay:{rng.randrange(5)}"
    else:
        if rng.random() < 0.4:
            fields["status"] = rng.choice(list(Status))
        if rng.random() < 0.3:
            fields["prefix"] = rng.choice(["pay:", "pay:eu:", "mail:"])
        if rng.random() < 0.25:
            fields["needs_operator"] = True
        if rng.random() < 0.25:
            fields["expired_by"] = rng.choice([T0 + 50, T0 + 500, T0 + 5000])
    if rng.random() < 0.3:
        fields["updated_from"] = T0 + rng.choice([0, 60, 120])
    if rng.random() < 0.5:
        fields["limit"] = rng.choice([1, 3, 7, 50])
    return Select(**fields)


def _agrees(backend: RedisCacheBackend, written: list[Record], rng: random.Random) -> None:
    for _ in range(60):
        query = _random_select(rng)
        assert _keys(backend.select(query)) == _keys(query.apply(written)), query


def _set(backend: RedisCacheBackend, name: str) -> set[str]:
    return {m.decode() for m in backend.client.zrange(f"{backend.prefix}{name}", 0, -1)}


# -- the previous release's scripts are the ones played here ----------------------------


def test_the_old_scripts_played_here_are_the_previous_release_s() -> None:
    try:
        text = subprocess.run(
            ["git", "show", "61b49de:crewai_idempotent/backends/redis/_scripts.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the repository's history (commit 61b49de) is not here")
    scope: dict[str, Any] = {}
    exec(
        text.replace("from ...ledger._backend import DOCUMENTS", f"DOCUMENTS = {DOCUMENTS!r}"),
        scope,
    )
    assert (scope["CLAIM"], scope["REPLACE"], scope["DELETE"]) == (
        OLD_CLAIM,
        OLD_REPLACE,
        OLD_DELETE,
    )


# -- a ledger the previous release made --------------------------------------------------


def test_a_ledger_the_previous_release_made_is_selected_right_then_backfilled_in_steps(
    new: RedisCacheBackend, old: OldRelease, url: str
) -> None:
    rng = random.Random(7)
    written = _random_records(rng, 1200)
    for record in written:
        assert old.insert(record)
    assert not new.indexes_ready()
    _agrees(new, written, rng)  # the slower path: right before the backfill
    # Bounded steps: a limit stops it before the end, and another process continues it.
    other = backend_from_url(url)
    try:
        assert not other.backfill_indexes(limit=500)
        assert not new.indexes_ready()
        assert new.backfill_indexes()
        assert other.indexes_ready()
    finally:
        other.close()
    _agrees(new, written, rng)
    # Complete: a needle among the 1200 is found by reading about as many as it finds.
    before = new.scan_stats().rows
    found = list(new.select(Select(prefix=APPROVALS, state="DENIED", order=Order.NEWEST)))
    assert found
    assert new.scan_stats().rows - before <= len(found) + 2


def test_two_processes_backfilling_at_once_finish_one_backfill(
    new: RedisCacheBackend, old: OldRelease, url: str
) -> None:
    written = _random_records(random.Random(3), 2000)
    for record in written:
        old.insert(record)
    others = [backend_from_url(url) for _ in range(3)]
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda b=b: results.append(b.backfill_indexes())) for b in others
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for backend in others:
        backend.close()
    assert results == [True, True, True]
    stamps = new.client.hmget(new.layout.record(written[0].key), "x")
    assert stamps == [b"1:1"]
    _agrees(new, written, random.Random(4))


# -- the previous release writing beside this one ----------------------------------------


def test_what_the_previous_release_writes_beside_this_one_is_listed(
    new: RedisCacheBackend, old: OldRelease
) -> None:
    # A ledger this release made: its indexes are complete from the start.
    claimed = _record("pay:1", Status.PENDING)
    assert new.insert(claimed) is None
    doc = _record(APPROVALS + "a", document={"state": "PENDING", "key": "pay:1"})
    assert new.insert(doc) is None
    receipt = _record("mail:1", expires_at=T0 + 5)
    assert new.insert(receipt) is None
    assert new.indexes_ready()

    # The previous release flags a record for an operator: UNCERTAIN, which it always is
    # then, so the listing finds it although the old script wrote no x:n entry.
    flagged = claimed.evolve(None, status=Status.UNCERTAIN, needs_operator=True, updated_at=T0 + 1)
    assert old.replace(claimed, flagged)
    assert "pay:1" not in _set(new, "x:n")
    assert _keys(new.select(Select(needs_operator=True))) == ["pay:1"]
    assert _keys(new.select(Select(needs_operator=True, order=Order.NEWEST, limit=1))) == ["pay:1"]

    # It decides an approval: the PENDING listing no longer shows it, and that read heals
    # the document's entries, so the APPROVED listing shows it from then on.
    approved = doc.evolve(
        None, result=encode({"state": "APPROVED", "key": "pay:1"}), updated_at=T0 + 2
    )
    assert old.replace(doc, approved)
    assert _keys(new.select(Select(prefix=APPROVALS, state="PENDING"))) == []
    assert _keys(new.select(Select(prefix=APPROVALS, state="APPROVED"))) == [APPROVALS + "a"]
    assert _keys(new.select(Select(prefix=APPROVALS, state="APPROVED", order=Order.NEWEST))) == [
        APPROVALS + "a"
    ]

    # It deletes an expired receipt (its purge): not listed, and the entry it left behind
    # is dropped by the first read that meets it.
    assert old.delete(receipt)
    assert "mail:1" in _set(new, "x:e")
    assert _keys(new.select(Select(expired_by=T0 + 10))) == []
    assert "mail:1" not in _set(new, "x:e")

    # What lags: a document it creates and a receipt it commits are in no x: set, so the
    # listings by state and expiry miss them until the backfill walks the ledger again.
    created = _record(APPROVALS + "b", at=T0 + 3, document={"state": "PENDING", "key": "pay:2"})
    assert old.insert(created)
    committed = _record("mail:2", at=T0 + 3, expires_at=T0 + 5)
    assert old.insert(committed)
    assert _keys(new.select(Select(prefix=APPROVALS))) == [APPROVALS + "a", APPROVALS + "b"]
    assert new.backfill_indexes(rescan=True)
    assert _keys(new.select(Select(prefix=APPROVALS, state="PENDING"))) == [APPROVALS + "b"]
    assert _keys(new.select(Select(expired_by=T0 + 10))) == ["mail:2"]

    # This release writing over what the previous one wrote leaves its entries right.
    resolved = flagged.evolve(
        None, status=Status.COMMITTED, needs_operator=False, updated_at=T0 + 4, expires_at=T0 + 6
    )
    assert new.replace(flagged, resolved)
    assert _keys(new.select(Select(needs_operator=True))) == []
    assert _keys(new.select(Select(expired_by=T0 + 10))) == ["mail:2", "pay:1"]


def test_a_backfill_does_not_finish_while_the_previous_release_writes(
    new: RedisCacheBackend, old: OldRelease
) -> None:
    for i in range(50):
        old.insert(_record(f"pay:{i}", at=new.now()))
    assert not new.indexes_ready()
    # A worker of the previous release writes while the walk goes on: the window after
    # the walk sees it, and the backfill stops short of calling the indexes complete.
    original = new.lua.walk_set

    def walk_while_old_writes(*args: Any, **kwargs: Any) -> Any:
        old.insert(_record(f"late:{random.random()}", at=new.now()))
        return original(*args, **kwargs)

    new.lua.walk_set = walk_while_old_writes  # type: ignore[method-assign]
    try:
        assert not new.backfill_indexes()
    finally:
        new.lua.walk_set = original  # type: ignore[method-assign]
    assert not new.indexes_ready()
    # Once it has stopped, the next run completes.
    assert new.backfill_indexes()


def test_this_release_keeps_the_previous_release_s_keys_as_it_did(
    redis_server: RedisServer,
) -> None:
    """The same writes through either release leave the same status indexes, documents'
    index and record hashes (bar this release's own fields): old readers read them."""
    base = redis_server.url()
    new_url = redis_server.fresh_url(check_persistence=False)
    new = backend_from_url(new_url)
    old = OldRelease(base, f"old{random.random()}:")
    try:
        rng = random.Random(11)
        for writer in (new, old):
            held: dict[str, Record] = {}
            rng.seed(11)
            for i in range(300):
                key = rng.choice([f"pay:{i % 40}", f"{APPROVALS}{i % 15}"])
                current = held.get(key)
                move = rng.random()
                if current is None:
                    record = _record(
                        key,
                        rng.choice(list(Status)),
                        at=T0 + i,
                        document={"state": "PENDING"} if key.startswith(DOCUMENTS) else None,
                    )
                    assert writer.insert(record) in (None, True)
                    held[key] = record
                elif move < 0.2:
                    assert writer.delete(current)
                    del held[key]
                else:
                    new_record = current.evolve(
                        None, status=rng.choice(list(Status)), updated_at=T0 + i
                    )
                    assert writer.replace(current, new_record)
                    held[key] = new_record
        client = new.client

        def kept(prefix: str) -> Any:
            sets = {
                name: client.zrange(f"{prefix}{name}", 0, -1, withscores=True)
                for name in [*(f"i:{s}" for s in STATUSES), "docs"]
            }
            hashes = {
                name.decode()[len(prefix) :]: {
                    k: v
                    for k, v in client.hgetall(name).items()
                    if k in (b"status", b"token", b"revision", b"doc")
                }
                for name in client.scan_iter(match=f"{prefix}r:*")
            }
            return sets, hashes

        assert kept(new.prefix) == kept(old.prefix)
    finally:
        new.close()
        old.close()


# -- content --------------------------------------------------------------------------------


def test_documents_with_nan_and_infinity_are_written_and_selected(new: RedisCacheBackend) -> None:
    # Stored as written (not through _results.encode, which spells NaN out), as a
    # document of someone's or a receipt in the json form may be.
    nan_doc = {"state": "PENDING", "key": "pay:1", "amount": math.nan, "cap": math.inf}
    written = [
        _record(APPROVALS + "nan").evolve(None, result={"t": "json", "v": nan_doc}),
        _record("pay:nan", expires_at=math.nan),
        _record("pay:inf", expires_at=math.inf),
        _record("pay:minus", expires_at=-math.inf),
        _record("pay:result").evolve(None, result={"t": "json", "v": [math.nan, -math.inf]}),
    ]
    for record in written:
        assert new.insert(record) is None
    assert "NaN" in new.client.hget(new.layout.record(APPROVALS + "nan"), "doc").decode()
    for query in [
        Select(prefix=APPROVALS, state="PENDING"),
        Select(prefix=APPROVALS, subject="pay:1", order=Order.NEWEST),
        Select(expired_by=T0),
        Select(expired_by=math.inf),
        Select(prefix="pay:"),
    ]:
        assert _keys(new.select(query)) == _keys(query.apply(written)), query
    assert _keys(new.select(Select(expired_by=math.inf))) == ["pay:inf", "pay:minus"]


HOSTILE_KEYS = [
    "pay:*",
    "pay:?x",
    "pay:[ab]",
    "pay:\\",
    "pay:new\nline",
    "pay:ünïcödé",
    "pay:\U0001f600",
    "x:n",
    "i:COMMITTED",
    "r:pay:1",
    DOCUMENTS + "x",
    DOCUMENTS + "approval/\n*",
    DOCUMENTS + "a" * 100 + "/b",
    DOCUMENTS + "approval/",
    "crewai-idempotent",
]


def test_content_that_looks_like_our_own_fields_neither_hides_nor_fails(
    new: RedisCacheBackend,
) -> None:
    rng = random.Random(5)
    written = []
    states: list[Any] = [
        "PENDING",
        "APPROVED",
        "=PENDING",
        "3:x-",
        "",
        None,
        7,
        {"s": 1},
        ["PENDING"],
        "PENDING" * 200,
    ]
    for i, key in enumerate(HOSTILE_KEYS):
        written.append(
            _record(
                key,
                rng.choice(list(Status)),
                at=T0 + i,
                expires_at=T0 + 5 if i % 2 else None,
                needs_operator=i % 3 == 0,
            )
        )
    for i, state in enumerate(states):
        summary = {
            "state": "PENDING",
            "key": "pay:1",
            "needs_operator": True,
            "expires_at": 0,
            "status": "UNCERTAIN",
            "x": "1:1",
        }
        document: dict[str, Any] = {"id": f"h{i}", "summary": summary, "key": f"pay:{i % 2}"}
        if state is not None:
            document["state"] = state
        written.append(_record(f"{APPROVALS}h{i}", at=T0 + 100 + i, document=document))
    odd = _record(APPROVALS + "not-json")
    written.append(odd.evolve(None, result={"t": "pickle", "v": {"state": "PENDING"}}))
    # A kind and a state whose names, run together, are another kind's and state's.
    written.append(_record(DOCUMENTS + "=x/1", document={"state": "a", "key": "k"}))
    written.append(_record(DOCUMENTS + "plain", document={"state": "x/=a", "key": "k"}))
    for record in written:
        assert new.insert(record) is None
    queries = [
        Select(prefix=DOCUMENTS, state="PENDING"),
        Select(prefix=APPROVALS, state="=PENDING", order=Order.NEWEST),
        Select(prefix=APPROVALS, state="3:x-"),
        Select(prefix=APPROVALS, state=""),
        Select(prefix=APPROVALS, state="PENDING" * 200),
        Select(prefix=DOCUMENTS, state="a"),
        Select(prefix=DOCUMENTS + "=x/", state="a", order=Order.NEWEST),
        Select(prefix=DOCUMENTS, state="x/=a", order=Order.NEWEST),
        Select(prefix=APPROVALS, subject="pay:1"),
        Select(prefix=DOCUMENTS, subject="pay:0", order=Order.OLDEST),
        Select(prefix=DOCUMENTS, order=Order.NEWEST),
        Select(prefix="pay:*"),
        Select(prefix="pay:[", order=Order.NEWEST),
        Select(prefix="x:"),
        Select(needs_operator=True),
        Select(expired_by=T0 + 10, order=Order.NEWEST),
        Select(order=Order.OLDEST, limit=5),
        Select(),
    ]
    for query in queries:
        assert _keys(new.select(query)) == _keys(query.apply(written)), query
    _agrees(new, written, rng)


# -- while others write ----------------------------------------------------------------------


def test_selects_while_others_write_yield_what_stays_in_order_once(
    new: RedisCacheBackend, old: OldRelease, url: str
) -> None:
    # What stays: flagged, expired, pending approvals and plain receipts nobody touches.
    stays = []
    for i in range(60):
        stays.append(_record(f"stay:{i:02d}", Status.UNCERTAIN, at=T0 + i, needs_operator=True))
        stays.append(_record(f"stay:e{i:02d}", at=T0 + i, expires_at=T0))
        stays.append(
            _record(
                f"{APPROVALS}stay{i:02d}", at=T0 + i, document={"state": "PENDING", "key": "pay:1"}
            )
        )
    for record in stays:
        assert new.insert(record) is None
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(seed: int, writer: Any) -> None:
        rng = random.Random(seed)
        try:
            n = 0
            while not stop.is_set():
                n += 1
                key = (
                    f"churn:{seed}:{n % 30}" if rng.random() < 0.7 else f"{APPROVALS}c{seed}{n % 9}"
                )
                current = writer_get(key)
                if current is None:
                    writer.insert(
                        _record(
                            key,
                            rng.choice(list(Status)),
                            at=T0 + rng.random() * 60,
                            expires_at=T0,
                            needs_operator=rng.random() < 0.3,
                            document={"state": "PENDING"} if "approval" in key else None,
                        )
                    )
                elif rng.random() < 0.3:
                    writer.delete(current)
                else:
                    writer.replace(
                        current,
                        current.evolve(
                            None,
                            status=rng.choice(list(Status)),
                            updated_at=T0 + rng.random() * 60,
                            needs_operator=rng.random() < 0.5,
                        ),
                    )
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    reader = backend_from_url(url)
    writer_get = reader.get
    writers = [backend_from_url(url), backend_from_url(url), old]
    threads = [threading.Thread(target=churn, args=(i, w)) for i, w in enumerate(writers)]
    for thread in threads:
        thread.start()
    try:
        for query in [
            Select(needs_operator=True, prefix="stay:"),
            Select(expired_by=T0, prefix="stay:e"),
            Select(prefix=APPROVALS + "stay", state="PENDING"),
        ]:
            wanted = [r for r in stays if query.matches(r)]
            for order in Order:
                whole = Select(**{**_fields(query), "order": order})
                paged = Select(**{**_fields(whole), "limit": 7})
                for _ in range(3):  # the same answer, page by page, while they write
                    seen, page = [], list(new.select(paged))
                    while page:
                        seen += page
                        page = list(new.select(paged.page_after(page[-1])))
                    assert _keys(seen) == _keys(whole.apply(wanted)), whole
        # Whatever else is listed meanwhile comes in order (in the order of time, a record
        # updated meanwhile may come again, where its new time puts it; by key, once).
        for order in (Order.NEWEST, Order.OLDEST, Order.KEY):
            everything = Select(order=order)
            positions = [everything.position(r) for r in new.select(everything)]
            assert positions == sorted(positions, reverse=order is Order.NEWEST)
            if order is Order.KEY:
                assert len(set(positions)) == len(positions)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for writer in writers[:2]:
            writer.close()
        reader.close()
    assert not errors, errors


def _fields(query: Select) -> dict[str, Any]:
    return {name: getattr(query, name) for name in Select.__dataclass_fields__}


# -- changes(), and fork ------------------------------------------------------------------------


def test_the_change_mark_moves_with_the_previous_release_s_writes_too(
    new: RedisCacheBackend, old: OldRelease
) -> None:
    record = _record("pay:1", Status.PENDING, at=new.now())
    assert new.insert(record) is None
    mark = new.changes()
    assert new.changes() == mark
    other = _record("pay:2", Status.PENDING, at=new.now())
    assert old.insert(other)  # a claim: the PENDING index grows
    moved = new.changes()
    assert moved != mark
    done = other.evolve(None, status=Status.COMMITTED, updated_at=new.now() + 1)
    assert old.replace(other, done)  # a commit: it moves, and is the newest entry
    assert new.changes() != moved
    latest = new.changes()
    again = done.evolve(None, updated_at=new.now() + 2)
    assert old.replace(done, again)  # an update in place: the newest entry moves
    assert new.changes() != latest
    assert new.changes() == new.changes()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_forked_child_selects_and_writes_on_the_same_ledger(new: RedisCacheBackend) -> None:
    assert new.insert(_record("pay:1", Status.UNCERTAIN, needs_operator=True)) is None
    assert _keys(new.select(Select(needs_operator=True))) == ["pay:1"]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 1
        try:
            found = _keys(new.select(Select(needs_operator=True)))
            new.insert(_record("pay:2", Status.UNCERTAIN, needs_operator=True))
            code = 0 if found == ["pay:1"] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _keys(new.select(Select(needs_operator=True))) == ["pay:1", "pay:2"]


def test_claims_of_both_releases_on_the_same_keys_have_one_winner_each(
    new: RedisCacheBackend, old: OldRelease, url: str
) -> None:
    """Old and new workers race for the same keys: each key is claimed once, whichever
    release wins, and the listings then show each record once, in its status."""
    keys = [f"race:{i:03d}" for i in range(200)]
    wins: dict[str, list[str]] = {key: [] for key in keys}
    other = backend_from_url(url)

    def claim(name: str, writer: Any) -> None:
        for key in keys:
            record = _record(key, Status.PENDING, at=T0 + int(key[-3:]))
            won = writer.insert(record)
            if won is None or won is True:
                wins[key].append(name)

    threads = [
        threading.Thread(target=claim, args=("old", old)),
        threading.Thread(target=claim, args=("new", new)),
        threading.Thread(target=claim, args=("new2", other)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    other.close()
    assert all(len(names) == 1 for names in wins.values()), wins
    assert _keys(new.select(Select(status=Status.PENDING))) == keys
    assert _keys(new.select(Select(order=Order.NEWEST, limit=3))) == keys[::-1][:3]
