"""What the signed approvals tests share: operators' keys, the workers' trusted keys file,
and a crew worker run in its own interpreter (tests/signed_approvals/worker.py)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent.signing import Signer
from tests.support.crewai.provider import FakeProvider

TRUSTED_ENV = "CREWAI_IDEMPOTENCY_TRUSTED_KEYS"
WORKER_TIMEOUT = 300  # importing crewai alone takes several seconds on a loaded machine


@dataclass(frozen=True)
class Keys:
    """Two operators' keys (alice holds two), and the trusted keys file that lists all
    three: what the workers are deployed with."""

    alice: Signer
    alice_again: Signer
    bob: Signer
    trusted: Path


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o700)
    alice = Signer.create(folder / "alice.key", identity="alice@example.com")
    again = Signer.create(folder / "alice-2.key", identity="alice@example.com", roles=["approve"])
    bob = Signer.create(folder / "bob.key", identity="bob@example.com", roles=["approve"])
    trusted = folder / "trusted_keys"
    trusted.write_text(
        "# the operators whose approvals the workers obey\n"
        + "".join(f"{s.trusted_line()}\n" for s in (alice, again, bob))
    )
    trusted.chmod(0o644)
    return Keys(alice, again, bob, trusted)


@pytest.fixture
def charges(tmp_path: Path) -> FakeProvider:
    return FakeProvider(tmp_path / "charges.jsonl")


def run_worker(
    url: str,
    charges: FakeProvider,
    steps: list[dict[str, Any]],
    *,
    trusted: Path | None,
    approvers: int = 2,
    invoice: str = "INV-9",
    request_id: str | None = None,
) -> list[dict[str, Any]]:
    """The steps run by one crew worker that holds the ledger's URL (and, when `trusted` is
    given, the workers' trusted keys file): one result per step."""
    # Here, not at the top: the test modules load it as a plugin first (assert rewriting).
    from tests.support.crewai.fixtures import PYTHON, REPO, subprocess_env

    spec = {
        "provider": str(charges.path), "invoice": invoice, "amount_cents": 90_000,
        "approvers": approvers, "steps": steps, "request_id": request_id,
    }  # fmt: skip
    env = subprocess_env(CREWAI_IDEMPOTENCY_URL=url, XDG_DATA_HOME=str(charges.path.parent / "xdg"))
    env.pop(TRUSTED_ENV, None)
    if trusted is not None:
        env[TRUSTED_ENV] = str(trusted)
    done = subprocess.run(
        [PYTHON, "-m", "tests.signed_approvals.worker", json.dumps(spec)],
        capture_output=True, text=True, cwd=REPO, timeout=WORKER_TIMEOUT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["do"] for r in results] == [s["do"] for s in steps], done.stdout[-3000:]
    return results
