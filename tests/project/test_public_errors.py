"""Every exception a public method raises is importable from `crewai_idempotent`.

Found mechanically, two ways: every exception or warning class defined anywhere in the
package (a new one is either exported or named below as one that never leaves the code
that raises it), and every exception class a public docstring names (`Raises ...`;
tests/project/test_public_docs.py requires each public callable to say what it raises).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import crewai_idempotent
from tests.project.test_public_docs import CASES, _doc

PACKAGE = Path(crewai_idempotent.__file__).parent

# Raised and caught inside the package; none reaches a caller of a public method.
INTERNAL = {
    "CacheUnusable": "the self-test's verdict cache: _verify and the doctor catch it",
    "ToolReportedFailure": "the guard records a ToolFailure as FAILED and returns it",
    "Halt": "carries an error through crewai; the kickoff raises the error it carries",
    "CheckFailed": "a self-test check's failure, reported by the doctor",
    "Unchanged": "a gate store's loop signal",
    "_NotPlain": "key rendering's signal",
    "_TooLarge": "the console's request-size guard, answered with HTTP 413",
    "SlackRefused": "a Slack request that fails its signature, answered with HTTP 401",
}


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # running it is its import
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _defined_exceptions() -> dict[str, type[BaseException]]:
    """Every exception and warning class the package's modules define, by name."""
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        path = PACKAGE.parent.joinpath(*name.split("."))
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        classes = [
            node.name
            for node in ast.walk(ast.parse(source.read_text()))
            if isinstance(node, ast.ClassDef)
        ]
        if not classes:
            continue
        module = importlib.import_module(name)
        for cls in classes:
            value = getattr(module, cls, None)
            if isinstance(value, type) and issubclass(value, BaseException):
                found[cls] = value
    return found


DEFINED = _defined_exceptions()


def test_every_exception_the_package_defines_is_exported_or_internal() -> None:
    missing = [
        name
        for name, cls in sorted(DEFINED.items())
        if name not in INTERNAL
        and (
            getattr(crewai_idempotent, name, None) is not cls
            or name not in crewai_idempotent.__all__
        )
    ]
    assert not missing, f"not importable from crewai_idempotent (or not in its __all__): {missing}"
    assert not set(INTERNAL) - set(DEFINED), "INTERNAL names a class the package no longer has"


def test_every_exception_a_public_docstring_names_is_exported() -> None:
    named: dict[str, set[str]] = {}
    for where, fn in CASES:
        for word in set(re.findall(r"\b[A-Z_]\w*\b", _doc(fn))):
            if word in DEFINED:
                named.setdefault(word, set()).add(where)
    assert {"ApprovalNotFound", "ApprovalAlreadyDecided", "LedgerUnavailable"} <= set(named)
    not_exported = {
        name: sorted(where)
        for name, where in named.items()
        if getattr(crewai_idempotent, name, None) is not DEFINED[name]
    }
    assert not not_exported, f"public docstrings say these are raised: {not_exported}"


def test_what_approvals_raise_is_caught_by_its_exported_name() -> None:
    from crewai_idempotent import ApprovalNotFound, Approvals, InMemoryCacheBackend

    approvals = Approvals(InMemoryCacheBackend())
    unknown = "ap_" + "0" * 20
    with pytest.raises(ApprovalNotFound):
        approvals.get(unknown)
    with pytest.raises(ApprovalNotFound):
        approvals.approve(unknown, by="ops")
