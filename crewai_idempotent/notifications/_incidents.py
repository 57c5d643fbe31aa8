"""Ledger errors for a person: what a process does when its ledger does not answer.

An error from the store cannot be written to the store that gave it, so it is kept here
first: an incident per ledger in this process, counting the operations that failed from
the first to the last, with the last error, in memory and in a spool file on this host
(`CREWAI_IDEMPOTENCY_SPOOL`, else the user's state folder: `ledger-errors/<ledger>/`).
One thread per process looks at the ledgers with an open incident every few seconds;
the first time one answers, the incident goes into its outbox as one
"ledger.unavailable" entry (its id fixed by the incident's, so a retry or another
process writes it once) and its spool file goes. A spool file left by a process that died
meanwhile is put in the outbox by the next process on this host that clears an incident
for that ledger, or that dispatches its outbox. A sweeper that cannot read the ledger
adds its alert to the incident (`alerted`), so its `ledger_unreachable` comes this same
way, in the same entry, rather than through a second spool.

So an outage is said once it is over, from every process that met it, which is when the
ledger can hold the saying; while it lasts, the log (every failed call is logged as it
happens) and OpenTelemetry's `idempotency.ledger_errors` counter are what there is. A
spool that cannot be written (a read-only home) leaves the incident in memory only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from ..ledger._backend import CacheBackend, url_of

log = logging.getLogger("crewai_idempotent")

SPOOL_ENV = "CREWAI_IDEMPOTENCY_SPOOL"
PROBE_KEY = "crewai-idempotent/probe"
_PROBE_S = 5.0  # between looks at a ledger with an open incident
_SPOOL_EVERY_S = 5.0  # the spool file is rewritten at most this often while errors go on

_lock = threading.Lock()
_open: weakref.WeakKeyDictionary[CacheBackend, dict[str, Any]] = weakref.WeakKeyDictionary()
_watcher: threading.Thread | None = None
_wake = threading.Event()


def noted(backend: CacheBackend, error: BaseException) -> None:
    """The store behind `backend` failed an operation: count it in the open incident (or
    open one). Never raises: this runs on the way out of a failing call."""
    try:
        _note(backend, error)
    except Exception:
        log.debug("could not record a ledger error", exc_info=True)


def _note(backend: CacheBackend, error: BaseException) -> None:
    now = time.time()
    text = " ".join(str(error).split())[:500]
    with _lock:
        incident = _open.get(backend)
        if incident is None:
            incident = _open[backend] = _opened(backend, now, text)
        incident["count"] += 1
        incident["last_at"], incident["error"] = now, text
        spool = now - incident["spooled_at"] >= _SPOOL_EVERY_S
        if spool:
            incident["spooled_at"] = now
        snapshot = dict(incident)
        _ensure_watcher()
    if spool:
        _spool(snapshot)


def alerted(backend: CacheBackend, alert_id: str, reason: str) -> None:
    """A sweeper could not read the ledger behind `backend` and said so (`alert_id`,
    `reason`): its open incident carries the alert into the `ledger.unavailable` entry,
    spooled with it. The failed read usually opened the incident; an error the ledger
    does not count as an outage (another IdempotencyError) opens one here, which the
    watcher puts in the outbox as soon as the ledger answers its probe. Never raises: a
    sweep goes on whatever its alarms do."""
    try:
        now = time.time()
        text = " ".join(reason.split())[:500]
        with _lock:
            incident = _open.get(backend)
            if incident is None:
                incident = _open[backend] = _opened(backend, now, text)
                incident["count"] = 1
            if incident.get("alert_id") == alert_id:
                return  # said already: nothing new to spool
            incident["alert_id"], incident["alert"] = alert_id, text
            snapshot = dict(incident)
            _ensure_watcher()
        _spool(snapshot)
    except Exception:
        log.debug("could not record a sweeper's alert", exc_info=True)


def answered(backend: CacheBackend) -> None:
    """Something read the ledger behind `backend` again: the watcher looks at its open
    incident now, on its own thread, instead of at its next probe."""
    with _lock:
        waiting = backend in _open
    if waiting:
        _wake.set()


def _opened(backend: CacheBackend, now: float, text: str) -> dict[str, Any]:
    return {
        "id": secrets.token_hex(8), "ledger": url_of(backend), "host": socket.gethostname(),
        "pid": os.getpid(), "first_at": now, "last_at": now, "count": 0, "error": text,
        "spooled_at": 0.0,
    }  # fmt: skip


def _spool_dir(ledger: str) -> Path | None:
    base = os.environ.get(SPOOL_ENV, "").strip()
    if not base:
        try:
            import platformdirs

            base = str(Path(platformdirs.user_state_dir("crewai-idempotent")) / "ledger-errors")
        except Exception:  # noqa: BLE001 - no state folder: memory only
            return None
    return Path(base) / hashlib.sha256(ledger.encode()).hexdigest()[:16]


def _spool_file(incident: dict[str, Any]) -> Path | None:
    folder = _spool_dir(incident["ledger"])
    if folder is None:
        return None
    return folder / f"{incident['host']}-{incident['pid']}-{incident['id']}.json"


def _spool(incident: dict[str, Any]) -> None:
    path = _spool_file(incident)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temp = path.with_suffix(f".{secrets.token_hex(4)}.tmp")
        temp.write_text(json.dumps({k: v for k, v in incident.items() if k != "spooled_at"}))
        os.replace(temp, path)
    except OSError:
        log.debug("could not write the ledger-error spool %s", path, exc_info=True)


def _ensure_watcher() -> None:
    global _watcher
    if _watcher is not None and _watcher.is_alive():
        return
    _watcher = threading.Thread(target=_watch, name="crewai-idempotent-ledger-errors", daemon=True)
    _watcher.start()


def _watch() -> None:
    while True:
        _wake.wait(_PROBE_S)
        _wake.clear()
        with _lock:
            waiting = list(_open.items())
        if not waiting:
            return  # the next incident starts a new watcher
        for backend, incident in waiting:
            if _cleared(backend, dict(incident)):
                with _lock:
                    if _open.get(backend) is incident:
                        del _open[backend]


def _cleared(backend: CacheBackend, incident: dict[str, Any]) -> bool:
    """Put the incident in the outbox if the ledger answers now; whether it did."""
    try:
        backend.get(PROBE_KEY)
        _put(backend, incident)
    except Exception:  # noqa: BLE001 - still down, or closed: looked at again later
        return False
    path = _spool_file(incident)
    if path is not None:
        path.unlink(missing_ok=True)
    flush_spools(backend)
    return True


def _put(backend: CacheBackend, incident: dict[str, Any]) -> None:
    from ._outbox import put

    data = {
        "ledger": incident["ledger"], "host": incident["host"], "process": incident["pid"],
        "first_at": incident["first_at"], "last_at": incident["last_at"],
        "count": incident["count"], "error": incident["error"],
    }  # fmt: skip
    if incident.get("alert_id"):  # a sweeper could not read the ledger, and said so
        data["alert"], data["alert_id"] = incident.get("alert"), incident["alert_id"]
    put(backend, "ledger.unavailable", data, dedupe=f"{incident['host']}:{incident['id']}")


def flush_spools(backend: CacheBackend) -> int:
    """Put in the outbox the incidents that processes of this host which are gone left in
    their spool files for `backend`'s ledger; how many."""
    folder = _spool_dir(url_of(backend))
    if folder is None or not folder.is_dir():
        return 0
    host, done = socket.gethostname(), 0
    for path in folder.glob("*.json"):
        try:
            incident = json.loads(path.read_text())
            if incident.get("host") != host or _alive(int(incident["pid"])):
                continue  # another host's (a shared home), or still open in its process
            _put(backend, incident)
            path.unlink(missing_ok=True)
            done += 1
        except (OSError, ValueError, KeyError, TypeError):
            log.debug("could not flush the spool file %s", path, exc_info=True)
    return done


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _forget_in_child() -> None:
    global _lock, _watcher, _wake
    _lock, _watcher, _wake = threading.Lock(), None, threading.Event()
    _open.clear()  # the parent's incidents are the parent's to say


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
