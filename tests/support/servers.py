"""Real, throwaway PostgreSQL and Redis servers on loopback, for the server backends' tests.

The servers are started once per test session (lazily: only when a test asks for one) in
temporary folders and stopped when the session ends. PostgreSQL refuses to run as root, so
as root its binaries run as the unprivileged `postgres` user through `runuser`.

A missing server binary skips the tests that need it, with the reason; with `CI=true` it
fails them instead, so that CI can never pass by silently skipping the server backends.

Each test gets its own namespace on the shared server (a fresh table, a fresh key prefix),
described by a URL (`fresh_url`) that `backend_from_url` reopens in any process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

# Loaded once here, so that processes the tests fork do not each import psycopg/redis-py.
with contextlib.suppress(ImportError):
    import crewai_idempotent.backends.postgres
    import crewai_idempotent.backends.redis  # noqa: F401

ON_CI = os.environ.get("CI", "").lower() == "true"


def missing(what: str) -> NoReturn:
    """Skip locally; fail on CI, where a missing server must never pass unnoticed."""
    if ON_CI:
        pytest.fail(f"{what}; CI=true, so this is a failure, not a skip", pytrace=False)
    pytest.skip(what)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(ready: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout} s")
        time.sleep(0.02)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...; comm may hold spaces and parentheses
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


# -- PostgreSQL --------------------------------------------------------------------------


def postgres_bindir() -> Path | None:
    """Where initdb/pg_ctl live: $CREWAI_IDEMPOTENT_PG_BIN, else the newest Debian install."""
    configured = os.environ.get("CREWAI_IDEMPOTENT_PG_BIN")
    candidates = [Path(configured)] if configured else []
    candidates += sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    found = shutil.which("pg_ctl")
    if found:
        candidates.append(Path(found).parent)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    return None


class PostgresServer:
    """One PostgreSQL cluster in a temporary folder, listening on 127.0.0.1 only."""

    def __init__(
        self,
        bindir: Path,
        *,
        fsync: bool = False,
        max_connections: int = 300,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.bindir = bindir
        self.fsync = fsync
        self.max_connections = max_connections
        # Server settings on top of (or instead of) the ones `start` writes, as they would
        # appear in postgresql.conf: {"synchronous_commit": "off"}.
        self.settings = dict(settings or {})
        self.port = 0
        self.root = Path(tempfile.mkdtemp(prefix="crewai-idempotent-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._as_root = os.geteuid() == 0
        if self._as_root:
            try:
                import pwd

                entry = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError(
                    "running as root, and PostgreSQL refuses root, but there is no "
                    "'postgres' user to run it as"
                ) from None
            os.chown(self.root, entry.pw_uid, entry.pw_gid)

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / argv[0]), *argv[1:]]
        if self._as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}):\n"
                f"{done.stdout}\n{done.stderr}\n{tail}"
            )
        return done

    def start(self) -> None:
        if not self.data.exists():
            self._run(
                "initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                "-E", "UTF8", "--locale=C", "--no-sync",
            )  # fmt: skip
        for _attempt in range(5):
            self.port = self.port or free_port()
            settings = {
                "port": self.port,
                "listen_addresses": "'127.0.0.1'",
                "unix_socket_directories": f"'{self.root}'",
                "max_connections": self.max_connections,
                "shared_buffers": "'32MB'",
                # Only an OS crash or power loss could lose data with fsync off; the tests
                # kill clients and restart the server cleanly, never the machine.
                "fsync": "on" if self.fsync else "off",
                "full_page_writes": "on" if self.fsync else "off",
                **self.settings,
            }
            (self.data / "postgresql.auto.conf").write_text(
                "".join(f"{name} = {value}\n" for name, value in settings.items())
            )
            started = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w",
                                "-t", "60", "start", check=False)  # fmt: skip
            if started.returncode == 0:
                return
            self.port = 0  # most likely someone took the port between choosing and binding
        raise RuntimeError(f"PostgreSQL would not start:\n{self.log.read_text()[-3000:]}")

    def standby(self) -> PostgresServer:
        """A streaming standby of this server, started (pg_basebackup -R), and registered
        for clean-up like any server; it streams once `replicating()` counts it."""
        standby = PostgresServer(self.bindir, fsync=self.fsync, max_connections=20)
        with _servers_lock:
            _servers.append(standby)
        standby._run(
            "pg_basebackup", "-D", str(standby.data), "-h", "127.0.0.1", "-p", str(self.port),
            "-U", "postgres", "-R", "-X", "stream", "--no-sync",
        )  # fmt: skip
        # -R wrote primary_conninfo into postgresql.auto.conf, which `start` rewrites.
        auto = (standby.data / "postgresql.auto.conf").read_text()
        for line in auto.splitlines():
            name, _, value = line.partition("=")
            if name.strip() == "primary_conninfo":
                standby.settings["primary_conninfo"] = value.strip()
        standby.start()
        return standby

    def sql(self, statement: str) -> list[tuple[Any, ...]]:
        """Run one statement as the superuser (autocommit); its rows, if any."""
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            cursor = conn.execute(statement)
            return cursor.fetchall() if cursor.description else []

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop",
                      check=False)  # fmt: skip

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def processes(self) -> list[int]:
        """The postmaster first, then every server process it started."""
        try:
            postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return []
        return [postmaster, *_children(postmaster)]

    def freeze(self) -> None:
        """SIGSTOP every server process: the kernel still accepts and acknowledges TCP,
        but nothing answers (a hung host, a server stuck in the kernel)."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in reversed(self.processes()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def url(self, **options: Any) -> str:
        query = "&".join(f"{name}={value}" for name, value in options.items())
        return self.dsn() + (f"?{query}" if query else "")

    def fresh_url(self, **options: Any) -> str:
        """A URL naming a table no other test uses."""
        return self.url(table=f"ledger_{uuid.uuid4().hex[:16]}", **options)


