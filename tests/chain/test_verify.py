"""`crewai-idempotent verify`: a history edited behind the ledger's back is named.

Each store's JSON is edited directly (tests/chain/stored.py: SQL UPDATE, HSET), as someone
holding the store's credentials would: an event edited, removed or moved, a signature
replaced. `verify` names each such key and exits 1; it passes an untouched ledger and an
export of it (read on "another machine": only the file). A history rewritten with every
digest recomputed passes a chain alone, and is caught `--against` an earlier export.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent import Ledger, OutcomeUnknown
from crewai_idempotent.cli import main as cli
from crewai_idempotent.ledger import _chain
from crewai_idempotent.signing import Decision, Signer
from tests.support.stores import BackendFactory, backend_factory

from .stored import Stored

SERVED = ["sqlite", "postgres", "redis"]


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def alice(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "alice.key", identity="alice@example.com", roles=["resolve"])


@pytest.fixture
def mallory(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "mallory.key", identity="alice@example.com")


@pytest.fixture
def trusted(tmp_path: Path, alice: Signer) -> Path:
    path = tmp_path / "trusted_keys"
    path.write_text(alice.trusted_line() + "\n")
    path.chmod(0o644)
    return path


def unknown() -> None:
    raise OutcomeUnknown("the provider timed out")


def fill(ledger: Ledger, alice: Signer) -> None:
    """Receipts, a retried failure, and an uncertain charge resolved with a signature."""
    for number in range(3):
        ledger.run(f"receipt:{number}", lambda number=number: {"charge": f"ch_{number}"})

    def boom() -> None:
        raise ValueError("card declined")

    with pytest.raises(ValueError):
        ledger.run("retried", boom)
    ledger.run("retried", lambda: "ch_retried")  # claim, fail, takeover, commit
    with pytest.raises(OutcomeUnknown):
        ledger.run("pay", unknown)
    ledger.resolve("pay", result="ch_found", reason="in the dashboard", signer=alice)


def recomputed(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with every digest recomputed, as a forger who knows the format writes it."""
    chain = _chain.Chain.of(doc)
    assert chain is not None
    events = _chain.events_of(doc)
    doc["chain"] = list(_chain.digests(doc["key"], events, chain.cut, chain.signed))
    return doc


@pytest.fixture(params=SERVED)
def store(request: pytest.FixtureRequest) -> BackendFactory:
    return backend_factory(str(request.param), request)


def test_an_untouched_ledger_and_its_export_verify(
    store: BackendFactory, alice: Signer, trusted: Path, tmp_path: Path
) -> None:
    ledger = Ledger(store())
    fill(ledger, alice)
    result = run("--ledger", store.url, "verify", "--trusted-keys", str(trusted))
    assert result.exit_code == 0, result.output
    assert "every history verifies" in result.output
    exported = run("--ledger", store.url, "export")
    assert exported.exit_code == 0
    export = tmp_path / "export.jsonl"
    export.write_text(exported.output)
    ledger.close()
    # Another machine: the file alone (the ledger's URL is not given).
    result = run("verify", "--export", str(export), "--trusted-keys", str(trusted))
    assert result.exit_code == 0, result.output
    assert f"verified {len(exported.output.splitlines())} record(s)" in result.output
    result = run("verify", "pay", "--export", str(export))
    assert result.exit_code == 0 and "verified 1 record(s)" in result.output


def test_an_edited_removed_and_reordered_event_and_a_replaced_signature_are_named(
    store: BackendFactory, alice: Signer, mallory: Signer, trusted: Path
) -> None:
    ledger = Ledger(store())
    fill(ledger, alice)
    stored = Stored(store.url)

    edited = stored.read("receipt:0")
    edited["history"][1][4] = "nothing to see"  # the commit's note
    stored.write("receipt:0", edited)
    removed = stored.read("retried")
    del removed["history"][1]  # the failure
    stored.write("retried", removed)
    moved = stored.read("receipt:1")
    moved["history"].reverse()  # commit before claim
    stored.write("receipt:1", moved)
    resigned = stored.read("pay")
    ((seq, decision, _),) = resigned["signed"]
    forged = Decision.from_json(decision)
    resigned["signed"] = [[seq, decision, mallory.sign(forged).to_json()]]
    stored.write("pay", resigned)

    result = run("--ledger", store.url, "verify")
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    named = {line.split(": ")[0]: line for line in lines if not line.startswith("verified")}
    assert set(named) == {"'receipt:0'", "'retried'", "'receipt:1'", "'pay'"}, result.output
    assert ": edited: event #2 (commit" in named["'receipt:0'"]
    assert ": removed: " in named["'retried'"]
    assert ": reordered: " in named["'receipt:1'"]
    assert "decision signed with it (a signature replaced?)" in named["'pay'"]
    assert "'receipt:2'" not in result.output
    assert "4 with a history that does not verify" in result.output

    # Re-signed with every digest recomputed: the chain holds, the signature does not.
    stored.write("pay", recomputed(stored.read("pay")))
    assert "'pay'" not in run("--ledger", store.url, "verify").output
    result = run("--ledger", store.url, "verify", "pay", "--trusted-keys", str(trusted))
    assert result.exit_code == 1
    assert "'pay': signature: event #3 (resolve by alice@example.com): untrusted-key" in (
        result.output
    )
    ledger.close()


