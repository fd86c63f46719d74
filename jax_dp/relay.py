"""A relay between this process's JAX runtime client and the run's coordinator, which sees the
coordinator go before JAX's client does."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Callable

# JAX's client ends the process in C++ (its fatal log, SIGABRT) as soon as its connection to the
# coordinator breaks. Through the relay, the client's side stays open when the coordinator's
# closes: the client sees silence until its heartbeat timeout, and this process has that long to
# end in its own words (its next collective with the lost process fails at once).


class Relay:
    """Forwards every connection made to 127.0.0.1:port to the coordinator at upstream
    (HOST:PORT); calls on_lost once when the coordinator closes one, leaving the client's open."""

    def __init__(self, upstream: str, on_lost: Callable[[], None]):
        host, _, port = upstream.rpartition(":")
        self.upstream = (host.strip("[]"), int(port))
        self.on_lost = on_lost
        self.lost = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, name="jax-dp-relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            try:
                coordinator = socket.create_connection(self.upstream)
            except OSError:  # Not listening yet (or gone): JAX's client retries, to its deadline.
                client.close()
                continue
            closed = threading.Event()  # Set when the client closes this connection.
            for source, sink, upward in ((client, coordinator, True), (coordinator, client, False)):
                threading.Thread(target=self._pipe, args=(source, sink, upward, closed),
                                 name="jax-dp-relay", daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, upward: bool,
              closed: threading.Event) -> None:
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # The source closed its side.
                break
            try:
                sink.sendall(data)
            except OSError:  # The sink is gone: the other direction sees it close.
                return
        if upward:  # The client closed its connection: so does the relay.
            closed.set()
            for s in (source, sink):
                with contextlib.suppress(OSError):  # Wakes the other direction's recv.
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        elif not closed.is_set() and not self.lost.is_set():
            self.lost.set()
            self.on_lost()
