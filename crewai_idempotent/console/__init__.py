"""The web console: pending approvals with the whole call, uncertain records to resolve,
records and spend, for authenticated approvers (`crewai-idempotent console`).

Optional: `pip install 'crewai-idempotent[console]'` brings Starlette, uvicorn, Jinja2,
python-multipart and argon2-cffi. Nothing here is imported by the rest of the package.

    create_app(backend, ConsoleSettings(...))   an ASGI app to serve or mount yourself
    serve(backend, settings, host=..., port=...) what `crewai-idempotent console` runs
    dispatching(Dispatcher(...)), sweeping(Sweeper(...))  `background` jobs of create_app
    Accounts(backend)                           the accounts and roles the CLI manages
    actions_block(request)                      Slack's Approve / Deny buttons for a request

The parts: `_settings` (what a console is told), `_accounts` and `_sessions` (kept in the
ledger), `_auth` (who is asking: a login or a trusted proxy; login throttling),
`_security` (headers, origin and CSRF checks, body and host limits), `_views` (what each
page reads), `_render` (templates, escaping), `_live` (live updates), `_slack` (button
posts), `_app` (the routes), `_beside` (the dispatcher and sweeper it runs), `_serve`
(uvicorn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .._errors import AccountError
    from ._accounts import Account, Accounts, Role
    from ._app import create_app
    from ._beside import dispatching, sweeping
    from ._console import SECTIONS, Console, Section
    from ._serve import serve
    from ._settings import ConsoleSettings
    from ._slack import actions_block, button_value

_WHERE = {
    "Account": "._accounts",
    "AccountError": ".._errors",
    "Accounts": "._accounts",
    "Role": "._accounts",
    "SECTIONS": "._console",
    "Console": "._console",
    "Section": "._console",
    "create_app": "._app",
    "dispatching": "._beside",
    "sweeping": "._beside",
    "serve": "._serve",
    "ConsoleSettings": "._settings",
    "actions_block": "._slack",
    "button_value": "._slack",
}

__getattr__ = lazy_attributes(__name__, _WHERE)

__all__ = [
    "SECTIONS",
    "Account",
    "AccountError",
    "Accounts",
    "Console",
    "ConsoleSettings",
    "Role",
    "Section",
    "actions_block",
    "button_value",
    "create_app",
    "dispatching",
    "serve",
    "sweeping",
]
