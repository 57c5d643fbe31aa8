"""A loopback TCP proxy that can be told to stop forwarding: a network that drops packets.

While forwarding, every byte goes through both ways. After `swallow()`, the proxy keeps
every connection open and keeps accepting new ones (the client's kernel sees a healthy
TCP peer, as it would with a frozen server or a route that silently drops packets), but
nothing more reaches the server and no answer comes back: what a client sends is read
and thrown away. `forward()` only affects bytes that arrive afterwards, so a connection
that lost bytes while swallowed stays out of step; clients must discard it.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class BlackHoleProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self._swallowing = threading.Event()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def swallowing(self) -> bool:
        return self._swallowing.is_set()

    def swallow(self) -> None:
        """Stop forwarding in both directions, and connect new clients to nothing."""
        self._swallowing.set()

    def forward(self) -> None:
        self._swallowing.clear()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._track(client)
            if self.swallowing:
                # Accepted (the client's connect succeeds), then silence.
                threading.Thread(target=self._drain, args=(client,), daemon=True).start()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            self._track(server)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _drain(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                if not self.swallowing:
                    sink.sendall(chunk)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
