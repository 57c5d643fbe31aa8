"""The chain itself, and the resolutions it binds: a history cut at the limit still
verifies, the chain belongs to its key, a lone surrogate in a note survives the round
trip; a ledger with trusted keys checks a resolution only where one is used (never on an
ordinary replay), refuses a found receipt it cannot verify, and `resolve` refuses early;
the sweeper signs its settlements, or, unsigned on a ledger with trusted keys, leaves an
absent one unwritten."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent import (
    DecisionRefused,
    Ledger,
    OutcomeUnknown,
    ResolutionRefused,
    SQLiteCacheBackend,
    Status,
)
from crewai_idempotent.cli import main as cli
from crewai_idempotent.ledger import _chain
from crewai_idempotent.ledger._record import HISTORY_LIMIT
from crewai_idempotent.ledger._results import encode
from crewai_idempotent.reconciliation import Sweeper
from crewai_idempotent.signing import Signer, TrustedKeys
from tests.support.reconcile import uncertain

from .stored import Stored


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def unknown() -> None:
    raise OutcomeUnknown("the provider timed out")


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}?synchronous=NORMAL"


@pytest.fixture
def ledger(url: str) -> Any:
    opened = Ledger(SQLiteCacheBackend(url.split("///", 1)[1].split("?")[0], synchronous="NORMAL"))
    yield opened
    opened.close()


class Counted(TrustedKeys):
    """Trusted keys that count how often a key is looked up: once per verification."""

    looked_up = 0

    def get(self, key_id: str) -> Any:
        type(self).looked_up += 1
        return super().get(key_id)


@pytest.fixture
def alice(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "alice.key", identity="alice@example.com", roles=["resolve"])


@pytest.fixture
def sweeper_key(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "sweeper.key", identity="payments-sweeper", roles=["sweeper"])


def trust(*signers: Signer) -> Counted:
    Counted.looked_up = 0
    return Counted.from_lines([signer.trusted_line() for signer in signers])  # type: ignore[return-value]


def test_a_history_cut_at_the_limit_still_verifies_and_an_edit_after_the_cut_is_named(
    ledger: Ledger, url: str, tmp_path: Path
) -> None:
    def boom() -> None:
        raise ValueError("declined")

    for _ in range(12):
        with pytest.raises(ValueError):
            ledger.run("retried", boom)
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(run("--ledger", url, "export").output)
    for _ in range(HISTORY_LIMIT // 2):
        with pytest.raises(ValueError):
            ledger.run("retried", boom)
    stored = Stored(url)
    doc = stored.read("retried")
    assert len(doc["history"]) == HISTORY_LIMIT and doc["chain_cut"][0] == 24
    assert run("--ledger", url, "verify").exit_code == 0
    against = run("--ledger", url, "verify", "--against", str(earlier))
    assert against.exit_code == 0
    assert "note: 'retried': the history limit has cut it past the end" in against.output

    edited = json.loads(json.dumps(doc))
    edited["history"][1][4] = "edited right after the cut"
    stored.write("retried", edited)
    result = run("--ledger", url, "verify")
    assert result.exit_code == 1 and "'retried': edited: event #2 (" in result.output
    assert _chain.check(doc, limit=HISTORY_LIMIT) == []
    del doc["history"][5], doc["chain"][5]  # one event and its digest
    kinds = {problem.kind for problem in _chain.check(doc, limit=HISTORY_LIMIT)}
    assert kinds == {"edited", "cut"}


def test_the_chain_belongs_to_its_key(ledger: Ledger, url: str) -> None:
    ledger.run("pay:a", lambda: "ch_a")
    ledger.run("pay:b", lambda: "ch_b")
    stored = Stored(url)
    moved = {**stored.read("pay:a"), "key": "pay:b"}  # a's history, claimed for b
    stored.write("pay:b", moved)
    result = run("--ledger", url, "verify")
    assert result.exit_code == 1
    assert "'pay:b': edited: event #1 (claim" in result.output


def test_a_lone_surrogate_in_a_note_verifies_from_the_ledger_and_its_export(
    ledger: Ledger, url: str, tmp_path: Path
) -> None:
    def odd() -> None:
        raise ValueError("bad byte \udcff here")

    with pytest.raises(ValueError):
        ledger.run("odd", odd)
    ledger.run("odd", lambda: "fine")
    assert run("--ledger", url, "verify").exit_code == 0
    export = tmp_path / "export.jsonl"
    export.write_text(run("--ledger", url, "export").output)
    result = run("verify", "--export", str(export))
    assert result.exit_code == 0, result.output


def test_trusted_keys_are_asked_only_where_a_resolution_is_used(
    ledger: Ledger, alice: Signer
) -> None:
    ledger.trusted_keys = trusted = trust(alice)
    ledger.run("plain", lambda: "ch_plain")
    for _ in range(3):
        assert ledger.run("plain", lambda: "again") == "ch_plain"
    assert Counted.looked_up == 0  # an ordinary replay verifies nothing

    ledger.trusted_keys = None
    with pytest.raises(OutcomeUnknown):
        ledger.run("pay", unknown)
    ledger.trusted_keys = trusted
    record = ledger.resolve("pay", result="ch_found", reason="in the dashboard", signer=alice)
    assert record.resolved == 2 and record.resolution is not None
    assert record.history[-1].by == "alice@example.com"
    looked = Counted.looked_up
    assert ledger.run("pay", lambda: "never") == "ch_found"  # verified, then replayed
    assert Counted.looked_up == looked + 1


def test_a_found_resolution_that_cannot_be_verified_is_not_replayed(
    ledger: Ledger, url: str, alice: Signer
) -> None:
    with pytest.raises(OutcomeUnknown):
        ledger.run("pay", unknown)
    ledger.resolve("pay", result="ch_found", reason="in the dashboard", signer=alice)
    stored = Stored(url)
    doc = stored.read("pay")
    doc["result"] = encode("ch_forged")  # the receipt a later call would be handed
    stored.write("pay", doc)
    ledger.trusted_keys = trust(alice)
    with pytest.raises(DecisionRefused) as refused:
        ledger.run("pay", lambda: "never")
    assert refused.value.reason == "subject"
    assert "another receipt than the one stored" in str(refused.value)
    # The same with signing off: the stored receipt is replayed, as today.
    ledger.trusted_keys = None
    assert ledger.run("pay", lambda: "never") == "ch_forged"


def test_the_async_path_refuses_an_unsigned_resolution_too(ledger: Ledger, alice: Signer) -> None:
    import asyncio

    with pytest.raises(OutcomeUnknown):
        ledger.run("pay", unknown)
    ledger.resolve("pay", absent=True, reason="unsigned")
    ledger.trusted_keys = trust(alice)
    ran: list[str] = []

    async def body() -> str:
        ran.append("charged")
        return "ch_2"

    with pytest.raises(DecisionRefused, match="carries no signature"):
        asyncio.run(ledger.arun("pay", body))
    assert ran == []
    ledger.resolve("pay", absent=True, reason="none at the provider", signer=alice)
    assert asyncio.run(ledger.arun("pay", body)) == "ch_2" and ran == ["charged"]


def test_resolve_refuses_early_on_a_ledger_with_trusted_keys(
    ledger: Ledger, alice: Signer, tmp_path: Path
) -> None:
    with pytest.raises(OutcomeUnknown):
        ledger.run("pay", unknown)
    before = ledger.get("pay")
    ledger.trusted_keys = trust(alice)
    with pytest.raises(DecisionRefused, match="trusts only signed resolutions"):
        ledger.resolve("pay", absent=True, by="operator-alice")
    stranger = Signer.create(tmp_path / "bob.key", identity="bob@example.com")
    with pytest.raises(DecisionRefused) as refused:
        ledger.resolve("pay", absent=True, signer=stranger)
    assert refused.value.reason == "untrusted-key"
    with pytest.raises(ValueError, match=r"signs as 'alice@example\.com'"):
        ledger.resolve("pay", absent=True, by="operator-alice", signer=alice)
    with pytest.raises(TypeError, match="TrustedKeys"):
        ledger.trusted_keys = ["a line"]  # type: ignore[assignment]
    assert ledger.get("pay") == before  # nothing was written

    ledger.resolve("pay", absent=True, reason="none at the provider", signer=alice)
    # A resolved record is resolved again only with a signer (to replace a refused one).
    ledger.trusted_keys = None
    with pytest.raises(ResolutionRefused, match="with a signing key"):
        ledger.resolve("pay", result="ch_1")
    again = ledger.resolve("pay", result="ch_1", signer=alice)
    assert again.status is Status.COMMITTED and again.resolved == 3


def test_the_sweeper_signs_its_settlements(
    ledger: Ledger, url: str, sweeper_key: Signer, alice: Signer
) -> None:
    ledger.trusted_keys = trust(alice, sweeper_key)
    uncertain(ledger, "pay:absent", {"answer": "absent"})
    uncertain(ledger, "pay:found", {"answer": "found"})
    with Sweeper(ledger, channels=[], entry_points=False, trust=["tests"], signer=sweeper_key) as s:
        outcomes = {result.key: result.outcome for result in s.sweep().results}
    assert outcomes == {"pay:absent": "absent", "pay:found": "found"}
    found = ledger.get("pay:found")
    assert found is not None and found.resolution is not None
    assert found.resolution[1]["via"] == "sweeper" and found.resolution[1]["by"] == (
        "payments-sweeper"
    )
    assert ledger.run("pay:found", lambda: "never", fingerprint="fp") == "receipt-pay:found"
    assert ledger.run("pay:absent", lambda: "ran", fingerprint="fp") == "ran"
    trusted = Path(url.split("///", 1)[1].split("?")[0]).with_name("trusted")
    trusted.write_text(f"{alice.trusted_line()}\n{sweeper_key.trusted_line()}\n")
    trusted.chmod(0o644)
    assert run("--ledger", url, "verify", "--trusted-keys", str(trusted)).exit_code == 0


def test_an_unsigned_sweeper_on_a_ledger_with_trusted_keys_leaves_absent_unwritten(
    ledger: Ledger, alice: Signer
) -> None:
    uncertain(ledger, "pay:absent", {"answer": "absent"})
    ledger.trusted_keys = trust(alice)
    with Sweeper(ledger, channels=[], entry_points=False, trust=["tests"]) as sweeper:
        (result,) = sweeper.sweep().results
    assert result.outcome == "unknown"
    assert "this sweeper has no signing key" in result.reason
    record = ledger.get("pay:absent")
    assert record is not None and record.status is Status.UNCERTAIN

    # Without trusted keys on its own ledger it writes it; workers that trust keys refuse it.
    ledger.trusted_keys = None
    with Sweeper(ledger, channels=[], entry_points=False, trust=["tests"], backoff_s=0) as again:
        (result,) = again.sweep().results
    assert result.outcome == "absent"
    ledger.trusted_keys = trust(alice)
    with pytest.raises(DecisionRefused) as refused:
        ledger.run("pay:absent", lambda: "ran", fingerprint="fp")
    assert refused.value.reason == "unsigned"
    with pytest.raises(TypeError, match=r"signing\.Signer"):
        Sweeper(ledger, signer="alice.key")  # type: ignore[arg-type]


def test_a_document_of_the_previous_release_reads_and_is_chained_by_the_next_write() -> None:
    from crewai_idempotent.ledger._record import Record

    ledger = Ledger(__import__("crewai_idempotent").InMemoryCacheBackend())
    with pytest.raises(OutcomeUnknown):
        ledger.run("k", unknown)
    record = ledger.get("k")
    assert record is not None
    older = json.loads(record.to_json())
    for name in ("chain", "chain_cut", "chain_from", "signed", "resolved"):
        older.pop(name, None)
    read = Record.from_json(json.dumps(older))
    assert read.chain is None and json.loads(read.to_json()).get("chain") is None
    assert [p.kind for p in _chain.check(older)] == ["unchained"]
    settled = read.evolve(read.history[-1], status=Status.FAILED)
    doc = json.loads(settled.to_json())
    assert doc["chain_from"][0] == 2 and len(doc["chain"]) == 3
    assert [p.kind for p in _chain.check(doc)] == ["unchained"]
    assert _chain.check(doc, since=doc["chain_from"][1] + 1) == []
