"""`crewai-idempotent console`: serve the web console, and manage its accounts.

    crewai-idempotent console --ledger URL [--host 127.0.0.1] [--port 8765] ...
    crewai-idempotent console users add NAME --role approver [--slack-user U...]
    crewai-idempotent console users ls | set | passwd | logout | rm

The console's code (and its optional dependencies) is imported only when one of these
runs; without the `console` extra they say what to install.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ._output import duration, ledger_errors, safe
from ._where import Where

if TYPE_CHECKING:
    from ..console._console import Background
    from ..console._settings import ConsoleSettings
    from ..ledger._backend import CacheBackend

SLACK_SECRET_ENV = "CREWAI_IDEMPOTENT_SLACK_SIGNING_SECRET"
_EXTRA = "pip install 'crewai-idempotent[console]'"


def _need_extra(exc: ImportError) -> click.ClickException:
    return click.ClickException(f"the console needs its extra ({exc.name} is missing): {_EXTRA}")


def _seconds(value: str, option: str) -> float:
    try:
        seconds = duration(value)
    except click.BadParameter as exc:
        raise click.BadParameter(exc.message, param_hint=option) from None
    if seconds is None or seconds <= 0:
        raise click.BadParameter(f"{value!r} is not a positive duration", param_hint=option)
    return seconds


def _secret(path: str | None) -> str | None:
    """Slack's signing secret: from a file (never the command line, which `ps` shows), else
    the environment."""
    if path is not None:
        try:
            secret = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise click.BadParameter(
                f"cannot read {path}: {exc.strerror}", param_hint="--slack-signing-secret-file"
            ) from None
        return secret
    value = os.environ.get(SLACK_SECRET_ENV, "").strip()
    return value or None


def _backend(where: Where, *, create: bool = False) -> Any:
    """The ledger's store; a ledger that does not exist yet is reported with what to do
    (`create`: made, for the accounts that live in it)."""
    try:
        with ledger_errors(where.scrub):
            return where.ledger(create=create).backend
    except click.ClickException as exc:
        if create or not exc.message.startswith("no ledger at"):
            raise
        add = where.command("console", "users", "add", "NAME", "--role", "approver")
        raise click.ClickException(
            safe(
                f"{exc.message}. The console works on the ledger your crews write: point "
                f"--ledger at it, or make it with its first account: {add}"
            )
        ) from None


@click.group("console", invoke_without_command=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--public-url",
    metavar="URL",
    help="The origin browsers use when it is not the listening address "
    "(https://approvals.example.com behind a reverse proxy).",
)
@click.option(
    "--trusted-proxy",
    "proxies",
    multiple=True,
    metavar="ADDRESS",
    help="A reverse or auth proxy in front (address or network): its X-Forwarded-For, "
    "X-Forwarded-Proto and identity header are believed. Repeatable.",
)
@click.option(
    "--auth",
    type=click.Choice(["accounts", "proxy"]),
    default="accounts",
    show_default=True,
    help="accounts: log in with a console account; proxy: the identity comes from the "
    "trusted auth proxy's header.",
)
@click.option(
    "--proxy-header",
    default="X-Forwarded-Email",
    show_default=True,
    help="With --auth proxy: the header holding the user's identity.",
)
@click.option("--allowed-host", "hosts", multiple=True, metavar="NAME",
              help="A Host name the console answers to besides loopback. Repeatable.")  # fmt: skip
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="Serve TLS.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False))
@click.option("--session-ttl", default="12h", show_default=True,
              help="A login lasts at most (more than 60 s).")  # fmt: skip
@click.option("--idle-timeout", default="1h", show_default=True,
              help="A session ends after this long without a request "
              "(more than 60 s).")  # fmt: skip
@click.option("--refresh", default="2s", show_default=True,
              help="How often, while a page is open, the ledger is asked whether it "
              "changed (more than 0.05 s).")  # fmt: skip
@click.option(
    "--slack-signing-secret-file",
    type=click.Path(dir_okay=False),
    help=f"Enables Slack's buttons at /slack/interactive (or ${SLACK_SECRET_ENV}): a file "
    "holding the app's signing secret (32 hex characters; under 16 characters is refused).",
)
@click.option("--slack-team", metavar="TEAM_ID", help="Only this Slack workspace's posts.")
@click.option("--slack-grant-ttl", default="24h", show_default=True,
              help="How long a grant given in Slack lasts.")  # fmt: skip
@click.option(
    "--channel",
    "channels",
    multiple=True,
    metavar="URL",
    help="Deliver the outbox to this channel (as `notify --channel`) while the console "
    "runs; repeatable. Default: $CREWAI_IDEMPOTENCY_NOTIFY.",
)
@click.option("--no-dispatch", is_flag=True,
              help="Deliver nothing: a separate `notify --watch` does.")  # fmt: skip
@click.option("--reconcile", is_flag=True,
              help="Also sweep (as `reconcile --watch`) while the console runs.")  # fmt: skip
@click.option("--import", "imports", multiple=True, metavar="MODULE",
              help="With --reconcile: import MODULE (its reconcilers) and trust the paths "
              "records name under it. Repeatable.")  # fmt: skip
@click.option("--trust", multiple=True, metavar="MODULE",
              help="With --reconcile: trust reconcilers under MODULE. Repeatable.")  # fmt: skip
@click.option("--reconcile-interval", default="30s", show_default=True, metavar="AGE",
              help="With --reconcile: the pause between sweeps.")  # fmt: skip
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))  # fmt: skip
@click.pass_context
def console(ctx: click.Context, **options: Any) -> None:
    """The web console: pending approvals with the whole call, uncertain records, records,
    spend and notifications, for authenticated approvers. See docs/console.md.

    It delivers the outbox to its channels (--channel, else $CREWAI_IDEMPOTENCY_NOTIFY;
    --no-dispatch: not) and, with --reconcile, sweeps the ledger, for as long as it runs.
    It listens on 127.0.0.1:8765 by default. Accounts: `console users add NAME --role
    viewer|approver|operator`."""
    if ctx.invoked_subcommand is not None:
        return
    _serve(ctx.find_object(Where) or Where(None), **options)


def _serve(where: Where, **o: Any) -> None:
    try:
        from .._errors import ListenError, SigningConfigurationError
        from ..console._serve import serve
        from ..console._settings import ConsoleSettings
    except ImportError as exc:
        raise _need_extra(exc) from None
    if (o["tls_cert"] is None) != (o["tls_key"] is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    try:
        settings = ConsoleSettings(
            auth=o["auth"], proxy_header=o["proxy_header"], trusted_proxies=o["proxies"],
            public_url=o["public_url"], allowed_hosts=o["hosts"],
            session_ttl_s=_seconds(o["session_ttl"], "--session-ttl"),
            idle_s=_seconds(o["idle_timeout"], "--idle-timeout"),
            refresh_s=_seconds(o["refresh"], "--refresh"),
            slack_signing_secret=_secret(o["slack_signing_secret_file"]),
            slack_team=o["slack_team"],
            slack_grant_ttl_s=_seconds(o["slack_grant_ttl"], "--slack-grant-ttl"),
            tls=o["tls_cert"] is not None,
        )  # fmt: skip
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    interval = _seconds(o["reconcile_interval"], "--reconcile-interval")
    trusted = _trusted_keys()
    backend = _backend(where)
    with ledger_errors(where.scrub):
        _check_accounts(where, backend, settings.auth)
    background = [*_dispatching(backend, settings, o), *_sweeping(where, o, interval)]
    try:
        serve(
            backend, settings, host=o["host"], port=o["port"], tls_cert=o["tls_cert"],
            tls_key=o["tls_key"], log_level=o["log_level"],
            say=lambda line: click.echo(safe(line), err=line.startswith("WARNING")),
            background=background, trusted_keys=trusted,
        )  # fmt: skip
    except (ListenError, SigningConfigurationError) as exc:  # trusted keys: never unsigned
        raise click.ClickException(safe(str(exc))) from None


def _trusted_keys() -> Any:
    """The trusted keys the console checks signed decisions against, as the workers do
    ($CREWAI_IDEMPOTENCY_TRUSTED_KEYS), read before it listens: a file that cannot be
    used is an error now, never a console that quietly records unsigned approvals."""
    from .._errors import SigningConfigurationError
    from ..signing._trusted import ENV, TrustedKeys

    try:
        trusted = TrustedKeys.from_env()
    except SigningConfigurationError as exc:
        raise click.ClickException(safe(str(exc))) from None
    if trusted is None:
        click.echo(f"note: no trusted keys (${ENV}): approvals are recorded unsigned, and "
                   "passkey signatures are optional", err=True)  # fmt: skip
    else:
        click.echo(safe(f"approvals must be signed by a key in {trusted.path} ({len(trusted)} "
                        "trusted)"), err=True)  # fmt: skip
    return trusted


def _dispatching(
    backend: CacheBackend, settings: ConsoleSettings, o: dict[str, Any]
) -> list[Background]:
    """The dispatcher the console runs (none with --no-dispatch, or without a channel),
    made before it listens: a channel that cannot work is an error now."""
    from ..console._beside import dispatching, link_console
    from ..notifications._channels import ENV
    from ..notifications._dispatch import Dispatcher
    from ._notify import channels_given

    if o["no_dispatch"]:
        if o["channels"]:
            raise click.UsageError("--channel and --no-dispatch contradict each other")
        click.echo("not delivering notifications (--no-dispatch): `crewai-idempotent notify "
                   "--watch` must run somewhere", err=True)  # fmt: skip
        return []
    found = channels_given(o["channels"])
    if not found:
        click.echo(f"note: no notification channel (--channel URL or ${ENV}): entries wait "
                   "in the outbox for `crewai-idempotent notify --watch`", err=True)  # fmt: skip
        return []
    linked = link_console(found, settings.public_origin)
    try:
        dispatcher = Dispatcher(backend, found)
    except ValueError as exc:
        raise click.UsageError(safe(str(exc))) from None
    names = ", ".join(f"{c.name} ({c.url})" for c in found)
    click.echo(safe(f"delivering notifications to {names} (dispatcher {dispatcher.name})"),
               err=True)  # fmt: skip
    if linked:
        click.echo(safe(f"Slack channel(s) {', '.join(linked)} link to "
                        f"{settings.public_origin}"), err=True)  # fmt: skip
    return [dispatching(dispatcher)]


def _sweeping(where: Where, o: dict[str, Any], interval: float) -> list[Background]:
    """The sweeper the console runs with --reconcile, its reconcilers imported now."""
    if not o["reconcile"]:
        if o["imports"] or o["trust"]:
            raise click.UsageError("--import and --trust are for --reconcile")
        return []
    from ..console._beside import sweeping
    from ..reconciliation import Sweeper

    # A console script's sys.path lacks the current folder, where `myapp` usually is.
    if o["imports"] and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    with ledger_errors(where.scrub):
        ledger = where.ledger()
    try:
        sweeper = Sweeper(ledger, imports=o["imports"], trust=o["trust"])
    except ImportError as exc:
        raise click.ClickException(safe(f"--import: {type(exc).__name__}: {exc}")) from None
    except (ValueError, TypeError) as exc:
        raise click.UsageError(safe(str(exc))) from None
    click.echo(safe(f"sweeping {where.label} every {interval:g} s"), err=True)
    return [sweeping(sweeper, interval)]


def _check_accounts(where: Where, backend: Any, auth: str) -> None:
    from ..console._accounts import Accounts

    accounts = Accounts(backend).all()
    usable = [a for a in accounts if not a.disabled and (auth == "proxy" or a.password_hash)]
    if not usable:
        words = ["console", "users", "add", "NAME", "--role", "approver"]
        words += ["--no-password"] if auth == "proxy" else []
        click.echo(safe(f"note: no account can log in yet; add one with "
                        f"{where.command(*words)}"), err=True)  # fmt: skip


# -- accounts -----------------------------------------------------------------------------


def _accounts(where: Where, *, create: bool = False) -> Any:
    try:
        from ..console._accounts import Accounts
    except ImportError as exc:  # pragma: no cover - the module itself has no hard import
        raise _need_extra(exc) from None
    return Accounts(_backend(where, create=create))


def _account_errors() -> Any:
    from .._errors import AccountError

    return AccountError


def _password(name: str, from_stdin: bool) -> str:
    if from_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
        if not password:
            raise click.UsageError("--password-stdin read an empty line")
        return password
    value: str = click.prompt(
        f"password for {name}", hide_input=True, confirmation_prompt=True, err=True
    )
    return value


@console.group("users")
def users() -> None:
    """The console's accounts (kept in the ledger). Roles: viewer (looks), approver
    (approves and denies), operator (also resolves uncertain records and purges)."""


@users.command("ls")
@click.pass_obj
def list_users(where: Where) -> None:
    """Every account: name, role, Slack user, whether it has a password."""
    with ledger_errors(where.scrub):
        found = _accounts(where).all()
    if not found:
        click.echo(f"no console accounts in {where.label}")
        return
    for a in found:
        login = "password" if a.password_hash else "auth proxy only"
        state = "  DISABLED" if a.disabled else ""
        slack = f"  slack {a.slack_user}" if a.slack_user else ""
        click.echo(safe(f"{a.name}  {a.role.value}  {login}{slack}{state}"))


@users.command("add")
@click.argument("name")
@click.option("--role", required=True, type=click.Choice(["viewer", "approver", "operator"]))
@click.option("--slack-user", metavar="ID", help="Link a Slack member id (U012AB3CDE).")
@click.option("--no-password", is_flag=True, help="For --auth proxy: no password login.")
@click.option("--password-stdin", is_flag=True, help="Read the password from standard input.")
@click.pass_obj
def add_user(
    where: Where, name: str, role: str, slack_user: str | None, no_password: bool,
    password_stdin: bool,
) -> None:  # fmt: skip
    """Add an account; asks for its password (twice) unless --no-password.

    With no ledger there yet (a new install, before any crew ran), it makes the ledger the
    accounts live in, and says so."""
    error = _account_errors()
    if no_password and password_stdin:
        raise click.UsageError("--no-password and --password-stdin contradict each other")
    try:
        with ledger_errors(where.scrub):
            try:
                store = _accounts(where)
            except click.ClickException as exc:
                if not exc.message.startswith("no ledger at"):
                    raise
                store = None  # made below, once the password is known: nothing is left half-done
            if store is not None and store.get(name) is not None:
                raise error(f"there is already an account {name!r}")
            password = None if no_password else _password(name, password_stdin)
            if store is None:
                store = _accounts(where, create=True)
            account = store.add(name, role, password, slack_user)
    except error as exc:
        raise click.ClickException(safe(str(exc))) from None
    if where.created:
        click.echo(
            safe(
                f"made a new ledger at {where.label}: crews must use this one for the console "
                "to see their calls"
            ),
            err=True,
        )
    login = "a password" if account.password_hash else "no password (auth proxy only)"
    click.echo(safe(f"added {account.name} ({account.role.value}, {login}) to {where.label}"))


@users.command("set")
@click.argument("name")
@click.option("--role", type=click.Choice(["viewer", "approver", "operator"]))
@click.option("--slack-user", metavar="ID", help="Link a Slack member id.")
@click.option("--no-slack-user", is_flag=True, help="Unlink the Slack user.")
@click.option("--disable/--enable", "disabled", default=None, help="Disabled: no login at all.")
@click.pass_obj
def set_user(
    where: Where, name: str, role: str | None, slack_user: str | None, no_slack_user: bool,
    disabled: bool | None,
) -> None:  # fmt: skip
    """Change an account's role, Slack user, or whether it may log in."""
    error = _account_errors()
    if slack_user is not None and no_slack_user:
        raise click.UsageError("--slack-user and --no-slack-user contradict each other")
    slack: str | bool | None = (
        slack_user if slack_user is not None else (None if no_slack_user else False)
    )
    try:
        with ledger_errors(where.scrub):
            account = _accounts(where).set(name, role=role, slack_user=slack, disabled=disabled)
    except error as exc:
        raise click.ClickException(safe(str(exc))) from None
    state = "disabled" if account.disabled else "enabled"
    slack_text = account.slack_user or "no Slack user"
    click.echo(safe(f"{account.name}: {account.role.value}, {slack_text}, {state}"))


