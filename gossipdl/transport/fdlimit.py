"""File descriptors: a peer's sockets, connections, checkpoints and metrics all take one.

Every TCP connection made to a peer's port holds a file descriptor until ZeroMQ drops it,
and libzmq has no cap on how many connections a listening socket accepts. A stranger's
idle connections that never greet (no key needed) used the common soft limit of 1,024 up
in 6 s; then the peer could neither write its metrics nor open a connection. Two things
bound that here: a connection that has not finished its handshake within
``HANDSHAKE_S`` (:mod:`gossipdl.transport.sockets`) is dropped, and the soft limit is
raised to the hard one, so what the system allows, not a shell's default, is the budget.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

try:
    import resource
except ImportError:  # Windows: no RLIMIT_NOFILE
    resource = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_raised = threading.Lock()  # held for good once the limit was raised: once per process
OUT_OF_FDS = "out_of_file_descriptors"  # the drop reason of a connection EMFILE refused


def raise_fd_limit() -> int | None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit, once per process; returns
    the soft limit now (None where the platform has no such limit)."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not _raised.acquire(blocking=False) or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # macOS refuses RLIM_INFINITY: keep the soft one
        log.debug("could not raise the file descriptor limit from %d to %s: %s", soft, hard, exc)
        return soft
    return hard


def out_of_fds() -> bool:
    """Whether this process cannot open one more file descriptor now (EMFILE): a ZeroMQ
    EMFILE means either that or a full context, and the two need different fixes."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    return False


def fd_limit() -> int | None:
    """This process's soft RLIMIT_NOFILE (None where the platform has none)."""
    return None if resource is None else resource.getrlimit(resource.RLIMIT_NOFILE)[0]
