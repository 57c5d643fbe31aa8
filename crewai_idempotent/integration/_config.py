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

Every option is checked here where it is given (approval gates and spend caps included).
What a call uses is resolved once per tool, crew and `configure()` (`settings_for`) and
reused by every later call until one of them, or the environment it read, changes;
`_ledgers` opens and keeps the ledgers, `_gates` turns the gate options into a call's gates.
"""

from __future__ import annotations

import difflib
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from .._errors import LedgerConfigurationError, LedgerUnavailable, SigningConfigurationError
from ..gates._spend import SpendCap
from ..ledger._backend import CacheBackend
from ..ledger._keys import fingerprint as _fingerprint
from ..ledger._ledger import Ledger
from ..ledger._policy import StalePolicy, _Options, check_seconds
from ..ledger._reconcile import named
from . import _signing
from ._gates import GateRules
from ._ledgers import (
    URL_ENV,
    announce,
    backend_from,
    check_reachable,
    default_backend,
    env_backend,
    ledger_for,
    reachability_checked,
)

if TYPE_CHECKING:
    from ..ledger._reconcile import Verdict

OnUncertain = Literal["raise", "report"]
KeySpec = str | Callable[[dict[str, Any], Any], str]
Reconciler = Callable[[str, Any], "Verdict | Any"]
Fingerprinter = Callable[[dict[str, Any]], Any]

NOTIFY_ENV = "CREWAI_IDEMPOTENCY_NOTIFY"  # as notifications._channels.ENV, not loaded here
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


def _check_approvers(where: str, value: Any) -> None:
    if value is None or callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(
            f"{where}: approvers must be a whole number of distinct approvers (1 or more) or "
            f"a callable (args, ctx) -> int, not {value!r}"
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
        raise ValueError(
            f"{where}: two caps share a name {labels} (SpendCap's name= tells them apart)"
        )
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
    _check_approvers(where, options.approvers)
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
    checks = {"approval": _check_approval, "spend": _check_spend, "approvers": _check_approvers}
    for field, check in checks.items():
        value = getattr(config, field)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise TypeError(f"{where}: {field} must map tool names to the option, not {value!r}")
        for name, option in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: {field} keys are tool names, not {name!r}")
            check(f"{where}.{field}[{name!r}]", option)
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
    - `check_reachable`: whether a PostgreSQL or Redis `backend` must answer here, within
      its connect timeout (`LedgerUnavailable` if not). None: yes, unless
      CREWAI_IDEMPOTENCY_CHECK_REACHABLE=0; False for a process that starts before its
      server (the first guarded call reports an unreachable one then).
    - `notify`: notification channels (URLs such as `webhook+https://...#secret_env=...`,
      `slack+https://hooks.slack.com/...`, or `Channel` objects): this process delivers
      its ledger's outbox to them (docs/notifications.md); checked here. None defers to
      the next level, then to CREWAI_IDEMPOTENCY_NOTIFY.
    - `approval`, `approvers`, `spend`, `caps`, `on_approval`, `approval_wait_s`: the
      approval gates (and how many distinct approvers each needs) and spend caps, by
      tool name (see the `integration/_gates` docstring and
      docs/approvals.md).
    - `trusted_keys`: the keys approvals, denials and resolutions must be signed with
      before the guard obeys them: a trusted keys file's path, its lines, or
      `signing.TrustedKeys` (read and checked here). None defers to
      CREWAI_IDEMPOTENCY_TRUSTED_KEYS; with neither, decisions are unsigned
      (docs/security.md). A process setting: `configure()` only, never a crew's.
    - `accept_unsigned_grants_until`: with trusted keys, approvals made without a
      signature (before signing was turned on) still count until this time (an aware
      `datetime`, ISO 8601 text with its offset, or seconds since the epoch); after it
      they are refused. None defers to
      CREWAI_IDEMPOTENCY_ACCEPT_UNSIGNED_GRANTS_UNTIL; by default they are refused.

    Raises `TypeError` for a `backend` that is neither a `CacheBackend` nor a URL (or
    `trusted_keys` that are no path, lines or `TrustedKeys`),
    `SigningConfigurationError` for trusted keys that do not pass (a file that does not
    parse, another user could change, or names an unknown algorithm) or a malformed
    time, `LedgerConfigurationError` for a setting that cannot be used (a misspelt name in a
    dict, a bad URL or option, a value of the wrong kind) and `LedgerUnavailable` for a
    server that does not answer; nothing runs.
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
    check_reachable: bool | None = None
    notify: Any = None
    approvers: Mapping[str, int | Callable[[dict[str, Any], Any], int]] | None = None
    trusted_keys: Any = None
    accept_unsigned_grants_until: Any = None

    def __post_init__(self) -> None:
        _check_crew_gates(self)
        object.__setattr__(
            self, "trusted_keys", _signing.load_trusted(self.trusted_keys, "IdempotencyConfig")
        )
        until = _signing.parse_until(self.accept_unsigned_grants_until, "IdempotencyConfig")
        object.__setattr__(self, "accept_unsigned_grants_until", until)
        if self.notify is not None:
            from ..notifications._channels import channels_from

            object.__setattr__(self, "notify", channels_from(self.notify, "notify"))
        if self.backend is not None and not isinstance(self.backend, CacheBackend | str):
            raise TypeError(
                "backend must be a crewai_idempotent CacheBackend or a ledger URL string, "
                f"not {type(self.backend).__name__}"
            )
        if self.check_reachable is not None and not isinstance(self.check_reachable, bool):
            raise TypeError(f"check_reachable must be True or False, not {self.check_reachable!r}")
        if self.backend is not None:
            # A URL is opened here, not at the first tool call; a server must answer now.
            backend = backend_from(self.backend)
            if reachability_checked(self.check_reachable):
                check_reachable(backend)
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
    # A callable, or its import path ("myapp.payments:find_charge"), which a sweeper in
    # another process can find by.
    reconcile: Reconciler | str | None = None
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
    approvers: int | Callable[[dict[str, Any], Any], int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.idempotent, bool):
            raise TypeError(f"idempotent must be True or False, not {self.idempotent!r}")
        # What calls of this tool resolved (`settings_for`); not a field, never copied.
        object.__setattr__(self, "_resolved", _Resolved())
        _check_tool_gates(self)
        _check_key_spec("idempotency_key", self.idempotency_key)
        _check_seconds("wait_s", self.wait_s)
        _check_seconds("lease_s", self.lease_s, positive=True)
        _check_seconds("ttl", self.ttl, positive=True)
        if isinstance(self.reconcile, str):
            object.__setattr__(self, "reconcile", named(self.reconcile))
        elif self.reconcile is not None and not callable(self.reconcile):
            raise TypeError(
                "reconcile must be a callable (key, args) -> Found | Absent | Unknown, or its "
                "import path ('package.module:function')"
            )
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
                    f"{where}: idempotent=False together with {others}, which apply only to "
                    "a tool guarded with idempotent=True"
                )
            return cls(idempotent=False)
        return cls(**{k: v for k, v in given.items() if v is not None or k == "idempotent"})


OPTION_NAMES = tuple(f.name for f in fields(ToolOptions))

_lock = threading.RLock()
_process_config: IdempotencyConfig | None = None
_generation = 0  # grows whenever resolved settings may be out of date


def configure(
    config: IdempotencyConfig | None = None, /, **settings: Any
) -> IdempotencyConfig | None:
    """Set the process-wide default (below tool and crew settings, above the environment).

    `configure(backend=..., on_uncertain=...)` or `configure(IdempotencyConfig(...))`:
    `config` is an `IdempotencyConfig`, `settings` its fields by name; `configure(None)`
    clears it. Returns the previous setting. `configure(trusted_keys=...)` turns signed
    decisions on for the process; without it, CREWAI_IDEMPOTENCY_TRUSTED_KEYS is read
    here too, so that a file named there that does not pass is refused here.

    Raises `TypeError` for both or for something that is not an `IdempotencyConfig`,
    `LedgerConfigurationError` for a misspelt setting (naming the close match) or one
    that cannot be used, `SigningConfigurationError` (one of them) for trusted keys,
    in the setting or the environment, that do not pass, `LedgerUnavailable` for a
    server that does not answer.
    """
    global _process_config
    if config is not None and settings:
        raise TypeError("configure() takes an IdempotencyConfig or keyword settings, not both")
    if config is not None and not isinstance(config, IdempotencyConfig):
        raise TypeError(f"configure() takes an IdempotencyConfig, not {type(config).__name__}")
    new = config if config is not None else (config_from("configure()", settings) or None)
    if new is not None:
        _signing_of(new)  # the environment's trusted keys, checked here too
    with _lock:
        previous, _process_config = _process_config, new
        forget_settings()
    return previous


SETTING_NAMES = tuple(f.name for f in fields(IdempotencyConfig))


def config_from(where: str, settings: Mapping[Any, Any]) -> IdempotencyConfig | None:
    """An IdempotencyConfig from keyword settings (`configure(...)`, `Crew(idempotency={...})`);
    a name that is not a setting is a `LedgerConfigurationError` naming the closest one,
    never Python's bare "unexpected keyword argument"."""
    if not settings:
        return None
    for name in settings:
        if not isinstance(name, str):
            raise TypeError(f"{where}: setting names are strings, not {name!r}")
    unknown = [name for name in settings if name not in SETTING_NAMES]
    if unknown:
        described = []
        for name in unknown:
            close = difflib.get_close_matches(name, SETTING_NAMES, n=1)
            described.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise LedgerConfigurationError(
            f"{where}: unknown setting {', '.join(described)}; the settings are "
            f"{', '.join(SETTING_NAMES)}"
        )
    return IdempotencyConfig(**settings)