def test_a_consistent_rewrite_passes_the_chain_and_is_caught_against_an_earlier_export(
    store_sqlite: BackendFactory, alice: Signer, tmp_path: Path
) -> None:
    url = store_sqlite.url
    ledger = Ledger(store_sqlite())
    fill(ledger, alice)
    with pytest.raises(OutcomeUnknown):
        ledger.run("open", unknown)  # UNCERTAIN: a purge never deletes it
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(run("--ledger", url, "export").output)
    ledger.run("receipt:9", lambda: "later")  # the ledger goes on meanwhile
    ledger.run("receipt:0", lambda: "replayed")
    assert run("--ledger", url, "verify", "--against", str(earlier)).exit_code == 0

    stored = Stored(url)
    rewritten = stored.read("receipt:0")
    rewritten["history"][1][3] = "someone-else"
    stored.write("receipt:0", recomputed(rewritten))
    truncated = stored.read("retried")
    truncated["history"], truncated["chain"] = truncated["history"][:2], truncated["chain"][:2]
    stored.write("retried", truncated)
    backend = store_sqlite()
    held = backend.get("open")
    assert held is not None and backend.delete(held)

    alone = run("--ledger", url, "verify")
    assert alone.exit_code == 0, alone.output  # what a chain alone cannot see
    result = run("--ledger", url, "verify", "--against", str(earlier))
    assert result.exit_code == 1, result.output
    assert "'receipt:0': rewritten: its first 2 events differ" in result.output
    assert "'retried': truncated: the earlier export holds 4 events" in result.output
    assert "'open': deleted: the earlier export holds it UNCERTAIN" in result.output
    assert "3 with a history that does not verify" in result.output
    ledger.close()


def test_a_chain_missing_or_started_part_way_is_reported_unless_older_than_since(
    store_sqlite: BackendFactory, tmp_path: Path
) -> None:
    """What the previous release writes back (it drops keys it does not know) looks like
    a stripped chain: reported, unless --since says such writes ended before then."""
    url = store_sqlite.url
    ledger = Ledger(store_sqlite())
    ledger.run("older", lambda: "r")

    def boom() -> None:
        raise ValueError("declined")

    with pytest.raises(ValueError):
        ledger.run("adopted", boom)
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(run("--ledger", url, "export").output)
    stored = Stored(url)
    for key in ("older", "adopted"):
        doc = stored.read(key)
        stored.write(key, {name: value for name, value in doc.items() if name != "chain"})
    time.sleep(0.01)
    upgraded = time.time()
    time.sleep(0.01)
    # The next write of this release chains the history again and says from where.
    ledger.run("adopted", lambda: "r")  # a takeover and a commit
    adopted = stored.read("adopted")
    assert adopted["chain_from"][0] == 2 and len(adopted["chain"]) == 4

    result = run("--ledger", url, "verify")
    assert result.exit_code == 1
    assert "'older': unchained: its 2 event(s) carry no chain" in result.output
    assert "'adopted': unchained: its events before #3 carry no chain" in result.output
    since = json.dumps(upgraded)
    assert run("--ledger", url, "verify", "--since", since).exit_code == 0
    assert run("--ledger", url, "verify", "--since", "2000-01-01").exit_code == 1
    # An export taken before knows the chain was there: --since does not excuse that.
    result = run("--ledger", url, "verify", "--since", since, "--against", str(earlier))
    assert result.exit_code == 1
    assert "'older': unchained: its chain is gone since the earlier export" in result.output
    bad = run("--ledger", url, "verify", "--since", "yesterday")
    assert bad.exit_code == 2 and "not a time" in bad.output
    ledger.close()
