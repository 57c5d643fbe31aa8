"""What this version keeps beside a ledger table, and adding it to a table made before:
the indexes the listings read by, the two functions some of them are made of, and the
change mark (a sequence a trigger moves).

The previous release writes the record's JSON `doc` and the columns, nothing more, and
refuses a table whose version row is above 1; so the version stays 1, and every object
here follows from what any release writes: partial indexes whose predicates and
expressions read `doc` as text, and a trigger, which fires for every writer's statements.
`doc` may hold NaN or Infinity, which jsonb refuses, so nothing here parses it as JSON:
the functions scan its text, return NULL for what they cannot read, and cannot raise, so
no write (an old writer's included) ever fails on an index. Model-written content inside
`doc` can at most make an index over-include a record (the reader checks every record it
yields against its `Select`), never hide one.

A table made by this version gets everything with the table (`create_with_table`, in the
migration's transaction). A table made before gets it from `build`, which one process at
a time runs (a session advisory lock taken with try, so nobody ever waits for it) on a
connection of its own: CREATE INDEX CONCURRENTLY, so claims go on while an index is
built; an index an interrupted build left INVALID is dropped and built again. Every object
is found by its name in the catalog (`inspect`); nothing records a version.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from ...ledger._backend import DOCUMENTS
from ...ledger._record import Status
from ._schema import MIGRATION_LOCK, Statements

log = logging.getLogger("crewai_idempotent")

#: The records flagged for a person. A record's own flag is the top-level
#: `"needs_operator":true`; the same text inside a receipt only over-includes.
NEEDS_OPERATOR = "strpos(doc, '\"needs_operator\":true') > 0"
#: The package's documents, written as the documents' index writes it (`LIKE` with `%`:
#: doubled where a statement takes parameters).
DOCUMENTS_ONLY = f"key LIKE '{DOCUMENTS}%'"
#: COMMITTED receipts that can expire: the record's own `expires_at` (the first in its
#: JSON, see `_EXPIRY_BODY`) is not null. A receipt kept for ever (no ttl: the default)
#: stays out of the expiry index, so its commit pays this test and no index entry.
EXPIRING = (
    "status = 'COMMITTED' AND substr(doc, strpos(doc, ',\"expires_at\":') + 14, 5) <> 'null,'"
)
STATUSES = tuple(status.value for status in Status)

DOCUMENT_FIELD = "crewai_idempotent_document_field_v1"
EXPIRY = "crewai_idempotent_expiry_v1"
TRIGGER = "crewai_idempotent_changes"
TRUNCATE_TRIGGER = "crewai_idempotent_truncated"

# Whitespace, as JSON allows it around tokens (the package's writers write none).
_SKIP_SPACE = """
    LOOP
      IF i > n THEN RETURN NULL; END IF;
      c := pg_catalog.get_byte(b, i - 1);
      EXIT WHEN c <> 32 AND c <> 9 AND c <> 10 AND c <> 13;
      i := i + 1;
    END LOOP;"""
# From just after an opening quote at i, on to the closing one (i ends on it): the next
# quote byte not escaped by an odd run of backslashes. `position` over the rest rather than
# a step per byte: a step of PL/pgSQL costs what copying a few hundred bytes does.
_TO_QUOTE = """
    LOOP
      j := pg_catalog.position(pg_catalog.substring(b, i), '"'::bytea);
      IF j = 0 THEN RETURN NULL; END IF;
      i := i + j - 1;
      k := i - 1;
      LOOP
        EXIT WHEN k < 1;
        EXIT WHEN pg_catalog.get_byte(b, k - 1) <> 92;
        k := k - 1;
      END LOOP;
      EXIT WHEN (i - 1 - k) % 2 = 0;
      i := i + 1;
    END LOOP;"""

# `document_field` in SQL: the raw JSON text (escapes kept, as the writer wrote them) of
# the string member `field` of the document a record holds (`result` = {"t": "json", "v":
# {...}}), or NULL. The top-level `,"result":` is the first: every field before it is a
# string (escaped), a number or an array of those. Then a walk of the document's members
# at depth one, skipping nested values whole, so a member of the same name nested in
# model-written content (an approval's summary) is never taken for it. Every index is
# checked against the length before a byte is read, so nothing here raises.
_DOCUMENT_FIELD_BODY = f"""
DECLARE
  b bytea := pg_catalog.textsend(doc);
  n integer := pg_catalog.length(b);
  target bytea := pg_catalog.textsend(field);
  i integer;
  j integer;
  k integer;
  c integer;
  s integer;
  e integer;
  depth integer;
