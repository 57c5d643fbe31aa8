"""What the console tests share: a ledger with requests waiting in it, accounts, and a
logged-in HTTP client (Starlette's, in process) or the console served by the real command
in a subprocess."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crewai_idempotent import CacheBackend, Ledger
from crewai_idempotent._errors import ApprovalRequired
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Where

PASSWORD = "correct horse battery staple"
REPO = Path(__file__).resolve().parents[2]


def ask(
    backend: CacheBackend,
    key: str,
    summary: Mapping[str, Any],
    *,
    tool: str = "pay_invoice",
    approvers: int = 1,
    origin: Mapping[str, Any] | None = None,
) -> str:
    """Store an approval request for this call (as a gated call does), its id."""
    plan = Plan(
        tool=tool, fingerprint=f"fp-{key}-{sorted(summary.items())!r}"[:200], approval=True,
        approval_reason="the tool always requires approval", summary=dict(summary),
        where=Where(kickoff="kick-1", crew="crew-key", task="task-key"), approvers=approvers,
        origin=dict(origin or {"crew": "Payables", "task": "Pay the invoices", "agent": "Cashier"}),
    )  # fmt: skip
    ledger = Ledger(backend)
    try:
        ledger.run(key, lambda: "ran", fingerprint=plan.fingerprint, stage=plan)
    except ApprovalRequired as asked:
        return asked.request_id
    raise AssertionError(f"{key}: the call ran without approval")


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, "no CSRF field on the page"
    return match.group(1)


def login(client: Any, name: str, password: str = PASSWORD) -> Any:
    form = client.get("/login")
    token = re.search(r'name="login_csrf" value="([^"]+)"', form.text)
    assert token, form.text
    return client.post(
        "/login",
        data={"login_csrf": token.group(1), "name": name, "password": password},
        follow_redirects=False,
    )


@dataclass
class Served:
    """The console run by `crewai-idempotent console` in its own process."""

    url: str
    process: subprocess.Popen[str]
    lines: queue.Queue[str]
    seen: list[str]

    def output(self) -> str:
        """Everything it printed so far."""
        found = self.seen
        with contextlib.suppress(queue.Empty):
            while True:
                found.append(self.lines.get_nowait())
        return "".join(found)


@contextlib.contextmanager
def served(
    ledger_url: str, *options: str, env: Mapping[str, str] | None = None
) -> Iterator[Served]:
    """`crewai-idempotent --ledger URL console --port 0 OPTIONS`, until the block ends."""
    command = [sys.executable, "-m", "crewai_idempotent.cli", "--ledger", ledger_url, "console",
               "--port", "0", "--refresh", "0.2s", *options]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, **(env or {})}, start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    seen = []
    url = None
    while url is None:
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            process.kill()
            raise AssertionError("the console did not start: " + "".join(seen)) from None
        if line == "":
            raise AssertionError("the console exited: " + "".join(seen))
        seen.append(line)
        match = re.search(r"crewai-idempotent console on (http\S+)", line)
        if match:
            url = match.group(1)
    try:
        yield Served(url, process, lines, seen)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
