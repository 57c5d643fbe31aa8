"""A new operator's first hour: from a fresh folder to a logged-in console.

docs/console.md's quickstart is followed top to bottom in an empty folder, its commands
pasted into a shell as printed, and the login done over HTTP against the console it
started. Every command the console and `console users add` print is run the same way, from
the same folder and environment: it must work as pasted, naming the ledger as the user
did, and never print a password.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from crewai_idempotent import Ledger, backend_from_url
from crewai_idempotent.console import Accounts
from tests.support.console import PASSWORD, REPO, served

pytest.importorskip("argon2", reason="the console extra is not installed")

BIN = Path(sys.executable).parent  # where `crewai-idempotent` is installed
DOCS = REPO / "docs" / "console.md"


@pytest.fixture
def fresh(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An empty project folder and a shell environment in which no ledger exists yet: the
    default one would be made in XDG_DATA_HOME, named after the folder."""
    folder = tmp_path / "shop"
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREWAI_")}
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), PATH=f"{BIN}{os.pathsep}{env['PATH']}")
    env.pop("COLUMNS", None)
    return folder, env


def shell(
    command: str, cwd: Path, env: dict[str, str], typed: str = ""
) -> subprocess.CompletedProcess[str]:
    """`command` pasted into a shell in `cwd`, then `typed` (no terminal: a password prompt
    reads standard input)."""
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, input=typed, capture_output=True, text=True,
        timeout=120, start_new_session=True,
    )  # fmt: skip


def hint(output: str) -> str:
    """The one command between backticks that adds an account, as printed."""
    (command,) = re.findall(r"`(crewai-idempotent [^`]*console users add [^`]*)`", output)
    return command


def twice(password: str = PASSWORD) -> str:
    return f"{password}\n{password}\n"


# -- hints, pasted ----------------------------------------------------------------------------


def test_a_missing_ledger_names_the_command_that_makes_it(
    fresh: tuple[Path, dict[str, str]],
) -> None:
    folder, env = fresh
    for ledger in ("--ledger sqlite:///ops.db", ""):  # named relative to the folder; the default
        refused = shell(f"crewai-idempotent {ledger} console".replace("  ", " "), folder, env)
        assert refused.returncode == 1 and "no ledger at" in refused.stderr
        command = hint(refused.stderr)
        assert ("--ledger sqlite:///ops.db" in command) == bool(ledger), command
        pasted = shell(command, folder, env, twice())
        assert pasted.returncode == 0, pasted.stderr
        assert "made a new ledger at" in pasted.stderr and "added NAME (approver" in pasted.stdout
        listed = shell(f"crewai-idempotent {ledger} console users ls", folder, env)
        assert listed.stdout.splitlines() == ["NAME  approver  password"], listed.stderr
    assert (folder / "ops.db").is_file()
    assert (Path(env["XDG_DATA_HOME"]) / "shop" / "crewai_idempotent.db").is_file()


def test_the_ledger_from_the_environment_is_found_again_by_the_pasted_command(
    fresh: tuple[Path, dict[str, str]],
) -> None:
    folder, env = fresh
    env = {**env, "CREWAI_IDEMPOTENCY_URL": f"sqlite:///{folder / 'env.db'}"}
    refused = shell("crewai-idempotent console", folder, env)
    command = hint(refused.stderr)
    assert "--ledger" not in command  # the same shell has the variable
    pasted = shell(command, folder, env, twice())
    assert pasted.returncode == 0, pasted.stderr
    assert Accounts(backend_from_url(env["CREWAI_IDEMPOTENCY_URL"])).get("NAME") is not None


@pytest.mark.parametrize("auth", ["accounts", "proxy"])
def test_the_start_up_hint_runs_as_pasted(fresh: tuple[Path, dict[str, str]], auth: str) -> None:
    folder, env = fresh
    url = f"sqlite:///{folder / 'ledger.db'}"
    backend = backend_from_url(url)
    try:
        Ledger(backend).run("charge:1", lambda: "ch_1")  # a ledger the crews already use
        proxy = ("--auth", "proxy", "--trusted-proxy", "127.0.0.1") if auth == "proxy" else ()
        with served(url, *proxy) as console:
            pass
        command = hint(console.output())
        assert command.startswith(f"crewai-idempotent --ledger {url} console users add NAME")
        assert command.endswith("--no-password") == (auth == "proxy")
        pasted = shell(command, folder, env, twice())
        assert pasted.returncode == 0, pasted.stderr
        assert "made a new ledger" not in pasted.stderr
        account = Accounts(backend).get("NAME")
        assert account is not None and bool(account.password_hash) == (auth == "accounts")
    finally:
        backend.close()


