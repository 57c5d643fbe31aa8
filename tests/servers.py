"""Real, throwaway PostgreSQL and Redis servers on loopback, for the server backends' tests.

The servers are started once per test session (lazily: only when a test asks for one) in
temporary folders and stopped when the session ends. PostgreSQL refuses to run as root, so
as root its binaries run as the unprivileged `postgres` user through `runuser`.

A missing server binary skips the tests that need it, with the reason; with `CI=true` it
fails them instead, so that CI can never pass by silently skipping the server backends.

Each test gets its own namespace on the shared server (a fresh table, a fresh key prefix),
described by a URL that `backend_from_url` reopens in any process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from crewai_idempotent import CacheBackend, backend_from_url

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


class UrlFactory:
    """Opens the store at `url`; `url` is what a child process passes to backend_from_url."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self) -> CacheBackend:
        return backend_from_url(self.url)

    def __repr__(self) -> str:
        return f"UrlFactory({self.url!r})"


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

    def __init__(self, bindir: Path, *, fsync: bool = False, max_connections: int = 300) -> None:
        self.bindir = bindir
        self.fsync = fsync
        self.max_connections = max_connections
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


def postgres_factory(tmp_path: Path, request: pytest.FixtureRequest) -> UrlFactory:
    """For conftest's EXTRA_FACTORIES: a fresh table per test on the session's server."""
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return UrlFactory(server.fresh_url())


def redis_factory(tmp_path: Path, request: pytest.FixtureRequest) -> UrlFactory:
    """For conftest's EXTRA_FACTORIES: a fresh key prefix per test on the session's server."""
    server: RedisServer = request.getfixturevalue("redis_server")
    return UrlFactory(server.fresh_url())


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


# -- workers in other processes ----------------------------------------------------------
#
# The race, fault and restart tests of both server backends share these. A worker is a
# fresh Python process (`python -c "from tests.servers import worker_main; ..."`) with its
# own backend and its own connections. Effects are counted at a fake provider: one line
# per effect appended (O_APPEND, a single write) to a file the processes share.

ROOT = Path(__file__).resolve().parent.parent


