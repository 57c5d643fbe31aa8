"""The SQLite ledger's indexes for what people and watchers list, kept by the ledger file.

A listing asks for records by time (per status and across statuses), for the records that
need an operator, for COMMITTED receipts whose TTL has passed (purge), and for the
package's documents by state and by subject (`ledger._select.Select`). Each has an
*index table* here: a `WITHOUT ROWID` table whose primary key is the index's order, so
one table is one B-tree, as an index is.

Why tables filled by triggers, not `CREATE INDEX` on the records:

- **Old writers keep them right.** The previous release writes the ledger beside this one
  during a rolling deployment and knows nothing of them; SQLite runs the triggers for
  every connection, its included. What they store follows from what every release writes:
  the columns, and the record's JSON (`doc`).
- **An existing ledger gets them without blocking claims.** `CREATE INDEX` holds the
  write lock for its whole build (seconds at a million records, minutes at ten million;
  docs/backends.md has the figures). The triggers and empty tables are made at once; the
  records already there are added by `backfill`, a few hundred at a time in short write
  transactions (a claim waits for one of them at most). Until the last one, the tables
  are incomplete and `_select` answers from the primary key and the status index.
- **No expression can fail a write, nor differ between SQLite versions.** A record's JSON
  may hold NaN or Infinity (SQLite 3.40's JSON functions reject both), and an index whose
  expression gives another value under another SQLite version corrupts on the next
  delete. So nothing here uses the JSON functions: the values are cut out of the JSON
  text with `instr` and `substr`, from places whose shape every release writes the same
  (compact separators, the top-level keys of `Record._doc()` in one order since the first
  release). Model-written content inside the document (a receipt, an approval's summary
  of arguments) can at most make an entry say "maybe": the reader re-checks every record
  with `Select.matches` before yielding it, and an extraction that cannot be sure files
  the record where every select of its kind looks (`AMBIGUOUS`), never where none does.

The index tables, each entry ending with the key:

- `idempotency_settled (status, updated_at, key)`: the COMMITTED and FAILED records (the
  bulk of a ledger, and what stays). The records in flight or waiting for a person
  (PENDING, UNCERTAIN) are few, and a claim is the hot path: a claim adds no entry here
  (its trigger only checks the status), and a time order of those two statuses is sorted
  from the status index the ledger has always had;
- `idempotency_flagged (updated_at, key) + status`: records whose JSON says
  `"needs_operator":true` (rare: the table stays small);
- `idempotency_expiry (expires, updated_at, key)`: COMMITTED records with an expiry,
  `expires` the whole seconds of `expires_at` (`floor`: a select compares with the floor
  of its time and re-checks), or `UNSURE` when the text does not say them plainly;
- `idempotency_documents (key) + kind, state, subject, updated_at` and its four indexes:
  the records under `DOCUMENTS` only (a claim of an ordinary key pays the trigger's
  `WHEN` and nothing more).

Readiness is the objects' existence and the absence of a backfill row (`ready`); the
schema number stays 1, which the previous release accepts.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Final

from ...ledger._select import DOCUMENTS

TIME: Final = "idempotency_settled"
#: The statuses `TIME` holds.
SETTLED: Final = ("COMMITTED", "FAILED")
FLAGGED: Final = "idempotency_flagged"
EXPIRY: Final = "idempotency_expiry"
DOCS: Final = "idempotency_documents"
DOCS_STATE_KEY: Final = "idempotency_documents_state_key"
DOCS_STATE_TIME: Final = "idempotency_documents_state_time"
DOCS_SUBJECT_TIME: Final = "idempotency_documents_subject_time"
DOCS_KIND_TIME: Final = "idempotency_documents_kind_time"
BACKFILL: Final = "idempotency_index_backfill"

#: The `expires` of a COMMITTED record whose `expires_at` text is not plain digits (an
#: exponent, NaN, Infinity, a negative number, a shape not found): every expiry select
#: reads it, and re-checks.
UNSURE: Final = -(2**62)
#: The `state` / `subject` of a document whose field could not be cut out for sure
#: (a nested value before it, an escape inside it): every select of that field reads it.
#: A BLOB, which no text a JSON string decodes to ever equals.
AMBIGUOUS: Final = b"\x00"

_DOCS_FROM = DOCUMENTS
_DOCS_TO = DOCUMENTS[:-1] + chr(ord(DOCUMENTS[-1]) + 1)  # the least key after the prefix
_RESULT_DICT = ',"result":{"t":"json","v":{'


def _flag(doc: str) -> str:
    # The top-level flag is always followed by the evidence: a nested copy of this exact
    # text (a receipt's own "needs_operator") can only add a record, re-checked on read.
    return f'instr({doc}, \',"needs_operator":true,"evidence":\') > 0'


def _expires_at(doc: str) -> str:
    # `expires_at` comes before `result`, after nothing nested (the key and the owner's
    # names are escaped strings, where `,"` cannot occur): the first one is the record's.
    return f"instr({doc}, ',\"expires_at\":')"


def _expires(doc: str) -> str:
    """The whole seconds of the record's `expires_at`, read from its JSON text: the
    integer its digits begin with (CAST reads the longest prefix that is one, the same in
    every SQLite version). A number written otherwise (an exponent: `1.5e-05`, `1e+20`;
    NaN, Infinity, a negative one) begins with fewer than two digits, so anything below 10
    is `UNSURE`; so is a text without the key. NULL for `null` (no expiry)."""
    return f"""(SELECT CASE WHEN p = 0 THEN {UNSURE} WHEN substr({doc}, p + 14, 1) = 'n' THEN NULL
        WHEN v < 10 THEN {UNSURE} ELSE v END
      FROM (SELECT p, CAST(substr({doc}, p + 14, 24) AS INTEGER) AS v
            FROM (SELECT {_expires_at(doc)} AS p)))"""


def _expiring(doc: str) -> str:
    # An entry is made unless `expires_at` is null: then `_expires` is never NULL.
    return f"substr({doc}, {_expires_at(doc)} + 14, 1) <> 'n'"


def _field(doc: str, name: str) -> str:
    """The document's top-level string field `name` (`document_field`), cut out of the
    JSON text: the first `"name":` after the document's opening brace is its own only if
    no bracket comes before it (no nested value begun) and a comma or the brace comes
    right before it (not the end of another key). NULL: the document has no such string
    field (then no select of it matches); `AMBIGUOUS`: not sure."""
    label = f'"{name}":'
    n = len(label)
    return f"""(SELECT CASE
        WHEN a = 0 THEN (CASE WHEN instr({doc}, '"t":"json"') > 0 THEN x'00' END)
        WHEN f = 0 THEN NULL
        WHEN substr(v, f - 1, 1) NOT IN (',', '{{') OR substr(v, 2, f - 2) GLOB '*[][{{}}]*'
            THEN x'00'
        WHEN substr(v, f + {n}, 1) <> '"' THEN NULL
        WHEN e = 0 OR instr(substr(v, f + {n} + 1, e - 1), '\\') > 0 THEN x'00'
        ELSE substr(v, f + {n} + 1, e - 1) END
      FROM (SELECT a, v, f, instr(substr(v, f + {n} + 1), '"') AS e
            FROM (SELECT a, v, instr(v, '{label}') AS f
                  FROM (SELECT a, substr({doc}, a + {len(_RESULT_DICT) - 1}) AS v
                        FROM (SELECT instr({doc}, '{_RESULT_DICT}') AS a)))))"""


def _kind(key: str) -> str:
    # The first segment under the documents' prefix, with its slash ('approval/'); '' for
    # a key with no second slash.
    start = len(DOCUMENTS) + 1
    return f"substr({key}, {start}, instr(substr({key}, {start}), '/'))"


def _in_documents(key: str) -> str:
    return f"{key} >= '{_DOCS_FROM}' AND {key} < '{_DOCS_TO}'"


_TABLES = f"""
CREATE TABLE IF NOT EXISTS {TIME} (
    status TEXT, updated_at REAL, key TEXT, PRIMARY KEY (status, updated_at, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS {FLAGGED} (
    updated_at REAL, key TEXT, status TEXT, PRIMARY KEY (updated_at, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS {EXPIRY} (
    expires INTEGER, updated_at REAL, key TEXT, PRIMARY KEY (expires, updated_at, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS {DOCS} (
    key TEXT PRIMARY KEY, kind TEXT, state, subject, updated_at REAL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS {DOCS_STATE_KEY} ON {DOCS} (state, key) WHERE state IS NOT NULL;
CREATE INDEX IF NOT EXISTS {DOCS_STATE_TIME} ON {DOCS} (state, updated_at)
    WHERE state IS NOT NULL;
CREATE INDEX IF NOT EXISTS {DOCS_SUBJECT_TIME} ON {DOCS} (subject, updated_at)
    WHERE subject IS NOT NULL;
CREATE INDEX IF NOT EXISTS {DOCS_KIND_TIME} ON {DOCS} (kind, updated_at);
CREATE TABLE IF NOT EXISTS {BACKFILL} (
    id INTEGER PRIMARY KEY CHECK (id = 1), done_through TEXT, holder TEXT, held_until REAL
)
"""


def _settled(row: str) -> str:
    return f"{row}.status IN ('{SETTLED[0]}', '{SETTLED[1]}')"


def _add(row: str) -> list[str]:
    """The statements that add `row`'s entries (`new` in a trigger)."""
    return [
        f"INSERT OR REPLACE INTO {TIME} (status, updated_at, key) "
        f"SELECT {row}.status, {row}.updated_at, {row}.key WHERE {_settled(row)}",
        f"INSERT OR REPLACE INTO {FLAGGED} (updated_at, key, status) "
        f"SELECT {row}.updated_at, {row}.key, {row}.status WHERE {_flag(f'{row}.doc')}",
        f"INSERT OR REPLACE INTO {EXPIRY} (expires, updated_at, key) "
        f"SELECT {_expires(f'{row}.doc')}, {row}.updated_at, {row}.key "
        f"WHERE {row}.status = 'COMMITTED' AND {_expiring(f'{row}.doc')}",
    ]


def _drop(row: str) -> list[str]:
    """The statements that remove `row`'s entries (`old` in a trigger): each a seek of
    its table's primary key, recomputed from the row."""
    return [
        f"DELETE FROM {TIME} WHERE {_settled(row)} AND status = {row}.status "
        f"AND updated_at = {row}.updated_at AND key = {row}.key",
        f"DELETE FROM {FLAGGED} WHERE {_flag(f'{row}.doc')} AND updated_at = {row}.updated_at "
        f"AND key = {row}.key",
        f"DELETE FROM {EXPIRY} WHERE {row}.status = 'COMMITTED' "
        f"AND expires = {_expires(f'{row}.doc')} AND updated_at = {row}.updated_at "
        f"AND key = {row}.key",
    ]


def _document(row: str) -> str:
    return (
        f"INSERT OR REPLACE INTO {DOCS} (key, kind, state, subject, updated_at) VALUES "
        f"({row}.key, {_kind(f'{row}.key')}, {_field(f'{row}.doc', 'state')}, "
        f"{_field(f'{row}.doc', 'key')}, {row}.updated_at)"
    )


def _trigger(name: str, event: str, body: list[str], when: str = "") -> str:
    condition = f" WHEN {when}" if when else ""
    statements = "".join(f"    {s};\n" for s in body)
    return (
        f"CREATE TRIGGER IF NOT EXISTS {name} AFTER {event} ON idempotency_records"
        f"{condition}\nBEGIN\n{statements}END"
    )


TRIGGERS: Final = {
    "idempotency_indexed_insert": _trigger("idempotency_indexed_insert", "INSERT", _add("new")),
    "idempotency_indexed_update": _trigger(
        "idempotency_indexed_update", "UPDATE", [*_drop("old"), *_add("new")]
    ),
    "idempotency_indexed_delete": _trigger("idempotency_indexed_delete", "DELETE", _drop("old")),
    # A key never changes: a document's row is replaced under its key, or removed.
    "idempotency_documents_insert": _trigger(
        "idempotency_documents_insert", "INSERT", [_document("new")], _in_documents("new.key")
    ),
    "idempotency_documents_update": _trigger(
        "idempotency_documents_update", "UPDATE", [_document("new")], _in_documents("new.key")
    ),
    "idempotency_documents_delete": _trigger(
        "idempotency_documents_delete",
        "DELETE",
        [f"DELETE FROM {DOCS} WHERE key = old.key"],
        _in_documents("old.key"),
    ),
}

#: Every object this module makes, by name: what `install` checks for.
OBJECTS: Final = (
    TIME, FLAGGED, EXPIRY, DOCS, DOCS_STATE_KEY, DOCS_STATE_TIME, DOCS_SUBJECT_TIME,
    DOCS_KIND_TIME, BACKFILL, *TRIGGERS,
)  # fmt: skip
_COUNT_OBJECTS = (
    f"SELECT count(*) FROM sqlite_master WHERE name IN ({', '.join('?' * len(OBJECTS))})"
)


def _statements(script: str) -> list[str]:
    return [s for s in (part.strip() for part in script.split(";\n")) if s]


def installed(conn: sqlite3.Connection) -> bool:
    """True when every object exists (they are made together, in one transaction)."""
    return bool(conn.execute(_COUNT_OBJECTS, OBJECTS).fetchone()[0] == len(OBJECTS))


def ready(conn: sqlite3.Connection) -> bool:
    """True when the index tables hold every record: installed, and no backfill left."""
    if not installed(conn):
        return False
    return conn.execute(f"SELECT 1 FROM {BACKFILL}").fetchone() is None


def install(conn: sqlite3.Connection) -> None:
    """Make the index tables and their triggers, if they are missing, in one write
    transaction that takes no longer than making empty tables: the records already there
    are left to `backfill` (none for a new ledger, which is then ready at once). Safe when
    many processes open the ledger at once: the first to take the write lock makes them,
    the others find them made."""
    if installed(conn):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        present = conn.execute(_COUNT_OBJECTS, OBJECTS).fetchone()[0]
        if present != len(OBJECTS):
            if present:
                # Only a hand that dropped one of them gets here; what is left may have
                # missed writes: start again from empty tables.
                for name in TRIGGERS:
                    conn.execute(f"DROP TRIGGER IF EXISTS {name}")
                for table in (TIME, FLAGGED, EXPIRY, DOCS, BACKFILL):
                    conn.execute(f"DROP TABLE IF EXISTS {table}")
            for statement in _statements(_TABLES):
                conn.execute(statement)
            for statement in TRIGGERS.values():
                conn.execute(statement)
            if conn.execute("SELECT 1 FROM idempotency_records LIMIT 1").fetchone():
                conn.execute(f"INSERT INTO {BACKFILL} (id) VALUES (1)")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


# -- backfill --------------------------------------------------------------------------

# A chunk's records, from the key after the last one done to `upto` (included): both
# bounds of one range of the primary key. INSERT OR IGNORE: an entry the triggers already
# made (a record written since they exist) is the same entry, made from the same row.
_FILL_WHERE = "key > coalesce(?1, '') AND key <= ?2"
_FILL = [
    f"INSERT OR IGNORE INTO {TIME} (status, updated_at, key) "
    f"SELECT status, updated_at, key FROM idempotency_records "
    f"WHERE {_FILL_WHERE} AND status IN ('{SETTLED[0]}', '{SETTLED[1]}')",
    f"INSERT OR IGNORE INTO {FLAGGED} (updated_at, key, status) "
    f"SELECT updated_at, key, status FROM idempotency_records "
    f"WHERE {_FILL_WHERE} AND {_flag('doc')}",
    f"INSERT OR IGNORE INTO {EXPIRY} (expires, updated_at, key) "
    f"SELECT {_expires('r.doc')}, r.updated_at, r.key FROM idempotency_records AS r "
    f"WHERE r.status = 'COMMITTED' AND {_expiring('r.doc')} AND "
    f"r.key > coalesce(?1, '') AND r.key <= ?2",
    f"INSERT OR IGNORE INTO {DOCS} (key, kind, state, subject, updated_at) "
    f"SELECT r.key, {_kind('r.key')}, {_field('r.doc', 'state')}, {_field('r.doc', 'key')}, "
    f"r.updated_at FROM idempotency_records AS r WHERE r.key > coalesce(?1, '') AND "
    f"r.key <= ?2 AND substr(r.key, 1, {len(DOCUMENTS)}) = '{DOCUMENTS}'",
]
# The last key of the next chunk: the keys only (the primary key's order).
_CHUNK_END = (
    "SELECT max(key), count(*) FROM (SELECT key FROM idempotency_records "
    "WHERE key > coalesce(?, '') ORDER BY key LIMIT ?)"
)

#: How long a backfill holds the work before another process may take it over.
LEASE_S: Final = 30.0


def backfill(conn: sqlite3.Connection, holder: str, rows: int) -> bool | None:
    """Add the next `rows` records to the index tables in one short write transaction.

    True: nothing is left (the tables are complete; the backfill row is gone). False:
    more to do. None: another process holds the work (`holder` names this one; a lease
    of `LEASE_S`, renewed with every chunk, so that many processes opening an upgraded
    ledger at once do not all build: those find it held by a read, without the write
    lock)."""
    if _held_by_another(conn.execute(_LEASE).fetchone(), holder):
        return None
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute(f"SELECT done_through, holder, held_until FROM {BACKFILL}").fetchone()
        if row is None:
            conn.execute("COMMIT")
            return True
        done_through, other, until = row
        if _held_by_another((other, until), holder):
            conn.execute("COMMIT")
            return None
        now = time.time()
        upto, count = conn.execute(_CHUNK_END, (done_through, rows)).fetchone()
        last = count < rows  # in this transaction, no key after `upto` can appear
        if count:
            for statement in _FILL:
                conn.execute(statement, (done_through, upto))
        if last:
            conn.execute(f"DELETE FROM {BACKFILL}")
        else:
            conn.execute(
                f"UPDATE {BACKFILL} SET done_through = ?, holder = ?, held_until = ?",
                (upto, holder, now + LEASE_S),
            )
        conn.execute("COMMIT")
        return last
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


_LEASE = f"SELECT holder, held_until FROM {BACKFILL}"


def _held_by_another(lease: tuple[str | None, float | None] | None, holder: str) -> bool:
    if lease is None:
        return False
    other, until = lease
    return other not in (None, holder) and until is not None and until > time.time()


def progress(conn: sqlite3.Connection) -> str | None:
    """The last key the backfill has added, or None (not begun, or nothing left)."""
    row = conn.execute(f"SELECT done_through FROM {BACKFILL}").fetchone()
    return None if row is None else row[0]
