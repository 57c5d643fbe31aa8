"""The PostgreSQL ledger's table: its SQL, its version, and migrating it.

One row per key; the record itself is the JSON `doc`, and `status`, `token`, `revision`
and `updated_at` are copied out of it for the compare-and-set and for listing by status.
Each ledger table's version is a row of `crewai_idempotency_schema` in the same schema.
Migrations run under one advisory lock, so many workers can start at once, and a table
newer than this code is refused rather than written in a format it does not know.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._errors import LedgerUnavailable
from ...ledger._backend import DOCUMENTS

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("crewai_idempotent")

SCHEMA_VERSION = 1
DEFAULT_TABLE = "crewai_idempotency_records"
#: One row per ledger table: (table_name, version). Lives in the same schema as the table.
VERSIONS_TABLE = "crewai_idempotency_schema"
# pg_advisory_xact_lock key that serialises migrations of every crewai-idempotent table
# (and the creation of the functions their indexes share: `_upgrade`).
MIGRATION_LOCK = int.from_bytes(
    hashlib.sha256(b"crewai-idempotent migrate").digest()[:8], "big", signed=True
)

# Statements that bring a table from version N-1 to version N.
_MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE IF NOT EXISTS {table} (
            key        TEXT PRIMARY KEY,
            status     TEXT NOT NULL,
            token      BIGINT NOT NULL,
            revision   BIGINT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            doc        TEXT NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS {index} ON {table} (status, updated_at)",
        # The package's own documents (the outbox, approvals, caps) by key, compared as
        # bytes whatever the database's collation: `scan_prefix` for them is a range of
        # this small index. Tables made before it lack it (`Statements.scans`).
        "CREATE INDEX IF NOT EXISTS {docs_index} ON {table} (key text_pattern_ops) "
        f"WHERE key LIKE '{DOCUMENTS}%'",
    ],
}


def identifier(name: str, what: str) -> str:
    """Quote a table or schema name, refusing anything but a plain identifier."""
    if (
        not isinstance(name, str)
        or not name
        or len(name.encode()) > 63
        or not (name[0].isalpha() or name[0] == "_")
        or not all(c.isalnum() or c == "_" for c in name)
        or not name.isascii()
    ):
        raise ValueError(
            f"{what} must be a plain identifier (letters, digits and _, at most 63 bytes), "
            f"not {name!r}"
        )
    return f'"{name}"'


class Statements:
    """The SQL for one table, rendered once."""

    def __init__(self, table: str, schema: str | None) -> None:
        self.table_name, self.schema_name = table, schema
        prefix = f"{identifier(schema, 'schema')}." if schema is not None else ""
        self.label = f"{schema}.{table}" if schema is not None else table
        t = self.table = prefix + identifier(table, "table")
        digest = hashlib.sha256(self.label.encode()).hexdigest()[:8]
        #: What every object of this table is named from (`_upgrade.Objects`).
        self.base = f"{table[:40]}_{digest}"
        self.index = identifier(f"{self.base}_status", "index")
        versions = prefix + identifier(VERSIONS_TABLE, "table")
        self.create_versions = (
            f"CREATE TABLE IF NOT EXISTS {versions} ("
            "table_name TEXT PRIMARY KEY, version INTEGER NOT NULL, "
            "migrated_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        self.version = f"SELECT version FROM {versions} WHERE table_name = %s"
        self.set_version = (
            f"INSERT INTO {versions} (table_name, version) VALUES (%s, %s) "
            "ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, migrated_at = now()"
        )
        # One statement: the insert-if-absent, and the holder when the key is taken.
        # No row back means the holder committed after this statement's snapshot.
        self.claim = (
            f"WITH claimed AS (INSERT INTO {t} (key, status, token, revision, updated_at, doc) "
            "VALUES (%(key)s, %(status)s, %(token)s, %(revision)s, %(updated_at)s, %(doc)s) "
            "ON CONFLICT (key) DO NOTHING RETURNING key) "
            "SELECT NULL::text FROM claimed UNION ALL "
            f"SELECT doc FROM {t} WHERE key = %(key)s AND NOT EXISTS (SELECT FROM claimed)"
        )
        update = (
            f"UPDATE {t} SET status = %(status)s, token = %(token)s, revision = %(revision)s, "
            "updated_at = %(updated_at)s, doc = %(doc)s WHERE key = %(key)s AND "
        )
        self.replace = (
            update + "((token = %(current_token)s AND revision = %(current_revision)s) OR "
            "(token = %(token)s AND revision = %(revision)s AND doc = %(doc)s))"
        )
        self.get = f"SELECT doc FROM {t} WHERE key = %s"
        self.delete = f"DELETE FROM {t} WHERE key = %s AND token = %s AND revision = %s"
        # A batch of deletes as one statement (one commit): each row is deleted only if it
        # is still as read, as `delete` does one at a time; the keys deleted come back.
        self.delete_many = (
            f"DELETE FROM {t} AS r USING unnest(%s::text[], %s::bigint[], %s::bigint[]) "
            "AS d(key, token, revision) WHERE r.key = d.key AND r.token = d.token AND "
            "r.revision = d.revision RETURNING r.key"
        )
        # Prefix scans compare bytes (text_pattern_ops' operators, and C order): under a
        # linguistic collation a range of the primary key is not a prefix. The documents'
        # clause is written out, so the planner matches it to the partial index.
        self.docs_index_bare = f"{self.base}_docs"
        self.docs_index = identifier(self.docs_index_bare, "index")
        self.docs_index_name = prefix + self.docs_index
        self.create_docs_index = (
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {self.docs_index} ON {t} "
            f"(key text_pattern_ops) WHERE key LIKE '{DOCUMENTS}%'"
        )
        # Every scan reads a batch per statement (`LIMIT`), the first from its start, each
        # later one after the last key read: keyset pagination on the key, which never
        # changes, so a record that stays is read once however often it is written.
        # `scans[kind, first]` takes the kind's own parameters, the start (or the last key
        # read) and the batch size. All records and a status go in the primary key's order
        # (the database's collation): the primary key serves the first, and the second
        # either the (status, updated_at) index and a sort of that status's rows (a rare
        # status: what the sweeper asks for) or the primary key filtered by status (a
        # common one); the planner chooses, as each statement is planned for its values.
        # Prefixes go in byte order, the documents' from their partial index (another
        # prefix is read whole: `PostgresCacheBackend.scan_prefix`).
        select = f"SELECT key, doc FROM {t} WHERE "
        docs = f"key LIKE '{DOCUMENTS}%%' AND "
        self.scans = {
            (kind, first): select + where.format(op=">=" if first else ">")
            + (" ORDER BY key LIMIT %s" if kind in ("all", "status") else
               " ORDER BY key USING ~<~ LIMIT %s")
            for kind, where in (
                ("all", "key {op} %s"),
                ("status", "status = %s AND key {op} %s"),
                ("documents", docs + "key ~<~ %s AND key ~{op}~ %s"),
                ("range", "key ~<~ %s AND key ~{op}~ %s"),
                ("from", "key ~{op}~ %s"),
            )
            for first in (True, False)
        }  # fmt: skip


def check_version(version: int, sql: Statements, where: str) -> None:
    """Refuse a table written by a newer crewai-idempotent."""
    if version > SCHEMA_VERSION:
        raise LedgerUnavailable(
            f"ledger table {sql.label} at {where} has schema version {version}; "
            f"this crewai-idempotent understands up to {SCHEMA_VERSION}: a newer "
            "crewai-idempotent wrote it"
        )


def migrate(
    conn: psycopg.Connection[Any],
    sql: Statements,
    where: str,
    with_new_table: Callable[[psycopg.Connection[Any]], None] | None = None,
) -> None:
    """Create the table, or bring it to SCHEMA_VERSION, in one transaction.
    `with_new_table` runs in that transaction when it created the table."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        if sql.schema_name is not None:
            conn.execute(f"CREATE SCHEMA IF NOT EXISTS {identifier(sql.schema_name, 'schema')}")
        conn.execute(sql.create_versions)
        row = conn.execute(sql.version, (sql.table_name,)).fetchone()
        version = row[0] if row else 0
        check_version(version, sql, where)
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (sql.table,)).fetchone()
        for step in range(version + 1, SCHEMA_VERSION + 1):
            for statement in _MIGRATIONS[step]:
                conn.execute(
                    statement.format(table=sql.table, index=sql.index, docs_index=sql.docs_index)
                )
        if with_new_table is not None and exists is not None and not exists[0]:
            with_new_table(conn)
        conn.execute(sql.set_version, (sql.table_name, SCHEMA_VERSION))
    if row is None or row[0] != SCHEMA_VERSION:
        log.info("ledger table %s at %s is at schema version %d", sql.label, where,
                 SCHEMA_VERSION)  # fmt: skip
