"""A crew worker in its own interpreter, holding only the ledger's URL (and, when signing
is on, the workers' trusted keys file): `python -m tests.signed_approvals.worker SPEC`.

SPEC is JSON: provider (the charges file), invoice, amount_cents, approvers, and steps,
each run in order in this one process, each printing one JSON line:

  {"do": "pay"}          a kickoff of the payment crew (pay_invoice needs `approvers`
                         distinct approvals): its output ("raw") or its exception
                         ("error", "message", and "request_id" when it names one);
  {"do": "approve-api", "as": ["alice", "bob"]}
                         the package's public API, as any ledger writer may call it:
                         `Approvals(backend).approve(rid, by=...)` once per name;
  {"do": "update-sql", "table": "...", "dsn": "..."}
                         the request's document flipped to APPROVED by two approvers
                         with a plain SQL UPDATE (SQLite's file, or PostgreSQL's `dsn`);
  {"do": "approve-twice", "keys": [FILE, FILE]}
                         one person who holds two trusted keys signs the request's round
                         with each, and writes both into its document as two approvers.

The request is the one the last refusal of this process named. The ledger comes from
CREWAI_IDEMPOTENCY_URL; the trusted keys, when given, from CREWAI_IDEMPOTENCY_TRUSTED_KEYS.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from typing import Any

from crewai.tools import tool

from crewai_idempotent import Approvals, backend_from_url
from crewai_idempotent.gates import _gatestore
from crewai_idempotent.gates._approvals import KIND
from crewai_idempotent.signing import Decision, Signer
from tests.support.crewai.crews import payment_crew, scripted
from tests.support.crewai.provider import FakeProvider

DOCS = _gatestore.PREFIX + KIND


def _pay_tool(spec: dict[str, Any]) -> Any:
    charges = FakeProvider(spec["provider"])

    @tool("pay_invoice", idempotent=True, approval=True, approvers=int(spec["approvers"]))
    def pay_invoice(invoice: str, amount_cents: int) -> str:
        """Pay `amount_cents` (euro cents) for `invoice`. Returns the payment id."""
        return charges.charge(amount_cents, "supplier", invoice=invoice)

    return pay_invoice


def _pay(spec: dict[str, Any]) -> dict[str, Any]:
    args = {"invoice": spec["invoice"], "amount_cents": spec["amount_cents"]}
    llm = scripted(True, [("pay_invoice", args)])
    crew, _ = payment_crew(
        [_pay_tool(spec)], llm, name="Payables", description=f"Pay invoice {spec['invoice']}."
    )
    try:
        return {"raw": crew.kickoff().raw}
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        found = getattr(exc, "request_id", None) or _named_request(str(exc))
        return {"error": type(exc).__name__, "message": str(exc), "request_id": found}


def _named_request(message: str) -> str | None:
    at = message.find("approval request ap_")
    return message[at + len("approval request ") :][:23] if at >= 0 else None


def _forged(doc: dict[str, Any], names: list[str], now: float) -> dict[str, Any]:
    """The request's document as a writer who wants it granted writes it."""
    approvals = [
        {"by": name, "at": now, "until": now + 3600, "reason": "ok", "via": "api", "host": None}
        for name in names
    ]
    return {
        **doc, "state": "APPROVED", "approvals": approvals, "decided_at": now,
        "decided_by": ", ".join(names), "grant_expires_at": now + 3600, "grant_host": None,
    }  # fmt: skip


def _update_sql(step: dict[str, Any], rid: str) -> dict[str, Any]:
    key = DOCS + rid
    table = step["table"]
    if "dsn" in step:
        import psycopg

        with psycopg.connect(step["dsn"], autocommit=True) as conn:
            (text,) = conn.execute(f'SELECT doc FROM "{table}" WHERE key = %s', (key,)).fetchone()
            record = json.loads(text)
            record["result"]["v"] = _forged(record["result"]["v"], ["alice", "bob"], time.time())
            changed = conn.execute(
                f'UPDATE "{table}" SET doc = %s WHERE key = %s', (json.dumps(record), key)
            ).rowcount
            user = conn.execute("SELECT current_user").fetchone()[0]
        return {"updated": changed, "as": user}
    with sqlite3.connect(step["path"]) as conn:
        (text,) = conn.execute(f"SELECT doc FROM {table} WHERE key = ?", (key,)).fetchone()
        record = json.loads(text)
        record["result"]["v"] = _forged(record["result"]["v"], ["alice", "bob"], time.time())
        changed = conn.execute(
            f"UPDATE {table} SET doc = ? WHERE key = ?", (json.dumps(record), key)
        ).rowcount
    return {"updated": changed}


def _approve_twice(step: dict[str, Any], rid: str) -> dict[str, Any]:
    """Both signatures are real (the person holds both keys); the second is written as if
    it were another approver's, under another name."""
    signers = [Signer.from_file(path) for path in step["keys"]]
    backend = backend_from_url(os.environ["CREWAI_IDEMPOTENCY_URL"])

    def change(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
        assert doc is not None
        entries = []
        for number, signer in enumerate(signers, 1):
            decision = Decision.approval(
                request=rid, round=doc["round"], key=doc["key"], fingerprint=doc["fingerprint"],
                until=now + 3600, by=signer.identity, via="cli", at=now,
            )  # fmt: skip
            entries.append({
                "by": f"{signer.identity}#{number}", "at": now, "until": now + 3600,
                "reason": "", "via": "cli", "host": None, "decision": decision.to_json(),
                "signature": signer.sign(decision).to_json(),
            })  # fmt: skip
        forged = _forged(doc, [e["by"] for e in entries], now)
        return {**forged, "approvals": entries}

    written = _gatestore.update(backend, DOCS + rid, change)
    backend.close()
    return {"state": written["state"], "approvers": [a["by"] for a in written["approvals"]]}


def main(spec: dict[str, Any]) -> None:
    rid = spec.get("request_id")
    for step in spec["steps"]:
        out: dict[str, Any] = {"do": step["do"]}
        if step["do"] == "pay":
            out.update(_pay(spec))
            rid = out.get("request_id") or rid
        elif step["do"] == "approve-api":
            backend = backend_from_url(os.environ["CREWAI_IDEMPOTENCY_URL"])
            approvals = Approvals(backend)  # what any process holding the URL can make
            for name in step["as"]:
                out["state"] = approvals.approve(rid, by=name, reason="looks fine").state.value
            backend.close()
        elif step["do"] == "update-sql":
            out.update(_update_sql(step, rid))
        elif step["do"] == "approve-twice":
            out.update(_approve_twice(step, rid))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
