"""A ledger of one file per key, for where SQLite is unavailable or unwelcome.

The claim is an exclusive create: the record is written to a temporary file, fsynced,
then hard-linked to its final name, which fails if the name exists. Later transitions
hold the key's lock (`flock` on a per-key lock file) and replace the file atomically
(temp file, fsync, rename, folder fsync). Each operation touches one key's files, so its
cost does not grow with the number of records. Not for network filesystems: `flock` and
`link` are local.

The temporary files live in a folder of their own (`tmp/`), not beside the records: a
shard folder then changes twice per claim and commit (the link, the rename) instead of
five times. At a million records the shard folders are large and mostly cold, and those
extra creations and removals in them were what made a fresh key slower there (1M/10k
0.14-0.77 with the temporary files beside the records, 0.88-0.98 without, alternating
runs of `bench/ledger.py`'s scale figure; docs/benchmarks.md).

The package's own documents (keys under `crewai-idempotent/`: the outbox, approvals,
caps) each have an empty marker file named by the key's digest in `documents/`, made
before the record and removed after it, so `scan_prefix` of them lists that folder rather
than every record. A folder from before the markers gets them at its first such scan.

Across fork(): a `flock` belongs to the open file description, which a forked child
shares with its parent; unlocking it in the child would release the parent's lock. The
locks are therefore taken on descriptors this module opens and closes itself (not through
a library whose finalizer might unlock an inherited one): a child closes, without
unlocking, the descriptors of locks its parent's threads held at the fork (closing one
copy leaves the parent's lock in place, and frees it if the parent dies), and opens its
own for every lock it takes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import stat
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote, unquote, urlsplit

from .._errors import LedgerConfigurationError, LedgerUnavailable
from ..ledger import _fork
from ..ledger._backend import DOCUMENTS, CacheBackend
from ..ledger._hostclock import this_host
from ..ledger._record import Peek, Record, Status, read_peek, read_record
from ._options import configuration_errors, flag, local_options, with_options
from ._paths import check_trusted, private_folder
from ._scan import ScanCounter, ScanStats


class FileLockCacheBackend(CacheBackend):
    """A ledger folder holding one JSON file per key (named by the key's SHA-256).

    The folder is created 0700 if absent; its parent must exist, unless
    `create_parents=True`. `directory` is that folder; `fsync=False` skips the syncs (a
    crash of the host may then lose records); `lock_timeout_s` bounds the wait for a key's
    lock. A folder another user owns or may write to (or a symlink) is refused unless
    `allow_insecure_path=True`.

    Raises `LedgerConfigurationError` for a folder that cannot hold a ledger (its parent
    missing, insecure) and `LedgerUnavailable` for one that cannot be opened."""

    read_first = True  # a read is one open() of a local file: replays peek before claiming

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: bool = True,
        lock_timeout_s: float = 10.0,
        allow_insecure_path: bool = False,
        create_parents: bool = False,
    ) -> None:
        self.directory = private_folder(
            Path(directory), allow_insecure_path, create_parents=create_parents
        )
        self.fsync = fsync
        self.lock_timeout_s = lock_timeout_s
        # Every process that opens it runs on this host: leases go by the host's clock.
        self.host_clock = this_host()
        self.allow_insecure_path = allow_insecure_path
        self._records = self.directory / "records"
        self._locks = self.directory / "locks"
        # Made with the first write, like the shard folders: a ledger folder an older
        # version wrote has none, and a read-only look at it must not need one.
        self._temps = self.directory / "tmp"
        self._documents = self.directory / "documents"  # made with the first document
        self._documents_checked = False
        self._scans = ScanCounter()
        for folder in (self._records, self._locks):
            private_folder(folder, allow_insecure_path)
        # The open folder keeps its inode number from being handed to a folder created
        # at the same path after a deletion, which would pass the identity check.
        try:
            pin = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise LedgerUnavailable(f"cannot open ledger folder {self.directory}: {exc}") from exc
        weakref.finalize(self, os.close, pin)
        st = os.fstat(pin)
        self._identity = (st.st_dev, st.st_ino)
        self._directory_text = str(self.directory)
        self._shards: set[Path] = set()  # shard folders made or checked by this object
        # Descriptors of the locks being taken or held right now, by any thread.
        self._lock_fds: set[int] = set()
        _fork.register(self)

    def __repr__(self) -> str:
        return f"FileLockCacheBackend({str(self.directory)!r})"

    @property
    def url(self) -> str:
        """The URL that names this ledger (for messages and the CLI's --ledger)."""
        options = {"allow_insecure_path": True} if self.allow_insecure_path else {}
        return with_options(file_url(self.directory), options)

    # -- URL (RFC 8089) ----------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str) -> Self:
        """`file:///absolute/dir` with the options `fsync`, `allow_insecure_path` and
        `create_parents`; anything else is a `LedgerConfigurationError`, as is a `url` that
        is not an absolute file URL. Raises what the constructor raises."""
        options = local_options(url, _URL_OPTIONS, "file")
        with configuration_errors():
            return cls(cls.path_from_url(url), **options)

    @staticmethod
    def path_from_url(url: str) -> Path:
        """The absolute folder a `file:` URL names, without opening it. A file URL has
        no relative form (as browsers, curl and `Path.as_uri()` read it). The options are
        checked too: a misspelt one is refused before anyone looks for the folder."""
        local_options(url, _URL_OPTIONS, "file")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise LedgerConfigurationError(
                f"{url!r}: a file URL names a folder on this host; {parts.netloc!r} is read as "
                f"a host name; the folder /{parts.netloc}{parts.path} is file:///"
                f"{parts.netloc}{parts.path}"
            )
        text = unquote(parts.path)
        if not text.startswith("/"):
            raise LedgerConfigurationError(
                f"{url!r}: file URLs are absolute (RFC 8089): write file:///absolute/dir, or "
                "FileLockCacheBackend('relative/dir') in code"
            )
        if text.rstrip("/") == "":
            raise LedgerConfigurationError(f"{url!r} names no folder")
        return Path(text)

    # -- layout ------------------------------------------------------------------------

    def _names(self, key: str) -> tuple[Path, Path]:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        shard = digest[:2]  # 256 sub-folders keep every folder small at millions of keys
        return self._records / shard / f"{digest}.json", self._locks / shard / f"{digest}.lock"

    # -- fork ----------------------------------------------------------------------------

    def before_fork(self) -> None:
        pass  # nothing to quiesce: a lock held across the fork stays the parent's

    def after_fork_in_parent(self) -> None:
        pass

    def after_fork_in_child(self) -> None:
        # Each descriptor in the set is open and ours: it joins the set after os.open and
        # leaves it before os.close. Closing the child's copy never unlocks the parent.
        for fd in list(self._lock_fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lock_fds = set()

    # -- trust ---------------------------------------------------------------------------

    def _check_identity(self) -> None:
        # One stat per operation: a ledger folder deleted or replaced under a running
        # process must not turn into an empty ledger in which committed keys run again.
        try:
            st = os.stat(self._directory_text)
        except FileNotFoundError:
            raise LedgerUnavailable(
                f"the ledger folder {self.directory} was deleted while this process had it "
                "open; refusing to start an empty ledger (committed keys would run again)"
            ) from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise LedgerUnavailable(
                f"the ledger folder {self.directory} was replaced while this process had it "
                "open; refusing to use a different ledger than the one opened"
            )

    def _check_file(self, fd: int, path: Path, what: str) -> os.stat_result:
        st = os.fstat(fd)
        if self.allow_insecure_path:
            return st
        if not stat.S_ISREG(st.st_mode):
            raise LedgerUnavailable(f"{what} {path} is not a regular file")
        check_trusted(st, path, what)
        return st

    def _shard(self, path: Path) -> None:
        folder = path.parent
        if folder in self._shards:
            return
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
            st = os.lstat(folder)
        except OSError as exc:
            raise LedgerUnavailable(self._explain(exc, folder)) from exc
        if not self.allow_insecure_path:
            if not stat.S_ISDIR(st.st_mode):
                raise LedgerUnavailable(f"ledger folder {folder} is not a directory")
            check_trusted(st, folder, "ledger folder")
        self._shards.add(folder)

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
        data = self._read_bytes(path)
        return None if data is None else read_record(data, f"the record file {path}")

    def _read_bytes(self, path: Path) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LedgerUnavailable(f"the record file {path} is a symlink") from exc
            raise LedgerUnavailable(self._explain(exc, path)) from exc
        try:
            size = self._check_file(fd, path, "record file").st_size
            parts = []
            while chunk := os.read(fd, size + 1):  # raw reads: no file object per record
                parts.append(chunk)
            data = b"".join(parts)
        except OSError as exc:
            raise LedgerUnavailable(self._explain(exc, path)) from exc
        finally:
            os.close(fd)
        return data

    def _write_temp(self, final: Path, record: Record) -> Path:
        temp = self._temps / f"{final.name}.{secrets.token_hex(6)}.tmp"
        self._shard(temp)
        data = record.to_json().encode("utf-8")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
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

    @contextlib.contextmanager
    def _locked(self, lock_path: Path) -> Iterator[None]:
        """Hold the key's lock: `flock` on a descriptor opened here, for this call only."""
        self._shard(lock_path)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._lock_fds.add(fd)
        try:
            self._check_file(fd, lock_path, "lock file")
            deadline = time.monotonic() + self.lock_timeout_s
            delay = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LedgerUnavailable(
                            f"the lock {lock_path} stayed held past {self.lock_timeout_s} s"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._lock_fds.discard(fd)
            os.close(fd)

    # -- protocol ----------------------------------------------------------------------

    def insert(self, record: Record) -> Record | None:
        self._check_identity()
        final, _ = self._names(record.key)
        self._shard(final)
        if record.key.startswith(DOCUMENTS):
            self._mark_document(final.stem)  # first: a document is never missing from it
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
        self._check_identity()
        final, lock_path = self._names(current.key)
        try:
            with self._locked(lock_path):
                held = self._read(final)
                same = held is not None and (held.token, held.revision) == (
                    current.token,
                    current.revision,
                )
                yield final if same else None
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
        self._check_identity()
        return self._read(self._names(key)[0])

    def peek(self, key: str) -> Peek | None:
        # A read of the record file: no key lock, no temp file, no fsync.
        self._check_identity()
        path = self._names(key)[0]
        data = self._read_bytes(path)
        return None if data is None else read_peek(data, f"the record file {path}")

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        self._check_identity()
        return self._scan_files(status)

    def _scan_files(self, status: Status | None) -> Iterator[Record]:
        """Every record file, a shard folder at a time in the order of the keys' digests
        (a record's file keeps its name through every write, so one that stays is read
        once). There is no index of statuses: a scan of one reads every record."""
        try:
            shards = sorted(os.listdir(self._records))
        except FileNotFoundError:
            return
        for shard in shards:
            try:
                names = sorted(n for n in os.listdir(self._records / shard) if n.endswith(".json"))
            except (FileNotFoundError, NotADirectoryError):
                continue
            self._scans.read(0)
            for name in names:
                record = self._read(self._records / shard / name)
                self._scans.read(1, 0)
                if record is not None and (status is None or record.status is status):
                    yield record

    def delete(self, current: Record) -> bool:
        with self._holding(current) as final:
            if final is None:
                return False
            os.unlink(final)
            self._sync_folder(final.parent)
            if current.key.startswith(DOCUMENTS):
                _unlink(self._documents / final.stem)  # a marker left behind is skipped
            return True

    def scan_prefix(self, prefix: str) -> Iterator[Record]:
        if not prefix.startswith(DOCUMENTS):
            return super().scan_prefix(prefix)
        self._check_identity()
        self._index_documents()
        try:
            names = os.listdir(self._documents)
        except FileNotFoundError:
            names = []
        self._scans.read(0)
        records = []
        for name in names:
            if name.startswith("."):
                continue
            record = self._read(self._records / name[:2] / f"{name}.json")
            self._scans.read(1, 0)
            if record is not None and record.key.startswith(prefix):
                records.append(record)
        # The markers are named by digest: every document is read, and those under the
        # prefix are held to be sorted (docs/backends.md says how this grows).
        records.sort(key=lambda r: r.key)
        return iter(records)

    def scan_stats(self) -> ScanStats:
        """What this backend's scans have read in this process: see `ScanStats`.
        Raises nothing."""
        return self._scans.stats()

    def _mark_document(self, digest: str) -> None:
        marker = self._documents / digest
        self._shard(marker)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return
        except OSError as exc:
            raise LedgerUnavailable(self._explain(exc, marker)) from exc
        os.close(fd)
        try:
            self._sync_folder(self._documents)
        except OSError as exc:
            raise LedgerUnavailable(self._explain(exc, self._documents)) from exc

    def _index_documents(self) -> None:
        """A folder written before the markers existed gets them, once: every record is
        read, and `documents/.complete` says it was done."""
        if self._documents_checked:
            return
        done = self._documents / ".complete"
        if not done.exists():
            for path in self._records.glob("*/*.json"):
                record = self._read(path)
                if record is not None and record.key.startswith(DOCUMENTS):
                    self._mark_document(path.stem)
            self._shard(done)
            try:
                os.close(os.open(done, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
                self._sync_folder(self._documents)
            except OSError as exc:
                raise LedgerUnavailable(self._explain(exc, done)) from exc
        self._documents_checked = True


_URL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "fsync": flag,
    "allow_insecure_path": flag,
    "create_parents": flag,
}


def file_url(path: str | os.PathLike[str]) -> str:
    """The `file:` URL of the folder `path`, made absolute."""
    return "file://" + quote(str(Path(path).absolute()), safe="/")


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
