"""Which ledger and which options a guarded call uses.

Each option is taken from the first place that sets it: the tool, then the crew
(`Crew(idempotency=...)` / `Crew(cache_backend=...)`), then `configure()`, then (for the
backend) `CREWAI_IDEMPOTENCY_URL`, then the embedded default, a SQLite ledger in
crewai's storage folder. Nothing here imports crewai at module level.

A ledger setting that cannot work (a malformed URL, an unknown scheme or option, a path
that cannot hold a ledger) raises `LedgerConfigurationError` where it is given:
`IdempotencyConfig(...)`, `configure()`, `Crew(...)`. `CREWAI_IDEMPOTENCY_URL` is read at
`Crew(...)` and at the first guarded call; a bad value stops the kickoff there, as an
uncertain outcome does, instead of becoming a tool error the model reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, cast, get_args

from .._backend import CacheBackend
from .._errors import LedgerConfigurationError, LedgerUnavailable
from .._keys import fingerprint as _fingerprint
from .._ledger import Ledger, StalePolicy
from .._policy import check_seconds

if TYPE_CHECKING:
    from .._reconcile import Verdict

log = logging.getLogger("crewai_idempotent")

URL_ENV = "CREWAI_IDEMPOTENCY_URL"
DEFAULT_LEDGER_NAME = "crewai_idempotent.db"

OnUncertain = Literal["raise", "report"]
KeySpec = str | Callable[[dict[str, Any], Any], str]
Reconciler = Callable[[str, Any], "Verdict | Any"]
Fingerprinter = Callable[[dict[str, Any]], Any]

_ON_UNCERTAIN = ("raise", "report")
_ON_STALE = get_args(StalePolicy)


def _check_seconds(name: str, value: Any, *, positive: bool = False) -> None:
    if value is not None:  # None: the ledger's own setting
        check_seconds(name, value, positive=positive)


def _check_key_spec(name: str, value: Any) -> None:
    if value is None or isinstance(value, str) or callable(value):
        return
    raise TypeError(
        f"{name} must be a format template (str) or a callable (args, ctx) -> str, "
        f"not {type(value).__name__}"
    )


def _check_on_stale(value: Any) -> None:
    if value is not None and value not in _ON_STALE:
        raise ValueError(f"on_stale must be one of {', '.join(_ON_STALE)}, not {value!r}")


@dataclass(frozen=True)
class IdempotencyConfig:
    """Settings for the guard, given to a crew (`Crew(idempotency=...)`) or the process
    (`configure(...)`). A field left at None defers to the next level.

    - `backend`: a `CacheBackend`, or a ledger URL (`sqlite:///relative.db`,
      `sqlite:////abs/path.db`, `file:///abs/dir`, ...). A URL is opened here, so a bad
      one raises `LedgerConfigurationError` (or `LedgerUnavailable`) at once.
    - `on_uncertain`: "raise" (default) stops the kickoff with `OutcomeUncertain`;
      "report" hands it to the agent as a tool error instead.
    - `idempotency_key`: the key template (or callable) for tools that set none.
    - `wait_s`, `lease_s`, `ttl`, `on_stale`: as on the tool and on `Ledger`.
    """

    backend: CacheBackend | str | None = None
    on_uncertain: OnUncertain | None = None
    idempotency_key: KeySpec | None = None
    wait_s: float | None = None
    lease_s: float | None = None
    ttl: float | None = None
    on_stale: StalePolicy | None = None
    # Approval gates and spend caps (see _gates.py and docs/approvals.md): by tool name.
    approval: Mapping[str, bool | Callable[[dict[str, Any], Any], bool]] | None = None
    spend: Mapping[str, Callable[[dict[str, Any]], Any]] | None = None
    caps: Any = None
    on_approval: Literal["raise", "report"] | None = None
    approval_wait_s: float | None = None

    def __post_init__(self) -> None:
        from ._gates import check_crew_options

        check_crew_options(self)
        if self.backend is not None and not isinstance(self.backend, CacheBackend | str):
            raise TypeError(
                "backend must be a crewai_idempotent CacheBackend or a ledger URL string, "
                f"not {type(self.backend).__name__}"
            )
        if isinstance(self.backend, str):
            _backend_from(self.backend)  # refused here, not at the first tool call
        if self.on_uncertain is not None and self.on_uncertain not in _ON_UNCERTAIN:
            raise ValueError(f"on_uncertain must be 'raise' or 'report', not {self.on_uncertain!r}")
        _check_key_spec("idempotency_key", self.idempotency_key)
        _check_seconds("wait_s", self.wait_s)
        _check_seconds("lease_s", self.lease_s, positive=True)
        _check_seconds("ttl", self.ttl, positive=True)
        _check_on_stale(self.on_stale)


@dataclass(frozen=True)
class ToolOptions:
    """What a tool says about itself: `idempotent=True` and its per-tool options."""

    idempotent: bool = True
    idempotency_key: KeySpec | None = None
    wait_s: float | None = None
    lease_s: float | None = None
    ttl: float | None = None
    reconcile: Reconciler | None = None
    on_stale: StalePolicy | None = None
    fingerprint: Fingerprinter | None = None
    # Approval gates and spend caps (see _gates.py and docs/approvals.md).
    approval: bool | Callable[[dict[str, Any], Any], bool] | None = None
    spend: Callable[[dict[str, Any]], Any] | None = None
    caps: Any = None
    on_approval: Literal["raise", "report"] | None = None
    approval_wait_s: float | None = None
    redact: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.idempotent, bool):
            raise TypeError(f"idempotent must be True or False, not {self.idempotent!r}")
        from ._gates import check_tool_options

        check_tool_options(self)
        _check_key_spec("idempotency_key", self.idempotency_key)
        _check_seconds("wait_s", self.wait_s)
        _check_seconds("lease_s", self.lease_s, positive=True)
        _check_seconds("ttl", self.ttl, positive=True)
        if self.reconcile is not None and not callable(self.reconcile):
            raise TypeError("reconcile must be a callable (key, args) -> Found | Absent | Unknown")
        _check_on_stale(self.on_stale)
        if self.fingerprint is not None and not callable(self.fingerprint):
            raise TypeError(
                "fingerprint must be a callable (args) -> JSON-able data, "
                f"not {type(self.fingerprint).__name__}"
            )

    def args_fingerprint(self, tool: str, arguments: dict[str, Any]) -> str:
        """The fingerprint of one call: the tool name and its arguments, or what the tool's
        `fingerprint` callable makes of them. TypeError when they cannot be fingerprinted."""
        data: Any = arguments
        if self.fingerprint is not None:
            try:
                data = self.fingerprint(dict(arguments))
            except Exception as exc:
                raise TypeError(
                    f"the fingerprint callable raised {type(exc).__name__}: {exc}"
                ) from exc
        return _fingerprint({"tool": tool, "args": data})

    @classmethod
    def from_kwargs(cls, where: str, given: Mapping[str, Any]) -> ToolOptions | None:
        """Options from keyword arguments; None when none of them was given.

        Any option implies `idempotent=True` unless `idempotent=False` is said, and
        options next to `idempotent=False` are refused rather than ignored.
        """
        known = {f.name for f in fields(cls)}
        if not given:
            return None
        unknown = set(given) - known
        if unknown:
            raise TypeError(f"{where}: unknown idempotency option(s) {sorted(unknown)}")
        if given.get("idempotent", True) is False:
            others = sorted(k for k, v in given.items() if k != "idempotent" and v is not None)
            if others:
                raise ValueError(
                    f"{where}: idempotent=False together with {others}; "
                    "drop those options or set idempotent=True"
                )
            return cls(idempotent=False)
        return cls(**{k: v for k, v in given.items() if v is not None or k == "idempotent"})


OPTION_NAMES = tuple(f.name for f in fields(ToolOptions))

_lock = threading.RLock()
_process_config: IdempotencyConfig | None = None
_url_backends: dict[str, CacheBackend] = {}
_default_backends: dict[str, CacheBackend] = {}


def configure(
    config: IdempotencyConfig | None = None, /, **settings: Any
) -> IdempotencyConfig | None:
    """Set the process-wide default (below tool and crew settings, above the environment).

    `configure(backend=..., on_uncertain=...)` or `configure(IdempotencyConfig(...))`;
    `configure(None)` clears it. Returns the previous setting.
    """
    global _process_config
    if config is not None and settings:
        raise TypeError("pass an IdempotencyConfig or keyword settings, not both")
    if config is not None and not isinstance(config, IdempotencyConfig):
        raise TypeError(f"configure() takes an IdempotencyConfig, not {type(config).__name__}")
    new = config if config is not None else (IdempotencyConfig(**settings) if settings else None)
    with _lock:
        previous, _process_config = _process_config, new
    return previous


def default_ledger_path() -> Path:
    """The embedded default: `crewai_idempotent.db` in crewai's storage folder."""
    from ._compat import db_storage_path

    return Path(db_storage_path()) / DEFAULT_LEDGER_NAME


