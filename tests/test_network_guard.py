"""The suite's network guard (``no_outbound_network`` in ``tests/conftest.py``) is on in a test that
imports nothing from the suite: outbound connections and name lookups fail, loopback works."""

from __future__ import annotations

import socket
import threading
import urllib.request

import pytest

#: TEST-NET addresses (RFC 5737 / RFC 3849): never routed, so nothing is sent even if the guard failed.
OUTSIDE = [("192.0.2.1", 80), ("2001:db8::1", 80)]


@pytest.mark.parametrize("address", OUTSIDE)
def test_socket_connect_outside_is_refused(address):
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        with pytest.raises(AssertionError, match="must not use the network"):
            sock.connect(address)
        with pytest.raises(AssertionError, match="must not use the network"):
            sock.connect_ex(address)


def test_udp_send_outside_is_refused():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        with pytest.raises(AssertionError, match="must not use the network"):
            sock.sendto(b"x", ("192.0.2.1", 53))


def test_name_lookups_and_high_level_clients_are_refused():
    with pytest.raises(AssertionError, match="must not use the network"):
        socket.getaddrinfo("huggingface.co", 443)
    with pytest.raises(AssertionError, match="must not use the network"):
        socket.gethostbyname("example.com")
    with pytest.raises(AssertionError, match="must not use the network"):
        socket.create_connection(("192.0.2.1", 80), timeout=0.5)
    with pytest.raises(AssertionError, match="must not use the network"):
        urllib.request.urlopen("http://192.0.2.1/", timeout=0.5)
    with pytest.raises(AssertionError, match="must not use the network"):
        urllib.request.urlopen("https://huggingface.co/", timeout=0.5)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_stays_open(host):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        received = []

        def serve():
            conn, _ = server.accept()
            with conn:
                received.append(conn.recv(5))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with socket.create_connection((host, port), timeout=5) as client:
            client.sendall(b"hello")
        thread.join(5)
    assert received == [b"hello"]
