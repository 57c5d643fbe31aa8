"""The gate with trusted keys, in process: what it takes for a grant to be used, each way an
approval written into the ledger is refused, and the decisions signed elsewhere.

Payments are counted at the fake provider; time moves on a `ManualClock`. A ledger writer
is played by the package's own document API (`_gatestore.update`), which any process
holding the ledger can use.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    ApprovalDenied,
    ApprovalMovedOn,
    ApprovalRequired,
    Approvals,
    ApprovalState,
    CacheBackend,
    DecisionRefused,
    Ledger,
    signing,
)
from crewai_idempotent.gates import _gatestore
from crewai_idempotent.gates._approvals import KIND
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.signing import Decision, Signer, TrustedKeys
from tests.signed_approvals.conftest import Keys
from tests.support.clock import ClockedBackend, ManualClock
from tests.support.faults.provider import Provider

FINGERPRINT = hashlib.sha256(b"pay INV-7 900.00 EUR").hexdigest()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(tmp_path: Path, clock: ManualClock) -> CacheBackend:
    from crewai_idempotent import SQLiteCacheBackend

    return ClockedBackend(SQLiteCacheBackend(tmp_path / "ledger.db"), clock)


@pytest.fixture
def trusted(keys: Keys) -> TrustedKeys:
    return TrustedKeys.from_file(keys.trusted)


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "effects")


class Gate:
    """One two-person call under trusted keys: asked, then paid or refused."""

    def __init__(
        self, store: CacheBackend, trusted: TrustedKeys, provider: Provider, **plan: Any
    ) -> None:
        self.store, self.trusted, self.provider = store, trusted, provider
        self.ledger = Ledger(store)
        self.plan = Plan(
            tool="pay_invoice", fingerprint=FINGERPRINT, approval=True, approvers=2,
            summary={"invoice": "INV-7"}, trusted_keys=trusted, **plan,
        )  # fmt: skip
        self.key = "pay:INV-7"

    def pay(self) -> Any:
        return self.ledger.run(
            self.key, lambda: self.provider.charge(self.key), fingerprint=FINGERPRINT,
            stage=self.plan,
        )  # fmt: skip

    def ask(self) -> str:
        with pytest.raises(ApprovalRequired, match="approvals are signed") as asked:
            self.pay()
        return asked.value.request_id

    def approvals(self, signer: Signer | None = None) -> Approvals:
        return Approvals(self.store, signer, trusted_keys=self.trusted)

    def write(self, rid: str, change: Callable[[dict[str, Any], float], dict[str, Any]]) -> None:
        """What any ledger writer can do to the request's document."""

        def changed(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
            assert doc is not None
            return change(doc, now)

        _gatestore.update(self.store, _gatestore.PREFIX + KIND + rid, changed)

    def charges(self) -> int:
        return len(self.provider.effects())


@pytest.fixture
def gate(store: CacheBackend, trusted: TrustedKeys, provider: Provider) -> Gate:
    return Gate(store, trusted, provider)


def _granted(doc: dict[str, Any], entries: list[dict[str, Any]], now: float) -> dict[str, Any]:
    return {
        **doc, "state": "APPROVED", "approvals": entries, "decided_at": now,
        "decided_by": ", ".join(e["by"] for e in entries), "grant_expires_at": now + 3600,
        "grant_host": None,
    }  # fmt: skip


def _signed_entry(signer: Signer, decision: Decision, now: float) -> dict[str, Any]:
    return {
        "by": decision.by, "at": now, "until": decision.until, "reason": "", "via": "api",
        "host": None, "decision": decision.to_json(), "signature": signer.sign(decision).to_json(),
    }  # fmt: skip


def _approval(doc: dict[str, Any], signer: Signer, now: float, **changes: Any) -> Decision:
    fields: dict[str, Any] = {
        "request": doc["id"], "round": doc["round"], "key": doc["key"],
        "fingerprint": doc["fingerprint"], "until": now + 3600, "by": signer.identity,
        "via": "api", "at": now,
    }  # fmt: skip
    fields.update(changes)
    return Decision.approval(**fields)


def test_two_trusted_identities_pay_once_and_a_replay_verifies_nothing(
    gate: Gate, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid = gate.ask()
    one = gate.approvals(keys.alice).approve(rid, reason="invoice checked")
    assert one.state is ApprovalState.PENDING and one.approvals[0]["by"] == "alice@example.com"
    with pytest.raises(ApprovalRequired, match="1 of 2 approvers"):
        gate.pay()
    two = gate.approvals().approve(rid, signer=keys.bob, ttl_s=600)
    assert two.state is ApprovalState.APPROVED and two.history[-1]["signed"] == keys.bob.key_id
    verified: list[str] = []
    real = signing.verify

    def counting(*args: Any, **kwargs: Any) -> Any:
        verified.append("once")
        return real(*args, **kwargs)

    monkeypatch.setattr(signing, "verify", counting)
    receipt = gate.pay()
    assert len(verified) == 2  # each approval of the grant, where the grant is used
    assert gate.pay() == receipt and len(verified) == 2  # a replay checks nothing
    assert gate.charges() == 1


@pytest.mark.parametrize(
    "forgery",
    ["unsigned", "untrusted-key", "role", "signature", "another-call", "another-round",
     "a-denial", "identity"],
)  # fmt: skip
def test_an_approval_written_into_the_ledger_that_does_not_verify_is_refused(
    gate: Gate, keys: Keys, tmp_path: Path, forgery: str
) -> None:
    rid = gate.ask()
    mallory = Signer.create(tmp_path / "mallory.key", identity="mallory@example.com")

    def forge(doc: dict[str, Any], now: float) -> dict[str, Any]:
        good = _signed_entry(keys.alice, _approval(doc, keys.alice, now), now)
        if forgery == "unsigned":
            bad = {**good, "by": "bob@example.com"}
            del bad["decision"], bad["signature"]
        elif forgery == "untrusted-key":
            bad = _signed_entry(mallory, _approval(doc, mallory, now), now)
        elif forgery == "role":  # trusted, but not to approve: its line says resolve only
            bad = _signed_entry(keys.bob, _approval(doc, keys.bob, now), now)
        elif forgery == "signature":
            bad = _signed_entry(keys.bob, _approval(doc, keys.bob, now), now)
            bad["decision"] = {**bad["decision"], "until": now + 10 * 86400}
        elif forgery == "another-call":
            other = _approval(doc, keys.bob, now, key="pay:INV-8", request="ap_" + "0" * 20)
            bad = _signed_entry(keys.bob, other, now)
        elif forgery == "another-round":
            bad = _signed_entry(keys.bob, _approval(doc, keys.bob, now, round=7), now)
        elif forgery == "a-denial":
            denial = Decision.denial(
                request=doc["id"], round=doc["round"], key=doc["key"],
                fingerprint=doc["fingerprint"], by=keys.bob.identity, via="api", at=now,
            )  # fmt: skip
            bad = _signed_entry(keys.bob, denial, now)
        else:  # bob's key signing a decision that names carol
            as_carol = _bare_key(keys.bob, tmp_path / "bob-bare.key", "carol@example.com")
            bad = _signed_entry(as_carol, _approval(doc, as_carol, now), now)
        return _granted(doc, [good, bad], now)

    if forgery == "role":
        resolve_only = f"resolve {keys.bob.trusted_line().split(' ', 1)[1]}"
        lines = [keys.alice.trusted_line(), resolve_only]
        gate.plan = Plan(
            **{**_plan_fields(gate.plan), "trusted_keys": TrustedKeys.from_lines(lines)}
        )
    gate.write(rid, forge)
    reason = {"another-call": "subject", "another-round": "subject", "a-denial": "subject"}
    with pytest.raises(DecisionRefused, match=rf"approval request {rid} refused") as refused:
        gate.pay()
    assert refused.value.reason == reason.get(forgery, forgery)
    assert "nothing was run" in str(refused.value)
    asked_again = gate.approvals().get(rid)
    assert asked_again.state is ApprovalState.PENDING and asked_again.round == 2
    assert gate.charges() == 0


def _bare_key(signer: Signer, path: Path, identity: str) -> Signer:
    """`signer`'s private key, in a file that names no identity, used as `identity`."""
    assert signer.path is not None
    pem = [line for line in signer.path.read_text().splitlines() if not line.startswith("#")]
    path.write_text("\n".join(pem) + "\n")
    path.chmod(0o600)
    return Signer.from_file(path, identity=identity)


def _plan_fields(plan: Plan) -> dict[str, Any]:
    return {name: getattr(plan, name) for name in plan.__dataclass_fields__}


def test_a_deadline_written_later_than_the_one_signed_does_not_stretch_the_grant(
    gate: Gate, keys: Keys, clock: ManualClock
) -> None:
    rid = gate.ask()
    gate.approvals(keys.alice).approve(rid, ttl_s=60)
    gate.approvals(keys.bob).approve(rid, ttl_s=60)
    clock.advance(120)

    def stretch(doc: dict[str, Any], now: float) -> dict[str, Any]:
        entries = [{**a, "until": now + 3600, "host": None} for a in doc["approvals"]]
        return {**doc, "approvals": entries, "grant_expires_at": now + 3600, "grant_host": None}

    gate.write(rid, stretch)
    with pytest.raises(ApprovalRequired, match="expired before the call ran"):
        gate.pay()
    assert gate.approvals().get(rid).round == 2 and gate.charges() == 0


def test_a_grant_stamped_approved_with_no_approval_at_all_is_refused(
    gate: Gate, keys: Keys
) -> None:
    rid = gate.ask()
    gate.write(rid, lambda doc, now: _granted(doc, [], now))
    with pytest.raises(DecisionRefused, match=r"\(unsigned\).*holds no approval"):
        gate.pay()
    assert gate.charges() == 0


def test_unsigned_approvals_made_before_signing_count_only_until_the_time_configured(
    store: CacheBackend, trusted: TrustedKeys, provider: Provider, keys: Keys
) -> None:
    later = Gate(store, trusted, provider, accept_unsigned_grants_until=time.time() + 3600)
    rid = later.ask()
    # Made by a process without trusted keys, as every approval was before signing.
    Approvals(store).approve(rid, by="alice@example.com")
    Approvals(store).approve(rid, by="bob@example.com")
    over = Gate(store, trusted, provider, accept_unsigned_grants_until=time.time() - 1)
    with pytest.raises(DecisionRefused, match=r"\(unsigned\)"):
        over.pay()
    assert provider.effects() == []
    # A new round: one unsigned approval and one signed still make two people in time.
    Approvals(store).approve(rid, by="carol@example.com")
    later.approvals(keys.bob).approve(rid)
    later.pay()
    assert len(provider.effects()) == 1


def test_a_denial_is_obeyed_signed_or_not_and_an_unsigned_one_says_so(
    gate: Gate, keys: Keys, store: CacheBackend
) -> None:
    rid = gate.ask()
    Approvals(store).deny(rid, by="someone", reason="looks odd")  # no key at all
    with pytest.raises(ApprovalDenied, match=r"looks odd.*carries no signature") as denied:
        gate.pay()
    assert denied.value.by == "someone"
    other = Gate(store, gate.trusted, gate.provider)
    other.key = "pay:INV-8"
    rid8 = other.ask()
    other.approvals(keys.alice).deny(rid8, reason="duplicate invoice")
    with pytest.raises(ApprovalDenied) as signed:
        other.pay()
    assert "signature" not in str(signed.value) and signed.value.by == "alice@example.com"
    assert gate.charges() == 0


def test_a_signature_made_elsewhere_is_kept_with_the_approval_it_makes(
    gate: Gate, keys: Keys, store: CacheBackend
) -> None:
    rid = gate.ask()
    doc = gate.approvals().get(rid)
    now = store.now()

    def made_for(
        signer: Signer = keys.alice, **changes: Any
    ) -> tuple[Decision, signing.SignatureEnvelope]:
        fields: dict[str, Any] = {
            "request": rid, "round": doc.round, "key": doc.key, "fingerprint": doc.fingerprint,
            "until": now + 900, "by": signer.identity, "via": "console", "at": now,
        }  # fmt: skip
        fields.update(changes)
        decision = Decision.approval(**fields)
        return decision, signer.sign(decision)

    approvals = gate.approvals()
    with pytest.raises(ApprovalMovedOn):
        approvals.approve(rid, signed=made_for(round=2))
    with pytest.raises(ValueError, match="ended at"):
        approvals.approve(rid, signed=made_for(until=now - 1))
    with pytest.raises(ValueError, match="about request"):
        approvals.approve(rid, signed=made_for(request="ap_" + "0" * 20))
    with pytest.raises(ValueError, match=re.escape("by='bob@example.com'")):
        approvals.approve(rid, by="bob@example.com", signed=made_for())
    forged = (made_for()[0], made_for(keys.bob)[1])  # alice's decision, bob's signature
    with pytest.raises(DecisionRefused, match=r"\(identity\)"):  # checked before it is written
        approvals.approve(rid, signed=forged)
    assert gate.approvals().get(rid).approvals == ()
    made = approvals.approve(rid, signed=made_for())
    entry = made.approvals[0]
    assert entry["by"] == "alice@example.com" and entry["via"] == "console"
    assert entry["until"] == pytest.approx(now + 900)
    assert Decision.from_json(entry["decision"]) == made_for()[0]
    gate.approvals(keys.bob).approve(rid)
    gate.pay()
    assert gate.charges() == 1


def test_with_trusted_keys_an_unsigned_approval_is_refused_before_it_is_written(
    gate: Gate, keys: Keys, tmp_path: Path
) -> None:
    rid = gate.ask()
    with pytest.raises(DecisionRefused, match=r"\(unsigned\).*nothing was written"):
        gate.approvals().approve(rid, by="alice@example.com")
    mallory = Signer.create(tmp_path / "mallory.key", identity="mallory@example.com")
    with pytest.raises(DecisionRefused, match=r"\(untrusted-key\)"):
        gate.approvals(mallory).approve(rid)
    with pytest.raises(ValueError, match=re.escape("belongs to 'alice@example.com'")):
        gate.approvals(keys.alice).approve(rid, by="bob@example.com")
    assert gate.approvals().get(rid).approvals == ()
