"""Port blocks for the tests' local Ray heads and MLflow servers.

Ports are drawn from below the kernel's ephemeral range: a port in that range can be taken at any moment by an
outgoing connection of another process (a Ray worker of the session's other local Ray, say) between the moment a
test sees it free and the moment the head binds it. Below the range, only an explicit listener can take it.
"""
from __future__ import annotations

import contextlib
import os
import random
import socket

WORKER_PORTS = range(100, 300)  # infra/local/cluster.sh: worker ports are RAY_PORT + 100 … + 299


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152


def free_port_block(size: int = 10) -> int:
    """First port of a block where base … base+size-1 and the worker ports above it are free on 127.0.0.1:
    RAY_PORT = base, its helpers base+1 … base+7, the dashboard base+8, MLflow base+9."""
    hi = _ephemeral_low() - WORKER_PORTS.stop
    rng = random.Random(os.getpid())
    for _ in range(200):
        base = rng.randrange(10000, hi - size)
        socks = []
        try:
            for port in [*range(base, base + size), *(base + p for p in WORKER_PORTS)]:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block below the ephemeral range")


@contextlib.contextmanager
def silent_server():
    """An 'MLflow server' that takes connections (the kernel's backlog does) and never answers a request."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"


def closed_port_uri() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/"  # nothing listens once the socket is closed