BEGIN
  i := pg_catalog.position(b, ',"result":{{"t":"json","v":{{'::bytea);
  IF i = 0 THEN RETURN NULL; END IF;
  i := i + 27;
  -- Not named anywhere after: no member of that name (most documents, for one field).
  IF pg_catalog.position(pg_catalog.substring(b, i),
                         '"'::bytea || target || '"'::bytea) = 0 THEN
    RETURN NULL;
  END IF;
  LOOP{_SKIP_SPACE}
    IF c <> 34 THEN RETURN NULL; END IF;
    s := i + 1;
    i := s;{_TO_QUOTE}
    e := i;
    i := i + 1;{_SKIP_SPACE}
    IF c <> 58 THEN RETURN NULL; END IF;
    i := i + 1;{_SKIP_SPACE}
    IF e - s = pg_catalog.length(target) AND pg_catalog.substring(b, s, e - s) = target THEN
      IF c <> 34 THEN RETURN NULL; END IF;
      s := i + 1;
      i := s;{_TO_QUOTE}
      RETURN pg_catalog.substring(b, s, i - s);
    END IF;
    depth := 0;
    LOOP
      IF i > n THEN RETURN NULL; END IF;
      c := pg_catalog.get_byte(b, i - 1);
      IF c = 34 THEN
        s := i + 1;
        i := s;{_TO_QUOTE}
      ELSIF c = 123 OR c = 91 THEN
        depth := depth + 1;
      ELSIF c = 125 OR c = 93 THEN
        IF depth = 0 THEN RETURN NULL; END IF;
        depth := depth - 1;
      ELSIF c = 44 AND depth = 0 THEN
        i := i + 1;
        EXIT;
      END IF;
      i := i + 1;
    END LOOP;
  END LOOP;
END"""

# A record's `expires_at` as a number, for `expires_at <= t`: the first `,"expires_at":`
# is the top-level one (`"lease_expires_at"` has no quote before `expires_at`, and
# nothing before it nests), and its value ends at the next comma. A number float8 reads
# without error (at most 40 characters, and a 1- or 2-digit exponent: every epoch time
# Python writes) is read; NaN and null are NULL (Python's NaN <= t is
# False); anything else is indexed at most as large as it is (-Infinity for a negative,
# 0 for the rest), so a select may over-include it (and drops it on checking) but never
# misses it. strpos and split_part rather than a regular expression over the document,
# and no bounded repetition (`{1,40}`) in the one over the number (PostgreSQL's engine
# builds a state per repetition, every call): this runs on every commit.
_EXPIRY_BODY = r"""
DECLARE
  i integer := pg_catalog.strpos(doc, ',"expires_at":');
  m text;
BEGIN
  IF i = 0 THEN RETURN NULL; END IF;
  m := pg_catalog.split_part(pg_catalog.substr(doc, i + 14, 48), ',', 1);
  IF pg_catalog.length(m) <= 40
     AND m OPERATOR(pg_catalog.~) '^-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9][0-9]?)?$' THEN
    RETURN m::double precision;
  END IF;
  IF m = 'null' OR m = 'NaN' THEN RETURN NULL; END IF;
  IF m = 'Infinity' THEN RETURN 'Infinity'::double precision; END IF;
  IF pg_catalog.left(m, 1) = '-' THEN RETURN '-Infinity'::double precision; END IF;
  RETURN 0;