def process_config() -> IdempotencyConfig | None:
    """What `configure()` set, if anything."""
    return _process_config


def forget_settings() -> None:
    """Make every tool resolve its settings again at its next call (after `configure()`,
    or after the ledgers opened so far were closed)."""
    global _generation
    _generation += 1


def _signing_of(config: IdempotencyConfig | None) -> _signing.Signing | None:
    """The signing settings in force under the process setting `config`."""
    if config is None:
        return _signing.in_force(None, None)
    return _signing.in_force(config.trusted_keys, config.accept_unsigned_grants_until)


def check_crew_ledger(crew: IdempotencyConfig | None) -> None:
    """At `Crew(...)`: when the crew's ledger will come from CREWAI_IDEMPOTENCY_URL, open
    it now, so that a bad value raises where the crew is built; the same for the trusted
    keys CREWAI_IDEMPOTENCY_TRUSTED_KEYS names."""
    _signing_of(_process_config)
    for config in (crew, _process_config):
        if config is not None and config.backend is not None:
            return
    backend = env_backend()
    if backend is not None and reachability_checked(None):
        check_reachable(backend, URL_ENV)


@dataclass(frozen=True, slots=True)
class Settings:
    """What calls of one tool use under one crew and `configure()`: the ledger, the key
    template, the ledger's options (each call fills in its fingerprint and arguments) and
    the gate options, if any level sets one."""

    ledger: Ledger
    idempotency_key: KeySpec | None
    on_uncertain: OnUncertain
    options: _Options
    gates: GateRules | None
    signing: _signing.Signing | None = None


