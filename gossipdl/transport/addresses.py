"""Which ``tcp://HOST:PORT`` addresses a peer will dial, and which only reach this machine.

Every address a peer dials comes from a member table, a join or a request's
reply address, and so from the wire: one rule checks them all, so a message
cannot make a peer dial a wildcard, a broadcast or a multicast address, a
port out of range, or anything that is not TCP.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import sys

from gossipdl.transport.address_syntax import (  # noqa: F401 (also imported from here)
    MAX_ADDRESS_CHARS,
    address_problem,
    check_address,
    host_port,
)

log = logging.getLogger(__name__)
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", ""})
_ROUTE_PROBE = "203.0.113.1"  # TEST-NET-3: asks the routing table for the default interface


def is_loopback(address: str) -> bool:
    """Whether a ``tcp://host:port`` address only accepts connections from this machine."""
    host = host_port(address)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def route_source(host: str) -> str | None:
    """This machine's IP on the interface that routes to ``host`` (None: no route). A UDP
    socket's ``connect`` only asks the routing table; no packet is sent."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_ips() -> list[str]:
    """This machine's IPv4 addresses that are not loopback, interface by interface (Linux; an
    empty list elsewhere)."""
    if not sys.platform.startswith("linux"):
        return []
    import fcntl
    import struct

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            ip = socket.inet_ntoa(packed[20:24])
            if not ipaddress.ip_address(ip).is_loopback:
                found.append(ip)
    return found


def reachable_host(toward: str | None = None) -> str | None:
    """An IP of this machine other machines can dial: the one that routes to ``toward`` (the
    member we join), else the default route's, else the first non-loopback interface's, else
    what the host name resolves to; None if all of them are loopback."""
    candidates = [route_source(toward)] if toward else []
    candidates += [route_source(_ROUTE_PROBE), *interface_ips()]
    with contextlib.suppress(OSError):
        candidates.append(socket.gethostbyname(socket.gethostname()))
    for host in candidates:
        if host is not None and not ipaddress.ip_address(host.split("%")[0]).is_loopback:
            return host
    return route_source(toward) if toward else None


def advertised_address(bound: str, advertise: str | None = None, toward: str | None = None) -> str:
    """The address other peers dial to reach a socket bound at ``bound`` (its real port):
    ``advertise`` if given, else ``bound`` with a wildcard host replaced by an IP of the
    interface that routes to ``toward`` (a member's address) or by the first one that is not
    loopback. Warns once when only a loopback address is left for a socket other machines
    could reach."""
    if advertise:
        address = check_address(advertise, "--advertise")
    else:
        host, port = host_port(bound)
        if host in WILDCARD_HOSTS:
            toward_host = host_port(toward)[0] if toward else None
            host = reachable_host(toward_host) or "127.0.0.1"
        address = f"tcp://{_format_host(host)}:{port}"
    if is_loopback(address) and not is_loopback(bound):
        _warn_loopback_once(bound, address)
    return address


_warned_loopback: set[str] = set()


def _warn_loopback_once(bound: str, address: str) -> None:
    if bound in _warned_loopback:
        return
    _warned_loopback.add(bound)
    log.warning(
        "listening on %s but telling the swarm to dial %s, which only this machine can reach: "
        "peers on other machines will fail to connect. Give --advertise tcp://HOST:PORT "
        "(or GOSSIPDL_ADVERTISE) with an address they can reach.",
        bound,
        address,
    )
