"""The `crewai-idempotent` command line: listing, showing, resolving, purging, the demo."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent import (
    Event,
    Ledger,
    OutcomeUnknown,
    Owner,
    Record,
    SQLiteCacheBackend,
    Status,
)
from crewai_idempotent.cli import main
from crewai_idempotent.ledger._record import _whoami

WIDE = {"COLUMNS": "250"}  # rich wraps tables at 80 columns when not on a terminal


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@pytest.fixture
def url(ledger_path: Path) -> str:
    return f"sqlite:///{ledger_path}"


@pytest.fixture
def ledger(ledger_path: Path) -> Iterator[Ledger]:
    opened = Ledger(SQLiteCacheBackend(ledger_path), lease_s=30.0)
    yield opened
    opened.close()


def _raise(exc: BaseException) -> Any:
    def body() -> Any:
        raise exc

    return body


def _pending(ledger: Ledger, key: str, lease_left_s: float) -> Record:
    """A claim as a worker leaves it: live (`lease_left_s` > 0) or stale (its owner died)."""
    now = ledger.backend.now()
    owner = Owner("worker-host", 4242, "abcdef012345")
    record = Record(
        key=key,
        status=Status.PENDING,
        fingerprint="f" * 64,
        token=1,
        revision=1,
        owner=owner,
        attempts=1,
        created_at=now - 60,
        updated_at=now - 60,
        lease_expires_at=now + lease_left_s,
        history=(Event(now - 60, "claim", 1, owner.label),),
    )
    assert ledger.backend.insert(record) is None
    return record


def _fenced(ledger: Ledger, key: str) -> Record:
    """What a worker that committed after being taken over leaves behind."""
    ledger.run(key, lambda: {"id": "ch_new"})
    held = ledger.get(key)
    assert held is not None
    late = {
        "token": 1, "owner": "old-host:77:0123456789ab", "outcome": "commit",
        "result": {"t": "json", "v": {"id": "ch_old"}}, "error": None, "at": held.updated_at,
    }  # fmt: skip
    note = (
        "worker old-host:77:0123456789ab (token 1) finished (commit) after its claim was taken over"
    )
    new = held.evolve(
        Event(held.updated_at, "fenced", held.token, "old-host:77:0123456789ab", note),
        status=Status.UNCERTAIN,
        needs_operator=True,
        error=note,
        evidence=(late,),
    )
    assert ledger.backend.replace(held, new)
    return new


@pytest.fixture
def populated(ledger: Ledger) -> Ledger:
    ledger.run("order-committed", lambda: {"id": "ch_1", "amount": 100})
    with pytest.raises(ValueError):
        ledger.run("order-failed", _raise(ValueError("card declined")))
    with pytest.raises(OutcomeUnknown):
        ledger.run("order-uncertain", _raise(OutcomeUnknown("provider timed out after 30 s")))
    _pending(ledger, "order-stale", lease_left_s=-120)
    _pending(ledger, "order-running", lease_left_s=600)
    _fenced(ledger, "order-twice")
    return ledger


def cli(url: str | None, *args: str, env: dict[str, str] | None = None, **kw: Any) -> Result:
    argv = (["--ledger", url] if url else []) + list(args)
    return CliRunner().invoke(main, argv, env={**WIDE, **(env or {})}, **kw)


def rows(output: str) -> dict[str, str]:
    """`ls` table rows by key."""
    return {line.split()[0]: line for line in output.splitlines()[1:] if line.startswith("order-")}


# -- ls ------------------------------------------------------------------------------------


def test_ls_and_show_judge_leases_by_the_host_clock(url: str, ledger: Ledger) -> None:
    """A lease whose wall-clock deadline passed an hour ago but which the host's clock
    says is live (its owner's clock was set back) is live; one another host renews (a
    folder shared between hosts) is shown as such, and never as stale."""
    host = ledger.backend.host_clock
    assert host is not None
    for key, wall_left, lease in (
        ("order-stepped", -3600.0, (host.boot, host.running() + 600)),
        ("order-elsewhere", 600.0, ("another-boot", 9e9)),
    ):
        planted = _pending(ledger, key, lease_left_s=wall_left)
        assert ledger.backend.replace(
            planted,
            planted.evolve(None, lease_expires_at=planted.lease_expires_at, host_lease=lease),
        )
    listed = rows(cli(url, "ls").stdout)
    assert "stale" not in listed["order-stepped"]
    assert "lease expires in 10 min" in listed["order-stepped"]
    assert "PENDING (held on another host)" in listed["order-elsewhere"]
    assert "shared between hosts" in listed["order-elsewhere"]
    assert rows(cli(url, "ls", "--stale").stdout) == {}
    assert "held on another host" in cli(url, "show", "order-elsewhere").stdout
    data = json.loads(cli(url, "show", "order-stepped", "--json").stdout)
    assert data["stale"] is False and data["host_lease"][0] == host.boot


def test_ls_lists_every_record_with_its_state(url: str, populated: Ledger) -> None:
    result = cli(url, "ls")
    assert result.exit_code == 0, result.output
    listed = rows(result.stdout)
    assert set(listed) == {
        "order-committed", "order-failed", "order-uncertain", "order-stale",
        "order-running", "order-twice",
    }  # fmt: skip
    assert " COMMITTED " in listed["order-committed"]
    assert "card declined" in listed["order-failed"]
    assert "UNCERTAIN " in listed["order-uncertain"] and "timed out" in listed["order-uncertain"]
    assert "PENDING (stale)" in listed["order-stale"] and "lease expired" in listed["order-stale"]
    assert "worker-host:4242:abcdef012345" in listed["order-stale"]
    assert "PENDING " in listed["order-running"] and "stale" not in listed["order-running"]
    assert "UNCERTAIN (needs operator)" in listed["order-twice"]
    assert f"6 record(s) in {url}" in result.stdout


def test_ls_filters(url: str, populated: Ledger) -> None:
    uncertain = cli(url, "ls", "--status", "UNCERTAIN")
    assert set(rows(uncertain.stdout)) == {"order-uncertain", "order-twice"}
    assert set(rows(cli(url, "ls", "--status", "pending").stdout)) == {
        "order-stale", "order-running"
    }  # fmt: skip
    assert set(rows(cli(url, "ls", "--stale").stdout)) == {"order-stale"}
    assert set(rows(cli(url, "ls", "--needs-operator").stdout)) == {"order-twice"}
    none = cli(url, "ls", "--status", "committed", "--stale")
    assert none.exit_code == 0 and "no records match" in none.stdout
    bad = cli(url, "ls", "--status", "done")
    assert bad.exit_code == 2 and "'done' is not one of" in bad.stderr


def test_ls_json(url: str, populated: Ledger) -> None:
    result = cli(url, "ls", "--json")
    assert result.exit_code == 0
    listed = {item["key"]: item for item in json.loads(result.stdout)}
    assert len(listed) == 6
    assert listed["order-stale"]["stale"] is True and listed["order-running"]["stale"] is False
    assert Record.from_json(json.dumps(listed["order-committed"])) == populated.get(
        "order-committed"
    )


# -- show ----------------------------------------------------------------------------------


def test_show_gives_state_result_evidence_and_history(url: str, populated: Ledger) -> None:
    result = cli(url, "show", "order-twice")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "UNCERTAIN (needs operator)" in out
    assert "two executions may have happened" in out
    assert "evidence (1 late finisher(s))" in out and '"ch_old"' in out
    assert "old-host:77:0123456789ab" in out
    assert '"ch_new"' in out  # the new owner's receipt, still on the record
    table = out.split("history", 1)[1].splitlines()
    history = [re.split(r"\s{2,}", line.strip()) for line in table if line[:3].strip().isdigit()]
    assert [(line[0], line[2], line[3]) for line in history] == [
        ("1", "claim", "1"), ("2", "commit", "1"), ("3", "fenced", "1"),
    ]  # fmt: skip


def test_show_json_is_the_record(url: str, populated: Ledger) -> None:
    result = cli(url, "show", "order-stale", "--json")
    data = json.loads(result.stdout)
    assert data.pop("stale") is True
    assert Record.from_json(json.dumps(data)) == populated.get("order-stale")


@pytest.mark.parametrize(
    ("payload", "label", "shown"),
    [
        ({"t": "json", "v": {"id": "ch_j"}}, "result (json)", '"id": "ch_j"'),
        ({"t": "typed", "v": {"$t": "tuple", "v": ["a"]}}, "result (json with tagged types)",
         '"$t": "tuple"'),
        ({"t": "pydantic", "cls": "gone.module:Receipt", "v": {"id": "ch_p"}},
         "result (gone.module:Receipt)", '"id": "ch_p"'),
        ({"t": "str", "v": "<Receipt ch_s>", "type": "Receipt"}, "result (str() of Receipt)",
         '"<Receipt ch_s>"'),
    ],
)  # fmt: skip
def test_show_names_the_stored_result_kind_without_importing_it(
    url: str, populated: Ledger, payload: dict[str, Any], label: str, shown: str
) -> None:
    held = _fenced(populated, "order-kinds")
    stored = replace(held, revision=held.revision + 1, result=payload)
    assert populated.backend.replace(held, stored)
    result = cli(url, "show", "order-kinds")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("result ("))
    assert line.startswith(label) and shown in result.stdout.split(label, 1)[1]


def test_show_unknown_key(url: str, populated: Ledger) -> None:
    result = cli(url, "show", "order-nope")
    assert result.exit_code == 1
    assert "no record for idempotency key 'order-nope'" in result.stderr
    blank = cli(url, "show", " ")
    assert blank.exit_code == 2 and "KEY" in blank.stderr


# -- resolve -------------------------------------------------------------------------------


def test_resolve_happened_with_a_json_receipt(url: str, populated: Ledger) -> None:
    result = cli(
        url, "resolve", "order-uncertain", "--happened", "--result", '{"id": "ch_9", "n": 1}',
        "--reason", "ch_9 in the dashboard",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "COMMITTED" in result.stdout and "ch_9" in result.stdout
    record = populated.get("order-uncertain")
    assert record is not None and record.status is Status.COMMITTED
    assert record.value() == {"id": "ch_9", "n": 1}
    event = record.history[-1]
    assert (event.kind, event.by, event.note) == (
        "resolve",
        _whoami(),
        "happened: ch_9 in the dashboard",
    )
    assert populated.run("order-uncertain", _raise(AssertionError("must replay"))) == {
        "id": "ch_9", "n": 1
    }  # fmt: skip


def test_resolve_refuses_a_typed_name_as_approvals_do(url: str, populated: Ledger) -> None:
    """A resolution, like a decision, is recorded as the user running the command: a typed
    --by would let one person settle a record as someone else."""
    for verdict in (["--absent"], ["--happened", "--result-text", "ch_9"]):
        typed = cli(url, "resolve", "order-uncertain", *verdict, "--reason", "seen", "--by", "cfo")
        assert typed.exit_code == 2, typed.output
        assert "--by" in typed.stderr and "not a typed name" in typed.stderr
        assert f"recorded as yours ({_whoami()}, the user running this command)" in typed.stderr
        record = populated.get("order-uncertain")
        assert record is not None and record.status is Status.UNCERTAIN
    assert "--by" not in cli(url, "resolve", "--help").output  # refused, so not offered


def test_resolve_happened_with_a_text_receipt(url: str, populated: Ledger) -> None:
    result = cli(
        url, "resolve", "order-stale", "--happened", "--result-text", "ch_7", "--reason", "found"
    )
    assert result.exit_code == 0, result.output
    record = populated.get("order-stale")
    assert record is not None and record.value() == "ch_7"
    assert record.history[-1].by.split("@")[0]  # user@host by default


def test_resolve_absent(url: str, populated: Ledger) -> None:
    result = cli(url, "resolve", "order-stale", "--absent", "--reason", "pid 4242 gone, no charge")
    assert result.exit_code == 0, result.output
    assert "FAILED; the next attempt runs" in result.stdout
    record = populated.get("order-stale")
    assert record is not None and record.status is Status.FAILED
    assert populated.run("order-stale", lambda: "ran once") == "ran once"


def test_resolve_happened_keeps_the_stored_result(url: str, populated: Ledger) -> None:
    result = cli(url, "resolve", "order-twice", "--happened", "--reason", "refunded ch_old")
    assert result.exit_code == 0, result.output
    assert "two executions may have happened" in result.stdout
    record = populated.get("order-twice")
    assert record is not None and record.status is Status.COMMITTED
    assert record.value() == {"id": "ch_new"} and not record.needs_operator
    assert len(record.evidence) == 1


def test_resolve_refusals_change_nothing(url: str, populated: Ledger) -> None:
    before = {r.key: r for r in populated.records()}
    cases = [
        (["order-committed", "--absent", "--reason", "x"], 1, "is COMMITTED"),
        (["order-failed", "--happened", "--result-text", "t", "--reason", "x"], 1, "is FAILED"),
        (["order-running", "--absent", "--reason", "x"], 1, "with a live lease"),
        (["order-nope", "--absent", "--reason", "x"], 1, "no record for idempotency key"),
        (["order-uncertain", "--happened", "--reason", "x"], 2, "no stored result to keep"),
        (["order-uncertain", "--happened", "--result", "{nope", "--reason", "x"], 2, "not JSON"),
        (["order-uncertain", "--happened", "--absent", "--reason", "x"], 2, "either --happened"),
        (["order-uncertain", "--reason", "x"], 2, "either --happened or --absent"),
        (["order-uncertain", "--absent"], 2, "Missing option '--reason'"),
        (["order-uncertain", "--absent", "--reason", "  "], 2, "say what you checked"),
        (
            ["order-uncertain", "--absent", "--result-text", "t", "--reason", "x"],
            2,
            "with --happened",
        ),
        (
            [
                "order-uncertain",
                "--happened",
                "--result",
                "1",
                "--result-text",
                "1",
                "--reason",
                "x",
            ],
            2,
            "not both",
        ),
    ]
    for args, code, message in cases:
        result = cli(url, "resolve", *args)
        assert result.exit_code == code, (args, result.output)
        assert message in result.stderr, (args, result.stderr)
    assert {r.key: r for r in populated.records()} == before


# -- purge ---------------------------------------------------------------------------------


def test_purge(url: str, populated: Ledger) -> None:
    populated.run("order-expired", lambda: "old receipt", ttl=0.001)
    result = cli(url, "purge")
    assert result.exit_code == 0 and "purged 1 record(s)" in result.stdout
    assert populated.get("order-expired") is None and populated.get("order-committed")

    # The gates' state lives in the ledger as records: --all takes it too, and says so.
    from crewai_idempotent.gates import _gatestore

    for key in ("approval/ap_" + "1" * 20, "spend/pay/day-EUR/2026-12-01", "spend/pay/total"):
        _gatestore.update(populated.backend, _gatestore.PREFIX + key, lambda doc, now: {"k": 1})
    declined = cli(url, "purge", "--all", input="n\n")
    assert declined.exit_code == 1 and "receipts are lost" in declined.stderr
    assert "2 COMMITTED and FAILED record(s)" in declined.stderr
    assert "1 approval request(s) with their decisions" in declined.stderr
    assert "2 spend-cap budget(s), with the spend counted so far" in declined.stderr
    # order-uncertain is news for a person: an entry of the outbox (order-twice was planted)
    assert "1 notification(s) of the outbox" in declined.stderr
    assert populated.get("order-committed") is not None

    everything = cli(url, "purge", "--all", "--yes")
    assert everything.exit_code == 0 and "purged 6 record(s)" in everything.stdout
    left = {r.key: r.status for r in populated.records()}
    assert left == {
        "order-uncertain": Status.UNCERTAIN, "order-stale": Status.PENDING,
        "order-running": Status.PENDING, "order-twice": Status.UNCERTAIN,
    }  # fmt: skip


# -- where the ledger is -------------------------------------------------------------------


def test_bad_ledger_urls(tmp_path: Path) -> None:
    unknown = cli("bogus://somewhere", "ls")
    assert unknown.exit_code == 2 and "unknown ledger URL scheme 'bogus'" in unknown.stderr
    hosted = cli("sqlite://host/ledger.db", "ls")
    assert hosted.exit_code == 2 and "a sqlite URL has no host" in hosted.stderr
    missing = tmp_path / "typo.db"
    absent = cli(f"sqlite:///{missing}", "ls")
    assert absent.exit_code == 1 and f"no ledger at {missing}" in absent.stderr
    assert not missing.exists()  # looking did not create an empty ledger


def test_unreadable_ledger(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    corrupt.chmod(0o600)
    result = cli(f"sqlite:///{corrupt}", "ls")
    assert result.exit_code == 1
    assert "not a SQLite database" in result.stderr
    assert corrupt.read_bytes() == b"this is not a database" * 100


def test_ledger_from_the_environment(url: str, populated: Ledger) -> None:
    result = cli(None, "ls", "--status", "failed", env={"CREWAI_IDEMPOTENCY_URL": url})
    assert result.exit_code == 0 and set(rows(result.stdout)) == {"order-failed"}


# Every command, nested ones included, with what it needs to run on `populated`.
_EVERY_COMMAND = [
    ["ls"], ["show", "order-committed"], ["export"], ["purge"], ["doctor"], ["spend"],
    ["reconcile", "--dry-run"], ["resolve", "{key}", "--absent", "--reason", "gone"],
    ["approvals", "ls"], ["notifications", "ls"], ["console", "users", "ls"],
]  # fmt: skip


def _nowhere(tmp_path: Path) -> dict[str, str | None]:
    """An environment whose default ledger does not exist: a command that works used --ledger."""
    return {"XDG_DATA_HOME": str(tmp_path / "empty"), "CREWAI_STORAGE_DIR": None,
            "CREWAI_IDEMPOTENCY_URL": None}  # fmt: skip


@pytest.mark.parametrize("words", _EVERY_COMMAND, ids=lambda words: " ".join(words[:2]))
def test_the_ledger_goes_before_or_after_any_command(
    url: str, populated: Ledger, tmp_path: Path, words: list[str]
) -> None:
    if words[0] == "console":
        pytest.importorskip("argon2", reason="the console extra is not installed")
    env = {**WIDE, **_nowhere(tmp_path)}
    groups = 2 if words[0] == "console" else 1 if words[0] in ("approvals", "notifications") else 0
    placements = [
        ["--ledger", url, *words],  # before the command
        [*words, "--ledger", url],  # after it (and after its subcommand)
        [*words[: groups + 1], "--ledger", url, *words[groups + 1 :]],  # right after the name
        [*words[:1], "--ledger", url, *words[1:]],  # between a group and its subcommand
        ["--ledger", url, *words, "--ledger", url],  # both, the same
    ]
    for number, argv in enumerate(placements):
        key = f"order-lost-{number}"  # a record of its own to resolve, for each placement
        with pytest.raises(OutcomeUnknown):
            populated.run(key, _raise(OutcomeUnknown("timed out")))
        argv = [word.replace("{key}", key) for word in argv]
        done = CliRunner().invoke(main, argv, env=env)
        assert done.exit_code == 0, (argv, done.output)
        assert "No such option" not in done.output
        assert "no ledger at the default location" not in done.output
    if words[0] == "ls":
        assert "order-committed" in done.stdout  # the ledger named, not another


def test_a_ledger_given_before_and_after_must_agree(
    url: str, populated: Ledger, tmp_path: Path
) -> None:
    other = f"sqlite:///{tmp_path / 'other.db'}"
    env = {**WIDE, **_nowhere(tmp_path)}
    for argv in (
        ["--ledger", other, "ls", "--ledger", url],
        ["--ledger", other, "approvals", "ls", "--ledger", url],
        ["approvals", "--ledger", other, "ls", "--ledger", url],
    ):
        done = CliRunner().invoke(main, argv, env=env)
        assert done.exit_code == 2, (argv, done.output)
        assert "--ledger is given twice with different URLs" in done.stderr
        assert other in done.stderr and url in done.stderr
    assert not (tmp_path / "other.db").exists()
    # The environment's ledger is not "given": the one after the command is used.
    from_env = CliRunner().invoke(
        main, ["ls", "--ledger", url], env={**env, "CREWAI_IDEMPOTENCY_URL": other}
    )
    assert from_env.exit_code == 0 and "order-committed" in from_env.stdout
    # A password is never repeated.
    secret = "postgresql://app:hunter2hunter2@db.invalid/ledger"
    refused = CliRunner().invoke(main, ["--ledger", secret, "ls", "--ledger", url], env=env)
    assert refused.exit_code == 2 and "hunter2" not in refused.output
    assert "postgresql://app:***@db.invalid/ledger" in refused.stderr


def test_piped_output_is_not_wrapped(url: str, populated: Ledger) -> None:
    """Not on a terminal, a line is printed whole, however long (rich would wrap at 80)."""
    reason = " and ".join(["checked the provider's dashboard for key order-uncertain"] * 3)
    piped = {"COLUMNS": None, "LINES": None}
    resolved = CliRunner().invoke(
        main, ["--ledger", url, "resolve", "order-uncertain", "--happened", "--result-text",
               "ch_" + "9" * 90, "--reason", reason], env=piped,
    )  # fmt: skip
    assert resolved.exit_code == 0, resolved.output
    (line,) = resolved.stdout.splitlines()
    assert line.startswith("resolved 'order-uncertain' as happened") and ("9" * 90) in line
    shown = CliRunner().invoke(main, ["--ledger", url, "show", "order-uncertain"], env=piped)
    assert shown.exit_code == 0, shown.output
    (note,) = [line for line in shown.stdout.splitlines() if "happened: " in line]
    assert f"happened: {reason}" in note


def test_the_notify_lease_limit_is_the_documented_one(url: str, populated: Ledger) -> None:
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "notifications.md")
                    .read_text(encoding="utf-8").split())  # fmt: skip
    assert "must be longer than a try may take: the longest channel `timeout_s` plus 2 s" in docs
    hook = "webhook+https://hooks.example.invalid/x#secret=whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    slow = f"{hook}&timeout_s=20"
    refused = cli(url, "notify", "--channel", slow, "--lease", "21.9s")
    assert refused.exit_code == 2 and "shorter than a try may take (22.0 s" in refused.output
    enough = cli(url, "notify", "--channel", slow, "--lease", "22s")  # an empty outbox: one pass
    assert enough.exit_code == 0, enough.output


def test_default_ledger_is_the_integrations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("CREWAI_STORAGE_DIR", "shop")
    monkeypatch.delenv("CREWAI_IDEMPOTENCY_URL", raising=False)
    from crewai_idempotent.integration import default_ledger_path

    path = default_ledger_path()
    assert path.is_relative_to(tmp_path / "data" / "shop")
    missing = cli(None, "ls")
    assert missing.exit_code == 1
    assert f"no ledger at the default location {path}" in missing.stderr
    assert "'shop'" in missing.stderr
    created = Ledger(SQLiteCacheBackend(path))
    created.run("order-default", lambda: "ok")
    created.close()
    listed = cli(None, "ls")
    assert listed.exit_code == 0 and set(rows(listed.stdout)) == {"order-default"}
    assert "(default)" in listed.stdout


# -- demo ----------------------------------------------------------------------------------


def test_demo_calls_run_demo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[Any, Any, Any]] = []

    def run_demo(
        ledger_path: str | None = None, *, ledger_url: str | None = None, console: Any = None
    ) -> int:
        calls.append((ledger_path, ledger_url, console))
        console.print("demo ran")
        return 3

    fake = types.ModuleType("crewai_idempotent.integration.offline._demo")
    fake.run_demo = run_demo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "crewai_idempotent.integration.offline._demo", fake)
    target = str(tmp_path / "demo.db")
    env = {"CREWAI_IDEMPOTENCY_URL": "sqlite:///must/not/be/used.db"}
    result = cli(None, "demo", "--ledger-path", target, env=env)
    assert result.exit_code == 3 and "demo ran" in result.stdout
    assert calls[-1][:2] == (target, None) and calls[-1][2] is not None
    # The environment's ledger is never the demo's: a throwaway one unless --ledger.
    assert cli(None, "demo", env=env).exit_code == 3 and calls[-1][:2] == (None, None)
    url = f"sqlite:///{tmp_path / 'kept.db'}"
    assert cli(url, "demo", env=env).exit_code == 3 and calls[-1][:2] == (None, url)
    both = cli(url, "demo", "--ledger-path", target)
    assert both.exit_code == 2 and "not both" in both.stderr


def test_demo_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "crewai_idempotent.integration.offline._demo", None)
    result = cli(None, "demo")
    assert result.exit_code == 1 and "the demo is not available" in result.stderr


# -- the installed console script ----------------------------------------------------------


def _script() -> Path:
    script = Path(sys.executable).parent / "crewai-idempotent"
    if not script.exists():
        pytest.fail(f"console script not installed at {script}: pip install -e .")
    return script


def test_console_script(url: str, populated: Ledger) -> None:
    env = {**os.environ, **WIDE}
    listed = subprocess.run(
        [_script(), "--ledger", url, "ls", "--stale"], capture_output=True, text=True, env=env
    )
    assert listed.returncode == 0, listed.stderr
    assert set(rows(listed.stdout)) == {"order-stale"}
    resolved = subprocess.run(
        [_script(), "--ledger", url, "resolve", "order-stale", "--absent", "--reason", "gone"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr
    assert populated.get("order-stale").status is Status.FAILED  # type: ignore[union-attr]
    refused = subprocess.run(
        [_script(), "--ledger", url, "resolve", "order-stale", "--absent", "--reason", "again"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert refused.returncode == 1 and "is FAILED" in refused.stderr


def test_operator_commands_do_not_import_crewai(url: str, populated: Ledger) -> None:
    """`import crewai` takes seconds; ls/show/resolve/purge must not pay for it."""
    program = f"""
