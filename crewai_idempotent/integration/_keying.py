"""Deriving a tool call's idempotency key from its arguments and where it runs."""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidIdempotencyKey
from .._keys import validate_key

# Template fields that name where the call runs rather than one of its arguments.
CONTEXT_FIELDS = ("tool", "crew", "task", "kickoff", "fingerprint")


@dataclass(frozen=True, slots=True)
class KeyContext:
    """Where a guarded call runs; the second argument of a callable `idempotency_key`.

    - `tool`: the tool's name as the model calls it.
    - `crew`: crewai's crew key (a hash of its agents and tasks; the same in every
      process), or None outside a crew.
    - `task`: the task key: a hash of the task's description and expected output after
      inputs are interpolated (crewai's `task.key` when there are no inputs); None
      outside a task.
    - `kickoff`: crewai's execution id, new for every kickoff; None outside one.
    - `fingerprint`: SHA-256 of the tool name and all its validated arguments.
    """

    tool: str
    crew: str | None
    task: str | None
    kickoff: str | None
    fingerprint: str

    def field(self, name: str) -> str:
        value = getattr(self, name)
        if value is None:
            where = {"crew": "a crew", "task": "a task", "kickoff": "a kickoff"}[name]
            raise InvalidIdempotencyKey(
                f"tool {self.tool!r}: its idempotency key uses {{{name}}}, but this call "
                f"does not run inside {where} (a direct call?); nothing was run"
            )
        return str(value)


def template_fields(template: str) -> list[str]:
    """The root names a format template refers to: "{order.id}:{amount:.2f}" -> order, amount."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"bad idempotency key template {template!r}: {exc}") from None
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = name.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(
                f"idempotency key template {template!r} uses a positional field; "
                "name the arguments: '{order_id}'"
            )
        names.append(root)
    return names


def check_template(template: str, tool: str, arguments: Iterable[str] | None) -> None:
    """Refuse, when the tool is flagged, a template that can never format."""
    try:
        names = template_fields(template)
    except ValueError as exc:
        raise ValueError(f"tool {tool!r}: {exc}") from None
    if arguments is None:  # the tool takes **kwargs: its argument names are not known
        return
    known = set(arguments)
    for name in names:
        if name in known and name in CONTEXT_FIELDS:
            raise ValueError(
                f"tool {tool!r}: key template field {{{name}}} is ambiguous: the tool has an "
                f"argument called {name!r} and {{{name}}} is also a context field"
            )
        if name not in known and name not in CONTEXT_FIELDS:
            raise ValueError(
                f"tool {tool!r}: key template {template!r} uses {{{name}}}, which is neither an "
                f"argument ({', '.join(sorted(known)) or 'none'}) nor one of "
                f"{', '.join('{' + f + '}' for f in CONTEXT_FIELDS)}"
            )


class _Fields(Mapping[str, Any]):
    """Arguments first, then context fields, looked up only when the template uses them."""

    def __init__(self, args: Mapping[str, Any], ctx: KeyContext) -> None:
        self._args, self._ctx = args, ctx

    def __getitem__(self, name: str) -> Any:
        if name in self._args:
            return self._args[name]
        if name in CONTEXT_FIELDS:
            return self._ctx.field(name)
        raise KeyError(name)

    def __iter__(self) -> Any:
        return iter(self._args)

    def __len__(self) -> int:
        return len(self._args)


def derive_key(spec: Any, args: Mapping[str, Any], ctx: KeyContext) -> str:
    """The key for one call: from a template, a callable, or the default."""
    if spec is None:
        return validate_key(f"{ctx.tool}:{ctx.fingerprint}")
    if isinstance(spec, str):
        try:
            key = string.Formatter().vformat(spec, (), _Fields(args, ctx))
        except InvalidIdempotencyKey:
            raise
        except (KeyError, AttributeError, IndexError, ValueError, TypeError) as exc:
            raise InvalidIdempotencyKey(
                f"tool {ctx.tool!r}: cannot format idempotency key template {spec!r} "
                f"({type(exc).__name__}: {exc}); nothing was run"
            ) from exc
        return _checked(key, ctx)
    try:
        key = spec(dict(args), ctx)
    except InvalidIdempotencyKey:
        raise
    except Exception as exc:
        raise InvalidIdempotencyKey(
            f"tool {ctx.tool!r}: the idempotency_key callable raised {type(exc).__name__}: "
            f"{exc}; nothing was run"
        ) from exc
    return _checked(key, ctx)


def _checked(key: Any, ctx: KeyContext) -> str:
    try:
        return validate_key(key)
    except InvalidIdempotencyKey as exc:
        raise InvalidIdempotencyKey(f"tool {ctx.tool!r}: {exc}; nothing was run") from None
