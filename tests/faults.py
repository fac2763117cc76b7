"""A loopback TCP proxy in front of a real server that can go down on cue (fault injection).

``OutageProxy`` forwards every connection to an upstream server (the moto S3 endpoint) and
notes the HTTP request lines it forwards. When a request line contains ``trigger`` (even one cut
in two by the socket's chunking), that request is not forwarded: the proxy goes down for
``outage_s`` seconds (listening socket closed, every open connection reset, all before the
triggering connection is let go, so a client that retries at once is refused too), so clients
see what they see when an S3 endpoint is stopped: refused connections. Then it listens again on
the same port. The upstream keeps its data, like a real object store that restarts.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable

from flowrl.infra.servers import free_port

_REQUEST_LINE = re.compile(rb"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.[01]")
_TAIL = 4096  # longer than any request line the tests send


class OutageProxy:
    def __init__(
        self,
        upstream: tuple[str, int],
        trigger: str,
        outage_s: float,
        on_down: Callable[[], None] | None = None,
    ) -> None:
        self.upstream = upstream
        self.trigger = trigger.encode()
        self.outage_s = outage_s
        self.on_down = on_down
        self.host, self.port = "127.0.0.1", free_port()
        self.requests: list[tuple[float, str, str]] = []
        """(time, method, path) of every request line seen, forwarded or not."""
        self.outage: tuple[float, float] | None = None
        """(start, end) of the outage, in time.monotonic() seconds."""
        self._fired = False
        self._down = False  # from the trigger until the proxy listens again: nothing forwarded
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._closed = False

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> OutageProxy:
        self._listen()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._go_down()

    # ------------------------------------------------------------------ up and down

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _go_down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = list(self._conns), set()
        if listener is not None:
            _reset(listener)  # shutdown first: close() alone leaves a blocked accept() listening
        for conn in conns:
            _reset(conn)

    def _outage(self, start: float) -> None:
        if self.on_down is not None:
            self.on_down()
        time.sleep(max(0.0, self.outage_s - (time.monotonic() - start)))
        self.outage = (start, time.monotonic())
        with self._lock:
            self._down = False
        if not self._closed:
            self._listen()

    # ------------------------------------------------------------------ forwarding

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: the proxy went down
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                _reset(client)
                continue
            server.settimeout(None)
            with self._lock:
                refused = self._down or self._listener is not listener
                if not refused:
                    self._conns.update((client, server))
            if refused:  # accepted just as the proxy went down
                _reset(client)
                _reset(server)
                return
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        tail = b""  # the end of the last chunk: a request line may straddle two recv() chunks
        try:
            while data := src.recv(65536):
                if from_client:
                    fire, down = self._inspect(tail, data)
                    if fire:
                        # Down before this thread lets go of the client: a client that retries
                        # at once must find the port closed, not a listener still accepting.
                        start = time.monotonic()
                        self._go_down()
                        threading.Thread(target=self._outage, args=(start,), daemon=True).start()
                    if down:
                        return  # the request, whole or cut short, never completes upstream
                    tail = (tail + data)[-_TAIL:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _reset(sock)

    def _inspect(self, tail: bytes, data: bytes) -> tuple[bool, bool]:
        """Note request lines that end in this chunk; ``(fire, down)``: whether it starts the
        outage, and whether the proxy is down (this chunk is then not forwarded).

        ``tail`` (the end of the connection's earlier chunks) is looked at with it, so a request
        line or trigger cut in two by the socket's chunking is still seen, and seen once.
        """
        now = time.monotonic()
        window = tail + data
        for match in _REQUEST_LINE.finditer(window):
            if match.end() > len(tail):
                self.requests.append((now, match.group(1).decode(), match.group(2).decode()))
        with self._lock:
            fire = not self._fired and self.trigger in window
            self._fired = self._fired or fire
            self._down = self._down or fire
            return fire, self._down


def _reset(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
