"""Every ```python block in README.md and docs/*.md runs, against fakes for the outside world
(a payment provider, a mailer, an HTTP client), and the claims the text makes about them hold.

Blocks run as written, with two mirrorings: paths under /srv/app/ move into the test's
folder, and a `spawn` process pool becomes `fork` (a block executed here is not a module a
spawned child could import). A new block whose names no fake provides fails here: add the
fake, or make the example self-contained.
"""

from __future__ import annotations

import itertools
import logging
import re
import sys
import types
from abc import ABC
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from crewai_idempotent import (
    Absent,
    InMemoryCacheBackend,
    Ledger,
    OutcomeUncertain,
    OutcomeUnknown,
    Record,
    Status,
    configure,
)
from tests.support.crewai.crews import scripted

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for number, match in enumerate(FENCE.finditer(text)):
            found.append((f"{path.relative_to(ROOT)}#{number}", match.group(1)))
    return found


BLOCKS = _blocks()
HOOK_SECRET = "whsec_" + "c2VjcmV0IG9mIHRoZSBkb2NzJyB3ZWJob29rcw=="


class Effects:
    """What the fakes did: one list per kind of effect."""

    def __init__(self) -> None:
        self.done: dict[str, list[Any]] = {}
        self._ids = itertools.count(1)

    def __call__(self, kind: str, detail: Any) -> str:
        self.done.setdefault(kind, []).append(detail)
        return f"{kind}_{next(self._ids)}"

    def count(self, kind: str) -> int:
        return len(self.done.get(kind, []))


def _namespace(effects: Effects, tmp_path: Path) -> dict[str, Any]:
    from crewai import Agent, Task
    from crewai.tools import BaseTool

    def create_intent(amount: int, currency: str = "eur", idempotency_key: str = "") -> Any:
        return SimpleNamespace(id=effects("pi", (amount, currency, idempotency_key)))

    stripe = SimpleNamespace(
        PaymentIntent=SimpleNamespace(create=create_intent),
        Refund=SimpleNamespace(create=lambda charge: SimpleNamespace(id=effects("re", charge))),
    )

    class DeployTool(BaseTool):
        name: str = "deploy"
        description: str = "Deploy a service version."

        def _run(self, service: str, version: str) -> str:
            return effects("deploy", (service, version))

    class SomeToolsRefund(BaseTool):
        name: str = "refund"
        description: str = "Refund a charge."

        def _run(self, charge_id: str) -> str:
            return effects("refund", charge_id)

    class BookingTool(BaseTool):
        name: str = "book_trip"
        description: str = "Book a trip."

        def _run(self, trip_id: str) -> str:
            return effects("booking", trip_id)

    class Celery:
        def task(self, **_: Any) -> Any:
            return lambda fn: fn

    cashier = Agent(
        role="Cashier", goal="Charge once", backstory="Careful.", llm=scripted(True), tools=[]
    )
    return {
        "stripe": stripe,
        "shop": SimpleNamespace(cancel=lambda order_id: effects("cancel", order_id)),
        "mailer": SimpleNamespace(send=lambda to, body: effects("mail", (to, body))),
        "some_mcp_tool": DeployTool(),
        "SomeToolsRefund": SomeToolsRefund,
        "BookingTool": BookingTool,
        "log": logging.getLogger("docs-example"),
        "charge": lambda **args: effects("charge", args),
        "client": SimpleNamespace(post=lambda *a, **k: SimpleNamespace(status_code=200)),
        "payload": {"amount": 100},
        "key": "charge:order-1",
        "httpx": httpx,
        "provider": SimpleNamespace(charges=SimpleNamespace(search=lambda idempotency_key: None)),
        "app": Celery(),
        "payments": SimpleNamespace(
            charge=lambda order_id, amount=None: f"ch_{order_id}",
        ),
        "order_ids": ["o1", "o2"],
        "ABC": ABC,
        "Record": Record,
        "Iterator": Iterator,
        "cashier": cashier,
        "charge_invoice": Task(
            description="Charge invoice inv-1.", expected_output="The receipt.", agent=cashier
        ),
    }


def _mirrored(source: str, tmp_path: Path) -> str:
    return source.replace("/srv/app/", f"{tmp_path}/srv/app/").replace(
        'get_context("spawn")', 'get_context("fork")'
    )


@pytest.fixture
def run_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "srv" / "app").mkdir(parents=True, mode=0o700)
    # The webhook channels' shared secret (docs/notifications.md names it by variable).
    monkeypatch.setenv("CREWAI_HOOK_SECRET", HOOK_SECRET)
    modules: list[str] = []

    def run(name: str, source: str) -> tuple[dict[str, Any], Effects]:
        effects = Effects()
        # A real module, so that what the block defines pickles by reference.
        module = types.ModuleType(f"docs_example_{len(modules)}")
        sys.modules[module.__name__] = module
        modules.append(module.__name__)
        module.__dict__.update(_namespace(effects, tmp_path))
        exec(compile(_mirrored(source, tmp_path), name, "exec"), module.__dict__)
        return module.__dict__, effects

    yield run
    for name in modules:
        sys.modules.pop(name, None)
    configure(None)