def test_a_ledger_password_is_never_printed_in_a_hint(
    fresh: tuple[Path, dict[str, str]],
) -> None:
    from tests.support.servers import discard, start_redis

    folder, env = fresh
    secret = "pw-4f1e9c0b7a2d"
    redis = start_redis(extra=("--requirepass", secret))
    try:
        url = redis.fresh_url().replace("redis://", f"redis://:{secret}@", 1)
        with served(url) as console:
            pass
        out = console.output()
        assert secret not in out
        note = next(line for line in out.splitlines() if "no account can log in yet" in line)
        assert "with CREWAI_IDEMPOTENCY_URL set to the ledger's URL" in note
        command = hint(note)
        assert "--ledger" not in command
        pasted = shell(command, folder, {**env, "CREWAI_IDEMPOTENCY_URL": url}, twice())
        assert pasted.returncode == 0, pasted.stderr
        assert secret not in pasted.stdout + pasted.stderr
        backend = backend_from_url(url)
        try:
            assert Accounts(backend).get("NAME") is not None
        finally:
            backend.close()
    finally:
        discard(redis)


def test_a_failed_password_prompt_makes_no_ledger(fresh: tuple[Path, dict[str, str]]) -> None:
    folder, env = fresh
    typo = shell("crewai-idempotent --ledger sqlite:///ops.db console users add alice "
                 "--role approver", folder, env, f"{PASSWORD}\nsomething else\n")  # fmt: skip
    assert typo.returncode != 0
    assert not (folder / "ops.db").exists()


# -- docs/console.md, top to bottom ----------------------------------------------------------


def _quickstart() -> list[tuple[str, list[str]]]:
    """The first console block under "Running it": each `$ command` with the lines the
    docs show it printing."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("\n## Running it\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```console\n(.*?)```", section, re.S)
    assert block is not None, "no console block under Running it"
    steps: list[tuple[str, list[str]]] = []
    for line in block.group(1).splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


def _shown(expected: str) -> str:
    """What of a line the docs show must be printed as is: up to the first ledger path,
    which is the reader's own."""
    return expected.split(" sqlite:", 1)[0]


@contextlib.contextmanager
def _started(command: str, cwd: Path, env: dict[str, str]) -> Iterator[tuple[str, list[str]]]:
    """`command` pasted into a shell and left running: (the URL it listens on, what it
    printed so far), until the block ends."""
    process = subprocess.Popen(
        ["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    try:
        while True:
            line = lines.get(timeout=120)
            if line == "":
                raise AssertionError(f"{command} exited: {''.join(seen)}")
            seen.append(line)
            found = re.search(r"crewai-idempotent console on (http\S+)", line)
            if found:
                yield found.group(1), seen
                return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_docs_quickstart_gets_a_new_operator_logged_in(
    fresh: tuple[Path, dict[str, str]],
) -> None:
    folder, env = fresh
    steps = _quickstart()
    assert [command.split()[:3] for command, _ in steps] == [
        ["pip", "install", "'crewai-idempotent[console]'"],
        ["crewai-idempotent", "console", "users"],
        ["crewai-idempotent", "console"],
    ]
    # pip install: this environment has the package and its console extra already.
    (add, add_shows), (serve, serve_shows) = steps[1], steps[2]
    added = shell(add, folder, env, twice())
    assert added.returncode == 0, added.stderr
    for expected in add_shows:
        assert _shown(expected) in added.stdout + added.stderr, expected
    account = re.search(r"console users add (\S+)", add)
    assert account is not None
    with socket.socket() as probe:  # the quickstart's console listens on its default port
        if probe.connect_ex(("127.0.0.1", 8765)) == 0:
            pytest.fail("port 8765 is taken: the quickstart's console cannot listen there")
    with _started(serve, folder, env) as (url, printed):
        assert url == "http://127.0.0.1:8765"
        for expected in serve_shows:
            assert _shown(expected) in "".join(printed), expected
        with httpx.Client(base_url=url, timeout=60) as browser:
            form = browser.get("/login")
            token = re.search(r'name="login_csrf" value="([^"]+)"', form.text)
            assert token is not None, form.text
            answer = browser.post("/login", data={"login_csrf": token.group(1),
                                  "name": account.group(1), "password": PASSWORD})  # fmt: skip
            page = browser.get("/approvals")
    assert answer.status_code == 303 and page.status_code == 200, page.text
    assert f"{account.group(1)} · approver" in page.text  # logged in
    default = Path(env["XDG_DATA_HOME"]) / "shop" / "crewai_idempotent.db"
    assert f"ledger <code>sqlite:///{default}</code>" in page.text