_LEDGER_ATTR = "_crewai_idempotent_ledger"


def ledger_for(backend: CacheBackend) -> Ledger:
    """One Ledger per backend object, kept on the backend itself: it lives exactly as long
    as the backend (a crew's backend goes away with the crew) and shares its lease keeper
    across every call that uses it."""
    state = getattr(backend, "__dict__", None)
    if state is None:  # a backend with __slots__: a ledger per call still guards correctly
        return Ledger(backend)
    with _lock:
        ledger = state.get(_LEDGER_ATTR)
        if ledger is None:
            ledger = state[_LEDGER_ATTR] = Ledger(backend)
        return ledger


def _backend_from(value: CacheBackend | str) -> CacheBackend:
    if isinstance(value, CacheBackend):
        return value
    from ..backends._url import backend_from_url  # on first use: it pulls in nothing at activation

    with _lock:
        backend = _url_backends.get(value)
        if backend is None:
            backend = _url_backends[value] = backend_from_url(value)
        return backend


def _default_backend() -> CacheBackend:
    from ..backends.sqlite import SQLiteCacheBackend

    path = str(default_ledger_path())
    with _lock:
        backend = _default_backends.get(path)
        if backend is None:
            backend = _default_backends[path] = SQLiteCacheBackend(path)
        return backend


