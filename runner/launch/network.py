"""Which network interface the ranks of a multi-node run talk over, and the one address
runner's stores listen on (stdlib only, Linux).

gloo binds to the address this machine's host name resolves to and falls back
to loopback when it cannot bind there, so on a host whose name does not
resolve to its cluster address, ranks advertise an address the other nodes
cannot reach and the run hangs or fails to connect. runner therefore sets
GLOO_SOCKET_IFNAME (unless the user did) to the interface this machine uses to
reach master_addr.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def local_address_towards(host: str, port: int = 9) -> str:
    """The local IPv4 address the kernel would use to reach `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def interface_with_address(address: str) -> str | None:
    """The name of the interface holding IPv4 `address`, or None."""
    for _, name in socket.if_nameindex():
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("256s", name.encode()[:15])
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def interface_towards(host: str) -> str | None:
    """The interface this machine reaches `host` through, or None if that cannot be told."""
    try:
        return interface_with_address(local_address_towards(host))
    except OSError:
        return None


def listening_socket(host: str, port: int) -> tuple[int, int]:
    """A TCP socket listening on the one address `host` resolves to, never on every
    interface: (file descriptor, port). For torch's TCPStore(master_listen_fd=...), which
    otherwise binds every interface; the store owns the descriptor afterwards.

    A single-node run's host is 127.0.0.1, so nothing off the machine can reach its
    unauthenticated store; node 0 of a multi-node run binds master_addr, the address the
    other nodes reach it by.
    """
    address = socket.gethostbyname(host)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port
