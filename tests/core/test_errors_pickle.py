"""Every public error survives pickle: Celery and multiprocessing send exceptions that way."""

from __future__ import annotations

import multiprocessing
import pickle
import pickletools
from typing import Any

import pytest

import crewai_idempotent
from crewai_idempotent import Owner, Record, Status
from crewai_idempotent.integration import UnsupportedCrewAIVersion, UnverifiedCrewAIVersion

RECORD = Record(
    key="pay:1",
    status=Status.PENDING,
    fingerprint="f" * 64,
    token=2,
    revision=3,
    owner=Owner("host", 42, "abcdef012345"),
    attempts=1,
    created_at=1.0,
    updated_at=2.0,
)

# How to build each public error; a new public error without an entry fails the test.
EXAMPLES: dict[str, Any] = {
    "IdempotencyError": lambda cls: cls("base"),
    "InvalidIdempotencyKey": lambda cls: cls("blank key"),
    "IdempotencyKeyConflict": lambda cls: cls("pay:1", "a" * 64, "b" * 64),
    "OperationInProgress": lambda cls: cls("pay:1", RECORD, 2.5),
    "OutcomeUncertain": lambda cls: cls("pay:1", RECORD, "the provider timed out"),
    "LedgerUnavailable": lambda cls: cls("disk full"),
    "LedgerConfigurationError": lambda cls: cls("bad URL"),
    "ResolutionRefused": lambda cls: cls("COMMITTED"),
    "GuardInactive": lambda cls: cls("not installed"),
    "OutcomeUnknown": lambda cls: cls("maybe"),
    "BodyFailed": lambda cls: cls("pay:1", "FAILED", "card declined", RECORD),
    "ApprovalRequired": lambda cls: cls("pay:1", "ap_" + "0" * 20, "pay", "over 500 EUR"),
    "ApprovalDenied": lambda cls: cls("pay:1", "ap_" + "0" * 20, "ops", "not ours"),
    "SpendCapExceeded": lambda cls: cls("pay:1", "pay/kickoff-EUR/k", 60, "EUR", 200, 150, 0),
    "CorruptRecord": lambda cls: cls("the ledger file /srv/ledger.db", "KeyError('status')"),
}


def _public_errors() -> list[type[BaseException]]:
    found = {
        name: getattr(crewai_idempotent, name)
        for name in crewai_idempotent.__all__
        if isinstance(getattr(crewai_idempotent, name), type)
        and issubclass(getattr(crewai_idempotent, name), BaseException)
        and not issubclass(getattr(crewai_idempotent, name), Warning)
    }
    import crewai_idempotent._errors as errors

    for value in vars(errors).values():  # errors added to the module count too
        if (
            isinstance(value, type)
            and issubclass(value, BaseException)
            and value.__module__ == errors.__name__
        ):
            found.setdefault(value.__name__, value)
    return sorted(found.values(), key=lambda cls: cls.__name__)


def _build(cls: type[BaseException]) -> BaseException:
    maker = EXAMPLES.get(cls.__name__)
    if maker is not None:
        return maker(cls)  # type: ignore[no-any-return]
    # An error added since: try the shapes the others take, most specific first.
    for args in (("pay:1", RECORD, "reason"), ("pay:1", RECORD), ("message",)):
        try:
            return cls(*args)
        except TypeError:
            continue
    pytest.fail(f"add an example for {cls.__name__} to EXAMPLES")


def _same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b)
    assert a.args == b.args
    assert vars(a) == vars(b)


@pytest.mark.parametrize("cls", _public_errors(), ids=lambda cls: cls.__name__)
def test_every_public_error_pickles(cls: type[BaseException]) -> None:
    error = _build(cls)
    error.__notes__ = ["a note"]  # type: ignore[attr-defined]
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        _same(error, pickle.loads(pickle.dumps(error, protocol)))


@pytest.mark.parametrize("cls", _public_errors(), ids=lambda cls: cls.__name__)
def test_a_pickled_error_names_the_module_every_release_has(cls: type[BaseException]) -> None:
    # Workers of the previous release unpickle what this one sends (Celery results): a
    # pickle naming a module that release lacks (crewai_idempotent._error_base, where
    # the base error now lives) could not be read there.
    named = {
        arg
        for op, arg, _ in pickletools.genops(pickle.dumps(_build(cls), protocol=2))
        if op.name == "GLOBAL" and isinstance(arg, str) and arg.startswith("crewai_idempotent")
    }
    assert f"{cls.__module__} {cls.__name__}" in named
    assert {m.split(" ")[0] for m in named} <= {
        "crewai_idempotent._errors",
        "crewai_idempotent.ledger._record",  # the Record an error carries
    }


def test_unsupported_crewai_version_pickles() -> None:
    error = UnsupportedCrewAIVersion("crewai 2.0")
    _same(error, pickle.loads(pickle.dumps(error)))
    unverified = UnverifiedCrewAIVersion("crewai 1.15.31: its self-test is running", "running")
    copy = pickle.loads(pickle.dumps(unverified))
    _same(unverified, copy)
    assert copy.state == "running"


def _raise_conflict(_: int) -> None:
    raise crewai_idempotent.IdempotencyKeyConflict("pay:1", "a" * 64, "b" * 64)


def test_an_error_crosses_a_process_pool() -> None:
    with (
        multiprocessing.get_context("spawn").Pool(1) as pool,
        pytest.raises(crewai_idempotent.IdempotencyKeyConflict) as caught,
    ):
        pool.map(_raise_conflict, [1])
    assert caught.value.key == "pay:1" and caught.value.fingerprint == "b" * 64