def env_backend() -> CacheBackend | None:
    """The ledger CREWAI_IDEMPOTENCY_URL names, or None if it is unset or blank.

    `LedgerConfigurationError` naming the variable if it cannot be used."""
    from ..backends._options import redact

    url = os.environ.get(URL_ENV, "").strip()
    if not url:
        return None
    try:
        return _backend_from(url)
    except (LedgerConfigurationError, LedgerUnavailable, ValueError, TypeError) as exc:
        raise LedgerConfigurationError(f"{URL_ENV}={redact(url)!r}: {exc}") from exc


def check_crew_ledger(crew: IdempotencyConfig | None) -> None:
    """At `Crew(...)`: when the crew's ledger will come from CREWAI_IDEMPOTENCY_URL, open
    it now, so that a bad value raises where the crew is built."""
    for config in (crew, _process_config):
        if config is not None and config.backend is not None:
            return
    env_backend()


def _stop(error: Exception) -> NoReturn:
    """Raise a configuration error past crewai: inside a kickoff, crewai would turn an
    Exception from a tool into text for the model; the guard's Halt carries it out to the
    kickoff instead, as it does an uncertain outcome."""
    from . import _guard

    if _guard._depth.get() > 0:
        raise cast(Any, _guard.Halt)(error)
    raise error


_announced: set[tuple[str, int]] = set()


def describe_default() -> str:
    path = default_ledger_path()
    return (
        f"{path} (the default: crewai's storage folder, named after the current directory "
        f"{path.parent.name!r} unless CREWAI_STORAGE_DIR is set; a crew started from another "
        f"directory uses another ledger. Set {URL_ENV} or configure(backend=...) to pin it)"
    )