@pytest.mark.parametrize(("name", "source"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_every_python_example_runs(run_block: Any, name: str, source: str) -> None:
    namespace, effects = run_block(name, source)
    _claims(namespace, effects)


def _claims(ns: dict[str, Any], effects: Effects) -> None:
    """What the text around a block promises about it."""
    if "send_payment" in ns:  # the key is filled in by the guard; a retry replays
        first = ns["send_payment"].run(invoice_id="inv_1", amount_cents=100)
        assert ns["send_payment"].run(invoice_id="inv_1", amount_cents=100) == first
        assert effects.done["pi"] == [(100, "eur", "pay:inv_1")]
        guarded = ns["guarded_mcp_tool"]
        assert guarded.run(service="api", version="2") == guarded.run(service="api", version="2")
        assert effects.count("deploy") == 1
    if "RefundCharge" in ns:
        tool = ns["RefundCharge"]()
        assert tool.run(charge_id="ch_1") == tool.run(charge_id="ch_1")
        assert ns["cancel_order"].run(order_id="o1") == ns["cancel_order"].run(order_id="o1")
        assert (effects.count("re"), effects.count("cancel")) == (1, 1)
    if "ChargeCardStrict" in ns:
        tool = ns["ChargeCardStrict"]()
        assert tool.run(invoice="i1", amount_cents=5) == tool.run(invoice="i1", amount_cents=5)
        assert effects.count("pi") == 1
    if "send_email" in ns:
        ns["send_email"].run(to="a@b", campaign_id="c1", body="hi")
        ns["send_email"].run(to="a@b", campaign_id="c1", body="hi")
        assert effects.count("mail") == 1
        assert ns["refund"].run(charge_id="ch_9") == ns["refund"].run(charge_id="ch_9")
        assert effects.count("refund") == 1
    if "receipt" in ns and "ledger" in ns:  # the framework-free core
        assert ns["receipt"] == ns["ledger"].run(
            "pay:inv_42",
            lambda: pytest.fail("ran twice"),
            fingerprint=ns["fingerprint"](ns["args"]),
        )
        assert effects.count("charge") == 1
    if "find_charge" in ns:
        assert isinstance(ns["find_charge"]("charge:order-1", {}), Absent)
    if "receipts" in ns:
        assert ns["receipts"] == ["ch_o1", "ch_o2"]
    if "receive" in ns:  # the webhook receiver: verifies, and deduplicates on webhook-id
        import datetime as dt

        from standardwebhooks import Webhook, WebhookVerificationError

        body = '{"type": "approval.requested", "data": {}}'
        sent = dt.datetime.now(dt.UTC)
        headers = {
            "webhook-id": "ob_7e557f372fbc106a8b184cc6",
            "webhook-timestamp": str(int(sent.timestamp())),
            "webhook-signature": Webhook(HOOK_SECRET).sign(
                "ob_7e557f372fbc106a8b184cc6", sent, body
            ),
        }
        assert ns["receive"](body.encode(), headers) == "204"
        assert ns["receive"](body.encode(), headers) == "204"  # a second try of the same id
        assert ns["seen"] == {"ob_7e557f372fbc106a8b184cc6"}
        with pytest.raises(WebhookVerificationError):
            ns["receive"](body.replace("requested", "approved").encode(), headers)
    _reconciliation_claims(ns)


def _reconciliation_claims(ns: dict[str, Any]) -> None:
    """recovery.md's sweeper and verifiers, against the local servers the tests use."""
    from crewai_idempotent import Found
    from crewai_idempotent.ledger._reconcile import ask
    from tests.support.reconcile import uncertain

    if "sweeper" in ns:  # the pass settles what find_charge can tell (nothing: Absent)
        sweeper = ns["sweeper"]
        uncertain(sweeper.ledger, "charge:order-1", tool="charge_card")
        assert [(r.key, r.outcome) for r in sweeper.sweep().results] == [
            ("charge:order-1", "absent")
        ]
        sweeper.close()
    if "verify_payment" in ns:  # the tool's charge is what the verifier finds
        import stripe

        from tests.support.fake_stripe import API_KEY, FakeStripe

        fake = FakeStripe()
        try:
            client = stripe.StripeClient(API_KEY, base_addresses={"api": fake.url})
            ns["client"] = ns["verify_payment"]._client = client
            receipt = ns["pay_invoice"].run(invoice_id="inv_1", amount_cents=500)
            assert ask(ns["verify_payment"], "pay:inv_1", {}) == Found(receipt)
            assert [c["id"] for c in fake.charged("pay:inv_1")] == [receipt]
        finally:
            fake.close()  # the tool it built is forgotten after the test (conftest.py)
    if "verify_transfer" in ns:  # the first answer comes back; nothing is done twice
        from tests.support.idempotent_http import IdempotentAPI

        api = IdempotentAPI()
        try:
            verify = ns["verify_transfer"]
            verify.url = f"{api.url}/transfers"
            args = {"amount": 40, "to": "acct_9"}
            first = httpx.post(verify.url, json=args, headers={"Idempotency-Key": "transfer:1"})
            assert ask(verify, "transfer:1", args) == Found(first.json())
            assert len(api.transfers) == 1
        finally:
            api.close()
    if "find_order_charge" in ns:
        import sqlite3

        with sqlite3.connect(Path.cwd() / "srv" / "app" / "shop.db") as db:
            db.execute("CREATE TABLE charges (idempotency_key TEXT, charge_id TEXT)")
            db.execute("INSERT INTO charges VALUES ('charge:order-1', 'ch_1')")
        assert ask(ns["find_order_charge"], "charge:order-1", {}) == Found("ch_1")
        assert isinstance(ask(ns["find_order_charge"], "charge:order-2", {}), Absent)


def test_the_http_example_says_what_happens(run_block: Any) -> None:
    (source,) = [src for name, src in BLOCKS if "client.post" in src]

    def failing(exc: Exception) -> Any:
        def post(*_: Any, **__: Any) -> Any:
            raise exc

        return SimpleNamespace(post=post)

    request = httpx.Request("POST", "https://provider.invalid/v1/charges")
    module = types.ModuleType("docs_http")
    for error, expected in (
        (httpx.RemoteProtocolError("dropped", request=request), OutcomeUnknown),
        (httpx.ConnectTimeout("no route", request=request), ConnectionError),
    ):
        module.__dict__.update(client=failing(error), payload={}, key="k", httpx=httpx)
        with pytest.raises(expected):
            exec(compile(source, "recovery.md", "exec"), module.__dict__)


# -- statements the docs make --------------------------------------------------------------


def _raises(exc: BaseException) -> Any:
    def body() -> Any:
        raise exc

    return body


def test_http_client_timeouts_are_recorded_uncertain() -> None:
    """docs/recovery.md: timeouts by name are UNCERTAIN; a dropped answer is FAILED."""
    import requests

    request = httpx.Request("POST", "https://provider.invalid/")
    ledger = Ledger(InMemoryCacheBackend())
    cases = {
        "httpx-read": (httpx.ReadTimeout("slow", request=request), Status.UNCERTAIN),
        "httpx-connect": (httpx.ConnectTimeout("slow", request=request), Status.UNCERTAIN),
        "requests-read": (requests.exceptions.ReadTimeout("slow"), Status.UNCERTAIN),
        "requests-connect": (requests.exceptions.ConnectTimeout("slow"), Status.UNCERTAIN),
        "timeout-error": (TimeoutError("slow"), Status.UNCERTAIN),
        "dropped": (httpx.RemoteProtocolError("dropped", request=request), Status.FAILED),
    }
    for key, (error, status) in cases.items():
        with pytest.raises(type(error)):
            ledger.run(key, _raises(error))
        record = ledger.get(key)
        assert record is not None and record.status is status, key


def test_an_uncertain_outcome_does_not_say_nothing_ran() -> None:
    ledger = Ledger(InMemoryCacheBackend())
    ran = []

    def body() -> Any:
        ran.append(1)
        raise OutcomeUnknown("the gateway timed out after accepting the charge")

    with pytest.raises(OutcomeUnknown):
        ledger.run("k", body)
    with pytest.raises(OutcomeUncertain) as caught:
        ledger.run("k", body)
    assert ran == [1]
    message = str(caught.value)
    assert "nothing was run" not in message.lower()
    assert "Nothing runs under this key until it is settled" in message


def test_one_start_up_figure_across_the_docs() -> None:
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    (figure,) = re.findall(
        r"\.pth` hook executed in a fresh interpreter \| \*\*([\d.]+) ms", benchmarks
    )
    crewai_md = (ROOT / "docs" / "crewai.md").read_text(encoding="utf-8")
    assert f"{figure} ms of interpreter start-up" in crewai_md
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for claim in re.findall(r"(?:under|about|adds?) ([\d.]+) ms[^.]*start-up", text):
            assert claim in (figure, "5"), (path.name, claim)  # 5 ms is the target


def test_the_readme_says_where_the_default_ledger_is() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "crewai_idempotent.db" in readme and "current directory" in readme
    assert "crewai-idempotent doctor" in readme