END"""


def quote(name: str) -> str:
    """A name as an SQL identifier, whatever it holds (a schema found in the catalog)."""
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def lock_key(label: str, what: str) -> int:
    """A bigint advisory lock key of one table's `what` (advisory locks are per database)."""
    digest = hashlib.sha256(f"crewai-idempotent {what} {label}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class Objects:
    """The names and statements of what this version keeps beside one table, in the
    table's own schema (`namespace`, as the catalog has it)."""

    def __init__(self, sql: Statements, namespace: str) -> None:
        self.sql = sql
        self.namespace = namespace
        ns = quote(namespace)
        self.document_field = f"{ns}.{quote(DOCUMENT_FIELD)}"
        self.expiry = f"{ns}.{quote(EXPIRY)}"
        self.sequence_name = f"{sql.base}_changes"
        self.sequence = f"{ns}.{quote(self.sequence_name)}"
        self.mark_function = f"{ns}.{quote(sql.base + '_changed')}"
        self.build_lock = lock_key(sql.label, "build")
        self.state = f"{self.document_field}(doc, 'state')"
        self.subject = f"{self.document_field}(doc, 'key')"
        self.expires = f"{self.expiry}(doc)"
        # The planner takes no statistics from a partial index's expression: without
        # these (PostgreSQL 14 and later) it guesses a third of the receipts expired,
        # and a purge that finds none reads the table through the primary key.
        self.statistics_name = f"{sql.base}_expiry_stats"
        self.create_statistics = (
            f"CREATE STATISTICS IF NOT EXISTS {ns}.{quote(self.statistics_name)} "
            f"ON ({self.expires}) FROM {sql.table}"
        )
        docs = f"WHERE {DOCUMENTS_ONLY}"
        # name -> what follows `ON table`; built in this order (the cheapest first).
        self.indexes: dict[str, str] = {
            sql.docs_index_bare: f"(key text_pattern_ops) {docs}",
            f"{sql.base}_flagged": f"(key text_pattern_ops) WHERE {NEEDS_OPERATOR}",
            f"{sql.base}_docs_time": f"(updated_at) {docs}",
            f"{sql.base}_state": f"({self.state}, key text_pattern_ops) {docs}",
            f"{sql.base}_subject": f"({self.subject}, key text_pattern_ops) {docs}",
            f"{sql.base}_expiry": f"({self.expires}) WHERE {EXPIRING}",
        }
        # What `changes()` reads: the sequence's value, then (correlated, so after it)
        # whether a writer holds the table's ROW EXCLUSIVE lock, which every INSERT,
        # UPDATE and DELETE takes before its rows (and trigger) and keeps until its
        # commit is visible. None holding it: every write the value counts is visible.
        self.read_mark = (
            "SELECT s.last_value, s.is_called, NOT EXISTS (SELECT FROM pg_catalog.pg_locks l "
            "WHERE l.locktype = 'relation' AND l.mode = 'RowExclusiveLock' AND l.granted "
            f"AND l.relation = {literal(f'{ns}.{quote(sql.table_name)}')}::pg_catalog.regclass "
            "AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d "
            "WHERE d.datname = pg_catalog.current_database()) "
            "AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid() "
            "AND s.last_value IS NOT NULL) "
            f"FROM {self.sequence} AS s"
        )

    def create_index(self, name: str, concurrently: bool) -> str:
        how = "CONCURRENTLY " if concurrently else ""
        return (
            f"CREATE INDEX {how}IF NOT EXISTS {quote(name)} ON {self.sql.table} "
            f"{self.indexes[name]}"
        )

    def drop_index(self, name: str) -> str:
        return f"DROP INDEX CONCURRENTLY IF EXISTS {quote(self.namespace)}.{quote(name)}"

    def functions(self) -> list[str]:
        """The two index functions (created if missing, under the migration lock)."""
        attributes = "LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE"
        return [
            f"CREATE OR REPLACE FUNCTION {self.document_field}(doc text, field text) "
            f"RETURNS bytea {attributes} AS $fn${_DOCUMENT_FIELD_BODY}$fn$",
            f"GRANT EXECUTE ON FUNCTION {self.document_field}(text, text) TO PUBLIC",
            f"CREATE OR REPLACE FUNCTION {self.expiry}(doc text) RETURNS double precision "
            f"{attributes} AS $fn${_EXPIRY_BODY}$fn$",
            f"GRANT EXECUTE ON FUNCTION {self.expiry}(text) TO PUBLIC",
        ]

    def mark(self) -> list[str]:
        """The sequence and the function its triggers run (no lock on the table)."""
        # Every writer's statement runs the trigger, so every role that writes the
        # ledger (an old release's included) may use the sequence and the function.
        return [
            f"CREATE SEQUENCE IF NOT EXISTS {self.sequence}",
            f"GRANT USAGE, SELECT ON SEQUENCE {self.sequence} TO PUBLIC",
            # An assignment, not PERFORM: PL/pgSQL evaluates it as a simple expression,
            # where PERFORM starts the executor (measured: a third of the trigger's cost).
            f"CREATE OR REPLACE FUNCTION {self.mark_function}() RETURNS trigger "
            "LANGUAGE plpgsql AS $fn$\nDECLARE\n  moved bigint;\nBEGIN\n"
            f"  moved := pg_catalog.nextval({literal(self.sequence)}::pg_catalog.regclass);\n"
            "  RETURN NULL;\nEND\n$fn$",
            f"GRANT EXECUTE ON FUNCTION {self.mark_function}() TO PUBLIC",
        ]

    def triggers(self) -> list[str]:
        """The triggers (each takes a SHARE ROW EXCLUSIVE lock on the table)."""
        return [
            f"CREATE TRIGGER {TRIGGER} AFTER INSERT OR UPDATE OR DELETE ON {self.sql.table} "
            f"FOR EACH ROW EXECUTE FUNCTION {self.mark_function}()",
            f"CREATE TRIGGER {TRUNCATE_TRIGGER} AFTER TRUNCATE ON {self.sql.table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {self.mark_function}()",
        ]

    def owned_by(self) -> str:
        """The sequence goes with the table when it is dropped (the table's owner only)."""
        return f"ALTER SEQUENCE {self.sequence} OWNED BY {self.sql.table}.key"


@dataclass(frozen=True, slots=True)
class Found:
    """What the catalog holds of one table's objects."""

    namespace: str
    valid: frozenset[str]  # indexes ready for reads
    invalid: frozenset[str]  # being built, or left by a build that was interrupted
    triggers: frozenset[str]
    functions: frozenset[str]
    sequence: bool
    statistics: frozenset[str]
    bytewise: bool  # the key column's collation orders text as bytes (code points)
    server_version: int

    def missing(self, objects: Objects) -> list[str]:
        """What is not there yet, by name (empty: ready)."""
        wanted = [name for name in objects.indexes if name not in self.valid]
        wanted += [name for name in (DOCUMENT_FIELD, EXPIRY) if name not in self.functions]
        if not self.sequence:
            wanted.append(objects.sequence_name)
        wanted += [name for name in (TRIGGER, TRUNCATE_TRIGGER) if name not in self.triggers]
        if self.expression_statistics and objects.statistics_name not in self.statistics:
            wanted.append(objects.statistics_name)
        return wanted

    @property
    def expression_statistics(self) -> bool:
        return self.server_version >= 140000

    @property
    def has_functions(self) -> bool:
        return DOCUMENT_FIELD in self.functions and EXPIRY in self.functions

    @property
    def has_mark(self) -> bool:
        return self.sequence and TRIGGER in self.triggers and TRUNCATE_TRIGGER in self.triggers


# Strings whose order under any linguistic collation differs from their byte order.
_COLLATION_PROBE = ["a", "B", "b", "A", "_", "-", ".", " ", "a b", "ab", "a-b", "Z", "z", "~"]

_INSPECT = """
SELECT n.nspname,
  ARRAY(SELECT ic.relname || CASE WHEN i.indisvalid THEN '' ELSE ' INVALID' END
        FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
        WHERE i.indrelid = c.oid),
  ARRAY(SELECT t.tgname FROM pg_catalog.pg_trigger t
        WHERE t.tgrelid = c.oid AND NOT t.tgisinternal),
  ARRAY(SELECT p.proname FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = c.relnamespace AND p.proname = ANY(%(functions)s)),
  EXISTS(SELECT FROM pg_catalog.pg_class s
         WHERE s.relnamespace = c.relnamespace AND s.relname = %(sequence)s
         AND s.relkind = 'S'),
  ARRAY(SELECT x FROM unnest(%(probe)s::text[]) AS x ORDER BY x),
  ARRAY(SELECT e.stxname FROM pg_catalog.pg_statistic_ext e WHERE e.stxrelid = c.oid),
  pg_catalog.current_setting('server_version_num')::integer
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = pg_catalog.to_regclass(%(table)s)
"""


def inspect(conn: psycopg.Connection[Any], sql: Statements) -> Found | None:
    """What the catalog holds of the table's objects; None when there is no table."""
    row = conn.execute(
        _INSPECT,
        {
            "table": sql.table,
            "functions": [DOCUMENT_FIELD, EXPIRY],
            "sequence": f"{sql.base}_changes",
            "probe": _COLLATION_PROBE,
        },
        prepare=False,
    ).fetchone()
    if row is None:
        return None
    namespace, indexes, triggers, functions, sequence, probe, statistics, version = row
    return Found(
        namespace=namespace,
        valid=frozenset(name for name in indexes if not name.endswith(" INVALID")),
        invalid=frozenset(
            name[: -len(" INVALID")] for name in indexes if name.endswith(" INVALID")
        ),
        triggers=frozenset(triggers),
        functions=frozenset(functions),
        sequence=bool(sequence),
        statistics=frozenset(statistics),
        bytewise=list(probe) == sorted(_COLLATION_PROBE),
        server_version=int(version),
    )


# Documents the functions read once they are created, in the same transaction: a
# function that raised would fail every write, so one that raises here is never kept.
_SAMPLES = [
    "",
    '{"v":1,"key":"k","lease_expires_at":null,"expires_at":NaN,"result":{"t":"json","v":'
    '{"a":[{"state":"x"}],"state":"S\\"","key":"k"}},"needs_operator":true}',
    '{"v":1,"expires_at":-Infinity,"result":{"t":"json","v":{"state":',
    *(f'{{"v":1,"expires_at":{n},' for n in ("1e400", "-1e-400", "9" * 400, "0.5", "1e-7")),
]


def _create_functions(conn: psycopg.Connection[Any], objects: Objects) -> None:
    for statement in objects.functions():
        conn.execute(statement)
    conn.execute(
        f"SELECT {objects.expiry}(d), {objects.document_field}(d, 'state') "
        "FROM unnest(%s::text[]) AS d",
        (_SAMPLES,),
    ).fetchall()


def create_with_table(conn: psycopg.Connection[Any], objects: Objects, found: Found) -> None:
    """Everything, in the transaction that created the (empty) table: plain CREATE
    INDEX, which costs nothing on an empty table. In a savepoint: if any of it fails
    (no PL/pgSQL in the database, say), the table is made all the same, and the
    backend's build says why later."""
    try:
        with conn.transaction():
            if not found.has_functions:
                _create_functions(conn, objects)
            for statement in [*objects.mark(), *objects.triggers(), objects.owned_by()]:
                conn.execute(statement)
            for name in objects.indexes:
                conn.execute(objects.create_index(name, concurrently=False))
            if found.expression_statistics:
                conn.execute(objects.create_statistics)
    except psycopg.Error as exc:
        log.warning("ledger table %s: its listing indexes were not created with it (%s)",
                    objects.sql.label, " ".join(str(exc).split()))  # fmt: skip


def build(
    conn: psycopg.Connection[Any],
    objects: Objects,
    stop: threading.Event,
) -> Found | None:
    """Create what the table lacks, on `conn`: autocommit, no statement timeout, holding
    the table's build lock (`objects.build_lock`), so nothing else builds them meanwhile
    and an INVALID index is one an interrupted build left. Returns what the catalog then
    holds. Raises psycopg's errors: `InsufficientPrivilege` when the role may not
    (not the table's owner, no CREATE on its schema)."""
    sql = objects.sql
    found = inspect(conn, sql)
    if found is None:
        return None
    if not found.has_functions or not found.has_mark:
        # Functions are shared by the schema's tables: created under the lock every
        # migration takes, so two tables' upgrades never race on one.
        with conn.transaction():
            conn.execute("SELECT pg_catalog.pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            again = inspect(conn, sql)
            if again is not None and not again.has_functions:
                _create_functions(conn, objects)
            for statement in objects.mark():
                conn.execute(statement)
    if not found.has_mark:
        _create_triggers(conn, objects, stop)
    found = inspect(conn, sql) or found
    built = False
    for name in objects.indexes:
        if stop.is_set():
            break
        if name in found.valid:
            continue
        if name in found.invalid:
            log.info("dropping the index %s that an interrupted build left INVALID", name)
            conn.execute(objects.drop_index(name))
        log.info("building the index %s of %s (CREATE INDEX CONCURRENTLY)", name, sql.label)
        conn.execute(objects.create_index(name, concurrently=True))
        built = True
    if found.expression_statistics and objects.statistics_name not in found.statistics:
        conn.execute(objects.create_statistics)
        built = True
    if built:
        # The planner knows an index expression's values only from ANALYZE: until
        # then it guesses a third of the rows expired and reads the primary key.
        log.info("analyzing %s for its new indexes", sql.label)
        conn.execute(f"ANALYZE {sql.table}")
    return inspect(conn, sql)


def _create_triggers(
    conn: psycopg.Connection[Any], objects: Objects, stop: threading.Event
) -> None:
    """CREATE TRIGGER waits for the writers in flight and, while it waits, holds back
    every write that comes after: so it waits at most 100 ms a try, and tries again."""
    for attempt in range(50):
        try:
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '100ms'")
                present = {
                    row[0]
                    for row in conn.execute(
                        "SELECT tgname FROM pg_catalog.pg_trigger WHERE tgrelid = "
                        "pg_catalog.to_regclass(%s) AND NOT tgisinternal",
                        (objects.sql.table,),
                    )
                }
                for name, statement in zip(
                    (TRIGGER, TRUNCATE_TRIGGER), objects.triggers(), strict=True
                ):
                    if name not in present:
                        conn.execute(statement)
                conn.execute(objects.owned_by())
            return
        except pg_errors.LockNotAvailable:
            if stop.wait(min(0.05 * (attempt + 1), 2.0)):
                return
    log.warning(
        "the ledger table %s stayed busy: its change mark's trigger was not created "
        "(tried again on the next start)",
        objects.sql.label,
    )


def statements_for_a_person(objects: Objects, found: Found | None) -> str:
    """What a role allowed to (the table's owner) runs to build them all, as pasted into
    psql: every statement on one line, `;`-separated."""
    again = [f"DROP TRIGGER IF EXISTS {name} ON {objects.sql.table}"
             for name in (TRIGGER, TRUNCATE_TRIGGER)]  # fmt: skip
    setup = [*objects.functions(), *objects.mark(), *again, *objects.triggers(),
             objects.owned_by()]  # fmt: skip
    indexes = [objects.create_index(name, concurrently=True) for name in objects.indexes]
    if found is None or found.expression_statistics:
        indexes.append(objects.create_statistics)
    indexes.append(f"ANALYZE {objects.sql.table}")
    return ";\n".join(" ".join(s.split()) if "$fn$" not in s else s for s in setup + indexes) + ";"
