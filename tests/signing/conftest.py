"""Keys and decisions the signing tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from crewai_idempotent.signing import Decision, Signer

REQUEST = "ap_" + "1" * 20
CALL = "pay:invoice-7"
FINGERPRINT = "f" * 64
AT = 1_800_000_000.0


def approval(by: str = "alice@example.com", **changes: object) -> Decision:
    fields: dict[str, object] = {
        "request": REQUEST, "round": 1, "key": CALL, "fingerprint": FINGERPRINT,
        "until": AT + 3600, "by": by, "via": "cli", "at": AT, "reason": "invoice checked",
    }  # fmt: skip
    fields.update(changes)
    return Decision.approval(**fields)  # type: ignore[arg-type]


def write_trusted(path: Path, *lines: str) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines))
    path.chmod(0o644)
    return path


@pytest.fixture
def alice(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "alice.key", identity="alice@example.com")


@pytest.fixture
def bob(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "bob.key", identity="bob@example.com", roles=["approve"])
