"""Free loopback ports for the servers the scripts and tests start."""
from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """n distinct free ports: held open together while the OS picks them, so no two are the same."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
