"""A tool call's arguments, bound by name, and the idempotency key derived from them and
from where the call runs."""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidIdempotencyKey
from ..ledger._keys import validate_key
from ._call import KEY_PARAMETER, flow

_NO_DEFAULT: Any = inspect.Parameter.empty
_PLAIN_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class Target:
    """A callable the guard wraps: a Tool's function (`tool_name` known) or a class tool's
    `_run`/`_arun` (`method`: the first argument is the tool)."""

    __slots__ = ("_by_name", "_names", "method", "signature", "takes_key", "tool_name")

    def __init__(
        self, signature: inspect.Signature, method: bool, tool_name: str | None = None
    ) -> None:
        self.signature = signature
        self.method = method
        self.takes_key = KEY_PARAMETER in signature.parameters
        self.tool_name = tool_name
        params = list(signature.parameters.values())[1 if method else 0 :]
        # Every parameter can be given by name (crewai calls tools with keyword arguments
        # only): such a call binds by a dict lookup per parameter, not Signature.bind.
        plain = all(p.kind in _PLAIN_KINDS for p in params)
        self._by_name = (
            tuple((p.name, p.default) for p in params if p.name != KEY_PARAMETER) if plain else None
        )
        self._names = frozenset(p.name for p in params)

    @classmethod
    def of(cls, fn: Callable[..., Any], *, method: bool, tool_name: str | None = None) -> Target:
        return cls(inspect.signature(fn), method, tool_name)

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """All arguments by name, defaults applied, without the tool itself or the key.
        TypeError, as `Signature.bind` words it, for arguments the callable does not take."""
        by_name = self._by_name
        if by_name is not None and len(args) == self.method and kwargs.keys() <= self._names:
            found: dict[str, Any] = {}
            for name, default in by_name:
                if name in kwargs:
                    found[name] = kwargs[name]
                elif default is not _NO_DEFAULT:
                    found[name] = default
                else:
                    break  # missing: Signature.bind says so
            else:
                return found
        return self._bound(args, kwargs)

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.takes_key and KEY_PARAMETER not in kwargs:
            kwargs = {**kwargs, KEY_PARAMETER: None}
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        params = self.signature.parameters
        found: dict[str, Any] = {}
        for index, (name, value) in enumerate(bound.arguments.items()):
            if (self.method and index == 0) or name == KEY_PARAMETER:
                continue
            kind = params[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                found.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    found[name] = list(value)
            else:
                found[name] = value
        return found


def flow_id() -> str | None:
    """The id of the flow state the running flow method works on (`flow.state.id`: what
    `@persist` saves under and `kickoff(inputs={"id": ...})` resumes), or None outside a
    flow's method."""
    running = flow.get()
    if running is None:
        return None
    state_id = getattr(running, "flow_id", "")  # crewai: "" for a state without an id
    return str(state_id) if state_id else None


# Template fields that name where the call runs rather than one of its arguments.
CONTEXT_FIELDS = ("tool", "crew", "task", "kickoff", "fingerprint", "flow")


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
    - `flow`: the id of the crewAI Flow state the call's flow method works on
      (`flow.state.id`): the same on every resume of one flow
      (`kickoff(inputs={"id": ...})`, what `@persist` saves under), another for another
      flow; None outside a flow's method.
    """

    tool: str
    crew: str | None
    task: str | None
    kickoff: str | None
    fingerprint: str
    flow: str | None = None

    def field(self, name: str) -> str:
        value = getattr(self, name)
        if value is None:
            if name == "flow":
                raise InvalidIdempotencyKey(
                    f"tool {self.tool!r}: its idempotency key uses {{flow}}, the id of the "
                    "crewAI Flow state the call runs in, but this call does not run inside a "
                    "flow's method (a crew kicked off on its own, or a direct call?); "
                    "nothing was run"
                )
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
                f"idempotency key template {template!r} uses a positional field; its fields "
                "name the tool's arguments, as in '{order_id}'"
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
