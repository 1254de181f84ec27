"""The listening socket: socket alone (no torch), so that `vaeopt serve` says a bad --host or a port in use at once,
before seconds of imports."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a port in use is a clear error (and port 0 picks a free one)."""
    from vaeopt.errors import VaeoptError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise VaeoptError(f"--host {host}: not an address here ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise VaeoptError(f"cannot listen on {host}:{port}: {e.strerror or e}" + (
            " (another server is there: pick another --port)" if e.errno == 98 else "")) from None
    sock.listen(512)
    sock.set_inheritable(True)
    return sock
