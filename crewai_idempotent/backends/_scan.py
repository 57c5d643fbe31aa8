"""What the stores' scans read: the seam that shows a scan costs what it finds.

Every store reads a scan in batches of at most `BATCH` records (one statement or one
round trip each, the connection given back between them) and yields each batch's records
before it reads the next, so a scan holds one batch, whatever the ledger holds.
`ScanCounter` counts what the batches read, and each store's `scan_stats()` returns it.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass

#: Records read per statement or round trip of a scan.
BATCH = 500


@dataclass(frozen=True, slots=True)
class ScanStats:
    """What a backend's scans have read in this process since it was made
    (`scan_stats()` of each store). `rows`: the records (rows, hashes, files) its scans
    read from the store, those a filter then dropped included. `batches`: the
    statements, round trips or folder listings they took."""

    rows: int
    batches: int


class ScanCounter:
    """The running totals behind `ScanStats`, safe to share between threads (and across
    fork(): a child gets a fresh lock, in case a thread of the parent held it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows = 0
        self._batches = 0
        _counters.add(self)

    def read(self, rows: int, batches: int = 1) -> None:
        with self._lock:
            self._rows += rows
            self._batches += batches

    def stats(self) -> ScanStats:
        with self._lock:
            return ScanStats(self._rows, self._batches)


_counters: weakref.WeakSet[ScanCounter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for counter in list(_counters):
        counter._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