def append_line(path: Path | str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


def effects_per_key(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            key = line.split(" ", 1)[0]
            counts[key] = counts.get(key, 0) + 1
    return counts


_logs: dict[int, Any] = {}


def spawn_worker(mode: str, **config: Any) -> subprocess.Popen[str]:
    code = "import sys; from tests.servers import worker_main; worker_main(sys.argv[1])"
    payload = json.dumps({"mode": mode, **config})
    # A file, not a pipe: it never fills up and blocks the worker. Kept open for worker_log.
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-c", code, payload],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        bufsize=1,
    )
    while len(_logs) > 100:  # the oldest workers are long gone
        _logs.pop(next(iter(_logs))).close()
    _logs[proc.pid] = log
    return proc


def worker_log(proc: subprocess.Popen[str]) -> str:
    """The end of what a worker wrote to stderr (tracebacks, warnings)."""
    log = _logs.get(proc.pid)
    if log is None:
        return ""
    log.seek(0)
    return str(log.read()[-4000:])


def worker_main(payload: str) -> None:  # pragma: no cover - runs in the worker process
    config = json.loads(payload)
    {"race": _race_worker, "kill": _kill_worker, "retry": _retry_worker}[config["mode"]](config)


_say_lock = threading.Lock()


def _say(*parts: Any) -> None:  # pragma: no cover - runs in the worker process
    with _say_lock:  # one whole line at a time from many threads
        sys.stdout.write(" ".join(map(str, parts)) + "\n")
        sys.stdout.flush()


def _race_worker(config: dict[str, Any]) -> None:  # pragma: no cover - worker process
    """Answer each key read from stdin with one guarded call; say how it went."""
    from crewai_idempotent import Ledger

    ledger = Ledger(backend_from_url(config["url"]), wait_s=60.0)
    ledger.get("warm-up")  # connect and migrate before the first round
    rng = random.Random()
    effects = config["effects"]
    _say("ready")
    for line in sys.stdin:
        key = line.strip()

        def charge(key: str = key) -> str:
            append_line(effects, f"{key} {os.getpid()}")
            time.sleep(rng.uniform(0, 0.002))
            return f"receipt:{key}:{os.getpid()}"

        try:
            outcome = ledger.execute(key, charge)
            _say(json.dumps({"key": key, "value": outcome.value, "replayed": outcome.replayed}))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            _say(json.dumps({"key": key, "error": f"{type(exc).__name__}: {exc}"}))
    ledger.close()


def _kill_worker(config: dict[str, Any]) -> None:  # pragma: no cover - worker process
    """Run one guarded call per key, each in a thread that stops at its key's point (after
    the claim, inside the body before the effect, after the effect, after the commit) and
    waits there to be killed with the whole process."""
    from crewai_idempotent import Ledger

    plan: dict[str, str] = config["plan"]
    effects = config["effects"]
    rng = random.Random()
    forever = threading.Event()

    def pause(key: str, point: str) -> None:
        if plan[key] == point:
            time.sleep(rng.uniform(0, 0.02))
            _say("at", key)
            forever.wait()

    def listener(kind: str, record: Any) -> None:
        if kind in ("claim", "commit"):
            pause(record.key, kind)

    ledger = Ledger(backend_from_url(config["url"]), lease_s=config["lease_s"], listener=listener)

    def call(key: str) -> None:
        def charge() -> str:
            pause(key, "body")
            append_line(effects, key)
            pause(key, "effect")
            return f"receipt:{key}"

        ledger.run(key, charge)
        pause(key, "return")

    threads = [threading.Thread(target=call, args=(key,), daemon=True) for key in plan]
    for thread in threads:
        thread.start()
    forever.wait()


def _retry_worker(config: dict[str, Any]) -> None:  # pragma: no cover - worker process
    """Retry each key once, concurrently; a reconciler (where asked for) checks the fake
    provider's effects. Print one JSON line per key: what the call did, and the record."""
    from crewai_idempotent import Absent, Found, Ledger

    effects = Path(config["effects"])
    ledger = Ledger(backend_from_url(config["url"]), wait_s=config["wait_s"],
                    lease_s=config["lease_s"])  # fmt: skip

    def reconcile(key: str, args: Any) -> Any:
        return Found(f"receipt:{key}") if effects_per_key(effects).get(key) else Absent()

    results: dict[str, dict[str, Any]] = {}

    def call(key: str, with_reconciler: bool) -> None:
        def charge() -> str:
            append_line(effects, key)
            return f"receipt:{key}"

        try:
            outcome = ledger.execute(key, charge, reconcile=reconcile if with_reconciler else None)
            result: dict[str, Any] = {"value": outcome.value, "replayed": outcome.replayed}
        except Exception as exc:  # noqa: BLE001 - the test asserts on the kind
            result = {"error": type(exc).__name__, "message": str(exc)}
        record = ledger.get(key)
        result["status"] = record.status.value if record else None
        results[key] = result

    threads = [
        threading.Thread(target=call, args=(key, flag)) for key, flag in config["reconcile"].items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.close()
    _say(json.dumps(results))


def run_race(url: str, effects: Path, *, rounds: int, workers: int = 16) -> None:
    """`workers` processes, each with its own backend, all call the same fresh key each
    round, released together; exactly one of them runs the body every round."""
    procs = [spawn_worker("race", url=url, effects=str(effects)) for _ in range(workers)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line == "ready", f"worker did not start: {line!r} {worker_log(proc)}"
        tag = uuid.uuid4().hex[:8]
        for round_ in range(rounds):
            key = f"race-{tag}-{round_}"
            for proc in procs:  # released together: one short write to each stdin
                assert proc.stdin is not None
                proc.stdin.write(key + "\n")
                proc.stdin.flush()
            answers = [json.loads(proc.stdout.readline()) for proc in procs]  # type: ignore[union-attr]
            errors = [a["error"] for a in answers if "error" in a]
            assert not errors, f"round {round_}: {errors}"
            ran = [a for a in answers if not a["replayed"]]
            assert len(ran) == 1, f"round {round_}: {len(ran)} callers ran the body"
            assert {a["value"] for a in answers} == {ran[0]["value"]}, (
                "a caller saw another receipt"
            )
        counts = effects_per_key(effects)
        keys = [f"race-{tag}-{round_}" for round_ in range(rounds)]
        assert {key: counts.get(key, 0) for key in keys} == dict.fromkeys(keys, 1)
    finally:
        for proc in procs:
            if proc.stdin:
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


POINTS = ("claim", "body", "effect", "commit")

#: (point, reconciler?) -> what a fresh process retrying the key gets: (error or "value",
#: replayed?, final status, effects at the provider).
EXPECTED: dict[tuple[str, bool], tuple[str, bool | None, str, int]] = {
    # Died before the effect: without a reconciler nobody can know that; with one, the
    # provider says absent, so the retry takes over and runs it once.
    ("claim", False): ("OutcomeUncertain", None, "UNCERTAIN", 0),
    ("claim", True): ("value", False, "COMMITTED", 1),
    ("body", False): ("OutcomeUncertain", None, "UNCERTAIN", 0),
    ("body", True): ("value", False, "COMMITTED", 1),
    # Died after the effect, before the commit: uncertain, or found by the reconciler.
    ("effect", False): ("OutcomeUncertain", None, "UNCERTAIN", 1),
    ("effect", True): ("value", True, "COMMITTED", 1),
    # Died after the commit: the receipt is replayed.
    ("commit", False): ("value", True, "COMMITTED", 1),
    ("commit", True): ("value", True, "COMMITTED", 1),
}


def run_kill_cells(url: str, effects: Path, *, copies: int, lease_s: float = 1.0) -> None:
    """One worker process runs `copies` keys for every cell (point x reconciler), each
    stopped at its point; the process is SIGKILLed at a random moment once all are
    there; a fresh process retries every key. Asserts the expected state of each cell
    and that no key ever has two effects."""
    tag = uuid.uuid4().hex[:8]
    cells = {
        f"kill-{tag}-{point}-{'rec' if rec else 'none'}-{n}": (point, rec)
        for point in POINTS
        for rec in (False, True)
        for n in range(copies)
    }
    worker = spawn_worker(
        "kill", url=url, effects=str(effects), lease_s=lease_s,
        plan={key: point for key, (point, _rec) in cells.items()},
    )  # fmt: skip
    try:
        waiting = set(cells)
        deadline = time.monotonic() + 60
        assert worker.stdout is not None
        while waiting:
            line = worker.stdout.readline()
            assert line, f"worker died early: {worker_log(worker)}"
            assert line.startswith("at "), f"unexpected output from the worker: {line!r}"
            waiting.discard(line.split()[1])
            assert time.monotonic() < deadline, f"never reached their points: {waiting}"
        time.sleep(random.uniform(0, lease_s / 2))  # sometimes mid lease renewal
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    retry = spawn_worker(
        "retry", url=url, effects=str(effects), wait_s=lease_s * 10 + 5, lease_s=lease_s,
        reconcile={key: rec for key, (_point, rec) in cells.items()},
    )  # fmt: skip
    out, _ = retry.communicate(timeout=120)
    assert retry.returncode == 0, worker_log(retry)
    results = json.loads(out.strip().splitlines()[-1])
    counts = effects_per_key(effects)
    problems = []
    for key, cell in cells.items():
        kind, replayed, status, effect_count = EXPECTED[cell]
        got = results[key]
        seen = (
            got.get("error", "value"),
            got.get("replayed") if kind == "value" else None,
            got["status"],
            counts.get(key, 0),
        )
        if seen != (kind, replayed, status, effect_count):
            problems.append(
                f"{cell}: expected {(kind, replayed, status, effect_count)}, got {seen} {got}"
            )
        if kind == "value" and got.get("value") != f"receipt:{key}":
            problems.append(f"{cell}: returned {got.get('value')!r}")
    assert not problems, "\n".join(problems)
    assert max(counts.values(), default=0) <= 1, "a key had two effects"


def run_through_restart(
    url: str, effects: Path, stop: Callable[[], None], start: Callable[[], None], *,
    down_s: float, threads: int = 4, before: int = 30, after: int = 30,
) -> dict[str, str]:  # fmt: skip
    """Guarded calls on fresh keys from `threads` threads; once `before` have succeeded,
    `stop()` the server, keep it down for `down_s` (a guarded call made meanwhile must
    fail closed), `start()` it; go on until `after` more succeed. Every call must either
    complete or raise LedgerUnavailable, and no key may have two effects. Then every key
    that failed is retried from another ledger: still never a second effect. Returns
    key -> outcome."""
    from crewai_idempotent import Ledger, LedgerUnavailable, OutcomeUncertain

    ledger = Ledger(backend_from_url(url), lease_s=2.0, wait_s=1.0)
    tag = uuid.uuid4().hex[:8]
    outcomes: dict[str, str] = {}
    lock = threading.Lock()
    enough_before, restarted = threading.Event(), threading.Event()
    succeeded_after = 0
    deadline = time.monotonic() + 120

    def calls(n: int) -> None:
        nonlocal succeeded_after
        for i in range(10**6):
            key = f"restart-{tag}-{n}-{i}"

            def charge(key: str = key) -> str:
                append_line(effects, key)
                return f"receipt:{key}"

            try:
                value = ledger.run(key, charge)
                outcome = "ok" if value == f"receipt:{key}" else f"wrong receipt {value!r}"
            except LedgerUnavailable:
                outcome = "unavailable"
            except Exception as exc:  # noqa: BLE001 - the assertion below names it
                outcome = f"{type(exc).__name__}: {exc}"
            with lock:
                outcomes[key] = outcome
                if outcome == "ok" and restarted.is_set():
                    succeeded_after += 1
                if sum(o == "ok" for o in outcomes.values()) >= before:
                    enough_before.set()
                if succeeded_after >= after or time.monotonic() > deadline:
                    return

    workers = [threading.Thread(target=calls, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    try:
        assert enough_before.wait(60), f"calls did not succeed before the restart: {outcomes}"
        stop()
        down_since = time.monotonic()
        with pytest.raises(LedgerUnavailable):
            ledger.run(f"restart-{tag}-while-down", lambda: append_line(effects, "while-down"))
        time.sleep(max(0.0, down_s - (time.monotonic() - down_since)))
        start()
        restarted.set()
    finally:
        for worker in workers:
            worker.join()
        ledger.close()
    strange = {key: o for key, o in outcomes.items() if o not in ("ok", "unavailable")}
    assert not strange, f"calls neither completed nor raised LedgerUnavailable: {strange}"
    assert succeeded_after >= after, "calls did not succeed again after the restart"
    counts = effects_per_key(effects)
    assert max(counts.values(), default=0) <= 1, "a key ran twice"
    assert all(counts.get(key) == 1 for key, o in outcomes.items() if o == "ok")

    # The failed keys, retried once the lease of any claim that landed has lapsed: run
    # once, replayed, or uncertain (a claim landed and nobody knows more), never twice.
    retry = Ledger(backend_from_url(url), wait_s=10.0, lease_s=2.0)
    try:
        for key, outcome in outcomes.items():
            if outcome != "unavailable":
                continue
            try:
                retry.run(key, lambda key=key: append_line(effects, key) or f"receipt:{key}")
            except OutcomeUncertain:
                assert effects_per_key(effects).get(key, 0) <= 1
    finally:
        retry.close()
    assert max(effects_per_key(effects).values(), default=0) <= 1, "a retry ran a key twice"
    return outcomes


def check_cut_claims(url: str, proxy: CuttingProxy, claim: bytes, effects: Path) -> None:
    """Through `proxy`: a claim that never reaches the server fails closed; a claim that
    landed but whose reply was lost is recognised when resent, and the body runs once."""
    from crewai_idempotent import Ledger, LedgerUnavailable, Status

    ledger = Ledger(backend_from_url(url))
    direct = Ledger(backend_from_url(url.replace(f":{proxy.port}/", f":{proxy.upstream}/")))
    try:
        assert ledger.run("warm-up", lambda: "warm") == "warm"  # connected; scripts loaded

        proxy.arm(claim, when="before", times=100)
        with pytest.raises(LedgerUnavailable) as failure:
            ledger.run("cut-before", lambda: append_line(effects, "cut-before"))
        assert "cut-before" in str(failure.value)
        assert direct.get("cut-before") is None
        assert effects_per_key(effects).get("cut-before") is None

        proxy.arm(claim, when="after", times=1)
        assert ledger.run("cut-after", lambda: append_line(effects, "cut-after") or "r") == "r"
        assert proxy.cut == 1
        record = direct.get("cut-after")
        assert record is not None and record.status is Status.COMMITTED
        assert [e.kind for e in record.history] == ["claim", "commit"]
        assert effects_per_key(effects) == {"cut-after": 1}
    finally:
        ledger.close()
        direct.close()


def check_cut_commits(url: str, proxy: CuttingProxy, commit: bytes, effects: Path) -> None:
    """Through `proxy`: a commit whose reply was lost is recognised when resent; a commit
    that never gets through leaves the record to the lease rules (uncertain), never to a
    blind re-run."""
    from crewai_idempotent import Ledger, LedgerUnavailable, OutcomeUncertain, Status

    ledger = Ledger(backend_from_url(url), lease_s=1.0, commit_retry_s=0.5)
    direct = Ledger(backend_from_url(url.replace(f":{proxy.port}/", f":{proxy.upstream}/")))
    try:
        assert ledger.run("warm-up", lambda: "warm") == "warm"

        proxy.arm(commit, when="after", times=1)
        assert ledger.run("landed", lambda: append_line(effects, "landed") or "r") == "r"
        assert proxy.cut == 1
        record = direct.get("landed")
        assert record is not None and record.status is Status.COMMITTED
        assert not record.needs_operator

        proxy.arm(commit, when="before", times=10**6)
        # The receipt is in hand, so the caller may get it; the record cannot say so.
        with contextlib.suppress(LedgerUnavailable):
            assert ledger.run("lost", lambda: append_line(effects, "lost") or "r") == "r"
        proxy.arm(b"", times=0)
        record = direct.get("lost")
        assert record is not None and record.status is Status.PENDING
        with pytest.raises(OutcomeUncertain):
            direct.run("lost", lambda: append_line(effects, "lost") or "again", wait_s=10.0)
        record = direct.get("lost")
        assert record is not None and record.status is Status.UNCERTAIN
        assert effects_per_key(effects) == {"landed": 1, "lost": 1}
    finally:
        ledger.close()
        direct.close()
