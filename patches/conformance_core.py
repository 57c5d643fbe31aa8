"""pytest plugin for patches/verify.sh: the ledger conformance suite on crewAI core's store.

tests/core/test_ledger_conformance.py drives crewai-idempotent's Ledger through every
transition; here its backend is the patched crewAI's `SQLiteIdempotencyBackend`, seen
through the plugin's `CacheBackend` interface. The two share one record document and one
table, so each record crosses as its JSON: any drift in the document, the claim, the
compare-and-set or the scan between the patch and the package fails the suite.
Selected with CONFORMANCE_BACKENDS=crewai-core (tests/support/stores.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

KIND = "crewai-core"


def _core_factory(tmp_path: Path) -> Callable[[], Any]:
    from crewai.tools.idempotency.backends import SQLiteIdempotencyBackend
    from crewai.tools.idempotency.record import IdempotencyRecord, IdempotencyStatus

    from crewai_idempotent import CacheBackend, Record, Status
    from crewai_idempotent.ledger._hostclock import this_host

    def to_core(record: Record) -> IdempotencyRecord:
        return IdempotencyRecord.from_json(record.to_json())

    def to_plugin(record: IdempotencyRecord | None) -> Record | None:
        return None if record is None else Record.from_json(record.to_json())

    class CoreBackend(CacheBackend):
        """crewAI core's SQLite store behind the plugin's backend interface."""

        def __init__(self, path: Path) -> None:
            self.core = SQLiteIdempotencyBackend(path)
            # The core's store judges leases and TTLs by the host's clock, as the plugin's
            # embedded stores do: the same kernel clocks, seen through the plugin's type,
            # so host deadlines cross in the shared document both ways.
            self.host_clock = this_host() if self.core.host_clock is not None else None

        def __repr__(self) -> str:
            return f"CoreBackend({self.core!r})"

        def now(self) -> float:
            return float(self.core.now())

        def insert(self, record: Record) -> Record | None:
            return to_plugin(self.core.insert(to_core(record)))

        def replace(self, current: Record, new: Record) -> bool:
            return bool(self.core.replace(to_core(current), to_core(new)))

        def get(self, key: str) -> Record | None:
            return to_plugin(self.core.get(key))

        def scan(self, status: Status | None = None) -> Iterator[Record]:
            wanted = IdempotencyStatus(status.value) if status is not None else None
            for record in self.core.scan(wanted):
                found = to_plugin(record)
                assert found is not None
                yield found

        def delete(self, current: Record) -> bool:
            return bool(self.core.delete(to_core(current)))

        def close(self) -> None:
            self.core.close()

    path = tmp_path / "core-ledger.db"

    class Factory:
        # Child processes open the same file with the plugin's SQLite backend: one table,
        # one document, so what either writes the other reads.
        url = f"sqlite:///{path}"

        def __call__(self) -> CacheBackend:
            return CoreBackend(path)

    return Factory()


@pytest.fixture
def store_crewai_core(tmp_path: Path) -> Callable[[], Any]:
    # tests/conftest.py opens the store of kind K through the fixture `store_K`.
    return _core_factory(tmp_path)
