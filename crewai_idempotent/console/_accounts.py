"""The console's accounts: who may look, who may decide, who may also resolve and purge.

Accounts live in the ledger itself, as one document under the reserved prefix
(`crewai-idempotent/console/accounts`, see `_gatestore`): every console process on every
host that uses the ledger sees the same accounts, a role changed from the CLI applies at
the next request everywhere, and there is no second file to back up and protect. The
ledger is already the root of trust (whoever can write it can approve without any
console), so the accounts add no new secret to guard beyond it.

Passwords are kept only as Argon2id hashes (`argon2-cffi`, RFC 9106's low-memory
profile), rehashed at login when the parameters change. An account without a password
can only be used through a trusted auth proxy (its name is the proxy's identity). A
Slack user id links an account to Slack's button posts.

Changing a password, disabling or removing an account bumps its `generation`: every
session made before ends at its next request.

An approver's passkeys (`Passkey`: the trusted keys line the console made when it was
registered) are kept in the account too: they tell the console which credentials to ask
the browser for and let it check an assertion before recording it. They are a
convenience, never trusted: the workers check a signed decision against their own
trusted keys file only, so a passkey written into this document by anyone else signs
nothing the workers obey.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from .._errors import AccountError, SigningConfigurationError
from ..gates import _gatestore
from ..ledger._backend import CacheBackend
from ..signing._trusted import TrustedKeys

KEY = f"{_gatestore.PREFIX}console/accounts"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$")
_SLACK_ID = re.compile(r"^[UW][A-Z0-9]{2,31}$")
MIN_PASSWORD = 12
MAX_PASSKEYS = 20  # per account: a person's devices, not a key ring
MAX_LABEL = 100
_LABEL = re.compile(r"^[^\x00-\x1f\x7f]*$")


class Role(enum.StrEnum):
    """What an account may do; each role may do what the ones before it may."""

    VIEWER = "viewer"  # every page, no button
    APPROVER = "approver"  # approve and deny
    OPERATOR = "operator"  # and resolve uncertain records, and purge expired receipts

    def may(self, action: str) -> bool:
        """Whether this role may do `action`: "view", "decide", "resolve" or "purge". Raises
        `KeyError` for another action."""
        return _RANK[self] >= _RANK[_NEEDS[action]]


_RANK = {Role.VIEWER: 0, Role.APPROVER: 1, Role.OPERATOR: 2}
_NEEDS = {"view": Role.VIEWER, "decide": Role.APPROVER, "resolve": Role.OPERATOR,
          "purge": Role.OPERATOR}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Passkey:
    """One passkey registered by an account, as the accounts document keeps it."""

    credential: str  # its credential id, base64url (what the browser is asked for)
    key_id: str  # its key id (SHA256:...), what its signatures name
    line: str  # its trusted keys line, for the workers' trusted keys file
    label: str  # what its owner called it ("laptop", "YubiKey 5C")
    created_at: float  # when it was registered (store's clock)

    @classmethod
    def from_doc(cls, d: dict[str, Any]) -> Passkey:
        return cls(
            credential=d["credential"], key_id=d["key_id"], line=d["line"],
            label=d.get("label", ""), created_at=d["created_at"],
        )  # fmt: skip

    def to_doc(self) -> dict[str, Any]:
        return {"credential": self.credential, "key_id": self.key_id, "line": self.line,
                "label": self.label, "created_at": self.created_at}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Account:
    """One console account, as the accounts document keeps it."""

    name: str  # 1-128 letters, digits and . _ @ + -, starting with a letter or digit
    role: Role  # what it may do
    password_hash: str | None  # its Argon2id hash; None: usable through the auth proxy only
    slack_user: str | None  # the Slack user id linked to it, if any
    disabled: bool  # a disabled account cannot log in, and its sessions end
    generation: int  # bumped to end every session made before
    created_at: float  # when it was added (store's clock)
    updated_at: float  # when it last changed (store's clock)
    passkeys: tuple[Passkey, ...] = ()  # registered in the console, oldest first

    @classmethod
    def from_doc(cls, name: str, d: dict[str, Any]) -> Account:
        return cls(
            name=name, role=Role(d["role"]), password_hash=d.get("hash"),
            slack_user=d.get("slack"), disabled=bool(d.get("disabled")),
            generation=int(d.get("generation", 1)), created_at=d["created_at"],
            updated_at=d["updated_at"],
            passkeys=tuple(Passkey.from_doc(p) for p in d.get("passkeys", ())),
        )  # fmt: skip


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise AccountError(
            f"an account name is 1-128 letters, digits and . _ @ + - (starting with a letter "
            f"or digit), not {name!r}"
        )
    return name


def check_role(role: Any) -> Role:
    try:
        return Role(str(role).lower())
    except ValueError:
        names = ", ".join(r.value for r in Role)
        raise AccountError(f"a role is one of {names}, not {role!r}") from None


def check_slack_user(user: Any) -> str:
    if not isinstance(user, str) or not _SLACK_ID.match(user):
        raise AccountError(
            f"a Slack user id looks like U012AB3CDE (the member id in the user's Slack "
            f"profile, not the display name), not {user!r}"
        )
    return user


def check_label(label: Any) -> str:
    if not isinstance(label, str) or len(label) > MAX_LABEL or not _LABEL.match(label):
        raise AccountError(
            f"a passkey's label is text of at most {MAX_LABEL} characters on one line, not "
            f"{label!r:.120}"
        )
    return label.strip()


def check_password(name: str, password: str) -> None:
    if len(password) < MIN_PASSWORD:
        raise AccountError(f"a password needs at least {MIN_PASSWORD} characters")
    if password.strip().lower() == name.lower():
        raise AccountError("the password must not be the account's name")


def _hasher() -> Any:
    try:
        from argon2 import PasswordHasher
    except ImportError as exc:  # the console extra is not installed
        raise AccountError(
            "console accounts need argon2-cffi: pip install 'crewai-idempotent[console]'"
        ) from exc
    return PasswordHasher()


class Accounts:
    """The accounts document of `backend`: read whole, changed by compare-and-set.
    Making one raises nothing; every method raises `LedgerUnavailable` if the store
    cannot be read (or, for a change, written), and each says what else it raises."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend
        self._dummy: str | None = None

    def all(self) -> list[Account]:
        """Every account, by name. Raises `LedgerUnavailable` if the store cannot be
        read."""
        doc = _gatestore.read(self.backend, KEY) or {}
        found = doc.get("accounts", {})
        return sorted((Account.from_doc(n, d) for n, d in found.items()), key=lambda a: a.name)

    def get(self, name: str) -> Account | None:
        """The account `name`, or None. Raises `LedgerUnavailable` if the store cannot be
        read."""
        doc = _gatestore.read(self.backend, KEY) or {}
        entry = doc.get("accounts", {}).get(name)
        return None if entry is None else Account.from_doc(name, entry)

    def by_slack_user(self, user: str) -> Account | None:
        """The account linked to the Slack user id `user`, or None. Raises
        `LedgerUnavailable` if the store cannot be read."""
        return next((a for a in self.all() if a.slack_user == user), None)

    # -- changes (the CLI's `console users ...`) ------------------------------------

    def add(
        self, name: str, role: Role | str, password: str | None, slack_user: str | None = None
    ) -> Account:
        """A new account `name` with `role` (a `Role` or its name) and `password` (None:
        usable through the auth proxy only), linked to the Slack user id `slack_user` if
        given. Raises `AccountError` for a name, role, password (under 12 characters, or
        the name) or Slack id that will not do, a name already taken, a Slack user linked
        to another account, or a `password` without argon2-cffi to hash it; and
        `LedgerUnavailable` if the store cannot be read or written."""
        name, role = check_name(name), check_role(role)
        if password is not None:
            check_password(name, password)
        if slack_user is not None:
            check_slack_user(slack_user)
        hashed = _hasher().hash(password) if password is not None else None

        def change(entries: dict[str, Any], now: float) -> None:
            if name in entries:
                raise AccountError(f"there is already an account {name!r}")
            _slack_free(entries, slack_user, name)
            entries[name] = {"role": role.value, "hash": hashed, "slack": slack_user,
                             "disabled": False, "generation": 1, "created_at": now,
                             "updated_at": now}  # fmt: skip

        self._change(change)
        return self._must(name)

    def set(
        self,
        name: str,
        *,
        role: Role | str | None = None,
        slack_user: str | bool | None = False,
        disabled: bool | None = None,
    ) -> Account:
        """Change the account `name`. `role`: a new role (None: as it is); `slack_user`:
        an id, None to unlink it, False to leave it; `disabled`: True to disable it, False
        to enable it (a change ends its sessions), None to leave it. Raises `AccountError`
        for a name, role or Slack id that will not do, no such account, or a Slack user
        linked to another account; and `LedgerUnavailable` if the store cannot be read or
        written."""
        check_name(name)
        new_role = check_role(role) if role is not None else None
        if isinstance(slack_user, str):
            check_slack_user(slack_user)

        def change(entries: dict[str, Any], now: float) -> None:
            entry = _existing(entries, name)
            if new_role is not None:
                entry["role"] = new_role.value
            if slack_user is not False:
                _slack_free(entries, slack_user if isinstance(slack_user, str) else None, name)
                entry["slack"] = slack_user
            if disabled is not None and bool(entry.get("disabled")) != disabled:
                entry["disabled"] = disabled
                entry["generation"] = int(entry.get("generation", 1)) + 1
            entry["updated_at"] = now

        self._change(change)
        return self._must(name)

    def set_password(self, name: str, password: str | None) -> Account:
        """A new `password` for the account `name` (None: none, the account is for the
        auth proxy only); every session of the account ends. Raises `AccountError` for a
        name or password that will not do, no such account, or a `password` without
        argon2-cffi to hash it; and `LedgerUnavailable` if the store cannot be read or
        written."""
        check_name(name)
        if password is not None:
            check_password(name, password)
        hashed = _hasher().hash(password) if password is not None else None

        def change(entries: dict[str, Any], now: float) -> None:
            entry = _existing(entries, name)
            entry.update(hash=hashed, updated_at=now)
            entry["generation"] = int(entry.get("generation", 1)) + 1

        self._change(change)
        return self._must(name)

    def end_sessions(self, name: str) -> Account:
        """Every session of the account `name` ends at its next request. Raises
        `AccountError` for a name that will not do or no such account, and
        `LedgerUnavailable` if the store cannot be read or written."""

        def change(entries: dict[str, Any], now: float) -> None:
            entry = _existing(entries, check_name(name))
            entry["generation"] = int(entry.get("generation", 1)) + 1
            entry["updated_at"] = now

        self._change(change)
        return self._must(name)

    def remove(self, name: str) -> None:
        """Delete the account `name`; its sessions end at their next request. Raises
        `AccountError` for a name that will not do or no such account, and
        `LedgerUnavailable` if the store cannot be read or written."""

        def change(entries: dict[str, Any], now: float) -> None:
            _existing(entries, check_name(name))
            del entries[name]

        self._change(change)

    # -- passkeys (the console's Passkeys page) ----------------------------------------

    def add_passkey(self, name: str, line: str, label: str = "") -> Passkey:
        """Keep the passkey whose trusted keys line is `line` (made by
        `signing.passkey_line` when it was registered) for the account `name`, called
        `label`. Raises `AccountError` for a name or label that will not do, no such
        account, a line that does not read or is not a passkey's of `name` (its identity
        is the account's name), a passkey registered already (to any account), or more
        than 20; and `LedgerUnavailable` if the store cannot be read or written."""
        check_name(name)
        label = check_label(label)
        try:
            (key,) = TrustedKeys.from_lines([line], f"the passkey line for {name!r}")
        except (SigningConfigurationError, ValueError) as exc:
            raise AccountError(f"not a passkey's trusted keys line: {exc}") from None
        if key.algorithm != "webauthn" or key.identity != name:
            raise AccountError(
                f"the line is a {key.algorithm} key of {key.identity!r}: an account keeps "
                f"only passkeys whose identity is its name ({name!r})"
            )
        credential = key.options["credential"]

        def change(entries: dict[str, Any], now: float) -> None:
            entry = _existing(entries, name)
            for other, held in entries.items():
                for known in held.get("passkeys", ()):
                    if known["credential"] == credential or known["key_id"] == key.key_id:
                        raise AccountError(
                            f"this passkey is registered already (to {other!r}, "
                            f"{known.get('label') or known['key_id']})"
                        )
            kept = list(entry.get("passkeys", ()))
            if len(kept) >= MAX_PASSKEYS:
                raise AccountError(
                    f"{name!r} has {len(kept)} passkeys, the most an account keeps: remove one"
                )
            made = Passkey(credential, key.key_id, key.line(), label, now)
            entry["passkeys"] = [*kept, made.to_doc()]
            entry["updated_at"] = now

        self._change(change)
        return next(p for p in self._must(name).passkeys if p.credential == credential)

    def remove_passkey(self, name: str, key_id: str) -> Passkey:
        """Forget the passkey `key_id` (SHA256:...) of the account `name`, returning it.
        The console then no longer offers it; the workers stop trusting it only when its
        line leaves their trusted keys file. Raises `AccountError` for a name that will
        not do, no such account or no such passkey, and `LedgerUnavailable` if the store
        cannot be read or written."""
        check_name(name)
        removed: list[Passkey] = []

        def change(entries: dict[str, Any], now: float) -> None:
            entry = _existing(entries, name)
            kept = list(entry.get("passkeys", ()))
            gone = [p for p in kept if p["key_id"] == key_id]
            if not gone:
                raise AccountError(f"{name!r} has no passkey {key_id!r}")
            removed[:] = [Passkey.from_doc(gone[0])]
            entry["passkeys"] = [p for p in kept if p["key_id"] != key_id]
            entry["updated_at"] = now

        self._change(change)
        return removed[0]

    # -- logging in ---------------------------------------------------------------------

    def verify(self, name: str, password: str) -> Account | None:
        """The account `name` if `password` is its password and it may log in, else None.
        An unknown name costs the same hash as a known one, so timing tells nothing; a hash
        made with older parameters is replaced. Raises `AccountError` without argon2-cffi,
        and `LedgerUnavailable` if the store cannot be read (or the new hash written)."""
        hasher = _hasher()
        account = self.get(name) if _NAME.match(name) else None
        stored = account.password_hash if account is not None else None
        if stored is None:
            if self._dummy is None:
                self._dummy = hasher.hash("not the password of any account")
            stored = self._dummy
        try:
            hasher.verify(stored, password)
        except Exception:  # noqa: BLE001 - argon2's mismatch, invalid hash, ... all say no
            return None
        if account is None or account.password_hash is None or account.disabled:
            return None
        if hasher.check_needs_rehash(stored):
            self._rehash(account, hasher.hash(password))
        return account

    def _rehash(self, account: Account, hashed: str) -> None:
        def change(entries: dict[str, Any], now: float) -> None:
            entry = entries.get(account.name)
            if entry is None or entry.get("hash") != account.password_hash:
                raise _gatestore.Unchanged(None)  # changed meanwhile: leave it
            entry["hash"] = hashed  # the same password: sessions stay

        self._change(change)

    # -- the document -------------------------------------------------------------------

    def _change(self, change: Any) -> None:
        def update(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
            current = doc or {"kind": "console-accounts", "accounts": {}}
            entries = {n: dict(e) for n, e in current["accounts"].items()}
            change(entries, now)
            return {**current, "accounts": entries}

        _gatestore.update(self.backend, KEY, update)

    def _must(self, name: str) -> Account:
        account = self.get(name)
        if account is None:  # removed by someone else right after our change
            raise AccountError(f"no account {name!r}")
        return account


def _existing(entries: dict[str, Any], name: str) -> dict[str, Any]:
    entry = entries.get(name)
    if entry is None:
        known = ", ".join(sorted(entries)) or "none yet"
        raise AccountError(f"no account {name!r} (accounts: {known})")
    return entry  # a copy already: _change hands out copies of every entry


def _slack_free(entries: dict[str, Any], slack_user: str | None, name: str) -> None:
    if slack_user is None:
        return
    for other, entry in entries.items():
        if other != name and entry.get("slack") == slack_user:
            raise AccountError(f"Slack user {slack_user} is linked to account {other!r} already")
