"""`crewai-idempotent keys`: an operator's or automation's signing key.

    crewai-idempotent keys new ~/.config/crewai-idempotent/alice.key --identity alice@example.com
    crewai-idempotent keys new /etc/crewai/sweeper.key --identity payments-sweeper --roles sweeper
    crewai-idempotent keys show ~/.config/crewai-idempotent/alice.key

`new` writes a new Ed25519 key file (0600; an existing file is never overwritten) and
prints its trusted keys line on standard output, alone, so that it can be appended where
the workers read their trusted keys; `show` prints the line again. Neither touches a
ledger: trusted keys live outside it.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from .._errors import SigningConfigurationError
from ._output import safe

if TYPE_CHECKING:
    from ..signing._keyfile import Signer
    from ..signing._trusted import TrustedKeys

#: The key file the decision commands sign with when --key is not given.
SIGNING_KEY_ENV = "CREWAI_IDEMPOTENCY_SIGNING_KEY"
#: `signing.ENV`, named here without loading the signing package.
TRUSTED_KEYS_ENV = "CREWAI_IDEMPOTENCY_TRUSTED_KEYS"


def signing_key_option(what: str, flag: str = "--key") -> Callable[[Any], Any]:
    """The option naming the key file a command signs `what` with ($CREWAI_IDEMPOTENCY_
    SIGNING_KEY by default), given to the command as `key_file`."""
    return click.option(
        flag,
        "key_file",
        metavar="FILE",
        envvar=SIGNING_KEY_ENV,
        help=f"Sign {what} with this key file (`keys new`). Default: ${SIGNING_KEY_ENV}.",
    )


def load_signing(key_file: str | None) -> tuple[Signer | None, TrustedKeys | None]:
    """The signer `key_file` names and the trusted keys $CREWAI_IDEMPOTENCY_TRUSTED_KEYS
    names (checked here as the workers check them), each None when not given; a key file
    or trusted keys that cannot be used are said as the command's error."""
    import os

    if key_file is None and not os.environ.get(TRUSTED_KEYS_ENV, "").strip():
        return None, None  # nothing of signing to load
    from ..signing._keyfile import Signer
    from ..signing._trusted import TrustedKeys

    try:
        signer = None if key_file is None else Signer.from_file(key_file)
        trusted = TrustedKeys.from_env()
    except SigningConfigurationError as exc:
        raise _refused(exc) from None
    except OSError as exc:  # a folder where a file was expected, say
        raise click.ClickException(safe(f"cannot read {exc.filename}: {exc.strerror}")) from None
    return signer, trusted


_ROLES_HELP = (
    "What the workers trust the key for, comma-separated: approve (approvals and denials), "
    "resolve (settling uncertain outcomes), cap (spend caps), sweeper (a sweeper's automatic "
    "settlements)."
)


def _refused(exc: SigningConfigurationError) -> click.ClickException:
    return click.ClickException(safe(str(exc)))


def _roles(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    from ..signing._keys import parse_roles

    try:
        parse_roles(value, "--roles")
    except SigningConfigurationError as exc:
        message = safe(str(exc).removeprefix("--roles: "))
        raise click.BadParameter(message, param_hint="--roles") from None
    return tuple(value.split(","))


@click.group("keys")
def keys() -> None:
    """Signing keys: make one, print its trusted keys line.

    Approvals, denials and resolutions signed with a key are obeyed by workers that trust
    it: its line is in their trusted keys file ($CREWAI_IDEMPOTENCY_TRUSTED_KEYS, or the
    one given to configure()). Removing the line stops the key.
    """


@keys.command("new")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--identity", required=True, metavar="NAME", help="Whose key it is.")
@click.option("--roles", default="approve,resolve", show_default=True, help=_ROLES_HELP)
def new(file: str, identity: str, roles: str) -> None:
    """Write a new Ed25519 signing key to FILE (0600) and print its trusted keys line."""
    from ..signing._keyfile import Signer

    chosen = _roles(roles)
    try:
        signer = Signer.create(file, identity=identity, roles=chosen or ())
        line = signer.trusted_line()
    except SigningConfigurationError as exc:
        raise _refused(exc) from None
    click.echo(line)
    show = f"crewai-idempotent keys show {shlex.quote(str(signer.path))}"
    click.echo(
        safe(
            f"Wrote the private key {signer.path} (0600): keep it there, never in the ledger. "
            "Add the line above to the workers' trusted keys file; "
            f"`{show}` prints it again."
        ),
        err=True,
    )


@keys.command("show")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--identity",
    metavar="NAME",
    help="Whose key it is, for a key file made elsewhere that does not say.",
)
@click.option("--roles", default=None, help=_ROLES_HELP + " Default: those the file names.")
def show(file: str, identity: str | None, roles: str | None) -> None:
    """Print the trusted keys line of the signing key in FILE."""
    from ..signing._keyfile import Signer

    chosen = _roles(roles)
    try:
        click.echo(Signer.from_file(file, identity=identity).trusted_line(chosen))
    except SigningConfigurationError as exc:
        raise _refused(exc) from None
