"""Which ``tcp://HOST:PORT`` addresses a peer will dial, and which only reach this machine.

Every address a peer dials comes from a member table, a join or a request's
reply address, and so from the wire: one rule checks them all, so a message
cannot make a peer dial a wildcard, a broadcast or a multicast address, a
port out of range, a host name, or anything that is not TCP. The user's own
``--bootstrap`` and ``--advertise`` may name a host: :func:`resolve` turns it
into an IP once, before any socket sees it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import socket
import sys
import threading

from gossipdl.transport.address_syntax import (  # noqa: F401 (also imported from here)
    MAX_ADDRESS_CHARS,
    address_problem,
    check_address,
    host_port,
    is_ip_literal,
)

log = logging.getLogger(__name__)
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", ""})
# How long a user's host name may take to resolve (once, at start): a DNS server that does
# not answer fails the start naming the host, instead of stalling it for the resolver's
# own retries.
RESOLVE_TIMEOUT_S = 5.0
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


class ResolveError(ValueError):
    """A user's host name did not resolve; the message names the host and the fix."""


def resolve(address: str, what: str, timeout: float | None = None) -> str:
    """``address`` with its host name replaced by the IP it resolves to here (the first IPv4
    address the system's resolver gives, else its first), or unchanged if it names an IP.
    Resolved on a thread of its own, waited for ``timeout`` seconds at most (None:
    ``RESOLVE_TIMEOUT_S``, read at the call): ResolveError naming ``what`` (the flag the
    user gave it with) otherwise. Only for the user's own addresses: one from the wire is
    refused unless it names an IP (:func:`check_address`).

    Example:
        >>> resolve("tcp://10.0.0.5:5555", "--bootstrap")  # an IP: asks nobody
        'tcp://10.0.0.5:5555'
    """
    host, port = host_port(address)
    if is_ip_literal(host):
        return address
    answer: queue.SimpleQueue[list[str] | OSError] = queue.SimpleQueue()

    def look_up() -> None:
        try:
            found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            answer.put([str(entry[4][0]) for entry in found])
        except OSError as exc:
            answer.put(exc)

    wait = RESOLVE_TIMEOUT_S if timeout is None else timeout
    threading.Thread(target=look_up, name=f"resolve-{host}", daemon=True).start()
    try:
        result = answer.get(timeout=wait)
    except queue.Empty:
        result = OSError(f"no answer from the DNS server within {wait:g}s")
    if isinstance(result, OSError) or not result:
        reason = result.strerror or str(result) if isinstance(result, OSError) else "no address"
        raise ResolveError(
            f"{what} {address!r}: cannot resolve host {host!r}: {reason}; give its IP "
            "address instead (e.g. tcp://10.0.0.5:5555)"
        )
    ipv4_first = sorted(result, key=lambda ip: ":" in ip)  # as ZeroMQ's own lookup did
    return f"tcp://{_format_host(ipv4_first[0])}:{port}"


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
    ``advertise`` if given (an IP: :func:`resolve` a user's host name first), else
    ``bound`` with a wildcard host replaced by an IP of the interface that routes to
    ``toward`` (a member's address) or by the first one that is not loopback. Warns once
    when only a loopback address is left for a socket other machines could reach."""
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
