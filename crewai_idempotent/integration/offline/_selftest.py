"""`crewai-idempotent doctor --self-test`: the guard's own checks against the installed crewai.

Every execution path (ReAct, native, parallel native, the standalone agent, flows, async)
meets every retry source (a guardrail rejection, an agent retry, the model repeating a
call, a second kickoff, an uncertain outcome), offline: a scripted model stands in for
the LLM and a counter for the payment provider. A check passes when the provider was
charged once per distinct invoice, the receipts are in the crew's ledger (not the process
default), and an uncertain outcome stopped the kickoff. tests/crewai/test_crewai_paths.py runs
the same checks in the suite, on every release of the matrix.

The doctor, and a release verifying itself (`_verify`), run them in a fresh interpreter:
`_selftest_process.run_in_subprocess` starts `main` here, which speaks the line protocol
that module reads (the checks that apply first, then one line per check as it finishes).
That end lives there, beneath the integration, so that the release gate's runner and the
doctor start the self-test without importing it: this module installs the integration,
and nothing of the package imports this module. The checks and the scripted answers
they give are together because they are read together when a check fails on a new crewai
release.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._errors import OutcomeUncertain, OutcomeUnknown
from ...backends.sqlite import SQLiteCacheBackend
from ...ledger._backend import DOCUMENTS
from ...notifications._outbox import OUTBOX
from .. import configure, install
from ._scripted import current_attempt, scripted_model, tool_call
from ._selftest_process import MARK

PATHS = ("react", "native", "parallel native", "agent", "flow", "async")
SOURCES = ("guardrail", "agent retry", "repeated call", "new kickoff", "uncertain")
# The standalone agent (Agent.kickoff: AgentExecutor, or LiteAgent on old releases) has no
# task, so no guardrail and no agent retry.
NOT_APPLICABLE = {("agent", "guardrail"), ("agent", "agent retry")}
EXECUTOR_PATHS = ("react", "native", "parallel native", "async")


@dataclass(frozen=True, slots=True)
class Check:
    path: str
    source: str
    executor: str | None = None  # crewai's agent executor class name, where it matters

    @property
    def label(self) -> str:
        where = f" [{self.executor}]" if self.executor else ""
        return f"{self.path} x {self.source}{where}"


@dataclass(frozen=True, slots=True)
class Result:
    check: Check
    passed: bool
    detail: str
    seconds: float


def executors() -> dict[str, type]:
    """crewai's agent executors present in this release, by class name."""
    found: dict[str, type] = {}
    for module in (
        "crewai.agents.crew_agent_executor",
        "crewai.agents.agent_executor",
        "crewai.experimental.agent_executor",
    ):
        try:
            loaded = importlib.import_module(module)
        except ImportError:
            continue
        for name in ("CrewAgentExecutor", "AgentExecutor"):
            cls = getattr(loaded, name, None)
            if isinstance(cls, type) and cls.__module__ == module:
                found.setdefault(name, cls)
    return found


def checks() -> list[Check]:
    """Every check that applies to the installed crewai."""
    names = sorted(executors())
    found: list[Check] = []
    for path in PATHS:
        for source in SOURCES:
            if (path, source) in NOT_APPLICABLE:
                continue
            if path in EXECUTOR_PATHS and len(names) > 1:
                found.extend(Check(path, source, name) for name in names)
            else:
                found.append(Check(path, source))
    return found


# -- the scripted model ----------------------------------------------------------------


@dataclass
class Script:
    """What the model does: `batches[i]` are the tool calls of turn i of an attempt."""

    native: bool
    batches: list[list[tuple[str, dict[str, Any]]]]
    fail_times: int = 0
    attempts: int = 0
    failures: int = 0

    def reply(self, messages: list[Any], tools: Any) -> Any:
        results = _results(current_attempt(messages), self.native)
        with _script_lock:
            if self.native and not tools and results:
                return "; ".join(results)
            if not results:
                self.attempts += 1
            seen = 0
            for batch in self.batches:
                if len(results) < seen + len(batch):
                    done = len(results) - seen
                    return self._ask(batch if self.native else batch[done : done + 1])
                seen += len(batch)
            if self.failures < self.fail_times:
                self.failures += 1
                raise RuntimeError("self-test: scripted model failure after its tool calls")
        answer = "; ".join(results) if results else "nothing to do"
        return answer if self.native else f"Thought: done\nFinal Answer: {answer}"

    def _ask(self, batch: list[tuple[str, dict[str, Any]]]) -> Any:
        if self.native:
            return [tool_call(f"call_{uuid.uuid4().hex[:8]}", name, args) for name, args in batch]
        name, args = batch[0]
        return f"Thought: I need {name}\nAction: {name}\nAction Input: {json.dumps(args)}"

    def model(self) -> Any:
        return scripted_model("self-test", self.reply, native=self.native)