# -- Redis -------------------------------------------------------------------------------


def redis_binary() -> Path | None:
    found = os.environ.get("CREWAI_IDEMPOTENT_REDIS_SERVER") or shutil.which("redis-server")
    if not found and Path("/usr/bin/redis-server").is_file():
        found = "/usr/bin/redis-server"
    return Path(found) if found else None


class RedisServer:
    """One redis-server in a temporary folder, listening on 127.0.0.1 only."""

    def __init__(
        self, binary: Path, *, appendonly: bool = True, appendfsync: str = "everysec",
        save: str = "", extra: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.binary = binary
        self.extra = extra
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.save = save
        self.port = 0
        self.root = Path(tempfile.mkdtemp(prefix="crewai-idempotent-redis-"))
        self.log = self.root / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        for _attempt in range(5):
            self.port = self.port or free_port()
            argv = [
                str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.root), "--logfile", str(self.log), "--daemonize", "no",
                "--save", self.save, "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync, *self.extra,
            ]  # fmt: skip
            self._process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
            try:
                _wait_for(lambda: self._process.poll() is not None or self._ping(), 20,
                          "redis-server")  # fmt: skip
            except RuntimeError:
                self._process.kill()
                raise
            if self._process.poll() is None:
                return
            self.port = 0
        tail = self.log.read_text()[-3000:] if self.log.exists() else ""
        raise RuntimeError(f"redis-server would not start:\n{tail}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up, maybe locked
        except OSError:
            return False

    def stop(self) -> None:
        """A clean shutdown: SIGTERM makes Redis flush its AOF before it exits."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def freeze(self) -> None:
        """SIGSTOP the server: connections stay open, nothing answers."""
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGCONT)

    def kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, **options: Any) -> str:
        query = "&".join(f"{name}={value}" for name, value in options.items())
        return f"redis://127.0.0.1:{self.port}/0" + (f"?{query}" if query else "")

    def fresh_url(self, **options: Any) -> str:
        """A URL naming a key prefix no other test uses."""
        return self.url(prefix=f"t{uuid.uuid4().hex[:16]}:", **options)


# -- session fixtures --------------------------------------------------------------------

_servers: list[Any] = []
_servers_lock = threading.Lock()


_owner_pid = os.getpid()


def _stop_all() -> None:
    if os.getpid() != _owner_pid:  # a forked child exiting must not stop the session's servers
        return
    with _servers_lock:
        for server in _servers:
            with contextlib.suppress(Exception):
                server.cleanup()
        _servers.clear()


atexit.register(_stop_all)  # a safety net if the session ends without its finalizers


def start_postgres(**options: Any) -> PostgresServer:
    """Start a throwaway PostgreSQL (skip or, on CI, fail when the binaries are missing)."""
    bindir = postgres_bindir()
    if bindir is None:
        missing(
            "PostgreSQL server binaries (initdb, pg_ctl) not found: install Debian's "
            "postgresql package or set CREWAI_IDEMPOTENT_PG_BIN"
        )
    server = PostgresServer(bindir, **options)
    with _servers_lock:
        _servers.append(server)
    server.start()
    return server


def start_redis(**options: Any) -> RedisServer:
    """Start a throwaway redis-server (skip or, on CI, fail when it is missing)."""
    binary = redis_binary()
    if binary is None:
        missing("redis-server not found: install Debian's redis-server package")
    server = RedisServer(binary, **options)
    with _servers_lock:
        _servers.append(server)
    server.start()
    return server


def discard(server: PostgresServer | RedisServer) -> None:
    with _servers_lock:
        if server in _servers:
            _servers.remove(server)
    server.cleanup()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = start_postgres()
    yield server
    discard(server)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    discard(server)


# -- a connection that can be cut --------------------------------------------------------


class CuttingProxy:
    """A TCP proxy to a server that cuts the connection when the client sends `pattern`.

    `when="before"`: the bytes holding `pattern` are never forwarded (the server never
    sees the command). `when="after"`: they are forwarded, and the connection is cut as
    the server's reply comes back (the command was applied; its reply is lost).
    `times` is how many commands are cut; after that everything passes through.
    """

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.pattern: bytes | None = None
        self.when = "before"
        self.times = 0
        self.cut = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, pattern: bytes, *, when: str = "before", times: int = 1) -> None:
        assert when in ("before", "after")
        with self._lock:
            self.pattern, self.when, self.times, self.cut = pattern, when, times, 0

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            link = {"drop_reply": False}
            threading.Thread(target=self._pump_up, args=(client, server, link), daemon=True).start()
            threading.Thread(
                target=self._pump_down, args=(server, client, link), daemon=True
            ).start()

    def _triggered(self, chunk: bytes) -> str | None:
        with self._lock:
            if self.pattern is None or self.cut >= self.times or self.pattern not in chunk:
                return None
            self.cut += 1
            return self.when

    @staticmethod
    def _close(*sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _pump_up(self, client: socket.socket, server: socket.socket, link: dict[str, bool]) -> None:
        try:
            while chunk := client.recv(65536):
                when = self._triggered(chunk)
                if when == "before":
                    break
                if when == "after":
                    link["drop_reply"] = True
                server.sendall(chunk)
        except OSError:
            pass
        if not link["drop_reply"]:
            self._close(client, server)

    def _pump_down(
        self, server: socket.socket, client: socket.socket, link: dict[str, bool]
    ) -> None:
        try:
            while chunk := server.recv(65536):
                if link["drop_reply"]:
                    break
                client.sendall(chunk)
        except OSError:
            pass
        self._close(client, server)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