@users.command("passwd")
@click.argument("name")
@click.option("--password-stdin", is_flag=True, help="Read the password from standard input.")
@click.option("--none", "no_password", is_flag=True, help="Remove it (auth proxy only).")
@click.pass_obj
def set_password(where: Where, name: str, password_stdin: bool, no_password: bool) -> None:
    """Set an account's password; its sessions end."""
    error = _account_errors()
    try:
        with ledger_errors(where.scrub):
            store = _accounts(where)
            if store.get(name) is None:
                raise error(f"no account {name!r}")
            password = None if no_password else _password(name, password_stdin)
            store.set_password(name, password)
    except error as exc:
        raise click.ClickException(safe(str(exc))) from None
    click.echo(safe(f"{name}: password {'removed' if no_password else 'set'}; its sessions ended"))


@users.command("logout")
@click.argument("name")
@click.pass_obj
def logout_user(where: Where, name: str) -> None:
    """End every session of an account (it logs in again)."""
    error = _account_errors()
    try:
        with ledger_errors(where.scrub):
            _accounts(where).end_sessions(name)
    except error as exc:
        raise click.ClickException(safe(str(exc))) from None
    click.echo(safe(f"{name}: every session ended"))


@users.command("rm")
@click.argument("name")
@click.pass_obj
def remove_user(where: Where, name: str) -> None:
    """Remove an account; its sessions end. Its past decisions keep its name."""
    error = _account_errors()
    try:
        with ledger_errors(where.scrub):
            _accounts(where).remove(name)
    except error as exc:
        raise click.ClickException(safe(str(exc))) from None
    click.echo(safe(f"removed {name} from {where.label}"))
