"""What the offline demos and `doctor --self-test` share: a scripted stand-in for the LLM,
the environment that keeps crewai offline, the demos' narration, their throwaway folders
for crewai's files, and their reproduction receipts.

A receipt (`crewai-idempotent demo --receipt FILE`, `demo-approvals --receipt FILE`) is one
JSON document for a bug report or a discussion upstream (docs/receipts.md reads each field):
the demo runs guarded, then the same crew without the guard (the control that shows the
duplicate); each run's timeline is what the crew did, step by step, and its effects are
read from the fake provider's own list, never from the ledger. The demos record the steps;
this module assembles and writes the document.

A scripted model answers every turn by calling the reply function registered under its
model name, so the model class has no fields of its own: the same class works whether
crewai's BaseLLM is a pydantic model (1.13+) or a plain class. crewai is imported when
the first model is made, not when this module is: the doctor imports the self-test's
launcher without paying for crewai.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

# A reply gets the conversation (a list of messages) and the tools offered, and returns
# the model's answer: text, or a list of native tool calls.
Reply = Callable[[list[Any], Any], Any]

OFFLINE = {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "OTEL_SDK_DISABLED": "true",
    "CREWAI_TRACING_ENABLED": "false",
}

# crewai's storage folder (crewai_core.paths.db_storage_path): a name in the user's data
# folder, or an absolute path used as it is.
STORAGE_ENV = "CREWAI_STORAGE_DIR"

# Entries are never removed: a crew may call its model until the process ends, and a
# process makes a handful of models (the self-test: one per check).
_replies: dict[str, tuple[bool, Reply]] = {}
_replies_lock = threading.Lock()


def go_offline() -> None:
    """Keep crewai from calling home; a value the user set wins. Before importing crewai."""
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)


def scripted_model(prefix: str, reply: Reply, *, native: bool = True) -> Any:
    """A crewai LLM whose every answer is `reply(messages, tools)`; `native`: it asks for
    tools with native function calls (else crewai runs its ReAct text loop)."""
    name = f"{prefix}-{uuid.uuid4().hex}"
    with _replies_lock:
        _replies[name] = (native, reply)
    return _model_class()(model=name)


def current_attempt(messages: list[Any]) -> list[Any]:
    """The messages of the latest attempt: from the last system prompt on (crewai < 1.14.4
    keeps the earlier attempts' messages in the conversation of a retry)."""
    starts = [
        i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "system"
    ]
    return messages[starts[-1] :] if starts else messages


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One native tool call, as a model's answer lists it."""
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": call_id, "type": "function", "function": function}


@functools.cache
def _model_class() -> type:
    from crewai.llms.base_llm import BaseLLM

    class ScriptedModel(BaseLLM):
        """Answers from the reply registered under its model name."""

        def supports_function_calling(self) -> bool:
            return _replies[self.model][0]

        def supports_stop_words(self) -> bool:
            return False

        def get_context_window_size(self) -> int:
            return 100_000

        def get_input_tokens_count(self, messages: Any, *args: Any, **kwargs: Any) -> int:
            return len(json.dumps(messages, default=str)) // 4 + 1

        async def acall(self, *args: Any, **kwargs: Any) -> Any:
            return self.call(*args, **kwargs)

        def call(self, messages: Any, tools: Any = None, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(messages, list):
                messages = [{"role": "user", "content": messages}]
            return _replies[self.model][1](messages, tools)

    return ScriptedModel


def narrator(console: Any = None) -> Any:
    """The console a demo narrates to: the one given (the CLI's), else a new one."""
    if console is not None:
        return console
    from rich.console import Console  # rich is only needed once a demo runs

    return Console(highlight=False, soft_wrap=True)


def say(console: Any, text: str) -> None:
    """Print a line of narration. Markup is on for this text only (the CLI's console prints
    data verbatim); every value interpolated into it must be escaped."""
    console.print(text, markup=True, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def demo_ledger(
    ledger_path: str | None, ledger_url: str | None, command: str
) -> Iterator[tuple[Any, str]]:
    """The ledger a demo runs on, and how to say which it is: the URL given with --ledger,
    the SQLite file given, or else a throwaway one in a temporary folder that is deleted
    when the demo ends (a demo never writes into the user's real default ledger)."""
    from ...backends._options import redact
    from ...backends._url import backend_from_url
    from ...backends.sqlite import SQLiteCacheBackend, sqlite_url

    if ledger_url is not None and ledger_path is not None:
        raise ValueError("the demo takes its ledger as a URL or as a path, not both")
    with contextlib.ExitStack() as stack:
        if ledger_url is not None:
            backend = backend_from_url(ledger_url)
            described = f"{redact(ledger_url)} (given with --ledger)"
        elif ledger_path is not None:
            backend = SQLiteCacheBackend(os.path.abspath(ledger_path))
            described = f"{sqlite_url(backend.path)} (given)"
        else:
            folder = stack.enter_context(
                tempfile.TemporaryDirectory(prefix=f"crewai-idempotent-{command}-")
            )
            backend = SQLiteCacheBackend(Path(folder) / "ledger.db")
            described = (
                f"{backend.url} (a throwaway ledger, deleted when the demo ends; "
                f"`crewai-idempotent --ledger URL {command}` runs it on one you keep)"
            )
        stack.callback(backend.close)
        yield backend, described


@contextlib.contextmanager
def crewai_files_thrown_away(command: str) -> Iterator[Callable[[], list[str]]]:
    """crewai's own files for a demo's run, in a throwaway folder deleted when it ends: its
    storage folder (CREWAI_STORAGE_DIR: every kickoff writes latest_kickoff_task_outputs.db
    there, else in the user's data folder under the current directory's name) and the temp
    folder (crewai keeps a lock file there for each SQLite file, named by the file's path,
    and never removes it). Both are process-wide while it lasts (a demo owns its process)
    and as they were afterwards. Enter it before crewai is imported: some of its modules
    make the storage folder when they are imported.

    Yields what says, at the end of the run, which of crewai's per-user folders crewai made
    meanwhile (importing crewai makes them the first time, whatever imports it), so that
    the demo can say what it leaves."""
    before = {path for path in _crewai_user_folders() if path.exists()}
    with tempfile.TemporaryDirectory(prefix=f"crewai-idempotent-{command}-crewai-") as folder:
        temp = Path(folder) / "tmp"
        temp.mkdir()
        storage, tempdir = os.environ.get(STORAGE_ENV), tempfile.tempdir
        os.environ[STORAGE_ENV] = str(Path(folder) / "storage")  # absolute: used as is
        tempfile.tempdir = str(temp)
        try:
            yield lambda: [
                str(path) for path in _crewai_user_folders() if path.exists() and path not in before
            ]
        finally:
            tempfile.tempdir = tempdir
            if storage is None:
                os.environ.pop(STORAGE_ENV, None)
            else:
                os.environ[STORAGE_ENV] = storage


def what_crewai_left(console: Any, made: list[str]) -> None:
    """Say which of crewai's per-user folders appeared during the demo (`made`): the only
    files it leaves. The demo's own, and crewai's for the run, went with their folders."""
    if made:
        from rich.markup import escape

        say(
            console,
            "[dim]left behind: "
            + ", ".join(escape(path) for path in made)
            + " (crewai makes them the first time it is imported, and keeps them: its "
            "login key and its settings); nothing else[/]",
        )


class Demo(Protocol):
    """What `run_offline` runs: the demo itself, then, asked for, its receipt."""

    def run(self) -> int: ...

    def receipt(self, path: str) -> int: ...


def run_offline(
    command: str,
    make: Callable[[Any, Any, str], Demo],
    ledger_path: str | None,
    ledger_url: str | None,
    console: Any,
    receipt: str | None,
) -> int:
    """Run the demo `make(narrator, backend, described)` builds, offline, on its ledger,
    with crewAI's files thrown away; then its receipt, if asked for. The worse of the two
    exit statuses; 1, said, if the ledger cannot be used."""
    from rich.markup import escape

    from ..._errors import LedgerConfigurationError, LedgerUnavailable

    go_offline()
    out = narrator(console)
    try:
        with (
            demo_ledger(ledger_path, ledger_url, command) as (backend, described),
            crewai_files_thrown_away(command) as crewai_made,
            unsigned(),
        ):
            demo = make(out, backend, described)
            status = demo.run()
            if receipt is not None:
                status = max(status, demo.receipt(receipt))
            what_crewai_left(out, crewai_made())
            return status
    except (LedgerUnavailable, LedgerConfigurationError) as exc:
        say(out, f"[red]cannot use that ledger:[/] {escape(str(exc))}")
        return 1


# What makes the guard demand signed decisions (integration/_signing): a demo's operator
# decides in-process without a key, on a throwaway ledger no deployment trusts anyway.
_SIGNING_ENV = (
    "CREWAI_IDEMPOTENCY_TRUSTED_KEYS",
    "CREWAI_IDEMPOTENCY_ACCEPT_UNSIGNED_GRANTS_UNTIL",
)


@contextlib.contextmanager
def unsigned() -> Iterator[None]:
    """The demo's decisions unsigned whatever the environment says, for as long as it
    runs (a demo owns its process), and the environment as it was afterwards."""
    kept = {name: os.environ.pop(name) for name in _SIGNING_ENV if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(kept)


def _crewai_user_folders() -> list[Path]:
    """Where crewai keeps files of its own per user, whatever runs it (crewai_core: the key
    for its platform login's tokens, and its settings)."""
    home = Path.home()
    if sys.platform == "win32":
        data = Path(os.environ.get("LOCALAPPDATA") or home)
    elif sys.platform == "darwin":
        data = home / "Library" / "Application Support"
    else:
        data = home / ".local" / "share"
    return [data / "crewai", home / ".config" / "crewai"]


def command_line(run: Callable[[str | None], int], module: str, argv: list[str] | None) -> int:
    """`python -m MODULE [LEDGER_PATH]`: run a demo on the SQLite file given, else on a
    throwaway ledger."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print(f"usage: python -m {module} [LEDGER_PATH]")
        return 2
    return run(args[0] if args else None)


# -- reproduction receipts ------------------------------------------------------------

RECEIPT_SCHEMA = "crewai-idempotent.receipt/1"


def receipt_unwritable(path: str) -> str | None:
    """Why a receipt cannot be written to `path`, or None if it can: said before the demo
    runs, so a bad path costs nothing. Nothing is created."""
    try:
        return _receipt_unwritable(Path(path))
    except OSError as exc:  # a folder on the way that this user may not look into
        return f"cannot look at {path}: {exc.strerror or exc}"


def _receipt_unwritable(target: Path) -> str | None:
    path = str(target)
    folder = target.parent
    if target.is_dir():
        return f"{path} is a folder; give a file name for the receipt"
    if not folder.exists():
        return f"the folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{path} cannot be written (no write permission)"
    if not target.exists() and not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} cannot be written (no write permission)"
    return None


def receipt_versions() -> dict[str, str]:
    """The exact versions the receipt was made with (installed distributions' metadata)."""

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "crewai": installed("crewai"),
        "crewai_idempotent": installed("crewai-idempotent"),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python_build": " ".join(sys.version.split()),
        "platform": platform.platform(),
    }


def receipt_document(
    demo: str, scenario: str, runs: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """The receipt: `demo` (the command), `scenario` (one sentence), the `runs` ("guarded"
    and "unguarded"), and any other top-level `fields` (the action, the verdict)."""
    return {
        "schema": RECEIPT_SCHEMA,
        "demo": demo,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": receipt_versions(),
        "scenario": scenario,
        **fields,
        "runs": runs,
    }


def write_receipt(path: str, receipt: dict[str, Any]) -> None:
    """Write `receipt` to `path` whole or not at all (a temporary file beside it, renamed).
    Raises OSError if it cannot be written."""
    target = Path(path)
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(receipt, out, indent=2, sort_keys=False, default=str)
            out.write("\n")
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def publish_receipt(
    say: Callable[[str], None],
    path: str,
    demo: str,
    scenario: str,
    runs: dict[str, Any],
    action: dict[str, Any],
    counts: tuple[int, int],
) -> bool:
    """Write the receipt of `demo` to `path`, its verdict from `counts` (the effects with
    the guard and without it), and say where; False (said) if it cannot be written."""
    from rich.markup import escape

    document = receipt_document(
        demo, scenario, runs, action=action,
        verdict={
            "guarded_effects": counts[0],
            "unguarded_effects": counts[1],
            "duplicates_prevented": counts[1] - counts[0],
        },
    )  # fmt: skip
    try:
        write_receipt(path, document)
    except OSError as exc:
        say(f"[red]could not write the receipt:[/] {escape(str(exc))}")
        return False
    say(f"receipt written to {escape(path)} [dim](docs/receipts.md reads it)[/]")
    return True
