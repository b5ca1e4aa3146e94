"""A launched process stops when its launcher is gone.

``gossipdl run`` stops its peers in order on Ctrl-C or SIGTERM, but a launcher killed
with SIGKILL (or by the OOM killer) cannot: its peers would train on to their last step
with nobody to collect them. The launcher names itself in :data:`LAUNCHER_PID_ENV`; a
process it started (directly, or forked from its fork server, whose parent it is not)
watches that process and, once it has ended, sends itself SIGTERM: the same clean stop
a signal to the swarm gives.
"""

from __future__ import annotations

import os
import select
import signal
import threading

from gossipdl.numerals import is_decimal

LAUNCHER_PID_ENV = "GOSSIPDL_LAUNCHER_PID"
"""The process id of the ``gossipdl run`` that started this process, if one did."""

ORPHAN_POLL_S = 1.0
"""Where the platform cannot wait on a process (no ``pidfd_open``), how often a launched
process looks for its launcher (seconds): the longest it trains on after it died."""


def stop_with_launcher(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """SIGTERM this process once the launcher named in ``environ`` has ended; whether one
    is named (a process a user started by hand outlives its shell on purpose: ``nohup``)."""
    value = environ.get(LAUNCHER_PID_ENV, "")
    if not is_decimal(value):
        return False
    threading.Thread(
        target=_wait_then_stop, args=(int(value),), name="launcher watch", daemon=True
    ).start()
    return True


def _wait_then_stop(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)  # readable once the process ends, even as a zombie
    except ProcessLookupError:
        pass  # ended already
    except (AttributeError, OSError):  # no pidfds here: poll for the process instead
        while process_exists(pid):
            threading.Event().wait(ORPHAN_POLL_S)
    else:
        select.select([fd], [], [])
        os.close(fd)
    os.kill(os.getpid(), signal.SIGTERM)


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
