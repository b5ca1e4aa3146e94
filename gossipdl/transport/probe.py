"""Before asking a member anything: is a ZeroMQ peer listening there, and does it use CURVE?

A ZeroMQ DEALER never says that nothing listens at its address, or that the
other side wants encryption: it retries the connection silently while
messages pile up. A joiner would wait out its whole start-up timeout. The
probe opens a plain TCP connection, sends the first bytes of a ZMTP 3
greeting (RFC 23) and reads the listener's greeting, whose mechanism field
says ``NULL`` (plain) or ``CURVE``. It reads 64 bytes at most and compares
them; nothing it reads is used for anything else.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from gossipdl.transport.addresses import host_port
from gossipdl.transport.sockets import TransportError

# Keep trying this long: under torchrun or srun every rank starts at once, and the others
# may look for rank 0 before it listens.
CONNECT_WAIT_S = 5.0
_PROBE_TIMEOUT_S = 1.0
_SIGNATURE = b"\xff" + b"\x00" * 7 + b"\x01" + b"\x7f"
_GREETING_BYTES = 64  # signature 10, version 2, mechanism 20, as-server 1, filler 31


class Unreachable(TransportError):
    """Nothing usable answers at an address; the message says what was found and what to do."""


def mechanism(address: str, timeout: float = _PROBE_TIMEOUT_S) -> str:
    """The security mechanism (``NULL`` or ``CURVE``) the ZeroMQ listener at ``address``
    greets with; OSError if nothing accepts the connection, ValueError if the listener is
    not ZeroMQ."""
    host, port = host_port(address)
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:
        conn.sendall(_SIGNATURE + b"\x03")  # a listener answers the major version with its own
        greeting = b""
        while len(greeting) < _GREETING_BYTES:
            chunk = conn.recv(_GREETING_BYTES - len(greeting))
            if not chunk:
                break
            greeting += chunk
    if len(greeting) < _GREETING_BYTES or greeting[0] != 0xFF or greeting[9] != 0x7F:
        raise ValueError("it does not speak ZeroMQ (ZMTP 3)")
    return greeting[12:32].rstrip(b"\x00").decode("ascii", "replace")


def reachable(addresses: Sequence[str], *, secure: bool, wait: float = CONNECT_WAIT_S) -> list[str]:
    """The ``addresses`` where a ZeroMQ peer with our security listens, in order, trying
    again for ``wait`` seconds while none does; otherwise Unreachable naming, per address,
    what was found there and what to do (a plain/CURVE mismatch fails at once)."""
    deadline = time.monotonic() + wait
    while True:
        found, problems = [], []
        for address in addresses:
            try:
                used = mechanism(address)
            except (OSError, ValueError) as exc:
                problems.append(f"{address}: {_why(exc)}")
                continue
            if (used == "CURVE") != secure:
                raise Unreachable(_mismatch(address, used, secure))
            found.append(address)
        if found:
            return found
        if time.monotonic() >= deadline:
            raise Unreachable(
                f"no gossipdl peer answers at {'; '.join(problems)} (tried for {wait:.0f}s). "
                "Check the address and port, that the swarm is still running (it may have "
                "finished), and that no firewall blocks the port."
            )
        time.sleep(0.25)


def _why(exc: OSError | ValueError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port)"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "no answer (host down, or a firewall drops the packets)"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror})"
    return exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)


def _mismatch(address: str, used: str, secure: bool) -> str:
    if used == "CURVE":
        return (
            f"{address} is a secure swarm (CURVE) and we connect without encryption; add "
            "--secure --keys DIR --allow FILE (our public key must be on its allow-list)"
        )
    if secure:
        return (
            f"{address} listens without encryption ({used}) and we use --secure; drop "
            "--secure, or start that swarm with --secure"
        )
    return f"{address} uses the security mechanism {used!r}, which gossipdl does not speak"