class _Resolved:
    """A tool's resolved settings, per crew config. Copying a tool (crewai deep-copies
    agents and their tools) or pickling it starts the copy empty: the entries hold open
    ledgers, which are not the copy's to share by accident of a shallow copy."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], _Entry] = {}

    def __deepcopy__(self, memo: Any) -> _Resolved:
        return _Resolved()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Resolved, ())


_MAX_ENTRIES = 32  # crews per tool kept at once; beyond that, older ones resolve again


@dataclass(frozen=True, slots=True)
class _Entry:
    settings: Settings
    crew: IdempotencyConfig | None
    generation: int
    source: str
    read: Any  # what the source's choice depended on in the environment, if anything
    signing_read: tuple[str, str]  # what the signing settings read in the environment

    def current(self, crew: IdempotencyConfig | None) -> bool:
        if self.crew is not crew or self.generation != _generation:
            return False
        if _signing.env_marks() != self.signing_read:
            return False
        if self.source == URL_ENV:
            return _env_url() == self.read
        if self.source == "default":
            return _default_place() == self.read
        return True


def _env_url() -> str:
    return os.environ.get(URL_ENV, "").strip()


def _default_place() -> tuple[Any, ...]:
    # What the default ledger's path is made of (crewai's storage folder): no URL in the
    # environment, the project folder (CREWAI_STORAGE_DIR, else the current directory's
    # name) and the user data folder's variables. Cheaper than asking crewai for the path,
    # which creates the folder on every call.
    env = os.environ
    return (
        _env_url(), env.get("CREWAI_STORAGE_DIR"), os.getcwd(), env.get("HOME"),
        env.get("XDG_DATA_HOME"), env.get("APPDATA"), env.get("LOCALAPPDATA"),
    )  # fmt: skip


def settings_for(tool_name: str, tool: ToolOptions, crew: IdempotencyConfig | None) -> Settings:
    """The settings a call of `tool` (named `tool_name`) uses under `crew`: resolved once,
    then reused while the tool, the crew, `configure()` and the environment the choice
    of ledger read stay the same.

    `LedgerConfigurationError` if the ledger that applies cannot be used (the guard
    carries it out to the kickoff); nothing is kept then, so the next call tries again."""
    cache: _Resolved = tool._resolved  # type: ignore[attr-defined]
    slot = (tool_name, id(crew))
    entry = cache.entries.get(slot)
    if entry is not None and entry.current(crew):
        return entry.settings
    generation = _generation
    signing_read = _signing.env_marks()
    settings, source, read = _resolve(tool_name, tool, crew)
    if len(cache.entries) >= _MAX_ENTRIES:
        cache.entries.clear()
    cache.entries[slot] = _Entry(settings, crew, generation, source, read, signing_read)
    return settings


def _resolve(
    tool_name: str, tool: ToolOptions, crew: IdempotencyConfig | None
) -> tuple[Settings, str, Any]:
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
    read: Any = None
    for label, config in levels:
        if config.backend is not None:
            backend, source = backend_from(config.backend), label
            break
    if backend is None:
        read = _env_url()
        backend, source = env_backend(), URL_ENV
    if backend is None:
        read = _default_place()
        try:
            backend, source = default_backend(), "default"
        except LedgerUnavailable as exc:
            raise LedgerConfigurationError(
                f"the default ledger cannot be used: {exc} ({URL_ENV} or configure(backend=...) "
                "names another)"
            ) from exc
    announce(source, backend)
    signed = _signing_of(_process_config)
    ledger = ledger_for(backend)
    _signing.apply(ledger, signed)
    _notifying(backend, [config for _, config in levels])
    options = ledger._call_options(
        pick("wait_s"),
        pick("lease_s"),
        pick("ttl"),
        tool.reconcile,
        pick("on_stale"),
        pick("reconcile_timeout_s"),
        tool=tool_name,
    )
    settings = Settings(
        ledger=ledger,
        idempotency_key=pick("idempotency_key"),
        on_uncertain=pick("on_uncertain") or "raise",
        options=options,
        gates=gate_rules(tool, [config for _, config in levels], tool_name, signed),
        signing=signed,
    )
    return settings, source, read


# -- the gate options of one tool, merged once -------------------------------------------


def _pick(name: str, tool: Any, levels: Sequence[Any]) -> Any:
    value = getattr(tool, name, None)
    if value is not None:
        return value
    for config in levels:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _by_tool(name: str, tool_name: str, levels: Sequence[Any]) -> Any:
    for config in levels:
        table = getattr(config, name, None)
        if table is not None and tool_name in table:
            return table[tool_name]
    return None


def gate_rules(
    options: ToolOptions,
    levels: Sequence[IdempotencyConfig],
    tool_name: str,
    signed: _signing.Signing | None = None,
) -> GateRules | None:
    """The gate options of `tool_name` merged over the tool, then the crew and
    `configure()` (`levels`, nearest first), or None when no level sets any gate;
    `signed`: the signing settings its approvals are checked with."""
    if (
        options.approval is None
        and options.spend is None
        and all(config.approval is None and config.spend is None for config in levels)
    ):
        return None  # the common case: no gate anywhere
    approval = options.approval
    if approval is None:
        approval = _by_tool("approval", tool_name, levels)
    spend = options.spend
    if spend is None:
        spend = _by_tool("spend", tool_name, levels)
    if not approval and spend is None:
        return None
    caps: list[tuple[str, SpendCap]] = [(tool_name, c) for c in options.caps or ()]
    for config in levels:
        caps += [("crew", c) for c in config.caps or ()]
        if config.caps:
            break  # the nearest level that sets caps
    wait_s = _pick("approval_wait_s", options, levels)
    approvers = options.approvers
    if approvers is None:
        approvers = _by_tool("approvers", tool_name, levels)
    return GateRules(
        tool=tool_name,
        approval=approval,
        spend=spend,
        caps=tuple(caps),
        on_approval=_pick("on_approval", options, levels) or "raise",
        approval_wait_s=float(wait_s or 0.0),
        redact=tuple(options.redact or ()),
        approvers=approvers,
        trusted_keys=None if signed is None else signed.trusted_keys,
        accept_unsigned_grants_until=None
        if signed is None
        else signed.accept_unsigned_grants_until,
    )


def _notifying(backend: CacheBackend, levels: list[IdempotencyConfig]) -> None:
    """A setting that names channels (the nearest level's `notify`, else
    CREWAI_IDEMPOTENCY_NOTIFY, read now) makes this process deliver the ledger's outbox."""
    channels = next((config.notify for config in levels if config.notify is not None), None)
    if channels is None:
        value = os.environ.get(NOTIFY_ENV, "").strip()
        if not value:
            return
        from ..notifications._channels import channels_from

        try:
            channels = channels_from(value, NOTIFY_ENV)
        except (ValueError, TypeError) as exc:
            raise LedgerConfigurationError(f"{NOTIFY_ENV}: {exc}") from exc
    if channels:
        from ..notifications import _inprocess

        _inprocess.ensure(backend, channels)