_script_lock = threading.Lock()


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else str(message)
    return content if isinstance(content, str) else json.dumps(content, default=str)


def _results(msgs: list[Any], native: bool) -> list[str]:
    found = []
    for m in msgs:
        if not isinstance(m, dict):
            continue
        if native and m.get("role") == "tool":
            found.append(_text(m).strip())
        elif not native and m.get("role") == "assistant" and "Observation:" in _text(m):
            found.append(_text(m).split("Observation:", 1)[1].strip().split("\n\n")[0].strip())
    return found


# -- one check -------------------------------------------------------------------------


class _Provider:
    """The fake payment provider: counts charges per invoice."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.charges: list[str] = []

    def charge(self, invoice: str) -> str:
        with self.lock:
            self.charges.append(invoice)
            return f"receipt-{invoice}-{len(self.charges)}"


class CheckFailed(AssertionError):
    pass


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def run_check(check: Check, workdir: Path) -> Result:
    started = time.monotonic()
    try:
        detail = _run(check, workdir)
        passed = True
    except CheckFailed as exc:
        passed, detail = False, str(exc)
    except Exception as exc:  # noqa: BLE001 - a crash of crewai or the guard is a failed check
        passed, detail = False, f"{type(exc).__name__}: {exc}"
    return Result(check, passed, detail, time.monotonic() - started)


def _run(check: Check, workdir: Path) -> str:
    from crewai.tools import tool

    provider = _Provider()
    uncertain = check.source == "uncertain"

    @tool("charge_card", idempotent=True)  # type: ignore[call-overload]
    def charge_card(invoice: str, amount: int) -> str:
        """Charge `amount` for `invoice`; returns the receipt."""
        receipt = provider.charge(invoice)
        if uncertain:
            raise OutcomeUnknown("self-test: the provider did not answer")
        return receipt

    invoices = ["inv-1", "inv-2"] if check.path == "parallel native" else ["inv-1"]
    calls = [("charge_card", {"invoice": i, "amount": 5}) for i in invoices]
    batches = [calls] if check.path == "parallel native" else [[c] for c in calls]
    if check.source == "repeated call":
        batches = [*batches, *batches]  # the model asks for the same charges again
    # Async runs the ReAct loop: the path whose tool calls crewai hands to a thread pool.
    native = check.path in ("native", "parallel native", "flow")
    script = Script(native=native, batches=batches)
    if check.source == "agent retry":
        script.fail_times = 1

    tag = f"{check.path}-{check.source}-{check.executor}".replace(" ", "_")
    crew_ledger = SQLiteCacheBackend(workdir / f"{tag}-crew.db")
    default_ledger = SQLiteCacheBackend(workdir / f"{tag}-default.db")
    replays: list[Any] = []
    configure(backend=default_ledger)
    try:
        kickoff = _kickoff(check, charge_card, script, crew_ledger)
        runs = 2 if check.source in ("new kickoff", "uncertain") else 1
        halted = 0
        with _replays_into(replays):
            for _ in range(runs):
                try:
                    kickoff()
                except OutcomeUncertain:
                    halted += 1
    finally:
        configure(None)

    charged = sorted(provider.charges)
    if uncertain:
        # Parallel calls: the halt may come before the second call ran; none runs twice.
        _expect(
            bool(charged) and len(set(charged)) == len(charged) and set(charged) <= set(invoices),
            f"charges made {charged}: an uncertain call must not run again",
        )
        _expect(halted == runs, f"an uncertain outcome stopped {halted} of {runs} kickoffs")
    else:
        _expect(charged == invoices, f"charges made {charged}, expected one each of {invoices}")
        _expect(halted == 0, "a kickoff stopped as uncertain with no uncertain outcome")
    where = crew_ledger if check.path != "agent" else default_ledger
    # The calls' records; the ledger's own documents (the outbox's entry for an uncertain
    # outcome) are not calls.
    stored = [r for r in where.scan() if not r.key.startswith(DOCUMENTS)]
    _expect(len(stored) == len(charged), f"{len(stored)} record(s) in the expected ledger")
    if uncertain:
        told = list(where.scan_prefix(OUTBOX))
        _expect(bool(told), "an uncertain outcome was not put in the outbox for a person")
    if check.path != "agent":
        strays = list(default_ledger.scan())
        _expect(not strays, "a call used the process default ledger instead of the crew's")
    if check.source in ("guardrail", "agent retry", "new kickoff"):
        _expect(script.attempts >= 2, f"the model made {script.attempts} attempt(s), not a retry")
    if not uncertain and not (check.source == "repeated call" and not native):
        # (crewai's ReAct loop refuses a repeated action itself, before any tool runs.)
        _expect(len(replays) >= len(invoices), f"{len(replays)} replay(s): the retry never called")
    return (
        f"{len(charged)} charge(s), {len(replays)} replay(s), {script.attempts} attempt(s), "
        f"{len(stored)} record(s)"
    )


@contextlib.contextmanager
def _replays_into(found: list[Any]) -> Iterator[None]:
    from crewai.events.event_bus import crewai_event_bus

    from ..events import IdempotencyReplayEvent  # imports crewai

    def seen(source: Any, event: Any) -> None:
        found.append(event)

    with crewai_event_bus.scoped_handlers():
        crewai_event_bus.register_handler(IdempotencyReplayEvent, seen)
        try:
            yield
        finally:
            crewai_event_bus.flush()


def _kickoff(check: Check, charge_card: Any, script: Script, backend: Any) -> Callable[[], Any]:
    from crewai import Agent, Crew, Task

    llm = script.model()
    reject = {"outputs": 0}

    def guardrail(output):  # type: ignore[no-untyped-def]  # crewai reads the annotation
        reject["outputs"] += 1
        if reject["outputs"] == 1:
            return False, "Rejected on purpose: redo the task."
        return True, output.raw

    agent_options: dict[str, Any] = {}
    if check.executor is not None:
        agent_options["executor_class"] = executors()[check.executor]

    def make_agent() -> Any:
        return Agent(
            role="Cashier",
            goal="Charge each invoice exactly once",
            backstory="Careful with money.",
            llm=llm,
            tools=[charge_card],
            max_retry_limit=2,
            allow_delegation=False,
            verbose=False,
            **agent_options,
        )

    if check.path == "agent":
        # A new agent per kickoff, as a new process would have: an agent remembers its
        # last action (crewai refuses to repeat it) across its own kickoffs.
        return lambda: make_agent().kickoff("Charge 5 for invoice inv-1.")
    agent = make_agent()

    def crew() -> Any:
        task = Task(
            description="Charge 5 for each invoice.",
            expected_output="The receipts.",
            agent=agent,
            guardrail=guardrail if check.source == "guardrail" else None,
            guardrail_max_retries=2,
        )
        options: dict[str, Any] = {"cache_backend": backend}  # taken by the integration
        return Crew(agents=[agent], tasks=[task], verbose=False, **options)

    if check.path == "async":
        return lambda: asyncio.run(crew().akickoff())
    if check.path == "flow":
        from crewai.flow.flow import Flow, start

        class PaymentFlow(Flow):
            @start()
            def pay(self) -> Any:
                return crew().kickoff()

        return lambda: PaymentFlow().kickoff()
    made = crew()
    return lambda: made.kickoff()


# -- all of them -----------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """crewai logs the scripted failures and uncertain outcomes; the report says them."""
    loggers = [logging.getLogger(n) for n in ("crewai", "crewai_idempotent", "LiteLLM")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def run_all(
    selected: list[Check] | None = None, each: Callable[[Result], None] | None = None
) -> list[Result]:
    """Every check (or those `selected`), `each(result)` called as each one finishes."""
    install()
    results = []
    with tempfile.TemporaryDirectory(prefix="crewai-idempotent-self-test-") as tmp, _quiet():
        for check in selected or checks():
            result = run_check(check, Path(tmp))
            results.append(result)
            if each is not None:
                each(result)
    return results


# -- the child's end of the line protocol -----------------------------------------------


def main() -> int:
    warnings.simplefilter("ignore")  # the untested-release warning: the report says it
    import crewai

    selected = checks()
    plan = {"crewai": str(crewai.__version__), "checks": [c.label for c in selected]}
    print(MARK + json.dumps(plan), flush=True)
    failed = 0
    for result in run_all(selected, each=_report):
        failed += not result.passed
    return 1 if failed else 0


def _report(result: Result) -> None:
    record = {
        "check": result.check.label,
        "passed": result.passed,
        "detail": result.detail,
        "seconds": round(result.seconds, 3),
    }
    print(MARK + json.dumps(record), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
