"""The fault-injection proxy itself: the outage tests are only as good as its cue."""

from __future__ import annotations

import socket
import threading
import time

from faults import OutageProxy

from flowrl.infra.servers import free_port


class Upstream:
    """A loopback TCP server that keeps every byte it receives."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.sock = socket.create_server(("127.0.0.1", free_port()))
        self.address = self.sock.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    self.received += data
            except OSError:
                pass


def test_a_trigger_cut_in_two_still_fires_and_a_retry_at_once_finds_the_port_closed() -> None:
    upstream = Upstream()
    trigger = "step-00000002/manifest.json"
    seen_down: list[bool] = []
    with OutageProxy(upstream.address, trigger, outage_s=1.5) as proxy:
        proxy.on_down = lambda: seen_down.append(True)
        client = socket.create_connection((proxy.host, proxy.port), timeout=5)
        client.sendall(b"PUT /bucket/weights HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
        client.sendall(b"PUT /bucket/step-00000002/mani")  # the socket may hand these over
        time.sleep(0.3)  # in separate chunks: here they surely are
        client.sendall(b"fest.json HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        assert client.recv(1) == b""  # the request never completes: the connection is cut
        client.close()
        try:  # and a client that retries at once is refused, not forwarded
            socket.create_connection((proxy.host, proxy.port), timeout=1).close()
            refused = False
        except OSError:
            refused = True
        assert refused
        deadline = time.monotonic() + 10
        while proxy.outage is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.outage is not None and proxy.outage[1] - proxy.outage[0] >= 1.5
        assert seen_down == [True]
        # Back up: the same request is forwarded whole this time.
        with socket.create_connection((proxy.host, proxy.port)) as again:
            again.sendall(b"PUT /bucket/step-00000002/manifest.json HTTP/1.1\r\n\r\n{}")
            time.sleep(0.3)
    assert b"manifest.json HTTP/1.1" in upstream.received  # only the retry after the outage
    assert upstream.received.count(b"manifest.json HTTP/1.1") == 1
    assert [(m, p) for _, m, p in proxy.requests] == [
        ("PUT", "/bucket/weights"),
        ("PUT", "/bucket/step-00000002/manifest.json"),
        ("PUT", "/bucket/step-00000002/manifest.json"),
    ]
    upstream.sock.close()
