"""What a peer may dial: the syntax of ``tcp://HOST:PORT`` addresses, with no sockets (the
protocol core checks member tables with it; :mod:`gossipdl.transport.addresses` finds
the addresses of this machine)."""

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
    """Why ``value`` is not an address a peer may dial, or None if it is one.

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
    """``value`` if a peer may dial it, else a ``bad_address`` WireError naming ``what``."""
    problem = address_problem(value)
    if problem is not None:
        raise WireError("bad_address", f"{what} {str(value)[:80]!r}: {problem}")
    return value
