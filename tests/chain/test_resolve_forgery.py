"""The forgery of issue 31, in real processes: a worker's charge goes UNCERTAIN, and
someone who can write the ledger tries to make it run again by settling it as absent.

With signing on (the workers' ledgers have trusted keys): `Ledger.resolve(key,
absent=True, by="operator-alice")` without a signer is refused at once, nothing written; a
resolution written straight into the store (unsigned, signed by a key nobody trusts, or
with its mark stripped) is refused by the next call, which runs nothing: the fake provider
counts one charge. A resolution signed by a trusted operator key is obeyed: the next call
runs once, and later calls replay it. With signing off, the documented behaviour of today:
an unsigned resolution is obeyed and the next call runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent.signing import Signer
from tests.support.faults.provider import Provider
from tests.support.stores import BackendFactory, backend_factory

from .stored import Stored, resolve_forged

ROOT = Path(__file__).resolve().parents[2]
KEY = "pay:invoice-7"


def worker(*args: str) -> dict[str, Any]:
    """One worker process: its JSON line."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-m", "tests.chain.worker", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest) -> BackendFactory:
    return backend_factory(str(request.param), request)


@pytest.fixture
def operator(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "alice.key", identity="operator-alice", roles=["resolve"])


@pytest.fixture
def trusted(tmp_path: Path, operator: Signer) -> Path:
    path = tmp_path / "trusted_keys"
    path.write_text(operator.trusted_line() + "\n")
    path.chmod(0o644)
    return path


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "provider.jsonl")


def charge(store: BackendFactory, provider: Provider, *more: str) -> dict[str, Any]:
    return worker("charge", store.url, str(provider.path), KEY, *more)


def test_with_signing_on_no_forged_resolution_runs_the_charge_again(
    store: BackendFactory, provider: Provider, trusted: Path, operator: Signer, tmp_path: Path
) -> None:
    signing = ("--trusted", str(trusted))
    assert charge(store, provider, *signing, "--uncertain")["outcome"] == "OutcomeUnknown"
    assert provider.counts() == {KEY: 1}
    stored = Stored(store.url)
    uncertain = stored.read(KEY)
    assert uncertain["status"] == "UNCERTAIN"

    # Through the package's own API, unsigned: refused at once, nothing written.
    said = worker("resolve", store.url, KEY, *signing, "--by", "operator-alice")
    assert said["outcome"] == "refused" and said["reason"] == "unsigned", said
    assert "this ledger trusts only signed resolutions" in said["message"]
    assert stored.read(KEY) == uncertain

    # Straight into the store: unsigned, signed by an untrusted key, the mark stripped.
    mallory = Signer.create(tmp_path / "mallory.key", identity="operator-alice")
    stripped = resolve_forged(uncertain, by="operator-alice")
    del stripped["resolved"]
    forgeries = {
        "unsigned": resolve_forged(uncertain, by="operator-alice"),
        "untrusted-key": resolve_forged(uncertain, by="operator-alice", signer=mallory),
        "stripped": stripped,
    }
    for what, forged in forgeries.items():
        stored.write(KEY, forged)
        said = charge(store, provider, *signing)
        assert said["outcome"] == "refused", (what, said)
        assert said["reason"] == ("unsigned" if what == "stripped" else what)
        assert f"idempotency key {KEY!r}" in said["message"]
        assert (
            "resolve 'pay:invoice-7' --happened/--absent --reason TEXT --key FILE"
            in (said["message"])
        )
        assert provider.counts() == {KEY: 1}, what

    # A signed resolution replaces the forged one: obeyed, the charge runs once more.
    said = worker("resolve", store.url, KEY, *signing, "--key", str(operator.path))
    assert said == {"outcome": "resolved", "status": "FAILED"}
    assert charge(store, provider, *signing)["outcome"] == "ran"
    assert charge(store, provider, *signing)["outcome"] == "replayed"
    assert provider.counts() == {KEY: 2}


def test_with_signing_off_an_unsigned_resolution_is_obeyed_as_today(
    store: BackendFactory, provider: Provider
) -> None:
    assert charge(store, provider, "--uncertain")["outcome"] == "OutcomeUnknown"
    said = worker("resolve", store.url, KEY, "--by", "operator-alice")
    assert said == {"outcome": "resolved", "status": "FAILED"}
    assert charge(store, provider)["outcome"] == "ran"
    assert provider.counts() == {KEY: 2}
    # The history says who resolved it, as before; the resolution is not signed.
    doc = Stored(store.url).read(KEY)
    resolve = [event for event in doc["history"] if event[1] == "resolve"]
    assert resolve[0][3] == "operator-alice" and "signed" not in doc
