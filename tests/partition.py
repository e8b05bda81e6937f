"""A TCP proxy between a process and Redis that can cut the link: partitions for tests.

``TcpProxy(upstream_port).start()`` listens on a free port of 127.0.0.1 and forwards every
connection to ``127.0.0.1:upstream_port``. :meth:`TcpProxy.cut` black-holes the link, as a
network cut without resets would: what either side sends is read and dropped, nothing
arrives, new connections are accepted and then hear nothing (a client sees timeouts, never
an error). :meth:`TcpProxy.heal` ends the cut: connections that lived through it are closed
(their streams lost bytes, as a peer would reset them after a long cut) and new ones are
forwarded again.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Iterator


class TcpProxy:
    """A forwarding proxy on 127.0.0.1 that can black-hole its traffic (see the module)."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        self._links: list[tuple[socket.socket, socket.socket | None]] = []

    def url(self, db: int, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/{db}"

    def start(self) -> TcpProxy:
        self._listener.listen(64)
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()
        return self

    def cut(self) -> None:
        """Black-hole every connection, present and future, until :meth:`heal`."""
        with self._lock:
            self._cut = True

    def heal(self) -> None:
        """Forward again; connections that lived through the cut are closed."""
        with self._lock:
            self._cut = False
            links, self._links = self._links, []
        for client, upstream in links:
            _close(client)
            if upstream is not None:
                _close(upstream)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        _close(self._listener)
        self.heal()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    _close(client)
                    return
                cut = self._cut
            upstream = None
            if not cut:
                try:
                    upstream = socket.create_connection(self.upstream, timeout=5)
                    upstream.settimeout(None)
                except OSError:
                    _close(client)
                    continue
            with self._lock:
                self._links.append((client, upstream))
            threading.Thread(
                target=self._pump, args=(client, upstream), name="tcp-proxy-link", daemon=True
            ).start()

    def _pump(self, client: socket.socket, upstream: socket.socket | None) -> None:
        peers = {client: upstream}
        if upstream is not None:
            peers[upstream] = client
        with selectors.DefaultSelector() as selector:
            try:
                for sock in peers:
                    selector.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):  # the link was cut before this thread started
                for sock in peers:
                    _close(sock)
                return
            for source in _readable(selector):
                try:
                    data = source.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                with self._lock:
                    cut = self._cut
                target = peers[source]
                if cut or target is None:
                    continue  # dropped: the black hole
                try:
                    target.sendall(data)
                except OSError:
                    break
        for sock in peers:
            _close(sock)


def _readable(selector: selectors.BaseSelector) -> Iterator[socket.socket]:
    while True:
        try:
            events = selector.select(timeout=0.5)
        except (OSError, ValueError):
            return
        if not selector.get_map():
            return
        for key, _ in events:
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock.fileno() < 0:
                return
            yield sock


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
