"""The stored JSON of a record, read and written behind the ledger's back: a SQL UPDATE
(SQLite, PostgreSQL) or an HSET (Redis), as a forger holding the store's credentials
would, so that nothing of the package sees or checks the write."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from crewai_idempotent.signing import Signer


class Stored:
    """One store's documents by key, edited directly."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.kind = urlsplit(url).scheme.split("+")[0]

    def read(self, key: str) -> dict[str, Any]:
        text = self._read(key)
        assert text is not None, f"no stored document for {key!r}"
        return json.loads(text)  # type: ignore[no-any-return]

    def write(self, key: str, doc: dict[str, Any]) -> None:
        self._write(key, json.dumps(doc), str(doc["status"]))

    def _read(self, key: str) -> str | None:
        if self.kind == "sqlite":
            with sqlite3.connect(self._path()) as conn:
                row = conn.execute(
                    "SELECT doc FROM idempotency_records WHERE key = ?", (key,)
                ).fetchone()
            return None if row is None else str(row[0])
        if self.kind == "postgresql":
            import psycopg

            with psycopg.connect(self._dsn()) as conn:
                row = conn.execute(
                    f'SELECT doc FROM "{self._table()}" WHERE key = %s', (key,)
                ).fetchone()
            return None if row is None else str(row[0])
        client = self._redis()
        value = client.hget(self._redis_key(key), "doc")
        return None if value is None else value.decode()

    def _write(self, key: str, text: str, status: str) -> None:
        if self.kind == "sqlite":
            with sqlite3.connect(self._path()) as conn:
                conn.execute(
                    "UPDATE idempotency_records SET doc = ?, status = ? WHERE key = ?",
                    (text, status, key),
                )
            return
        if self.kind == "postgresql":
            import psycopg

            with psycopg.connect(self._dsn()) as conn:
                conn.execute(
                    f'UPDATE "{self._table()}" SET doc = %s, status = %s WHERE key = %s',
                    (text, status, key),
                )
            return
        self._redis().hset(self._redis_key(key), "doc", text)

    def _path(self) -> Path:
        return Path(urlsplit(self.url).path[1:].split("?")[0])

    def _table(self) -> str:
        return parse_qs(urlsplit(self.url).query)["table"][0]

    def _dsn(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}{parts.path}"

    def _redis(self) -> Any:
        import redis

        parts = urlsplit(self.url)
        return redis.Redis(host=parts.hostname, port=parts.port)

    def _redis_key(self, key: str) -> str:
        return parse_qs(urlsplit(self.url).query)["prefix"][0] + "r:" + key


def resolve_forged(doc: dict[str, Any], *, by: str, signer: Signer | None = None) -> dict[str, Any]:
    """`doc` (an UNCERTAIN record's JSON) as a forger writes a resolution absent into the
    store: FAILED, a resolve event, the resolution's mark and, with `signer`, a decision
    signed by that key (a key the workers do not trust, say). Its revision stays: the store
    keeps it in a column of its own (a field of the Redis hash), which the forger leaves."""
    from crewai_idempotent.signing import Decision

    events = doc["history"]
    at = events[-1][0] + 1.0
    seq = len(events)  # no cut in these short histories
    forged = {
        **doc,
        "status": "FAILED",
        "error": f"resolved absent by {by}: forged",
        "history": [*events, [at, "resolve", doc["token"], by, "absent: forged"]],
        "resolved": seq,
    }
    if signer is not None:
        decision = Decision.absent(
            key=doc["key"], token=doc["token"], by=signer.identity, via="cli", at=at
        )
        forged["signed"] = [[seq, decision.to_json(), signer.sign(decision).to_json()]]
    return forged