def merge_crew_settings(
    idempotency: Any, cache_backend: Any, where: str = "Crew"
) -> IdempotencyConfig | None:
    """`Crew(idempotency=..., cache_backend=...)` as one config; conflicting values refused."""
    if idempotency is None and cache_backend is None:
        return None
    if idempotency is not None and not isinstance(idempotency, IdempotencyConfig):
        if isinstance(idempotency, Mapping):
            # Documented: the settings as a dict (from YAML or JSON), checked by name as
            # configure()'s keywords are.
            idempotency = config_from(f"{where}(idempotency={{...}})", idempotency)
        else:
            raise TypeError(
                f"{where}(idempotency=...) takes a crewai_idempotent.IdempotencyConfig or "
                f"a dict of its settings, not {type(idempotency).__name__}"
            )
    if idempotency is not None:
        for name in ("trusted_keys", "accept_unsigned_grants_until"):
            if getattr(idempotency, name) is not None:
                raise SigningConfigurationError(
                    f"{where}(idempotency=...): {name} is the process's setting, not a "
                    f"crew's (one ledger serves every crew of a process): give it to "
                    f"configure(), or set ${_signing.TRUSTED_KEYS_ENV}"
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
            "different ledgers, and a crew has one"
        )
    return replace(idempotency, backend=cache_backend)
