"""Ledger URLs by the ecosystem's conventions: SQLAlchemy for sqlite:, RFC 8089 for file:,
and no option a URL carries is ever ignored."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from crewai_idempotent import (
    FileLockCacheBackend,
    InMemoryCacheBackend,
    LedgerConfigurationError,
    SQLiteCacheBackend,
    backend_from_url,
    backends,
)
from crewai_idempotent.backends import _url as backends_url
from crewai_idempotent.backends._options import redact
from crewai_idempotent.backends.filelock import file_url
from crewai_idempotent.backends.sqlite import sqlite_url


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    monkeypatch.chdir(work)
    return work


def test_three_slashes_are_relative_four_are_absolute(in_tmp: Path, tmp_path: Path) -> None:
    relative = backend_from_url("sqlite:///ledger.db")
    assert isinstance(relative, SQLiteCacheBackend)
    assert relative.path == in_tmp / "ledger.db" and relative.path.is_file()
    (in_tmp / "data").mkdir()
    nested = backend_from_url("sqlite:///data/ledger.db")
    assert isinstance(nested, SQLiteCacheBackend) and nested.path == in_tmp / "data" / "ledger.db"
    absolute = backend_from_url(f"sqlite:///{tmp_path / 'abs.db'}")  # sqlite:////tmp/...
    assert isinstance(absolute, SQLiteCacheBackend) and absolute.path == tmp_path / "abs.db"
    spaced = backend_from_url(sqlite_url(tmp_path / "a b.db"))
    assert isinstance(spaced, SQLiteCacheBackend) and spaced.path == tmp_path / "a b.db"
    for backend in (relative, nested, absolute, spaced):
        backend.close()


def test_an_old_absolute_url_is_refused_rather_than_starting_an_empty_ledger(
    in_tmp: Path, tmp_path: Path
) -> None:
    existing = SQLiteCacheBackend(tmp_path / "old.db")
    existing.close()
    old_style = f"sqlite://{tmp_path / 'old.db'}"  # three slashes: /tmp/... before 0.2
    with pytest.raises(LedgerConfigurationError, match="four slashes") as caught:
        backend_from_url(old_style)
    assert f"sqlite:///{tmp_path / 'old.db'}" in str(caught.value)
    assert list(in_tmp.iterdir()) == []


def test_a_missing_folder_is_refused_not_created(in_tmp: Path, tmp_path: Path) -> None:
    missing = tmp_path / "srv" / "does" / "not" / "exist"
    for url, what in (
        (f"sqlite:///{missing / 'ledger.db'}", "ledger file"),
        (f"file://{missing / 'ledger'}", "ledger folder"),
    ):
        with pytest.raises(LedgerConfigurationError) as refused:
            backend_from_url(url)
        message = str(refused.value)
        assert f"the folder {missing} for the {what}" in message
        assert f"({tmp_path / 'srv'} is missing)" in message and "create_parents" in message
    with pytest.raises(LedgerConfigurationError, match="does not exist"):
        SQLiteCacheBackend(missing / "ledger.db")
    with pytest.raises(LedgerConfigurationError, match="does not exist"):
        FileLockCacheBackend(missing / "ledger")
    assert not (tmp_path / "srv").exists() and list(in_tmp.iterdir()) == []
    # A ledger's own file or folder is made: its parent exists.
    for backend in (
        backend_from_url(f"sqlite:///{tmp_path / 'own.db'}"),
        backend_from_url(f"file://{tmp_path / 'own'}"),
    ):
        backend.close()


def test_a_three_slash_url_meant_as_absolute_names_the_four_slash_form(in_tmp: Path) -> None:
    with pytest.raises(LedgerConfigurationError) as refused:
        backend_from_url("sqlite:///srv/app/ledger.db")
    message = str(refused.value)
    assert f"names {in_tmp / 'srv' / 'app' / 'ledger.db'} (three slashes" in message
    assert "is sqlite:////srv/app/ledger.db (four slashes)" in message
    assert list(in_tmp.iterdir()) == []  # nothing made under the current directory


def test_create_parents_lays_out_a_fresh_host(in_tmp: Path, tmp_path: Path) -> None:
    relative = backend_from_url("sqlite:///srv/app/ledger.db?create_parents=true")
    assert isinstance(relative, SQLiteCacheBackend)
    assert relative.path == in_tmp / "srv" / "app" / "ledger.db" and relative.path.is_file()
    folder = tmp_path / "deploy" / "ledger"
    files = backend_from_url(f"file://{folder}?create_parents=true")
    assert isinstance(files, FileLockCacheBackend) and folder.is_dir()
    code = SQLiteCacheBackend(tmp_path / "deep" / "er" / "l.db", create_parents=True)
    for backend in (relative, files, code):
        backend.close()
    assert oct((in_tmp / "srv" / "app").stat().st_mode & 0o777) == oct(0o700)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite://", "names no file"),
        ("sqlite:///", "names no file"),
        ("sqlite:///:memory:", "in-memory SQLite database"),
        ("sqlite://host/ledger.db", "a sqlite URL has no host"),
        ("file://ledger/dir", "read as a host name.*file:///ledger/dir"),
        ("file:ledger", "file URLs are absolute"),
        ("file:///", "names no folder"),
        ("memory://name", "takes no name or path"),
        ("ledger.db", "no URL scheme.*sqlite:///ledger.db"),
        ("mysql://db/x", "unknown ledger URL scheme 'mysql'"),
    ],
)
def test_malformed_urls_are_refused(in_tmp: Path, url: str, message: str) -> None:
    with pytest.raises(LedgerConfigurationError, match=message):
        backend_from_url(url)
    assert list(in_tmp.iterdir()) == []


@pytest.mark.parametrize(
    "query",
    [
        "synchronus=NORMAL",  # misspelt
        "synchronous=NORMAL&synchronous=FULL",  # given twice
        "allow_insecure_path=maybe",
        "busy_timeout_s=-1",
        "synchronous=OFF",
    ],
)
def test_sqlite_options_are_checked(in_tmp: Path, query: str) -> None:
    with pytest.raises(LedgerConfigurationError):
        backend_from_url(f"sqlite:///ledger.db?{query}")
    assert list(in_tmp.iterdir()) == []


def test_sqlite_options_are_applied(in_tmp: Path) -> None:
    backend = backend_from_url("sqlite:///l.db?synchronous=normal&busy_timeout_s=2.5")
    assert isinstance(backend, SQLiteCacheBackend)
    assert (backend.synchronous, backend.busy_timeout_s) == ("NORMAL", 2.5)
    backend.close()


def test_file_urls_follow_rfc_8089(tmp_path: Path) -> None:
    folder = tmp_path / "ledger"
    for url in (f"file://{folder}", f"file://localhost{folder}", file_url(folder)):
        backend = backend_from_url(url)
        assert isinstance(backend, FileLockCacheBackend) and backend.directory == folder
        backend.close()
    nosync = backend_from_url(f"file://{folder}?fsync=false")
    assert isinstance(nosync, FileLockCacheBackend) and nosync.fsync is False
    with pytest.raises(LedgerConfigurationError, match="unknown option 'fsnyc'"):
        backend_from_url(f"file://{folder}?fsnyc=false")


def test_memory_takes_no_options() -> None:
    assert isinstance(backend_from_url("memory://"), InMemoryCacheBackend)
    with pytest.raises(LedgerConfigurationError, match="unknown option 'durable'"):
        backend_from_url("memory://?durable=yes")


@pytest.mark.parametrize(
    ("scheme", "library", "extra"),
    [("redis", "redis", "redis"), ("postgresql", "psycopg", "postgres")],
)
def test_a_missing_client_library_names_the_extra_once(
    monkeypatch: pytest.MonkeyPatch, scheme: str, library: str, extra: str
) -> None:
    monkeypatch.delitem(sys.modules, f"crewai_idempotent.backends.{extra}", raising=False)
    monkeypatch.delitem(sys.modules, f"crewai_idempotent.backends.{extra}._store", raising=False)
    monkeypatch.setitem(sys.modules, library, None)
    with pytest.raises(LedgerConfigurationError) as caught:
        backend_from_url(f"{scheme}://u:pw@localhost/0")
    message = str(caught.value)
    assert message.count(f"crewai-idempotent[{extra}]") == 1, message
    assert "pw" not in message


def test_redact() -> None:
    assert redact("postgresql://app:s3cret@db/x?sslmode=require") == (
        "postgresql://app:***@db/x?sslmode=require"
    )
    assert redact("redis://:s3cret@cache:6379/0") == "redis://:***@cache:6379/0"
    assert "s3cret" not in redact("postgresql://db/x?password=s3cret&sslmode=require")
    assert redact("sqlite:///ledger.db") == "sqlite:///ledger.db"
    assert redact("sqlite:////abs/ledger.db?synchronous=NORMAL") == (
        "sqlite:////abs/ledger.db?synchronous=NORMAL"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite:///ledger.db?synchronus=NORMAL", "unknown option 'synchronus'"),
        ("file:///tmp/ledger?fsnyc=no", "unknown option 'fsnyc'"),
        ("memory://?durable=yes", "unknown option 'durable'"),
        ("postgresql://app@127.0.0.1:1/db?tabel=x", "unknown PostgreSQL URL option 'tabel'"),
        ("postgresql://app@127.0.0.1:1/db?timeout_s=-1", "timeout_s must be a positive"),
        ("redis://127.0.0.1:1/0?prefx=x", "unknown Redis URL option 'prefx'"),
        ("redis://127.0.0.1:1/0?retries=-1", "retries must be a whole number"),
    ],
)
def test_each_backend_reads_its_own_url_strictly(in_tmp: Path, url: str, message: str) -> None:
    """The class's from_url refuses what backend_from_url refuses, with the same error,
    before anything is created or connected."""
    scheme = url.split(":", 1)[0]
    cls = getattr(backends, backends_url.SCHEMES[scheme][1])
    with pytest.raises(LedgerConfigurationError, match=message):
        cls.from_url(url)
    with pytest.raises(LedgerConfigurationError, match=message):
        backend_from_url(url)
    assert list(in_tmp.iterdir()) == []


@pytest.mark.parametrize("module", ["sqlite", "filelock", "memory", "postgres", "redis"])
def test_no_backend_imports_the_scheme_table(module: str) -> None:
    """The scheme table loads the backends, never the other way round: a backend module
    imported alone leaves `_url` unloaded."""
    name = f"crewai_idempotent.backends.{module}"
    code = (
        f"import sys, {name}; "
        "assert 'crewai_idempotent.backends._url' not in sys.modules, 'imported _url'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