import json, sys
from crewai_idempotent.cli import main
for argv in (["ls"], ["show", "order-twice"], ["show", "order-nope"],
             ["resolve", "order-uncertain", "--absent", "--reason", "r"], ["purge"]):
    try:
        main(["--ledger", {url!r}, *argv])
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "crewai")))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    assert populated.get("order-uncertain").status is Status.FAILED  # type: ignore[union-attr]


def test_default_ledger_lookup_does_not_import_crewai(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "CREWAI_STORAGE_DIR": "p"}
    env.pop("CREWAI_IDEMPOTENCY_URL", None)
    program = """
import json, sys
from crewai_idempotent.cli import main
try:
    main(["ls"])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "crewai")))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env)
    assert "no ledger at the default location" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_resolve_keeps_a_pydantic_receipt_it_cannot_import(url: str, populated: Ledger) -> None:
    held = _fenced(populated, "order-model")
    stored = replace(
        held,
        revision=held.revision + 1,
        result={"t": "pydantic", "cls": "gone.module:Receipt", "v": {"id": "ch_m"}},
    )
    assert populated.backend.replace(held, stored)
    result = cli(url, "resolve", "order-model", "--happened", "--reason", "x")
    assert result.exit_code == 2 and "gone.module:Receipt" in result.stderr
    ok = cli(
        url, "resolve", "order-model", "--happened", "--result", '{"id": "ch_m"}', "--reason", "x"
    )
    assert ok.exit_code == 0, ok.output


def test_resolve_keeps_a_typed_receipt_it_cannot_import(url: str, populated: Ledger) -> None:
    held = _fenced(populated, "order-typed")
    tree = {"lines": [{"$t": "pydantic", "cls": "gone.module:Line", "v": {"sku": "a"}}]}
    stored = replace(held, revision=held.revision + 1, result={"t": "typed", "v": tree})
    assert populated.backend.replace(held, stored)
    result = cli(url, "resolve", "order-typed", "--happened", "--reason", "x")
    assert result.exit_code == 2 and "gone.module:Line" in result.stderr
    record = populated.get("order-typed")
    assert record is not None and record.status is Status.UNCERTAIN  # nothing changed


def test_keys_and_notes_print_as_written(url: str, ledger: Ledger) -> None:
    key = "charge:[bold]x[/bold]:smile:"
    with pytest.raises(OutcomeUnknown):
        ledger.run(key, _raise(OutcomeUnknown("[red]no answer[/red]")))
    shown = cli(url, "show", key)
    assert shown.exit_code == 0, shown.output
    assert key in shown.stdout and "[red]no answer[/red]" in shown.stdout
    assert key in cli(url, "ls").stdout
    resolved = cli(url, "resolve", key, "--absent", "--reason", "[none]")
    assert resolved.exit_code == 0 and key in resolved.stdout


# -- what an operator's terminal receives ----------------------------------------------------

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202eevil\u2066"


def _raw_controls(text: str) -> list[str]:
    return [c for c in text if c in "\x1b\x07\x9b\u202e\u2066"]


def test_control_and_bidi_characters_are_escaped_everywhere(url: str, ledger: Ledger) -> None:
    key = "pay:\u202egpj.exe\x9b"  # a valid key: no C0 controls, but C1 and bidi
    with pytest.raises(OutcomeUnknown):
        ledger.run(key, _raise(OutcomeUnknown(f"provider said {HOSTILE}\nfake row")))
    outputs = {
        "ls": cli(url, "ls"),
        "show": cli(url, "show", key),
        "show-missing": cli(url, "show", key + "x"),
        "resolve": cli(
            url, "resolve", key, "--happened", "--result-text", HOSTILE, "--reason", "x"
        ),
        "show-after": cli(url, "show", key),
        "ls-json": cli(url, "ls", "--json"),
        "export": cli(url, "export"),
    }
    for name, result in outputs.items():
        assert _raw_controls(result.stdout + result.stderr) == [], name
    assert "\\u202e" in outputs["ls"].stdout and "\\x1b" in outputs["ls"].stdout
    assert "\\x1b]0;pwned" in outputs["show"].stdout
    assert "\\n" in outputs["show"].stdout and "\nfake row" not in outputs["show"].stdout
    assert "\\x9b" in outputs["show-missing"].stderr
    # machine output stays exact JSON: the stored receipt reads back as written
    (record,) = json.loads(outputs["ls-json"].stdout)
    assert record["result"]["v"] == HOSTILE


def test_passwords_in_ledger_urls_are_never_printed(tmp_path: Path) -> None:
    from tests.support.servers import discard, start_redis

    server = start_redis(extra=("--requirepass", "s3cr%t pw"))
    try:
        good = server.url().replace("redis://", "redis://:s3cr%25t%20pw@", 1)
        wrong = server.url().replace("redis://", "redis://:wrong%25s3cret@", 1)
        results = [
            cli(good, "ls"),
            cli(good, "show", "nope"),
            cli(good, "purge"),
            cli(good, "export"),
            cli(good, "doctor"),
            cli(None, "ls", env={"CREWAI_IDEMPOTENCY_URL": good}),
            cli(wrong, "ls"),
            cli(good.replace("redis://", "redis://x", 1) + "?bogus_option=1", "ls"),
        ]
    finally:
        discard(server)
    assert results[0].exit_code == 0, results[0].output
    assert "redis://:***@" in results[0].stdout
    assert results[6].exit_code == 1
    for result in results:
        text = result.stdout + result.stderr
        for secret in ("s3cr%t pw", "s3cr%25t%20pw", "s3cr", "wrong%25s3cret", "wrong%s3cret"):
            assert secret not in text, text


# -- which ledger, and never making one ------------------------------------------------------


def test_the_environment_is_named_as_the_source(tmp_path: Path) -> None:
    missing = tmp_path / "typo.db"
    env = {"CREWAI_IDEMPOTENCY_URL": f"sqlite:///{missing}"}
    result = cli(None, "ls", env=env)
    assert result.exit_code == 1
    assert "from CREWAI_IDEMPOTENCY_URL" in result.stderr and "--ledger" not in result.stderr
    bad = cli(None, "ls", env={"CREWAI_IDEMPOTENCY_URL": "bogus://x"})
    assert bad.exit_code == 2 and "CREWAI_IDEMPOTENCY_URL" in bad.stderr
    assert "--ledger" not in bad.stderr


def test_inspection_never_turns_a_file_into_a_ledger(tmp_path: Path) -> None:
    import sqlite3

    empty = tmp_path / "empty.db"
    empty.touch()
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE notes (x)")
    other_bytes = other.read_bytes()
    for command in (["ls"], ["show", "k"], ["export"], ["purge"], ["doctor"]):
        result = cli(f"sqlite:///{empty}", *command)
        assert result.exit_code == 1 and "empty file" in result.stderr + result.stdout, command
        result = cli(f"sqlite:///{other}", *command)
        assert result.exit_code == 1 and "without a ledger table" in result.output, command
    assert empty.stat().st_size == 0
    assert other.read_bytes() == other_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db", "other.db"]


def test_file_urls_never_create_folders(tmp_path: Path) -> None:
    existing = tmp_path / "some-folder"
    existing.mkdir()
    for url in (f"file://{existing}", f"file://{tmp_path / 'absent'}"):
        for command in (["ls"], ["purge"], ["doctor"]):
            result = cli(url, *command)
            assert result.exit_code == 1 and "no ledger at" in result.output, (url, command)
    assert list(existing.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["some-folder"]
    relative = cli("file://some-folder", "ls")
    assert relative.exit_code == 2 and "read as a host name" in relative.stderr


# -- filters, export, doctor ----------------------------------------------------------------


def test_ls_filters_by_tool_prefix_and_age(url: str, ledger: Ledger) -> None:
    ledger.run("order-charge:abc", lambda: "ch_1")
    ledger.run("order-charge:def", lambda: "ch_2")
    ledger.run("order-mail:abc", lambda: "m_1")
    old = ledger.get("order-charge:abc")
    assert old is not None
    assert ledger.backend.replace(
        old, replace(old, revision=old.revision + 1, updated_at=old.updated_at - 3 * 86400)
    )
    assert set(rows(cli(url, "ls", "--tool", "order-charge").stdout)) == {
        "order-charge:abc",
        "order-charge:def",
    }
    assert set(rows(cli(url, "ls", "--prefix", "order-m").stdout)) == {"order-mail:abc"}
    assert set(rows(cli(url, "ls", "--older-than", "2d").stdout)) == {"order-charge:abc"}
    assert set(rows(cli(url, "ls", "--newer-than", "1h", "--tool", "order-charge").stdout)) == {
        "order-charge:def"
    }
    assert cli(url, "ls", "--older-than", "soon").exit_code == 2


def test_export_is_json_lines_with_history(url: str, populated: Ledger) -> None:
    result = cli(url, "export")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    records = [json.loads(line) for line in lines]
    by_key = {r["key"]: r for r in records}
    assert set(by_key) == {r.key for r in populated.records()}
    twice = by_key["order-twice"]
    assert [e["kind"] for e in twice["history"]][-1] == "fenced" and twice["evidence"]
    assert by_key["order-stale"]["stale"] is True
    only = cli(url, "export", "--status", "uncertain")
    assert {json.loads(line)["key"] for line in only.stdout.splitlines()} == {
        "order-uncertain",
        "order-twice",
    }


READ_ONLY_DOCTOR = r"""
set -e
mount -t tmpfs none "$MNT"
mkdir -m 700 "$MNT/app"
"$PYTHON" -c "
import sys
from crewai_idempotent import Ledger, SQLiteCacheBackend
ledger = Ledger(SQLiteCacheBackend(sys.argv[1])); ledger.run('k', lambda: 1); ledger.close()
" "$MNT/app/ledger.db"
mount -o remount,ro "$MNT"
for url in "sqlite:///$MNT/app/ledger.db" "file://$MNT/app/files"; do
    "$PYTHON" -m crewai_idempotent.cli --ledger "$url" doctor || echo "exit $?"
