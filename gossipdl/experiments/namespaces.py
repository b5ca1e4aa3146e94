"""Emulated hosts on one machine: Linux network namespaces joined by veth pairs and a bridge.

Each "host" is a namespace with its own IP on a private /24; peers started
inside one (``ip netns exec``) talk to the others over real links that a test
can cut (``ip link set … down``) or shape (``tc`` tbf). Needs root and iproute2; ``why_not``
says what is missing so callers can skip with that reason.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path
from types import TracebackType


class NamespaceError(RuntimeError):
    """The namespaces could not be set up; the message has the failing command's output."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NamespaceError(f"{' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ip", *args, check=check)


def _tbf(tc: list[str], dev: str, rate_bps: float) -> None:
    """A token-bucket rate limit on ``dev``'s egress. A burst of ~2 ms of traffic (at least one
    full frame) keeps the rate honest over short transfers; 50 ms of queue, then drops."""
    burst = max(1600, int(rate_bps / 8 * 0.002))
    _run(*tc, "qdisc", "replace", "dev", dev, "root", "tbf",
         "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "50ms")  # fmt: skip


def why_not() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``), or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip command"
    return None


_INSTANCES = itertools.count()  # Hosts made in this process: each gets names of its own


def _free_tag() -> str:
    """A tag for a new :class:`Hosts`' names that nothing on this machine uses: this process's
    and its count of them (two in one process, or in two whose pids end alike, took the same
    names, and one's failed setup tore down the other's namespaces)."""
    while True:
        tag = f"{os.getpid() % 10000}{next(_INSTANCES) % 100:02d}"
        taken = (
            Path(f"/run/netns/gdl{tag}h0").exists() or Path(f"/sys/class/net/gdl{tag}br").exists()
        )
        if not taken:
            return tag


class Hosts:
    """``n`` namespaces on a bridge, host k at ``10.S.0.(k+1)`` (S from the pid, so runs at
    the same time do not collide); removed again on exit.

    Example (as root)::

        with Hosts(3) as hosts:
            subprocess.run([*hosts.prefix(1), "ping", "-c1", hosts.ip(0)])
            hosts.cut(2)      # host 2 loses its link
            hosts.restore(2)
    """

    def __init__(self, n: int) -> None:
        reason = why_not()
        if reason is not None:
            raise NamespaceError(reason)
        tag = _free_tag()
        self.n = n
        self.subnet = 100 + os.getpid() % 100
        self.names = [f"gdl{tag}h{k}" for k in range(n)]
        self.bridge = f"gdl{tag}br"
        self._links = [f"gdl{tag}v{k}" for k in range(n)]  # root-side end of host k's veth

    def ip(self, k: int) -> str:
        """Host k's address."""
        return f"10.{self.subnet}.0.{k + 1}"

    def add_address(self, k: int) -> str:
        """Give host k a second address on its link (as a machine with two IPs has); returns
        it."""
        ip = f"10.{self.subnet}.0.{k + 101}"
        _ip("-n", self.names[k], "addr", "add", f"{ip}/24", "dev", f"{self._links[k]}i")
        return ip

    def prefix(self, k: int) -> list[str]:
        """The command prefix that runs a program on host k."""
        return ["ip", "netns", "exec", self.names[k]]

    def shape(self, k: int, uplink_bps: float = 0.0, downlink_bps: float = 0.0) -> None:
        """Limit host k's link in the kernel with a token bucket (``tc`` tbf): its uplink on
        its own end of the veth, its downlink on the bridge's end. 0 leaves a direction
        alone. Latency and loss need ``netem``; see :func:`netem_missing`."""
        if uplink_bps:
            _tbf([*self.prefix(k), "tc"], f"{self._links[k]}i", uplink_bps)
        if downlink_bps:
            _tbf(["tc"], self._links[k], downlink_bps)

    def netem_missing(self) -> str | None:
        """Why kernel latency and loss (``tc`` netem) are unavailable here, or None."""
        dev = self._links[0]
        done = _run("tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms", check=False)
        if done.returncode != 0:
            why = done.stderr.strip()
            return f"this kernel has no netem ({why}); latency and loss stay in user space"
        _run("tc", "qdisc", "del", "dev", dev, "root", check=False)
        return None

    def cut(self, k: int) -> None:
        """Take host k's link down: nothing reaches it or leaves it until ``restore``."""
        _ip("link", "set", self._links[k], "down")

    def restore(self, k: int) -> None:
        """Bring host k's link back up."""
        _ip("link", "set", self._links[k], "up")

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for k, (name, link) in enumerate(zip(self.names, self._links, strict=True)):
                _ip("netns", "add", name)
                inner = f"{link}i"
                _ip("link", "add", link, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", name)
                _ip("link", "set", link, "master", self.bridge)
                _ip("link", "set", link, "up")
                _ip("-n", name, "addr", "add", f"{self.ip(k)}/24", "dev", inner)
                _ip("-n", name, "link", "set", inner, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove the namespaces, their links and the bridge (whatever exists of them)."""
        for name in self.names:
            _ip("netns", "del", name, check=False)
        for link in self._links:
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)
