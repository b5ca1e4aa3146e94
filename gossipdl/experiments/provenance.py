"""What produced a run: versions, source commit, host, devices and command line, for
``summary.json``."""

from __future__ import annotations

import platform
import socket
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

_GIT_TIMEOUT_S = 5.0
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def provenance(devices: Iterable[str]) -> dict[str, Any]:
    """The versions, git commit, host and command line of this process, and ``devices`` (the
    ones the peers trained on) sorted and without repeats."""
    commit, dirty = git_state(PACKAGE_DIR)
    try:
        version: str | None = metadata.version("gossipdl")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        version = None
    return {
        "gossipdl": version,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "host": socket.gethostname(),
        "devices": sorted(set(devices)),
        "command": list(sys.argv),
    }


def git_state(directory: Path) -> tuple[str | None, bool | None]:
    """The commit checked out where ``directory``'s files are tracked, and whether tracked
    files differ from it; (None, None) outside a git checkout (an installed wheel, no git)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "--no-optional-locks", "-C", str(directory), *args],
                capture_output=True,
                text=True,
                timeout=_GIT_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    # the files must be tracked: a package installed into a virtualenv inside some other
    # checkout would otherwise report that checkout's commit
    if not git("ls-files", "--error-unmatch", "--", "."):
        return None, None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    if commit is None or status is None:
        return None, None
    return commit.strip(), bool(status.strip())
