"""The PostgreSQL ledger's listings and change mark, beyond the conformance test
(tests/backends/test_select.py): a table the previous release made, upgraded in place
while claims go on (and by a person, when the workers' role may not); an index an
interrupted build left INVALID; documents holding NaN and model content that reads like
the record's own fields; the mark seen from another process, and never settled while a
write it counts is not visible yet; a frozen server under a select.

What a select must yield is always `Select.apply` over every record (read with `scan`).
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from crewai_idempotent import (
    LedgerUnavailable,
    Order,
    Record,
    Select,
    Status,
    backend_from_url,
)
from crewai_idempotent.backends.postgres._schema import _MIGRATIONS, Statements
from crewai_idempotent.ledger._backend import DOCUMENTS
from crewai_idempotent.ledger._record import Owner
from crewai_idempotent.ledger._results import encode
from tests.support.servers import PostgresServer, discard, start_postgres

T0 = 1_700_000_000.0
APPROVALS = DOCUMENTS + "approval/"
STATES = ["PENDING", "APPROVED", "DENIED", "USED"]


# -- the previous release's table and writes ----------------------------------------------


def old_table(server: PostgresServer, table: str) -> None:
    """The table as the previous release (61b49de) makes it: its version-1 statements,
    which this version keeps unchanged as its migration, and its version row."""
    sql = Statements(table, None)
    with psycopg.connect(server.dsn(), autocommit=True) as conn, conn.transaction():
        conn.execute(sql.create_versions)
        for statement in _MIGRATIONS[1]:
            conn.execute(
                statement.format(table=sql.table, index=sql.index, docs_index=sql.docs_index)
            )
        conn.execute(sql.set_version, (table, 1))


class OldWriter:
    """Writes as the previous release does: its claim and compare-and-set statements
    (this version's are the same text), the record's JSON and the columns, no more."""

    def __init__(self, server: PostgresServer, table: str) -> None:
        self.sql = Statements(table, None)
        self.conn = psycopg.connect(server.dsn(), autocommit=True)

    def insert(self, record: Record) -> None:
        params = {
            "key": record.key, "status": record.status.value, "token": record.token,
            "revision": record.revision, "updated_at": record.updated_at,
            "doc": record.to_json(),
        }  # fmt: skip
        assert self.conn.execute(self.sql.claim, params).fetchall() == [(None,)]

    def replace(self, current: Record, new: Record) -> None:
        params = {
            "status": new.status.value, "token": new.token, "revision": new.revision,
            "updated_at": new.updated_at, "doc": new.to_json(), "key": current.key,
            "current_token": current.token, "current_revision": current.revision,
        }  # fmt: skip
        assert self.conn.execute(self.sql.replace, params).rowcount == 1

    def close(self) -> None:
        self.conn.close()


def record(
    key: str,
    status: Status = Status.COMMITTED,
    *,
    at: float = T0,
    expires_at: float | None = None,
    needs_operator: bool = False,
    result: Any = None,
    error: str | None = None,
    owner: Owner | None = None,
) -> Record:
    return Record(
        key, status, "fp", 1, 1, owner, 1, at, at, expires_at=expires_at,
        result=encode(result if result is not None else {"key": key}),
        error=error, needs_operator=needs_operator,
    )  # fmt: skip


def document(key: str, doc: dict[str, Any], at: float = T0) -> Record:
    return Record(key, Status.COMMITTED, "crewai-idempotent-document", 1, 1, None, 0, at, at,
                  result=encode(doc))  # fmt: skip


def random_records(rng: random.Random, count: int, tag: str = "") -> list[Record]:
    out = []
    for i in range(count):
        at = T0 + rng.choice([0, 1, 2, 3]) * 60 + rng.random()
        if rng.random() < 0.2:
            state, subject = rng.choice(STATES), f"pay:{rng.randrange(4)}"
            doc = {"kind": "approval", "id": f"r{i}", "key": subject, "state": state,
                   "summary": {"state": rng.choice(STATES), "key": "pay:0"}}  # fmt: skip
            out.append(document(f"{APPROVALS}{tag}{i:04d}", doc, at))
            continue
        status = rng.choice(list(Status))
        expires = rng.choice([None, T0 + 100, T0 + 1000]) if status is Status.COMMITTED else None
        out.append(record(f"{rng.choice(['pay:', 'mail:'])}{tag}{i:04d}", status, at=at,
                          expires_at=expires, needs_operator=rng.random() < 0.1))  # fmt: skip
    return out


def random_select(rng: random.Random) -> Select:
    fields: dict[str, Any] = {"order": rng.choice(list(Order))}
    if rng.random() < 0.35:
        fields["prefix"] = APPROVALS
        if rng.random() < 0.6:
            fields["state"] = rng.choice(STATES)
        if rng.random() < 0.4:
            fields["subject"] = f"pay:{rng.randrange(4)}"
    else:
        if rng.random() < 0.4:
            fields["status"] = rng.choice(list(Status))
        if rng.random() < 0.3:
            fields["prefix"] = rng.choice(["pay:", "mail:"])
        if rng.random() < 0.25:
            fields["needs_operator"] = True
        if rng.random() < 0.25:
            fields["expired_by"] = rng.choice([T0 + 50, T0 + 500, T0 + 5000])
    if rng.random() < 0.3:
        fields["updated_from"] = T0 + rng.choice([0, 60, 120])
    if rng.random() < 0.5:
        fields["limit"] = rng.choice([1, 3, 7, 600])
    return Select(**fields)


def keys(records: Any) -> list[str]:
    return [r.key for r in records]


def assert_answers(backend: Any, rng: random.Random, queries: int = 60) -> None:
    """Every select yields what `Select.apply` yields over all the records."""
    everything = list(backend.scan())
    for _ in range(queries):
        query = random_select(rng)
        assert keys(backend.select(query)) == keys(query.apply(everything)), query


def wait_until_ready(backend: Any, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while not backend.indexes_ready():
        assert time.monotonic() < deadline, "the indexes were not built"
        time.sleep(0.1)


@pytest.fixture
def table() -> str:
    return f"ledger_{uuid.uuid4().hex[:16]}"


# -- upgrading in place ---------------------------------------------------------------------


def test_a_table_the_previous_release_made_gets_its_indexes_while_workers_claim(
    postgres_server: PostgresServer, table: str
) -> None:
    """Six workers open a table the previous release made and filled, at once, and claim
    and commit all along while the first of them builds the indexes: no claim fails,
    nothing deadlocks, the version row stays 1 (what the previous release accepts), and
    the selects answer right before and after."""
    old_table(postgres_server, table)
    old = OldWriter(postgres_server, table)
    rng = random.Random(1)
    for item in random_records(rng, 400):
        old.insert(item)
    url = postgres_server.url(table=table, check_durability="false")
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def worker(n: int) -> None:
        backend = backend_from_url(url)
        try:
            start.wait()
            for i in range(40):
                claim = record(f"live:{n}:{i}", Status.PENDING, at=T0 + 7000 + i)
                assert backend.insert(claim) is None
                assert backend.replace(claim, claim.evolve(None, status=Status.COMMITTED))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            backend.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    # An old writer keeps writing too: its rows must land in the indexes being built.
    for item in random_records(rng, 100, tag="late"):
        old.insert(item)
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    reader = backend_from_url(url)
    try:
        wait_until_ready(reader)
        assert reader.changes() is not None
        assert_answers(reader, random.Random(2))
        # Written by the previous release's statements after the build: indexed too.
        flagged = record("late:flagged", Status.UNCERTAIN, needs_operator=True)
        old.insert(flagged)
        assert flagged.key in keys(reader.select(Select(needs_operator=True)))
    finally:
        reader.close()
        old.close()
    with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
        version = conn.execute(
            "SELECT version FROM crewai_idempotency_schema WHERE table_name = %s", (table,)
        ).fetchone()
        invalid = conn.execute(
            "SELECT count(*) FROM pg_index WHERE indrelid = %s::regclass AND NOT indisvalid",
            (f'"{table}"',),
        ).fetchone()
    assert version == (1,)
    assert invalid == (0,)


def test_until_its_indexes_are_built_a_table_answers_right_without_them(
    postgres_server: PostgresServer, table: str
) -> None:
    """`build_in_background=false`: nothing is built until `build_indexes()`; meanwhile
    every select answers right (the fields without an index are checked on the rows read)
    and `changes()` says it cannot tell."""
    old_table(postgres_server, table)
    old = OldWriter(postgres_server, table)
    try:
        for item in random_records(random.Random(10), 600):
            old.insert(item)
    finally:
        old.close()
    url = postgres_server.url(table=table, check_durability="false", build_in_background="false")
    backend = backend_from_url(url)
    try:
        assert not backend.indexes_ready()
        assert backend.changes() is None
        assert_answers(backend, random.Random(11))
        assert not backend.indexes_ready()  # nothing built it meanwhile
        assert backend.build_indexes()
        assert backend.indexes_ready()
        assert backend.changes() is not None
        assert_answers(backend, random.Random(11))
    finally:
        backend.close()


def test_a_role_that_may_not_build_them_lists_without_them_until_the_owner_does(
    postgres_server: PostgresServer, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The workers connect as a role that may write the table but not change it: their
    listings answer right without the indexes, `changes()` says it cannot tell, and the
    warning holds the statements the table's owner runs, which build everything when
    pasted into psql; then the workers' own writes (running the owner's trigger and
    functions) still land, and their mark moves."""
    old_table(postgres_server, table)
    role = f"worker_{uuid.uuid4().hex[:8]}"
    postgres_server.sql(f"CREATE ROLE {role} LOGIN")
    postgres_server.sql(f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table}" TO {role}')
    postgres_server.sql(f"GRANT SELECT ON crewai_idempotency_schema TO {role}")
    worker_url = (
        f"postgresql://{role}@127.0.0.1:{postgres_server.port}/postgres"
        f"?table={table}&check_durability=false"
    )
    caplog.set_level(logging.WARNING, logger="crewai_idempotent")
    worker = backend_from_url(worker_url)
    try:
        for item in random_records(random.Random(3), 300):
            assert worker.insert(item) is None
        deadline = time.monotonic() + 60
        while not any("may not build them" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no warning"
            time.sleep(0.1)
        assert not worker.indexes_ready()
        assert worker.changes() is None
        assert_answers(worker, random.Random(4))
        message = next(r.getMessage() for r in caplog.records if "may not build" in r.getMessage())
        statements = message.split("The table's owner builds them with:\n", 1)[1]
        psql = Path(postgres_server.bindir) / "psql"
        done = subprocess.run(
            [str(psql), postgres_server.dsn(), "-v", "ON_ERROR_STOP=1", "-q"],
            input=statements, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert worker.indexes_ready()
        mark = worker.changes()
        assert mark is not None
        claim = record("after-owner", Status.PENDING)
        assert worker.insert(claim) is None
        assert worker.changes() != mark
        assert_answers(worker, random.Random(5))
    finally:
        worker.close()


def test_an_index_an_interrupted_build_left_invalid_is_built_again(
    postgres_server: PostgresServer, table: str
) -> None:
    url = postgres_server.url(table=table, check_durability="false")
    backend = backend_from_url(url)
    try:
        for item in random_records(random.Random(6), 200):
            assert backend.insert(item) is None
        assert backend.indexes_ready()
        with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
            name, definition = conn.execute(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s "
                "AND indexname LIKE '%%expiry'", (table,)
            ).fetchone()  # type: ignore[misc]  # fmt: skip
            conn.execute(f'DROP INDEX "{name}"')
            # A build that failed half-way leaves its index in the catalog, INVALID.
            with pytest.raises(psycopg.errors.UniqueViolation):
                conn.execute(f'CREATE UNIQUE INDEX CONCURRENTLY "{name}" ON "{table}" (status)')
            assert conn.execute(
                "SELECT indisvalid FROM pg_index WHERE indexrelid = %s::regclass", (f'"{name}"',)
            ).fetchone() == (False,)  # fmt: skip
        assert not backend.indexes_ready()
        assert_answers(backend, random.Random(7), queries=20)
        assert backend.build_indexes()
        assert backend.indexes_ready()
        with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
            rebuilt = conn.execute(
                "SELECT indexdef FROM pg_indexes WHERE indexname = %s", (name,)
            ).fetchone()
        assert rebuilt == (definition,)
    finally:
        backend.close()


PREVIOUS_RELEASE = "61b49de"

_OLD_RELEASE_WRITES = """
import sys
import crewai_idempotent
from crewai_idempotent import Record, Status, backend_from_url
assert crewai_idempotent.__file__.startswith(sys.argv[2]), crewai_idempotent.__file__
backend = backend_from_url(sys.argv[1])
def put(key, status=Status.COMMITTED, **fields):
    record = Record(key, status, "fp", 1, 1, None, 1, 5.0, 5.0, **fields)
    assert backend.insert(record) is None
    return record
claim = put("old:claim", Status.PENDING)
assert backend.replace(claim, claim.evolve(None, status=Status.COMMITTED, expires_at=7.0))
put("old:flagged", Status.UNCERTAIN, needs_operator=True)
put("crewai-idempotent/approval/old", result={"t": "json", "v": {"state": "PENDING",
    "key": "pay:old", "summary": {"state": "USED"}}})
assert backend.get("new:1") is not None  # what this version wrote, read by the old one
backend.close()
"""


@pytest.fixture(scope="module")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's package, from this checkout's git history."""
    root = Path(__file__).resolve().parents[2]
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", PREVIOUS_RELEASE, "crewai_idempotent"],
        capture_output=True,
    )  # fmt: skip
    if archive.returncode != 0:
        pytest.skip(f"the previous release ({PREVIOUS_RELEASE}) is not in this checkout")
    old_root = tmp_path_factory.mktemp("previous-release")
    subprocess.run(["tar", "-x", "-C", str(old_root)], input=archive.stdout, check=True)
    return old_root


def test_the_previous_release_writes_beside_this_one(
    postgres_server: PostgresServer, table: str, old_release: Path
) -> None:
    """The previous release itself (its code, from git, in another interpreter) opens a
    table this version made, with every index and the trigger: it accepts it (version 1),
    its writes land in the indexes, and they move this version's mark."""
    old_root = old_release
    url = postgres_server.url(table=table, check_durability="false")
    backend = backend_from_url(url)
    try:
        assert backend.insert(record("new:1", Status.PENDING)) is None
        assert backend.indexes_ready()
        mark = backend.changes()
        env = {**os.environ, "PYTHONPATH": str(old_root)}
        done = subprocess.run([sys.executable, "-c", _OLD_RELEASE_WRITES, url, str(old_root)],
                              env=env, cwd=old_root, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert backend.changes() != mark
        assert keys(backend.select(Select(expired_by=7.0))) == ["old:claim"]
        assert keys(backend.select(Select(needs_operator=True))) == ["old:flagged"]
        assert keys(backend.select(Select(prefix=APPROVALS, state="PENDING"))) == [
            APPROVALS + "old"
        ]
        assert keys(backend.select(Select(prefix=APPROVALS, subject="pay:old"))) == [
            APPROVALS + "old"
        ]
        assert keys(backend.select(Select(prefix=APPROVALS, state="USED"))) == []
    finally:
        backend.close()


_OLD_RELEASE_CLAIMS = """
import sys
import crewai_idempotent
from crewai_idempotent import Record, Status, backend_from_url
assert crewai_idempotent.__file__.startswith(sys.argv[2]), crewai_idempotent.__file__
backend = backend_from_url(sys.argv[1])
backend.get("-")  # the previous release makes the table
print("made", flush=True)
sys.stdin.readline()  # this version has opened it
for i in range(300):
    record = Record(f"old:{i:04d}", Status.PENDING, "fp", 1, 1, None, 1, 5.0 + i, 5.0 + i)
    assert backend.insert(record) is None
    done = record.evolve(None, status=Status.COMMITTED, expires_at=float(i),
                         needs_operator=i % 50 == 0)
    assert backend.replace(record, done)
backend.close()
"""


def test_a_table_the_previous_release_makes_is_upgraded_while_it_writes(
    postgres_server: PostgresServer, table: str, old_release: Path
) -> None:
    """The rolling upgrade: the previous release (its code, in another interpreter) makes
    the table and keeps claiming and committing while this version opens it and builds
    its indexes; every write of both lands, and the selects see the old release's."""
    url = postgres_server.url(table=table, check_durability="false")
    env = {**os.environ, "PYTHONPATH": str(old_release)}
    old = subprocess.Popen(
        [sys.executable, "-c", _OLD_RELEASE_CLAIMS, url, str(old_release)], env=env,
        cwd=old_release, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    backend = None
    try:
        assert old.stdout is not None and old.stdin is not None
        assert old.stdout.readline().strip() == "made"
        backend = backend_from_url(url)
        assert backend.insert(record("new:1", Status.PENDING)) is None  # starts the build
        old.stdin.write("go\n")
        old.stdin.flush()
        for i in range(100):
            claim = record(f"new:{i + 2:04d}", Status.PENDING)
            assert backend.insert(claim) is None
        _out, errors = old.communicate(timeout=120)
        assert old.returncode == 0, errors
        wait_until_ready(backend)
        assert keys(backend.select(Select(needs_operator=True))) == [
            f"old:{i:04d}" for i in range(0, 300, 50)
        ]
        assert len(list(backend.select(Select(expired_by=99.0)))) == 100
        assert_answers(backend, random.Random(12), queries=30)
    finally:
        if old.poll() is None:
            old.kill()
        if backend is not None:
            backend.close()


# -- what a write holds ---------------------------------------------------------------------


def test_nan_and_infinity_in_records_and_documents_never_fail_a_write(
    postgres_server: PostgresServer, table: str
) -> None:
    """jsonb refuses NaN and Infinity; the indexes never parse JSON, so every such write
    lands (this version's and the previous release's), and each select is still right."""
    backend = backend_from_url(postgres_server.url(table=table, check_durability="false"))
    old = OldWriter(postgres_server, table)
    try:
        backend.get("-")
        nan, inf = math.nan, math.inf
        written = [
            record("exp:nan", expires_at=nan),
            record("exp:inf", expires_at=inf),
            record("exp:-inf", expires_at=-inf),
            record("exp:tiny", expires_at=5e-324),
            record("exp:huge", expires_at=1.7e308),
            record("exp:-huge", expires_at=-1.7e308),
            record("exp:plain", expires_at=T0 + 10),
            record("res:nan", result={"amount": nan, "rate": inf, "floor": -inf}),
            record("flag:nan", Status.UNCERTAIN, needs_operator=True, result=[nan]),
            # A document whose own times are NaN and Infinity (before its content)...
            Record(
                APPROVALS + "nan",
                Status.COMMITTED,
                "crewai-idempotent-document",
                1,
                1,
                None,
                0,
                nan,
                T0,
                lease_expires_at=inf,
                expires_at=nan,
                result=encode({"kind": "approval", "key": "pay:1", "state": "PENDING"}),
            ),
            # ...and one whose content holds them: encoded "typed", which no select by
            # state or subject finds (`document_field` reads JSON documents only).
            document(
                APPROVALS + "typed",
                {
                    "kind": "approval",
                    "key": "pay:1",
                    "state": "PENDING",
                    "summary": {"amount": nan},
                },
            ),
        ]
        for n, item in enumerate(written):
            if n % 2:
                old.insert(item)
            else:
                assert backend.insert(item) is None
        for query, expected in (
            (Select(expired_by=T0 + 10), ["exp:-huge", "exp:-inf", "exp:plain", "exp:tiny"]),
            (Select(prefix=APPROVALS), [APPROVALS + "nan", APPROVALS + "typed"]),
            (
                Select(expired_by=inf),
                ["exp:-huge", "exp:-inf", "exp:huge", "exp:inf", "exp:plain", "exp:tiny"],
            ),
            (Select(needs_operator=True), ["flag:nan"]),
            (Select(prefix=APPROVALS, state="PENDING"), [APPROVALS + "nan"]),
            (Select(prefix=APPROVALS, subject="pay:1"), [APPROVALS + "nan"]),
        ):
            assert keys(backend.select(query)) == expected == keys(query.apply(written)), query
    finally:
        old.close()
        backend.close()


def test_model_content_that_reads_like_a_field_never_hides_a_record(
    postgres_server: PostgresServer, table: str
) -> None:
    """Receipts, errors, owners and documents whose content holds the record's own field
    names, nested before and after the real ones, quotes and escapes: every select still
    yields exactly `Select.apply`'s answer, and every write landed."""
    backend = backend_from_url(postgres_server.url(table=table, check_durability="false"))
    try:
        fake = {
            "needs_operator": True,
            "expires_at": 1.0,
            "state": "PENDING",
            "key": "pay:1",
            "status": "UNCERTAIN",
            "result": {"t": "json", "v": {"state": "PENDING"}},
        }
        text = ',"expires_at":1,"needs_operator":true,"result":{"t":"json","v":{"state":"PENDING"'
        hostile = Owner(host=text, pid=1, id='"state":"PENDING"')
        written = [
            record("r:receipt", result=fake, expires_at=T0 + 10_000),
            # A receipt that says it never expires, in a record that does.
            record(
                "r:nullfake",
                result={"expires_at": None, "t": ',"expires_at":null,'},
                expires_at=T0 + 5,
            ),
            record("r:text", result=text, error=text, owner=hostile),
            record("r:list", result=[fake, text], needs_operator=False),
            record("r:flagged", Status.UNCERTAIN, result=fake, needs_operator=True),
            # The real state after a nested one of the same name, and the reverse.
            document(
                APPROVALS + "a",
                {
                    "summary": {"state": "PENDING", "key": "pay:1"},
                    "state": "DENIED",
                    "key": "pay:2",
                },
            ),
            document(
                APPROVALS + "b",
                {"state": "APPROVED", "key": "pay:1", "summary": {"state": "PENDING", **fake}},
            ),
            document(
                APPROVALS + "c", {"id": 'x","state":"PENDING', "state": 'US"ED\\', "key": "pay:\n1"}
            ),
            document(
                APPROVALS + "d",
                {"list": [{"state": "PENDING"}, "]}", "[{"], "state": "USED", "key": "pay:1"},
            ),
            document(APPROVALS + "e", {"summary": fake}),  # no state, no subject of its own
            record(APPROVALS + "f", result=fake),  # not a document
        ]
        for item in written:
            assert backend.insert(item) is None
        queries = [
            Select(needs_operator=True),
            Select(expired_by=T0 + 5),
            Select(expired_by=T0 + 20_000),
            *(Select(prefix=APPROVALS, state=s) for s in [*STATES, 'US"ED\\', "X"]),
            *(Select(prefix=APPROVALS, subject=s) for s in ["pay:1", "pay:2", "pay:\n1"]),
            Select(prefix=APPROVALS, state="PENDING", subject="pay:1", order=Order.NEWEST),
        ]
        for query in queries:
            assert keys(backend.select(query)) == keys(query.apply(written)), query
        assert keys(backend.select(Select(prefix=APPROVALS, state='US"ED\\'))) == [APPROVALS + "c"]
    finally:
        backend.close()


def test_text_no_writer_of_ours_would_write_never_fails_a_write(
    postgres_server: PostgresServer, table: str
) -> None:
    """Rows written by hand (truncated, not JSON, huge numbers, odd bytes), where every
    index function runs (documents' keys, COMMITTED): each write lands."""
    backend = backend_from_url(postgres_server.url(table=table, check_durability="false"))
    backend.get("-")
    backend.close()
    rng = random.Random(8)
    pieces = [',"result":{"t":"json","v":{', '"state":', '"key":"', '"', "\\", "{", "}", "[",
              "]", ",", ":", ',"expires_at":', "1e999", "-", "9" * 300, "NaN", "é", "\u2028",
              "0.0000000000000000000000000000000000000001", " ", "\\u0000", "null"]  # fmt: skip
    sql = Statements(table, None)
    with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
        for i in range(400):
            doc = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
            conn.execute(
                f"INSERT INTO {sql.table} (key, status, token, revision, updated_at, doc) "
                "VALUES (%s, 'COMMITTED', 1, 1, 0, %s)", (f"{APPROVALS}junk{i}", doc),
            )  # fmt: skip
        assert conn.execute(f"SELECT count(*) FROM {sql.table}").fetchone() == (400,)


# -- the change mark -----------------------------------------------------------------------


_WRITE_ONE = """
import sys
from crewai_idempotent import Record, Status, backend_from_url
backend = backend_from_url(sys.argv[1])
assert backend.insert(Record(sys.argv[2], Status.PENDING, "fp", 1, 1, None, 1, 1.0, 1.0)) is None
backend.close()
"""


def test_the_mark_moves_with_another_process_and_the_previous_release(
    postgres_server: PostgresServer, table: str
) -> None:
    url = postgres_server.url(table=table, check_durability="false")
    backend = backend_from_url(url)
    old = OldWriter(postgres_server, table)
    try:
        mark = backend.changes()
        assert mark is not None and backend.changes() == mark
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        subprocess.run([sys.executable, "-c", _WRITE_ONE, url, "other:1"], env=env, check=True,
                       timeout=60)  # fmt: skip
        moved = backend.changes()
        assert moved != mark and backend.changes() == moved
        first = record("old:1", Status.PENDING)
        old.insert(first)
        after_old = backend.changes()
        assert after_old != moved
        old.replace(first, first.evolve(None, status=Status.COMMITTED))
        assert backend.changes() != after_old
        # A replay (the claim of a key that is taken) writes nothing: the mark stays.
        settled = backend.changes()
        assert backend.insert(record("old:1", Status.PENDING)) is not None
        assert backend.changes() == settled
    finally:
        old.close()
        backend.close()


def test_the_mark_never_settles_before_the_write_it_counts_is_visible(
    postgres_server: PostgresServer, table: str
) -> None:
    """A writer whose row is written but not committed yet: every mark read meanwhile is
    a new one (a reader that compares marks re-reads), and the first mark after the
    commit differs from the one before the write, so a reader that re-read while the
    write was invisible reads again once it is."""
    backend = backend_from_url(postgres_server.url(table=table, check_durability="false"))
    try:
        before = backend.changes()
        sql = Statements(table, None)
        with psycopg.connect(postgres_server.dsn()) as writer:  # a transaction, not autocommit
            item = record("slow:1", Status.PENDING)
            writer.execute(sql.claim, {
                "key": item.key, "status": "PENDING", "token": 1, "revision": 1,
                "updated_at": T0, "doc": item.to_json(),
            }).fetchall()  # fmt: skip
            during = [backend.changes() for _ in range(3)]
            assert keys(backend.select(Select(status=Status.PENDING))) == []
            assert len({repr(m) for m in during}) == 3 and before not in during
            writer.commit()
        after = backend.changes()
        assert after != before and after not in during
        assert backend.changes() == after
        assert keys(backend.select(Select(status=Status.PENDING))) == ["slow:1"]
    finally:
        backend.close()


def test_selects_and_the_mark_work_in_a_forked_child(
    postgres_server: PostgresServer, table: str
) -> None:
    backend = backend_from_url(postgres_server.url(table=table, check_durability="false"))
    try:
        assert backend.insert(record("fork:1", Status.UNCERTAIN, needs_operator=True)) is None
        assert keys(backend.select(Select(needs_operator=True))) == ["fork:1"]
        mark = backend.changes()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            code = 1
            try:
                ok = keys(backend.select(Select(needs_operator=True))) == ["fork:1"]
                ok = ok and backend.changes() == mark
                ok = ok and backend.insert(record("fork:2", Status.PENDING)) is None
                code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert backend.changes() != mark
        assert keys(backend.select(Select(status=Status.PENDING))) == ["fork:2"]
    finally:
        backend.close()


def test_a_select_in_key_order_yields_each_record_that_stays_once_while_others_write(
    postgres_server: PostgresServer, table: str
) -> None:
    backend = backend_from_url(postgres_server.url(table=table, check_durability="false"))
    writer = backend_from_url(postgres_server.url(table=table, check_durability="false"))
    try:
        staying = [record(f"stay:{i:05d}", at=T0 + i) for i in range(1200)]
        for item in staying:
            assert backend.insert(item) is None
        stop = threading.Event()

        def write() -> None:
            n = 0
            while not stop.is_set():
                claim = record(f"stay:{n:05d}x", Status.PENDING)  # between the staying keys
                assert writer.insert(claim) is None
                assert writer.delete(claim)
                n += 1

        thread = threading.Thread(target=write)
        thread.start()
        try:
            seen = [r.key for r in backend.select(Select(prefix="stay:", status=Status.COMMITTED))]
        finally:
            stop.set()
            thread.join(60)
        assert seen == [r.key for r in staying]
    finally:
        writer.close()
        backend.close()


# -- a server that stops answering -----------------------------------------------------------


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[PostgresServer]:
    """A server of this module's own: the test below freezes it."""
    server = start_postgres()
    yield server
    discard(server)


BOUNDED = re.compile(r"(within|past) (timeout_s|statement_timeout_s|connect_timeout_s)=1\.0")


def test_a_select_and_the_mark_on_a_frozen_server_end_within_the_timeouts(
    own_postgres: PostgresServer,
) -> None:
    url = own_postgres.fresh_url(
        timeout_s=1.0, connect_timeout_s=1.0, statement_timeout_s=1.0, check_durability="false"
    )
    backend = backend_from_url(url)
    try:
        for i in range(700):  # more than a batch: the second batch is read frozen
            assert backend.insert(record(f"f:{i:04d}", at=T0 + i)) is None
        listing = backend.select(Select(order=Order.NEWEST))
        next(listing)
        outcome: list[BaseException | None] = []

        def rest() -> None:
            try:
                for _ in listing:
                    pass
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcome.append(exc)
            try:
                backend.changes()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001
                outcome.append(exc)

        own_postgres.freeze()
        try:
            thread = threading.Thread(target=rest, daemon=True)
            thread.start()
            thread.join(60)
        finally:
            own_postgres.thaw()
        assert len(outcome) == 2, "a call on the frozen server did not end"
        for error in outcome:
            assert isinstance(error, LedgerUnavailable) and BOUNDED.search(str(error)), error
    finally:
        backend.close()
