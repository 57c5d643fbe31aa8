"""`export`, `purge` and `purge --all`'s count stream the ledger: what they hold is one batch
of the store's scan, not the ledger. Counted as Record objects alive (`gc`), never as RSS or
time; `ls` keeps listing oldest update first, as its help says."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from crewai_idempotent import Ledger, Record, SQLiteCacheBackend, Status
from crewai_idempotent.backends._scan import BATCH
from crewai_idempotent.cli import _ledger as cli_ledger
from crewai_idempotent.cli import main


def _records_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Record))


@pytest.fixture
def ledger_url(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    yield f"sqlite:///{path}"
    backend.close()


def _fill(url: str, count: int, ttl_passed: bool = False) -> None:
    backend = SQLiteCacheBackend(Path(url.removeprefix("sqlite:///")), synchronous="NORMAL")
    try:
        now = backend.now()
        for i in range(count):
            # Keys in the reverse of their update order: a key-ordered scan differs from
            # the oldest-first listing.
            key, at = f"order:{count - i:05d}", now - 1000 + i * 0.01
            expires = now - 1 if ttl_passed else None
            record = Record(key, Status.COMMITTED, "fp", 1, 1, None, 1, at, at,
                            result={"k": key}, expires_at=expires)  # fmt: skip
            assert backend.insert(record) is None
    finally:
        backend.close()


class _Watching:
    """Counts the Record objects alive every `every` calls of what it wraps."""

    def __init__(self, wrapped: Any, every: int) -> None:
        self.wrapped, self.every, self.calls, self.most = wrapped, every, 0, 0
        self.baseline = _records_alive()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls % self.every == 0:
            self.most = max(self.most, _records_alive() - self.baseline)
        return self.wrapped(*args, **kwargs)


@pytest.mark.parametrize("count", [BATCH * 3, BATCH * 6])
def test_export_holds_a_batch_whatever_the_ledger_holds(
    ledger_url: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(ledger_url, count)
    lines: list[str] = []
    watching = _Watching(lambda text, *a, **k: lines.append(text), BATCH // 2)
    monkeypatch.setattr(cli_ledger.click, "echo", watching)
    done = CliRunner().invoke(main, ["--ledger", ledger_url, "export"])
    assert done.exit_code == 0, done.output
    assert len(lines) == count
    assert {json.loads(line)["key"] for line in lines} == {
        f"order:{i:05d}" for i in range(1, count + 1)
    }
    assert watching.most <= BATCH  # a list of the ledger would hold `count`


@pytest.mark.parametrize("count", [BATCH * 3, BATCH * 6])
def test_purge_holds_a_batch_whatever_the_ledger_holds(
    ledger_url: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(ledger_url, count, ttl_passed=True)
    watching = _Watching(SQLiteCacheBackend.delete_many, 1)
    sizes: list[int] = []

    def deleting(self: SQLiteCacheBackend, records: list[Record]) -> list[bool]:
        sizes.append(len(records))
        return watching(self, records)  # type: ignore[no-any-return]

    monkeypatch.setattr(SQLiteCacheBackend, "delete_many", deleting)
    done = CliRunner().invoke(main, ["--ledger", ledger_url, "purge"])
    assert done.exit_code == 0, done.output
    assert f"purged {count} record(s)" in done.output
    # One write per hundred records (one commit each), never the ledger at once.
    assert sum(sizes) == count and max(sizes) == 100 and len(sizes) == count // 100
    assert watching.most <= BATCH


def test_ls_lists_oldest_update_first_though_the_store_scans_by_key(ledger_url: str) -> None:
    _fill(ledger_url, 5)
    done = CliRunner().invoke(main, ["--ledger", ledger_url, "ls", "--json"])
    assert done.exit_code == 0, done.output
    keys = [row["key"] for row in json.loads(done.output)]
    assert keys == [f"order:{i:05d}" for i in (5, 4, 3, 2, 1)]


def test_a_purge_waits_out_a_store_busy_with_claims_instead_of_stopping_half_way() -> None:
    """SQLite's write lock taken past its busy timeout by a stream of claims: the purge
    asks again after a pause and deletes every expired receipt; a store that stays
    unavailable still stops it with the store's error."""
    from crewai_idempotent import InMemoryCacheBackend, LedgerUnavailable

    class Busy(InMemoryCacheBackend):
        def __init__(self, refusals: int) -> None:
            super().__init__()
            self.refusals = refusals
            self.host_clock = None  # expiry judged by now() alone, which the test moves

        def delete_many(self, records: Sequence[Record]) -> list[bool]:
            if self.refusals:
                self.refusals -= 1
                raise LedgerUnavailable("the database stayed locked past the busy timeout")
            return super().delete_many(records)

    for refusals, purged in ((3, 4), (100, None)):
        backend = Busy(0)
        ledger = Ledger(backend, ttl=1)
        clock = backend.now()
        for i in range(4):
            ledger.run(f"pay:{i}", lambda: "ok")
        backend.refusals = refusals
        later = clock + 10
        backend.now = lambda later=later: later  # type: ignore[method-assign]
        if purged is None:
            with pytest.raises(LedgerUnavailable):
                ledger.purge()
        else:
            assert ledger.purge() == purged
        ledger.close()
