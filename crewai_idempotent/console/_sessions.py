"""Console sessions, kept in the ledger next to the accounts.

The browser holds a random token (256 bits) in an HttpOnly, SameSite=Strict cookie; the
ledger holds only its SHA-256, so reading the ledger gives no session away. A session
document names its account and the account's `generation` when it began (a password
change, a disabled or removed account ends it), the CSRF token every form must send back,
and when it ends: `ttl_s` after login at the latest, or after `idle_s` without a request.
Its record expires then too, so `crewai-idempotent purge` deletes sessions nobody ended;
the console also sweeps them.

Server-side sessions rather than signed cookies: logging out, disabling an account or
changing a password ends its sessions at once, on every host, and no signing key has to
be shared between console processes.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ..gates import _gatestore
from ..ledger._backend import CacheBackend
from ..ledger._record import Status

PREFIX = f"{_gatestore.PREFIX}console/session/"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{43}$")
TOUCH_S = 60.0  # a request writes `seen_at` at most this often


@dataclass(frozen=True, slots=True)
class Session:
    key: str
    account: str
    generation: int
    csrf: str
    via: str  # how the identity was established: "password" or "auth proxy"
    created_at: float
    expires_at: float
    seen_at: float


def _key(token: str) -> str:
    return PREFIX + hashlib.sha256(token.encode("ascii")).hexdigest()


def _session(key: str, d: dict[str, Any]) -> Session:
    return Session(
        key=key, account=d["account"], generation=int(d["generation"]), csrf=d["csrf"],
        via=d["via"], created_at=d["created_at"], expires_at=d["expires_at"],
        seen_at=d["seen_at"],
    )  # fmt: skip


class Sessions:
    def __init__(self, backend: CacheBackend, *, ttl_s: float, idle_s: float) -> None:
        self.backend = backend
        self.ttl_s = ttl_s
        self.idle_s = idle_s

    def start(self, account: str, generation: int, via: str) -> tuple[str, Session]:
        """A new session: the token for the cookie, and what the ledger keeps."""
        token = secrets.token_urlsafe(32)
        key = _key(token)
        now = self.backend.now()
        doc: dict[str, Any] = {
            "kind": "console-session", "account": account, "generation": generation,
            "csrf": secrets.token_urlsafe(32), "via": via, "created_at": now,
            "expires_at": now + self.ttl_s, "seen_at": now,
        }  # fmt: skip

        def create(current: dict[str, Any] | None, now: float) -> dict[str, Any]:
            if current is not None:  # 2**256 tokens: never, but never reuse one either
                raise RuntimeError("session token collision")
            return doc

        _gatestore.update(self.backend, key, create, expires_at=doc["expires_at"])
        return token, _session(key, doc)

    def find(self, token: str | None, *, touch: bool = True) -> Session | None:
        """The live session of `token`, or None (an ended one is deleted on the way).
        `touch`: this request counts as activity (a person's; a page's live updates do
        not, so an open tab nobody looks at still ends after `idle_s`)."""
        if not token or not _TOKEN.match(token):
            return None
        key = _key(token)
        doc = _gatestore.read(self.backend, key)
        if doc is None or doc.get("kind") != "console-session":
            return None
        session = _session(key, doc)
        now = self.backend.now()
        if now >= session.expires_at or now - session.seen_at >= self.idle_s:
            self._delete(key)
            return None
        if touch and now - session.seen_at >= TOUCH_S:
            self._touch(key, now)
        return session

    def end(self, session: Session) -> None:
        self._delete(session.key)

    def sweep(self) -> int:
        """Delete every session that has ended; how many."""
        now = self.backend.now()
        removed = 0
        # The sessions' own documents only (each store's index of documents): a sweep that
        # read every record would cost what the ledger holds, at every sweep.
        for record in list(self.backend.scan_prefix(PREFIX)):
            if record.status is not Status.COMMITTED or not _gatestore.is_document(record):
                continue
            try:
                doc = _gatestore.read(self.backend, record.key)
            except Exception:  # noqa: BLE001 - a corrupt session is not a live one
                doc = None
            idle = doc is not None and now - float(doc.get("seen_at", 0)) >= self.idle_s
            if (doc is None or idle or now >= float(doc.get("expires_at", 0))) and (
                self.backend.delete(record)
            ):
                removed += 1
        return removed

    def _touch(self, key: str, now: float) -> None:
        def change(doc: dict[str, Any] | None, at: float) -> dict[str, Any]:
            if doc is None:
                raise _gatestore.Unchanged(None)
            return {**doc, "seen_at": now}

        current = _gatestore.read(self.backend, key)
        if current is not None:
            _gatestore.update(self.backend, key, change, expires_at=current["expires_at"])

    def _delete(self, key: str) -> None:
        record = self.backend.get(key)
        if record is not None:
            self.backend.delete(record)
