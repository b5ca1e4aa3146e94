"""What a peer may dial: the syntax of ``tcp://HOST:PORT`` addresses, with no sockets (the
protocol core checks member tables with it; :mod:`gossipdl.transport.addresses` finds
the addresses of this machine).

An address from the network must name its host by IP: ZeroMQ resolves a host name inside
the context's one I/O thread, on connect and on every redial, so a slow DNS server would
freeze all of a peer's connections for seconds at a time (a stranger's request naming
``tcp://joiner-b.lan:5556`` split a two-peer swarm). The user's own ``--bootstrap`` and
``--advertise`` may name a host: :func:`gossipdl.transport.addresses.resolve` turns it into
an IP once, locally and with a time limit, before any socket sees it.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from gossipdl.numerals import is_decimal
from gossipdl.transport.wire import WireError

MAX_ADDRESS_CHARS = 300
MAX_PORT = 65535
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def host_port(address: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` (IPv6 hosts in brackets) as ``(HOST, PORT)``."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]") if host.startswith("[") and host.endswith("]") else host, port


def address_problem(value: Any) -> str | None:
    """Why ``value`` is not an address a user may give (``--bootstrap``, ``--advertise``: a
    host name is resolved locally before use), or None if it is one.

    Example:
        >>> address_problem("tcp://10.0.0.5:5555") is None, address_problem("tcp://0.0.0.0:5")
        (True, 'host 0.0.0.0 is not one machine (wildcard, broadcast or multicast)')
    """
    if not isinstance(value, str) or not value.startswith("tcp://"):
        return "not a tcp://HOST:PORT string"
    if len(value) > MAX_ADDRESS_CHARS:
        return f"longer than {MAX_ADDRESS_CHARS} characters"
    host, port = host_port(value)
    if not (is_decimal(port) and 0 < int(port) <= MAX_PORT):
        return f"port {port!r} is not in 1..{MAX_PORT}"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not _HOST_NAME.fullmatch(host):
            return f"host {host!r} is neither an IP address nor a host name"
        return None
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.ip_address("255.255.255.255"):
        return f"host {host} is not one machine (wildcard, broadcast or multicast)"
    return None


def wire_address_problem(value: Any) -> str | None:
    """Why ``value``, taken from a message, is not an address a peer may dial, or None if it
    is one: :func:`address_problem`'s rule, and the host an IP address (module docstring).

    Example:
        >>> wire_address_problem("tcp://10.0.0.5:5555") is None
        True
        >>> wire_address_problem("tcp://joiner-b.lan:5556").split(":")[0]
        "host 'joiner-b.lan' is a name, not an IP address"
    """
    problem = address_problem(value)
    if problem is None and names_a_host(value):
        return (
            f"host {host_port(value)[0]!r} is a name, not an IP address: a peer never resolves "
            "names it is sent (a slow DNS server would stall all its connections); advertise "
            "an IP, e.g. tcp://10.0.0.5:5555"
        )
    return problem


def names_a_host(address: str) -> bool:
    """Whether ``address`` dials a host by name: ZeroMQ would resolve it on its one I/O
    thread (an ``ipc://`` address names a file: no lookup)."""
    return address.startswith("tcp://") and not is_ip_literal(host_port(address)[0])


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (dialling it asks no DNS server)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def listen_problem(value: str) -> str | None:
    """Why ``value`` is not an address a peer may bind, or None if it is one: any host (a
    wildcard, an interface's name) and port 0 (any free one) will do, but a port above
    :data:`MAX_PORT` must be refused here, as ZeroMQ would wrap it round to another.

    Example:
        >>> listen_problem("tcp://0.0.0.0:0") is None, listen_problem("tcp://127.0.0.1:99999")
        (True, "port '99999' is not in 0..65535 (0: any free port)")
    """
    if not value.startswith("tcp://"):
        return "not a tcp://HOST:PORT string"
    port = host_port(value)[1]
    if not (is_decimal(port) and int(port) <= MAX_PORT):
        return f"port {port!r} is not in 0..{MAX_PORT} (0: any free port)"
    return None


def check_address(value: Any, what: str) -> str:
    """``value`` (taken from a message) if a peer may dial it, else a ``bad_address``
    WireError naming ``what``."""
    problem = wire_address_problem(value)
    if problem is not None:
        raise WireError("bad_address", f"{what} {str(value)[:80]!r}: {problem}")
    return value
