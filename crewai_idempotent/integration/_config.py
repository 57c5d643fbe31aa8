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

Every option is checked here where it is given (approval gates and spend caps included);
`_ledgers` opens and keeps the ledgers, `_gates` applies the gates at a call.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from .._backend import CacheBackend
from .._errors import LedgerConfigurationError, LedgerUnavailable
from .._keys import fingerprint as _fingerprint
from .._ledger import Ledger
from .._policy import StalePolicy, check_seconds
from .._spend import SpendCap
from ._ledgers import URL_ENV, announce, backend_from, default_backend, env_backend, ledger_for

if TYPE_CHECKING:
    from .._reconcile import Verdict

OnUncertain = Literal["raise", "report"]
KeySpec = str | Callable[[dict[str, Any], Any], str]
Reconciler = Callable[[str, Any], "Verdict | Any"]
Fingerprinter = Callable[[dict[str, Any]], Any]

_ON_UNCERTAIN = ("raise", "report")
_ON_APPROVAL = ("raise", "report")
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


# -- approval gates and spend caps (see _gates.py and docs/approvals.md) -----------------


def _check_approval(where: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool) and not callable(value):
        raise TypeError(
            f"{where}: approval must be True, False or a callable (args, ctx) -> bool, "
            f"not {type(value).__name__}"
        )


