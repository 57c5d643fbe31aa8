"""An operator's or automation's signing key: an Ed25519 private key file, and the
`Signer` that signs decisions with it.

The file is PEM (PKCS #8, unencrypted, as `cryptography` and `openssl genpkey -algorithm
ed25519` write it), preceded by comment lines that name its identity and roles, so that
`crewai-idempotent keys show FILE` can print its trusted keys line again:

    # crewai-idempotent signing key (Ed25519): private, keep it 0600
    # identity: alice@example.com
    # roles: approve,resolve
    -----BEGIN PRIVATE KEY-----
    ...
    -----END PRIVATE KEY-----

It is created 0600 and refused when group or others may read or write it, or another
user owns it (`_files`). A key file made elsewhere without the comments is used with an
identity given to `Signer.from_file`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .._errors import SigningConfigurationError
from ._decision import Decision, check_identity
from ._encoding import key_id
from ._envelope import SignatureEnvelope
from ._files import create_private, read_checked
from ._keys import ROLES, parse_roles, render_line

WHAT = "signing key file"
_HEADER = re.compile(r"^#\s*(identity|roles)\s*:\s*(\S*)\s*$")
_ENCRYPTED = (
    "{where} holds an encrypted key: signing keys are kept unencrypted, 0600 (protect the "
    "file, or the secret store it comes from)"
)
_BEGIN, _END = "-----BEGIN PRIVATE KEY-----", "-----END PRIVATE KEY-----"


class Signer:
    """Signs decisions with one Ed25519 private key, as one identity (make one with
    `from_file` or `create`). `roles` are those its trusted line is printed with."""

    def __init__(
        self,
        private_key: Ed25519PrivateKey,
        identity: str,
        *,
        roles: Iterable[str] = (),
        path: Path | None = None,
    ) -> None:
        """A signer for `private_key`, as `identity`, whose trusted line names `roles`;
        `path` is the file it was read from, if any. Raises `SigningConfigurationError`
        for a key that is not Ed25519, a malformed identity or an unknown role."""
        if not isinstance(private_key, Ed25519PrivateKey):
            raise SigningConfigurationError(
                f"a signing key is Ed25519, not {type(private_key).__name__}"
            )
        try:
            self.identity = check_identity(identity)
        except ValueError as exc:
            raise SigningConfigurationError(f"{_where(path)}: {exc}") from None
        listed = ",".join(roles)
        self.roles = parse_roles(listed, _where(path)) if listed else frozenset[str]()
        self.path = path
        self._key = private_key
        self.public_key = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.key_id = key_id("ed25519", self.public_key)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, identity: str | None = None) -> Signer:
        """The signer whose key is in the file at `path`, as the identity its comments
        name (or `identity`, which must agree with them when both are given). Raises
        `SigningConfigurationError` for a file that is missing, that group or others may
        read or write, that another user owns, that does not hold an unencrypted Ed25519
        private key, or that names no identity when none is given."""
        data, given, _ = read_checked(path, WHAT, private=True)
        where = f"{WHAT} {given}"
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            raise SigningConfigurationError(
                f"{where} is not a PEM file (it holds bytes that are not text)"
            ) from None
        headers, pem = _split(text, where)
        try:
            key = serialization.load_pem_private_key(pem.encode(), password=None)
        except TypeError:
            raise SigningConfigurationError(_ENCRYPTED.format(where=where)) from None
        except ValueError as exc:
            raise SigningConfigurationError(
                f"{where} holds no private key PEM can read: {exc}"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningConfigurationError(
                f"{where} holds a {type(key).__name__.removeprefix('_')}, not an Ed25519 key "
                "(`crewai-idempotent keys new` makes one)"
            )
        named = headers.get("identity")
        if identity is not None and named is not None and identity != named:
            raise SigningConfigurationError(f"{where} belongs to {named!r}, not {identity!r}")
        who = identity if identity is not None else named
        if who is None:
            raise SigningConfigurationError(
                f"{where} names no identity: give one (identity=..., --identity NAME)"
            )
        roles = headers.get("roles", "")
        return cls(key, who, roles=roles.split(",") if roles else (), path=given)

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        identity: str,
        roles: Iterable[str] = ("approve", "resolve"),
    ) -> Signer:
        """Make a new key in a new file at `path` (0600), for `identity` with `roles`
        (what its trusted line says). Raises `SigningConfigurationError` for a file that
        exists (a key is never overwritten), a missing folder, a malformed identity or an
        unknown role."""
        key = Ed25519PrivateKey.generate()
        signer = cls(key, identity, roles=roles)  # checks the identity and roles first
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        listed = ",".join(r for r in ROLES if r in signer.roles)
        text = (
            "# crewai-idempotent signing key (Ed25519): private, keep it 0600\n"
            f"# identity: {signer.identity}\n" + (f"# roles: {listed}\n" if listed else "") + pem
        )
        signer.path = create_private(path, text.encode(), WHAT)
        return signer

    def trusted_line(self, roles: Iterable[str] | None = None) -> str:
        """The line that makes workers trust this key, with `roles` (by default those
        of the file). Raises `SigningConfigurationError` when it would name no role."""
        chosen = tuple(self.roles if roles is None else roles)
        if not chosen:
            raise SigningConfigurationError(
                f"{_where(self.path)} names no roles: say which its trusted line grants "
                "(roles=[...], or --roles approve,resolve)"
            )
        return render_line(chosen, "ed25519", self.public_key, self.identity)

    def sign(self, decision: Decision) -> SignatureEnvelope:
        """The envelope of this key's signature over `decision`'s canonical bytes. Raises
        `ValueError` for a decision made by another identity (`decision.by` must be this
        signer's)."""
        if decision.by != self.identity:
            raise ValueError(
                f"this key signs as {self.identity!r}: a decision by {decision.by!r} cannot be "
                "signed with it"
            )
        return SignatureEnvelope("ed25519", self.key_id, self._key.sign(decision.canonical()))

    def __repr__(self) -> str:
        return f"Signer({self.identity!r}, {self.key_id})"


def _where(path: Path | None) -> str:
    return f"{WHAT} {path}" if path is not None else "signing key"


def _split(text: str, where: str) -> tuple[dict[str, str], str]:
    """The comments' identity and roles, and the PEM block."""
    headers: dict[str, str] = {}
    lines = text.splitlines()
    for at, line in enumerate(lines):
        stripped = line.strip()
        if stripped == _BEGIN:
            break
        if stripped == "-----BEGIN ENCRYPTED PRIVATE KEY-----":
            raise SigningConfigurationError(_ENCRYPTED.format(where=where))
        if stripped.startswith("-----BEGIN "):
            raise SigningConfigurationError(
                f"{where} holds a block of {stripped.strip('-').removeprefix('BEGIN ')}, not "
                "an unencrypted PKCS #8 private key (`crewai-idempotent keys new` writes one)"
            )
        match = _HEADER.match(stripped)
        if match:
            headers[match.group(1)] = match.group(2)
        elif stripped and not stripped.startswith("#"):
            raise SigningConfigurationError(
                f"{where} line {at + 1}: expected comments and then {_BEGIN} (a PKCS #8 "
                f"Ed25519 key, as `crewai-idempotent keys new` writes), not {stripped[:40]!r}"
            )
    else:
        raise SigningConfigurationError(
            f"{where} holds no {_BEGIN} block (a PKCS #8 Ed25519 key, as `crewai-idempotent "
            "keys new` writes)"
        )
    rest = lines[at:]
    if _END not in (line.strip() for line in rest):
        raise SigningConfigurationError(f"{where}: its key block has no {_END} line")
    end = next(i for i, line in enumerate(rest) if line.strip() == _END)
    if any(line.strip() for line in rest[end + 1 :]):
        raise SigningConfigurationError(f"{where}: something follows the key's {_END} line")
    return headers, "\n".join(line.strip() for line in rest[: end + 1]) + "\n"
