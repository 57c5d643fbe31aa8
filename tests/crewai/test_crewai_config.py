"""Where the ledger comes from: tool > crew > configure() > CREWAI_IDEMPOTENCY_URL > the
embedded default, and no setting a user gives is silently ignored."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    FileLockCacheBackend,
    IdempotencyConfig,
    InMemoryCacheBackend,
    LedgerConfigurationError,
    LedgerUnavailable,
    SQLiteCacheBackend,
    Status,
    configure,
)
from crewai_idempotent.integration._config import ToolOptions, settings_for
from crewai_idempotent.integration._ledgers import default_ledger_path
from tests.support.crewai.crews import charge_tool, payment_crew, scripted
from tests.support.crewai.provider import FakeProvider
from tests.support.crewai.versions import CREWAI, HAS_FORMATTED_DESCRIPTION

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

ALICE = {"amount": 5, "recipient": "alice", "invoice": "inv-1"}


def _keys(backend: Any) -> list[str]:
    return sorted(r.key for r in backend.scan(Status.COMMITTED))


def _kickoff(native: bool, charges: FakeProvider, **crew_options: Any) -> Any:
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{invoice}")
    crew, _ = payment_crew(
        [charge], scripted(native, [("charge_card", ALICE)]), reject=1, **crew_options
    )
    return crew.kickoff()


def test_nothing_configured_uses_the_default_ledger_in_crewai_storage(
    native: bool, charges: FakeProvider, isolated_crewai: Path
) -> None:
    path = default_ledger_path()
    assert isolated_crewai in path.parents and path.name == "crewai_idempotent.db"
    assert not path.exists()

    _kickoff(native, charges)

    assert charges.count() == 1
    assert path.exists()
    with SQLiteCacheBackend(path) as backend:
        assert _keys(backend) == ["pay:inv-1"]


def test_crew_cache_backend_is_really_used(
    native: bool, charges: FakeProvider, tmp_path: Path
) -> None:
    backend = SQLiteCacheBackend(tmp_path / "crew-ledger.db")
    _kickoff(native, charges, cache_backend=backend)
    assert charges.count() == 1
    assert _keys(backend) == ["pay:inv-1"]
    assert not default_ledger_path().exists()


def test_crew_idempotency_config_is_really_used(
    native: bool, charges: FakeProvider, tmp_path: Path
) -> None:
    backend = FileLockCacheBackend(tmp_path / "crew-ledger")
    _kickoff(native, charges, idempotency=IdempotencyConfig(backend=backend))
    assert charges.count() == 1
    assert _keys(backend) == ["pay:inv-1"]
    assert not default_ledger_path().exists()


def test_crew_settings_as_a_dict_are_checked_like_configure(
    charges: FakeProvider, tmp_path: Path
) -> None:
    # Documented: the settings as a dict, as a YAML or JSON crew configuration gives them.
    url = f"sqlite:///{tmp_path / 'dict-ledger.db'}"
    _kickoff(True, charges, idempotency={"backend": url, "on_uncertain": "raise"})
    with SQLiteCacheBackend(tmp_path / "dict-ledger.db") as backend:
        assert _keys(backend) == ["pay:inv-1"]
    charge = charge_tool(charges, idempotent=True)
    with pytest.raises(LedgerConfigurationError) as refused:
        payment_crew([charge], scripted(True), idempotency={"bakend": url})
    assert "Crew(idempotency={...}): unknown setting 'bakend' (did you mean 'backend'?)" in str(
        refused.value
    )
    assert not default_ledger_path().exists()


def test_a_misspelt_configure_setting_names_the_close_match() -> None:
    with pytest.raises(LedgerConfigurationError) as refused:
        configure(wiat_s=3)
    message = str(refused.value)
    assert "configure(): unknown setting 'wiat_s' (did you mean 'wait_s'?)" in message
    assert "the settings are backend, on_uncertain" in message
    assert configure(None) is None  # nothing was set
    with pytest.raises(LedgerConfigurationError, match=r"'zzz'; the settings are"):
        configure(zzz=1)  # nothing close: no guess


def test_crew_backend_as_url(charges: FakeProvider, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'url-ledger.db'}"
    _kickoff(True, charges, cache_backend=url)
    with SQLiteCacheBackend(tmp_path / "url-ledger.db") as backend:
        assert _keys(backend) == ["pay:inv-1"]


def test_crew_setting_beats_configure_which_beats_the_environment(
    charges: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crew_backend, configured = InMemoryCacheBackend(), InMemoryCacheBackend()
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_URL", f"sqlite:///{tmp_path / 'env.db'}")
    configure(backend=configured)

    _kickoff(False, charges, cache_backend=crew_backend)
    assert _keys(crew_backend) == ["pay:inv-1"] and _keys(configured) == []

    second = charge_tool(charges, idempotent=True, idempotency_key="pay:{invoice}")
    second.run(**{**ALICE, "invoice": "inv-2"})  # no crew: configure() applies
    assert _keys(configured) == ["pay:inv-2"]

    configure(None)
    second.run(**{**ALICE, "invoice": "inv-3"})  # nothing but the environment
    with SQLiteCacheBackend(tmp_path / "env.db") as backend:
        assert _keys(backend) == ["pay:inv-3"]
    assert not default_ledger_path().exists()


def test_option_precedence_tool_crew_configure() -> None:
    configured = InMemoryCacheBackend()
    configure(wait_s=3, lease_s=40, ttl=100, on_uncertain="report", backend=configured)
    crew = IdempotencyConfig(wait_s=2, idempotency_key="crew:{fingerprint}")
    tool = ToolOptions(wait_s=1)

    settings = settings_for("pay", tool, crew)
    assert settings.options.wait_s == 1  # tool
    assert settings.idempotency_key == "crew:{fingerprint}"  # crew
    options = settings.options
    assert (options.lease_s, options.ttl, settings.on_uncertain) == (40, 100, "report")
    assert settings.ledger.backend is configured  # configure()'s, the crew setting none

    configure(None)
    defaults = settings_for("pay", ToolOptions(), None)
    assert defaults.on_uncertain == "raise"
    default = defaults.ledger.backend
    assert isinstance(default, SQLiteCacheBackend) and default.path == default_ledger_path()
    assert defaults.options.ttl is defaults.ledger.ttl  # unset: the ledger's default applies


def test_crew_key_template_applies_to_tools_without_one(charges: FakeProvider) -> None:
    backend = InMemoryCacheBackend()
    charge = charge_tool(charges, idempotent=True)
    config = IdempotencyConfig(backend=backend, idempotency_key="crew-wide:{task}")
    crew, _ = payment_crew(
        [charge], scripted(True, [("charge_card", ALICE)]), reject=1, idempotency=config
    )
    crew.kickoff()
    assert charges.count() == 1
    (key,) = _keys(backend)
    assert key.startswith("crew-wide:") and len(key) == len("crew-wide:") + 32


def test_crew_copy_keeps_the_setting(charges: FakeProvider) -> None:
    backend = InMemoryCacheBackend()
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{invoice}")
    crew, _ = payment_crew(
        [charge], scripted(True, [("charge_card", ALICE)]), cache_backend=backend
    )
    crew.copy().kickoff()
    assert _keys(backend) == ["pay:inv-1"]
    assert not default_ledger_path().exists()


def test_conflicting_crew_settings_are_refused(tmp_path: Path, charges: FakeProvider) -> None:
    one, two = InMemoryCacheBackend(), InMemoryCacheBackend()
    charge = charge_tool(charges, idempotent=True)
    llm = scripted(True)
    with pytest.raises(ValueError, match="name two different ledgers"):
        payment_crew([charge], llm, cache_backend=one, idempotency=IdempotencyConfig(backend=two))
    with pytest.raises(TypeError, match=r"takes a crewai_idempotent\.IdempotencyConfig or a dict"):
        payment_crew([charge], llm, idempotency="sqlite:///x.db")
    with pytest.raises(TypeError, match="CacheBackend or a ledger URL"):
        payment_crew([charge], llm, cache_backend=object())
    # The same backend given both ways is one setting, not a conflict.
    crew, _ = payment_crew(
        [charge], llm, cache_backend=one, idempotency=IdempotencyConfig(backend=one)
    )
    assert crew is not None


def test_bad_config_values_are_refused() -> None:
    with pytest.raises(ValueError, match="on_uncertain must be 'raise' or 'report'"):
        IdempotencyConfig(on_uncertain="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backend must be"):
        IdempotencyConfig(backend=Path("ledger.db"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="wait_s must be a number"):
        IdempotencyConfig(wait_s="soon")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not both"):
        configure(IdempotencyConfig(), wait_s=1)
    with pytest.raises(ValueError, match="ttl must be greater than 0"):
        IdempotencyConfig(ttl=0)  # 0 would mean every call runs again, never a replay


def test_bad_environment_url_is_refused_at_crew_and_stops_the_kickoff(
    native: bool, charges: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_URL", "mysql://nowhere/ledger")
    charge = charge_tool(charges, idempotent=True)
    with pytest.raises(
        LedgerConfigurationError, match="CREWAI_IDEMPOTENCY_URL='mysql://nowhere/ledger'"
    ):
        charge.run(**ALICE)
    llm = scripted(native, [("charge_card", ALICE)])
    with pytest.raises(LedgerConfigurationError, match="unknown ledger URL scheme 'mysql'"):
        payment_crew([charge], llm)  # where the crew is built

    # Set after the crew was built: the first guarded call stops the kickoff with the
    # error; the model never reads it as a tool observation.
    monkeypatch.delenv("CREWAI_IDEMPOTENCY_URL")
    crew, _ = payment_crew([charge], llm)
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_URL", "sqlite:///ledger.db?synchronus=NORMAL")
    with pytest.raises(LedgerConfigurationError, match="unknown option 'synchronus'"):
        crew.kickoff()
    assert charges.count() == 0
    assert not any("synchronus" in p for p in llm.prompts)


@pytest.mark.parametrize(
    ("backend", "error"),
    [
        ("./ledger.db", "no URL scheme.*sqlite:///./ledger.db"),
        ("bogus://x", "unknown ledger URL scheme 'bogus'"),
        ("sqlite:///ledger.db?synchronus=NORMAL", "unknown option 'synchronus'"),
        ("file://ledger", "read as a host name"),
        ("memory://?fsync=no", "unknown option 'fsync'"),
    ],
)
def test_bad_ledger_settings_raise_where_they_are_given(
    backend: str, error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, charges: FakeProvider
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LedgerConfigurationError, match=error):
        IdempotencyConfig(backend=backend)
    with pytest.raises(LedgerConfigurationError, match=error):
        configure(backend=backend)
    with pytest.raises(LedgerConfigurationError, match=error):
        payment_crew([charge_tool(charges, idempotent=True)], scripted(True), cache_backend=backend)
    assert list(tmp_path.iterdir()) == []  # nothing was created on the way


def test_unusable_ledger_path_raises_at_configuration(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # any local user could swap the ledger
    with pytest.raises(LedgerUnavailable, match="writable by group or others"):
        IdempotencyConfig(backend=f"sqlite:///{shared / 'ledger.db'}")


def test_a_bad_default_ledger_stops_the_kickoff(
    charges: FakeProvider, isolated_crewai: Path
) -> None:
    folder = default_ledger_path().parent
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o777)
    charge = charge_tool(charges, idempotent=True)
    llm = scripted(True, [("charge_card", ALICE)])
    crew, _ = payment_crew([charge], llm)
    with pytest.raises(LedgerConfigurationError, match="the default ledger cannot be used"):
        crew.kickoff()
    assert charges.count() == 0


def test_the_ledger_in_use_is_logged_once(
    charges: FakeProvider, isolated_crewai: Path, caplog: pytest.LogCaptureFixture
) -> None:
    charge = charge_tool(charges, idempotent=True)
    with caplog.at_level(logging.INFO, logger="crewai_idempotent"):
        charge.run(**ALICE)
        charge.run(**{**ALICE, "invoice": "inv-2"})
    said = [r.getMessage() for r in caplog.records if "guarded tool calls use" in r.getMessage()]
    assert len(said) == 1
    assert str(default_ledger_path()) in said[0] and "named after the current directory" in said[0]


needs_lazy_schema = pytest.mark.skipif(
    not HAS_FORMATTED_DESCRIPTION,
    reason=f"crewai {CREWAI} renders every tool's JSON schema when it is built (until 1.15.3): "
    "a tool cannot take an argument type without one, guarded or not",
)


@needs_lazy_schema
def test_fingerprint_option_on_every_form(charges: FakeProvider) -> None:
    from crewai.tools import BaseTool, tool

    from crewai_idempotent import idempotent

    class Money:  # a custom argument type the canonical form does not know
        def __init__(self, cents: int) -> None:
            self.cents = cents

    def by_cents(args: dict[str, Any]) -> Any:
        return {"cents": args["amount"].cents, "to": args["to"]}

    backend = InMemoryCacheBackend()
    configure(backend=backend)

    @tool("pay_money", fingerprint=by_cents)
    def pay_money(amount: Money, to: str) -> str:
        """Pay."""
        return charges.charge(amount.cents, to)

    class PayMoney(BaseTool):
        name: str = "pay_class"
        description: str = "Pay."
        idempotent: bool = True
        fingerprint: Any = by_cents

        def _run(self, amount: Money, to: str) -> str:
            return charges.charge(amount.cents, to)

    @tool("pay_plain")
    def pay_plain(amount: Money, to: str) -> str:
        """Pay."""
        return charges.charge(amount.cents, to)

    copied = idempotent(pay_plain, fingerprint=by_cents)
    for guarded in (pay_money, PayMoney(), copied):
        first = (
            guarded.func(Money(5), "bob")
            if hasattr(guarded, "func")
            else guarded._run(Money(5), "bob")
        )
        again = (
            guarded.func(Money(5), "bob")
            if hasattr(guarded, "func")
            else guarded._run(Money(5), "bob")
        )
        assert first == again
    assert charges.count() == 3  # once per tool, each replayed

    with pytest.raises(TypeError, match=r"fingerprint= callable.*__idempotency_fingerprint__"):
        idempotent(pay_plain).func(Money(5), "bob")
    assert charges.count() == 3


@needs_lazy_schema
def test_a_type_can_say_how_it_fingerprints(charges: FakeProvider) -> None:
    from crewai.tools import tool

    class Money:
        def __init__(self, cents: int) -> None:
            self.cents = cents

        def __idempotency_fingerprint__(self) -> Any:
            return self.cents

    configure(backend=InMemoryCacheBackend())

    @tool("pay_money", idempotent=True)
    def pay_money(amount: Money) -> str:
        """Pay."""
        return charges.charge(amount.cents, "bob")

    assert pay_money.func(Money(5)) == pay_money.func(Money(5))
    pay_money.func(Money(6))
    assert charges.count() == 2


def test_on_uncertain_report_from_configure(charges: FakeProvider) -> None:
    from crewai_idempotent import OutcomeUnknown

    configure(on_uncertain="report")

    def charge_then_time_out(amount: int, recipient: str) -> str:
        """Charge, then lose the answer."""
        charges.charge(amount, recipient)
        raise OutcomeUnknown("gateway timed out after accepting the charge")

    from crewai.tools import tool

    charge = tool("charge_card", idempotent=True)(charge_then_time_out)
    llm = scripted(True, [("charge_card", {"amount": 5, "recipient": "alice"})])
    crew, _ = payment_crew([charge], llm, reject=1)
    crew.kickoff()  # reported to the model, not raised
    assert charges.count() == 1
    assert any("is uncertain" in p for p in llm.prompts)