def _check_spend(where: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(
            f"{where}: spend must be a callable (args) -> Money, not {type(value).__name__}"
        )


def _check_caps(where: str, value: Any) -> tuple[SpendCap, ...] | None:
    if value is None:
        return None
    caps = (value,) if isinstance(value, SpendCap) else value
    if isinstance(caps, str | bytes) or not hasattr(caps, "__iter__"):
        raise TypeError(f"{where}: caps must be a SpendCap or a list of them, not {value!r}")
    caps = tuple(caps)
    for cap in caps:
        if not isinstance(cap, SpendCap):
            raise TypeError(f"{where}: caps must hold SpendCap objects, not {cap!r}")
    labels = [c.label for c in caps]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{where}: two caps share a name {labels}; give them name=...")
    return caps


def _check_approval_handling(where: str, on_approval: Any, wait_s: Any) -> None:
    if on_approval is not None and on_approval not in _ON_APPROVAL:
        raise ValueError(f"{where}: on_approval must be 'raise' or 'report', not {on_approval!r}")
    if wait_s is not None and (
        isinstance(wait_s, bool)
        or not isinstance(wait_s, int | float)
        or math.isnan(wait_s)
        or wait_s < 0
    ):
        raise ValueError(f"{where}: approval_wait_s must be 0 or more seconds, not {wait_s!r}")


def _check_tool_gates(options: ToolOptions) -> None:
    where = "tool options"
    _check_approval(where, options.approval)
    _check_spend(where, options.spend)
    caps = _check_caps(where, options.caps)
    if caps is not None:
        object.__setattr__(options, "caps", caps)
    _check_approval_handling(where, options.on_approval, options.approval_wait_s)
    redact = options.redact
    if redact is not None:
        if isinstance(redact, str) or not all(isinstance(n, str) for n in redact):
            raise TypeError(f"{where}: redact must be a list of argument names, not {redact!r}")
        object.__setattr__(options, "redact", tuple(redact))


def _check_crew_gates(config: IdempotencyConfig) -> None:
    where = "IdempotencyConfig"
    for field in ("approval", "spend"):
        value = getattr(config, field)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise TypeError(f"{where}: {field} must map tool names to the option, not {value!r}")
        for name, option in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: {field} keys are tool names, not {name!r}")
            (_check_approval if field == "approval" else _check_spend)(
                f"{where}.{field}[{name!r}]", option
            )
    caps = _check_caps(where, config.caps)
    if caps is not None:
        object.__setattr__(config, "caps", caps)
    _check_approval_handling(where, config.on_approval, config.approval_wait_s)


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
    - `wait_s`, `lease_s`, `ttl`, `on_stale`, `reconcile_timeout_s`: as on the tool and
      on `Ledger`.
    """

    backend: CacheBackend | str | None = None
    on_uncertain: OnUncertain | None = None
    idempotency_key: KeySpec | None = None
    wait_s: float | None = None
    lease_s: float | None = None
    ttl: float | None = None
    on_stale: StalePolicy | None = None
    reconcile_timeout_s: float | None = None
    # Approval gates and spend caps (checked below, used by _gates.py): by tool name.
    approval: Mapping[str, bool | Callable[[dict[str, Any], Any], bool]] | None = None
    spend: Mapping[str, Callable[[dict[str, Any]], Any]] | None = None
    caps: Any = None
    on_approval: Literal["raise", "report"] | None = None
    approval_wait_s: float | None = None

    def __post_init__(self) -> None:
        _check_crew_gates(self)
        if self.backend is not None and not isinstance(self.backend, CacheBackend | str):
            raise TypeError(
                "backend must be a crewai_idempotent CacheBackend or a ledger URL string, "
                f"not {type(self.backend).__name__}"
            )
        if isinstance(self.backend, str):
            backend_from(self.backend)  # refused here, not at the first tool call
        if self.on_uncertain is not None and self.on_uncertain not in _ON_UNCERTAIN:
            raise ValueError(f"on_uncertain must be 'raise' or 'report', not {self.on_uncertain!r}")
        _check_key_spec("idempotency_key", self.idempotency_key)
        _check_seconds("wait_s", self.wait_s)
        _check_seconds("lease_s", self.lease_s, positive=True)
        _check_seconds("ttl", self.ttl, positive=True)
        _check_on_stale(self.on_stale)
        _check_seconds("reconcile_timeout_s", self.reconcile_timeout_s, positive=True)


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
    reconcile_timeout_s: float | None = None
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
        _check_tool_gates(self)
        _check_key_spec("idempotency_key", self.idempotency_key)
        _check_seconds("wait_s", self.wait_s)
        _check_seconds("lease_s", self.lease_s, positive=True)
        _check_seconds("ttl", self.ttl, positive=True)
        if self.reconcile is not None and not callable(self.reconcile):
            raise TypeError("reconcile must be a callable (key, args) -> Found | Absent | Unknown")
        _check_on_stale(self.on_stale)
        _check_seconds("reconcile_timeout_s", self.reconcile_timeout_s, positive=True)
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


def process_config() -> IdempotencyConfig | None:
    """What `configure()` set, if anything."""
    return _process_config


def check_crew_ledger(crew: IdempotencyConfig | None) -> None:
    """At `Crew(...)`: when the crew's ledger will come from CREWAI_IDEMPOTENCY_URL, open
    it now, so that a bad value raises where the crew is built."""
    for config in (crew, _process_config):
        if config is not None and config.backend is not None:
            return
    env_backend()


@dataclass(frozen=True)
class Settings:
    """The options in force for one guarded call, and where the backend came from."""

    ledger: Ledger
    idempotency_key: KeySpec | None
    wait_s: float | None
    lease_s: float | None
    ttl: float | None
    reconcile: Reconciler | None
    on_stale: StalePolicy | None
    on_uncertain: OnUncertain
    reconcile_timeout_s: float | None = None

    def ledger_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "wait_s": self.wait_s,
            "lease_s": self.lease_s,
            "reconcile": self.reconcile,
            "on_stale": self.on_stale,
        }
        if self.ttl is not None:  # unset: the ledger's own default applies
            options["ttl"] = self.ttl
        if self.reconcile_timeout_s is not None:  # likewise
            options["reconcile_timeout_s"] = self.reconcile_timeout_s
        return options


def resolve(tool: ToolOptions, crew: IdempotencyConfig | None) -> Settings:
    """Merge tool > crew > configure() > environment > default.

    `LedgerConfigurationError` if the ledger that applies cannot be used (the guard
    carries it out to the kickoff)."""
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
    for label, config in levels:
        if config.backend is not None:
            backend, source = backend_from(config.backend), label
            break
    if backend is None:
        backend, source = env_backend(), URL_ENV
    if backend is None:
        try:
            backend, source = default_backend(), "default"
        except LedgerUnavailable as exc:
            raise LedgerConfigurationError(
                f"the default ledger cannot be used: {exc}. Set {URL_ENV} or configure(backend=...)"
            ) from exc
    announce(source, backend)
    ttl = pick("ttl")
    return Settings(
        ledger=ledger_for(backend),
        idempotency_key=pick("idempotency_key"),
        wait_s=pick("wait_s"),
        lease_s=pick("lease_s"),
        ttl=ttl,
        reconcile=tool.reconcile,
        on_stale=pick("on_stale"),
        on_uncertain=pick("on_uncertain") or "raise",
        reconcile_timeout_s=pick("reconcile_timeout_s"),
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
