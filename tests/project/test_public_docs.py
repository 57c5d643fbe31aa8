"""Every public callable says what each parameter is and what it raises.

Public: the functions and classes in `__all__` of the package, `backends` and
`integration`, the methods of the classes people call (the ledger, the stores, the gates'
operators) and the store protocol. Records, events and other data classes describe their
fields where they are declared; the stores' protocol methods say it once, on
`CacheBackend`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import crewai_idempotent
from crewai_idempotent import backends, console, integration, notifications, reconciliation

# Classes whose public methods are documented one by one.
OPERATED = ("Ledger", "Approvals", "SpendLedger", "CacheBackend")
# Data: fields, not parameters; each field is declared and commented in its class.
DATA = {
    "Absent", "ApprovalRequest", "ApprovalState", "Event", "Found", "KeyContext", "Money",
    "Order", "Outcome", "Owner", "Record", "SpendCap", "Status", "Unknown",
    "IdempotentTool",  # a crewai BaseTool: its fields are crewai's
    "Delivery", "Entry", "Pass",  # notifications
    "Alert", "Report", "Result",  # reconciliation
    "Account", "Role", "Section",  # console
}  # fmt: skip
# The stores' protocol methods, documented on CacheBackend.
PROTOCOL = {name for name in vars(crewai_idempotent.CacheBackend) if not name.startswith("_")}


def _public() -> Iterator[tuple[str, Callable[..., Any]]]:
    seen: set[int] = set()
    for module in (
        crewai_idempotent,
        backends,
        integration,
        notifications,
        reconciliation,
        console,
    ):
        prefix = (
            ""
            if module in (crewai_idempotent, backends, integration)
            else (module.__name__.rsplit(".", 1)[1] + ".")
        )
        for bare in module.__all__:
            value = getattr(module, bare)
            name = prefix + bare
            if id(value) in seen or bare in DATA:
                continue
            seen.add(id(value))
            if inspect.isclass(value):
                if issubclass(value, BaseException):
                    continue  # the errors: tests/core/test_errors_pickle.py
                yield name, value
                for method, fn in vars(value).items():
                    if method.startswith("_") or not inspect.isfunction(fn):
                        continue
                    if name in OPERATED or (method == "from_url"):
                        yield f"{name}.{method}", fn
                    elif method not in PROTOCOL and not method.endswith("fork_in_child"):
                        if method in ("before_fork", "after_fork_in_parent"):
                            continue  # the fork hooks: ledger/_fork's protocol
                        yield f"{name}.{method}", fn
            elif callable(value):
                yield name, value


def _parameters(name: str, fn: Callable[..., Any]) -> list[str]:
    if inspect.isclass(fn) and fn.__init__ is object.__init__:  # type: ignore[misc]
        return []  # an abstract base: nothing to construct
    if inspect.isclass(fn) and getattr(fn, "_is_protocol", False):
        return []  # a typing.Protocol: implemented, never constructed
    target = fn.__init__ if inspect.isclass(fn) else fn  # type: ignore[misc]
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [p for p in signature.parameters if p not in ("self", "cls")]


def _doc(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    if inspect.isclass(fn) and "__init__" in vars(fn):
        doc += "\n" + (inspect.getdoc(fn.__init__) or "")
    return doc


CASES = sorted(_public(), key=lambda case: case[0])


@pytest.mark.parametrize(("name", "fn"), CASES, ids=[name for name, _ in CASES])
def test_a_public_callable_names_its_parameters_and_what_it_raises(
    name: str, fn: Callable[..., Any]
) -> None:
    doc = _doc(fn)
    assert doc, f"{name} has no docstring"
    unnamed = [p for p in _parameters(name, fn) if f"`{p}" not in doc]
    assert not unnamed, f"{name}'s docstring does not name {unnamed}"
    assert "raise" in doc.lower(), f"{name}'s docstring does not say what it raises"


def test_the_list_is_not_empty() -> None:
    names = {name for name, _ in CASES}
    assert {"Ledger", "Ledger.execute", "SQLiteCacheBackend", "configure"} <= names
