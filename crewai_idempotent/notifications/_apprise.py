"""Many more services through apprise (the `apprise` extra): email, Microsoft Teams,
Discord, Telegram, PagerDuty, ntfy, Matrix and a hundred others, each named by a URL.

    apprise+mailtos://user:app-password@example.com?to=ops@example.com
    apprise+msteams://TokenA/TokenB/TokenC
    apprise+ntfy://ntfy.example.com/crewai#types=approval.*,record.uncertain

apprise fits the way channels are named here (a URL per service, checked when it is
given) and is well kept; its messages are text, so they carry the facts, the arguments
shortened, and the commands, as plain text (`Message.plain`). What apprise cannot give
is a delivery id the service keeps: a service reached twice (a try that timed out after
it was delivered) shows the message twice, with the same entry id in its last line.
A try fails when apprise reports a failure (its log says why); the dispatcher tries again
later. apprise's own options stay in the target's query (`?to=`, `?cto=`...).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from .._errors import DeliveryFailed, LedgerConfigurationError
from ._kinds import Channel, built_in, check_options
from ._message import Message


class AppriseChannel(Channel):
    scheme = "apprise"

    def __init__(self, target: str, options: Mapping[str, str]) -> None:
        check_options(self.scheme, options, ())
        super().__init__(target, options)
        try:
            import apprise
        except ImportError as exc:
            raise LedgerConfigurationError(
                f"the apprise channel needs the apprise library ({exc}); install it with: "
                "pip install 'crewai-idempotent[apprise]'"
            ) from None
        self._apprise_module: Any = apprise
        self._apprise = apprise.Apprise()
        if not self._apprise.add(target):
            raise LedgerConfigurationError(
                "apprise does not take this URL (an unknown service, or a part it needs is "
                "missing): see https://github.com/caronc/apprise/wiki"
            )
        self._timeout = "timeout" in inspect.signature(self._apprise.notify).parameters

    def send(self, message: Message) -> None:
        apprise = self._apprise_module
        extra: dict[str, Any] = {"timeout": self.timeout_s} if self._timeout else {}
        with apprise.LogCapture(level=apprise.logging.WARNING) as logs:
            sent = self._apprise.notify(
                title=message.title, body=message.plain(),
                body_format=apprise.NotifyFormat.TEXT, **extra,
            )  # fmt: skip
            said = logs.getvalue().strip()
        if not sent:
            lines = [line.split(" - ", 2)[-1] for line in said.splitlines()]
            raise DeliveryFailed("; ".join(lines)[-300:] or "apprise reported a failure")


built_in(AppriseChannel.scheme, AppriseChannel)