done
"""


def test_doctor_says_read_only_filesystem(tmp_path: Path) -> None:
    """A tmpfs mounted read-only in a mount namespace of our own (unshare -rm: a user
    namespace, so no privilege on the host is needed or used)."""
    unshare = shutil.which("unshare")
    probe = (
        subprocess.run([unshare, "-rm", "true"], capture_output=True, timeout=60)
        if unshare
        else None
    )
    if probe is None or probe.returncode != 0:
        reason = "unshare -rm (util-linux, user namespaces) is not available here"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    mount = tmp_path / "mnt"
    mount.mkdir()
    env = {
        **os.environ,
        "MNT": str(mount),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    assert unshare is not None
    done = subprocess.run(
        [unshare, "-rm", "bash", "-c", READ_ONLY_DOCTOR],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("filesystem")]
    assert len(said) == 2, done.stdout
    for line in said:
        assert f"PROBLEM: {mount / 'app'} is on a read-only filesystem" in line
    assert done.stdout.count("exit 1") == 2


def test_doctor_reports_ledger_source_modes_durability_and_support(
    url: str, ledger_path: Path, populated: Ledger, tmp_path: Path
) -> None:
    import importlib.metadata

    result = cli(url, "doctor")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"ledger       {url}" in out and "source       --ledger" in out
    assert f"{ledger_path}  -rw------- (0600)" in out
    assert "reachable    yes" in out and "2 uncertain" in out
    assert "synchronous=FULL: survives power loss" in out
    assert f"crewai       {importlib.metadata.version('crewai')}: supported" in out
    assert "activation" in out
    from_env = cli(None, "doctor", env={"CREWAI_IDEMPOTENCY_URL": url + "?synchronous=NORMAL"})
    assert "source       CREWAI_IDEMPOTENCY_URL" in from_env.stdout
    assert "synchronous=NORMAL" in from_env.stdout

    ledger_path.parent.chmod(0o777)
    try:
        unsafe = cli(url, "doctor")
    finally:
        ledger_path.parent.chmod(0o700)
    assert unsafe.exit_code == 1 and "writable by group or others" in unsafe.stdout


def test_doctor_names_the_default_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("CREWAI_STORAGE_DIR", raising=False)
    monkeypatch.delenv("CREWAI_IDEMPOTENCY_URL", raising=False)
    from crewai_idempotent.integration import default_ledger_path

    result = cli(None, "doctor")
    assert result.exit_code == 1  # no ledger there yet: reported, not created
    assert f"default: {default_ledger_path()}" in result.stdout
    assert "named after the current directory" in result.stdout
    assert not default_ledger_path().exists()


@pytest.mark.parametrize("scheme", ["sqlite", "file"])
def test_a_misspelt_option_is_named_before_the_ledger_is_looked_for(
    tmp_path: Path, scheme: str
) -> None:
    # A missing ledger and a typo in the URL: the typo is what the operator must fix.
    target = tmp_path / ("missing.db" if scheme == "sqlite" else "missing")
    result = cli(f"{scheme}://{target}?synchronus=FULL", "ls")
    assert result.exit_code == 2, result.output
    assert "unknown option 'synchronus'" in result.output
    assert not target.exists()


def test_show_says_arguments_are_recorded_only_where_they_are(ledger: Ledger, url: str) -> None:
    """Every crewAI tool's claim records the tool's name; only a tool with a reconciler of
    its own records its arguments too, and `show` says which."""
    named = _pending(ledger, "charge:named", lease_left_s=600)
    assert ledger.backend.replace(named, named.evolve(None, call={"tool": "charge_card"}))
    shown = cli(url, "show", "charge:named")
    assert shown.exit_code == 0, shown.output
    assert "tool charge_card" in shown.output and "arguments recorded" not in shown.output
    both = _pending(ledger, "charge:both", lease_left_s=600)
    call = {"tool": "charge_card", "reconciler": "shop:verify", "args": {"order": "o1"}}
    assert ledger.backend.replace(both, both.evolve(None, call=call))
    assert "arguments recorded" in cli(url, "show", "charge:both").output
