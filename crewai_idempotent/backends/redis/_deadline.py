"""Bounding every socket wait of a redis-py connection by the operation's deadline.

redis-py applies one fixed socket timeout to each wait (connecting, sending, each reply),
and its own resends start the count again, so an operation could last many times its
timeout against a frozen server or a network that drops packets. The Redis backend sets
`deadline.at` for the whole operation, resends included, and its connections come from
`bounded(...)`: each wait gets only the time the operation has left.
"""

from __future__ import annotations

import threading
import time
from typing import Any

#: `deadline.at`: the monotonic time by which the operation this thread runs must end
#: (unset outside one), read by the connections' socket timeouts.
deadline = threading.local()


class _DeadlineBound:
    """Mixed into redis-py's connection class: every socket wait (connecting, sending,
    reading a reply) is limited to the time the current operation has left."""

    socket_connect_timeout: float | None
    _sock: Any

    def _left(self) -> float | None:
        at: float | None = getattr(deadline, "at", None)
        # A wait of almost nothing times out at once, through redis-py's own path, which
        # drops the connection so no late reply is read by the next command.
        return None if at is None else max(at - time.monotonic(), 0.001)

    def _connect(self) -> Any:
        left = self._left()
        if left is not None:
            self.socket_connect_timeout = left
        return super()._connect()  # type: ignore[misc]

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self._bound_socket()
        super().send_packed_command(command, check_health)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self._bound_socket()
        return super().read_response(*args, **kwargs)  # type: ignore[misc]

    def _bound_socket(self) -> None:
        left = self._left()
        if left is not None and self._sock is not None:
            self._sock.settimeout(left)


_bounded_classes: dict[type[Any], type[Any]] = {}


def bounded(cls: type[Any]) -> type[Any]:
    """`cls` (a redis-py connection class) with every socket wait bounded by `deadline`."""
    if issubclass(cls, _DeadlineBound):
        return cls
    if cls not in _bounded_classes:
        _bounded_classes[cls] = type(f"DeadlineBound{cls.__name__}", (_DeadlineBound, cls), {})
    return _bounded_classes[cls]
