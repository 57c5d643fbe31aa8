"""A ledger of one file per key, for where SQLite is unavailable or unwelcome.

The claim is an exclusive create: the record is written to a temporary file, fsynced,
then hard-linked to its final name, which fails if the name exists. Later transitions
hold a per-key `filelock` and replace the file atomically (temp file, fsync, rename,
folder fsync). Each operation touches one key's files, so its cost does not grow with
the number of records. Not for network filesystems: `flock` and `link` are local.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from ._backend import CacheBackend
from ._errors import LedgerUnavailable
from ._paths import private_folder
from ._record import Record, Status


class FileLockCacheBackend(CacheBackend):
    """A ledger folder holding one JSON file per key (named by the key's SHA-256)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: bool = True,
        lock_timeout_s: float = 10.0,
        allow_insecure_path: bool = False,
    ) -> None:
        self.directory = private_folder(Path(directory), allow_insecure_path)
        self.fsync = fsync
        self.lock_timeout_s = lock_timeout_s
        self._records = self.directory / "records"
        self._locks = self.directory / "locks"
        for folder in (self._records, self._locks):
            private_folder(folder, allow_insecure_path)

    def __repr__(self) -> str:
        return f"FileLockCacheBackend({str(self.directory)!r})"

    # -- layout ------------------------------------------------------------------------

    def _names(self, key: str) -> tuple[Path, Path]:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        shard = digest[:2]  # 256 sub-folders keep every folder small at millions of keys
        return self._records / shard / f"{digest}.json", self._locks / shard / f"{digest}.lock"

    def _shard(self, path: Path) -> None:
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise LedgerUnavailable(self._explain(exc, path.parent)) from exc

    def _explain(self, exc: OSError, path: Path) -> str:
        reason = {
            errno.EACCES: "permission denied",
            errno.EPERM: "permission denied",
            errno.EROFS: "the filesystem is read-only",
            errno.ENOSPC: "the disk is full",
            errno.EDQUOT: "the disk quota is exhausted",
            errno.EFBIG: "a file size limit was reached",
        }.get(exc.errno or 0, "the ledger could not be written")
        return f"{reason}: {path}: {exc}"

    def _read(self, path: Path) -> Record | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LedgerUnavailable(self._explain(exc, path)) from exc
        try:
            return Record.from_json(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise LedgerUnavailable(f"the record file is corrupt: {path}: {exc!r}") from exc

    def _write_temp(self, final: Path, record: Record) -> Path:
        temp = final.with_name(f".{final.name}.{secrets.token_hex(6)}.tmp")
        data = record.to_json().encode("utf-8")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink(temp)
            raise LedgerUnavailable(self._explain(exc, temp)) from exc
        return temp

    def _sync_folder(self, folder: Path) -> None:
        if not self.fsync:
            return
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _lock(self, lock_path: Path) -> FileLock:
        self._shard(lock_path)
        return FileLock(lock_path, timeout=self.lock_timeout_s, mode=0o600)

    # -- protocol ----------------------------------------------------------------------

    def insert(self, record: Record) -> Record | None:
        final, _ = self._names(record.key)
        self._shard(final)
        while True:
            temp = self._write_temp(final, record)
            try:
                os.link(temp, final)  # fails if `final` exists: the atomic claim
            except FileExistsError:
                held = self._read(final)
                if held is not None:
                    return held
                continue  # deleted in between: claim again
            except OSError as exc:
                raise LedgerUnavailable(self._explain(exc, final)) from exc
            finally:
                _unlink(temp)
            try:
                self._sync_folder(final.parent)
            except OSError as exc:
                raise LedgerUnavailable(self._explain(exc, final.parent)) from exc
            return None

    @contextlib.contextmanager
    def _holding(self, current: Record) -> Iterator[Path | None]:
        """Hold the key's lock; yield its record file if the stored record is still
        `current` (same token and revision), else None. Failures become LedgerUnavailable."""
        final, lock_path = self._names(current.key)
        try:
            with self._lock(lock_path):
                held = self._read(final)
                same = held is not None and (held.token, held.revision) == (
                    current.token,
                    current.revision,
                )
                yield final if same else None
        except Timeout as exc:
            raise LedgerUnavailable(
                f"the lock {lock_path} stayed held past {self.lock_timeout_s} s"
            ) from exc
        except OSError as exc:
            raise LedgerUnavailable(self._explain(exc, final)) from exc

    def replace(self, current: Record, new: Record) -> bool:
        with self._holding(current) as final:
            if final is None:
                return False
            temp = self._write_temp(final, new)
            try:
                os.replace(temp, final)
            except OSError:
                _unlink(temp)
                raise
            self._sync_folder(final.parent)
            return True

    def get(self, key: str) -> Record | None:
        return self._read(self._names(key)[0])

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        records = []
        for path in self._records.glob("*/*.json"):
            record = self._read(path)
            if record is not None and (status is None or record.status is status):
                records.append(record)
        records.sort(key=lambda r: r.updated_at)
        return iter(records)

    def delete(self, current: Record) -> bool:
        with self._holding(current) as final:
            if final is None:
                return False
            os.unlink(final)
            self._sync_folder(final.parent)
            return True


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