def _announce(source: str, backend: CacheBackend) -> None:
    """Say once per ledger and source which ledger guarded calls use."""
    with _lock:
        mark = (source, id(backend))
        if mark in _announced:
            return
        _announced.add(mark)
    where = describe_default() if source == "default" else f"{backend!r} (from {source})"
    log.info("crewai-idempotent: guarded tool calls use the ledger %s", where)


@dataclass(frozen=True)
class Settings:
    """The options in force for one guarded call, and where the backend came from."""

    ledger: Ledger
    backend_source: str
    idempotency_key: KeySpec | None
    wait_s: float | None
    lease_s: float | None
    ttl: float | None
    reconcile: Reconciler | None
    on_stale: StalePolicy | None
    on_uncertain: OnUncertain

    def ledger_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "wait_s": self.wait_s,
            "lease_s": self.lease_s,
            "reconcile": self.reconcile,
            "on_stale": self.on_stale,
        }
        if self.ttl is not None:  # unset: the ledger's own default applies
            options["ttl"] = self.ttl
        return options


def resolve(tool: ToolOptions, crew: IdempotencyConfig | None) -> Settings:
    """Merge tool > crew > configure() > environment > default."""
    levels = [(label, c) for label, c in (("crew", crew), ("configure()", _process_config)) if c]

    def pick(name: str) -> Any:
        value = getattr(tool, name, None)
        if value is not None:
            return value
        for _, config in levels:
            value = getattr(config, name)
            if value is not None:
                return value
        return None

    backend: CacheBackend | None = None
    source = ""
    try:
        for label, config in levels:
            if config.backend is not None:
                backend, source = _backend_from(config.backend), label
                break
        if backend is None:
            backend, source = env_backend(), URL_ENV
        if backend is None:
            try:
                backend, source = _default_backend(), "default"
            except LedgerUnavailable as exc:
                raise LedgerConfigurationError(
                    f"the default ledger cannot be used: {exc}. Set {URL_ENV} or "
                    "configure(backend=...)"
                ) from exc
    except LedgerConfigurationError as exc:
        _stop(exc)
    _announce(source, backend)
    ttl = pick("ttl")
    return Settings(
        ledger=ledger_for(backend),
        backend_source=source,
        idempotency_key=pick("idempotency_key"),
        wait_s=pick("wait_s"),
        lease_s=pick("lease_s"),
        ttl=ttl,
        reconcile=tool.reconcile,
        on_stale=pick("on_stale"),
        on_uncertain=pick("on_uncertain") or "raise",
    )


def merge_crew_settings(
    idempotency: Any, cache_backend: Any, where: str = "Crew"
) -> IdempotencyConfig | None:
    """`Crew(idempotency=..., cache_backend=...)` as one config; conflicting values refused."""
    if idempotency is None and cache_backend is None:
        return None
    if idempotency is not None and not isinstance(idempotency, IdempotencyConfig):
        if isinstance(idempotency, Mapping):
            idempotency = IdempotencyConfig(**idempotency)
        else:
            raise TypeError(
                f"{where}(idempotency=...) takes a crewai_idempotent.IdempotencyConfig, "
                f"not {type(idempotency).__name__}"
            )
    if cache_backend is None:
        return idempotency
    if not isinstance(cache_backend, CacheBackend | str):
        raise TypeError(
            f"{where}(cache_backend=...) takes a crewai_idempotent CacheBackend or a ledger URL, "
            f"not {type(cache_backend).__name__}"
        )
    if idempotency is None:
        return IdempotencyConfig(backend=cache_backend)
    if idempotency.backend is not None and idempotency.backend is not cache_backend:
        raise ValueError(
            f"{where}: cache_backend= and idempotency=IdempotencyConfig(backend=...) name two "
            "different ledgers; give one"
        )
    return replace(idempotency, backend=cache_backend)


def reset_for_tests() -> None:
    """Forget the process default and the cached ledgers (their backends are closed)."""
    global _process_config
    with _lock:
        _process_config = None
        for backend in list(_url_backends.values()) + list(_default_backends.values()):
            with contextlib.suppress(Exception):  # closing is best effort here
                backend.close()
        _url_backends.clear()
        _default_backends.clear()
        _announced.clear()
