"""Every approval forgery of issue 31, made by a crew worker in its own process that holds
only the ledger's URL (tests/signed_approvals/worker.py), on a two-person request of its
own call: through the package's public API (`Approvals(backend).approve(rid, by=...)`
twice), and by flipping the request's document to APPROVED with a plain SQL UPDATE
(SQLite; PostgreSQL as a role that may only read and write the ledger's rows).

With the workers' trusted keys configured (signing on), the payment never runs: the fake
provider counts no charge, and the kickoff stops with `DecisionRefused` naming the request.
Approvals signed by two trusted operators let it run once; one person's two trusted keys
are one approver. With signing off, the forgery works: that is today's documented
behaviour (docs/security.md), and the tests that show it say so in their names.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from crewai_idempotent import (
    ApprovalNeedsAnother,
    Approvals,
    ApprovalState,
    Ledger,
    backend_from_url,
)
from crewai_idempotent.cli import main as cli
from crewai_idempotent.signing import TrustedKeys
from tests.signed_approvals.conftest import TRUSTED_ENV, Keys, run_worker
from tests.support.crewai.provider import FakeProvider
from tests.support.servers import PostgresServer

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

PAY = {"do": "pay"}
TWO_NAMES = {"do": "approve-api", "as": ["alice", "bob"]}


def _sqlite(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A ledger file's URL, and the SQL step that rewrites a document in it."""
    path = tmp_path / "ledger.db"
    return f"sqlite:///{path}", {
        "do": "update-sql",
        "path": str(path),
        "table": "idempotency_records",
    }


def _request(url: str, rid: str) -> Any:
    backend = backend_from_url(url)
    try:
        return Approvals(backend).get(rid)
    finally:
        backend.close()


def _refused_and_asked_again(url: str, asked: dict[str, Any], refused: dict[str, Any]) -> None:
    assert asked["error"] == "ApprovalRequired"
    rid = asked["request_id"]
    assert refused["error"] == "DecisionRefused", refused
    assert f"approval request {rid}" in refused["message"]
    assert "nothing was run" in refused["message"]
    request = _request(url, rid)  # asked again, in a new round nobody has approved
    assert request.state is ApprovalState.PENDING and request.round == 2
    assert request.approvals == ()


def test_signing_on_a_worker_that_approves_its_own_call_through_the_api_pays_nothing(
    tmp_path: Path, keys: Keys, charges: FakeProvider
) -> None:
    url, _ = _sqlite(tmp_path)
    asked, forged, refused = run_worker(url, charges, [PAY, TWO_NAMES, PAY], trusted=keys.trusted)
    assert forged["state"] == "APPROVED"  # the ledger took it: every worker may write it
    _refused_and_asked_again(url, asked, refused)
    assert "(unsigned)" in refused["message"] and "'alice'" in refused["message"]
    assert charges.count() == 0


def test_signing_on_a_sql_update_to_approved_in_sqlite_pays_nothing(
    tmp_path: Path, keys: Keys, charges: FakeProvider
) -> None:
    url, update = _sqlite(tmp_path)
    asked, forged, refused = run_worker(url, charges, [PAY, update, PAY], trusted=keys.trusted)
    assert forged["updated"] == 1
    _refused_and_asked_again(url, asked, refused)
    assert charges.count() == 0


def test_signing_on_a_sql_update_by_the_workers_database_role_pays_nothing(
    postgres_server: PostgresServer, keys: Keys, charges: FakeProvider
) -> None:
    table = f"ledger_{uuid.uuid4().hex[:12]}"
    owner = backend_from_url(postgres_server.url(table=table))
    Ledger(owner).get("made-by-the-owner")  # the table exists before any worker starts
    owner.close()
    role = f"worker_{uuid.uuid4().hex[:8]}"
    postgres_server.sql(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
    postgres_server.sql(
        f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table}", crewai_idempotency_schema TO {role}'
    )
    url = postgres_server.url(table=table).replace("postgres@", f"{role}@")
    update = {"do": "update-sql", "table": table, "dsn": postgres_server.dsn().replace(
        "postgres@", f"{role}@")}  # fmt: skip
    asked, forged, refused = run_worker(url, charges, [PAY, update, PAY], trusted=keys.trusted)
    assert forged == {"do": "update-sql", "updated": 1, "as": role}
    _refused_and_asked_again(url, asked, refused)
    assert charges.count() == 0


@pytest.mark.parametrize("forgery", ["api", "sql"])
def test_signing_off_the_forgery_works_today_a_worker_approves_its_own_call_and_is_paid(
    tmp_path: Path, charges: FakeProvider, forgery: str
) -> None:
    url, update = _sqlite(tmp_path)
    step = TWO_NAMES if forgery == "api" else update
    asked, _, paid = run_worker(url, charges, [PAY, step, PAY], trusted=None)
    assert asked["error"] == "ApprovalRequired"
    assert "raw" in paid, paid  # no trusted keys: the ledger's word is the approval
    assert charges.count() == 1


def _approve(url: str, rid: str, key: Path) -> str:
    result = CliRunner().invoke(
        cli, ["--ledger", url, "approvals", "approve", rid, "--key", str(key), "--reason", "ok"]
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_two_trusted_operators_sign_with_their_keys_and_the_payment_runs_once(
    tmp_path: Path, keys: Keys, charges: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = _sqlite(tmp_path)
    (asked,) = run_worker(url, charges, [PAY], trusted=keys.trusted)
    rid = asked["request_id"]
    monkeypatch.setenv(TRUSTED_ENV, str(keys.trusted))  # the operators' shell knows them too
    first = _approve(url, rid, keys.alice.path)  # type: ignore[arg-type]
    assert "1 of 2 distinct approvers" in first and "signed by alice@example.com" in first
    assert "APPROVED" in _approve(url, rid, keys.bob.path)  # type: ignore[arg-type]
    paid, again = run_worker(url, charges, [PAY, PAY], trusted=keys.trusted)
    assert "raw" in paid and "raw" in again, (paid, again)
    assert charges.count() == 1  # the second kickoff replayed the receipt
    request = _request(url, rid)
    assert request.state is ApprovalState.USED
    assert [a["by"] for a in request.approvals] == ["alice@example.com", "bob@example.com"]
    assert [a["signature"]["key"] for a in request.approvals] == [keys.alice.key_id,
                                                                  keys.bob.key_id]  # fmt: skip


def test_one_person_with_two_trusted_keys_is_one_approver(
    tmp_path: Path, keys: Keys, charges: FakeProvider
) -> None:
    url, _ = _sqlite(tmp_path)
    (asked,) = run_worker(url, charges, [PAY], trusted=keys.trusted)
    rid = asked["request_id"]
    # Through the API: the second key signs as the same identity, which has approved.
    backend = backend_from_url(url)
    approvals = Approvals(backend, trusted_keys=TrustedKeys.from_file(keys.trusted))
    approvals.approve(rid, signer=keys.alice)
    with pytest.raises(
        ApprovalNeedsAnother, match=re.escape("alice@example.com has already approved")
    ):
        approvals.approve(rid, signer=keys.alice_again)
    backend.close()
    # Through the ledger: both real signatures written as two approvers under two names.
    twice = {"do": "approve-twice", "keys": [str(keys.alice.path), str(keys.alice_again.path)]}
    written, refused = run_worker(url, charges, [twice, PAY], trusted=keys.trusted, request_id=rid)
    assert written["state"] == "APPROVED" and len(written["approvers"]) == 2
    assert refused["error"] == "DecisionRefused" and "(approvers)" in refused["message"]
    assert "alice@example.com (2 signatures)" in refused["message"]
    assert charges.count() == 0
