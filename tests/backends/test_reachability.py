"""A PostgreSQL or Redis ledger is checked where it is configured, not at the first tool call.

`configure()`, `IdempotencyConfig(...)` and `Crew(...)` (for CREWAI_IDEMPOTENCY_URL) open
one connection within the backend's connect timeout; a server that does not answer is a
`LedgerUnavailable` there, naming the ledger and the switch for processes that start
before their server (`check_reachable=False`, CREWAI_IDEMPOTENCY_CHECK_REACHABLE=0). With
the switch, the first guarded call reports it, and runs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import IdempotencyConfig, LedgerUnavailable, configure
from tests.support.blackhole import BlackHoleProxy
from tests.support.crewai.crews import charge_tool, payment_crew, scripted
from tests.support.crewai.provider import FakeProvider
from tests.support.servers import PostgresServer, RedisServer, free_port

pytest_plugins = ["tests.support.servers", "tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")


@pytest.fixture
def down() -> Iterator[dict[str, str]]:
    """URLs of a PostgreSQL and a Redis that are not there (nothing listens on the port)."""
    port = free_port()
    yield {
        "postgresql": f"postgresql://app:s3cret@127.0.0.1:{port}/ledger?connect_timeout_s=1",
        "redis": f"redis://:s3cret@127.0.0.1:{port}/0?timeout_s=1",
    }


@pytest.mark.parametrize("scheme", ["postgresql", "redis"])
def test_an_unreachable_server_is_refused_by_configure(scheme: str, down: dict[str, str]) -> None:
    with pytest.raises(LedgerUnavailable) as refused:
        configure(backend=down[scheme])
    message = str(refused.value)
    assert "127.0.0.1" in message and "s3cret" not in message and ":***@" in message
    assert "check_reachable=False" in message and "CREWAI_IDEMPOTENCY_CHECK_REACHABLE=0" in message
    assert configure(None) is None  # nothing was configured


@pytest.mark.parametrize("scheme", ["postgresql", "redis"])
def test_the_switch_defers_the_error_to_the_first_guarded_call(
    scheme: str, down: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    charges = FakeProvider(tmp_path / "charges.jsonl")
    tool = charge_tool(charges, idempotent=True)
    configure(backend=down[scheme], check_reachable=False)
    with pytest.raises(LedgerUnavailable):
        tool.run(amount=1, recipient="bob")
    configure(None)
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_CHECK_REACHABLE", "0")
    configure(IdempotencyConfig(backend=down[scheme]))
    with pytest.raises(LedgerUnavailable):
        tool.run(amount=1, recipient="bob")
    configure(None)
    assert not charges.effects()  # nothing ran unguarded


def test_the_environment_url_is_checked_when_the_crew_is_built(
    down: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    charges = FakeProvider(tmp_path / "charges.jsonl")
    args = {"amount": 5, "recipient": "alice", "invoice": "inv-1"}
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_URL", down["postgresql"])
    with pytest.raises(LedgerUnavailable, match="CREWAI_IDEMPOTENCY_URL: "):
        payment_crew(
            [charge_tool(charges, idempotent=True)], scripted(True, [("charge_card", args)])
        )
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_CHECK_REACHABLE", "0")
    payment_crew([charge_tool(charges, idempotent=True)], scripted(True, [("charge_card", args)]))


def test_a_bad_switch_value_is_refused(
    down: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_CHECK_REACHABLE", "sometimes")
    with pytest.raises(ValueError, match="CREWAI_IDEMPOTENCY_CHECK_REACHABLE='sometimes'"):
        configure(backend=down["redis"])
    with pytest.raises(TypeError, match="check_reachable must be True or False"):
        IdempotencyConfig(check_reachable="no")  # type: ignore[arg-type]


def test_a_server_that_never_answers_is_refused_within_the_connect_timeout(
    postgres_server: PostgresServer,
) -> None:
    proxy = BlackHoleProxy(postgres_server.port)
    proxy.swallow()  # accepts the connection, answers nothing: a frozen server
    try:
        url = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?connect_timeout_s=2"
        with pytest.raises(LedgerUnavailable, match=r"within connect_timeout_s=2"):
            configure(backend=url)
    finally:
        proxy.close()


def test_reachable_servers_are_checked_once(
    postgres_server: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    from crewai_idempotent import PostgresCacheBackend, RedisCacheBackend

    for made in (
        PostgresCacheBackend.from_url(postgres_server.fresh_url()),
        RedisCacheBackend.from_url(redis_server.fresh_url()),
    ):
        asked: list[int] = []
        probe = made.check_reachable

        def counted(probe: Any = probe, asked: list[int] = asked) -> None:
            asked.append(1)
            probe()

        made.check_reachable = counted  # type: ignore[method-assign]
        configure(backend=made)
        configure(backend=made)  # the same backend: it answered once, it is not asked again
        IdempotencyConfig(backend=made)
        assert asked == [1]
        charges = FakeProvider(tmp_path / f"charges-{type(made).__name__}.jsonl")
        tool = charge_tool(charges, idempotent=True)
        assert tool.run(amount=1, recipient="bob") == tool.run(amount=1, recipient="bob")
        assert len(charges.effects()) == 1
        configure(None)
        made.close()
